"""`python -m mmspec.train vlm-vision` on the deployed VLM classes (issue 29): tiny random Qwen2.5-VL / Qwen3-VL
(M-RoPE, dynamic grids) and LLaVA-Next / LLaVA-OneVision (any-resolution tiles), made by the fixtures of
`test_deployed_vlms`. The trainer hands the frozen target what the pipeline hands it (the image processor's outputs,
M-RoPE positions) and the head each batch's `ImageLayout` built from the same outputs: a few steps run with finite,
moving losses and held-out metrics, the saved head loads and drafts exactly plain greedy through the pipeline, and
kill-and-resume stays bit-identical."""

import functools
import json
import math

import anyres_fixtures
import pytest
import qwen_vl_fixtures
import torch
from factories import resumed_after_kill
from vlm_fixtures import prompts

from mmspec.pipelines.vlm import SpeculativeVLMPipeline
from mmspec.train import vlm_vision as task
from mmspec.train.vlm_answers import user_turn
from mmspec.train.vlm_eagle import row_images


ROWS = 12  # 6 templated, then 6 free-form
# one policy per class: every policy on a dynamic-grid (Qwen) and on an any-resolution target
POLICIES = {"qwen2_5_vl": "vispec", "qwen3_vl": "msd", "llava_next": "specvlm", "llava_onevision": "vispec"}


