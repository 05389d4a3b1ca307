"""Small-model drafter: a smaller AR model of the same family drafts a chain of K tokens (Leviathan et al. 2023,
arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318), for discrete-token image models (`LlamaGenGPT`).

The draft model runs the same CFG streams as the target (`mmspec.decoding.guidance.Guidance`) and its logits go through
the *same* processing as the target's, so `q_draft` is exactly the distribution each draft token was drawn from (a
one-hot under greedy decoding, i.e. a point-mass draft).

Cache protocol (one `StaticKVCache` of the draft model, per-row lengths):

* after `prefill`, the draft cache holds the condition prefix; the target's first token is *pending* (known, not yet
  in any cache).
* `propose` feeds `[last committed token, pending]` at slots `L - 1, L` (re-computing slot `L - 1` keeps the shapes
  uniform: that slot is missing exactly when the previous round accepted all K drafts), then K - 1 single-token
  forwards; K draft forwards in all. On the first round only `[pending]` is fed.
* `commit` rolls the draft cache back to everything but the last committed token (per row), which is always a
  correct prefix, whatever was accepted.
"""

import logging

import torch

from mmspec.decoding.captured_draft import CapturedDraft, captures_rounds
from mmspec.decoding.compiled import pad_rows, row_bucket
from mmspec.decoding.drafter import Proposal
from mmspec.decoding.graph_uniforms import resolve_uniforms
from mmspec.drafters.chain import chain_lengths, draw_chain, refeed, sample_chain, stops_in_round
from mmspec.drafters.lengths import FixedLength


logger = logging.getLogger(__name__)

__all__ = ["ModelDrafter", "chain_round"]


