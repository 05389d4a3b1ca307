"""Issue 31, command line: no flag passes the usage check and then fails after the models load.

* A walk over the argparse parsers of every command and subcommand that loads a model (`generate`, `vlm`, each
  `bench` subcommand, `eval fid | sweep`): every numeric flag refuses NaN / inf / a huge negative number, every
  integer flag also a huge number (each has an upper bound), as a usage error (exit 2) naming the flag, with the
  model loaders and the runs replaced by functions that fail the test.
* A table of the issue's examples: bounds that only the pipeline knew (MAR temperature, top-p 0, top-k past the
  vocabulary read from the zoo's config.json), sampling-only methods under greedy decoding, output paths that cannot
  be written (system folders: root passes `os.access` there, so the check creates a probe file).
"""

import argparse
import math
import os

import pytest

import mmspec.cli as cli
import mmspec.cli.generate as cli_generate
import mmspec.cli.vlm as cli_vlm
import mmspec.models
import mmspec.pipelines
from mmspec.cli.checks import check_output_file, check_output_folder
from mmspec.eval import bench, bench_ar_image, bench_continuous, bench_t2i, bench_verify, bench_vlm, fid, sweep
from mmspec.methods import CONTINUOUS_LIMITS, SAMPLING_LIMITS


def _refuse(*args, **kwargs):
    raise AssertionError("reached model loading / the run although an argument was invalid")


