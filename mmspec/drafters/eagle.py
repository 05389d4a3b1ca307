"""EAGLE-style feature drafter for LlamaGen (Li et al. 2024, EAGLE-1/2; as used for images by LANTERN, Jang et al.
2024), plus the EAGLE-2 dynamic draft-tree builder.

The head predicts the target's next final-norm feature from the current one and the next token:

    f_hat[t+1] = Block(fc([tok_emb(x[t+1]) ; h[t]]))       # one decoder layer of the target's block type
    q_draft(x[t+2]) = softmax(target.output(f_hat[t+1]))    # the target's output head, reused

Pair `(h[t], x[t+1])` sits at the RoPE position of `x[t+1]` (the target's position of that token), so every head
position is an image position. The head owns only `fc` and the layer; the token embedding and output head are the
target's (passed in on every call, never stored).

Head cache: `EagleHead.setup_cache` returns a one-layer `StaticKVCache` whose slot index equals the RoPE position;
its first `cls_token_num` slots are marked invalid and its lengths start at `cls_token_num`, so the chain/tree helpers
of `mmspec.cache` apply unchanged.

Pipeline protocol (both CFG streams as rows `[cond; uncond]`):
    1. after target prefill: `hidden` = target hidden at the last prefix slot `[rows, 1, dim]`, `input_ids` = the
       first sampled token `[rows, 1]`.
    2. after each verification that accepted tree nodes a_1..a_k and sampled the bonus token b: `hidden` = target
       hiddens at [root, a_1, ..., a_k], `input_ids` = [a_1, ..., a_k, b] (`num_valid = k + 1`, ragged rows padded).
    `draft_tree(head, target, head_cache, hidden, input_ids, num_valid, ...)` commits these pairs to the head cache
    and returns the next draft tree; prepend the root b with `prepend_root` before verifying.
"""

import logging
from typing import NamedTuple

import torch
import torch.nn as nn
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from mmspec.cache import StaticKVCache, chain_inputs
from mmspec.models.llamagen import TransformerBlock, ffn_hidden_dim, find_multiple, rope_2d
from mmspec.sampling import sample


logger = logging.getLogger(__name__)


