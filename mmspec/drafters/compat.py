"""Load-time checks that a drafter fits its target: one function per drafter kind, called by the pipelines when they
are built, so a head or draft model made for another model is refused before any forward, with the folder it came
from (or the argument, for a model built in memory) and the mismatch, expected vs found.

| function                  | drafter                                | target                                 |
|---------------------------|----------------------------------------|----------------------------------------|
| `check_image_eagle_head`  | `EagleHead`                            | `LlamaGenGPT` (c2i / t2i)              |
| `check_image_draft_model` | `LlamaGenGPT`                          | `LlamaGenGPT`                          |
| `check_vlm_eagle_head`    | `TextEagleHead` / `VisionEagleHead`    | a transformers LLaVA / causal LM       |
| `check_vlm_draft_model`   | a transformers causal LM / LLaVA       | a transformers LLaVA / causal LM       |

Each checks the drafter's class (which kind of head for which kind of target) here, then the shapes it shares with
the target in the class's own `check_target` (`EagleHead`, `TextEagleHead`, `VisionEagleHead`; also run by the
drafters) or `ModelDrafter.check_compatible`.
"""

import logging

from mmspec.models.hf.inputs import has_vision


logger = logging.getLogger(__name__)

__all__ = ["check_image_draft_model", "check_image_eagle_head", "check_vlm_draft_model", "check_vlm_eagle_head"]


def origin(module, argument):
    """`argument='<folder>'` for a model loaded from a folder (`mmspec.models.load`, transformers' `from_pretrained`,
    `load_vlm_draft` record it as `config._name_or_path`), else `argument`."""
    path = getattr(getattr(module, "config", None), "_name_or_path", None)
    return f"{argument}={str(path)!r}" if path else argument


def _kind(module):
    """What a model is, for the messages: its class and, for the classes a zoo ships, what it drafts for."""
    name = type(module).__name__
    for_what = {
        "EagleHead": "an EAGLE head for a LlamaGen image model, SpeculativeARImagePipeline",
        "TextEagleHead": "an EAGLE head for a transformers VLM / LM, SpeculativeVLMPipeline",
        "VisionEagleHead": "a vision-aware EAGLE head for a transformers VLM, SpeculativeVLMPipeline",
        "LlamaGenGPT": "a LlamaGen image model",
    }.get(name)
    if for_what is None and _is_transformers(module):
        for_what = f"a transformers {getattr(module.config, 'model_type', '?')} model"
    return f"{name} ({for_what})" if for_what else name


def _is_transformers(module):
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def _named(module, argument, check):
    """Run `check()`; a ValueError it raises gets the drafter's folder (or argument) in front."""
    try:
        check()
    except ValueError as err:
        raise ValueError(f"{origin(module, argument)}: {err}") from err


def _wrong_kind(module, argument, expected):
    return TypeError(f"{origin(module, argument)}: expected {expected}, found {_kind(module)}")


def check_image_eagle_head(head, target, argument="eagle_head"):
    """`head` must be an `EagleHead` trained for the LlamaGen `target`: same width, vocabulary (codebook), condition
    prefix and token grid (`EagleHead.check_target`). TypeError / ValueError naming the folder and the mismatch."""
    from mmspec.models.llamagen.eagle import EagleHead

    if not isinstance(head, EagleHead):
        raise _wrong_kind(head, argument, "an EagleHead (an EAGLE head for a LlamaGen image model)")
    _named(head, argument, lambda: head.check_target(target))


def check_image_draft_model(draft, target, argument="draft_model"):
    """`draft` must be a `LlamaGenGPT` with the target's vocabulary (codebook), token grid, condition type (c2i / t2i),
    class count and condition prefix (`ModelDrafter.check_compatible`)."""
    from mmspec.drafters.model import ModelDrafter
    from mmspec.models.llamagen.gpt import LlamaGenGPT

    if not isinstance(draft, LlamaGenGPT):
        raise _wrong_kind(draft, argument, "a LlamaGenGPT (a small LlamaGen image model)")
    _named(draft, argument, lambda: ModelDrafter.check_compatible(draft, target))


def check_vlm_eagle_head(head, target, argument="eagle_head"):
    """`head` must be a `TextEagleHead` / `VisionEagleHead` trained for the transformers `target`: same hidden size and
    vocabulary, every `draft_vocab` id in it, and (vision-aware heads) the target's image tokens per image
    (`TextEagleHead.check_target` / `VisionEagleHead.check_target`)."""
    from mmspec.models.hf.eagle import TextEagleHead

    if not isinstance(head, TextEagleHead):
        raise _wrong_kind(head, argument, "a TextEagleHead or VisionEagleHead (an EAGLE head for a transformers VLM)")
    _named(head, argument, lambda: head.check_target(target))


def check_vlm_draft_model(draft, target, argument="draft_model"):
    """`draft` must be a transformers LM / LLaVA sharing the target's tokenizer: the same vocabulary (output head
    rows) and, when both see images, the same image token and image tokens per image."""
    if not _is_transformers(draft) or not callable(getattr(draft, "get_output_embeddings", None)):
        raise _wrong_kind(draft, argument, "a transformers causal LM or LLaVA sharing the target's tokenizer")
    if draft.get_output_embeddings() is None:
        raise _wrong_kind(draft, argument, "a transformers model with an output head (a *ForCausalLM or LLaVA)")

    def check():
        from mmspec.drafters.vision_eagle import image_tokens_per_image

        vocab, theirs = draft.get_output_embeddings().weight.shape[0], target.get_output_embeddings().weight.shape[0]
        if vocab != theirs:
            raise ValueError(
                f"the draft model's vocabulary does not match the target's: expected {theirs} tokens (the target's "
                f"output head), found {vocab}; draft and target must share the tokenizer"
            )
        if has_vision(draft) and hasattr(target.config, "vision_config"):
            pairs = [("image_token_id", getattr(draft.config, "image_token_id", None), target.config.image_token_id)]
            if hasattr(draft.model, "visual"):  # Qwen-VL: dynamic grids, one processor: the same patching and merge
                pairs += [(f"vision_config.{name}", getattr(draft.config.vision_config, name, None),
                           getattr(target.config.vision_config, name, None))
                          for name in ("patch_size", "spatial_merge_size", "temporal_patch_size")]  # fmt: skip
            else:  # LLaVA: a fixed number of image tokens per image
                pairs.append(("image tokens per image", image_tokens_per_image(draft.config),
                              image_tokens_per_image(target.config)))  # fmt: skip
            for name, mine, want in pairs:
                if mine != want:
                    raise ValueError(f"the draft model's {name} does not match the target's: expected {want}, "
                                     f"found {mine}")  # fmt: skip

    _named(draft, argument, check)
