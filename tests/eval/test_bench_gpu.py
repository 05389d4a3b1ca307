"""`mmspec bench gpu --smoke`: every section written with finite, positive numbers; (b)/(c) survive without
diffusers; bad command lines are usage errors before anything loads."""

import json
import math
import subprocess
import sys

import pytest

from mmspec.eval.bench import main


def _positive_numbers(tree, path="report"):
    """Every number in the costs/projection sections is finite and > 0 (None allowed only with a reason)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            _positive_numbers(v, f"{path}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            _positive_numbers(v, f"{path}[{i}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        assert math.isfinite(tree) and tree > 0, path


def _check_costs(report, archs, compiled=True):
    assert set(report["costs"]) == set(archs)
    for name in archs:
        entry = report["costs"][name]
        for key in ("impl", "param_bytes", "context", "verify_widths", "eager", "compiled", "engine_s",
                    "achieved_bandwidth", "bound_step_s", "bound_step_copy_s"):  # fmt: skip
            assert key in entry, (name, key)
        for variant in ("eager", "compiled") if compiled else ("eager",):
            t = entry[variant]
            assert t is not None, entry.get("compiled_reason")
            assert set(t) == {"plain_step_s", "verify_s", "draft_step_s"}
            widths = entry["verify_widths" if variant == "eager" else "compiled_verify_widths"]
            assert list(t["verify_s"]) == [str(w) for w in widths]
        assert set(entry["engine_s"]) == {"chain", "tree"}
        if compiled:  # counted: 0 on the CPU (no CUDA graphs to skip)
            assert entry["cudagraph_skips"] == 0
            # the chain and tree rounds with their verification captured
            assert entry["engine_compiled_s"]["chain"] > 0 and entry["engine_compiled_s"]["tree"] > 0, entry
        else:
            assert entry["engine_compiled_s"] is None and entry["engine_compiled_reason"] == "--no-compile"
        _positive_numbers({k: v for k, v in entry.items() if k not in ("bound_step_s", "compiled_reason", "cudagraph_skips",
                                                                        "engine_compiled_s", "engine_compiled_reason",
                                                                        "profile")})  # fmt: skip
        # the plain step's profile: aten ops on the CPU (kernels on CUDA), their time, the most expensive named
        for variant in ("eager", "compiled") if compiled else ("eager",):
            prof = entry["profile"][variant]
            assert prof["kernels"] >= 10 and prof["device_s"] > 0, prof
            assert prof["graph_launches"] == 0 and 0 < len(prof["top"]) <= 8, prof
            assert all(k["name"].startswith("aten::") and k["s"] > 0 for k in prof["top"]), prof
        if not compiled:
            assert entry["profile"]["compiled"] is None
        rows = report["projection"][name]
        assert set(rows) == {"eagle", "lantern", "sjd-pac", "vispec", "plain"}
        for anchor, row in rows.items():
            assert row["eager"] > 0 and math.isfinite(row["eager"]), anchor
            if compiled:
                assert row["compiled"] > 0 and math.isfinite(row["compiled"]), anchor
    for key in ("host", "device", "torch", "transformers", "cuda", "projection_model", "bandwidth"):
        assert key in report
    assert report["bandwidth"]["copy"] > 0


def test_smoke_writes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    # --no-compile keeps the test short (the compiled costs are checked below, the zoo's compile by tests/pipelines)
    assert main(["gpu", "--smoke", "--no-compile", "--archs", "smollm2-135m", "--json", str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    _check_costs(report, ["smollm2-135m"], compiled=False)
    assert report["costs"]["smollm2-135m"]["compiled"] is None
    zoo = report["zoo"]
    assert zoo["batch_sizes"] == [1, 2] and set(zoo["rows"]) == {"ar-image", "mar"}
    assert zoo["failed"] == {} and zoo["skipped"] == {} and report["partial"] is False
    for pipeline, methods in zoo["rows"].items():
        assert "plain" in methods
        for method, by_batch in methods.items():
            for b, row in by_batch.items():
                assert row["eager_s"] > 0 and row["tau"] >= 1, (pipeline, method, b)
                assert row["speedup_vs_eager_plain"] > 0
                # compiled: measured, or null with the reason
                assert row["compiled_s"] is None and row["compiled_reason"] == "--no-compile"
            assert by_batch["1"].keys() == by_batch["2"].keys()
        assert methods["plain"]["1"]["speedup_vs_eager_plain"] == 1.0


def test_costs_and_projection_survive_without_diffusers(tmp_path):
    """The device machine has no diffusers: the zoo rows are skipped with the reason, sections (b)/(c) run (LlamaGen
    through transformers' Llama with the same shapes)."""
    out = tmp_path / "gpu.json"
    code = (
        "import sys; sys.modules['diffusers'] = None\n"
        "from mmspec.eval.bench import main\n"
        f"sys.exit(main(['gpu', '--smoke', '--archs', 'llamagen-xl-c2i', '--json', {str(out)!r}, '--quiet']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    _check_costs(report, ["llamagen-xl-c2i"])
    assert "diffusers" in report["costs"]["llamagen-xl-c2i"]["impl"]
    assert report["zoo"]["rows"] == {}
    assert set(report["zoo"]["skipped"]) == {"ar-image", "mar"}
    assert all("diffusers" in reason for reason in report["zoo"]["skipped"].values())


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--device", "cpu"], "--device"),  # no --smoke: CUDA only
        (["--smoke", "--archs", "gpt-5"], "--archs"),
        (["--smoke", "--sections", "zoo,speed"], "--sections"),
        (["--smoke", "--repeats", "0"], "--repeats"),
        (["--smoke", "--eager-verify", "--compile-rng", "philox"], "--compile-rng"),
        (["--smoke", "--batch-size", "100000"], "--batch-size"),
        (["--smoke", "--zoo", "/no/such/zoo"], "--zoo"),
        (["--smoke", "--methods", "plain,warp-drive"], "--methods"),
        (["--smoke", "--json", "/no/such/folder/out.json"], "--json"),
    ],
)
def test_usage_errors_before_any_model_loads(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["gpu", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_section_past_its_budget_is_stopped_and_the_rest_recorded_as_skipped():
    """`Budget.hard` interrupts work that runs past the section's end (one long compile must not eat the next
    section), and `projection_widths` names the widths the compiled pass must measure."""
    import time

    from mmspec.eval.bench_gpu import Budget, BudgetSpent, projection_widths

    budget = Budget(0.2)
    start = time.monotonic()
    with pytest.raises(BudgetSpent):
        with budget.hard():
            while time.monotonic() - start < 10:
                sum(range(1000))
    assert time.monotonic() - start < 2 and budget.over()
    with Budget(5).hard():  # inside its budget: no signal, and the timer is cleared afterwards
        pass
    time.sleep(0.01)
    assert projection_widths((2, 4, 8, 16, 32, 64)) == [8, 32]
