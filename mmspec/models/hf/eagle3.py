"""EAGLE-3 head for a transformers decoder LM / LLaVA target (Li et al. 2025, arXiv 2503.01840), in the layout vLLM
and SGLang load (`Eagle3LlamaForCausalLM` / `LlamaForCausalLMEagle3`, `mmspec.models.hf.eagle3_export`):

    g[t]    = fc([a_1[t] ; a_2[t] ; a_3[t]])                  # the target's low / middle / high hidden states
    x       = [input_layernorm(embed(x[t+1])) ; hidden_norm(g[t])]      # 2 * hidden wide
    r       = g[t] + self_attn(x)                             # q / k / v read 2 * hidden, o writes hidden
    f[t+1]  = r + mlp(post_attention_layernorm(r))           # the head's feature (pre-norm, fed back when drafting)
    q_draft(x[t+2]) = softmax(lm_head(norm(f[t+1])))          # over the draft vocabulary, target id = draft id + d2t

`a_i` are the inputs of the target's decoder layers `aux_layers` (default `(2, L // 2, L - 3)`, the engines'
default; index `i` is transformers' `hidden_states[i]` and vLLM's `eagle_aux_hidden_state_layer_ids`), concatenated
in that (ascending) order; the target adapter returns them instead of its final-norm hidden states when built with
`HFTarget(..., hidden_layers=head.config.aux_layers)`. When the head drafts past the accepted tokens it is fed its own
feature `f` (hidden wide) instead of `fc(a)`: `_inputs` tells the two apart by width, as SGLang does. Unlike EAGLE-1
(`mmspec.models.hf.eagle.TextEagleHead`) the head owns its output head and final norm, over a reduced draft
vocabulary (`draft_vocab`, FR-Spec: the most frequent target tokens of the training answers); the token embedding is
the target's (passed in on every call). Everything else -- the cache, chains, EAGLE-2 trees, training-time test,
capture -- is `TextEagleHead`'s, so the engine's `EagleDrafter` drives it unchanged.

Image positions (`image_inputs`), fixed at training and honoured when drafting:

* `"placeholder"` (vLLM's `Eagle3LlamaForCausalLM.embed_input_ids` ignores multimodal embeddings): an image token
  enters as the embedding of the image placeholder id; the head sees the image only through the aux hidden states;
* `"embeds"` (SGLang's EAGLE worker passes the target's merged `input_embeds` to the draft): an image token enters as
  the projected image feature the target's decoder received. The drafter then reads the target's merged input
  embeddings at prefill (`prefill_prompt`, `HFTarget.prefill(return_vision=True)`).

RoPE positions (`positions`), fixed at training and honoured when drafting:

* `"slot"`: pair `(a[t], x[t+1])` at 1-D position `t + 1` (the text EAGLE head's; on a 1-D RoPE target the engines'
  `t` differs by a constant, which RoPE does not see);
* `"mrope"` (the default on an M-RoPE target: Qwen2-VL / Qwen2.5-VL / Qwen3-VL): pair `(a[t], x[t+1])` at the
  *target's* 3-D M-RoPE position of token `t` -- the model's own `get_rope_index` ids over the prompt (image tokens
  at their grid coordinates), `t + rope_delta` on every axis after it, drafted tokens continuing by one per step --
  rotated with the target's `mrope_section` (and Qwen3-VL's interleaving, `mrope_interleaved`). This is what both
  engines give an EAGLE-3 draft of an M-RoPE target (vLLM `v1/spec_decode/eagle.py`: the target's
  `target_positions`, `positions += 1` per step when `uses_mrope`; SGLang `llama_eagle3.py`:
  `forward_batch.mrope_positions` when `rope_scaling` has `mrope_section`): training passes the target's
  position ids of the sequence (`forward_unrolled(positions=...)`), drafting reads the prompt's from the target's
  prefill (`set_prompt_positions`, `mmspec.models.hf.mrope.MRopeDraftCache`).
"""

import functools
import logging

