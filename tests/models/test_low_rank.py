"""`mmspec.models.hf.low_rank`: an adapted LM trains as `W + (alpha / r) B A` parametrisations with its base weights
frozen, ships only the factors (in the zoo folder's weights file, named by its config's `lm_low_rank`) and loads as a
plain model whose weights hold the merged update, computing what the parametrised model computed."""

import functools

import pytest
import torch

from mmspec.models.hf import low_rank


SETTINGS = {"rank": 4, "alpha": 8.0, "modules": ["q_proj", "v_proj"]}


def _lm(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _randomise(deltas, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for delta in deltas.values():
            delta.lora_b.copy_(torch.randn(delta.lora_b.shape, generator=generator) * 0.1)


def test_the_update_starts_at_zero_trains_only_the_factors_and_merges_to_the_same_model():
    ids = torch.randint(0, 49152, (2, 9), generator=torch.Generator().manual_seed(0))
    adapted, plain = _lm(), _lm()
    before = adapted(ids).logits
    deltas = low_rank.add_low_rank(adapted.model, SETTINGS, torch.Generator().manual_seed(2))
    assert len(deltas) == 2 * 2  # two layers, q and v
    torch.testing.assert_close(adapted(ids).logits, before, rtol=0, atol=0)  # B = 0: unchanged
    adapted(ids).logits.square().mean().backward()
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(name.endswith(("lora_a", "lora_b")) for name in trainable)
    assert all(delta.lora_b.grad is not None and delta.lora_b.grad.abs().sum() > 0 for delta in deltas.values())
    _randomise(deltas)
    state = low_rank.low_rank_state(adapted.model)
    assert {k: tuple(v.shape) for k, v in state.items()} == low_rank.low_rank_shapes(plain.model, SETTINGS)
    low_rank.merge_low_rank(plain.model, SETTINGS, state, "here")
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(plain(ids).logits, before, atol=1e-3)  # the update changed the model
    # only the named projections moved
    base = _lm()
    for name, value in plain.state_dict().items():
        moved = not torch.equal(value, base.state_dict()[name])
        assert moved == name.endswith(("q_proj.weight", "v_proj.weight")), name


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"rank": 0, "alpha": 1.0, "modules": ["q_proj"]}, "rank"),
        ({"rank": 4, "alpha": float("nan"), "modules": ["q_proj"]}, "alpha"),
        ({"rank": 4, "alpha": 1.0, "modules": []}, "modules"),
        ({"rank": 4, "alpha": 1.0, "modules": ["q_proj", "q_proj"]}, "repeat"),
        ({"rank": 4, "alpha": 1.0}, "keys"),
    ],
)
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        low_rank.check_settings(settings)


def test_a_projection_the_layers_lack_is_refused():
    with pytest.raises(ValueError, match="no linear projection named 'qkv'"):
        low_rank.add_low_rank(_lm().model, {"rank": 2, "alpha": 2.0, "modules": ["qkv"]})


@functools.cache
def _tokenizer():
    from mmspec.models.hf.smollm2 import load_smollm2

    return load_smollm2()[1]


@pytest.fixture
def tiny_smollm2(monkeypatch):
    """A 2-layer Llama of SmolLM2's vocabulary in SmolLM2's place; each call a fresh copy of the same weights."""
    from mmspec.models.hf import smollm2

    tokenizer = _tokenizer()
    monkeypatch.setattr(smollm2, "load_smollm2", lambda *a, **k: (_lm(), tokenizer))


def _adapted_vlm():
    from mmspec.models.hf.zoo import build_processor, build_vlm, vlm_config

    model = build_vlm(vlm_config(_lm().config, 32, 1, 2, image_size=64), _lm()).eval()
    deltas = low_rank.add_low_rank(model.model.language_model, SETTINGS, torch.Generator().manual_seed(3))
    _randomise(deltas)
    model.config.lm_low_rank = dict(SETTINGS)
    return model, build_processor(_tokenizer(), image_size=64)


@pytest.mark.parametrize("storage, tol", [("float32", 1e-5), ("int4", 2e-2)])
def test_a_zoo_folder_ships_the_factors_and_loads_the_merged_model(tiny_smollm2, tmp_path, storage, tol):
    from safetensors import safe_open

    from mmspec.models.hf.zoo import WEIGHTS_NAME, load_vlm, save_vlm_parts

    model, processor = _adapted_vlm()
    save_vlm_parts(model, processor, tmp_path, storage=storage, tokenizer=False)
    with safe_open(tmp_path / WEIGHTS_NAME, "pt") as f:
        keys = set(f.keys())
    lm_keys = {k for k in keys if k.startswith("language_model.")}
    assert lm_keys and all(".lora_" in k for k in lm_keys)  # SmolLM2's own weights are not copied
    assert any(k.startswith("language_model.layers.1.self_attn.v_proj.lora_b") for k in keys)
    loaded, _ = load_vlm(tmp_path)
    assert loaded.config.lm_low_rank == SETTINGS
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(torch.tensor([[5, 7, 9]]))
        want = model.model.language_model(inputs_embeds=embeds).last_hidden_state
        got = loaded.model.language_model(inputs_embeds=embeds).last_hidden_state
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_a_folder_whose_weights_lack_the_factors_its_config_names_is_refused(tiny_smollm2, tmp_path):
    import json

    from mmspec.models.hf.zoo import load_vlm, save_vlm_parts

    model, processor = _adapted_vlm()
    save_vlm_parts(model, processor, tmp_path, storage="float32", tokenizer=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["lm_low_rank"]["modules"] = ["q_proj", "v_proj", "o_proj"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"vision_projector.safetensors.*missing.*o_proj"):
        load_vlm(tmp_path)
    config["lm_low_rank"]["rank"] = -1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json.*rank"):
        load_vlm(tmp_path)


def test_saving_factors_without_their_settings_is_refused(tiny_smollm2, tmp_path):
    from mmspec.models.hf.zoo import save_vlm_parts

    model, processor = _adapted_vlm()
    del model.config.lm_low_rank
    with pytest.raises(ValueError, match="lm_low_rank"):
        save_vlm_parts(model, processor, tmp_path)
