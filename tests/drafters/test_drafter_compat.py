"""A drafter folder made for another model is refused when the pipeline is built (before any forward), with the folder
and the mismatch (expected vs found) named: `mmspec.drafters.compat`, one check per drafter kind (issue 31)."""

import json
import re
import shutil

import pytest
import torch
from vlm_fixtures import IMAGE_TOKENS, tiny_llava, tiny_lm, tiny_processor, tiny_tokenizer

from mmspec.cli.vlm import EAGLE_HEADS
from mmspec.drafters.vision_eagle import VisionEagleHead
from mmspec.models import DEFAULT_ZOO, load
from mmspec.models.hf.draft import save_draft_delta, truncated_draft
from mmspec.models.hf.eagle import TextEagleHead
from mmspec.models.llamagen.eagle import EagleHead
from mmspec.models.llamagen.gpt import LlamaGenGPT
from mmspec.models.storage import read_weights, storage_of, write_weights
from mmspec.pipelines.ar_image import SpeculativeARImagePipeline
from mmspec.pipelines.janus import SpeculativeJanusPipeline
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


def _seeded(fn, seed=0):
    with torch.random.fork_rng():  # model init draws from the global RNG; keep it out of other tests
        torch.manual_seed(seed)
        return fn()


def _saved(model, folder):
    """Save `model` to `folder` and load it back as the pipelines do (`mmspec.models.load`)."""
    model.save_pretrained(folder)
    return load(folder)


def _names(folder, *mismatch):
    """A regex: the folder, then (anywhere after) each part of the mismatch, in order."""
    return "(?s)" + re.escape(str(folder)) + "".join(".*" + re.escape(m) for m in mismatch)


@pytest.fixture(scope="module")
def llava():
    return tiny_llava(2, seed=1)


# ------------------------------------------------------------------ VLM pipeline: EAGLE heads
def test_vlm_from_zoo_refuses_the_image_models_eagle_head():
    """Issue 31: `from_zoo(eagle="mnist-c2i-eagle")` loaded, then raised AttributeError ('LlavaConfig' has no 'dim')."""
    with pytest.raises(TypeError, match=_names("mnist-c2i-eagle", "TextEagleHead", "found EagleHead")):
        SpeculativeVLMPipeline.from_zoo(eagle="mnist-c2i-eagle")


@pytest.mark.parametrize("cls", [TextEagleHead, VisionEagleHead])
@pytest.mark.parametrize(
    "overrides, mismatch",
    [
        (dict(hidden_size=32, intermediate_size=64, head_dim=8), ("expected hidden_size=64", "found 32")),
        (dict(vocab_size=80), ("expected vocab_size=64", "found 80")),
    ],
)
def test_vlm_head_of_another_width_or_vocabulary_is_refused_naming_the_folder(llava, tmp_path, cls, overrides,
                                                                              mismatch):  # fmt: skip
    folder = tmp_path / "other-head"
    head = _saved(_seeded(lambda: cls.from_target(llava, **overrides)), folder)
    with pytest.raises(ValueError, match=_names(folder, *mismatch)):
        SpeculativeVLMPipeline(llava, tiny_processor(), eagle_head=head)


def test_vision_head_for_another_image_grid_is_refused(llava, tmp_path):
    """The image tokens a vision-aware head's policy is built for must be those of one image in the target's prompt."""
    folder = tmp_path / "msd-32"
    head = _saved(_seeded(lambda: VisionEagleHead.from_target(llava, vision_policy="msd",
                                                              tokens_per_image=2 * IMAGE_TOKENS)), folder)  # fmt: skip
    with pytest.raises(ValueError, match=_names(folder, f"expected tokens_per_image={IMAGE_TOKENS}", "found 32")):
        SpeculativeVLMPipeline(llava, tiny_processor(), eagle_head=head)


def test_vlm_head_with_draft_vocab_ids_beyond_the_vocabulary_is_refused(tmp_path):
    """Issue 31: a `draft_vocab` id past the vocabulary loaded, then raised IndexError at call time."""
    folder = tmp_path / "eagle-bad-vocab"
    shutil.copytree(DEFAULT_ZOO / "mnist-vlm-eagle", folder)
    path = folder / "diffusion_pytorch_model.safetensors"
    weights = read_weights(path)  # the zoo's storage (int4), dequantised; written back in the same scheme
    weights["draft_vocab"][5] = 60000
    write_weights(weights, path, storage_of(path))
    with pytest.raises(ValueError, match=_names(folder, "draft_vocab", "[0, 49152)", "found 60000")):
        SpeculativeVLMPipeline.from_zoo(eagle=str(folder))


def test_vision_head_of_another_width_names_the_folder(tmp_path):
    """Issue 31: a vision head of another width failed inside transformers' config validation, no folder named."""
    folder = tmp_path / "vispec-192"
    shutil.copytree(DEFAULT_ZOO / "mnist-vlm-vispec", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 192}))
    with pytest.raises(ValueError, match=_names(folder, "hidden size (192)")):
        SpeculativeVLMPipeline.from_zoo(eagle=str(folder))


# ------------------------------------------------------------------ VLM pipeline: draft models
def test_vlm_draft_lm_with_another_vocabulary_is_refused_naming_the_folder(tmp_path):
    target = tiny_lm(2, seed=1)
    other = tiny_lm(1, seed=2)
    other.resize_token_embeddings(80)
    folder = tmp_path / "draft-80"
    draft = _saved(other, folder)
    with pytest.raises(ValueError, match=_names(folder, "expected 64", "found 80")):
        SpeculativeVLMPipeline(target, tiny_tokenizer(), draft_model=draft)


