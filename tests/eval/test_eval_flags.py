"""Issue 20 (evaluation): every flag of `mmspec eval fid | sweep | reference` with a bad value (negative, 0, huge,
NaN, inf, a missing file, a folder where a file is expected, a path under a file, a wrong extension, a corrupt
file, an unknown device) is a usage error before any model loads: exit 2, one line, naming the flag."""

from pathlib import Path

import numpy as np
import pytest


ROOT = Path(__file__).resolve().parents[2]
CLASSIFIER_STATS = ROOT / "assets" / "reference-stats" / "mnist-test-classifier.npz"  # 128-d, not Inception's 2048

HUGE = "1000000000"
INCEPTION = ["--metrics", "inception"]

FID = [
    (["--num-images", "-1"], "--num-images"),
    (["--num-images", "0"], "--num-images"),
    (["--num-images", "1"], "--num-images"),  # FID needs a covariance
    (["--num-images", HUGE], "--num-images"),
    (["--num-images", "nan"], "--num-images"),
    (["--shard-size", "0"], "--shard-size"),
    (["--shard-size", HUGE], "--shard-size"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", HUGE], "--batch-size"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**40)], "--seed"),
    (["--guidance-scale", "nan"], "--guidance-scale"),
    (["--guidance-scale", "inf"], "--guidance-scale"),
    (["--guidance-scale", "-1"], "--guidance-scale"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--metrics", "fid"], "--metrics"),
    (["--metrics", ""], "--metrics"),
    ([*INCEPTION, "--reference", "{tmp}/missing.npz"], "--reference"),
    ([*INCEPTION, "--reference", "{tmp}/folder"], "--reference"),
    ([*INCEPTION, "--reference", "{tmp}/file.txt"], "--reference"),
    ([*INCEPTION, "--reference", "{tmp}/corrupt.npz"], "--reference"),
    ([*INCEPTION, "--reference", str(CLASSIFIER_STATS)], "--reference"),  # 128-d stats for the Inception FID
    (["--reference", str(CLASSIFIER_STATS)], "--reference"),  # --metrics in-domain never reads it
    (["--json", "{tmp}/folder"], "--json"),
    (["--json", "{tmp}/missing/result.json"], "--json"),
    (["--json", "{tmp}/file.txt/result.json"], "--json"),
    (["--json", "{tmp}/result.txt"], "--json"),
    (["--out", "{tmp}/file.txt"], "--out"),
    (["--out", "{tmp}/file.txt/run"], "--out"),
    (["--device", "nope"], "--device"),
    (["--device", "cuda:99"], "--device"),
    (["--pipeline", "{tmp}/missing"], "--pipeline"),
    (["--pipeline", "{tmp}/file.txt"], "--pipeline"),
    (["--pipeline", "{tmp}/folder"], "--pipeline"),  # no model_index.json
    (["--zoo", "{tmp}/missing"], "--zoo"),
    (["--zoo", "{tmp}/folder"], "--zoo"),
    (["--preset", "nope"], "--preset"),
    (["--group-size", "0"], "--group-size"),
]

SWEEP = [
    (["--num-images", "0"], "--num-images"),
    (["--num-images", "1"], "--num-images"),
    (["--num-images", HUGE], "--num-images"),
    (["--num-images", "nan"], "--num-images"),
    (["--plain-seeds", "0"], "--plain-seeds"),
    (["--plain-seeds", HUGE], "--plain-seeds"),
    (["--seed", "-1"], "--seed"),
    (["--speed-images", "-1"], "--speed-images"),
    (["--speed-images", HUGE], "--speed-images"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", HUGE], "--batch-size"),
    (["--shard-size", "0"], "--shard-size"),
    (["--shard-size", HUGE], "--shard-size"),
    (["--guidance-scale", "nan"], "--guidance-scale"),
    (["--guidance-scale", "inf"], "--guidance-scale"),
    (["--guidance-scale", "-1"], "--guidance-scale"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--metrics", "fid"], "--metrics"),
    (["--out", "{tmp}/file.txt"], "--out"),
    (["--out", "{tmp}/file.txt/sweep"], "--out"),
    (["--table", "{tmp}/folder"], "--table"),
    (["--table", "{tmp}/table.txt"], "--table"),
    (["--table", "{tmp}/file.txt/t.jsonl"], "--table"),
    (["--table", "{tmp}/garbage.jsonl"], "--table"),  # an existing table that is not JSONL
    (["--markdown", "{tmp}/table.txt"], "--markdown"),
    (["--markdown", "{tmp}/folder"], "--markdown"),
    (["--plot", "{tmp}/plot.txt"], "--plot"),
    (["--plot", "{tmp}/file.txt/plot.png"], "--plot"),
    (["--threads", "0"], "--threads"),
    (["--threads", HUGE], "--threads"),
    (["--device", "nope"], "--device"),
    (["--device", "cuda:99"], "--device"),
    (["--zoo", "{tmp}/missing"], "--zoo"),
    (["--grid", "{tmp}/missing.json"], "--grid"),
    (["--grid", "{tmp}/folder"], "--grid"),
    (["--grid", "{tmp}/garbage.jsonl"], "--grid"),
    (["--grid", "{tmp}/plain.json"], "--grid"),  # a point named like the baseline rows
]

REFERENCE = [
    (["--features", "nope"], "--features"),
    (["--features", ""], "--features"),
    (["--split", "nope"], "--split"),
    (["--out", "{tmp}/file.txt"], "--out"),
    (["--out", "{tmp}/file.txt/stats"], "--out"),
    (["--out", "{tmp}/clash"], "--out"),  # the statistics file's name is a folder there
    (["--work-dir", "{tmp}/file.txt"], "--work-dir"),
    (["--work-dir", "{tmp}/file.txt/chunks"], "--work-dir"),
    (["--zoo", "{tmp}/missing"], "--zoo"),
    (["--dtype", "int8"], "--dtype"),
]


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default run folders (runs/...) land here, never in the repository
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.txt").write_text("not a folder")
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04 truncated")
    (tmp_path / "garbage.jsonl").write_text("{not json\n")
    (tmp_path / "plain.json").write_text('[{"name": "plain", "preset": "jacobi"}]')
    (tmp_path / "clash" / "mnist-test-classifier.npz").mkdir(parents=True)
    (tmp_path / "clash" / "mnist-test-inception.npz").mkdir(parents=True)
    return tmp_path


def _usage_error(main, argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert exc.value.code == 2, err
    assert len(errors) == 1 and flag in errors[0], err  # one line, naming the flag
    return errors[0]


def _fill(argv, tmp):
    return [a.replace("{tmp}", str(tmp)) for a in argv]


@pytest.mark.parametrize("argv, flag", FID, ids=[" ".join(a) for a, _ in FID])
def test_eval_fid_bad_flags_are_usage_errors_before_loading(argv, flag, tmp, capsys, monkeypatch):
    from mmspec.eval import fid

    monkeypatch.setattr(fid, "run", lambda args: pytest.fail("sampling started despite a bad flag"))
    _usage_error(fid.main, _fill(argv, tmp), flag, capsys)


@pytest.mark.parametrize("argv, flag", SWEEP, ids=[" ".join(a) for a, _ in SWEEP])
def test_eval_sweep_bad_flags_are_usage_errors_before_loading(argv, flag, tmp, capsys, monkeypatch):
    from mmspec.eval import sweep

    monkeypatch.setattr(sweep, "run", lambda args: pytest.fail("the sweep started despite a bad flag"))
    _usage_error(sweep.main, _fill(argv, tmp), flag, capsys)


@pytest.mark.parametrize("argv, flag", REFERENCE, ids=[" ".join(a) for a, _ in REFERENCE])
def test_eval_reference_bad_flags_are_usage_errors_before_loading(argv, flag, tmp, capsys, monkeypatch):
    from mmspec.eval import reference

    monkeypatch.setattr(
        reference, "make_reference", lambda *a, **k: pytest.fail("features computed despite a bad flag")
    )
    argv = _fill(argv, tmp)
    if "--out" not in argv:
        argv += ["--out", str(tmp / "stats")]
    if "--work-dir" not in argv:
        argv += ["--work-dir", str(tmp / "work")]
    _usage_error(reference.main, argv, flag, capsys)


def test_good_flags_pass_the_checks(tmp, monkeypatch):
    """The checks refuse only bad values: the defaults and a full set of good flags reach `run`."""
    from mmspec.eval import fid, reference, sweep

    reached = []
    monkeypatch.setattr(fid, "run", lambda args: reached.append(("fid", args.num_images, args.metrics)))
    monkeypatch.setattr(sweep, "run", lambda args: reached.append(("sweep", args.plain_seeds)) or [])
    monkeypatch.setattr(sweep, "markdown_table", lambda rows: "")
    monkeypatch.setattr(
        reference, "make_reference", lambda *a, **k: reached.append(("reference", a[0])) or CLASSIFIER_STATS
    )
    assert fid.main([]) == 0
    np.savez(tmp / "ref.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    assert fid.main(["--metrics", "in-domain,inception", "--reference", str(tmp / "ref.npz"), "--num-images", "2",
                     "--json", str(tmp / "r.json"), "--out", str(tmp / "new" / "run"), "--device", "cpu"]) == 0  # fmt: skip
    assert sweep.main(["--out", str(tmp / "new" / "sweep"), "--plot", str(tmp / "p.pdf")]) == 0
    assert reference.main(["--features", "in-domain", "--out", str(tmp / "s"), "--work-dir", str(tmp / "w")]) == 0
    assert reached == [("fid", 1000, ["in-domain"]), ("fid", 2, ["in-domain", "inception"]), ("sweep", 4),
                       ("reference", "in-domain")]  # fmt: skip