import torch
import torch.nn as nn
from diffusers import ModelMixin
from diffusers.configuration_utils import register_to_config
from huggingface_hub.errors import StrictDataclassError
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from mmspec.cache import StaticKVCache
from mmspec.models.config_fields import check_fields
from mmspec.models.hf.eagle import TextEagleHead
from mmspec.models.hf.mrope import MRopeDraftCache, mrope_axes, mrope_cos_sin, mrope_params
from mmspec.models.llamagen.eagle import EagleHead


logger = logging.getLogger(__name__)

__all__ = ["IMAGE_INPUTS", "POSITIONS", "Eagle3Head", "default_aux_layers"]

IMAGE_INPUTS = ("placeholder", "embeds")  # what an image position feeds the head (module docstring)
POSITIONS = ("slot", "mrope")  # the RoPE positions of the head's pairs (module docstring)


def default_aux_layers(num_layers):
    """The engines' default aux layers of an `num_layers`-layer target: `(2, L // 2, L - 3)` (vLLM / SGLang)."""
    return (2, num_layers // 2, num_layers - 3)


class _MidLayer(nn.Module):
    """The head's one decoder layer, named as the engines' checkpoints name it (`midlayer.*`)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, heads, kv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.self_attn = LlamaAttention(config, layer_idx=0)
        self.self_attn.q_proj = nn.Linear(2 * h, heads * hd, bias=False)  # [embedding ; feature] in
        self.self_attn.k_proj = nn.Linear(2 * h, kv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, kv * hd, bias=False)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)


class Eagle3Head(TextEagleHead):
    """One-layer EAGLE-3 head for a transformers text target (see the module docstring).

    Args:
        vocab_size: the target's vocabulary (output head rows).
        hidden_size: the head's width (the target's embedding width: the embedding is the target's).
        target_hidden_size: the width of one target hidden state (`fc` reads `len(aux_layers)` of them).
        draft_vocab_size: tokens the head scores (0: all `vocab_size`).
        aux_layers: target decoder layers whose inputs are fused (strictly ascending, >= 0).
        image_inputs: `"placeholder"` or `"embeds"` (module docstring).
        positions: `"slot"` or `"mrope"` (module docstring); `mrope_section` (the target's `[t, h, w]` frequency
            counts, summing to `head_dim / 2`) and `mrope_interleaved` (Qwen3-VL) with `"mrope"` only.
        others: the decoder layer's shapes (`LlamaConfig` fields).
    """

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 49152,
        hidden_size: int = 576,
        target_hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int = 64,
        rope_theta: float = 100000.0,
        rms_norm_eps: float = 1e-5,
        max_position_embeddings: int = 8192,
        initializer_range: float = 0.02,
        draft_vocab_size: int = 0,
        aux_layers: tuple = (2, 15, 27),
        image_inputs: str = "placeholder",
        positions: str = "slot",
        mrope_section: tuple = (),
        mrope_interleaved: bool = False,
    ):
        check_fields("Eagle3Head", locals())  # types and ranges; the cross-field rules follow
        ModelMixin.__init__(self)  # not TextEagleHead's layers: this head's own, below
        aux = list(aux_layers) if isinstance(aux_layers, (list, tuple)) else None
        if not aux or aux != sorted(set(aux)):
            raise ValueError(f"aux_layers must be a non-empty, strictly ascending list of layer indices >= 0, got "
                             f"{aux_layers!r}")  # fmt: skip
        if image_inputs not in IMAGE_INPUTS:
            raise ValueError(f"image_inputs must be one of {IMAGE_INPUTS}, got {image_inputs!r}")
        if not 0 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, vocab_size={vocab_size}], got {draft_vocab_size}")
        if positions == "mrope" and (len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2):
            raise ValueError(f"mrope_section must be the target's 3 M-RoPE sections summing to head_dim / 2 = "
                             f"{head_dim // 2} (positions='mrope'), got {list(mrope_section)}")  # fmt: skip
        if positions == "slot" and (mrope_section or mrope_interleaved):
            raise ValueError("mrope_section / mrope_interleaved are for positions='mrope' (got positions='slot')")
        if len(aux) * target_hidden_size == hidden_size:
            raise ValueError(f"len(aux_layers) * target_hidden_size must differ from hidden_size={hidden_size} (the "
                             "head tells fused target states from its own features by their width)")  # fmt: skip
        self.register_buffer("draft_vocab", torch.arange(draft_vocab_size, dtype=torch.long))
        self._sub_weight = None
        try:
            self.layer_config = LlamaConfig(
                vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=1,
                num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, max_position_embeddings=max_position_embeddings,
            )  # fmt: skip
        except StrictDataclassError as err:
            raise ValueError(f"the decoder layer's config is invalid: {err}") from err
        self.layer_config._attn_implementation = "sdpa"
        self.fc = nn.Linear(len(aux) * target_hidden_size, hidden_size, bias=False)
        self.midlayer = _MidLayer(self.layer_config)
        self.norm = LlamaRMSNorm(hidden_size, eps=rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size or vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(self.layer_config)
        self.cache_class = MRopeDraftCache if positions == "mrope" else StaticKVCache
        self._mrope_axes = {}  # device -> the axis of each rotary frequency (`mrope_axes`), made on first use
        self.init_weights()

    @classmethod
    def from_target(cls, target, **overrides):
        """A head whose shapes match the transformers `target` (its text config), aux layers the engines' default,
        positions the engines' for it (`"mrope"` with the target's sections on an M-RoPE target, else `"slot"`).
        The decoder layer's sizes (`intermediate_size`, `num_attention_heads`, ...) may be overridden to make a
        smaller head; `hidden_size` stays the target's (the embedding is shared)."""
        t = target.config.get_text_config()
        rope = getattr(t, "rope_parameters", None) or {}
        kwargs = dict(
            vocab_size=target.get_output_embeddings().weight.shape[0], hidden_size=t.hidden_size,
            target_hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
            num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
            rope_theta=float(rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))), rms_norm_eps=t.rms_norm_eps,
            max_position_embeddings=t.max_position_embeddings,
            aux_layers=default_aux_layers(t.num_hidden_layers),
        )  # fmt: skip
        mrope = mrope_params(target.config)
        if mrope is not None and overrides.get("positions", "mrope") == "mrope":
            kwargs.update(positions="mrope", **mrope)
        kwargs.update(overrides)
        return cls(**kwargs)

    init_weights = EagleHead.init_weights  # N(0, initializer_range) Linear weights (norms stay ones)

    @torch.no_grad()
    def init_from_target(self, target):
        """Start the output head from the target's rows at the draft vocabulary and the final norm from the
        target's (the head's feature then starts where the target's last hidden state lives)."""
        rows = target.get_output_embeddings().weight
        self.lm_head.weight.copy_(rows[self.draft_vocab] if self.config.draft_vocab_size else rows)
        final_norm = getattr(getattr(target.model, "language_model", target.model), "norm", None)
        if final_norm is not None and final_norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(final_norm.weight)
        return self

    @property
    def fused_size(self):
        """Width of the fused target states `fc` reads: `len(aux_layers) * target_hidden_size`."""
        return len(self.config.aux_layers) * self.config.target_hidden_size

    def check_target(self, target):
        """`TextEagleHead.check_target` (hidden size, vocabulary, draft vocabulary ids), plus the target's width
        (`target_hidden_size`) and depth: every aux layer must be one of its decoder layers."""
        config_of = getattr(getattr(target, "config", None), "get_text_config", None)
        if callable(config_of):
            t = config_of()
            if t.hidden_size != self.config.target_hidden_size:
                raise ValueError(f"target hidden_size={t.hidden_size} does not match the EAGLE-3 head's "
                                 f"target_hidden_size={self.config.target_hidden_size} (expected "
                                 f"{t.hidden_size}, found {self.config.target_hidden_size})")  # fmt: skip
            self.check_positions(target.config)
            bad = [i for i in self.config.aux_layers if i >= t.num_hidden_layers]
            if bad:
                raise ValueError(f"aux_layers {list(self.config.aux_layers)} name layer(s) {bad} of a target with "
                                 f"{t.num_hidden_layers} decoder layers (expected indices < {t.num_hidden_layers})")  # fmt: skip
        super().check_target(target)

    def check_positions(self, target_config):
        """Raise ValueError naming `mrope_section` unless a `positions="mrope"` head's sections (and interleaving)
        are the target's (`target_config`): it was trained on that target's M-RoPE ids."""
        if self.config.positions != "mrope":
            return
        mrope = mrope_params(target_config)
        mine = {"mrope_section": list(self.config.mrope_section), "mrope_interleaved": self.config.mrope_interleaved}
        if mrope != mine:
            raise ValueError(f"the head's M-RoPE positions ({mine}) are not the target's ({mrope or 'no M-RoPE'}): "
                             "it was trained for another target (expected its mrope_section)")  # fmt: skip

    def _inputs(self, hidden, input_ids, target, embeds=None):
        """`[embedding ; feature]` `[rows, M, 2 * hidden]`: `hidden` is the fused target states (`fused_size` wide,
        through `fc`) or the head's own features (`hidden_size` wide); `embeds` (optional `[rows, M, hidden]`)
        replaces the token embeddings (image features, `image_inputs="embeds"`)."""
        width = hidden.shape[-1] if hidden.dim() == 3 else None
        if width not in (self.fused_size, self.config.hidden_size):
            raise ValueError(f"hidden must be [rows, M, {self.fused_size}] (the target's aux hidden states "
                             f"{list(self.config.aux_layers)}) or [rows, M, {self.config.hidden_size}] (the head's "
                             f"features), got {tuple(hidden.shape)}")  # fmt: skip
        if tuple(input_ids.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"input_ids must be [rows, M] = {tuple(hidden.shape[:2])}, got {tuple(input_ids.shape)}")
        dtype = self.fc.weight.dtype
        feature = hidden.to(dtype)
        if width == self.fused_size:
            feature = self.fc(feature)
        emb = target.get_input_embeddings()(input_ids) if embeds is None else embeds
        return torch.cat([emb.to(dtype), feature], dim=-1)

    def _layer(self, x, positions, mask, cache):
        emb, feature = x.split(self.config.hidden_size, dim=-1)
        m = self.midlayer
        attn_in = torch.cat([m.input_layernorm(emb), m.hidden_norm(feature)], dim=-1)
        if positions.dim() == 3:  # [3, rows, M]: the target's M-RoPE positions
            rope, ids = mrope_cos_sin(self.rotary, feature, positions, self.mrope_axes(feature.device)), None
        else:
            rope, ids = self.rotary(feature, positions), positions
        attn, _ = m.self_attn(attn_in, position_embeddings=rope, attention_mask=mask, past_key_values=cache,
                              position_ids=ids)  # fmt: skip
        r = feature + attn
        return r + m.mlp(m.post_attention_layernorm(r))

    def forward_unrolled(self, hidden, input_ids, target, steps, valid=None, embeds=None, positions=None):
        """Training-time test (`TextEagleHead.forward_unrolled`): step 0 reads the fused target states `hidden
        [B, N, fused_size]`, step `j` the head's own step `j - 1` features. `embeds` (optional `[B, N, hidden]`):
        the embeddings of `input_ids` with image features at image positions (`image_inputs="embeds"`).
        `positions`: with `positions="mrope"` (required there) the target's M-RoPE position ids of the tokens the
        pairs' hidden states come from, `[3, B, N]` (the sequence's `position_ids[..., :-1]`); `"slot"`: pair `i`
        at `i + 1` (1-D)."""
        b, n = input_ids.shape
        if self.config.positions == "mrope":
            if positions is None or tuple(positions.shape) != (3, b, n):
                raise ValueError(f"positions must be the target's M-RoPE position ids of the pairs [3, {b}, {n}] "
                                 f"(the head's positions='mrope'), got "
                                 f"{None if positions is None else tuple(positions.shape)}")  # fmt: skip
            pos = positions.to(input_ids.device)
        else:
            pos = (torch.arange(n, device=input_ids.device) + 1)[None].expand(b, n)
        return self.unrolled_steps(lambda feats: self._inputs(feats, input_ids, target, embeds), hidden, pos, steps,
                                   valid)  # fmt: skip

    # ------------------------------------------------------------------ positions
    def mrope_axes(self, device):
        """`[head_dim / 2]` the M-RoPE axis of each rotary frequency (`mmspec.models.hf.mrope.mrope_axes`) on
        `device` (made once per device: no host-to-device copy per forward)."""
        if device not in self._mrope_axes:
            axes = mrope_axes(self.config.mrope_section, self.config.mrope_interleaved)
            self._mrope_axes[device] = torch.tensor(axes, dtype=torch.long, device=device)
        return self._mrope_axes[device]

    def set_prompt_positions(self, cache, positions, lengths):
        """The drafter's hook at prefill: a `positions="mrope"` head keeps the target's prompt positions `[3, rows,
        L]` (`TargetOutput.positions`) in its cache, so its pairs sit where the target's tokens do; a `"slot"` head
        needs nothing."""
        if self.config.positions == "mrope":
            cache.set_prompt(positions, lengths)

    def _rope_positions(self, input_pos, cache):
        """`"mrope"`: the target's position of the token whose hidden state the pair at slot `input_pos` carries
        (`MRopeDraftCache.pair_positions`, `[3, rows, M]`); `"slot"`: the slot."""
        return cache.pair_positions(input_pos) if self.config.positions == "mrope" else input_pos

    # ------------------------------------------------------------------ image inputs
    @property
    def prefill_prompt(self):
        """The `EagleDrafter` hook that writes the prompt's pairs itself (`image_inputs="embeds"`: the image features
        at image positions), or None (`"placeholder"`: the drafter's own text path, which feeds token ids)."""
        return self._prefill_embeds if self.config.image_inputs == "embeds" else None

    def _prefill_embeds(self, target, cache, hidden, nxt, lengths, inputs_embeds, image_mask, host_prompt=None):
        """Write the prompt pairs `(a[t], x[t+1])` for `t < L_r - 1` with `x[t+1]` entering as the decoder's merged
        input embedding (image features at image tokens); the last pair `(a[L_r - 1], first token)` stays pending
        (the drafter feeds it with the first draft)."""
        if hidden.shape[1] > 1:
            step = functools.partial(self._embeds_step, inputs_embeds[:, 1:])
            self(hidden[:, :-1], nxt[:, :-1], target, cache, step=step)
            cache.commit(lengths - 1)
        tokens = list(host_prompt[1]) if host_prompt is not None else image_mask.sum(1)
        return {"draft_image_tokens": tokens}

    def _embeds_step(self, embeds, hidden, input_ids, target, cache, input_pos, mask, hf_cache):
        x = self._inputs(hidden, input_ids, target, embeds)
        return self._layer(x, self._rope_positions(input_pos, cache), mask, hf_cache)

    # ------------------------------------------------------------------ output head
    def set_draft_vocab(self, ids):
        """Score only token `ids` (`[draft_vocab_size]`, distinct, in range): draft index `i` is target id
        `ids[i]` (the engines' `d2t[i] = ids[i] - i`)."""
        super().set_draft_vocab(ids)
        self._sub_weight = None
        return self

    def prepare_round(self, target) -> tuple:
        """Nothing to gather before a captured round: the draft vocabulary's head is the head's own."""
        return ()

    def draft_logits(self, target, features):
        """Logits `[..., N]` (float32) over the draft vocabulary (the head's own output head and final norm)."""
        return self.lm_head(self.norm(features.to(self.lm_head.weight.dtype))).float()

    def compute_logits(self, target, features):
        """Draft logits `[..., V]` (float32) over the target's vocabulary (`-inf` outside the draft vocabulary)."""
        logits = self.draft_logits(target, features)
        if not self.config.draft_vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab, logits)
