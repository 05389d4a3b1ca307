"""Your own VLM end to end through the CLIs (issue 29: "train a drafter for your VLM, prove it lossless, then serve
it"): a tiny random Qwen2.5-VL saved as a transformers folder (weights, tokenizer, image processor, chat template;
its video processor cannot load here, so `vlm_folder.load_processor` rebuilds it for images), a `--prompts` JSON Lines
file of images of different sizes, `python -m mmspec.train vlm-answers --target FOLDER --prompts FILE` (the target's
own greedy answers, resumable, refusing changed images), `vlm-eagle3` and `vlm-draft --target FOLDER` on them, a
head and a draft LM that draft exactly plain greedy on a ragged batch, and `mmspec export eagle3 --target FOLDER`.
Bad inputs are usage errors naming the file and line, before any model loads."""

import json

import PIL.Image
import pytest
import qwen_vl_fixtures
import torch
from own_vlm_fixtures import SIZES, save_own_vlm, usage_error

from mmspec.train.__main__ import main as train


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """`(folder, prompts file, model)`: `own_vlm_fixtures.save_own_vlm`."""
    return save_own_vlm(tmp_path_factory.mktemp("own-vlm"))


def _answers(own, out, *extra):
    folder, prompts, _ = own
    train(["vlm-answers", "--target", str(folder), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens",
           "6", "--batch-size", "2", "--threads", "1", "--quiet", *extra])  # fmt: skip
    return torch.load(out, weights_only=True)


def test_the_target_loads_from_its_folder_with_an_images_only_processor(own):
    from mmspec.models.hf.vlm_folder import TRANSFORMERS, check_vlm_folder, load_target_vlm

    folder, _, model = own
    assert check_vlm_folder(folder) == TRANSFORMERS
    loaded, processor = load_target_vlm(folder)
    assert type(loaded) is type(model) and processor.video_processor is None
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    image = PIL.Image.open(folder.parent / "images" / "2.png")
    ours = processor(images=[image], text=["<|vision_start|><|image_pad|><|vision_end|> w1"], return_tensors="pt")
    ref = qwen_vl_fixtures.processor("qwen2_5_vl")(images=[image], text=["<|vision_start|><|image_pad|><|vision_end|> w1"],
                                                   return_tensors="pt")  # fmt: skip
    assert ours["input_ids"].tolist() == ref["input_ids"].tolist()
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert ours["image_grid_thw"].tolist() == [[1, 8, 8]]  # 32 x 32 px: 8 x 8 patches of 4 px (16 tokens, merged)


