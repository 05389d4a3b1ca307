"""EAGLE head for a transformers decoder LM / LLaVA target (Li et al. 2024, EAGLE-1/2, arXiv 2401.15077 /
2406.16858): the text twin of `mmspec.models.llamagen.eagle.EagleHead`, with the same call signature, so the engine's
`mmspec.drafters.eagle` (chains, EAGLE-2 dynamic trees, `EagleDrafter`) drives both.

    f_hat[t+1] = LlamaDecoderLayer(fc([embed(x[t+1]) ; h[t]]))     # one decoder layer, transformers' own class
    q_draft(x[t+2]) = softmax(lm_head(f_hat[t+1]))                   # the target's output head, reused

`h` are the target's final-norm hidden states. Optional draft vocabulary (`draft_vocab_size > 0`; FR-Spec, Zhao et
al. 2025, arXiv 2502.14856; EAGLE-3's `d2t`): the head scores only the `draft_vocab` ids (e.g. the 2,048 most
frequent answer tokens) -- at batch 1 on a CPU the 49,152 x 576 output head is most of a draft step's weight
traffic -- and every other token gets probability 0 in `q_draft`. Verification is unchanged, so drafting stays
lossless (a draft outside the subset is simply never proposed). The token embedding and output head are the target's
(`get_input_embeddings()` / `get_output_embeddings()`, passed in on every call, never stored). Pair `(h[t], x[t+1])`
sits at the RoPE position of `x[t+1]`; the head cache (`setup_cache`) is a one-layer `StaticKVCache` whose slot is
the position, slot 0 (no pair ends there) invalid and lengths starting at 1; a forward reads only the slots in use
(`mmspec.models.hf.target.attention_window`), not the whole allocation. Image tokens of a LLaVA prompt enter as
the embedding of the image placeholder id (the head sees the image only through the target's hidden states).
"""

import functools
import logging

import torch
import torch.nn as nn
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from huggingface_hub.errors import StrictDataclassError
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from mmspec.cache import ConcatKV, StaticKVCache, chain_inputs
from mmspec.models.hf.target import StaticCache, attention_window, window_view
from mmspec.models.llamagen.eagle import EagleHead


logger = logging.getLogger(__name__)

__all__ = ["TextEagleHead"]


