"""Sharded, resumable FID sampling (`mmspec.eval.fid_sampling`) and the `mmspec eval fid` script on tiny models."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from mmspec.eval import fid
from mmspec.eval.fid_sampling import load_shards, missing_shards, sample_shards, shard_path
from mmspec.models.llamagen.eagle import EagleHead
from mmspec.models.llamagen.gpt import LlamaGenGPT
from mmspec.models.llamagen.vq import LlamaGenVQ
from mmspec.pipelines import SpeculativeARImagePipeline


V, GRID, CLASSES = 16, 4, 4


def tiny_pipe():
    g = torch.Generator().manual_seed(0)
    target = LlamaGenGPT(vocab_size=V, dim=32, n_layer=2, n_head=2, num_classes=CLASSES, block_size=GRID**2,
                         multiple_of=8, initializer_range=0.3).init_weights(g, zero_output=False).eval()  # fmt: skip
    head = EagleHead.from_target(target, initializer_range=0.3).init_weights(torch.Generator().manual_seed(2)).eval()
    vq = LlamaGenVQ(codebook_size=V, codebook_embed_dim=4, ch=8, ch_mult=(1, 2, 2), z_channels=8, in_channels=1,
                    num_res_blocks=1, norm_num_groups=4).eval()  # fmt: skip
    pipe = SpeculativeARImagePipeline(target, vq, eagle_head=head)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fid") / "pipe"
    tiny_pipe().save_pretrained(folder)
    return folder


METHOD = dict(acceptance="exact", drafter="eagle", guidance_scale=2.0)


def test_images_do_not_depend_on_shards_batches_or_ranks(tmp_path):
    pipe = tiny_pipe()
    sample_shards(pipe, tmp_path / "a", num_images=10, shard_size=4, batch_size=3, call_kwargs=METHOD, progress=False)
    for rank in (1, 0):  # two "ranks" of a world of 2, the second one first
        sample_shards(pipe, tmp_path / "b", num_images=10, shard_size=5, batch_size=5, call_kwargs=METHOD,
                      rank=rank, world_size=2, progress=False)  # fmt: skip
    a, la = load_shards(tmp_path / "a", 10, 4)
    b, lb = load_shards(tmp_path / "b", 10, 5)
    assert a.shape == (10, 16, 16, 1) and a.dtype == np.uint8
    assert np.array_equal(a, b) and np.array_equal(la, lb) and la.tolist() == [i % CLASSES for i in range(10)]
    assert len({a[i].tobytes() for i in range(10)}) == 10  # every image its own


def test_other_settings_in_the_same_folder_are_refused(tmp_path):
    pipe = tiny_pipe()
    sample_shards(pipe, tmp_path, num_images=4, shard_size=4, call_kwargs=METHOD, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        sample_shards(pipe, tmp_path, num_images=4, shard_size=4, call_kwargs=dict(METHOD, guidance_scale=3.0),
                      progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="shard_size"):
        sample_shards(pipe, tmp_path, num_images=4, shard_size=0, progress=False)


def test_killed_run_resumes_without_redoing_finished_shards(tmp_path, pipe_dir):
    """Kill a sampling run once its first shard is on disk; the rerun writes only the missing shards and ends with
    exactly the images of an uninterrupted run."""
    out = tmp_path / "run"
    code = (
        "import sys; from mmspec.pipelines import SpeculativeARImagePipeline as P; "
        "from mmspec.eval.fid_sampling import sample_shards; "
        f"p = P.from_pretrained({str(pipe_dir)!r}); p.set_progress_bar_config(disable=True); "
        f"sample_shards(p, {str(out)!r}, num_images=40, shard_size=2, batch_size=2, call_kwargs={METHOD!r}, "
        "progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 120
    while not shard_path(out, 0).is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    done_before = {s: shard_path(out, s).stat().st_mtime_ns for s in range(20) if shard_path(out, s).is_file()}
    missing = missing_shards(out, 40, 2)
    assert done_before and missing, "the kill should land between the first and the last shard"
    assert not list(out.glob("*.tmp*"))  # atomic writes: no partial shard left behind
    loaded = SpeculativeARImagePipeline.from_pretrained(pipe_dir)
    loaded.set_progress_bar_config(disable=True)
    written = sample_shards(loaded, out, num_images=40, shard_size=2, batch_size=2, call_kwargs=METHOD,
                            progress=False)  # fmt: skip
    assert written == missing
    assert all(shard_path(out, s).stat().st_mtime_ns == t for s, t in done_before.items())
    resumed, _ = load_shards(out, 40, 2)
    sample_shards(loaded, tmp_path / "whole", num_images=40, shard_size=2, batch_size=2, call_kwargs=METHOD,
                  progress=False)  # fmt: skip
    assert np.array_equal(resumed, load_shards(tmp_path / "whole", 40, 2)[0])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sampling"]["call_kwargs"] == METHOD


def _tiny_32px_pipe_dir(folder):
    """A tiny random pipeline whose images are 32x32 (8x8 tokens), the zoo classifier's input size."""
    g = torch.Generator().manual_seed(0)
    target = LlamaGenGPT(vocab_size=V, dim=32, n_layer=1, n_head=2, num_classes=10, block_size=64, multiple_of=8,
                         initializer_range=0.3).init_weights(g, zero_output=False).eval()  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the VQ's own init draws from the global RNG
        vq = LlamaGenVQ(codebook_size=V, codebook_embed_dim=4, ch=8, ch_mult=(1, 2, 2), z_channels=8, in_channels=1,
                        num_res_blocks=1, norm_num_groups=4).eval()  # fmt: skip
    SpeculativeARImagePipeline(target, vq).save_pretrained(folder)
    return folder


