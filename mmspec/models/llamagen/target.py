"""`LlamaGenTarget`: a `LlamaGenGPT` as a target of the decoding loop (`mmspec.decoding.target.Target`).

Owns the static KV cache (`mmspec.cache.StaticKVCache`) of every model row: `[cond; uncond]` with guidance on, the
conditional rows only with guidance off (`mmspec.decoding.guidance.Guidance`). Cache slot == RoPE position.
"""

from torch import Tensor

from mmspec.cache import tree_inputs
from mmspec.decoding.cached_target import CachedTarget
from mmspec.decoding.compiled import bucket_width, pad_block
from mmspec.decoding.guidance import Guidance
from mmspec.decoding.target import TargetOutput


__all__ = ["LlamaGenTarget"]


class LlamaGenTarget(CachedTarget):
    """Adapter of a `LlamaGenGPT` (c2i or t2i) for the decoding loop.

    Args:
        model: the target `LlamaGenGPT`.
        guidance: the call's `Guidance` (stream layout + distribution processing).

    `commit`, `select_rows` and `lengths` are `mmspec.decoding.cached_target.CachedTarget`'s.
    """

    bucket_rows = True  # captured: `forward` pads the items to the cache's row bucket

    def __init__(self, model, guidance: Guidance):
        super().__init__(guidance)
        self.model = model
        self.vocab_size = model.config.vocab_size

    @property
    def prefix_length(self) -> int:
        return self.model.config.cls_token_num

    def prefill(self, cond: Tensor, num_tokens: int, scratch: int, cond_mask: Tensor | None = None,
                return_hidden: bool = False) -> TargetOutput:  # fmt: skip
        """Write the condition prefix of every row and return the first token's distribution.

        Args:
            cond: class ids `[B]` (c2i) or text features `[B, cls_token_num, caption_dim]` (t2i).
            num_tokens: tokens to generate per row; `scratch`: the widest scored block (drafts + 1).
            cond_mask: t2i only, bool `[B, cls_token_num]`, False at padded text positions (also applied to the
                null-caption rows of CFG, as upstream).
            return_hidden: also return the hidden state at the last prefix slot (EAGLE's first input).

        Returns:
            `TargetOutput(p_target [B, 1, V], hidden [rows, 1, dim] | None)`; validated (raises on NaN).
        """
        cond = self.guidance.condition_rows(cond, self.model.null_condition(cond.shape[0]))
        if cond_mask is not None:  # the uncond rows keep the prompt's mask, as upstream LlamaGen's `generate`
            cond_mask = self.guidance.condition_rows(cond_mask, cond_mask)
        self.live = None  # a fresh cache: every item in use
        self.buckets = (1, int(scratch))  # captured forwards: every scored block is padded to one of these widths
        max_seq = self.prefix_length + int(num_tokens) + int(scratch) + 1
        self.cache = self.model.setup_cache(cond.shape[0], max_seq)
        out = self.model.prefill(cond, self.cache, cond_mask=cond_mask, return_hidden=return_hidden)
        return TargetOutput(self.guidance.probs(out.logits, "target", validate=True), out.hidden)

    def forward(self, tokens: Tensor, parents: Tensor | None = None, return_hidden: bool = False) -> TargetOutput:
        if self.compiler is not None:  # the cache's items (`select_rows` keeps row buckets when captured)
            tokens, parents = self.pad_items(tokens), self.pad_items(parents)
        rows = self.guidance.rows(tokens)  # [rows, M]
        parents = None if parents is None else self.guidance.rows(parents)
        # ids come from the engine's sampler, slots from the cache lengths: no per-round range checks (host syncs)
        if self.compiler is not None:
            return self.forward_captured(rows, parents, return_hidden)
        inputs = () if parents is None else tree_inputs(parents, self.cache.lengths)
        out = self.model(rows, self.cache, *inputs, return_hidden=return_hidden, validate=False)
        return TargetOutput(self.guidance.probs(out.logits, "target"), out.hidden)

    def forward_captured(self, rows: Tensor, parents: Tensor | None, return_hidden: bool) -> TargetOutput:
        """`forward` through the compiled graph of the block's bucket (`mmspec.decoding.compiled`): the block is
        padded to `bucket_width` (scratch slots after it, attended by nothing) and the outputs cut back to it. A
        tree's positions, slots and ancestor mask are built inside its graph (`tree_forward`)."""
        m = rows.shape[1]
        width = bucket_width(m, self.buckets)
        self.compiler.static(self.cache)
        if parents is None:
            run = self.compiler.forward("target", self.model)
            out = run(pad_block(width, rows)[0], self.cache, return_hidden=return_hidden, validate=False)
        else:
            run = self.compiler.forward("target", tree_forward, device=self.cache.device)
            out = run(self.model, rows, parents, self.cache, width=width, return_hidden=return_hidden)
        hidden = None if out.hidden is None else self.live_rows(out.hidden[:, :m])
        return TargetOutput(self.live_items(self.guidance.probs(out.logits[:, :m], "target")), hidden)


def tree_forward(model, rows, parents, cache, *, width, return_hidden):
    """A token tree's forward (`rows [R, M]` tokens, `parents [R, M]`) with its inputs built from the parents and the
    cache's lengths (`mmspec.cache.tree_inputs`) and padded to `width` (`pad_block`): the captured graph of a tree
    round (the mask building is ~65 ops a round when eager)."""
    inputs = tree_inputs(parents, cache.lengths)
    padded = pad_block(width, rows, *inputs)
    return model(padded[0], cache, *padded[1:], return_hidden=return_hidden, validate=False)