def test_answers_eagle3_head_drafts_plain_greedy_and_exports(own, tmp_path, monkeypatch):
    from mmspec.data.prompt_file import read_prompt_file
    from mmspec.models import load
    from mmspec.models.hf.vlm_folder import load_target_vlm
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline
    from mmspec.train.vlm_eagle import row_images

    folder, prompts, _ = own
    whole = _answers(own, tmp_path / "whole.pt")
    real_save, saved = torch.save, []

    def killed_after_first_chunk(obj, path, *a, **k):  # killed while it saves its second chunk
        saved.append(path)
        if len(saved) == 2:
            raise KeyboardInterrupt
        real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", killed_after_first_chunk)
    with pytest.raises(KeyboardInterrupt):
        _answers(own, tmp_path / "answers.pt")
    monkeypatch.setattr(torch, "save", real_save)
    assert len(torch.load(tmp_path / "answers.pt", weights_only=True)["rows"]) == 2  # one chunk of --batch-size 2
    record = _answers(own, tmp_path / "answers.pt")  # resumed after it
    assert record["rows"] == whole["rows"] and record["image_sha256"] == whole["image_sha256"]
    rows = read_prompt_file(prompts)
    assert record["workload"] == "file" and len(record["rows"]) == 5 and "canvases" not in record
    assert record["image_files"][1] == [str((prompts.parent / "images" / f"{i}.png").resolve()) for i in (1, 2)]
    assert record["image_files"][3] == []
    model, processor = load_target_vlm(folder)
    pipe = SpeculativeVLMPipeline(model, processor)
    pipe.set_progress_bar_config(disable=True)
    for r, row in enumerate(rows):  # each row is the target's own greedy answer to its line
        images = row_images(record, [r]) or None
        out = pipe(images=images, messages=[row.messages], max_new_tokens=6, acceptance="none", output_type="ids")
        answer = [t for t in out.sequences[0].tolist() if t >= 0]
        assert record["rows"][r][record["prompt_lengths"][r] :] == answer

    head_dir = tmp_path / "head"
    train(["vlm-eagle3", "--target", str(folder), "--data", str(tmp_path / "answers.pt"), "--out", str(head_dir),
           "--aux-layers", "0,2,3", "--steps", "3", "--batch-size", "2", "--eval-items", "1", "--unroll", "2",
           "--draft-vocab", "32",
           "--log-every", "1", "--checkpoint-every", "3", "--threads", "1", "--quiet"])  # fmt: skip
    head = load(head_dir)
    assert head.config.positions == "mrope"  # an M-RoPE target: the head sits at the target's own positions
    assert "Qwen2_5_VLForConditionalGeneration" in (head_dir / "README.md").read_text()
    spec = SpeculativeVLMPipeline(model, processor, eagle_head=head)
    spec.set_progress_bar_config(disable=True)
    picked = [0, 1, 4]  # a ragged batch: one image of 16 x 24, two images, one of 24 x 24
    images = row_images(record, picked)
    chats = [rows[r].messages for r in picked]
    kw = dict(images=images, messages=chats, max_new_tokens=10, output_type="ids")
    plain = pipe(acceptance="none", **kw).sequences
    for knobs in (dict(tree_depth=3, tree_top_k=1), dict(tree_depth=3, tree_top_k=2, tree_nodes=6)):
        drafted = spec(acceptance="greedy", drafter="eagle", **knobs, **kw)
        assert torch.equal(drafted.sequences, plain), knobs

    draft_dir = tmp_path / "draft"  # the target's first 2 layers, the second distilled
    train(["vlm-draft", "--target", str(folder), "--data", str(tmp_path / "answers.pt"), "--out", str(draft_dir),
           "--num-layers", "2", "--train-layers", "1", "--steps", "3", "--batch-size", "2", "--eval-items", "1",
           "--log-every", "1", "--checkpoint-every", "3", "--threads", "1", "--quiet"])  # fmt: skip
    from mmspec.models.hf.draft import load_vlm_draft

    draft = load_vlm_draft(draft_dir, model)
    assert "Qwen2_5_VLForConditionalGeneration cut to 2 layers" in (draft_dir / "README.md").read_text()
    with_draft = SpeculativeVLMPipeline(model, processor, draft_model=draft)
    with_draft.set_progress_bar_config(disable=True)
    for knobs in (dict(num_draft_tokens=3), dict(tree_depth=3, tree_top_k=2, tree_nodes=6)):
        drafted = with_draft(acceptance="greedy", drafter="model", **knobs, **kw)
        assert torch.equal(drafted.sequences, plain), knobs

    from mmspec.cli.export import main as export

    out = tmp_path / "vllm"
    assert export(["eagle3", str(head_dir), "--target", str(folder), "--format", "vllm", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["target_hidden_size"] == model.config.get_text_config().hidden_size


def test_a_changed_image_refuses_a_resume(own, tmp_path, capsys):
    import shutil

    folder, prompts, _ = own
    shutil.copytree(prompts.parent / "images", tmp_path / "images")
    copy = tmp_path / "prompts.jsonl"
    copy.write_text("\n".join(prompts.read_text().splitlines()[:3]))
    argv = ["vlm-answers", "--target", str(folder), "--prompts", str(copy), "--out", str(tmp_path / "a.pt"),
            "--max-new-tokens", "2", "--threads", "1", "--quiet"]  # fmt: skip
    train(argv)
    train(argv)  # finished: a rerun with the same file and images is accepted
    qwen_vl_fixtures.images([SIZES[1]], seed=99)[0].save(tmp_path / "images" / "1.png")  # same name, other pixels
    err = usage_error(train, argv, capsys)
    assert "cannot resume" in err and "the input of --prompts" in err, err
    with pytest.raises(ValueError, match="1.png' changed since its answers were made"):  # checked before training
        train(["vlm-eagle3", "--target", str(folder), "--data", str(tmp_path / "a.pt"), "--out", str(tmp_path / "h"),
               "--aux-layers", "0,2,3", "--steps", "1", "--threads", "1", "--quiet"])  # fmt: skip
    assert not (tmp_path / "h" / "checkpoint.pt").exists()


def test_sampled_answers_are_drawn_per_row_and_repeat(own, tmp_path):
    from mmspec.data.prompt_file import read_prompt_file

    folder, prompts, _ = own
    greedy = _answers(own, tmp_path / "greedy.pt")
    assert not greedy["sampled"].any()  # the default: greedy
    hot = ["--sampled-fraction", "1", "--temperature", "50"]
    sampled = _answers(own, tmp_path / "hot.pt", *hot)
    again = _answers(own, tmp_path / "hot-b1.pt", *hot, "--batch-size", "1")  # other batches: the same draws
    assert sampled["sampled"].all() and sampled["rows"] == again["rows"]
    assert sampled["rows"] != greedy["rows"]
    assert all(s[:n] == g[:n] for s, g, n in zip(sampled["rows"], greedy["rows"], greedy["prompt_lengths"]))
    assert len(sampled["rows"]) == len(read_prompt_file(prompts))


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"image": "images/none.png", "prompt": "w1"}', "images/none.png' does not exist"),
        ('{"image": "prompts.jsonl", "prompt": "w1"}', "is not a readable image"),
        ('{"image": "images/0.png"}', "exactly one of 'prompt' and 'messages'"),
        ('{"image": "images/0.png", "prompt": "w1", "answer": "w2"}', "unknown key(s) ['answer']"),
        ('{"images": ["images/0.png"], "messages": [{"role": "user", "content": "w1"}]}', "0 image item(s) for 1"),
        ('{"prompt": "w1"', "not a JSON object"),
    ],
)
def test_a_bad_prompts_line_is_a_usage_error_naming_file_and_line(own, tmp_path, capsys, line, needle, monkeypatch):
    from mmspec.models.hf import vlm_folder

    folder, prompts, _ = own
    bad = prompts.parent / f"bad-{abs(hash(line))}.jsonl"
    bad.write_text(prompts.read_text().splitlines()[0] + "\n\n" + line + "\n")
    monkeypatch.setattr(vlm_folder, "load_target_vlm", None)  # nothing may load
    err = usage_error(train, ["vlm-answers", "--target", str(folder), "--prompts", str(bad), "--out",
                        str(tmp_path / "a.pt")], capsys)  # fmt: skip
    assert "argument --prompts" in err and f"{bad}:3" in err and needle in err, err


