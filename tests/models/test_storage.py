"""`mmspec.models.storage`: int8 / int4 weight-only storage, dequantised at load, for every kind of zoo folder.

The bounds are the schemes' own: symmetric absmax quantisation rounds to the nearest level, so a dequantised weight
is within half a step (`scale / 2`) of the original, the row's (int8) or group's (int4) largest magnitude is exact,
and a quantised tensor is never stored under its own name (a loader that ignores the scheme must fail, not load
integers as weights).
"""

import json
from pathlib import Path

import pytest
import torch
from factories import tiny_gpt
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import mmspec.models
from mmspec.models.storage import (
    METADATA_KEY,
    convert_folder,
    dequantize,
    quantize,
    read_weights,
    storage_of,
    write_weights,
)


ZOO = Path(__file__).resolve().parents[2] / "assets"


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "linear.weight": torch.randn(48, 64, generator=g),
        "conv.weight": torch.randn(16, 8, 3, 3, generator=g),  # 72 inputs per row: int4 groups of 32 do not divide
        "norm.weight": torch.rand(64, generator=g),
        "small.weight": torch.randn(4, 8, generator=g),  # under the size floor: float16
        "steps": torch.arange(5),  # not floating: as is
    }


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_dequantised_weights_are_within_half_a_step(scheme):
    state = _state()
    tensors, metadata = quantize(state, scheme)
    back = dequantize(tensors, metadata)
    assert set(back) == set(state) and "linear.weight" not in tensors  # stored as .qweight / .qscale only
    info = json.loads(metadata[METADATA_KEY])["tensors"]
    assert info["linear.weight"]["bits"] == (4 if scheme == "int4" else 8) and info["conv.weight"]["bits"] == 8
    for name in ("linear.weight", "conv.weight"):
        w, bits = state[name].reshape(state[name].shape[0], -1), info[name]["bits"]
        groups = w.reshape(w.shape[0], -1, 32) if bits == 4 else w[:, None, :]
        step = groups.abs().amax(-1, keepdim=True) / (7 if bits == 4 else 127)
        error = (back[name].reshape(groups.shape) - groups).abs()
        assert (error <= step / 2 * (1 + 1e-3) + 1e-6).all(), name  # fp16 scales (int4) round the step a little
        assert back[name].shape == state[name].shape
    assert torch.equal(back["norm.weight"], state["norm.weight"].half())
    assert torch.equal(back["small.weight"], state["small.weight"].half())
    assert torch.equal(back["steps"], state["steps"])


def test_int4_nibbles_unpack_in_order():
    """Every level of [-7, 7] in every position of a group comes back where it was (low nibble first)."""
    levels = torch.arange(-7, 8, dtype=torch.float32)
    w = torch.stack([levels.roll(i)[:14].repeat(2)[:28].repeat(2)[:32] for i in range(15)])  # [15, 32], max |w| = 7
    w[:, 0] = 7.0  # every group's scale is exactly 1
    back = dequantize(*quantize({"w": w}, "int4"))["w"]
    assert torch.equal(back, w)


def test_files_round_trip_and_name_their_scheme(tmp_path):
    state = _state()
    for scheme in ("float32", "float16", "int8", "int4"):
        path = write_weights(state, tmp_path / f"{scheme}.safetensors", scheme)
        assert storage_of(path) == scheme
        back = read_weights(path)
        assert set(back) == set(state)
        if scheme == "float32":
            assert all(torch.equal(back[k], state[k]) for k in state)


def test_damaged_storage_is_refused_naming_the_file(tmp_path):
    path = write_weights(_state(), tmp_path / "w.safetensors", "int8")
    tensors = load_file(path)
    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    del tensors["linear.weight.qscale"]
    save_file(tensors, path, metadata=metadata)
    with pytest.raises(ValueError, match=r"w\.safetensors.*linear\.weight"):
        read_weights(path)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"w\.safetensors"):
        read_weights(path)


def test_zoo_folder_loads_dequantised_and_plain_loaders_cannot_misread_it(tmp_path):
    model = tiny_gpt()
    model.save_pretrained(tmp_path, safe_serialization=True)
    convert_folder(tmp_path, "int4")
    loaded = mmspec.models.load(tmp_path)
    expected = read_weights(tmp_path / "diffusion_pytorch_model.safetensors")
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name].float()), name
    # the stored names are not the model's: a loader that ignores the scheme cannot take integers for weights
    stored = load_file(tmp_path / "diffusion_pytorch_model.safetensors")
    assert not any(v.dtype in (torch.int8, torch.uint8) and k in loaded.state_dict() for k, v in stored.items())


def test_transformers_folder_loads_dequantised(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    convert_folder(tmp_path, "int8")
    assert storage_of(tmp_path / "model.safetensors") == "int8"
    loaded = mmspec.models.load(tmp_path)
    expected = read_weights(tmp_path / "model.safetensors")
    for name, value in loaded.state_dict().items():
        key = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # tied
        assert torch.equal(value, expected[key].float()), name


@pytest.mark.zoo
def test_every_shipped_weights_file_is_stored_as_its_model_card_says():
    files = sorted(ZOO.glob("*/*.safetensors"))
    assert files
    for file in files:
        scheme = storage_of(file)
        card = (file.parent / "README.md").read_text()
        assert f"storage: {scheme}" in card, f"{file.parent.name}: card does not record storage {scheme}"
