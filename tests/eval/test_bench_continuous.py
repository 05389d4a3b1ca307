"""`mmspec bench continuous` end to end on a tiny random zoo next to the real classifier and reference statistics."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from mmspec.eval.bench import main as bench_main
from mmspec.models.mar.kl_vae import AutoencoderKL
from mmspec.models.mar.model import MAR


ASSETS = Path(__file__).resolve().parents[2] / "assets"


def tiny_mar(seed, dim):
    torch.manual_seed(seed)
    return MAR(seq_h=8, seq_w=8, token_embed_dim=4, encoder_embed_dim=dim, encoder_depth=1, encoder_num_heads=2,
               decoder_embed_dim=dim, decoder_depth=1, decoder_num_heads=2, class_num=10, buffer_size=2,
               diffloss_d=1, diffloss_w=16, num_sampling_steps="4")  # fmt: skip


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    tiny_mar(0, 16).save_pretrained(root / "mnist-mar")
    tiny_mar(1, 8).save_pretrained(root / "mnist-mar-draft")
    torch.manual_seed(0)
    AutoencoderKL(in_channels=1, out_channels=1, ch=8, ch_mult=(1, 2, 2), num_res_blocks=1, attn_resolutions=(),
                  resolution=32, embed_dim=4, num_groups=4).save_pretrained(root / "mnist-kl")  # fmt: skip
    shutil.copytree(ASSETS / "mnist-classifier", root / "mnist-classifier")
    (root / "reference-stats").mkdir()
    shutil.copy(ASSETS / "reference-stats" / "mnist-test-classifier.npz", root / "reference-stats")
    return root


def test_bench_continuous_writes_every_method(zoo, tmp_path):
    out = tmp_path / "bench.json"
    args = ["continuous", "--zoo", str(zoo), "--json", str(out), "--batch-size", "2,1", "--timing-batches", "1",
            "--num-images", "20", "--quality-batch-size", "10", "--num-ar-steps", "4", "--fewer-steps", "2",
            "--num-draft-tokens", "2", "--prefill-ratio", "0.25", "--threads", "1",
            "--plot", str(tmp_path / "pareto.png"), "--skip-quality", "cspd-exact"]  # fmt: skip
    assert bench_main(args) == 0
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"plain", "fewer-steps-2", "cspd-block", "cspd-exact"}
    assert isinstance(report["cpu"], str) and report["cpu"]  # the host, for reading the timings
    plain = report["methods"]["plain"]
    assert plain["speedup"] == 1.0 and plain["acceptance_rate"] is None and plain["target_calls"] == 4
    for name in ("cspd-block", "cspd-exact"):
        m = report["methods"][name]
        assert m["knobs"]["acceptance"] == "continuous" and m["knobs"]["num_draft_tokens"] == 2
        assert 0.0 <= m["acceptance_rate"] <= 1.0 and m["draft_calls"] > 0
    assert report["methods"]["cspd-block"]["target_calls"] == 3  # 1 pre-fill step + blocks of steps 1-2 and 3
    assert report["batch_sizes"] == [2, 1] and (tmp_path / "pareto.png").stat().st_size > 0
    for bs in ("2", "1"):
        assert "cspd-exact" not in report["pareto"][bs]  # not scored
        for name in ("cspd-block",):
            entry = report["pareto"][bs][name]
            assert entry["on_front"] == (not entry["dominated_by"])
    exact = report["methods"].pop("cspd-exact")
    assert exact["num_images"] == 0 and exact["fid_in_domain"] is None and exact["latency_s"] > 0
    for m in report["methods"].values():
        assert set(m["by_batch_size"]) == {"2", "1"} and m["latency_s"] == m["by_batch_size"]["2"]["latency_s"]
        assert m["num_images"] == 20 and 0.0 <= m["accuracy"] <= 1.0 and m["fid_in_domain"] > 0
        assert m["latency_s"] > 0


def test_bench_continuous_writes_the_report_before_the_plot(zoo, tmp_path, monkeypatch):
    """A plot that fails after the whole bench ran must not lose the finished JSON report."""
    from mmspec.eval import bench_continuous

    def broken_plot(*args, **kwargs):
        raise OSError("plot failed")

    monkeypatch.setattr(bench_continuous, "plot", broken_plot)
    out = tmp_path / "bench.json"
    args = ["continuous", "--zoo", str(zoo), "--json", str(out), "--timing-batches", "1", "--num-images", "2",
            "--quality-batch-size", "2", "--num-ar-steps", "2", "--fewer-steps", "1", "--verify-modes", "block",
            "--num-draft-tokens", "1", "--threads", "1", "--device", "cpu", "--plot", str(tmp_path / "p.png")]  # fmt: skip
    with pytest.raises(OSError, match="plot failed"):
        bench_main(args)
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"plain", "fewer-steps-1", "cspd-block"} and report["num_images"] == 2


def test_bench_continuous_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["continuous", "--verify-modes", "fast"])
    assert exc.value.code == 2 and "verify modes" in capsys.readouterr().err


def test_pareto_report_interpolates_the_mar_front():
    from mmspec.eval.bench_continuous import pareto_report

    def m(speed, fid):
        return {"by_batch_size": {"1": {"speedup": speed}}, "fid_in_domain": fid}

    report = {"plain": m(1.0, 2.0), "fewer-steps-32": m(2.0, 3.0), "fewer-steps-16": m(4.0, 5.0),
              "cspd-block": m(1.5, 3.0), "cspd-exact": m(3.0, 3.5)}  # fmt: skip
    out = pareto_report(report, 1)
    assert out["cspd-block"]["dominated_by"] == ["fewer-steps-32"] and not out["cspd-block"]["on_front"]
    assert out["cspd-block"]["fid_gap"] == pytest.approx(0.5)  # front at 1.5x: FID 2.5
    assert out["cspd-block"]["dominator_speed_ratio"] == pytest.approx(2.0 / 1.5)
    assert out["cspd-exact"]["on_front"] and out["cspd-exact"]["fid_gap"] == pytest.approx(-0.5)  # front at 3x: 4.0
    assert out["cspd-exact"]["dominator_speed_ratio"] is None