class TextEagleHead(ModelMixin, ConfigMixin):
    """One-layer EAGLE head for a transformers text target (see module docstring)."""

    cache_class = StaticKVCache  # the head cache `setup_cache` makes (a subclass may keep per-row state in it)
    windowed_cache = True  # forwards read an attention window of the cache (host bookkeeping: `sync_host`)

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 49152,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int = 64,
        rope_theta: float = 100000.0,
        rms_norm_eps: float = 1e-5,
        max_position_embeddings: int = 8192,
        initializer_range: float = 0.02,
        draft_vocab_size: int = 0,
    ):
        super().__init__()
        if not 0 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, vocab_size={vocab_size}], got {draft_vocab_size}")
        self.register_buffer("draft_vocab", torch.arange(draft_vocab_size, dtype=torch.long))
        self._sub_weight = None  # (key, the target head's rows at draft_vocab as [dim, N]), refreshed on a new target
        try:
            self.layer_config = LlamaConfig(
                vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=1,
                num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, max_position_embeddings=max_position_embeddings,
            )  # fmt: skip
        except StrictDataclassError as err:  # transformers' config validation: a ValueError for `load` to name
            raise ValueError(f"the decoder layer's config is invalid: {err}") from err
        self.layer_config._attn_implementation = "sdpa"
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=True)
        self.layer = LlamaDecoderLayer(self.layer_config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(self.layer_config)
        self.init_weights()

    @classmethod
    def from_target(cls, target, **overrides):
        """A head whose shapes match the transformers `target` (its text config)."""
        t = target.config.get_text_config()
        rope = getattr(t, "rope_parameters", None) or {}
        kwargs = dict(
            vocab_size=target.get_output_embeddings().weight.shape[0], hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads, head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
            rope_theta=float(rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))), rms_norm_eps=t.rms_norm_eps,
            max_position_embeddings=t.max_position_embeddings,
        )  # fmt: skip
        kwargs.update(overrides)
        return cls(**kwargs)

    init_weights = EagleHead.init_weights  # N(0, initializer_range) Linear weights, zero biases

    def check_target(self, target):
        """Raise unless this head was made for the transformers `target`: TypeError for another kind of target (e.g.
        a LlamaGen image model), ValueError naming the field for another `hidden_size` or vocabulary (`vocab_size`:
        the target's output head rows), or a `draft_vocab` id outside that vocabulary or repeated."""
        config_of = getattr(getattr(target, "config", None), "get_text_config", None)
        if not callable(config_of) or not callable(getattr(target, "get_output_embeddings", None)):
            raise TypeError(f"this {type(self).__name__} drafts for a transformers VLM / causal LM, the target is a "
                            f"{type(target).__name__}")  # fmt: skip
        t = config_of()
        vocab = target.get_output_embeddings().weight.shape[0]
        for name, theirs in (("hidden_size", t.hidden_size), ("vocab_size", vocab)):
            if getattr(self.config, name) != theirs:
                raise ValueError(
                    f"target {name}={theirs} does not match the EAGLE head's {getattr(self.config, name)} "
                    f"(expected {name}={theirs}, found {getattr(self.config, name)})"
                )
        ids = self.draft_vocab
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = ids[(ids < 0) | (ids >= vocab)]
            raise ValueError(f"draft_vocab holds {bad.numel()} token id(s) outside the target's vocabulary: expected "
                             f"ids in [0, {vocab}), found {int(bad[0])}")  # fmt: skip
        if ids.numel() and int(torch.unique(ids).numel()) != ids.numel():
            raise ValueError(f"draft_vocab repeats token ids: expected {ids.numel()} distinct ids, found "
                             f"{int(torch.unique(ids).numel())}")  # fmt: skip

    def setup_cache(self, rows, max_seq, dtype=None, device=None):
        """One-layer cache (a `cache_class`), slot == position, slot 0 invalid, lengths 1 (`max_seq`: prompt + new
        tokens + scratch)."""
        c, p = self.config, next(self.parameters())
        cache = self.cache_class(1, rows, c.num_key_value_heads, int(max_seq) + 1, c.head_dim,
                                 dtype=dtype or p.dtype, device=device or p.device)  # fmt: skip
        cache.key_valid[:, 0] = False
        cache.lengths = torch.ones(rows, dtype=torch.long, device=cache.device)
        return cache

    def _inputs(self, hidden, input_ids, target):
        if hidden.dim() != 3 or hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden must be [rows, M, {self.config.hidden_size}], got {tuple(hidden.shape)}")
        if tuple(input_ids.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"input_ids must be [rows, M] = {tuple(hidden.shape[:2])}, got {tuple(input_ids.shape)}")
        emb = target.get_input_embeddings()(input_ids).to(self.fc.weight.dtype)
        return self.fc(torch.cat([emb, hidden.to(self.fc.weight.dtype)], dim=-1))

    def _layer(self, x, positions, mask, cache):
        return self.layer(x, attention_mask=mask, position_embeddings=self.rotary(x, positions),
                          position_ids=positions, past_key_values=cache, use_cache=cache is not None)  # fmt: skip

    def forward(self, hidden, input_ids, target, cache, input_pos=None, write_slots=None, attention_mask=None,
                cache_mask=None, validate=True, step=None, window=None):  # fmt: skip
        """Draft features for `M` pairs per row, as `EagleHead.forward` (chain by default, or a tree via
        `input_pos`, `write_slots` and `cache_mask [rows, M, max_seq]`). Returns `f_hat [rows, M, dim]`. The slots
        and masks are made here (the attention window is read on the host, or given: `window`, a whole captured
        round's, `mmspec.models.hf.target.round_window`); the layer runs in `step` (default `self.step`; `capture`
        passes its compiled graph)."""
        rows, m = input_ids.shape
        if not isinstance(cache, StaticKVCache) or cache.k.shape[0] != 1 or cache.rows != rows:
            raise ValueError("cache must be this head's StaticKVCache (setup_cache) with one row per input row")
        if input_pos is None:
            input_pos, slots, causal = chain_inputs(cache.lengths, m)
            write_slots = slots if write_slots is None else write_slots
            attention_mask = causal if attention_mask is None else attention_mask
        write_slots = input_pos if write_slots is None else write_slots
        cache.check_slots(write_slots, values=validate)
        if window is None:  # only the slots in use (earlier nodes of a tree sit below this forward's slots)
            window = attention_window(cache, write_slots, write_slots.shape[1])
        view = window_view(cache, window)
        if cache_mask is None:
            cache_mask = view.visibility(write_slots, attention_mask)
        else:
            cache_mask = cache_mask[..., : view.max_seq]
        hf_cache = StaticCache(view)
        hf_cache.write_slots = write_slots
        return (step or self.step)(hidden, input_ids, target, cache, input_pos, cache_mask[:, None], hf_cache)

    def step(self, hidden, input_ids, target, cache, input_pos, mask, hf_cache):
        """The tensor part of `forward`: the layer inputs of the new pairs and the decoder layer over them (`mask
        [rows, 1, M, window]`, `hf_cache` the window's `StaticCache` at this forward's write slots)."""
        x = self._draft_inputs(hidden, input_ids, target, cache)
        return self._layer(x, self._rope_positions(input_pos, cache), mask, hf_cache)

    def capture(self, compiler):
        """This head's per-step forward with `step` captured by `compiler` (a `mmspec.decoding.compiled.Compiler`,
        role "drafter"): one graph per (pairs, attention-window bucket); the window and masks stay on the host."""
        run = compiler.forward("drafter", self, self.step)
        return functools.partial(self.forward, step=run)

    def _draft_inputs(self, hidden, input_ids, target, cache):
        """Layer inputs of new pairs at inference (hook: `VisionEagleHead` fuses its global image vector)."""
        return self._inputs(hidden, input_ids, target)

    def _rope_positions(self, input_pos, cache):
        """RoPE positions of new pairs whose logical index (slot space) is `input_pos` (hook: a draft cache whose slots
        are not positions, `VisionEagleHead`). Here slot == position."""
        return input_pos

    def forward_unrolled(self, hidden, input_ids, target, steps, valid=None):
        """Training-time test (as `EagleHead.forward_unrolled`): step 0 is teacher forcing over pairs
        `(hidden[:, i], input_ids[:, i])` at positions `i + 1`; step `j` feeds the head its own step `j - 1` output
        and attends like the depth-`j + 1` node of a drafted chain. `valid [B, N]` (bool, optional) masks padded
        keys. Returns `steps` tensors `[B, N, dim]`; entry `j` at `i` regresses `hidden[:, i + 1]` (meaningful for
        `i >= j`)."""
        b, n = input_ids.shape
        pos = (torch.arange(n, device=input_ids.device) + 1)[None].expand(b, n)
        return self.unrolled_steps(lambda feats: self._inputs(feats, input_ids, target), hidden, pos, steps, valid)

    def unrolled_steps(self, inputs_of, feats, positions, steps, valid=None):
        """The training-time-test loop over a sequence of `N` draft entries in attention order: step 0 runs the layer
        on `inputs_of(feats)` (`feats [B, N, dim]`, layer inputs `[B, N, dim]`) causally at RoPE `positions [B, N]` (or
        `[3, B, N]`, M-RoPE);
        step `j` shifts its outputs by one entry (entry `i` gets output `i - 1`) and attends to step-0 keys `<= i - j`
        and to its own chain `i - j + 1 .. i` of the later steps. Returns the `steps` outputs `[B, N, dim]`."""
        b, n = positions.shape[-2:]  # [B, N], or [3, B, N] (M-RoPE)
        i = torch.arange(n, device=positions.device)
        cache = StaticCache(ConcatKV())  # keys appended out of place: autograd flows through every step
        outputs = []
        for j in range(steps):
            blocks = [i[None, :] <= i[:, None] - j] + [i[None, :] == i[:, None] - j + s for s in range(1, j + 1)]
            mask = torch.cat(blocks, dim=1)[None, None].expand(b, 1, n, (j + 1) * n)
            if valid is not None:
                mask = mask & valid.repeat(1, j + 1)[:, None, None, :]
            itself = torch.zeros(n, (j + 1) * n, dtype=torch.bool, device=positions.device)
            itself[i, j * n + i] = True  # a padded query still sees itself (no empty rows, no NaN)
            mask = mask | itself[None, None]
            out = self._layer(inputs_of(feats), positions, mask, cache)
            outputs.append(out)
            feats = torch.cat([out[:, :1], out[:, :-1]], dim=1)  # entry i now gets f_j[i - 1]
        return outputs

    def set_draft_vocab(self, ids):
        """Score only token `ids` (`[draft_vocab_size]`, distinct, in range) when drafting."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if tuple(ids.shape) != (self.config.draft_vocab_size,) or len(set(ids.tolist())) != len(ids):
            raise ValueError(f"ids must be {self.config.draft_vocab_size} distinct token ids")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"ids must be in [0, {self.config.vocab_size})")
        self.draft_vocab.copy_(ids.to(self.draft_vocab.device))
        self._sub_weight = None
        return self

    def draft_logits(self, target, features):
        """Logits `[..., N]` (float32) over the draft vocabulary only (the full vocabulary when it is off)."""
        head = target.get_output_embeddings()
        if not self.config.draft_vocab_size:
            return head(features.to(head.weight.dtype)).float()
        w = head.weight
        if torch.compiler.is_compiling():  # a captured round: the rows gathered before it (`draft_weights`)
            return (features.to(w.dtype) @ self._sub_weight[1]).float()
        return (features.to(w.dtype) @ self.draft_weights(target)).float()

    def prepare_round(self, target) -> tuple:
        """What a captured round's graph reads but cannot make (`mmspec.drafters.eagle`, before each graph): the
        draft vocabulary's rows of the target's output head (`draft_weights`). Returns the tensors made here, which
        the graph reads in place (static addresses)."""
        return (self.draft_weights(target),) if self.config.draft_vocab_size else ()

    def draft_weights(self, target):
        """The target output head's rows at `draft_vocab` as `[dim, N]` (cheap small-M products), gathered again
        when the target's head or the vocabulary changed. A captured round calls it before its graph."""
        w = target.get_output_embeddings().weight
        key = (w.data_ptr(), w._version, w.device, self.draft_vocab.data_ptr())
        if self._sub_weight is None or self._sub_weight[0] != key or torch.is_grad_enabled():
            self._sub_weight = (key, w[self.draft_vocab].t().contiguous())
        return self._sub_weight[1]

    def compute_logits(self, target, features):
        """Draft logits `[..., V]` (float32) through the target's output head (`-inf` outside the draft vocabulary)."""
        logits = self.draft_logits(target, features)
        if not self.config.draft_vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab, logits)
