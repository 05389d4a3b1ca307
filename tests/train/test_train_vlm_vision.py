"""`python -m mmspec.train vlm-vision` (online distillation of the vision-aware EAGLE heads, issue 19) on a tiny random
LLaVA: the teacher's online features are the target's own, text-only samples carry no image, MSD's curriculum is
exact at its knots, a run writes a loadable head with per-depth held-out metrics, kill-and-resume is bit-identical,
a changed flag on resume is refused naming it, bad flags are usage errors before anything loads."""

import json

import pytest
import torch
from vlm_fixtures import IMAGE_TOKENS, chat, prompts, tiny_llava, tiny_processor

from mmspec.train import __main__ as train_main
from mmspec.train import common
from mmspec.train import vlm_vision as task


ROWS = 16  # 8 templated, then 8 free-form


def _tiny_data(processor, rows=ROWS, seed=0):
    """A `vlm-answers` file for the tiny LLaVA: prompts with the expanded image span, random word answers + EOS."""
    g = torch.Generator().manual_seed(seed)
    seqs, prompt_lengths = [], []
    for text in prompts(rows, seed=seed):
        chat_text = processor.apply_chat_template(chat(text), add_generation_prompt=True, tokenize=False)
        ids = processor.tokenizer(chat_text.replace("<image>", "<image>" * IMAGE_TOKENS))["input_ids"]
        answer = torch.randint(4, 60, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist()
        seqs.append(ids + answer + [2])
        prompt_lengths.append(len(ids))
    width = max(len(s) for s in seqs)
    return {
        "input_ids": torch.tensor([s + [0] * (width - len(s)) for s in seqs]),
        "lengths": torch.tensor([len(s) for s in seqs]),
        "prompt_lengths": prompt_lengths,
        "canvases": torch.randint(0, 256, (rows, 64, 64), generator=g, dtype=torch.uint8),
        "kinds": ["templated"] * (rows // 2) + ["detail"] * (rows - rows // 2),
    }


@pytest.fixture(scope="module")
def tiny():
    model, processor = tiny_llava(2, seed=3), tiny_processor()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, processor, _tiny_data(processor)


@pytest.fixture
def files(tmp_path, tiny, monkeypatch):
    """A target folder (config.json) and a data file on disk; `load_target_vlm` gives the tiny LLaVA."""
    model, processor, data = tiny
    target = tmp_path / "target"
    model.config.save_pretrained(target)
    path = tmp_path / "answers.pt"
    torch.save(data, path)
    import mmspec.models.hf.vlm_folder as vlm_folder

    monkeypatch.setattr(vlm_folder, "load_target_vlm", lambda folder, dtype=None: (model, processor))
    return {"target": str(target), "data": str(path)}


def _argv(files, out, *extra, policy="vispec"):
    return ["vlm-vision", "--policy", policy, "--target", files["target"], "--data", files["data"], "--out", str(out),
            "--steps", "4", "--batch-size", "2", "--checkpoint-every", "2", "--eval-items", "2", "--unroll", "2",
            "--ce-positions", "4", "--draft-vocab", "32", "--quiet", "--threads", "1", *extra]  # fmt: skip


def _parse(argv):
    import argparse

    parser = argparse.ArgumentParser()
    task.add_arguments(parser)
    return parser.parse_args(argv[1:])


# ----------------------------------------------------------------------------- the teacher


def _pixels(processor, data, rows):
    from mmspec.data.canvases import to_pil

    ims = [to_pil(data["canvases"][r].float() / 255) for r in rows]
    return processor.image_processor(ims, return_tensors="pt")["pixel_values"]


def test_online_teacher_features_equal_the_target_recomputed_row_by_row(tiny):
    model, processor, data = tiny
    idx, multimodal = torch.tensor([3, 9, 0, 12]), torch.tensor([True, False, True, True])
    batch = task.teacher_batch(model, processor, data, idx, multimodal)
    image_id = model.config.image_token_id
    for b, (r, mm) in enumerate(zip(idx.tolist(), multimodal.tolist())):
        n = int(batch.lengths[b])
        ids = batch.ids[b : b + 1, :n]
        pixels = _pixels(processor, data, [r]) if mm else None
        with torch.no_grad():
            ref = model.model(input_ids=ids, pixel_values=pixels).last_hidden_state[0]
            embeds = model.get_input_embeddings()(ids)[0]
            if mm:
                feats = model.model.get_image_features(pixel_values=pixels).pooler_output  # projector outputs
                embeds[ids[0] == image_id] = torch.cat(list(feats))
        torch.testing.assert_close(batch.hidden[b, :n], ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(batch.inputs_embeds[b, :n], embeds, atol=1e-6, rtol=1e-5)
        assert torch.equal(batch.image_mask[b, :n], ids[0] == image_id)
        assert int(batch.image_mask[b].sum()) == (IMAGE_TOKENS if mm else 0)
        # the answer is what the data holds; only answer tokens are trained
        length, prompt = int(data["lengths"][r]), int(data["prompt_lengths"][r])
        answer = data["input_ids"][r, prompt:length]
        assert torch.equal(batch.ids[b, int(batch.prompt_lengths[b]) : n], answer)
        assert torch.equal(batch.weight[b].nonzero().flatten(), torch.arange(int(batch.prompt_lengths[b]), n))


def test_text_only_samples_carry_no_image_and_the_teacher_gets_no_pixels(tiny, monkeypatch):
    model, processor, data = tiny
    seen = []
    forward = type(model.model).forward

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("pixel_values"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model.model), "forward", spy)
    idx = torch.tensor([1, 10])
    batch = task.teacher_batch(model, processor, data, idx, torch.tensor([False, False]))
    assert seen == [None]
    assert not bool((batch.ids == model.config.image_token_id).any()) and not bool(batch.image_mask.any())
    for b, r in enumerate(idx.tolist()):  # the row minus its image span, the prompt shortened by it
        length, prompt = int(data["lengths"][r]), int(data["prompt_lengths"][r])
        row = data["input_ids"][r, :length]
        kept = row[row != model.config.image_token_id]
        assert int(batch.lengths[b]) == length - IMAGE_TOKENS == len(kept)
        assert int(batch.prompt_lengths[b]) == prompt - IMAGE_TOKENS
        assert torch.equal(batch.ids[b, : len(kept)], kept)
    # a mixed batch hands the target exactly the multimodal rows' images
    seen.clear()
    task.teacher_batch(model, processor, data, torch.tensor([1, 10, 4]), torch.tensor([False, True, False]))
    assert len(seen) == 1 and torch.equal(seen[0], _pixels(processor, data, [10]))


def test_curriculum_share_is_exact_at_its_knots():
    r = task.multimodal_probability
    assert [r(s, 10, 20) for s in (0, 9, 10, 15, 20, 29, 30, 31, 500)] == [0, 0, 0, 0.25, 0.5, 0.95, 1, 1, 1]
    assert [r(s, 3, 0) for s in (0, 2, 3, 4)] == [0, 0, 1, 1]  # no ramp: a jump
    assert [r(s, 0, 0) for s in (0, 1)] == [1, 1]  # the default of vispec / specvlm: multimodal throughout
    assert r(7, 8, 5) == 0  # text-only throughout (--text-steps = --steps)


def test_held_out_rows_come_from_both_workloads(tiny):
    _, _, data = tiny
    held = task.held_out_rows(data, 2)
    assert {k: v.tolist() for k, v in held.items()} == {"templated": [0, 1], "free_form": [8, 9]}
    held = task.held_out_rows(data, 100)  # at most a quarter of each part
    assert {k: v.tolist() for k, v in held.items()} == {"templated": [0, 1], "free_form": [8, 9]}


# ----------------------------------------------------------------------------- the task end to end


def test_run_samples_text_only_then_multimodal_by_the_curriculum(files, tmp_path, monkeypatch):
    calls = []
    real = task.teacher_batch

    def spy(model, processor, data, idx, multimodal, pad_id=0):
        calls.append(multimodal.tolist())
        return real(model, processor, data, idx, multimodal, pad_id)

    monkeypatch.setattr(task, "teacher_batch", spy)
    argv = _argv(files, tmp_path / "out", "--text-steps", "2", "--ramp-steps", "0", "--eval-items", "1", "--log-every", "1",
                 policy="msd")  # fmt: skip
    train_main.main(argv)
    assert calls[:4] == [[False, False], [False, False], [True, True], [True, True]]  # then the evaluation rows
    record = json.loads((tmp_path / "out" / "training.json").read_text())
    assert record["extra"]["curriculum"] == {"text_steps": 2, "ramp_steps": 0}
    assert [h["multimodal"] for h in record["history"]] == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("policy", ["vispec", "msd", "specvlm"])
def test_a_few_steps_write_a_loadable_head_with_held_out_metrics(files, tmp_path, policy):
    from mmspec.drafters.vision_eagle import VisionEagleHead
    from mmspec.models import load

    out = tmp_path / "out"
    head = task.run(_parse(_argv(files, out, policy=policy)))
    loaded = load(out)  # strict: every weight present with its config's shape
    assert isinstance(loaded, VisionEagleHead) and loaded.config.vision_policy == policy
    state = head.state_dict()
    assert set(loaded.state_dict()) == set(state)
    for k, v in loaded.state_dict().items():  # float16 on disk, float32 loaded
        assert torch.equal(v, state[k].half().to(v.dtype)), k
    record = json.loads((out / "training.json").read_text())
    metrics = record["metrics"]
    for prefix in ("", "templated_", "free_form_"):
        values = [metrics[f"{prefix}top1_step{j}"] for j in range(3)]
        assert all(0.0 <= v <= 1.0 for v in values), metrics
    for workload in ("templated", "free_form"):  # 2 held-out rows each (--eval-items 2)
        tokens = metrics[f"{workload}_draft_image_tokens"]
        assert tokens == {"msd": IMAGE_TOKENS, "vispec": 1}[policy] if policy != "specvlm" else tokens < IMAGE_TOKENS
        if policy == "specvlm":
            choice = metrics[f"{workload}_gate_choice"]
            assert sum(choice.values()) == 2 and set(choice) <= set(head.vision.names), choice
        else:
            assert f"{workload}_gate_choice" not in metrics
    assert record["seed"] == 0 and record["hyperparameters"]["policy"] == policy
    assert record["extra"]["policy"] == policy and record["model_class"] == "VisionEagleHead"
    assert record["extra"]["curriculum"] == dict(zip(("text_steps", "ramp_steps"), task.CURRICULUM[policy]))
    assert record["extra"]["policy_kwargs"] == {k: d for k, (p, d) in task.POLICY_FLAGS.items() if policy in p}
    card = (out / "README.md").read_text()
    assert "top1_step2" in card and policy in card and "final_train_loss" in card


def test_eagle_control_trains_a_text_head_from_init_through_the_same_loop(files, tmp_path, tiny, monkeypatch):
    """`--policy eagle`: a `TextEagleHead` started from `--init` (its weights at step 0), no vision inputs."""
    from mmspec.models import load
    from mmspec.models.hf.eagle import TextEagleHead

    model, _, _ = tiny
    init = TextEagleHead.from_target(model, draft_vocab_size=32)
    init.set_draft_vocab(torch.arange(10, 42))
    init.save_pretrained(tmp_path / "init")
    seen = []
    real = TextEagleHead.forward_unrolled

    def spy(self, *args, **kwargs):
        seen.append((self.fc.weight.detach().clone(), sorted(kwargs)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TextEagleHead, "forward_unrolled", spy)
    out = tmp_path / "out"
    argv = _argv(files, out, "--init", str(tmp_path / "init"), policy="eagle")
    head = task.run(_parse(argv))
    assert type(head) is TextEagleHead and torch.equal(head.draft_vocab, torch.arange(10, 42))
    assert torch.equal(seen[0][0], init.fc.weight) and not torch.equal(head.fc.weight, init.fc.weight)
    assert all(kwargs == [] for _, kwargs in seen)  # no vision inputs, in training or evaluation
    assert type(load(out)) is TextEagleHead
    metrics = json.loads((out / "training.json").read_text())["metrics"]
    assert {"top1_step2", "init_top1_step2", "free_form_top1_step0"} <= set(metrics)
    assert not any("draft_image_tokens" in k for k in metrics)


def test_kill_and_resume_gives_bit_identical_weights(files, tmp_path, monkeypatch):
    argv = _argv(files, tmp_path / "whole", "--fp32-weights", policy="specvlm")
    whole = task.run(_parse(argv))

    class Killed(Exception):
        pass

    save = common.save_checkpoint

    def killed_after_first(path, state):  # the process dies right after its checkpoint at step 2
        save(path, state)
        raise Killed

    monkeypatch.setattr(common, "save_checkpoint", killed_after_first)
    argv = _argv(files, tmp_path / "killed", "--fp32-weights", policy="specvlm")
    with pytest.raises(Killed):
        task.run(_parse(argv))
    assert torch.load(tmp_path / "killed" / common.CHECKPOINT_NAME, weights_only=True)["step"] == 2
    monkeypatch.setattr(common, "save_checkpoint", save)
    resumed = task.run(_parse(argv))
    for k, v in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


@pytest.mark.parametrize(
    "flag, value, stored",
    [("--num-queries", "3", "2"), ("--text-steps", "1", "0"), ("--logit-weight", "0.5", "0.1"),
     ("--eval-items", "3", "2")],
)  # fmt: skip
def test_resume_with_a_changed_flag_is_refused_naming_it(files, tmp_path, capsys, flag, value, stored):
    out = tmp_path / "out"
    argv = _argv(files, out)
    train_main.main([*argv[: argv.index("--steps") + 1], "2", *argv[argv.index("--steps") + 2 :]])
    with pytest.raises(SystemExit) as exit_:
        train_main.main([*argv, flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{flag} {value} differs from the checkpoint's {flag} {stored}" in err, err


def test_policy_fills_its_own_defaults_whatever_the_flag_order():
    base = ["vlm-vision", "--out", "x"]
    assert vars(_parse([*base, "--policy", "msd"]))["text_steps"] == task.CURRICULUM["msd"][0]
    args = _parse([*base, "--text-steps", "7", "--policy", "msd", "--ramp-steps", "9"])
    assert (args.text_steps, args.ramp_steps, args.num_queries, args.ratio) == (7, 9, None, None)
    args = _parse([*base, "--policy", "msd", "--policy", "vispec"])  # the last one counts
    assert (args.text_steps, args.ramp_steps, args.num_queries, args.policy) == (0, 0, 2, "vispec")
    args = _parse([*base, "--ratio", "8", "--policy", "specvlm"])
    assert (args.ratio, args.gate_tau, args.num_queries) == (8, 1.0, 2)  # 2: its resampler expert's queries


class Ran(Exception):
    pass


@pytest.mark.parametrize(
    "extra, flag",
    [(["--policy", "medusa"], "--policy"), (["--num-queries", "3", "--policy", "msd"], "--num-queries"),
     (["--ratio", "2"], "--ratio"), (["--gate-tau", "0.5", "--policy", "vispec"], "--gate-tau"),
     (["--num-queries", "1"], "--num-queries"), (["--gate-tau", "0"], "--gate-tau"),
     (["--text-steps", "5"], "--text-steps"), (["--policy", "msd", "--steps", "30"], "--text-steps"),
     (["--ramp-steps", "-1"], "--ramp-steps"), (["--init", "MISSING"], "--init"), (["--init", "DATA"], "--init"),
     (["--logit-weight", "nan"], "--logit-weight"), (["--target", "DATA"], "--target")],
)  # fmt: skip
def test_bad_flags_are_usage_errors_before_anything_loads(files, tmp_path, monkeypatch, capsys, extra, flag):
    monkeypatch.setattr(task, "run", lambda args: (_ for _ in ()).throw(Ran()))
    extra = [{"MISSING": str(tmp_path / "missing"), "DATA": files["data"]}.get(a, a) for a in extra]
    with pytest.raises(SystemExit) as exit_:
        train_main.main(_argv(files, tmp_path / "out", *extra))
    assert exit_.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(Ran):  # the same command without the bad flag gets through
        train_main.main(_argv(files, tmp_path / "out"))
