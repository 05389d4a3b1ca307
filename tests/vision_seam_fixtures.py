"""A minimal vision-token head for the seam tests (`tests/test_vision_seam.py`): an EAGLE head with the
`VisionEagleHead` drafter API (`prefill_prompt`, a head cache with a per-row position offset) and the simplest policy
that decouples draft positions from cache slots -- keep every `stride`-th image pair, drop the others -- so the seam
(target prefill -> drafter -> head -> rounds) is tested apart from the real policies (`mmspec.models.vision_eagle`).
Pairs are the target's `(h[t], x[t+1])`, written at the target's position `t + 1` of `x[t+1]`; the cache's
`position_offset [rows]` maps later slots to positions (`position = slot + offset`)."""

import torch

from mmspec.cache import StaticKVCache, chain_inputs
from mmspec.models.hf_eagle import TextEagleHead


class OffsetCache(StaticKVCache):
    """The head cache plus `position_offset [rows]`, kept in step by `select_rows`."""

    def select_rows(self, index):
        super().select_rows(index)
        self.position_offset = self.position_offset[index]
        return self


class StrideImageHead(TextEagleHead):
    """`TextEagleHead` weights; at prefill it keeps the image pairs `t` (x[t+1] an image token) with
    `t % stride == stride - 1` and every text pair, at the target's positions."""

    stride = 4

    def setup_cache(self, rows, max_seq, dtype=None, device=None):
        cache = super().setup_cache(rows, max_seq, dtype, device)
        cache.__class__ = OffsetCache
        cache.position_offset = torch.zeros(rows, dtype=torch.long, device=cache.device)
        return cache

    def prefill_prompt(self, target, cache, hidden, input_ids, num_valid, inputs_embeds, image_mask):
        rows, width = input_ids.shape
        t = torch.arange(width, device=input_ids.device)
        image_next = torch.cat([image_mask[:, 1:], image_mask[:, :1] & False], dim=1)  # x[t+1] is an image token
        keep = (t[None] < num_valid[:, None] - 1) & (~image_next | (t[None] % self.stride == self.stride - 1))
        kept = keep.sum(1)
        order = torch.sort((~keep).long(), dim=1, stable=True).indices  # kept pairs first, in order
        m = max(int(kept.max()), 1)
        order = order[:, :m]
        valid = torch.arange(m)[None] < kept[:, None]
        h = hidden.gather(1, order[:, :, None].expand(-1, -1, hidden.shape[-1]))
        ids = input_ids.gather(1, order)
        positions = order + 1  # the target's position of x[t+1]
        slots = cache.lengths[:, None] + torch.arange(m)[None]
        causal = torch.ones(m, m, dtype=torch.bool).tril()[None] & valid[:, None, :]
        causal = causal | torch.eye(m, dtype=torch.bool)[None]  # a padded query sees itself (no empty rows)
        TextEagleHead.forward(self, h, ids, target, cache, positions, slots, causal)
        cache.commit(kept)
        cache.position_offset = num_valid - 1 - kept  # the pending pair: slot 1 + kept, position L_r
        image_kept = (keep & image_next).sum(1)
        return {"draft_image_tokens": image_kept, "choice": None, "choice_names": None}

    def forward(self, hidden, input_ids, target, cache, input_pos=None, write_slots=None, attention_mask=None,
                cache_mask=None, validate=True):  # fmt: skip
        if input_pos is None:
            input_pos, slots, causal = chain_inputs(cache.lengths, input_ids.shape[1])
            write_slots = slots if write_slots is None else write_slots
            attention_mask = causal if attention_mask is None else attention_mask
        write_slots = input_pos if write_slots is None else write_slots
        positions = input_pos + cache.position_offset[:, None]
        return super().forward(hidden, input_ids, target, cache, positions, write_slots, attention_mask, cache_mask,
                               validate)  # fmt: skip


def stride_head_from(head):
    """A `StrideImageHead` with `head`'s (a trained `TextEagleHead`) weights."""
    new = StrideImageHead(**{k: v for k, v in head.config.items() if not k.startswith("_")})
    new.load_state_dict(head.state_dict())
    return new.eval()