@pytest.fixture
def no_loading(monkeypatch, tmp_path):
    """Fail the test if a command gets past its argument checks; run in a temporary folder (default outputs)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_generate, "run", _refuse)
    monkeypatch.setattr(cli_vlm, "run", _refuse)
    for module in (bench_ar_image, bench_continuous, bench_t2i, bench_verify, bench_vlm, fid, sweep):
        monkeypatch.setattr(module, "run", _refuse)
    monkeypatch.setattr(mmspec.models, "load", _refuse)
    for name in ("SpeculativeARImagePipeline", "SpeculativeContinuousARPipeline", "SpeculativeVLMPipeline"):
        monkeypatch.setattr(getattr(mmspec.pipelines, name), "from_zoo", _refuse)


def _bench_parser(name):
    def build(parser):
        parser.add_argument("--json", default=None)
        bench._subcommand(bench.SUBCOMMANDS[name][0]).add_arguments(parser)

    return build


# argv prefix -> the function that adds the command's arguments to a parser
COMMANDS = {
    ("generate",): cli_generate.add_arguments,
    ("vlm",): cli_vlm.add_arguments,
    **{("bench", name): _bench_parser(name) for name in bench.SUBCOMMANDS},
    ("eval", "fid"): fid.add_arguments,
    ("eval", "sweep"): sweep.add_arguments,
}


def _parsed_kind(action):
    """int / float when the flag takes a number (or a comma list of numbers), else None."""
    for text in ("1", "2", "4", "16", "0.5"):
        try:
            value = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        value = value[0] if isinstance(value, list | tuple) and value else value
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return type(value)
    return None


def _numeric_flags():
    flags = []
    for prefix, add in COMMANDS.items():
        parser = argparse.ArgumentParser()
        add(parser)
        for action in parser._actions:
            if action.type is None or not action.option_strings or not callable(action.type):
                continue
            kind = _parsed_kind(action)
            if kind is not None:
                flags.append((prefix, action.option_strings[0], kind))
    return flags


NUMERIC = _numeric_flags()
BAD = {float: ["nan", "inf", "-1e30"], int: ["nan", "-1" + "0" * 30, "1" + "0" * 30]}
WALK = [(prefix, flag, bad) for prefix, flag, kind in NUMERIC for bad in BAD[kind]]


def _usage_error(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert "error:" in last and flag in last, err
    assert "Traceback" not in err
    return last


def test_the_walk_finds_the_numeric_flags():
    """The walk sees the flags of every command (a broken detection would make the walk test vacuous)."""
    found = {(prefix, flag) for prefix, flag, _ in NUMERIC}
    for expected in [(("generate",), "--top-k"), (("vlm",), "--top-p"), (("vlm",), "--temperature"),
                     (("bench", "continuous"), "--temperature"), (("bench", "continuous"), "--guidance-scale"),
                     (("eval", "fid"), "--temperature"), (("bench", "vlm"), "--tree-nodes"),
                     (("bench", "t2i"), "--top-k"), (("eval", "sweep"), "--plain-seeds")]:  # fmt: skip
        assert expected in found, expected
    assert len(NUMERIC) > 60


@pytest.mark.parametrize("prefix, flag, bad", WALK, ids=[" ".join([*p, f, b[:8]]) for p, f, b in WALK])
def test_every_numeric_flag_refuses_out_of_range_values_before_loading(prefix, flag, bad, capsys, no_loading):
    _usage_error([*prefix, flag, bad], flag, capsys)


BIG_TOP_K = str(SAMPLING_LIMITS["top_k"] + 1)
UNWRITABLE = "/proc/mmspec-no-such-folder"  # cannot be created, not even by root

# (argv, the flag the one-line error must name): the examples and the bounds only the pipelines knew
CASES = [
    # the continuous pipeline's bounds (mmspec.methods.CONTINUOUS_LIMITS)
    (["bench", "continuous", "--temperature", "1e30"], "--temperature"),
    (["bench", "continuous", "--temperature", str(CONTINUOUS_LIMITS["temperature"] * 1.01)], "--temperature"),
    (["bench", "continuous", "--guidance-scale", str(CONTINUOUS_LIMITS["guidance_scale"] + 1)], "--guidance-scale"),
    # the sampling rules (mmspec.sampling.SamplingParams) and top-k against the registry / the zoo's vocabulary
    (["vlm", "--do-sample", "--top-p", "0"], "--top-p"),
    (["vlm", "--do-sample", "--top-p", "1.5"], "--top-p"),
    (["vlm", "--do-sample", "--temperature", "-1"], "--temperature"),
    (["vlm", "--do-sample", "--top-k", BIG_TOP_K], "--top-k"),
    (["vlm", "--do-sample", "--top-k", "49153"], "--top-k"),  # the zoo VLM's vocabulary is 49152
    (["vlm", "--threads", "100000"], "--threads"),
    (["generate", "--top-k", "257"], "--top-k"),  # the zoo target's 256 codes
    (["generate", "--top-k", BIG_TOP_K], "--top-k"),
    (["bench", "ar-image", "--top-k", "257"], "--top-k"),
    (["bench", "t2i", "--top-k", "100000"], "--top-k"),  # the zoo Janus' VQ codebook
    (["bench", "vlm", "--do-sample", "--temperature", "-1"], "--temperature"),
    # sampling-only methods (GSD) are undefined under greedy decoding
    (["eval", "fid", "--temperature", "0", "--preset", "grouped"], "--temperature"),
    (["eval", "sweep", "--temperature", "0"], "--temperature"),  # the default grid has GSD points
    (["generate", "--acceptance", "grouped", "--temperature", "0"], "--temperature"),
    (["bench", "t2i", "--methods", "plain,grouped", "--temperature", "0"], "--temperature"),
    # cross-knob bounds
    (["eval", "fid", "--preset", "sjd-pac", "--jacobi-window", "1", "--jacobi-tree-depth", "4"], "--jacobi-tree"),
    # draft-length policies: chains of the draft model / EAGLE only, the cost knobs with the cost policy only
    (
        ["generate", "--acceptance", "exact", "--drafter", "eagle", "--tree-top-k", "3", "--draft-length", "cost"],
        "--draft-length",
    ),  # fmt: skip
    (["generate", "--acceptance", "jacobi", "--draft-length", "heuristic"], "--draft-length"),
    (["generate", "--acceptance", "exact", "--drafter", "model", "--draft-step-cost", "0.1"], "--draft-step-cost"),
    (["generate", "--acceptance", "exact", "--drafter", "model", "--verify-token-cost", "101"], "--verify-token"),
    (["bench", "ar-image", "--methods", "plain,exact-eagle-cost", "--tree-top-k", "2"], "--draft-length"),
    (["bench", "vlm", "--adaptive-max-tokens", "0"], "--adaptive-max-tokens"),
    # output paths that cannot be written (root passes os.access there)
    (["eval", "fid", "--out", UNWRITABLE], "--out"),
    (["eval", "fid", "--out", "{tmp}/runs", "--json", UNWRITABLE + "/r.json"], "--json"),
    (["eval", "sweep", "--out", UNWRITABLE], "--out"),
    (["generate", "--out", "/proc/mmspec-grid.png"], "--out"),
    (["vlm", "--save-image", "/proc/mmspec-canvas.png"], "--save-image"),
    (["bench", "continuous", "--json", "/proc/mmspec-report.json"], "--json"),
    (["bench", "verify", "--json", "/proc/mmspec-report.json"], "--json"),
]


@pytest.mark.parametrize("argv, flag", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_flag_fails_before_loading_not_after(argv, flag, tmp_path, capsys, no_loading):
    _usage_error([a.replace("{tmp}", str(tmp_path)) for a in argv], flag, capsys)


def test_good_values_still_pass(tmp_path, monkeypatch, capsys, no_loading):
    """The new bounds refuse only bad values: values at the bounds reach the run."""

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(bench_continuous, "run", reached)
    monkeypatch.setattr(cli_vlm, "run", reached)
    monkeypatch.setattr(cli_generate, "run", reached)
    monkeypatch.setattr(fid, "run", reached)
    top = str(CONTINUOUS_LIMITS["temperature"])
    for argv in (["bench", "continuous", "--temperature", top, "--num-images", "0", "--timing-batches", "1"],
                 ["vlm", "--do-sample", "--top-p", "1", "--top-k", "49152", "--temperature", "0.7"],
                 ["generate", "--top-k", "256"],
                 ["generate", "--acceptance", "exact", "--drafter", "model", "--draft-length", "cost",
                  "--draft-step-cost", "0", "--verify-token-cost", "100"],
                 ["eval", "fid", "--preset", "grouped", "--out", str(tmp_path / "new" / "run")]):  # fmt: skip
        with pytest.raises(Reached):
            cli.main(argv)
    assert (tmp_path / "new" / "run").is_dir()  # --out's missing parents are created up front
    assert not [p for p in (tmp_path / "new" / "run").iterdir()]  # and the write probe leaves nothing behind


def test_output_folder_probe_names_the_flag_and_path(tmp_path):
    """`check_output_folder` creates a missing folder, and refuses one that cannot be created."""
    parser = argparse.ArgumentParser(prog="x")
    check_output_folder(parser, "--out", tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    if os.path.isdir("/proc/self"):
        with pytest.raises(SystemExit):
            check_output_folder(parser, "--work-dir", UNWRITABLE)


def test_output_file_in_a_new_folder(tmp_path):
    """`check_output_file(create_folder=True)` (the eval scripts' result files) creates the missing folder, but not
    for a file name it refuses (a wrong extension)."""
    parser = argparse.ArgumentParser(prog="x")
    with pytest.raises(SystemExit):
        check_output_file(parser, "--table", tmp_path / "new" / "rows.csv", (".jsonl",), create_folder=True)
    assert not (tmp_path / "new").exists()
    check_output_file(parser, "--table", tmp_path / "new" / "rows.jsonl", (".jsonl",), create_folder=True)
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())
    with pytest.raises(SystemExit):  # without create_folder a missing folder stays a usage error
        check_output_file(parser, "--json", tmp_path / "other" / "r.json", (".json",))
    assert not (tmp_path / "other").exists()


def test_top_k_bound_is_finite():
    assert math.isfinite(SAMPLING_LIMITS["top_k"]) and SAMPLING_LIMITS["top_k"] >= 262_144
