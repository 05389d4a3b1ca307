"""LlamaGen GPT (Sun et al. 2024, "Autoregressive Model Beats Diffusion", FoundationVision/LlamaGen) for speculative
decoding.

A Llama-style decoder over VQ image tokens: RMSNorm, SwiGLU, 2-D RoPE, and a condition prefix of `cls_token_num`
tokens (c2i: one class embedding; t2i: `cls_token_num` projected text features). Module and parameter names are the
official ones (`tok_embeddings`, `cls_embedding.*`, `layers.{i}.attention.wqkv`, ..., `norm`, `output`), so official
`c2i_*.pt` / `t2i_*.pt` state dicts load directly (see `mmspec.models.llamagen.checkpoints`).

Two faithful-to-upstream details worth knowing:

* RoPE table: position `p >= cls_token_num` gets the 2-D rotation of grid cell `p - cls_token_num` (first half of the
  rotary pairs by row, second half by column); the `cls_token_num` condition positions get an all-zero (cos, sin)
  row, exactly as upstream's `precompute_freqs_cis_2d`, which zeroes the condition tokens' queries and keys (they
  still contribute through their values).
* t2i: padded text positions (`cond_mask == False`) are never attended to, except by themselves.

Inference uses a static KV cache (`mmspec.cache.StaticKVCache`) with explicit positions, write slots and masks, so one
forward can score a chain or a token tree for any mix of rows (CFG `[cond; uncond]`, per-row lengths):

    >>> cache = model.setup_cache(rows=2 * B, max_seq=model.config.cls_token_num + num_tokens + 64)
    >>> cond = torch.cat([labels, model.null_condition(B)])
    >>> logits, hidden = model.prefill(cond, cache, return_hidden=True)  # [2B, 1, V]: token 0
    >>> logits, _ = model(tokens, cache)  # chain after cache.lengths (scratch until cache.commit(n))
    >>> pos, slots, mask = tree_inputs(parents, cache.lengths)
    >>> logits, hidden = model(tree_tokens, cache, pos, slots, mask, return_hidden=True)
    >>> cache.commit_path(*path_to_leaf(parents, accepted_leaf))

Training uses `forward_train` (teacher forcing over whole sequences, no cache).
"""

import logging
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from mmspec.cache import StaticKVCache, forward_inputs
from mmspec.models.config_fields import check_fields


logger = logging.getLogger(__name__)

try:  # optional, CUDA only
    import xformers.ops as _xops
except Exception:  # noqa: BLE001 - any import failure just disables the path
    _xops = None
_XFORMERS_FAILED = False


def find_multiple(n, k):
    """Smallest multiple of `k` that is >= `n`."""
    return n if n % k == 0 else n + k - (n % k)


def ffn_hidden_dim(dim, multiple_of=256, ffn_dim_multiplier=None):
    """LlamaGen's SwiGLU width: find_multiple(int(mult * int(2 * 4 * dim / 3)), multiple_of)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return find_multiple(hidden, multiple_of)


class GPTOutput(NamedTuple):
    """`logits [rows, M, V]` (float32) and, if requested, `hidden [rows, M, dim]`: the final-norm output that enters
    `output` (the EAGLE feature)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


