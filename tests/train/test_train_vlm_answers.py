"""`vlm-answers --workload templated|free-form|both`: the target's own answers to the free-form *train* prompts,
greedy and sampled, deterministic across batch sizes, resumable and refusing another workload."""

import argparse
import functools

import pytest
import torch

from mmspec.data.vlm_prompts import split_templates
from mmspec.train import vlm_answers
from mmspec.train.common import load_checkpoint


def _args(out, *argv):
    parser = argparse.ArgumentParser()
    vlm_answers.add_arguments(parser)
    return parser.parse_args(["--out", str(out), "--num", "5", "--max-new-tokens", "2", "--threads", "1", "--quiet",
                              *argv])  # fmt: skip


def test_defaults_leave_room_for_long_answers():
    parser = argparse.ArgumentParser()
    vlm_answers.add_arguments(parser)
    args = vlm_answers.resolve_defaults(parser.parse_args(["--out", "x.pt"]))
    assert args.workload == "templated" and args.num == vlm_answers.DEFAULT_NUM and args.max_new_tokens >= 128


def test_both_workloads_greedy_and_sampled_deterministic_and_resume_refuses_another_workload(tmp_path, monkeypatch):
    from mmspec.models.hf import zoo

    # the zoo VLM loads once for the five runs below (each run loaded it: seconds apiece; inference never changes it)
    monkeypatch.setattr(zoo, "load_vlm", functools.cache(zoo.load_vlm))
    hot = ["--workload", "both", "--sampled-fraction", "1", "--temperature", "5"]
    record = vlm_answers.run(_args(tmp_path / "a.pt", *hot, "--batch-size", "5"))
    assert len(record["rows"]) == 10 and record["kinds"][:5] == ["templated"] * 5
    assert record["sampled"].tolist() == [False] * 5 + [True] * 5
    held = set(split_templates()["held-out"])
    assert all(t not in held for t in record["templates"][5:]) and "follow-up" in record["kinds"]
    tokenizer = zoo.load_vlm(vlm_answers.zoo_folder("mnist-vlm"))[1].tokenizer
    for r in range(10):  # the prompt is the conversation asked; a follow-up's holds the first answer too
        prompt = tokenizer.decode(record["rows"][r][: record["prompt_lengths"][r]])
        assert prompt.count(record["questions"][r]) >= 1
        user_turns = sum(m["role"] == "user" for m in record["messages"][r])
        assert prompt.count("<|im_start|>user") == user_turns
        if record["kinds"][r] == "follow-up":
            assert user_turns == 2 and record["messages"][r][1]["content"][0]["text"] in prompt
        assert len(record["rows"][r]) - record["prompt_lengths"][r] == 2  # 2 new tokens (no EOS that soon)

    again = vlm_answers.run(_args(tmp_path / "b.pt", *hot, "--batch-size", "3"))  # other batches: same answers
    assert again["rows"] == record["rows"] and torch.equal(again["canvases"], record["canvases"])
    greedy = vlm_answers.run(_args(tmp_path / "c.pt", "--workload", "free-form", "--sampled-fraction", "0"))
    assert greedy["questions"] == record["questions"][5:] and not greedy["sampled"].any()
    assert [r[:n] for r, n in zip(greedy["rows"], greedy["prompt_lengths"])] == [
        r[:n] for r, n in zip(record["rows"][5:], record["prompt_lengths"][5:])
    ]
    assert greedy["rows"] != record["rows"][5:]  # sampled at temperature 5: other answers

    with pytest.raises(ValueError, match="--workload free-form differs from the checkpoint's --workload both"):
        vlm_answers.run(_args(tmp_path / "a.pt", *hot, "--batch-size", "5", "--workload", "free-form"))
    assert load_checkpoint(tmp_path / "a.pt")["workload"] == "both"


def test_readout_rows_are_training_grids_with_train_templates():
    from mmspec.data import grids

    rows = vlm_answers.workload_rows("readout", 12, seed=5, sampled_fraction=0.5)
    assert rows["canvases"].shape == (12, 128, 128) and rows["sampled"] == [False] * 12
    held = set(grids.split_templates()["held-out"])
    assert set(rows["kinds"]) <= set(grids.KINDS) and len(set(rows["kinds"])) > 1
    assert all(t not in held for t in rows["templates"])
    assert all(m[0]["content"][0] == {"type": "image"} for m in rows["messages"])
    again = vlm_answers.workload_rows("readout", 12, seed=5, sampled_fraction=0.5)
    assert torch.equal(again["canvases"], rows["canvases"]) and again["questions"] == rows["questions"]


@pytest.mark.parametrize("workload", ["readout", "templated"])
def test_a_target_of_another_image_size_is_a_usage_error_before_loading(workload, tmp_path, capsys):
    import json

    from mmspec.train.__main__ import main

    folder = tmp_path / "target"
    folder.mkdir()
    size = 64 if workload == "readout" else 128  # the other workload's canvases
    (folder / "config.json").write_text(json.dumps({"vision_config": {"image_size": size}}))
    (folder / "vision_projector.safetensors").touch()  # a zoo VLM folder (`vlm_folder.check_vlm_folder`)
    with pytest.raises(SystemExit) as info:
        main(["vlm-answers", "--workload", workload, "--target", str(folder), "--out", str(tmp_path / "a.pt")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "argument --target" in err and f"{size}x{size}" in err
