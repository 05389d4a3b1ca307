"""`python -m mmspec.train vlm-readout`: the dense-readout target (256 image tokens on 4x4 digit grids). Its stage-1
template reads every cell's position and digit, the tower starts from a 64-token one with its position table resized,
and a run (a tiny LM in SmolLM2's place) trains both stages, saves a folder `load_vlm` reads back with 256 image tokens,
and refuses a resume with another run-defining flag."""

import argparse
import functools

import pytest
import torch

from mmspec.data import grids
from mmspec.data.canvases import mnist_digits
from mmspec.train import vlm_readout


@functools.cache
def _tokenizer():
    from mmspec.models.hf.smollm2 import load_smollm2

    return load_smollm2()[1]


def _args(*argv):
    parser = argparse.ArgumentParser()
    vlm_readout.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_stage1_template_reads_every_cell_s_position_and_digit():
    tokenizer = _tokenizer()
    _, labels = mnist_digits("test")
    layouts = [grids.sample_layout(labels, torch.Generator().manual_seed(s)) for s in range(2)]
    ids = vlm_readout.template_ids(tokenizer, layouts)
    assert ids.shape == (2, 256)
    slots = vlm_readout.digit_slots(tokenizer, layouts)
    grid = ids.reshape(2, 16, 16)
    for b, layout in enumerate(layouts):
        for k, digit in enumerate(layout.cells):
            r, c = k // 4, k % 4
            cell = grid[b, r * 4 : r * 4 + 4, c * 4 : c * 4 + 4]
            text = "|".join(tokenizer.decode(row) for row in cell.tolist())
            d = digit.label
            assert text == f" row{r + 1} column{c + 1}|: {d}.| row{r + 1}:{d}| column{c + 1}:{d}", text
        digits = ids[b][slots[b]]
        expected = torch.tensor([tokenizer.convert_tokens_to_ids(str(layout.label(y // 4 + 1, x // 4 + 1)))
                                 for y in range(16) for x in range(16) if slots[b].reshape(16, 16)[y, x]])  # fmt: skip
        assert torch.equal(digits, expected)  # the slots are exactly the cells' digit tokens
    assert slots[0].sum() == 3 * 16
    vocab = vlm_readout.template_vocabulary(tokenizer)
    assert torch.isin(ids, vocab).all()


def test_the_tower_starts_from_a_64_token_tower_with_its_position_table_resized():
    from mmspec.models.hf.zoo import load_vlm

    model, processor, _ = vlm_readout.build(_args())
    source = load_vlm(vlm_readout.zoo_folder("mnist-vlm"))[0].model.vision_tower.state_dict()
    tower = model.model.vision_tower.state_dict()
    (key,) = [k for k in tower if k.endswith("position_embedding.weight")]
    assert source[key].shape[0] == 65 and tower[key].shape[0] == 257
    assert torch.equal(tower[key][0], source[key][0])  # the CLS row kept
    for name, value in source.items():
        if name != key and not name.endswith("position_ids"):
            assert torch.equal(tower[name], value), name
    pixels = torch.zeros(1, 3, 128, 128)
    features, _ = vlm_readout.image_features(model, pixels)
    assert features.shape == (1, 256, 576)
    prompt = vlm_readout.user_prompt(processor, "Read the grid row by row.", expand=False)
    from mmspec.data.canvases import to_pil

    inputs = processor(images=[to_pil(torch.zeros(128, 128))], text=[prompt], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 256


@pytest.fixture
def tiny_lm(monkeypatch):
    """SmolLM2's tokenizer with a 2-layer, 64-wide Llama of its vocabulary in the LM's place (a step in seconds)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mmspec.models.hf import smollm2

    tokenizer = _tokenizer()
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    monkeypatch.setattr(smollm2, "load_smollm2", lambda *a, **k: (model, tokenizer))
    return model


TINY = ("--init-from", "none", "--hidden", "32", "--layers", "1", "--heads", "2", "--stage1-steps", "3",
        "--stage1-batch-size", "2", "--steps", "2", "--batch-size", "2", "--eval-prompts", "1", "--threads", "1",
        "--quiet")  # fmt: skip


def test_a_tiny_run_trains_both_stages_and_saves_a_256_token_target(tiny_lm, tmp_path):
    from mmspec.models.hf.zoo import load_vlm
    from mmspec.train.common import read_training_record

    out = tmp_path / "out"
    vlm_readout.run(_args("--out", str(out), "--work", str(tmp_path / "work"), *TINY, "--lm-rank", "8"))
    model, processor = load_vlm(out)
    assert model.config.image_seq_length == 256 and model.config.vision_config.image_size == 128
    record = read_training_record(out)
    metrics = record["metrics"]
    for kind in grids.KINDS:
        assert 0 <= metrics[f"heldout_{kind}_digit_accuracy"] <= 1
    assert metrics["stage1_final_loss"] > 0 and metrics["stage2_final_loss"] > 0
    assert metrics["stage2_final_tokens"] > 256  # the image tokens and the answer
    card = (out / "README.md").read_text()
    assert "load_vlm('mnist-vlm-readout')" in card and "256 image tokens" in card
    assert (tmp_path / "work" / "stage2" / "checkpoint.pt").is_file()
    # a rank-8 update of the LM (q / v by default): the folder ships the factors, load_vlm merges them
    assert model.config.lm_low_rank == {"rank": 8, "alpha": 16.0, "modules": ["q_proj", "v_proj"]}
    base = tiny_lm.model.state_dict()
    for name, value in model.model.language_model.state_dict().items():
        assert torch.equal(value, base[name]) != name.endswith(("q_proj.weight", "v_proj.weight")), name
    with pytest.raises(ValueError, match="--digit-weight"):  # a resume with another run-defining flag
        vlm_readout.run(_args("--out", str(out), "--work", str(tmp_path / "work"), *TINY, "--lm-rank", "8",
                              "--digit-weight", "2"))  # fmt: skip
    with pytest.raises(ValueError, match="--lm-rank"):  # stage 2 depends on the LM's update
        vlm_readout.run(_args("--out", str(out), "--work", str(tmp_path / "work"), *TINY, "--lm-rank", "4"))


def test_stage1_checkpoints_do_not_depend_on_the_lm_s_update(tiny_lm, tmp_path):
    """Stage 1 never runs the LM: a run with a frozen LM (`--lm-rank 0`, the default) resumes the stage 1 of a run
    with an update, and saves a folder without factors."""
    from mmspec.models.hf.zoo import load_vlm

    work = tmp_path / "work"
    one = _args("--out", str(tmp_path / "a"), "--work", str(work), *TINY, "--lm-rank", "8")
    vlm_readout.run_stage1(one, *vlm_readout.build(one)[::2], *mnist_digits("train"), torch.Generator())
    stage1 = (work / "stage1" / "checkpoint.pt").read_bytes()
    vlm_readout.run(_args("--out", str(tmp_path / "b"), "--work", str(work), *TINY, "--lm-rank", "0"))
    assert (work / "stage1" / "checkpoint.pt").read_bytes() == stage1  # resumed as finished, not retrained
    model, _ = load_vlm(tmp_path / "b")
    assert getattr(model.config, "lm_low_rank", None) is None
    base = tiny_lm.model.state_dict()
    assert all(torch.equal(v, base[k]) for k, v in model.model.language_model.state_dict().items())


def test_stage2_loss_is_the_weighted_answer_cross_entropy(tiny_lm):
    """The loss with the LM head at the answer positions only equals the full-logits token-weighted mean."""
    import torch.nn.functional as F

    from mmspec.models.hf.zoo import build_processor, build_vlm, vlm_config

    model = build_vlm(vlm_config(tiny_lm.config, 32, 1, 2, image_size=128), tiny_lm)
    processor = build_processor(_tokenizer(), image_size=128)
    layouts, canvases, prompts = grids.sample_prompts(2, "train", seed=0)
    texts = [vlm_readout.user_prompt(processor, p.text, image_tokens=256) for p in prompts]
    ids, mask, labels = vlm_readout.collate(processor, texts, [grids.answer(a, p) for a, p in zip(layouts, prompts)])
    pixels = vlm_readout.pixel_values(canvases)
    digits = torch.tensor([processor.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])
    got = vlm_readout.answer_logits_loss(model, ids, mask, labels, pixels, digits, 3.0)
    logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixels).logits[:, :-1]
    target = labels[:, 1:]
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none")
    weight = (target != -100).float() * torch.where(torch.isin(target, digits), 3.0, 1.0)
    torch.testing.assert_close(got, (ce * weight.flatten()).sum() / weight.sum())


def test_bad_init_from_is_a_usage_error_before_anything_loads(tmp_path, capsys):
    from mmspec.train.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["vlm-readout", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"), "--init-from",
              str(tmp_path)])  # fmt: skip
    assert info.value.code == 2 and "--init-from" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["vlm-readout", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"), "--lm-modules", "q_proj,"])
    assert info.value.code == 2 and "--lm-modules" in capsys.readouterr().err


def test_the_2x2_target_trainer_runs_through_the_shared_stage_code(tiny_lm, tmp_path):
    """`vlm` (mnist-vlm's trainer) shares the two-stage flags, stage 2's optimiser and loop and the card's metrics
    with `vlm-readout`: a tiny run of it trains both stages and saves a 64-token target without tokenizer files."""
    import argparse

    from mmspec.models.hf.zoo import load_vlm
    from mmspec.train import vlm
    from mmspec.train.common import read_training_record

    parser = argparse.ArgumentParser()
    vlm.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--out", str(out), "--work", str(tmp_path / "work"), "--hidden", "32", "--layers", "1",
                              "--heads", "2", "--stage1-steps", "2", "--stage1-batch-size", "2", "--steps", "2",
                              "--batch-size", "2", "--eval-which", "2", "--eval-count", "1", "--eval-batch-size", "2",
                              "--threads", "1", "--quiet"])  # fmt: skip
    vlm.run(args)
    model, _ = load_vlm(out)
    assert model.config.image_seq_length == 64 and not (out / "tokenizer.json").exists()
    record = read_training_record(out)
    assert record["metrics"]["stage2_final_loss"] > 0 and record["metrics"]["stage1_final_loss"] > 0
    assert (tmp_path / "work" / "stage1" / "checkpoint.pt").is_file()
    assert (tmp_path / "work" / "stage2" / "checkpoint.pt").is_file()
