"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) for `HFTarget`: 3-D position ids `[3, rows, M]`.

Qwen's multimodal rotary embedding gives every token three position ids (temporal, height, width). Text tokens
advance all three together; an image's tokens take their grid coordinates, so an image of `h x w` merged patches
advances the text position by `max(h, w)`, not by its `h * w` tokens. Hence a row's position and its cache slot
drift apart by a per-row constant once the prompt is over (Wang et al. 2024, "Qwen2-VL", section 2.1):

    prefill:   position_ids = model.model.get_rope_index(input_ids, image_grid_thw, mask)   # the model's own
    after it:  position[r, axis] = logical[r] + rope_delta[r]     (every axis, logical = slot or length + depth)

`rope_delta[r] = max prompt position + 1 - L_r`, which `get_rope_index` returns; a tree node's logical index is
its row's committed length plus its depth, so siblings share a position, as in a chain. The provider is chosen by
`positions_for(model)`: any model whose base has `get_rope_index` (transformers' Qwen-VL classes) gets M-RoPE, every
other model position == slot.
"""

import inspect

import torch
from torch import Tensor

from mmspec.models.hf.positions import Positions


__all__ = ["MRopePositions", "positions_for", "sequence_inputs", "token_types"]


def token_types(config, input_ids: Tensor) -> Tensor:
    """`[rows, L]` Qwen's `mm_token_type_ids` from the ids themselves: 1 at image placeholders, 2 at video
    placeholders, 0 elsewhere (recomputed, so they always line up with the right-aligned ids the target gets)."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    for value, name in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, name, None)
        if token is not None:
            types = torch.where(input_ids == token, value, types)
    return types


class MRopePositions(Positions):
    """3-D positions: the model's own `get_rope_index` over the prompt at prefill, then `logical + rope_delta` on
    every axis (module docstring). `rope_delta [rows]` follows the cache's rows through `select_rows`."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def prompt(self, input_ids: Tensor, lengths: Tensor, model_inputs: dict) -> Tensor:
        """`[3, rows, L]` the prompt's position ids (right-padded rows: `lengths [rows]`; padding gets 0 and is
        never attended to); sets `offset = -rope_delta`. `model_inputs`: the processor's (`image_grid_thw`,
        `video_grid_thw`, `second_per_grid_ts`, ...)."""
        base = self.model.model
        mask = (torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] < lengths[:, None]).long()
        known = dict(model_inputs, attention_mask=mask, mm_token_type_ids=token_types(self.model.config, input_ids))
        accepted = inspect.signature(base.get_rope_index).parameters
        kwargs = {k: v for k, v in known.items() if k in accepted and k != "input_ids"}
        position_ids, delta = base.get_rope_index(input_ids, **kwargs)
        self.offset = -delta.reshape(-1).to(device=input_ids.device, dtype=torch.long)
        return position_ids

    def __call__(self, logical: Tensor) -> Tensor:
        return super().__call__(logical)[None].expand(3, -1, -1)


def positions_for(model) -> Positions:
    """The position provider a transformers model needs: M-RoPE for the Qwen-VL family (its base model has
    `get_rope_index`), else position == slot."""
    if callable(getattr(getattr(model, "model", None), "get_rope_index", None)):
        return MRopePositions(model)
    return Positions()


def sequence_inputs(model, input_ids: Tensor, attention_mask: Tensor, model_inputs: dict) -> dict:
    """Keyword inputs of one forward of `model.model` over whole right-padded sequences (prompt + answer, as
    training and tests run them): the processor's `model_inputs` without its prompt-wide `mm_token_type_ids`, plus,
    for M-RoPE, the model's own 3-D `position_ids` over the sequences (`attention_mask [rows, T]` 1 = token)."""
    inputs = {k: v for k, v in model_inputs.items() if k != "mm_token_type_ids"}
    positions = positions_for(model).prompt(input_ids, attention_mask.sum(1), inputs)
    return inputs if positions is None else {**inputs, "position_ids": positions}
