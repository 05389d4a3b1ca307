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

from mmspec.cache import StaticKVCache
from mmspec.models.hf.positions import Positions


__all__ = ["MRopeDraftCache", "MRopePositions", "mrope_axes", "mrope_cos_sin", "mrope_params", "positions_for",
           "sequence_inputs", "token_types"]  # fmt: skip


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


def mrope_params(config) -> dict | None:
    """`{"mrope_section": [t, h, w], "mrope_interleaved": bool}` of a model whose text config uses M-RoPE (Qwen2-VL
    family: `rope_scaling` / `rope_parameters` hold `mrope_section`; Qwen3-VL interleaves the axes), else None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(text, name, None) or {}
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return {"mrope_section": [int(n) for n in rope["mrope_section"]],
                    "mrope_interleaved": bool(rope.get("mrope_interleaved", False))}  # fmt: skip
    return None


def mrope_axes(section, interleaved: bool = False) -> list[int]:
    """The position axis (0 temporal, 1 height, 2 width) each of the `sum(section)` rotary frequencies takes.
    Qwen2-VL / Qwen2.5-VL: contiguous chunks of `section[0]`, `section[1]`, `section[2]` frequencies; Qwen3-VL
    (`interleaved`): frequency `f` takes height where `f % 3 == 1` and `f < 3 * section[1]`, width where
    `f % 3 == 2` and `f < 3 * section[2]`, temporal elsewhere."""
    if not interleaved:
        return [axis for axis, n in enumerate(section) for _ in range(n)]
    return [axis if f % 3 == axis and f < 3 * section[axis] else 0 for f in range(sum(section))
            for axis in [f % 3]]  # fmt: skip


def mrope_cos_sin(rotary, x: Tensor, positions: Tensor, axes) -> tuple[Tensor, Tensor]:
    """M-RoPE's `(cos, sin)` `[rows, M, head_dim]` from a 1-D rotary embedding `rotary` (transformers' `(x,
    position_ids) -> (cos, sin)`, with `cos = [c ; c]` over the `head_dim / 2` frequencies) for 3-D `positions [3,
    rows, M]`: frequency `f` rotates by the position on axis `axes[f]` (`mrope_axes`). Applied as ordinary RoPE, this
    is the target's own multimodal rotary embedding."""
    cos, sin = zip(*(rotary(x, positions[a]) for a in range(3)))  # each [rows, M, head_dim]
    axes = torch.as_tensor(axes, device=x.device)
    pick = torch.cat([axes, axes])  # the two halves share their frequencies
    index = pick[None, None, None].expand(1, *cos[0].shape)
    return tuple(torch.stack(t).gather(0, index)[0] for t in (cos, sin))


class MRopeDraftCache(StaticKVCache):
    """A draft head's one-layer cache (slot `s` holds pair `s - 1`: `(h[s - 1], x[s])`) that also keeps, per row, the
    target's M-RoPE positions of the prompt and its `rope_delta`, so a pair sits at the target's position of its
    hidden state's token (the serving engines' convention, `mmspec.models.hf.eagle3`): the prompt's own 3-D ids
    for a prompt token, `t + rope_delta` on every axis after it. Both follow `select_rows`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_positions = None  # [3, rows, L]
        self.prompt_lengths = None  # [rows]
        self.rope_delta = None  # [rows]

    def set_prompt(self, positions: Tensor, lengths: Tensor) -> None:
        """The target's prompt positions `[3, rows, L]` (right-padded rows of `lengths [rows]`); `rope_delta` =
        the row's largest prompt position + 1 - its length (`get_rope_index`'s), no host read."""
        if positions is None or positions.dim() != 3 or positions.shape[0] != 3 or positions.shape[1] != self.rows:
            raise ValueError(f"positions must be the target's M-RoPE prompt positions [3, rows={self.rows}, L], got "
                             f"{None if positions is None else tuple(positions.shape)}")  # fmt: skip
        valid = torch.arange(positions.shape[2], device=positions.device)[None] < lengths[:, None]
        largest = torch.where(valid[None], positions, positions.new_full((), -1)).amax(dim=(0, 2))
        self.prompt_positions, self.prompt_lengths = positions.long(), lengths.long()
        self.rope_delta = largest + 1 - lengths.long()

    def pair_positions(self, slots: Tensor) -> Tensor:
        """`[3, rows, M]` RoPE positions of the pairs at cache `slots [rows, M]` (module docstring)."""
        if self.prompt_positions is None:
            raise ValueError("the head's M-RoPE positions need the target's prompt positions first (set_prompt)")
        token = slots - 1  # the token whose hidden state the pair carries
        table = self.prompt_positions
        inside = token < self.prompt_lengths[:, None]
        index = token.clamp(0, table.shape[2] - 1)[None].expand(3, -1, -1)
        after = (token + self.rope_delta[:, None])[None].expand(3, -1, -1)
        return torch.where(inside[None], table.gather(2, index), after)

    def select_rows(self, index):
        super().select_rows(index)
        if self.prompt_positions is not None:
            self.prompt_positions = self.prompt_positions[:, index]
            self.prompt_lengths, self.rope_delta = self.prompt_lengths[index], self.rope_delta[index]
        return self
