"""Small-model drafter: a smaller AR model of the same family drafts a chain of K tokens (Leviathan et al. 2023;
Chen et al. 2023), for discrete-token image models (`LlamaGenGPT`).

The draft model runs both CFG streams (rows `[cond; uncond]`) and its logits go through the *same* `SamplingParams`
processing as the target's, so `q_draft` is exactly the distribution each draft token was drawn from (a one-hot
under greedy decoding, i.e. a point-mass draft).

Cache protocol (one `StaticKVCache` of the draft model, per-row lengths):

* after `prefill`, the draft cache holds the condition prefix; the target's first token is *pending* (known, not yet
  in any cache).
* `draft(last, pending, ...)` feeds `[last committed token, pending]` at slots `L - 1, L` (re-computing slot `L - 1`
  keeps the shapes uniform: that slot is missing exactly when the previous round accepted all K drafts), then
  K - 1 single-token forwards; K draft forwards in all. On the first round only `[pending]` is fed.
* `commit(committed_lengths)` rolls the draft cache back to `committed_lengths - 1` (per row), which is always a
  correct prefix, whatever was accepted.
"""

import logging

import torch

from mmspec.sampling import sample


logger = logging.getLogger(__name__)


class ModelDrafter:
    """Drafts chains with a small `LlamaGenGPT` (see module docstring).

    Args:
        model: the draft `LlamaGenGPT`; its vocabulary, class count and token grid must match the target's.
    """

    def __init__(self, model):
        self.model = model
        self.cache = None
        self._first_round = True

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

    def prefill(self, cond, max_seq, cond_mask=None):
        """Reset the draft cache and write the condition prefix for rows `[cond; uncond]`."""
        self.cache = self.model.setup_cache(cond.shape[0], max_seq)
        self.model.prefill(cond, self.cache, cond_mask=cond_mask)
        self._first_round = True

    @torch.no_grad()
    def draft(self, last_tokens, pending, num_draft, sampling, generator):
        """Draft `num_draft` tokens after `pending` for every batch item.

        Args:
            last_tokens: `[B]` last committed image token per item (ignored on the first round).
            pending: `[B]` the token the target emitted last round (not yet in any cache).
            num_draft: K >= 1.
            sampling: the pipeline's `SamplingParams` (CFG scale, temperature, top-k/p), shared with the target.
            generator: `torch.Generator` for the draft samples.

        Returns:
            `(draft_tokens [B, K], q_draft [B, K, V])`.
        """
        if self._first_round:
            feed = pending[:, None]
        else:
            feed = torch.stack([last_tokens, pending], dim=1)  # `commit` left the last committed slot open
        feed = torch.cat([feed, feed])  # rows [cond; uncond] carry the same tokens
        tokens, probs = [], []
        for _ in range(num_draft):
            logits = self.model(feed, self.cache).logits[:, -1]  # [2B, V]
            self.cache.commit(feed.shape[1])
            cond, uncond = logits.chunk(2)
            q = sampling.probs(cond, uncond)  # [B, V] exactly what the draft is drawn from
            tok = sample(q, generator)
            tokens.append(tok)
            probs.append(q)
            feed = torch.cat([tok, tok])[:, None]
        self._first_round = False
        return torch.stack(tokens, 1), torch.stack(probs, 1)

    def commit(self, committed_lengths):
        """After verification: `committed_lengths [B]` = target cache lengths of the cond rows (prefix + committed
        tokens). The draft cache keeps everything but the last committed token, which the next round re-feeds."""
        lengths = torch.cat([committed_lengths, committed_lengths]) - 1
        self.cache.rollback(torch.minimum(lengths, self.cache.lengths))
