"""Official LlamaGen GPT checkpoint loading with synthetic files in the upstream formats."""

import argparse

import pytest
import torch

import mmspec.models
from mmspec.models.llamagen.checkpoints import (
    GPT_PRESETS,
    check_state_dict,
    convert_official_gpt,
    load_official_gpt,
    load_official_state_dict,
    official_gpt_config,
)
from mmspec.models.llamagen.gpt import LlamaGenGPT


def upstream_shapes(
    n_layer,
    n_head,
    dim,
    vocab=16384,
    model_type="c2i",
    num_classes=1000,
    caption_dim=2048,
    token_num=120,
    multiple_of=256,
):
    """Key -> shape of upstream `Transformer(ModelArgs(...)).state_dict()` (written from upstream's module tree)."""
    hidden = int(2 * 4 * dim / 3)
    hidden = hidden if hidden % multiple_of == 0 else hidden + multiple_of - hidden % multiple_of
    shapes = {}
    if model_type == "c2i":
        shapes["cls_embedding.embedding_table.weight"] = (num_classes + 1, dim)
    else:
        shapes["cls_embedding.uncond_embedding"] = (token_num, caption_dim)
        shapes["cls_embedding.cap_proj.fc1.weight"] = (dim, caption_dim)
        shapes["cls_embedding.cap_proj.fc2.weight"] = (dim, dim)
    shapes["tok_embeddings.weight"] = (vocab, dim)
    for i in range(n_layer):
        p = f"layers.{i}."
        shapes[p + "attention.wqkv.weight"] = (3 * dim, dim)
        shapes[p + "attention.wo.weight"] = (dim, dim)
        shapes[p + "feed_forward.w1.weight"] = (hidden, dim)
        shapes[p + "feed_forward.w3.weight"] = (hidden, dim)
        shapes[p + "feed_forward.w2.weight"] = (dim, hidden)
        shapes[p + "attention_norm.weight"] = (dim,)
        shapes[p + "ffn_norm.weight"] = (dim,)
    shapes["norm.weight"] = (dim,)
    shapes["output.weight"] = (vocab, dim)
    return shapes


TINY = dict(n_layer=2, n_head=4, dim=32, vocab=64, multiple_of=16)


def synthetic_state(model_type="c2i", seed=0, **overrides):
    kw = {**TINY, **overrides}
    gen = torch.Generator().manual_seed(seed)
    shapes = upstream_shapes(model_type=model_type, num_classes=10, caption_dim=12, token_num=8, **kw)
    return {k: torch.randn(s, generator=gen) * 0.05 for k, s in shapes.items()}


def tiny_kwargs(model_type="c2i"):
    # a custom "preset" via overrides: n_layer / n_head / dim / multiple_of replace GPT-B's
    kw = dict(n_layer=2, n_head=4, dim=32, multiple_of=16, image_size=64)
    if model_type == "t2i":
        kw["caption_dim"] = 12
    return kw


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
@pytest.mark.parametrize("wrapper", ["model", "module", "state_dict", "bare", "ddp_prefix"])
def test_load_official_formats(tmp_path, model_type, wrapper):
    state = synthetic_state(model_type)
    if wrapper == "bare":
        obj = state
    elif wrapper == "ddp_prefix":
        obj = {"model": {"module._orig_mod." + k: v for k, v in state.items()}}
    else:
        obj = {wrapper: state}
    if wrapper == "model":  # upstream train_c2i.py also stores the optimizer, steps and argparse args
        obj.update(optimizer={"state": {}, "param_groups": []}, steps=1000, args=argparse.Namespace(lr=1e-4))
    path = tmp_path / "ckpt.pt"
    torch.save(obj, path)
    model = load_official_gpt(path, "GPT-B", **tiny_kwargs(model_type))
    assert isinstance(model, LlamaGenGPT) and model.config.model_type == model_type
    assert model.config.vocab_size == 64 and model.config.block_size == 16
    if model_type == "c2i":
        assert model.config.num_classes == 10
    else:
        assert model.config.cls_token_num == 8
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v), k
    # it runs
    cache = model.setup_cache(2, 24)
    cond = torch.tensor([1, 10]) if model_type == "c2i" else torch.randn(2, 8, 12)
    assert model.prefill(cond, cache).logits.shape == (2, 1, 64)


