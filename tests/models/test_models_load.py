"""`mmspec.models.load`: zoo folders (allow-listed diffusers classes) and transformers model folders (causal LMs,
llava-family VLMs) with local safetensors only and no remote code; every failure is a `ValueError` naming `path`."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import mmspec.models
from mmspec.models import MODEL_CLASSES, load
from mmspec.models.storage import read_weights


transformers = pytest.importorskip("transformers")


def _seeded(fn, seed=0):
    with torch.random.fork_rng():  # model init draws from the global RNG; keep it out of other tests
        torch.manual_seed(seed)
        return fn()


@pytest.fixture
def tiny_llama(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37
    )
    model = _seeded(lambda: transformers.LlamaForCausalLM(config)).eval()
    folder = tmp_path / "llama"
    model.save_pretrained(folder)
    return model, folder


def _rewrite_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def test_transformers_causal_lm_loads_with_identical_logits(tiny_llama):
    model, folder = tiny_llama
    assert (folder / "model.safetensors").is_file() and not (folder / "config.json").read_text().count("_class_name")
    loaded = load(folder)
    assert type(loaded) is transformers.LlamaForCausalLM and not loaded.training
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    ids = torch.tensor([[1, 5, 42, 98, 7, 0]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert next(load(folder, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16


def test_llava_family_loads_as_its_architecture(tmp_path):
    text = transformers.LlamaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=98)
    model = _seeded(lambda: transformers.LlavaForConditionalGeneration(config)).eval()
    model.save_pretrained(tmp_path / "llava")
    loaded = load(tmp_path / "llava")
    assert type(loaded) is transformers.LlavaForConditionalGeneration
    ids = torch.tensor([[1, 5, 42, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_unknown_model_type_names_path(tiny_llama):
    _, folder = tiny_llama
    _rewrite_config(folder, model_type="warp-drive")
    with pytest.raises(ValueError, match=re.escape(f"path={str(folder)!r}")):
        load(folder)


def test_remote_code_is_never_trusted(tiny_llama):
    _, folder = tiny_llama
    (folder / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    _rewrite_config(folder, model_type="evil", auto_map={"AutoConfig": "evil.Cfg", "AutoModelForCausalLM": "evil.M"})
    with pytest.raises(ValueError, match=re.escape(f"path={str(folder)!r}")):
        load(folder)


def test_corrupt_safetensors_names_path(tiny_llama):
    _, folder = tiny_llama
    (folder / "model.safetensors").write_bytes(b"not a safetensors file" * 8)
    with pytest.raises(ValueError, match=re.escape(f"path={str(folder)!r}")):
        load(folder)


def test_missing_weights_are_an_error_not_a_random_init(tiny_llama):
    _, folder = tiny_llama
    weights = read_weights(folder / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"path={str(folder)!r}") + ".*lm_head.weight"):
        load(folder)


def test_pickle_weights_are_refused(tiny_llama):
    model, folder = tiny_llama
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=re.escape(f"path={str(folder)!r}")):
        load(folder)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "os.system"}))
    with pytest.raises(ValueError, match=r"_class_name='os.system'"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ValueError, match="_class_name=None"):
        load(tmp_path)


def test_eagle_head_registered_at_its_new_home_with_a_fallback(monkeypatch):
    from mmspec.drafters.eagle import EagleHead

    assert MODEL_CLASSES["EagleHead"] == "mmspec.models.llamagen.eagle"
    assert mmspec.models.loading._zoo_class("EagleHead") is EagleHead
    monkeypatch.setitem(MODEL_CLASSES, "EagleHead", "mmspec.models.not_moved_yet")
    assert mmspec.models.loading._zoo_class("EagleHead") is EagleHead  # the former module still serves it
    monkeypatch.setitem(MODEL_CLASSES, "LlamaGenVQ", "mmspec.models.not_there")
    with pytest.raises(ModuleNotFoundError):  # no fallback for other classes: a real packaging error
        mmspec.models.loading._zoo_class("LlamaGenVQ")
