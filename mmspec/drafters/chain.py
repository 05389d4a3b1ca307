"""Sampled draft chains: the loop every chain drafter shares (`ModelDrafter`, `TextModelDrafter`, EAGLE's
`draft_chain`): each draft token is drawn from `q_draft`, the drafter's logits through the call's processing
(`mmspec.decoding.guidance.Guidance`: CFG, temperature, top-k / top-p; one-hot under greedy decoding), and fed back.
The drafters differ only in the step that turns what was fed into the next logits.

`draw_chain` is the same chain as a pure tensor function of pre-drawn uniforms, for a drafter whose whole round of
drafting runs as one captured graph (`mmspec.decoding.captured_draft`)."""

import torch

from mmspec.random import num_rows, rand
from mmspec.sampling import inverse_cdf, sample


__all__ = ["chain_lengths", "draw_chain", "refeed", "sample_chain", "stops_in_round"]


def refeed(state, first_round):
    """What a draft model is fed at the start of a round (`[B, M]`): `[pending]` on the first round, else `[last
    committed token, pending]` (the draft cache was rolled back to all committed tokens but the last)."""
    if first_round:
        return state.pending[:, None]
    return torch.stack([state.last_committed, state.pending], dim=1)


def chain_lengths(policy, state):
    """A round's chain shape from the draft-length `policy` (`mmspec.decoding.draft_length.DraftLength`): each row's
    `num_draft [B]` (its K, never past its last token, at least 1) and the chain's padded length on the host (the
    widest row's K, no drafts past the last token of any row)."""
    k, length = policy.lengths(), min(policy.host_max, state.max_remaining)
    if k is None:  # every row drafts k_max
        return state.remaining().clamp(min=1, max=policy.k_max), length
    return torch.minimum(state.remaining(), k).clamp(min=1, max=length), length


def stops_in_round(policy) -> bool:
    """The draft-length `policy` may stop a chain inside a round (the confidence stop, a calibrated stop): a host read
    after each draft, so the chain is drafted eagerly (`sample_chain`), never as one captured graph."""
    return policy.confidence is not None or getattr(policy, "stop", None) is not None


def sample_chain(step, feed, length, guidance, generator, num_draft=None, confidence=None, stop=None, draws=None):
    """Draw a chain of `length` draft tokens.

    Args:
        step: `step(feed) -> logits [rows, V]` after the last token of `feed` (model rows, every CFG stream); called
            once per draft token, first with `feed`, then with each drawn token `[B, 1]`.
        feed: the first input of `step` (`[B, M]` tokens, or whatever `step` takes).
        length: tokens to draw.
        guidance: the call's `Guidance` (`probs(logits, "draft")` is exactly what a token is drawn from).
        generator: one `torch.Generator` or one per batch item.
        num_draft: optional `[B]` drafts each item needs.
        confidence: optional in (0, 1): an item stops drafting (`num_draft` capped) after a token the drafter gave
            a raw (unprocessed; under CFG the conditional stream's) probability below this; the loop ends when no
            item drafts further.
        stop: optional `stop(d, prob [B], num_draft [B]) -> num_draft [B]`, a draft-length policy's in-round stop
            (`"calibrated"`), called after draft `d` (0-based) with each item's raw probability of its draw; an item
            whose returned `num_draft` is at most `d + 1` drafts no further (it keeps every draft it drew).
        draws: with per-item generators, the drafter's longest chain (`>= length`): each item draws that many
            uniforms up front, every round whatever this round's length, and its token `d` is the inverse CDF of its
            `q_draft` at its uniform `d` (`sample`'s law): its randomness does not depend on the rest of the batch,
            and no per-item count is read (as `draw_chain`'s). Required with per-item generators.

    Host reads: none without a stop; with `confidence` or `stop`, one after each draft but the last (whether any item
    drafts on), so a chain of `n` drafts reads `n - 1` times if it ran to `length`, `n` if it stopped early.

    Returns:
        `(draft_tokens [B, K], q_draft [B, K, V], num_draft)`; `K <= length` (fewer only with `confidence` or `stop`).
    """
    per_row = num_rows(generator) is not None and not guidance.greedy  # a fixed count of uniforms a row
    if per_row and (draws is None or draws < length):
        raise ValueError(f"sample_chain: per-row generators need draws >= length ({length}), got {draws}")
    tokens, probs = [], []
    for d in range(length):
        logits = step(feed)
        q = guidance.probs(logits, "draft")  # [B, V] exactly what the draft is drawn from
        if not per_row:
            tok = sample(q, generator)
        else:
            if d == 0:
                uniforms = rand((q.shape[0], draws), generator, device=q.device, dtype=torch.float64)
            tok = inverse_cdf(q, uniforms[:, d : d + 1])
        tokens.append(tok)
        probs.append(q)
        feed = tok[:, None]
        if confidence is not None or stop is not None:  # rows stop by their raw draft probability
            raw = logits[: feed.shape[0]]  # CFG: the conditional stream's rows come first
            prob = torch.softmax(raw.float(), dim=-1).gather(1, feed)[:, 0]
            if confidence is not None:  # after an unsure token
                num_draft = torch.where(prob >= confidence, num_draft, num_draft.clamp(max=d + 1))
            if stop is not None:
                num_draft = stop(d, prob, num_draft)
            if d + 1 < length and not bool((num_draft > d + 1).any()):  # one read per draft but the last
                break
    return torch.stack(tokens, 1), torch.stack(probs, 1), num_draft


def draw_chain(step, feed, length, guidance, uniforms):
    """`sample_chain`'s chain of `length` drafts (no stops) on pre-drawn uniforms `[B, >= length]`: token `d` of row
    `b` is the inverse CDF of its `q_draft` at `uniforms[b, d]` (`mmspec.sampling.inverse_cdf`, `sample`'s default
    method), or the argmax of the one-hot `q_draft` when `uniforms` is None (greedy: what `sample` draws from a point
    mass). A pure tensor function: the distributions go through `guidance.process` (their running sum is returned for
    `guidance.record`, which a graph cannot call).

    Returns:
        `(draft_tokens [B, length], q_draft [B, length, V], total)`, `total` the sum of every `q_draft`.
    """
    tokens, probs = [], []
    for d in range(length):
        q = guidance.process(step(feed))  # [B, V]
        tok = q.argmax(-1) if uniforms is None else inverse_cdf(q, uniforms[:, d, None])
        tokens.append(tok)
        probs.append(q)
        feed = tok[:, None]
    q_draft = torch.stack(probs, 1)
    return torch.stack(tokens, 1), q_draft, q_draft.sum()