def test_vlm_refuses_an_image_model_as_draft_model():
    draft = load(DEFAULT_ZOO / "mnist-c2i-draft")
    with pytest.raises(TypeError, match=_names("mnist-c2i-draft", "transformers causal LM", "found LlamaGenGPT")):
        SpeculativeVLMPipeline(tiny_lm(2, seed=1), tiny_tokenizer(), draft_model=draft)


def test_vlm_zoo_draft_reading_layers_beyond_the_target_is_refused(tmp_path):
    """The layers a zoo draft keeps (`draft.json` `num_layers`) must be within the target's 30."""
    root = tmp_path / "zoo"
    root.mkdir()
    (root / "mnist-vlm").symlink_to(DEFAULT_ZOO / "mnist-vlm", target_is_directory=True)
    shutil.copytree(DEFAULT_ZOO / "mnist-vlm-draft", root / "mnist-vlm-draft")
    meta = json.loads((root / "mnist-vlm-draft" / "draft.json").read_text())
    (root / "mnist-vlm-draft" / "draft.json").write_text(json.dumps({**meta, "num_layers": 40}))
    with pytest.raises(ValueError, match=_names(root / "mnist-vlm-draft", "num_layers", "30 layers", "40")):
        SpeculativeVLMPipeline.from_zoo(root)


def test_vlm_zoo_draft_made_for_another_target_names_the_tensor_and_shapes(tmp_path):
    target, other = tiny_lm(2, seed=1), tiny_lm(2, seed=2)
    other.resize_token_embeddings(80)
    folder = tmp_path / "draft"
    save_draft_delta(truncated_draft(other, 1), folder, ["model.embed_tokens.weight"], 1)
    from mmspec.models.hf.draft import load_vlm_draft

    with pytest.raises(ValueError, match=_names(folder, "embed_tokens", "expected (64, 64)", "found (80, 64)")):
        load_vlm_draft(folder, target)


# ------------------------------------------------------------------ image pipelines
def test_image_pipeline_refuses_the_vlm_eagle_head():
    head = load(DEFAULT_ZOO / "mnist-vlm-eagle")
    with pytest.raises(TypeError, match=_names("mnist-vlm-eagle", "expected an EagleHead", "found TextEagleHead")):
        SpeculativeARImagePipeline.from_zoo(eagle_head=head)


@pytest.mark.parametrize(
    "part, folder, mismatch",
    [
        ("eagle_head", "mnist-c2i-eagle", ("expected cls_token_num=16", "found 1")),
        ("draft_model", "mnist-c2i-draft", ("model_type=c2i", "model_type=t2i")),
    ],
)
def test_t2i_pipeline_refuses_the_c2i_drafters(part, folder, mismatch):
    with pytest.raises(ValueError, match=_names(folder, *mismatch)):
        SpeculativeARImagePipeline.from_zoo(kind="t2i", **{part: load(DEFAULT_ZOO / folder)})


@pytest.mark.parametrize(
    "change, mismatch",
    [
        (dict(vocab_size=512), ("vocab_size=512", "vocab_size=256")),
        (dict(num_classes=20), ("num_classes=20", "num_classes=10")),
    ],
)
def test_image_draft_model_of_another_codebook_or_class_count_is_refused(tmp_path, change, mismatch):
    config = {k: v for k, v in load(DEFAULT_ZOO / "mnist-c2i-draft").config.items() if not k.startswith("_")}
    folder = tmp_path / "draft"
    draft = _saved(_seeded(lambda: LlamaGenGPT(**{**config, **change})), folder)
    with pytest.raises(ValueError, match=_names(folder, *mismatch)):
        SpeculativeARImagePipeline.from_zoo(draft_model=draft)


def test_image_eagle_head_of_another_width_is_refused_naming_the_folder(tmp_path):
    config = {k: v for k, v in load(DEFAULT_ZOO / "mnist-c2i-eagle").config.items() if not k.startswith("_")}
    folder = tmp_path / "eagle-128"
    head = _saved(_seeded(lambda: EagleHead(**{**config, "dim": 128, "n_head": 4})), folder)
    with pytest.raises(ValueError, match=_names(folder, "expected dim=256", "found 128")):
        SpeculativeARImagePipeline.from_zoo(eagle_head=head)


@pytest.mark.parametrize("part", ["eagle_head", "draft_model"])
def test_janus_pipeline_refuses_drafters_naming_them(part):
    folder = DEFAULT_ZOO / {"eagle_head": "mnist-c2i-eagle", "draft_model": "mnist-c2i-draft"}[part]
    with pytest.raises(ValueError, match=_names(folder, "takes no draft model or EAGLE head")):
        SpeculativeJanusPipeline.from_zoo(**{part: str(folder)})
    with pytest.raises(ValueError, match=_names(folder, "takes no draft model or EAGLE head")):
        SpeculativeJanusPipeline.from_zoo(**{part: load(folder)})


# ------------------------------------------------------------------ the shipped zoo still loads
@pytest.mark.parametrize("kind", EAGLE_HEADS)
def test_vlm_zoo_loads_with_every_shipped_head(kind):
    pipe = SpeculativeVLMPipeline.from_zoo(eagle=kind)
    from mmspec.models.hf.eagle3 import Eagle3Head

    assert isinstance(pipe.eagle_head, {"eagle": TextEagleHead, "eagle3": Eagle3Head}.get(kind, VisionEagleHead))
    assert pipe.draft_model is not None


@pytest.mark.parametrize("kind", ["c2i", "t2i"])
def test_image_zoo_loads_with_its_drafters(kind):
    pipe = SpeculativeARImagePipeline.from_zoo(kind=kind)
    assert pipe.transformer.config.model_type == kind
    if kind == "c2i":
        assert pipe.eagle_head is not None and pipe.draft_model is not None