class EagleHead(ModelMixin, ConfigMixin):
    """One-layer EAGLE head for a `LlamaGenGPT` target (see module docstring)."""

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 16384,
        dim: int = 768,
        n_head: int = 12,
        n_kv_head: int | None = None,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-5,
        cls_token_num: int = 1,
        block_size: int = 256,
        fc_bias: bool = True,
        initializer_range: float = 0.02,
        attn_dropout_p: float = 0.0,
        resid_dropout_p: float = 0.0,
        ffn_dropout_p: float = 0.0,
    ):
        super().__init__()
        if dim % n_head or (dim // n_head) % 4:
            raise ValueError(f"dim={dim} must be divisible by n_head={n_head} with head_dim a multiple of 4")
        grid = int(round(block_size**0.5))
        if grid * grid != block_size:
            raise ValueError(f"block_size={block_size} must be a perfect square")
        self.fc = nn.Linear(2 * dim, dim, bias=fc_bias)
        hidden = ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier)
        self.layers = nn.ModuleList(
            [
                TransformerBlock(
                    dim, n_head, n_kv_head, hidden, norm_eps, attn_dropout_p, resid_dropout_p, ffn_dropout_p
                )
            ]
        )
        self.init_weights()

    @classmethod
    def from_target(cls, target, **overrides):
        """A head whose shapes match `target` (a `LlamaGenGPT`); `overrides` change config fields."""
        c = target.config
        kwargs = dict(
            vocab_size=c.vocab_size,
            dim=c.dim,
            n_head=c.n_head,
            n_kv_head=c.n_kv_head,
            multiple_of=c.multiple_of,
            ffn_dim_multiplier=c.ffn_dim_multiplier,
            rope_base=c.rope_base,
            norm_eps=c.norm_eps,
            cls_token_num=c.cls_token_num,
            block_size=c.block_size,
            initializer_range=c.initializer_range,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def init_weights(self, generator=None):
        """N(0, initializer_range) for the Linear weights, zero biases (optional `torch.Generator`)."""
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
                nn.init.normal_(module.weight, 0.0, self.config.initializer_range, generator=generator)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        return self

    @property
    def head_dim(self):
        return self.config.dim // self.config.n_head

    def check_target(self, target):
        c, t = self.config, target.config
        for name in ("dim", "vocab_size", "cls_token_num", "block_size"):
            if getattr(c, name) != getattr(t, name):
                raise ValueError(f"target {name}={getattr(t, name)} does not match the head's {getattr(c, name)}")

    def rope(self, input_pos):
        c = self.config
        return rope_2d(input_pos, self.head_dim, c.rope_base, c.cls_token_num, int(round(c.block_size**0.5)))

    def setup_cache(self, rows, max_seq, dtype=None, device=None):
        """One-layer cache with slot == RoPE position; slots `< cls_token_num` are invalid, lengths start there.

        `max_seq` should cover `cls_token_num + block_size + (largest tree)`.
        """
        p = next(self.parameters())
        cache = StaticKVCache(
            1,
            rows,
            self.config.n_kv_head or self.config.n_head,
            find_multiple(int(max_seq), 8),
            self.head_dim,
            dtype=dtype or p.dtype,
            device=device or p.device,
        )
        self.reset_cache(cache)
        return cache

    def reset_cache(self, cache):
        t = self.config.cls_token_num
        cache.reset()
        cache.key_valid[:, :t] = False
        cache.lengths = torch.full((cache.rows,), t, dtype=torch.long, device=cache.device)
        return cache

    def _inputs(self, hidden, input_ids, target):
        if hidden.dim() != 3 or hidden.shape[-1] != self.config.dim:
            raise ValueError(f"hidden must be [rows, M, dim={self.config.dim}], got {tuple(hidden.shape)}")
        if input_ids.dim() != 2 or tuple(input_ids.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"input_ids must be [rows, M] = {tuple(hidden.shape[:2])}, got {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if not torch.compiler.is_compiling() and input_ids.numel():
            if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size:
                raise ValueError(f"input_ids must be in [0, {self.config.vocab_size})")
        self.check_target(target)
        emb = target.tok_embeddings(input_ids).to(self.fc.weight.dtype)
        return self.fc(torch.cat([emb, hidden.to(self.fc.weight.dtype)], dim=-1))

    def forward(
        self, hidden, input_ids, target, cache, input_pos=None, write_slots=None, attention_mask=None, cache_mask=None
    ):
        """Draft features for `M` pairs per row (chain by default, or a tree via positions/slots/mask).

        Args:
            hidden: `[rows, M, dim]` target final-norm features h[t] (or the head's own f_hat inside a tree).
            input_ids: `[rows, M]` the next tokens x[t+1].
            target: the `LlamaGenGPT` whose `tok_embeddings` are used.
            cache, input_pos, write_slots, attention_mask, cache_mask: as `LlamaGenGPT.forward` (head cache).

        Returns:
            `f_hat [rows, M, dim]`; `self.compute_logits(target, f_hat)` gives the draft logits.
        """
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [rows, M] tensor, got {getattr(input_ids, 'shape', input_ids)}")
        rows, m = input_ids.shape
        if not isinstance(cache, StaticKVCache) or cache.k.shape[0] != 1 or cache.rows != rows:
            raise ValueError("cache must be this head's StaticKVCache (setup_cache) with one row per input row")
        if input_pos is None:
            input_pos, default_slots, default_mask = chain_inputs(cache.lengths, m)
            write_slots = default_slots if write_slots is None else write_slots
            if attention_mask is None and cache_mask is None:
                attention_mask = default_mask
        if write_slots is None:
            write_slots = input_pos
        if cache_mask is None:
            if attention_mask is None:
                attention_mask = torch.ones(m, m, dtype=torch.bool, device=input_ids.device).tril().expand(rows, m, m)
            if attention_mask.shape != (rows, m, m) or attention_mask.dtype != torch.bool:
                raise ValueError(f"attention_mask must be bool [rows={rows}, M={m}, M={m}]")
            cache.check_slots(write_slots)
            cache_mask = cache.visibility(write_slots, attention_mask)
        else:
            cache.check_slots(write_slots)
        if tuple(input_pos.shape) != (rows, m):
            raise ValueError(f"input_pos must be [rows={rows}, M={m}], got {tuple(input_pos.shape)}")
        x = self._inputs(hidden, input_ids, target)
        return self.layers[0](x, self.rope(input_pos), cache_mask[:, None], cache, 0, write_slots)

    def forward_train(self, hidden, input_ids, target):
        """Teacher forcing: pairs `(hidden[:, i], input_ids[:, i])` at positions `cls_token_num + i`, causal.

        With `hidden = target.forward_train(x, cond, return_hidden=True).hidden` (index i predicts x[:, i]), use
        `input_ids = x`; output `i` regresses `hidden[:, i + 1]` (and its logits predict `x[:, i + 1]`).
        """
        x = self._inputs(hidden, input_ids, target)
        pos = self.config.cls_token_num + torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.layers[0](x, self.rope(pos), None, None, 0, None)

    def forward_unrolled(self, hidden, input_ids, target, steps):
        """Training-time test (EAGLE-3 / HASS style): teacher forcing unrolled for `steps` draft depths.

        Step 0 is `forward_train`. Step `j >= 1` feeds the head its own step `j-1` output instead of the target's
        feature (`f_{j-1}[i-1]` in place of `hidden[i]`), and position `i` attends exactly as the depth-`j+1` node of a
        chain drafted at inference: step-0 keys at positions `<= i - j` (pairs built from true target features),
        then step `s` keys at position `i - j + s` for `s = 1 .. j` (its drafted ancestors and itself).

        Returns:
            a list of `steps` tensors `[B, N, dim]`; entry `j` at position `i` regresses `hidden[:, i + 1]`, and is
            meaningful for `i >= j` only (earlier positions have no true prefix to start the chain from).
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        b, n = input_ids.shape
        device = input_ids.device
        pos = self.config.cls_token_num + torch.arange(n, device=device)[None]
        rope = self.rope(pos)
        i = torch.arange(n, device=device)
        kv = _ConcatKV()
        outputs, feats = [], hidden
        for j in range(steps):
            x = self._inputs(feats, input_ids, target)
            # keys of steps 0..j, step-major: [n, (j + 1) * n]
            blocks = [i[None, :] <= i[:, None] - j] + [i[None, :] == i[:, None] - j + s for s in range(1, j + 1)]
            mask = torch.cat(blocks, dim=1)
            out = self.layers[0](x, rope, mask[None, None].expand(b, 1, n, (j + 1) * n), kv, 0, None)
            outputs.append(out)
            feats = torch.cat([out[:, :1], out[:, :-1]], dim=1)  # position i now gets f_j[i - 1]
        return outputs

    @staticmethod
    def compute_logits(target, features):
        """Draft logits `[..., V]` (float32) from head features, through the target's output head."""
        return target.output(features.to(target.output.weight.dtype)).float()


class _ConcatKV:
    """Stand-in for `StaticKVCache` in `forward_unrolled`: `update` appends the new keys/values out of place (so
    autograd can flow through every step) and returns all of them."""

    def __init__(self):
        self.k, self.v = None, None

    def update(self, layer, write_slots, k_new, v_new):
        self.k = k_new if self.k is None else torch.cat([self.k, k_new], dim=2)
        self.v = v_new if self.v is None else torch.cat([self.v, v_new], dim=2)
        return self.k, self.v


# ---------------------------------------------------------------------- EAGLE-2 dynamic tree
class DraftTree(NamedTuple):
    """A draft token tree per batch item, nodes in topological order (`parents[b, i] < i`, `-1` = child of root).

    tokens: `[B, N]` draft tokens; parents: `[B, N]`; depths: `[B, N]` (1 = child of the root);
    scores: `[B, N]` cumulative draft log-probabilities (CFG-combined, after `logits_processor`).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor


def cfg_combine(logits, guidance_scale):
    """`uncond + s * (cond - uncond)` over rows `[cond; uncond]` -> `[rows // 2, ...]`; `guidance_scale=None` means
    the rows are not CFG pairs (returned as is). `guidance_scale` may be a float or a `[B]` tensor."""
    if guidance_scale is None:
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    s = torch.as_tensor(guidance_scale, dtype=logits.dtype, device=logits.device)
    if s.dim() == 1:
        s = s.view(-1, *([1] * (logits.dim() - 1)))
    return uncond + s * (cond - uncond)


def prepend_root(root_tokens, tokens, parents):
    """Verification tree = `[root] + draft nodes`: returns `(tokens [B, N+1], parents [B, N+1])` with the root at
    index 0 (parent -1) and every draft node shifted by one (children of the root point at 0)."""
    root_tokens = root_tokens.reshape(-1, 1).to(tokens.dtype)
    shifted = torch.where(parents >= 0, parents + 1, torch.zeros_like(parents))
    return (torch.cat([root_tokens, tokens], dim=1), torch.cat([torch.full_like(parents[:, :1], -1), shifted], dim=1))


def commit_accepted(head, target, cache, hidden, input_ids, num_valid=None):
    """Step 1 of every EAGLE draft: feed the newly accepted pairs `(hidden, input_ids)` (`num_valid [rows]` valid per
    row, default all), commit them to the head cache, and return the last valid feature `[rows, 1, dim]`, which
    drafts the first token after the root."""
    rows, m = input_ids.shape
    device = input_ids.device
    num_valid = torch.full((rows,), m, dtype=torch.long, device=device) if num_valid is None else num_valid
    num_valid = torch.as_tensor(num_valid, dtype=torch.long, device=device)
    if tuple(num_valid.shape) != (rows,) or bool(((num_valid < 1) | (num_valid > m)).any()):
        raise ValueError(f"num_valid must be [rows={rows}] with values in 1..{m}")
    feats = head(hidden, input_ids, target, cache)
    cache.commit(num_valid)
    return feats[torch.arange(rows, device=device), num_valid - 1][:, None]


@torch.no_grad()
def draft_chain(head, target, cache, hidden, input_ids, num_valid, *, length, sampling, generator):
    """EAGLE chain with *sampled* drafts: `length` tokens, each drawn from the head's processed distribution.

    Step 1 is `commit_accepted` (as in `draft_tree`). Each draft token is sampled from
    `q_draft = sampling.probs(cond, uncond)` of the head's logits (CFG, temperature, top-k/p exactly as the target's),
    so standard speculative sampling accepts it with probability `sum_v min(p_target, q_draft)`; a deterministic
    top-1 chain would be accepted with `p_target(argmax q_draft)` only, far less at temperature 1. Under greedy
    sampling `q_draft` is one-hot and the chain is the head's greedy chain. Drafted pairs are scratch: the head cache
    keeps only the committed pairs (lengths grow by `num_valid`).

    Args:
        hidden, input_ids, num_valid: the accepted pairs, rows `[cond; uncond]` (see `draft_tree`).
        length: chain length K >= 1.
        sampling: the pipeline's `mmspec.sampling.SamplingParams`.
        generator: `torch.Generator` for the draft samples.

    Returns:
        `(draft_tokens [B, K], q_draft [B, K, V])`.
    """
    rows = input_ids.shape[0]
    if rows % 2:
        raise ValueError(f"rows must be [cond; uncond] (even), got {rows}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    feat = commit_accepted(head, target, cache, hidden, input_ids, num_valid)  # [rows, 1, dim]
    tokens, probs = [], []
    for d in range(length):
        q = sampling.probs(*head.compute_logits(target, feat[:, 0]).chunk(2))  # [B, V]
        tok = sample(q, generator)
        tokens.append(tok)
        probs.append(q)
        if d + 1 < length:
            feat = head(feat, torch.cat([tok, tok])[:, None], target, cache)  # pair (f_hat, x) at the next slot
            cache.commit(1)
    cache.rollback(cache.lengths - (length - 1))
    return torch.stack(tokens, 1), torch.stack(probs, 1)


@torch.no_grad()
def draft_tree(
    head,
    target,
    cache,
    hidden,
    input_ids,
    num_valid=None,
    *,
    guidance_scale=None,
    depth=4,
    top_k=10,
    total=59,
    logits_processor=None,
):
    """EAGLE-2 dynamic draft tree (Li et al. 2024, "EAGLE-2"), batched over rows, both CFG streams.

    1. Feed the newly accepted chain of pairs `(hidden, input_ids)` (`num_valid [rows]` valid per row) and commit it
       to the head cache; its last feature drafts depth 1 (the root is `input_ids[r, num_valid[r] - 1]`).
    2. For each depth: draft logits of the frontier are CFG-combined (`guidance_scale`), passed through
       `logits_processor` (optional callable on `[..., V]` logits), log-softmaxed; every frontier node proposes its
       `top_k` children, scored by cumulative log-prob; the best `top_k` of them form the next frontier and are fed
       to the head (attending to committed pairs + their ancestors). `depth` = levels of draft tokens.
    3. Rerank all candidates globally by cumulative log-prob (ties: shallower first) and keep `total` of them (an
       ancestor-closed set, since children never score above parents), returned in topological order.

    The head cache's committed length grows by `num_valid`; tree nodes stay scratch.

    Returns:
        `DraftTree` with `B = rows // 2` items under CFG (`guidance_scale` not None), else `B = rows`.
    """
    rows = input_ids.shape[0]
    device = input_ids.device
    if guidance_scale is not None and rows % 2:
        raise ValueError(f"with guidance_scale the rows must be [cond; uncond] (even), got {rows}")
    if depth < 1 or top_k < 1 or total < 1:
        raise ValueError(f"depth, top_k and total must be >= 1, got {depth}, {top_k}, {total}")
    top_k = min(top_k, head.config.vocab_size)
    batch = rows // 2 if guidance_scale is not None else rows

    def log_probs(features):  # [rows, K, dim] -> [B, K, V]
        logits = cfg_combine(head.compute_logits(target, features), guidance_scale)
        if logits_processor is not None:
            logits = logits_processor(logits)
        return torch.log_softmax(logits.float(), dim=-1)

    def per_row(x):  # [B, ...] -> [rows, ...] (same tree on both CFG streams)
        return torch.cat([x, x], dim=0) if guidance_scale is not None else x

    # 1. accepted chain -> committed head state
    root_feat = commit_accepted(head, target, cache, hidden, input_ids, num_valid)  # [rows, 1, dim]
    base_len = cache.lengths

    # depth 1: children of the root
    lp = log_probs(root_feat)[:, 0]  # [B, V]
    score, tok = lp.topk(top_k, dim=-1)  # [B, k]
    cand_tokens, cand_scores = [tok], [score]
    cand_parents = [torch.full_like(tok, -1)]
    cand_depths = [torch.ones_like(tok)]
    n_cand = top_k
    frontier_ids = torch.arange(top_k, device=device).expand(batch, top_k)  # candidate ids of the frontier
    frontier_tokens, frontier_scores = tok, score
    frontier_feat = root_feat.expand(rows, top_k, -1)  # input feature of each frontier node (its parent's f_hat)
    # head-tree bookkeeping: nodes fed to the head so far (slot base_len + index), ancestor-or-self mask
    fed_anc = torch.zeros(batch, 0, 0, dtype=torch.bool, device=device)
    frontier_head_parent = torch.full((batch, top_k), -1, dtype=torch.long, device=device)

    for d in range(2, depth + 1):
        # feed the frontier (top_k nodes at depth d-1) to the head
        n_fed = fed_anc.shape[1]
        eye = torch.eye(top_k, dtype=torch.bool, device=device).expand(batch, top_k, top_k)
        par = frontier_head_parent
        if n_fed:
            inherited = fed_anc.gather(1, par.clamp(min=0)[:, :, None].expand(batch, top_k, n_fed))
            inherited = inherited & (par >= 0)[:, :, None]  # ancestors-or-self of the parent
        else:
            inherited = torch.zeros(batch, top_k, 0, dtype=torch.bool, device=device)
        new_rows = torch.cat([inherited, eye], dim=2)  # [B, k, n_fed + k]
        fed_anc = torch.cat([torch.cat([fed_anc, fed_anc.new_zeros(batch, n_fed, top_k)], dim=2), new_rows], dim=1)
        key_slots = base_len[:, None] + torch.arange(n_fed + top_k, device=device)[None]
        write_slots = key_slots[:, n_fed:]
        input_pos = (base_len + d - 2)[:, None].expand(rows, top_k)
        cache.check_slots(write_slots)
        cache_mask = cache.visibility(key_slots, per_row(new_rows))
        out = head(
            frontier_feat, per_row(frontier_tokens), target, cache, input_pos, write_slots, cache_mask=cache_mask
        )  # [rows, k, dim]
        lp = log_probs(out)  # [B, k, V]
        child_lp, child_tok = lp.topk(top_k, dim=-1)  # [B, k, k]
        cum = (frontier_scores[:, :, None] + child_lp).reshape(batch, top_k * top_k)
        cand_tokens.append(child_tok.reshape(batch, -1))
        cand_scores.append(cum)
        cand_parents.append(frontier_ids[:, :, None].expand(batch, top_k, top_k).reshape(batch, -1))
        cand_depths.append(torch.full_like(cum, d, dtype=torch.long))
        # next frontier: best top_k children
        _, pick = cum.topk(top_k, dim=-1)  # [B, k] indices into k*k
        parent_local = torch.div(pick, top_k, rounding_mode="floor")
        frontier_tokens = child_tok.reshape(batch, -1).gather(1, pick)
        frontier_scores = cum.gather(1, pick)
        frontier_ids = n_cand + pick
        frontier_head_parent = n_fed + parent_local
        frontier_feat = out.gather(1, per_row(parent_local)[:, :, None].expand(rows, top_k, out.shape[-1]))
        n_cand += top_k * top_k

    tokens = torch.cat(cand_tokens, 1)
    scores = torch.cat(cand_scores, 1)
    parents = torch.cat(cand_parents, 1)
    depths = torch.cat(cand_depths, 1)
    n_keep = min(total, tokens.shape[1])
    # candidates are stored depth by depth (parents first), so a stable sort on -score breaks ties shallower-first
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :n_keep]
    keep = order.sort(dim=1).values  # topological order
    new_index = torch.full_like(tokens, -1)
    new_index.scatter_(1, keep, torch.arange(n_keep, device=device).expand(batch, n_keep))
    kept_parents = parents.gather(1, keep)
    remapped = torch.where(kept_parents >= 0, new_index.gather(1, kept_parents.clamp(min=0)), kept_parents)
    if bool(((kept_parents >= 0) & (remapped < 0)).any()):  # cannot happen unless scores are NaN
        raise RuntimeError("draft tree selection is not ancestor-closed (NaN draft scores?)")
    return DraftTree(tokens.gather(1, keep), remapped, depths.gather(1, keep), scores.gather(1, keep))
