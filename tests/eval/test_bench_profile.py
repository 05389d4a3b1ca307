"""`mmspec bench profile`: the JSON's structure and its exact invariants on the zoo (few tokens)."""

import json
from pathlib import Path

import pytest

import mmspec.pipelines.token_image as token_image
from mmspec.eval.bench import main


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    # the image pipeline only: the zoo's MAR calls take minutes on a loaded 2-core host (`bench profile` runs them)
    argv = ["profile", "--pipeline", "ar-image", "--methods", "plain,exact-eagle,jacobi",
            "--batch-size", "1,2", "--num-ar-steps", "8", "--no-compile", "--json", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_rows_and_invariants(report):
    rows = report["rows"]
    assert set(rows) == {"ar-image"}
    assert set(rows["ar-image"]) == {"plain", "exact-eagle", "jacobi"}
    for pipeline, methods in rows.items():
        for method, by_batch in methods.items():
            assert set(by_batch) == {"1", "2"}
            for b, row in by_batch.items():
                ops = row["ops_per_round"]
                assert set(ops) == {"target", "drafter", "engine", "total"}
                assert row["rounds"] > 0 and ops["target"] > 0 and ops["engine"] > 0, (pipeline, method, b)
                assert ops["total"] == pytest.approx(ops["target"] + ops["drafter"] + ops["engine"])
                assert row["ops_per_call"] >= ops["total"] * row["rounds"]  # the call holds the loop
                assert row["host_reads_per_call"] >= row["host_reads_per_round"] * row["rounds"] - 1e-9
                assert row["tau"] >= 1 and row["launch_bound_speedup"] > 0
                if method == "plain":
                    assert ops["drafter"] == 0  # no drafter, no drafter ops
                    assert row["launch_bound_speedup"] == 1.0
                else:
                    assert ops["drafter"] > 0
            first = by_batch["1"]
            assert first["compile"] is None and first["compile_reason"] == "--no-compile"
            assert first["captured_ops_per_round"] is None and first["captured_reason"] == "--no-compile"
    # plain image decoding: one target forward per image token after the prefill
    assert rows["ar-image"]["plain"]["1"]["rounds"] == 64 - 1


def test_captured_rounds_are_graph_launches_on_the_zoo():
    """`profile_captured` (the `captured_ops_per_round` column): with everything captured, a Jacobi round (SCD) and
    plain's step keep the loop's bookkeeping only in the engine (the verification is one launch), and the target's
    forward is a launch plus its eager inputs, far below the eager counts; the pipeline leaves uncompiled."""
    import torch

    from mmspec.eval.bench_profile import profile_call, profile_captured
    from mmspec.eval.zoo_runs import build

    run = build("ar-image", Path(__file__).resolve().parents[2] / "assets", "cpu", ["plain", "jacobi"])
    for method in ("plain", "jacobi"):
        with torch.no_grad():
            eager = profile_call(run, method, 1)["ops_per_round"]
            captured, reason = profile_captured(run, method, 1)
        assert reason is None and set(captured) == {"target", "drafter", "engine", "total"}
        assert captured["engine"] <= 32 < eager["engine"] - 20, (method, captured, eager)  # eager: 56 / 155
        assert captured["target"] <= 12 < eager["target"] / 10, (method, captured, eager)  # eager: 648
        assert run.pipes[method].compile_report() == {}


def test_wrappers_are_restored(report):
    """The profile wraps the loop and the target/drafter methods only for its calls."""
    from mmspec.decoding import decode

    assert token_image.decode is decode


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--pipeline", "ar-image", "--methods", "cspd"], "--methods"),  # a MAR method on the image pipeline
        (["--pipeline", "dit"], "--pipeline"),
        (["--batch-size", "0"], "--batch-size"),
        (["--zoo", "/no/such/zoo"], "--zoo"),
        (["--json", "/no/such/folder/p.json"], "--json"),
    ],
)
def test_usage_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
