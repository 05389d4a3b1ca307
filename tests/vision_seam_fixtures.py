"""A minimal vision-token head for the seam tests (`tests/drafters/test_vision_seam.py`): an EAGLE head with the
`VisionEagleHead` drafter API (`prefill_prompt`, a head cache with a per-row position offset) and the simplest policy
that decouples draft positions from cache slots -- keep every `stride`-th image pair, drop the others -- so the seam
(target prefill -> drafter -> head -> rounds) is tested apart from the real policies (`mmspec.drafters.vision_eagle`).
Pairs are the target's `(h[t], x[t+1])`, written at the target's position `t + 1` of `x[t+1]`; the cache's
`position_offset [rows]` maps later slots to positions (`position = slot + offset`)."""

import torch

from mmspec.cache import StaticKVCache
from mmspec.models.hf.eagle import TextEagleHead


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
        self(h, ids, target, cache, positions, slots, causal)  # offsets are 0 until the end of the prefill
        cache.commit(kept)
        cache.position_offset = num_valid - 1 - kept  # the pending pair: slot 1 + kept, position L_r
        image_kept = (keep & image_next).sum(1)
        return {"draft_image_tokens": image_kept, "choice": None, "choice_names": None}

    def _rope_positions(self, input_pos, cache):  # slot -> the target's position (0 offset during the prefill)
        return input_pos + cache.position_offset[:, None]


def stride_head_from(head):
    """A `StrideImageHead` with `head`'s (a trained `TextEagleHead`) weights."""
    new = StrideImageHead(**{k: v for k, v in head.config.items() if not k.startswith("_")})
    new.load_state_dict(head.state_dict())
    return new.eval()


def record_head_positions(pipe, head, run):
    """Run `run()` and record, for every forward of the head's decoder layer, the RoPE positions it received and
    the target's positions of those tokens: at prefill the kept prompt pairs, then per round the accepted pairs
    (the pending token sits at `P = L_r + count - 1`) and the drafts (depth `d` at `P + d`)."""
    calls, now = [], {"ctx": {}}
    make = pipe.make_drafter

    def make_drafter(*args, **kwargs):
        drafter = make(*args, **kwargs)
        lengths = args[4]  # the prompt lengths of the call's rows
        prefill, propose, setup = drafter.prefill, drafter.propose, drafter.head.setup_cache
        start = {}

        def setup_cache(*a, **k):
            cache = setup(*a, **k)
            start["lengths"] = cache.lengths.clone()
            return cache

        def traced_prefill(state, target_out):
            ctx = now["ctx"] = dict(phase="prefill", lengths=lengths, image_mask=target_out.image_mask)
            drafter.head.setup_cache = setup_cache
            try:
                prefill(state, target_out)
            finally:
                del drafter.head.setup_cache
            ctx.update(kept=drafter.cache.lengths - start["lengths"], image_tokens=drafter.draft_image_tokens)

        def traced_propose(state):
            pending = lengths[state.ids] + state.count - 1
            now["ctx"] = dict(phase="round", pending=pending, num_valid=drafter.num_valid.clone(), calls=0)
            return propose(state)

        drafter.prefill, drafter.propose = traced_prefill, traced_propose
        return drafter

    def hook(module, args):
        ctx = now["ctx"]
        calls.append((ctx["phase"], args[1].clone(), ctx if ctx["phase"] == "prefill" else dict(ctx)))
        if ctx["phase"] == "round":
            ctx["calls"] += 1

    pipe.make_drafter = make_drafter
    handle = head.rotary.register_forward_pre_hook(hook)
    try:
        out = run()
    finally:
        handle.remove()
        del pipe.make_drafter
    return out, calls


def check_positions(calls):
    """Every kept token at the target's position (see `record_head_positions`)."""
    prefill = [(pos, ctx) for kind, pos, ctx in calls if kind == "prefill"]
    assert prefill, "the head wrote nothing at prefill"
    rounds = [(pos, ctx) for kind, pos, ctx in calls if kind == "round"]
    assert rounds
    ctx = prefill[-1][1]
    written = torch.cat([pos for pos, _ in prefill], dim=1)
    for r in range(written.shape[0]):
        length, kept = int(ctx["lengths"][r]), int(ctx["kept"][r])
        got = written[r, :kept].tolist()
        image = ctx["image_mask"][r, :length].tolist()
        assert got == sorted(set(got)) and all(1 <= q <= length - 1 for q in got), (r, got)
        text_pairs = {t + 1 for t in range(length - 1) if not image[t + 1]}  # pairs whose next token is text
        assert text_pairs <= set(got), (r, sorted(text_pairs - set(got)))
        image_pairs = [q for q in got if image[q]]  # the policy's tokens, at image positions
        assert len(image_pairs) == int(ctx["image_tokens"][r]) and len(got) == len(text_pairs) + len(image_pairs)
    for pos, ctx in rounds:
        pending, num_valid, i = ctx["pending"], ctx["num_valid"], ctx["calls"]
        for r in range(pos.shape[0]):
            if i == 0:  # the accepted pairs: positions P - n + 1 .. P
                n = int(num_valid[r])
                assert pos[r, :n].tolist() == list(range(int(pending[r]) - n + 1, int(pending[r]) + 1)), (r, i)
            else:  # depth-i drafts (chain token or tree frontier)
                assert (pos[r] == pending[r] + i).all(), (r, i, pos[r].tolist(), int(pending[r]))