@functools.cache
def deployed(kind):
    """`(target, processor, vlm-answers data)` of a tiny deployed VLM: 64 x 64 canvases (a 6 x 6 merged grid on Qwen,
    a base tile + 4 tiles on any-res), prompts as `vlm-answers` encodes them, random word answers + EOS."""
    family = qwen_vl_fixtures if kind in qwen_vl_fixtures.KINDS else anyres_fixtures
    target = family.tiny_qwen_vl(kind, seed=1) if family is qwen_vl_fixtures else family.tiny_anyres(kind, seed=1)
    for p in target.parameters():
        p.requires_grad_(False)
    processor = family.processor(kind)
    g = torch.Generator().manual_seed(0)
    data = {"canvases": torch.randint(0, 256, (ROWS, 64, 64), generator=g, dtype=torch.uint8)}
    pipe = SpeculativeVLMPipeline(target, processor)
    ids, lengths, _ = pipe.encode(row_images(data, range(ROWS)), None, [user_turn(q) for q in prompts(ROWS)], "cpu")
    seqs = []
    for r in range(ROWS):  # word tokens (ids 7..59 are words in both fixture vocabularies), then EOS (2)
        answer = torch.randint(7, 60, (int(torch.randint(5, 10, (1,), generator=g)),), generator=g).tolist()
        seqs.append(ids[r, : lengths[r]].tolist() + answer + [2])
    width = max(len(s) for s in seqs)
    data.update(input_ids=torch.tensor([s + [0] * (width - len(s)) for s in seqs]),
                lengths=torch.tensor([len(s) for s in seqs]), prompt_lengths=lengths.tolist(),
                kinds=["templated"] * (ROWS // 2) + ["detail"] * (ROWS - ROWS // 2))  # fmt: skip
    return target, processor, data


def files_for(kind, tmp_path, monkeypatch):
    import mmspec.models.hf.vlm_folder as vlm_folder

    model, processor, data = deployed(kind)
    target, path = tmp_path / "target", tmp_path / "answers.pt"
    model.config.save_pretrained(target)
    torch.save(data, path)
    monkeypatch.setattr(vlm_folder, "load_target_vlm", lambda folder, dtype=None: (model, processor))
    return {"target": str(target), "data": str(path)}


def argv(files, out, policy, *extra):
    return ["--policy", policy, "--target", files["target"], "--data", files["data"], "--out", str(out), "--steps", "4",
            "--batch-size", "2", "--checkpoint-every", "2", "--log-every", "1", "--eval-items", "1", "--unroll", "2",
            "--ce-positions", "4", "--draft-vocab", "32", "--lr", "3e-3", "--quiet", "--threads", "1", *extra]  # fmt: skip


def parse(args):
    import argparse

    parser = argparse.ArgumentParser()
    task.add_arguments(parser)
    return parser.parse_args(args)


@pytest.mark.parametrize("kind", list(POLICIES))
def test_a_few_steps_train_a_head_that_drafts_plain_greedy(kind, tmp_path, monkeypatch):
    from mmspec.drafters.vision_eagle import VisionEagleHead
    from mmspec.models import load

    policy = POLICIES[kind]
    files = files_for(kind, tmp_path, monkeypatch)
    layouts = []
    real = task.vision_kwargs

    def spy(batch, generator=None):
        layouts.append(batch.image_layout)
        return real(batch, generator)

    monkeypatch.setattr(task, "vision_kwargs", spy)
    curriculum = ["--text-steps", "1", "--ramp-steps", "2"] if policy == "msd" else []  # text-only, mixed, then images
    out = tmp_path / "out"
    head = task.run(parse(argv(files, out, policy, *curriculum)))
    model, processor, data = deployed(kind)
    # every multimodal batch's layout: each image's own length, as the processor counts it
    counts = (data["input_ids"] == model.config.image_token_id).sum(1)
    seen = [n for layout in layouts for row in layout.lengths for n in row]
    assert seen and set(seen) == {int(counts[0])}, seen
    record = json.loads((out / "training.json").read_text())
    losses = [h["loss"] for h in record["history"]]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses) and len(set(losses)) > 1, losses
    metrics = record["metrics"]
    assert all(0.0 <= metrics[f"top1_step{j}"] <= 1.0 for j in range(3)), metrics
    kept = metrics["templated_draft_image_tokens"]  # per held-out row: what the policy keeps of its one image
    assert kept == {"vispec": 1, "msd": int(counts[0])}[policy] if policy != "specvlm" else kept < int(counts[0])
    loaded = load(out)
    assert isinstance(loaded, VisionEagleHead) and loaded.config.vision_policy == policy
    assert set(loaded.state_dict()) == set(head.state_dict())
    pipe = SpeculativeVLMPipeline(model, processor, eagle_head=loaded)
    pipe.set_progress_bar_config(disable=True)
    ims, texts = row_images(data, [0, 5, 9]), prompts(3, seed=4)
    plain = pipe(images=ims, prompt=texts, max_new_tokens=12, acceptance="none", output_type="ids").sequences
    out = pipe(images=ims, prompt=texts, max_new_tokens=12, acceptance="exact", drafter="eagle", tree_depth=3,
               output_type="ids")  # fmt: skip
    assert torch.equal(out.sequences, plain)


def test_kill_and_resume_on_qwen_gives_bit_identical_weights(tmp_path, monkeypatch):
    files = files_for("qwen2_5_vl", tmp_path, monkeypatch)
    whole = task.run(parse(argv(files, tmp_path / "whole", "vispec", "--fp32-weights")))
    args = argv(files, tmp_path / "killed", "vispec", "--fp32-weights")
    resumed = resumed_after_kill(lambda: task.run(parse(args)), monkeypatch)
    for k, v in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


def eagle3_argv(files, out, *extra):
    return ["--target", files["target"], "--data", files["data"], "--out", str(out), "--steps", "3", "--batch-size",
            "2", "--checkpoint-every", "3", "--eval-items", "1", "--unroll", "2", "--draft-vocab", "32", "--aux-layers",
            "0,1", "--intermediate-size", "48", "--lr", "3e-3", "--quiet", "--threads", "1", *extra]  # fmt: skip


def test_vlm_eagle3_on_qwen_trains_at_the_targets_mrope_positions(tmp_path, monkeypatch):
    """`vlm-eagle3` on Qwen2.5-VL: the head (positions "mrope", the target's sections) is trained on the pairs at the
    target's own 3-D position ids of the rows (those its forward used), with or without `--target-cache`; the saved
    head records them and drafts exactly plain greedy."""
    from mmspec.models import load
    from mmspec.models.hf.eagle3 import Eagle3Head
    from mmspec.train import vlm_eagle3

    files = files_for("qwen2_5_vl", tmp_path, monkeypatch)
    used, fed = [], []
    outputs, unrolled = vlm_eagle3.target_outputs, Eagle3Head.forward_unrolled

    def spy_outputs(*args, **kwargs):
        got = outputs(*args, **kwargs)
        used.append(got[3])
        return got

    def spy_unrolled(self, *args, positions=None, **kwargs):
        fed.append((positions, used[-1]))
        return unrolled(self, *args, positions=positions, **kwargs)

    monkeypatch.setattr(vlm_eagle3, "target_outputs", spy_outputs)
    monkeypatch.setattr(Eagle3Head, "forward_unrolled", spy_unrolled)
    parser = __import__("argparse").ArgumentParser()
    vlm_eagle3.add_arguments(parser)
    head = vlm_eagle3.run(parser.parse_args(eagle3_argv(files, tmp_path / "out", "--fp32-weights")))
    assert len(fed) == 3 + 2  # three steps, two held-out rows
    for positions, target in fed[:3]:  # training: every pair at its first token's id in the target's forward
        assert positions.dim() == 3 and torch.equal(positions, target[..., :-1])
        assert not torch.equal(positions[1], positions[2])  # image tokens: height and width ids differ
    model, processor, data = deployed("qwen2_5_vl")
    loaded = load(tmp_path / "out")
    assert (loaded.config.positions, list(loaded.config.mrope_section)) == ("mrope", [2, 3, 3])
    assert json.loads((tmp_path / "out" / "training.json").read_text())["extra"]["positions"] == "mrope"
    cached = vlm_eagle3.run(parser.parse_args(eagle3_argv(files, tmp_path / "cached", "--fp32-weights",
                                                          "--target-cache")))  # fmt: skip
    for k, v in head.state_dict().items():
        torch.testing.assert_close(cached.state_dict()[k], v, atol=1e-3, rtol=1e-3)  # the cache holds float16
    pipe = SpeculativeVLMPipeline(model, processor, eagle_head=loaded)
    pipe.set_progress_bar_config(disable=True)
    ims, texts = row_images(data, [0, 7]), prompts(2, seed=4)
    plain = pipe(images=ims, prompt=texts, max_new_tokens=12, acceptance="none", output_type="ids").sequences
    out = pipe(images=ims, prompt=texts, max_new_tokens=12, acceptance="exact", drafter="eagle", tree_depth=3,
               output_type="ids")  # fmt: skip
    assert torch.equal(out.sequences, plain)
