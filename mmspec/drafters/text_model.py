"""Draft-LM drafter for transformers targets: a smaller causal LM / LLaVA sharing the target's tokenizer drafts a
chain of K tokens (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318) -- the text twin of
`mmspec.drafters.model.ModelDrafter`, with the same cache protocol, run through `mmspec.models.hf.target.HFTarget`:

* `prefill` writes the prompt (and, for a LLaVA draft, its image) into the draft's own `StaticKVCache`; the target's
  first token is pending.
* `propose` feeds `[last committed token, pending]` (only `[pending]` on the first round), then K - 1 single tokens;
  each draft token is drawn from `q_draft`, the draft's logits through the *same* processing as the target's (one-hot
  under greedy decoding).
* `commit` rolls the draft cache back to the prompt + all committed tokens but the last (always a correct prefix).

With `top_k > 1` the draft LM grows an EAGLE-2 dynamic tree instead (`mmspec.drafters.tree.grow_tree`; Li et al.
2024, arXiv 2406.16858): after the `[last committed, pending]` forward, each level's frontier of `top_k` nodes is fed
in one forward (scratch slots, ancestor masks), every node proposes its `top_k` most likely children under the draft's
raw log-probabilities, and the best `num_draft_tokens` nodes of `depth` levels are verified as one token tree
(deterministic children, `mmspec.verify.tree`: lossless in every mode). At batch 1 on a memory-bound device a forward
of `top_k` tokens costs about what one token costs, so the tree buys acceptance for little draft time.
"""

import torch

from mmspec.cache import chain_inputs
from mmspec.decoding.captured_draft import CapturedDraft, captures_rounds
from mmspec.decoding.drafter import JointSync, Proposal
from mmspec.decoding.graph_uniforms import resolve_uniforms
from mmspec.drafters.chain import chain_lengths, draw_chain, refeed, sample_chain, stops_in_round
from mmspec.drafters.lengths import ConfidenceStop, FixedLength
from mmspec.drafters.tree import grow_tree
from mmspec.models.hf.inputs import decoder_of
from mmspec.models.hf.target import HFTarget


__all__ = ["TextModelDrafter", "chain_round"]