# ---------------------------------------------------------------------- rotary embedding
def rope_2d(input_pos, head_dim, base, cls_token_num, grid_size):
    """(cos, sin) rows `[*input_pos.shape, head_dim // 2, 2]` of LlamaGen's 2-D RoPE, computed for any positions.

    Equals upstream's `precompute_freqs_cis_2d(grid_size, head_dim, base, cls_token_num)[input_pos]`: zeros for the
    condition prefix, else row `r = (p - cls) // grid` on the first `head_dim // 4` pairs and column
    `c = (p - cls) % grid` on the rest. Positions past the grid simply continue the rows (used only for padding).
    """
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, half, 2, device=input_pos.device)[: half // 2].float() / half))
    p = (input_pos - cls_token_num).clamp(min=0)
    row = torch.div(p, grid_size, rounding_mode="floor")
    col = p - row * grid_size
    angles = torch.cat([row[..., None].float() * inv_freq, col[..., None].float() * inv_freq], dim=-1)
    rope = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
    return rope.masked_fill((input_pos < cls_token_num)[..., None, None], 0.0)


def rope_factors(rope):
    """`rope [rows or 1, M, head_dim // 2, 2]` (cos, sin) -> the factors `apply_rope` multiplies by, `(c, s)`, each
    `[rows or 1, M, 1, head_dim // 2, 2]`: c = (cos, cos), s = (-sin, sin) per pair. Made once per forward, shared by
    every layer (a layer then rotates in five ops, not by slicing cos and sin out of `rope` again)."""
    cos, sin = rope[..., 0], rope[..., 1]
    return torch.stack([cos, cos], -1)[:, :, None], torch.stack([-sin, sin], -1)[:, :, None]


def apply_rope(x, rope):
    """Rotate `x [rows, M, heads, head_dim]` by `rope` (`rope_2d`'s `[rows or 1, M, head_dim // 2, 2]`, or its
    `rope_factors`), in float32: pair (a, b) -> (a cos - b sin, b cos + a sin). Computed as `x c + flip(x) s`, the
    same products and sums in the same order (a + (-b) is a - b in IEEE arithmetic), so bitwise the textbook form."""
    c, s = rope if isinstance(rope, tuple) else rope_factors(rope)
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    return (xs * c + xs.flip(-1) * s).flatten(3).type_as(x)


# ---------------------------------------------------------------------- blocks
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout_p=0.0):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.ffn_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


def _xformers_attention(q, k, v, mask):
    """memory_efficient_attention with an additive bias; returns None if unavailable or it fails (then SDPA)."""
    global _XFORMERS_FAILED
    if _xops is None or _XFORMERS_FAILED or not q.is_cuda or mask is None or torch.compiler.is_compiling():
        return None
    try:
        s = k.shape[2]
        s_pad = find_multiple(s, 8)  # xformers wants the bias' last dim 8-aligned
        bias = torch.zeros(*mask.shape[:-1], s_pad, dtype=q.dtype, device=q.device)
        bias[..., :s].masked_fill_(~mask, float("-inf"))
        bias[..., s:] = float("-inf")
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], s_pad)[..., :s]
        out = _xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=bias)
        return out.transpose(1, 2)
    except Exception as err:  # noqa: BLE001 - fall back to SDPA for good
        logger.warning("xformers attention failed (%s); using scaled_dot_product_attention", err)
        _XFORMERS_FAILED = True
        return None


class Attention(nn.Module):
    def __init__(self, dim, n_head, n_kv_head=None, attn_dropout_p=0.0, resid_dropout_p=0.0):
        super().__init__()
        self.dim, self.n_head = dim, n_head
        self.n_kv_head = n_kv_head or n_head
        self.head_dim = dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * self.n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.attn_dropout_p = attn_dropout_p
        self.resid_dropout = nn.Dropout(resid_dropout_p)

    def forward(self, x, rope, mask=None, cache=None, layer=0, write_slots=None):
        """x: [rows, M, dim]; rope: [rows|1, M, hd/2, 2]; mask: [rows, 1, M, keys] bool or None (causal)."""
        rows, m, _ = x.shape
        kv = self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv, kv], dim=-1)
        q = apply_rope(q.view(rows, m, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(rows, m, self.n_kv_head, self.head_dim), rope).transpose(1, 2)
        v = v.view(rows, m, self.n_kv_head, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer, write_slots, k, v)  # [rows, n_kv, max_seq, hd]
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        out = None if self.training else _xformers_attention(q, k, v, mask)
        if out is None:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None,
                dropout_p=self.attn_dropout_p if self.training else 0.0,
            )
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(rows, m, self.dim)))


class TransformerBlock(nn.Module):
    def __init__(
        self,
        dim,
        n_head,
        n_kv_head,
        ffn_hidden,
        norm_eps=1e-5,
        attn_dropout_p=0.0,
        resid_dropout_p=0.0,
        ffn_dropout_p=0.0,
    ):
        super().__init__()
        self.attention = Attention(dim, n_head, n_kv_head, attn_dropout_p, resid_dropout_p)
        self.feed_forward = FeedForward(dim, ffn_hidden, ffn_dropout_p)
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)

    def forward(self, x, rope, mask=None, cache=None, layer=0, write_slots=None):
        h = x + self.attention(self.attention_norm(x), rope, mask, cache, layer, write_slots)
        return h + self.feed_forward(self.ffn_norm(h))


