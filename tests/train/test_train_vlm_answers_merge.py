"""`vlm-answers --merge`: finished answer files concatenated in order; unfinished or missing inputs refused first."""

import pytest
import torch
from factories import parse_flags

from mmspec.train import vlm_answers


def _record(rows, prompt_len, kind, fill):
    n = len(rows)
    return {
        "rows": rows, "prompt_lengths": [prompt_len] * n,
        "canvases": torch.full((n, 64, 64), fill, dtype=torch.uint8), "questions": [f"q{kind}"] * n,
        "messages": [[{"role": "user", "content": kind}]] * n, "kinds": [kind] * n, "templates": [kind] * n,
        "sampled": torch.tensor([False] * n), "run_flags": {"workload": kind}, "workload": kind,
    }  # fmt: skip


def _parse(*argv):
    return parse_flags(vlm_answers.add_arguments, *argv)


def test_merge_concatenates_rows_in_order_and_pads(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(_record([[1, 2, 3], [4, 5]], 1, "templated", 7), a)
    torch.save(_record([[6, 7, 8, 9]], 2, "detail", 9), b)
    merged = vlm_answers.merge_answers([a, b], pad=0)
    assert merged["rows"] == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert merged["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]]
    assert merged["lengths"].tolist() == [3, 2, 4]
    assert merged["prompt_lengths"] == [1, 1, 2]
    assert merged["canvases"][:, 0, 0].tolist() == [7, 7, 9]
    assert merged["kinds"] == ["templated", "templated", "detail"]
    assert merged["run_flags"] == {"merge": [{"workload": "templated"}, {"workload": "detail"}]}


def test_merge_refuses_missing_unfinished_and_out_before_loading(tmp_path, capsys):
    a, partial = tmp_path / "a.pt", tmp_path / "p.pt"
    torch.save(_record([[1, 2]], 1, "templated", 0), a)
    torch.save({"rows": [[1]], "prompt_lengths": [1]}, partial)  # a resumable chunk file, not finished
    for merge, needle in (([a, tmp_path / "none.pt"], "does not exist"), ([a, partial], "not a finished"),
                          ([a], "also --out")):  # fmt: skip
        out = a if needle == "also --out" else tmp_path / "out.pt"
        parser, args = _parse("--out", str(out), "--merge", *map(str, merge))
        with pytest.raises(SystemExit) as err:
            vlm_answers.check_args(parser, args)
        assert err.value.code == 2
        assert needle in capsys.readouterr().err