def _fid_cmd(*args):
    return ["-m", "mmspec.eval.fid", "--zoo", str(ZOO), "--num-images", "12", "--shard-size", "3",
            "--batch-size", "3", "--preset", "jacobi", "--quiet", *args]  # fmt: skip


ZOO = __import__("pathlib").Path(__file__).resolve().parents[2] / "assets"


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_rank(tmp_path):
    """`torchrun --nproc-per-node 2` (gloo on CPU): every image sampled exactly once, and the same images and
    metrics as one process."""
    pipe = _tiny_32px_pipe_dir(tmp_path / "pipe")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the one-process run in this process (its command line is the same; `python -m` runs are the ranks below)
    assert fid.main(_fid_cmd("--pipeline", str(pipe), "--out", str(tmp_path / "one"))[2:]) == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29531"]
    two = subprocess.run([*torchrun, *_fid_cmd("--pipeline", str(pipe), "--out", str(tmp_path / "two"))],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert two.returncode == 0, two.stderr[-2000:]
    a, la = load_shards(tmp_path / "one", 12, 3)
    b, lb = load_shards(tmp_path / "two", 12, 3)
    assert np.array_equal(a, b) and np.array_equal(la, lb)
    r1 = json.loads((tmp_path / "one" / "result.json").read_text())
    r2 = json.loads((tmp_path / "two" / "result.json").read_text())
    assert r2["world_size"] == 2 and r1["world_size"] == 1
    assert r1["metrics"] == r2["metrics"]
    assert r1["metrics"]["in_domain"]["num_samples"] == 12 and r1["metrics"]["in_domain"]["fid"] > 0


def test_bad_flags_are_usage_errors_before_loading(tmp_path, monkeypatch, capsys):
    # in this process (the `python -m mmspec.eval.fid` entry point runs in the torchrun test): nothing may load
    monkeypatch.setattr(fid, "run", lambda args: pytest.fail("a model was loaded"))
    for args in (["--metrics", "foo"], ["--num-images", "0"], ["--pipeline", str(tmp_path / "nope")],
                 ["--reference", str(tmp_path / "nope.npz")]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            fid.main(_fid_cmd(*args)[2:])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and args[0] in err, (args, err[-500:])