# ---------------------------------------------------------------------- condition embedders
class LabelEmbedder(nn.Module):
    """Class embedding table with `num_classes + 1` rows; row `num_classes` is the null (CFG) class."""

    def __init__(self, num_classes, dim):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, dim)


class MLP(nn.Module):
    """Upstream `cap_proj`: Linear -> GELU(tanh) -> Linear, no biases."""

    def __init__(self, in_features, hidden_features, out_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """Projects `[B, cls_token_num, caption_dim]` text features; `uncond_embedding` is the null condition (in
    caption space, replaced before the projection as upstream)."""

    def __init__(self, caption_dim, dim, token_num):
        super().__init__()
        self.cap_proj = MLP(caption_dim, dim, dim)
        self.uncond_embedding = nn.Parameter(torch.randn(token_num, caption_dim) / caption_dim**0.5)


# ---------------------------------------------------------------------- the model
class LlamaGenGPT(ModelMixin, ConfigMixin):
    """LlamaGen GPT with a static-KV-cache forward that scores chains and token trees.

    Args (config): the upstream `ModelArgs` fields. `model_type` is "c2i" (class ids, `cls_token_num` must be 1) or
    "t2i" (text features `[B, cls_token_num, caption_dim]`); `block_size` is the number of image tokens (a square).
    """

    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 16384,
        dim: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        n_kv_head: int | None = None,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        token_dropout_p: float = 0.1,
        attn_dropout_p: float = 0.0,
        resid_dropout_p: float = 0.1,
        ffn_dropout_p: float = 0.1,
        num_classes: int = 1000,
        caption_dim: int = 2048,
        class_dropout_prob: float = 0.1,
        model_type: str = "c2i",
        cls_token_num: int = 1,
        block_size: int = 256,
    ):
        check_fields("LlamaGenGPT", locals())  # types and ranges; the cross-field rules follow
        super().__init__()
        if model_type == "c2i" and cls_token_num != 1:
            raise ValueError(f"cls_token_num must be 1 for model_type='c2i', got {cls_token_num}")
        if dim % n_head or (dim // n_head) % 4:
            raise ValueError(f"dim={dim} must be divisible by n_head={n_head} with head_dim a multiple of 4")
        if n_head % (n_kv_head or n_head):
            raise ValueError(f"n_head={n_head} must be divisible by n_kv_head={n_kv_head}")
        grid = int(round(block_size**0.5))
        if grid * grid != block_size:
            raise ValueError(f"block_size={block_size} must be a perfect square (image tokens of a square grid)")
        if model_type == "c2i":
            self.cls_embedding = LabelEmbedder(num_classes, dim)
        else:
            self.cls_embedding = CaptionEmbedder(caption_dim, dim, cls_token_num)
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.tok_dropout = nn.Dropout(token_dropout_p)
        hidden = ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_head, n_kv_head, hidden, norm_eps, attn_dropout_p, resid_dropout_p, ffn_dropout_p)
            for _ in range(n_layer)
        )
        self.norm = RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.init_weights()

    # ------------------------------------------------------------------ basics
    @property
    def head_dim(self):
        return self.config.dim // self.config.n_head

    @property
    def grid_size(self):
        return int(round(self.config.block_size**0.5))

    @property
    def num_kv_heads(self):
        return self.config.n_kv_head or self.config.n_head

    def init_weights(self, generator=None, zero_output=True):
        """Upstream init: N(0, initializer_range) for Linear/Embedding weights, the `output` layer zeroed (set
        `zero_output=False` for random test models). Takes an optional `torch.Generator`."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module.weight.device.type == "meta":
                    continue
                nn.init.normal_(module.weight, 0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        if zero_output and self.output.weight.device.type != "meta":
            nn.init.zeros_(self.output.weight)
        return self

    def rope(self, input_pos):
        return rope_2d(input_pos, self.head_dim, self.config.rope_base, self.config.cls_token_num, self.grid_size)

    def setup_cache(self, rows, max_seq, dtype=None, device=None):
        """A fresh `StaticKVCache` for `rows` sequences of `max_seq` slots (rounded up to a multiple of 8).

        Size it as `cls_token_num + block_size + (largest scratch forward)`: chains/trees are written at
        `lengths[r] + i` even for rows that are finished.
        """
        p = next(self.parameters())
        return StaticKVCache(
            self.config.n_layer,
            rows,
            self.num_kv_heads,
            find_multiple(int(max_seq), 8),
            self.head_dim,
            dtype=dtype or p.dtype,
            device=device or p.device,
        )

    # ------------------------------------------------------------------ condition
    def null_condition(self, batch_size):
        """The CFG null condition for `batch_size` rows: class id `num_classes` (c2i) or the learned
        `uncond_embedding` expanded to `[batch_size, cls_token_num, caption_dim]` (t2i)."""
        device = self.tok_embeddings.weight.device
        if self.config.model_type == "c2i":
            return torch.full((batch_size,), self.config.num_classes, dtype=torch.long, device=device)
        return self.cls_embedding.uncond_embedding[None].expand(batch_size, -1, -1)

    def check_condition(self, cond, cond_mask=None, rows=None, check_range=True):
        """Raise ValueError (naming the argument) unless `cond` / `cond_mask` are valid for this model
        (`check_range=False`: class ids' range not read back, for ids the caller has checked already)."""
        cfg = self.config
        if not torch.is_tensor(cond):
            raise ValueError(f"cond must be a tensor, got {type(cond).__name__}")
        if rows is not None and cond.shape[0] != rows:
            raise ValueError(f"cond has {cond.shape[0]} rows, expected {rows} (the cache rows)")
        if cfg.model_type == "c2i":
            if cond.dim() != 1 or cond.dtype.is_floating_point or cond.dtype == torch.bool:
                raise ValueError(
                    f"cond must be integer class ids of shape [rows], got {cond.dtype} {tuple(cond.shape)}"
                )
            lo, hi = torch.stack([cond.min(), cond.max()]).tolist() if cond.numel() and check_range else (0, 0)
            if lo < 0 or hi > cfg.num_classes:
                raise ValueError(
                    f"cond class ids must be in [0, {cfg.num_classes}] ({cfg.num_classes} = null class), "
                    f"got range [{lo}, {hi}]"
                )
            if cond_mask is not None:
                raise ValueError("cond_mask is only used by model_type='t2i'")
        else:
            want = (cfg.cls_token_num, cfg.caption_dim)
            if cond.dim() != 3 or tuple(cond.shape[1:]) != want or not cond.dtype.is_floating_point:
                raise ValueError(
                    f"cond must be float text features [rows, {want[0]}, {want[1]}], got {tuple(cond.shape)}"
                )
            if cond_mask is not None and (cond_mask.dtype != torch.bool or tuple(cond_mask.shape) != cond.shape[:2]):
                raise ValueError(
                    f"cond_mask must be bool [rows, {cfg.cls_token_num}], got {cond_mask.dtype} "
                    f"{tuple(cond_mask.shape)}"
                )

    def embed_condition(self, cond, drop=None):
        """Condition tokens `[B, cls_token_num, dim]`; `drop [B]` (bool) swaps in the null condition (CFG dropout)."""
        if self.config.model_type == "c2i":
            if drop is not None:
                cond = torch.where(drop, torch.full_like(cond, self.config.num_classes), cond)
            return self.cls_embedding.embedding_table(cond)[:, None]
        if drop is not None:
            null = self.cls_embedding.uncond_embedding.to(cond.dtype)
            cond = torch.where(drop[:, None, None], null[None], cond)
        return self.cls_embedding.cap_proj(cond.to(self.cls_embedding.cap_proj.fc1.weight.dtype))

    # ------------------------------------------------------------------ cached inference
    def _head(self, h, return_hidden):
        h = self.norm(h)
        return GPTOutput(self.output(h).float(), h if return_hidden else None)

    def _run(self, h, input_pos, mask, cache, write_slots):
        rope = rope_factors(self.rope(input_pos))
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, mask, cache, i, write_slots)
        return h

    @torch.no_grad()
    def prefill(self, cond, cache, cond_mask=None, return_hidden=False, check_range=True):
        """Write the condition prefix of every row (slots `0 .. cls_token_num - 1`) and return the logits of the
        first image token.

        Args:
            cond: c2i: class ids `[rows]` in `[0, num_classes]` (use `null_condition` for the uncond rows);
                t2i: text features `[rows, cls_token_num, caption_dim]` (left-padded).
            cache: a cache from `setup_cache`; all its rows are reset to length `cls_token_num`.
            cond_mask: t2i only, bool `[rows, cls_token_num]`, False at padded text positions.
            return_hidden: also return the final-norm hidden state at the last prefix position.
            check_range: read back the class ids' range (`check_condition`, one host read); False only for ids
                the caller has range-checked against this model's classes already (shapes and dtypes are always
                checked).

        Returns:
            `GPTOutput(logits [rows, 1, V], hidden [rows, 1, dim] | None)`.
        """
        self.check_condition(cond, cond_mask, rows=cache.rows, check_range=check_range)
        t = self.config.cls_token_num
        if cache.max_seq < t:
            raise ValueError(f"cache.max_seq={cache.max_seq} is smaller than cls_token_num={t}")
        rows = cache.rows
        h = self.tok_dropout(self.embed_condition(cond).to(self.tok_embeddings.weight.dtype))
        input_pos = torch.arange(t, device=cache.device).expand(rows, t)
        cache.reset()
        causal = torch.ones(t, t, dtype=torch.bool, device=cache.device).tril()
        new_mask = causal.expand(rows, t, t)
        if cond_mask is not None:
            eye = torch.eye(t, dtype=torch.bool, device=cache.device)
            new_mask = (causal & cond_mask[:, None, :]) | eye
        mask = cache.visibility(input_pos, new_mask)[:, None]
        h = self._run(h, input_pos, mask, cache, input_pos)
        if cond_mask is not None:
            cache.key_valid[:, :t] = cond_mask
        cache.lengths = torch.full((rows,), t, dtype=torch.long, device=cache.device)
        return self._head(h[:, -1:], return_hidden)

    def check_inputs(self, input_ids, cache, input_pos, write_slots, attention_mask, cache_mask, values=True):
        """Shapes and types always; with `values`, also the id and slot ranges (two host syncs)."""
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [rows, M] tensor, got {getattr(input_ids, 'shape', input_ids)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if not isinstance(cache, StaticKVCache):
            raise ValueError(f"cache must be a StaticKVCache (see setup_cache), got {type(cache).__name__}")
        if cache.k.shape[0] != self.config.n_layer or cache.k.shape[2] != self.num_kv_heads:
            raise ValueError("cache was not built for this model (layers / kv heads differ)")
        rows, m = input_ids.shape
        if rows != cache.rows:
            raise ValueError(f"input_ids has {rows} rows but the cache has {cache.rows}")
        if values and not torch.compiler.is_compiling() and input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"input_ids must be in [0, {self.config.vocab_size}), got range [{lo}, {hi}]")
        for name, t in (("input_pos", input_pos), ("write_slots", write_slots)):
            if tuple(t.shape) != (rows, m):
                raise ValueError(f"{name} must be [rows={rows}, M={m}], got {tuple(t.shape)}")
        if attention_mask is not None and cache_mask is not None:
            raise ValueError("pass either attention_mask [rows, M, M] or cache_mask [rows, M, max_seq], not both")
        if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.shape != (rows, m, m)):
            raise ValueError(
                f"attention_mask must be bool [rows={rows}, M={m}, M={m}], got "
                f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
        if cache_mask is not None and (cache_mask.dtype != torch.bool or cache_mask.shape != (rows, m, cache.max_seq)):
            raise ValueError(
                f"cache_mask must be bool [rows={rows}, M={m}, max_seq={cache.max_seq}], got "
                f"{cache_mask.dtype} {tuple(cache_mask.shape)}"
            )
        cache.check_slots(write_slots, values=values)

    def forward(
        self,
        input_ids,
        cache,
        input_pos=None,
        write_slots=None,
        attention_mask=None,
        cache_mask=None,
        return_hidden=False,
        validate=True,
    ):
        """Score `M` new tokens per row against the cache in one forward (chain or tree).

        Args:
            input_ids: `[rows, M]` token ids (finished rows may carry any valid id as padding).
            cache: the `StaticKVCache`; K/V of the new tokens are written at `write_slots` (scratch: lengths are
                NOT advanced; call `cache.commit(n)` / `cache.commit_path(path, path_len)` afterwards).
            input_pos: `[rows, M]` RoPE positions; default the chain `cache.lengths[:, None] + arange(M)`.
            write_slots: `[rows, M]` cache slots; default `input_pos`.
            attention_mask: bool `[rows, M, M]`, True where new token i may attend to new token j (default causal;
                for trees use `mmspec.cache.tree_inputs`). The committed prefix of the row is always visible.
            cache_mask: alternatively the full bool visibility `[rows, M, max_seq]` over cache slots (after the
                write), e.g. to attend to uncommitted slots of earlier forwards (incremental tree drafting).
            return_hidden: also return the final-norm hidden states.
            validate: check token ids and slots against the vocabulary / cache size (two host syncs); the
                decoding engine passes False in its per-round forwards, whose ids come from its own sampler and
                whose slots from the cache lengths (shapes and types are always checked).

        Returns:
            `GPTOutput(logits [rows, M, V] float32, hidden [rows, M, dim] | None)`.
        """
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [rows, M] tensor, got {getattr(input_ids, 'shape', input_ids)}")
        if not isinstance(cache, StaticKVCache):
            raise ValueError(f"cache must be a StaticKVCache (see setup_cache), got {type(cache).__name__}")
        rows, m = input_ids.shape
        input_pos, write_slots, attention_mask = forward_inputs(
            cache.lengths, (rows, m), input_pos, write_slots, attention_mask, cache_mask, input_ids.device
        )
        self.check_inputs(input_ids, cache, input_pos, write_slots, attention_mask, cache_mask, values=validate)
        if cache_mask is None:
            cache_mask = cache.visibility(write_slots, attention_mask)
        h = self.tok_dropout(self.tok_embeddings(input_ids))
        h = self._run(h, input_pos, cache_mask[:, None], cache, write_slots)
        return self._head(h, return_hidden)

    # ------------------------------------------------------------------ training
    def forward_train(self, input_ids, cond, cond_mask=None, drop=None, generator=None, return_hidden=False):
        """Teacher forcing over whole image-token sequences (no cache), as upstream training.

        Args:
            input_ids: `[B, N]` image tokens, `N <= block_size`.
            cond: class ids `[B]` (c2i) or text features `[B, cls_token_num, caption_dim]` (t2i).
            cond_mask: t2i only, bool `[B, cls_token_num]`.
            drop: optional bool `[B]`: rows that get the null condition. If None and the model is in training
                mode, rows are dropped with probability `class_dropout_prob` (drawn from `generator`).
            generator: `torch.Generator` for the condition dropout.
            return_hidden: also return the final-norm hidden states.

        Returns:
            `GPTOutput(logits [B, N, V], hidden [B, N, dim] | None)`; position `i` predicts `input_ids[:, i]`.
        """
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be integer [B, N], got {getattr(input_ids, 'shape', input_ids)}")
        b, n = input_ids.shape
        if not 1 <= n <= self.config.block_size:
            raise ValueError(f"input_ids has N={n} tokens, expected 1..block_size={self.config.block_size}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must be in [0, {self.config.vocab_size})")
        self.check_condition(cond, cond_mask, rows=b)
        if drop is None and self.training and self.config.class_dropout_prob > 0:
            u = torch.rand(b, generator=generator, device=generator.device if generator is not None else "cpu")
            drop = (u < self.config.class_dropout_prob).to(input_ids.device)
        if drop is not None and (drop.dtype != torch.bool or tuple(drop.shape) != (b,)):
            raise ValueError(f"drop must be bool [B={b}], got {drop.dtype} {tuple(drop.shape)}")
        t = self.config.cls_token_num
        h = torch.cat(
            [
                self.embed_condition(cond, drop).to(self.tok_embeddings.weight.dtype),
                self.tok_embeddings(input_ids[:, :-1]),
            ],
            dim=1,
        )
        h = self.tok_dropout(h)
        length = h.shape[1]
        input_pos = torch.arange(length, device=h.device)[None]
        mask = None  # plain causal
        if cond_mask is not None:
            causal = torch.ones(length, length, dtype=torch.bool, device=h.device).tril()
            valid = torch.cat([cond_mask, cond_mask.new_ones(b, length - t)], dim=1)
            mask = ((causal & valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=h.device))[:, None]
        h = self._run(h, input_pos, mask, None, None)
        return self._head(h[:, t - 1 :], return_hidden)