class ModelDrafter:
    """Drafts chains with a small `LlamaGenGPT` (see module docstring; `mmspec.decoding.drafter.Drafter`).

    Args:
        model: the draft `LlamaGenGPT`; its vocabulary, class count and token grid must match the target's.
        guidance: the call's `Guidance` (row layout + processing shared with the target).
        num_draft_tokens: K, the chain length.
        cond, cond_mask: the condition rows the target was prefilled with (model rows, all streams).
        length: optional draft-length policy (`mmspec.decoding.draft_length.DraftLength`) with `k_max =
            num_draft_tokens`: each row's K per round. Default: K every round.
    """

    needs_hidden = False

    def __init__(self, model, guidance, num_draft_tokens, cond, cond_mask=None, length=None):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
        self.model, self.guidance, self.k = model, guidance, int(num_draft_tokens)
        self.cond, self.cond_mask = cond, cond_mask
        self.max_width = self.k
        if length is not None and length.k_max != self.k:
            raise ValueError(f"length: a policy with k_max = num_draft_tokens = {self.k}, got {length.k_max}")
        self.length = FixedLength(self.k) if length is None else length
        self.cache = None
        self.draft_forwards = 0
        self.compiler = None  # `mmspec.decoding.compiled.Compiler`: the draft forwards run captured
        self.captured = None  # with `verify` on, the call's `CapturedDraft`: a whole chain drafts as one graph
        self.live = None  # captured, after a compaction: the items in use (the cache's others are padding)

    @staticmethod
    def check_compatible(model, target):
        """Raise ValueError unless the draft `model` can draft for `target` (same token space and condition)."""
        for name in ("vocab_size", "block_size", "model_type", "num_classes", "cls_token_num"):
            mine, theirs = getattr(model.config, name), getattr(target.config, name)
            if mine != theirs:
                raise ValueError(
                    f"drafter {name}={mine} does not match the target's {name}={theirs}: "
                    "draft and target must share the token vocabulary and condition space"
                )

    def prefill(self, state, target_out):
        """Reset the draft cache and write the condition prefix."""
        max_seq = self.model.config.cls_token_num + state.max_length + self.k + 2
        self.cache = self.model.setup_cache(self.cond.shape[0], max_seq)
        # the target's prefill has range-checked these class ids, and `check_compatible` the class count: no re-read
        self.model.prefill(self.cond, self.cache, cond_mask=self.cond_mask, check_range=False)
        self.live = None
        self._first_round = True
        self.length.start(state.count.shape[0], state.count.device)
        self.captured = (CapturedDraft(self.compiler, state.batch_size, state.tokens.device)
                         if captures_rounds(self.compiler) else None)  # fmt: skip

    @torch.no_grad()
    def propose(self, state):
        """Draft `min(K, remaining)` tokens after each row's pending token."""
        g = self.guidance
        num_draft, length = chain_lengths(self.length, state)
        live_rows = None if self.live is None else self._live_rows
        feed = refeed(state, self._first_round)
        if self.compiler is not None:
            self.compiler.static(self.cache)
        if self.captured is not None and not stops_in_round(self.length):  # the whole chain as one graph
            count = 0 if g.greedy else self.k  # k_max uniforms a row every sampled round
            tokens, q_draft, total, lengths = self.captured(chain_round, state, count, self.model, self.cache, feed,
                                                            live_rows, g, length=length)  # fmt: skip
            g.record("draft", total)
            self.cache.lengths = lengths
        else:
            model = self.model if self.compiler is None else self.compiler.forward("drafter", self.model)
            tokens, q_draft, num_draft = sample_chain(_chain_step(model, self.cache, g, live_rows), feed, length, g,
                                                      state.generator, num_draft, confidence=self.length.confidence,
                                                      stop=getattr(self.length, "stop", None),
                                                      draws=self.k)  # fmt: skip
        self.draft_forwards += tokens.shape[1]
        self._first_round = False
        self._num_draft = num_draft
        return Proposal(tokens, num_draft, q_draft=q_draft)

    def commit(self, result, target_out, state):
        """Keep everything but the last committed token (prefix + `count - 2` tokens), which the next round re-feeds."""
        count = pad_rows(state.count, self.cache.rows // self.guidance.streams)  # padding rows: the first's length
        lengths = self.guidance.rows(self.model.config.cls_token_num + count - 2)
        self.cache.rollback(torch.minimum(lengths, self.cache.lengths))
        self.length.update(self._num_draft, result.num_accepted, state.finished)

    def sync_value(self):
        """An adaptive draft length's next width, read with the loop's one read per round (None: fixed K)."""
        return self.length.sync_value()

    def sync_host(self, value) -> None:
        self.length.sync_host(value)

    def select_rows(self, index):
        """Keep batch items `index`; captured, the cache keeps `row_bucket(len(index))` items (the kept ones, then
        copies of the first as padding whose drafts are never read), as the target's (`CachedTarget.select_rows`)."""
        items = self.cache.rows // self.guidance.streams
        self.length.select_rows(index)  # the live rows (the state's)
        if self.compiler is not None:
            self.live = index.shape[0]
            index = pad_rows(index, row_bucket(self.live, items))
            self._live_rows = self.guidance.row_index(torch.arange(self.live, device=index.device), index.shape[0])
        self.cache.select_rows(self.guidance.row_index(index, items))


def _chain_step(model, cache, guidance, live_rows):
    """A chain's `step` (`mmspec.drafters.chain`): feeds `[last committed, pending]` / `[pending]`, then each draft,
    at the cache's row bucket (captured: the live items padded), commits it, and returns the logits after it of the
    live rows (`live_rows`, None: every row)."""

    def step(feed):
        rows = guidance.rows(pad_rows(feed, cache.rows // guidance.streams))
        logits = model(rows, cache, validate=False).logits[:, -1]  # [rows, V]; no range syncs
        cache.commit(feed.shape[1])
        return logits if live_rows is None else logits[live_rows]

    return step


def chain_round(model, cache, feed, live_rows, guidance, uniforms, keys, round_index, *, length):
    """A round's chain of `length` drafts (no stops) as a pure function of its inputs, for one captured graph
    (`mmspec.decoding.captured_draft`): drawn on `uniforms` (or Philox blocks of `keys`; greedy: None) by
    `mmspec.drafters.chain.draw_chain`. Returns `(draft_tokens, q_draft, sum of q_draft, the cache's committed
    lengths)`."""
    uniforms = resolve_uniforms(uniforms, keys, round_index, length)
    step = _chain_step(model, cache, guidance, live_rows)
    tokens, q_draft, total = draw_chain(step, feed, length, guidance, uniforms)
    return tokens, q_draft, total, cache.lengths