class TextModelDrafter:
    """Drafts chains with a small transformers LM (see module docstring; `mmspec.decoding.drafter.Drafter`).

    Args:
        draft: the draft model wrapped as `HFTarget(model, guidance, source="draft")`.
        num_draft_tokens: K, the chain length (`top_k == 1`) or the tree's node count.
        input_ids, lengths, model_inputs: the right-padded prompt `input_ids [B, L]`, `lengths [B]` and extra model
            inputs (`pixel_values`) the target was prefilled with.
        top_k: 1 = a sampled chain; > 1 = an EAGLE-2 tree with `top_k` children per node and `depth` levels.
        depth: tree levels (trees only; default 5).
        confidence: chains only, optional in (0, 1): a row stops drafting after a token the draft gave a raw
            (unprocessed) probability below this -- transformers' `assistant_confidence_threshold`. Depends on the
            draft alone, so verification stays lossless; at batch 1 it saves the draft forwards a rejection would
            waste and lets `num_draft_tokens` be larger. The same as `length=ConfidenceStop(num_draft_tokens,
            confidence)`.
        length: chains only, optional: the draft-length policy (`mmspec.decoding.draft_length.DraftLength`, e.g.
            `mmspec.drafters.lengths.HeuristicLength(num_draft_tokens)`): each row's K per round, at most its
            `k_max`, which must equal `num_draft_tokens`. Default: K = `num_draft_tokens` every round.
    """

    needs_hidden = False

    def __init__(self, draft: HFTarget, num_draft_tokens: int, input_ids, lengths, *, top_k=1, depth=5,
                 confidence=None, length=None, **model_inputs):  # fmt: skip
        for name, value in (("num_draft_tokens", num_draft_tokens), ("top_k", top_k), ("depth", depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if confidence is not None and (isinstance(confidence, bool) or not 0 < float(confidence) < 1):
            raise ValueError(f"draft_confidence must be a number in (0, 1) or None, got {confidence!r}")
        if confidence is not None and top_k != 1:
            raise ValueError("draft_confidence applies to draft chains (tree_top_k=1)")
        self.confidence = None if confidence is None else float(confidence)
        self.draft, self.k, self.top_k, self.depth = draft, int(num_draft_tokens), int(top_k), int(depth)
        self.input_ids, self.lengths, self.model_inputs = input_ids, lengths, model_inputs
        self.chain = self.top_k == 1
        self.max_width = self.k if self.chain else min(self.k, self.top_k + (self.depth - 1) * self.top_k**2)
        self.draft_forwards = 0
        if length is not None and (not self.chain or confidence is not None or length.k_max != self.k):
            raise ValueError("length: a chain's policy (tree_top_k=1, no confidence given apart) with k_max = "
                             f"num_draft_tokens = {self.k}")  # fmt: skip
        if length is None:
            length = FixedLength(self.k) if self.confidence is None else ConfidenceStop(self.k, self.confidence)
        self.length = length
        self._sync = JointSync(self.draft, self.length)

    @property
    def compiler(self):
        """The draft adapter's `mmspec.decoding.compiled.Compiler` (None: eager); set before `prefill`, which then
        allocates the draft cache whole. Its forwards run captured, role "drafter"."""
        return self.draft.compiler

    @compiler.setter
    def compiler(self, compiler):
        self.draft.compiler = compiler

    def prefill(self, state, target_out):
        scratch = (self.k if self.chain else self.depth * self.top_k) + 2
        self.draft.prefill(self.input_ids, self.lengths, state.max_length, scratch, **self.model_inputs)
        self.prompt_lengths = self.lengths
        self._first_round = True
        self.length.start(state.count.shape[0], state.count.device)
        self.captured = (CapturedDraft(self.compiler, state.batch_size, state.tokens.device)
                         if self.chain and captures_rounds(self.compiler) else None)  # fmt: skip

    @torch.no_grad()
    def propose(self, state):
        if not self.chain:
            return self._propose_tree(state)
        num_draft, length = chain_lengths(self.length, state)
        if self.captured is not None and not stops_in_round(self.length):  # the whole chain as one graph
            return self._propose_captured(state, num_draft, length)
        tokens, q_draft, num_draft = sample_chain(self._last_logits, refeed(state, self._first_round), length,
                                                  self.draft.guidance, state.generator, num_draft,
                                                  confidence=self.length.confidence,
                                                  stop=getattr(self.length, "stop", None),
                                                  draws=self.k)  # fmt: skip
        self.draft_forwards += tokens.shape[1]
        self._first_round = False
        self._num_draft = num_draft
        return Proposal(tokens, num_draft, q_draft=q_draft)

    def _propose_captured(self, state, num_draft, length):
        """`propose`'s chain as one graph (`mmspec.decoding.captured_draft`): `[last committed, pending]` (the first
        round: `[pending]`) and the `length - 1` drafts after it on one attention window of the draft's cache, made
        before the graph."""
        g, cache = self.draft.guidance, self.draft.cache
        feed = refeed(state, self._first_round)
        window = self.draft.round_window(feed.shape[1] + length - 1)
        self.compiler.static(cache, *(t for t in (self.draft.vocab, self.draft.vocab_weight) if t is not None))
        count = 0 if g.greedy else self.k  # k_max uniforms a row every sampled round
        tokens, q_draft, total, lengths = self.captured(chain_round, state, count, self.draft, feed, g,
                                                        length=length, window=window)  # fmt: skip
        self._first_round = False
        g.record("draft", total)
        cache.lengths = lengths
        self.draft_forwards += length
        self._num_draft = num_draft
        return Proposal(tokens, num_draft, q_draft=q_draft)

    def _last_logits(self, feed):
        """Feed a chain `[B, M]` to the draft, commit it, and return the logits after its last token `[B, V]`."""
        cache = self.draft.cache
        logical, slots, mask = chain_inputs(cache.lengths, feed.shape[1])
        hidden = self.draft.run(decoder_of(self.draft.model), cache, slots, logical, mask, capture=True,
                                input_ids=feed)  # fmt: skip
        cache.commit(feed.shape[1])
        return self.draft.logits(hidden[:, -1])

    @staticmethod
    def _log_probs(logits):  # [..., V] -> raw draft log-probabilities (tree scores)
        return torch.log_softmax(logits.float(), dim=-1).nan_to_num(nan=float("-inf"))  # NaN: see Guidance.check

    def _propose_tree(self, state):
        root = self._last_logits(refeed(state, self._first_round))  # [B, V]
        self.draft.guidance.probs(root, "draft")  # only for the NaN check of the draft's logits (Guidance.check)
        self._first_round = False
        cache, decoder, base = self.draft.cache, decoder_of(self.draft.model), self.draft.cache.lengths

        def expand(tokens, parent, ancestry, d):  # feed the depth d - 1 frontier at scratch slots after `base`
            k, n_all = tokens.shape[1], ancestry.shape[2]
            key_slots = base[:, None] + torch.arange(n_all, device=base.device)[None]
            logical = (base + d - 2)[:, None].expand(-1, k)
            hidden = self.draft.run(decoder, cache, key_slots[:, n_all - k :], logical, ancestry, key_slots=key_slots,
                                    capture=True, input_ids=tokens)  # fmt: skip
            return self._log_probs(self.draft.logits(hidden))

        tree = grow_tree(self._log_probs(root), expand, depth=self.depth, top_k=self.top_k,
                         total=self.k)  # fmt: skip
        self.draft_forwards += self.depth
        self.last_tree = tree  # the `DraftTree` with its cumulative draft log-probabilities (inspection, tests)
        return Proposal(tree.tokens, torch.full_like(state.count, tree.tokens.shape[1]), parents=tree.parents,
                        bounds=(self.depth, self.top_k))  # fmt: skip

    def commit(self, result, target_out, state):
        lengths = self.prompt_lengths + state.count - 2
        self.draft.cache.rollback(torch.minimum(lengths, self.draft.cache.lengths))
        if self.chain:
            self.length.update(self._num_draft, result.num_accepted, state.finished)

    def sync_value(self):
        """The draft model's committed cache span (`HFTarget.sync_value`) and, for an adaptive draft length, the
        next round's widest chain: read with the loop's one read per round."""
        return self._sync.value()

    def sync_host(self, values) -> None:
        self._sync.host(values)

    def select_rows(self, index):
        self.draft.select_rows(index)
        self.prompt_lengths = self.prompt_lengths[index]
        self.length.select_rows(index)


def chain_round(draft, feed, guidance, uniforms, keys, round_index, *, length, window):
    """A draft LM's round of `length` drafts (no stops) as a pure function of its inputs, for one captured graph
    (`mmspec.decoding.captured_draft`): `feed [B, M]` and each draft after it fed to `draft` (an `HFTarget`) on
    its cache's attention `window` and committed, the drafts drawn on `uniforms` (or Philox blocks of `keys`;
    greedy: None) by `mmspec.drafters.chain.draw_chain`. Returns `(draft_tokens, q_draft, sum of q_draft, the
    cache's committed lengths)`."""
    uniforms = resolve_uniforms(uniforms, keys, round_index, length)
    cache, decoder = draft.cache, decoder_of(draft.model)

    def step(tokens):
        logical, slots, mask = chain_inputs(cache.lengths, tokens.shape[1])
        hidden = draft.run(decoder, cache, slots, logical, mask, window=window, input_ids=tokens)
        cache.commit(tokens.shape[1])
        return draft.logits(hidden[:, -1])

    tokens, q_draft, total = draw_chain(step, feed, length, guidance, uniforms)
    return tokens, q_draft, total, cache.lengths
