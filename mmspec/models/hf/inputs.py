"""What a VLM's decoder receives at prefill: the input embeddings with the projected image features merged in
(`inputs_embeds [rows, L, dim]`) and where the image tokens are (`image_mask [rows, L]`).

Vision-aware drafters (ViSpec, SpecVLM, MSD: `mmspec.drafters.vision_eagle`) read the target's projector outputs
`E_img`, not its hidden states at image positions. The vision tower must still run once: `capture_decoder_inputs`
records the decoder's `inputs_embeds` during the target's own prefill forward (a forward pre-hook on the decoder
stack, `decoder_of`), so nothing is recomputed and the merge is exactly the model's.
"""

from contextlib import contextmanager

import torch
from torch import Tensor


__all__ = ["capture_decoder_inputs", "capture_layer_inputs", "has_vision", "image_token_mask"]


def decoder_of(model):
    """The decoder stack of a causal LM / LLaVA (`model.model.language_model` or `model.model`)."""
    base = model.model
    return getattr(base, "language_model", base)


@contextmanager
def capture_decoder_inputs(model):
    """Within the block, every forward of `model`'s decoder stack stores what it received in the yielded dict:
    `inputs_embeds [rows, L, dim]` (a causal LM's decoder gets `input_ids`; their embeddings are stored)."""
    decoder, seen = decoder_of(model), {}

    def hook(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            embeds = model.get_input_embeddings()(ids)
        seen["inputs_embeds"] = embeds.detach()

    handle = decoder.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def has_vision(model) -> bool:
    """The model reads images: a vision tower on its base model (`vision_tower`: LLaVA family; `visual`: Qwen-VL)."""
    base = getattr(model, "model", None)
    return hasattr(base, "vision_tower") or hasattr(base, "visual")


def image_token_mask(model, input_ids: Tensor) -> Tensor:
    """`[rows, L]` True at image placeholder tokens (`config.image_token_id` / `image_token_index`); all False for a
    model without images."""
    config = model.config
    image_id = getattr(config, "image_token_id", None)
    image_id = getattr(config, "image_token_index", None) if image_id is None else image_id
    if image_id is None or not has_vision(model):
        return torch.zeros_like(input_ids, dtype=torch.bool)
    return input_ids == image_id


@contextmanager
def capture_layer_inputs(model, layers):
    """Within the block, every forward of `model`'s decoder stack stores the input of each decoder layer in `layers`
    (indices into its `layers`) in the yielded dict, `{index: [rows, L, dim]}`: the residual stream entering layer
    `i`, i.e. transformers' `hidden_states[i]` (0: the input embeddings) and the "aux hidden state" `i` of vLLM's
    EAGLE-3 (`mmspec.models.hf.eagle3`). A later forward in the block overwrites the entries."""
    stack = decoder_of(model).layers
    seen, handles = {}, []

    def hook_for(index):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            seen[index] = hidden.detach()

        return hook

    try:
        for index in layers:
            handles.append(stack[index].register_forward_pre_hook(hook_for(index), with_kwargs=True))
        yield seen
    finally:
        for handle in handles:
            handle.remove()
