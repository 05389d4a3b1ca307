"""`mmspec.models.hf.vlm_folder`: a user's transformers VLM folder (as `save_pretrained` writes it, with the hub's
`processor_config.json`) loads as its own class with a processor that makes the same pixels and the same image
placeholders as the full one, for Qwen2.5-VL, Qwen3-VL (their video processors need torchvision: rebuilt for
images), LLaVA-Next (no video half: transformers' own `AutoProcessor`) and LLaVA-OneVision (rebuilt, with its
`processor_config.json` settings: without them its placeholders would expand differently); what is not a VLM
folder is refused naming it."""

import json

import anyres_fixtures
import pytest
import qwen_vl_fixtures
import torch

from mmspec.models.hf.vlm_folder import TRANSFORMERS, ZOO, check_vlm_folder, load_target_vlm


KINDS = {"qwen2_5_vl": qwen_vl_fixtures, "qwen3_vl": qwen_vl_fixtures, "llava_next": anyres_fixtures,
         "llava_onevision": anyres_fixtures}  # fmt: skip


def _saved(kind, folder):
    family = KINDS[kind]
    model = family.tiny_qwen_vl(kind, seed=2) if family is qwen_vl_fixtures else family.tiny_anyres(kind, seed=2)
    processor = family.processor(kind)
    model.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(processor.chat_template)
    settings = json.loads(processor.to_json_string())  # what the hub's processor_config.json holds
    settings["processor_class"] = next(c.__name__ for c in type(processor).__mro__ if c.__name__ != "ImagesOnly")
    (folder / "processor_config.json").write_text(json.dumps(settings))
    return model, processor


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_saved_vlm_loads_with_an_equivalent_processor(kind, tmp_path):
    model, reference = _saved(kind, tmp_path)
    assert check_vlm_folder(tmp_path) == TRANSFORMERS
    loaded, processor = load_target_vlm(tmp_path)
    assert type(loaded) is type(model)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    images = qwen_vl_fixtures.images([(32, 48), (24, 24)], seed=1)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "w1 w2"}]}]
    texts = [reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)]
    assert processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == texts[0]
    ours = processor(images=images, text=texts, return_tensors="pt")
    ref = reference(images=images, text=texts, return_tensors="pt")
    assert set(ours) == set(ref)
    for key in ref:
        assert torch.equal(ours[key], ref[key]), key


def test_a_processor_class_transformers_cannot_tell_does_not_drop_the_images(tmp_path):
    """AutoProcessor answers an unknown `processor_class` with the bare tokenizer; the loader builds the model
    type's processor instead, so the images are not dropped."""
    _, reference = _saved("qwen2_5_vl", tmp_path)
    settings = json.loads((tmp_path / "processor_config.json").read_text())
    (tmp_path / "processor_config.json").write_text(json.dumps(settings | {"processor_class": "SomeSubclass"}))
    _, processor = load_target_vlm(tmp_path)
    images = qwen_vl_fixtures.images([(32, 48)], seed=1)
    text = ["<|vision_start|><|image_pad|><|vision_end|> w1"]
    ours, ref = (p(images=images, text=text, return_tensors="pt") for p in (processor, reference))
    assert torch.equal(ours["pixel_values"], ref["pixel_values"]) and torch.equal(ours["input_ids"], ref["input_ids"])


def test_what_is_not_a_vlm_folder_is_refused_naming_it(tmp_path):
    assert check_vlm_folder("mnist-vlm") == ZOO  # a zoo name, as `load_vlm` takes it
    with pytest.raises(ValueError, match="no readable config.json"):
        check_vlm_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama' is not a vision-language model"):
        check_vlm_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "LlamaGenGPT"}))
    with pytest.raises(ValueError, match="is an mmspec LlamaGenGPT folder, not a VLM"):
        check_vlm_folder(tmp_path)