def test_targets_and_flags_that_cannot_work_are_usage_errors_before_loading(own, tmp_path, capsys, monkeypatch):
    from mmspec.models.hf import vlm_folder

    folder, prompts, _ = own
    monkeypatch.setattr(vlm_folder, "load_target_vlm", None)
    out = str(tmp_path / "a.pt")
    err = usage_error(train, ["vlm-answers", "--target", str(folder), "--prompts", str(prompts), "--workload", "templated",
                        "--out", out], capsys)  # fmt: skip
    assert "argument --prompts: not allowed with --workload" in err
    err = usage_error(train, ["vlm-answers", "--target", str(folder), "--out", out], capsys)
    assert "argument --target" in err and "--prompts FILE" in err  # MNIST canvases are the zoo's workload
    text_only = tmp_path / "llama"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for task in ("vlm-eagle3", "vlm-eagle", "vlm-vision", "vlm-draft"):
        policy = ["--policy", "vispec"] if task == "vlm-vision" else []
        err = usage_error(train, [task, "--target", str(text_only), "--data", str(prompts), "--out", str(tmp_path / task),
                            *policy], capsys)  # fmt: skip
        assert "argument --target" in err and "'llama' is not a vision-language model" in err, task
    err = usage_error(train, ["vlm-eagle3", "--target", str(folder), "--data", str(prompts), "--out", str(tmp_path / "h")],
                       capsys)  # fmt: skip
    assert "argument --aux-layers: 2,2,1 (the default (2, L // 2, L - 3) for L = 4)" in err, err


def test_answers_read_the_prompts_file_once_per_check_and_once_per_run(own, tmp_path, monkeypatch):
    """`vlm-answers --prompts`: the usage check reads the file once and the run once, and the run's flags record the
    read whose rows it answers (was: three reads a run, four on a resume, so a file edited between them could be
    answered under another file's record)."""
    import pathlib

    _, prompts, _ = own
    reads = []
    for name in ("read_bytes", "read_text"):
        real = getattr(pathlib.Path, name)

        def counted(self, *a, _real=real, _name=name, **k):
            if self == prompts:
                reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(pathlib.Path, name, counted)
    _answers(own, tmp_path / "answers.pt")
    assert len(reads) == 2
    reads.clear()
    _answers(own, tmp_path / "answers.pt")  # a finished file: checked against its flags, then resumed (nothing left)
    assert len(reads) == 2