def test_upstream_only_buffers_are_dropped(tmp_path, caplog):
    """Upstream's rope table and KV caches in the file are dropped: the model holds exactly the checkpoint's weights
    and computes as the same checkpoint without them (a zero rope table or cache read in would change the logits)."""
    state = synthetic_state()
    torch.save({"model": state}, tmp_path / "clean.pt")
    extra = {"freqs_cis": torch.zeros(17, 4, 2), "layers.0.attention.kv_cache.k_cache": torch.zeros(1, 4, 24, 8)}
    torch.save({"model": {**state, **extra}}, tmp_path / "c.pt")
    with caplog.at_level("INFO", logger="mmspec.models.llamagen.checkpoints"):
        model = load_official_gpt(tmp_path / "c.pt", "GPT-B", **tiny_kwargs())
    assert "dropped 2 non-parameter upstream entries" in caplog.text
    loaded = model.state_dict()
    assert set(loaded) == set(state)  # no upstream buffer became part of the model
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    clean = load_official_gpt(tmp_path / "clean.pt", "GPT-B", **tiny_kwargs())
    cond = torch.tensor([1, 10])
    with torch.no_grad():
        logits = model.prefill(cond, model.setup_cache(2, 24)).logits
        expected = clean.prefill(cond, clean.setup_cache(2, 24)).logits
    assert torch.equal(logits, expected)


def test_wrong_shape_missing_and_unexpected_keys_are_named(tmp_path):
    state = synthetic_state()
    bad = dict(state)
    bad["layers.1.feed_forward.w2.weight"] = torch.zeros(32, 99)
    torch.save({"model": bad}, tmp_path / "shape.pt")
    with pytest.raises(ValueError, match=r"layers\.1\.feed_forward\.w2\.weight"):
        load_official_gpt(tmp_path / "shape.pt", "GPT-B", **tiny_kwargs())
    missing = {k: v for k, v in state.items() if k != "norm.weight"}
    torch.save({"model": missing}, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match=r"missing key 'norm\.weight'"):
        load_official_gpt(tmp_path / "missing.pt", "GPT-B", **tiny_kwargs())
    extra = {**state, "layers.2.attention.wo.weight": torch.zeros(32, 32)}  # a 3-layer file into 2 layers
    torch.save({"model": extra}, tmp_path / "extra.pt")
    with pytest.raises(ValueError, match=r"unexpected key 'layers\.2\.attention\.wo\.weight'"):
        load_official_gpt(tmp_path / "extra.pt", "GPT-B", **tiny_kwargs())
    # right file, wrong preset: every layer of GPT-B is missing
    torch.save({"model": state}, tmp_path / "ok.pt")
    with pytest.raises(ValueError, match="wqkv|missing"):
        load_official_gpt(tmp_path / "ok.pt", "GPT-B", image_size=64)


def test_corrupt_and_unsafe_files_are_refused(tmp_path):
    torch.save({"model": synthetic_state()}, tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt"):
        load_official_state_dict(tmp_path / "trunc.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="corrupt"):
        load_official_state_dict(tmp_path / "junk.pt")
    torch.save({"model": synthetic_state(), "hook": torch.nn.Linear(2, 2)}, tmp_path / "code.pt")
    with pytest.raises(ValueError, match="refusing"):
        load_official_state_dict(tmp_path / "code.pt")
    torch.save({"optimizer": {}, "steps": 3}, tmp_path / "nostate.pt")
    with pytest.raises(ValueError, match="no state dict"):
        load_official_state_dict(tmp_path / "nostate.pt")
    with pytest.raises(ValueError, match="does not exist"):
        load_official_state_dict(tmp_path / "absent.pt")
    torch.save({"model": {"a": torch.zeros(1), "b": 3}}, tmp_path / "nontensor.pt")
    with pytest.raises(ValueError, match="'b'"):
        load_official_state_dict(tmp_path / "nontensor.pt")


def test_check_state_dict_with_shapes():
    check_state_dict({"a": torch.zeros(2, 3)}, {"a": (2, 3)})
    with pytest.raises(ValueError, match="'a' has shape"):
        check_state_dict({"a": torch.zeros(3, 2)}, {"a": (2, 3)})


def test_convert_to_zoo_folder(tmp_path):
    torch.save({"model": synthetic_state()}, tmp_path / "c.pt")
    model = convert_official_gpt(tmp_path / "c.pt", tmp_path / "zoo", "GPT-B", **tiny_kwargs())
    loaded = mmspec.models.load(tmp_path / "zoo")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


@pytest.mark.parametrize(
    "preset,millions", [("GPT-B", 111), ("GPT-L", 343), ("GPT-XL", 775), ("GPT-XXL", 1400), ("GPT-3B", 3100)]
)
def test_presets_match_upstream_sizes(preset, millions):
    config = official_gpt_config(preset)  # c2i, 256px -> block 256, 1000 classes
    with torch.device("meta"):
        model = LlamaGenGPT(**config)
    n = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(n - millions) / millions < 0.04, n
    expected = upstream_shapes(**{k: GPT_PRESETS[preset][k] for k in ("n_layer", "n_head", "dim")})
    check_state_dict(model.state_dict(), expected)
