"""EAGLE head for LlamaGen (Li et al. 2024, EAGLE-1/2, arXiv 2401.15077 / 2406.16858; as used for images by
LANTERN, Jang et al. 2024): the model. Drafting with it (sampled chains, EAGLE-2 dynamic trees, the drafter's state
between rounds) is `mmspec.drafters.eagle`.

The head predicts the target's next final-norm feature from the current one and the next token:

    f_hat[t+1] = Block(fc([tok_emb(x[t+1]) ; h[t]]))       # one decoder layer of the target's block type
    q_draft(x[t+2]) = softmax(target.output(f_hat[t+1]))    # the target's output head, reused

Pair `(h[t], x[t+1])` sits at the RoPE position of `x[t+1]` (the target's position of that token), so every head
position is an image position. The head owns only `fc` and the layer; the token embedding and output head are the
target's (passed in on every call, never stored).

Head cache: `EagleHead.setup_cache` returns a one-layer `StaticKVCache` whose slot index equals the RoPE position;
its first `cls_token_num` slots are marked invalid and its lengths start at `cls_token_num`, so the chain/tree helpers
of `mmspec.cache` apply unchanged.
"""

import logging

import torch
import torch.nn as nn
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from mmspec.cache import ConcatKV, StaticKVCache, forward_inputs
from mmspec.models.config_fields import check_fields
from mmspec.models.llamagen.gpt import (
    LlamaGenGPT,
    TransformerBlock,
    ffn_hidden_dim,
    find_multiple,
    rope_2d,
    rope_factors,
)


logger = logging.getLogger(__name__)


def init_linears(modules, std, generator=None):
    """EAGLE heads' init: every `nn.Linear` of `modules` (in order; meta ones skipped) gets N(0, `std`) weights drawn
    from `generator` and zero biases."""
    for module in modules:
        if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
            nn.init.normal_(module.weight, 0.0, std, generator=generator)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


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
        check_fields("EagleHead", locals())  # types and ranges; the cross-field rules follow
        super().__init__()
        if n_head % (n_kv_head or n_head):
            raise ValueError(f"n_head={n_head} must be divisible by n_kv_head={n_kv_head}")
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
        init_linears(self.modules(), self.config.initializer_range, generator)
        return self

    @property
    def head_dim(self):
        return self.config.dim // self.config.n_head

    def check_target(self, target):
        """Raise unless this head was made for the LlamaGen `target`: TypeError for another kind of target (e.g. a
        transformers VLM), ValueError naming the field for another width (`dim`), vocabulary (`vocab_size`, the
        codebook), condition prefix (`cls_token_num`: c2i 1, t2i the caption length) or token grid (`block_size`)."""
        if not isinstance(target, LlamaGenGPT):
            raise TypeError(f"this EagleHead drafts for a LlamaGenGPT image model, the target is a "
                            f"{type(target).__name__}")  # fmt: skip
        c, t = self.config, target.config
        for name in ("dim", "vocab_size", "cls_token_num", "block_size"):
            if getattr(c, name) != getattr(t, name):
                raise ValueError(f"target {name}={getattr(t, name)} does not match the head's {getattr(c, name)} "
                                 f"(expected {name}={getattr(t, name)}, found {getattr(c, name)})")  # fmt: skip

    def rope(self, input_pos):
        """`rope_factors` of the 2-D RoPE at `input_pos` (made once per forward; `apply_rope` takes them as they are)."""
        c = self.config
        return rope_factors(
            rope_2d(input_pos, self.head_dim, c.rope_base, c.cls_token_num, int(round(c.block_size**0.5)))
        )

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

    def _inputs(self, hidden, input_ids, target, validate=True):
        if hidden.dim() != 3 or hidden.shape[-1] != self.config.dim:
            raise ValueError(f"hidden must be [rows, M, dim={self.config.dim}], got {tuple(hidden.shape)}")
        if input_ids.dim() != 2 or tuple(input_ids.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"input_ids must be [rows, M] = {tuple(hidden.shape[:2])}, got {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if validate and not torch.compiler.is_compiling() and input_ids.numel():
            if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size:
                raise ValueError(f"input_ids must be in [0, {self.config.vocab_size})")
        self.check_target(target)
        emb = target.tok_embeddings(input_ids).to(self.fc.weight.dtype)
        return self.fc(torch.cat([emb, hidden.to(self.fc.weight.dtype)], dim=-1))

    def forward(
        self,
        hidden,
        input_ids,
        target,
        cache,
        input_pos=None,
        write_slots=None,
        attention_mask=None,
        cache_mask=None,
        validate=True,
    ):
        """Draft features for `M` pairs per row (chain by default, or a tree via positions/slots/mask).

        Args:
            hidden: `[rows, M, dim]` target final-norm features h[t] (or the head's own f_hat inside a tree).
            input_ids: `[rows, M]` the next tokens x[t+1].
            target: the `LlamaGenGPT` whose `tok_embeddings` are used.
            cache, input_pos, write_slots, attention_mask, cache_mask, validate: as `LlamaGenGPT.forward` (head
                cache; `validate=False` skips the id / slot range checks, the drafters' per-round setting).

        Returns:
            `f_hat [rows, M, dim]`; `self.compute_logits(target, f_hat)` gives the draft logits.
        """
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [rows, M] tensor, got {getattr(input_ids, 'shape', input_ids)}")
        rows, m = input_ids.shape
        if not isinstance(cache, StaticKVCache) or cache.k.shape[0] != 1 or cache.rows != rows:
            raise ValueError("cache must be this head's StaticKVCache (setup_cache) with one row per input row")
        input_pos, write_slots, attention_mask = forward_inputs(
            cache.lengths, (rows, m), input_pos, write_slots, attention_mask, cache_mask, input_ids.device
        )
        if cache_mask is None:
            if attention_mask.shape != (rows, m, m) or attention_mask.dtype != torch.bool:
                raise ValueError(f"attention_mask must be bool [rows={rows}, M={m}, M={m}]")
            cache.check_slots(write_slots, values=validate)
            cache_mask = cache.visibility(write_slots, attention_mask)
        else:
            cache.check_slots(write_slots, values=validate)
        if tuple(input_pos.shape) != (rows, m):
            raise ValueError(f"input_pos must be [rows={rows}, M={m}], got {tuple(input_pos.shape)}")
        x = self._inputs(hidden, input_ids, target, validate)
        return self.layers[0](x, self.rope(input_pos), cache_mask[:, None], cache, 0, write_slots)

    def capture(self, compiler):
        """This head's per-step forward captured by `compiler` (a `mmspec.decoding.compiled.Compiler`, role
        "drafter"): the whole `forward` (validated on shapes only with `validate=False`), one graph per shape."""
        return compiler.forward("drafter", self)

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
        kv = ConcatKV()
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
