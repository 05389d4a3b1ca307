"""Draft-LM drafter for transformers targets: a smaller causal LM / LLaVA sharing the target's tokenizer drafts a
chain of K tokens (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318) -- the text twin of
`mmspec.drafters.model.ModelDrafter`, with the same cache protocol, run through `mmspec.models.hf.HFTarget`:

* `prefill` writes the prompt (and, for a LLaVA draft, its image) into the draft's own `StaticKVCache`; the target's
  first token is pending.
* `propose` feeds `[last committed token, pending]` (only `[pending]` on the first round), then K - 1 single tokens;
  each draft token is drawn from `q_draft`, the draft's logits through the *same* processing as the target's (one-hot
  under greedy decoding).
* `commit` rolls the draft cache back to the prompt + all committed tokens but the last (always a correct prefix).
"""

import torch

from mmspec.drafters.base import Proposal
from mmspec.models.hf import HFTarget
from mmspec.random import num_rows
from mmspec.sampling import sample


__all__ = ["TextModelDrafter"]


class TextModelDrafter:
    """Drafts chains with a small transformers LM (see module docstring; `mmspec.drafters.base.Drafter`).

    Args:
        draft: the draft model wrapped as `HFTarget(model, guidance, source="draft")`.
        num_draft_tokens: K, the chain length.
        prompt: the right-padded prompt `input_ids [B, L]`, `lengths [B]` and extra model inputs (`pixel_values`)
            the target was prefilled with.
    """

    needs_hidden = False

    def __init__(self, draft: HFTarget, num_draft_tokens: int, input_ids, lengths, **model_inputs):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
        self.draft, self.k = draft, int(num_draft_tokens)
        self.input_ids, self.lengths, self.model_inputs = input_ids, lengths, model_inputs
        self.max_width = self.k
        self.draft_forwards = 0

    def prefill(self, state, target_out):
        self.draft.prefill(self.input_ids, self.lengths, state.max_length, self.k + 2, **self.model_inputs)
        self.prompt_lengths = self.lengths
        self._first_round = True

    @torch.no_grad()
    def propose(self, state):
        num_draft = state.remaining().clamp(min=1, max=self.k)
        length = min(self.k, state.max_remaining)  # no drafts past the last token of any row
        feed = state.pending[:, None] if self._first_round else torch.stack([state.last_committed, state.pending], 1)
        counted = num_rows(state.generator) is not None  # per-row generators: draw only the drafts a row uses
        tokens, probs = [], []
        for d in range(length):
            q = self.draft.forward(feed).p_target[:, -1]  # [B, V] exactly what the draft is drawn from
            self.draft.cache.commit(feed.shape[1])
            tok = sample(q, state.generator, counts=(num_draft > d).long() if counted else None)
            tokens.append(tok)
            probs.append(q)
            feed = tok[:, None]
        self.draft_forwards += length
        self._first_round = False
        return Proposal(torch.stack(tokens, 1), num_draft, q_draft=torch.stack(probs, 1))

    def commit(self, result, target_out, state):
        lengths = self.prompt_lengths + state.count - 2
        self.draft.cache.rollback(torch.minimum(lengths, self.draft.cache.lengths))

    def select_rows(self, index):
        self.draft.select_rows(index)
        self.prompt_lengths = self.prompt_lengths[index]
