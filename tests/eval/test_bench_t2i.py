"""`mmspec bench t2i`: every bad flag is a usage error before any model loads; the methods are the training-free
presets; the report (schema, same seeds, speedups from one run) on a tiny Janus folder."""

import json

import pytest

from mmspec.eval import bench_t2i
from mmspec.eval.bench import main
from mmspec.methods import PRESETS


def _refuse(*args, **kwargs):
    raise AssertionError("reached the bench run although the arguments were invalid")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/nonexistent/janus"], "argument --model: '/nonexistent/janus' is neither a folder nor a hub id"),
        (["--model", "no id"], "argument --model: 'no id' is neither a folder nor a hub id"),
        (["--model", "{tmp}"], "is not a transformers model folder (no config.json)"),
        (["--prompts", "{tmp}/missing.txt"], "argument --prompts: cannot read"),
        (["--prompts", "{empty}"], "has no prompt (one per line)"),
        (["--methods", "exact-eagle"], "argument --methods: unknown names ['exact-eagle']"),
        (["--methods", "grouped", "--temperature", "0"], "argument --temperature: 0 (greedy) does not work"),
        (["--batch-size", "3", "--num-images", "4"], "argument --batch-size: 3 does not divide --num-images 4"),
        (["--num-images", "0"], "argument --num-images: must be an integer >= 1"),
        (["--guidance-scale", "nan"], "argument --guidance-scale: guidance_scale must be in [0, 10000]"),
        (["--jacobi-window", "0"], "jacobi_window must be in [1, 1024]"),
        (["--device", "warp:0"], "argument --device"),
        (["--zoo", "{tmp}/nozoo"], "argument --zoo"),
        (["--json", "{tmp}/out.txt"], "argument --json"),
    ],
)
def test_bad_flags_are_usage_errors_before_loading(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_t2i, "run", _refuse)
    (tmp_path / "empty.txt").write_text("\n  \n")
    argv = [a.replace("{empty}", str(tmp_path / "empty.txt")).replace("{tmp}", str(tmp_path)) for a in argv]
    if "--model" not in argv:  # the checks of the other flags must not depend on the zoo's Janus being there
        (tmp_path / "janus").mkdir()
        (tmp_path / "janus" / "config.json").write_text("{}")
        argv += ["--model", str(tmp_path / "janus")]
    with pytest.raises(SystemExit) as exit_:
        main(["t2i", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err


def test_hub_ids_pass_the_checks_without_downloading(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench_t2i, "run", lambda args: seen.setdefault("model", args.model) and {})
    (tmp_path / "p.txt").write_text("a red fox\n\na cat on a mat\n")
    main(["t2i", "--model", "deepseek-ai/Janus-Pro-1B", "--prompts", str(tmp_path / "p.txt")])
    assert seen["model"] == "deepseek-ai/Janus-Pro-1B"


def test_methods_are_the_training_free_presets():
    assert {"plain", "jacobi", "grouped", "sjd", "relaxed-jacobi", "exact-jacobi"} <= set(bench_t2i.T2I_PRESETS)
    for name, preset in PRESETS.items():  # a preset that needs a trained drafter component is not offered
        needs_component = (
            preset.get("drafter") in ("model", "eagle")
            or preset["acceptance"] == "relaxed"
            and (preset.get("drafter") != "jacobi")
        )
        assert (name in bench_t2i.T2I_PRESETS) != needs_component, name


def test_read_prompts_keeps_non_empty_lines(tmp_path):
    (tmp_path / "p.txt").write_text(" a seven \n\n  \nthe digit 3\n", encoding="utf-8")
    assert bench_t2i.read_prompts(tmp_path / "p.txt") == ["a seven", "the digit 3"]
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="bad.txt"):
        bench_t2i.read_prompts(tmp_path / "bad.txt")


def _report_keys():
    return {"target_forwards_per_image", "mean_accepted_length", "step_compression", "row_step_compression",
            "latency_s", "speedup", "accuracy", "images", "syncs_per_round"}  # fmt: skip


def test_report_on_a_tiny_janus_folder(tmp_path):
    from janus_fixtures import prompts, tiny_janus, tiny_processor

    folder = tmp_path / "janus"
    tiny_janus(spread=0.1).save_pretrained(folder)
    tiny_processor().save_pretrained(folder)
    (tmp_path / "p.txt").write_text("\n".join(prompts(2)) + "\n")
    out = tmp_path / "bench.json"
    rc = main(["t2i", "--model", str(folder), "--prompts", str(tmp_path / "p.txt"), "--methods", "jacobi,sjd",
               "--num-images", "2", "--repeats", "1", "--threads", "1", "--quiet", "--json", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ["plain", "jacobi", "sjd"]  # plain first: the speedup baseline
    for m in report["methods"].values():
        assert set(m) == _report_keys()
        assert m["images"] == 2 and m["accuracy"] is None  # free prompts: no classifier
    assert report["methods"]["plain"]["speedup"] == 1.0
    assert report["methods"]["plain"]["step_compression"] == pytest.approx(1.0)  # one forward per token
    assert report["methods"]["jacobi"]["step_compression"] > 1.0
    assert report["config"]["seeds"] == [0, 1]
    assert report["config"]["method_kwargs"]["sjd"]["coupling"] is False
