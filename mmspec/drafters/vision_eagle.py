"""Vision-aware EAGLE heads for LLaVA-style targets: ViSpec, SpecVLM and MSD on one head class, `VisionEagleHead`.

A `TextEagleHead` (EAGLE-1/2) reads the image only through the target's hidden states at the image positions: one
draft pair per image token. The three papers instead hand the draft the target's *projected image embeddings*
`E_img` (what the decoder received there, `mmspec.models.hf.inputs`) through a vision-token policy
(`mmspec.compressors`), applied once, when the drafter takes over the target's prefill:

| `vision_policy` | paper | draft-side image tokens | text pairs |
|---|---|---|---|
| `"vispec"`  | ViSpec (Kang et al., NeurIPS 2025, arXiv 2509.15235) | `num_queries - 1` learned-query tokens per image at the last positions of its span; the last query is a global image vector | `fc([emb(x[t+1]); img_fc([h[t]; g])])`, `img_fc` zero-initialised on `g`, `g` = the row's image vector after its image, 0 before |
| `"specvlm"` | SpecVLM (arXiv 2509.11815) | an elastic compressor: prune / pool / conv / resampler / text-only, picked per input by a question-conditioned gate (Gumbel-softmax in training, argmax at inference) | EAGLE's `fc([emb; h])` |
| `"msd"`     | MSD (arXiv 2505.14260) | every image token, raw (`E_img`): decoupled from the target's features | EAGLE's `fc([emb; h])` |

Policy tokens enter the draft layer as they are (no `fc`, no target feature), each at the *target's* RoPE position of
the image token it stands for; the pairs of dropped image tokens are gone. So the head cache is compacted: after the
prompt, draft cache slot `s` of row `r` holds position `s + position_offset[r]` (`VisionDraftCache`), and every later
forward (chains, EAGLE-2 trees, `mmspec.drafters.eagle`) adds the offset itself. Verification is untouched: drafting
stays lossless whatever the policy keeps.

Images of different sizes (Qwen2.5-VL / Qwen3-VL's dynamic grids: `t * h * w / merge**2` tokens each; LLaVA-Next /
OneVision's any-resolution tiles) come with an `ImageLayout` (`mmspec.models.hf.image_layout`, host-known from the
processor's outputs): the policy splits each row's image tokens by those lengths and compresses every image on its
own (`mmspec.compressors.ragged`). There `tokens_per_image` is the *nominal* image size the policy is built for (the
resampler's query bound, the pool / conv square-grid check; `image_tokens_per_image`), never a split length, and
`check_target` does not compare it with the target's images (they have no one size).

Notation as in `mmspec.models.hf.eagle`: pair `i = (h[i], x[i+1])` sits at position `i + 1`; `p_target` / `q_draft`
are the target's and the draft's next-token laws.
"""

import logging
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn as nn
from diffusers import ModelMixin  # noqa: F401  (diffusers looks up a component's base class in its module)
from diffusers.configuration_utils import register_to_config
from torch import Tensor

from mmspec.cache import StaticKVCache
from mmspec.counting import host_checks_enabled
from mmspec.methods import VISION_POLICIES
from mmspec.models.hf.eagle import TextEagleHead
from mmspec.models.hf.image_layout import ImageLayout, dynamic_image_sizes
from mmspec.models.hf.target import StaticCache
from mmspec.models.llamagen.eagle import init_linears


logger = logging.getLogger(__name__)

__all__ = [
    "VISION_POLICIES",
    "DraftSequence",
    "image_tokens_per_image",
    "VisionDraftCache",
    "VisionEagleHead",
    "question_embedding",
]


class VisionDraftCache(StaticKVCache):
    """The head's one-layer cache, plus per-row draft state that must follow `select_rows`:
    `position_offset [rows]` (position = slot + offset, set at prefill) and `global_vec [rows, dim] | None` (ViSpec)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.position_offset = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.global_vec = None

    def select_rows(self, index):
        super().select_rows(index)
        self.position_offset = self.position_offset[index]
        if self.global_vec is not None:
            self.global_vec = self.global_vec[index]
        return self


@dataclass
class DraftSequence:
    """A prompt (or a training sequence) as the draft sees it, compacted and in position order.

    Attributes:
        inputs: `[rows, M, dim]` the draft layer's inputs (fused text pairs; policy tokens as they are).
        positions: `[rows, M]` target RoPE positions, strictly increasing over valid entries.
        valid: `[rows, M]` bool (rows are padded to the longest).
        source: `[rows, M]` the pair index `i` of a text entry, -1 for a policy token or padding.
        image_tokens: `[rows]` draft-side image tokens (policy tokens) per row.
        choice: `[rows]` the elastic gate's expert per row (-1: no image), or None.
        global_vec: `[rows, dim]` ViSpec's image vector per row (zeros without image), or None.
        pair_global: `[rows, N, dim]` ViSpec's vector as each text pair sees it (zeros up to the row's last image
            token), or None.
    """

    inputs: Tensor
    positions: Tensor
    valid: Tensor
    source: Tensor
    image_tokens: Tensor
    choice: Tensor | None = None
    global_vec: Tensor | None = None
    pair_global: Tensor | None = None
    host_image_tokens: list[int] | None = None  # `image_tokens` known on the host (a fixed-size policy), else None


def question_embedding(inputs_embeds: Tensor, image_mask: Tensor, prompt_lengths: Tensor) -> Tensor:
    """`[rows, dim]`: the mean input embedding of the text between a row's first image token and the end of its
    prompt (the question the image comes with; the whole prompt for a row without image). The SpecVLM gate's input."""
    rows, length = image_mask.shape
    idx = torch.arange(length, device=image_mask.device)[None]
    has = image_mask.any(1)
    first = torch.where(has, image_mask.float().argmax(1), torch.zeros_like(prompt_lengths))
    text = (idx >= first[:, None]) & (idx < prompt_lengths[:, None]) & ~image_mask
    w = text.to(inputs_embeds.dtype)[..., None]
    return (inputs_embeds * w).sum(1) / w.sum(1).clamp(min=1)


def image_tokens_per_image(config) -> int:
    """Image tokens one image becomes in a LLaVA prompt: the vision tower's patch grid (+ CLS with the "full"
    feature strategy); `image_seq_length` when the vision config does not say; 64 for a model without images.

    Targets with dynamic image sizes (`dynamic_image_sizes`) have no such number: this is then a nominal size, the
    base tile's patch grid (any-resolution LLaVA) or `image_seq_length` / 64 (an 8 x 8 grid: Qwen-VL)."""
    vision = getattr(config, "vision_config", None)
    if getattr(config, "image_grid_pinpoints", None) and getattr(vision, "image_size", None):
        return (int(vision.image_size) // int(vision.patch_size)) ** 2  # the base tile, nominal
    if vision is not None and getattr(vision, "image_size", None) and getattr(vision, "patch_size", None):
        grid = (int(vision.image_size) // int(vision.patch_size)) ** 2
        return grid + int(getattr(config, "vision_feature_select_strategy", "default") == "full")
    return int(getattr(config, "image_seq_length", None) or 64)


class VisionEagleHead(TextEagleHead):
    """One-layer EAGLE head with a draft-side vision-token policy (module docstring).

    Args (beyond `TextEagleHead`'s):
        vision_policy: `"vispec"` | `"specvlm"` | `"msd"`.
        tokens_per_image: image tokens of one image in the target's prompt (LLaVA's `image_seq_length`); on a
            target with dynamic image sizes the nominal size the policy is built for (module docstring).
        num_queries: ViSpec's learned queries per image (`num_queries - 1` tokens + 1 global vector), SpecVLM's
            resampler expert.
        ratio: SpecVLM's prune / pool / conv experts keep `tokens_per_image / ratio` tokens per image.
        gate_tau: Gumbel-softmax temperature of SpecVLM's gate (training only).

    `setup_cache` (`TextEagleHead`'s) makes a `VisionDraftCache` (offsets 0 until `prefill_prompt`).
    """

    cache_class = VisionDraftCache

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
        vision_policy: str = "vispec",
        tokens_per_image: int = 64,
        num_queries: int = 2,
        ratio: int = 4,
        gate_tau: float = 1.0,
    ):
        if vision_policy not in VISION_POLICIES:
            raise ValueError(f"vision_policy must be one of {VISION_POLICIES}, got {vision_policy!r}")
        if isinstance(tokens_per_image, bool) or not isinstance(tokens_per_image, int) or tokens_per_image < 1:
            raise ValueError(f"tokens_per_image must be an int >= 1, got {tokens_per_image!r}")
        super().__init__(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
            rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, max_position_embeddings=max_position_embeddings,
            initializer_range=initializer_range, draft_vocab_size=draft_vocab_size,
        )  # fmt: skip
        from mmspec.compressors import build_policy, default_experts

        dim = hidden_size
        if vision_policy == "vispec":
            self.vision = build_policy("resampler", dim, tokens_per_image, num_queries=num_queries,
                                       num_heads=num_attention_heads, global_vector=True)  # fmt: skip
            self.img_fc = nn.Linear(2 * dim, dim, bias=False)  # [h; g] -> h, starts as h (plain EAGLE)
        elif vision_policy == "specvlm":
            experts = default_experts(dim, tokens_per_image, ratio=ratio, num_queries=num_queries)
            self.vision = build_policy("elastic", dim, tokens_per_image, experts=experts, tau=gate_tau)
        else:
            self.vision = build_policy("passthrough", dim, tokens_per_image)
        self.reset_vision()

    @classmethod
    def from_target(cls, target, **overrides):
        """A head whose shapes match the transformers `target` (`tokens_per_image` from LLaVA's
        `image_seq_length`)."""
        overrides.setdefault("tokens_per_image", image_tokens_per_image(target.config))
        return super().from_target(target, **overrides)

    def check_target(self, target):
        """`TextEagleHead.check_target`, and for a target that sees images (a `vision_config`) the number of image
        tokens one image becomes in its prompt (`tokens_per_image`, which the vision policy is built for). A target
        with dynamic image sizes (`dynamic_image_sizes`) has no such number: `tokens_per_image` is then nominal and
        not compared, but the policy must compress images of different sizes (`VisionPolicy.compress_ragged`)."""
        super().check_target(target)
        if getattr(target.config, "vision_config", None) is not None and dynamic_image_sizes(target.config):
            from mmspec.compressors import VisionPolicy

            experts = getattr(self.vision, "experts", {"": self.vision})
            for name, policy in experts.items():
                if type(policy).compress_ragged is VisionPolicy.compress_ragged:
                    raise ValueError(f"vision_policy: the target's images differ in size, but {type(policy).__name__}"
                                     f"{f' (expert {name!r})' if name else ''} compresses only images of "
                                     f"tokens_per_image={self.config.tokens_per_image} tokens")  # fmt: skip
        elif getattr(target.config, "vision_config", None) is not None:
            want = image_tokens_per_image(target.config)
            if self.config.tokens_per_image != want:
                raise ValueError(f"target image tokens per image ({want}) do not match the head's tokens_per_image "
                                 f"(expected tokens_per_image={want}, found {self.config.tokens_per_image})")  # fmt: skip

    def reset_vision(self):
        """ViSpec's `img_fc` = [identity | 0], so a head starts as the text EAGLE it was initialised from."""
        if hasattr(self, "img_fc"):
            dim = self.config.hidden_size
            with torch.no_grad():
                self.img_fc.weight.zero_()
                self.img_fc.weight[:, :dim].copy_(torch.eye(dim))

    def init_weights(self, generator=None):
        """`TextEagleHead`'s init for `fc` and the decoder layer; the vision policy keeps its own (e.g. Conv starts as
        Pool) and `img_fc` is reset to [identity | 0]."""
        init_linears(chain(self.fc.modules(), self.layer.modules()), self.config.initializer_range, generator)
        if hasattr(self, "vision"):
            self.reset_vision()
        return self

    def load_text_head(self, text_head: TextEagleHead):
        """Start from a trained `TextEagleHead` (ViSpec's / MSD's stage 1): copy `fc`, the decoder layer and the draft
        vocabulary; the vision policy and `img_fc` keep their initialisation."""
        mine, theirs = self.config, text_head.config
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size"):  # fmt: skip
            if getattr(mine, name) != getattr(theirs, name):
                raise ValueError(f"text_head {name}={getattr(theirs, name)} does not match this head's "
                                 f"{getattr(mine, name)}")  # fmt: skip
        with torch.no_grad():
            self.fc.load_state_dict(text_head.fc.state_dict())
            self.layer.load_state_dict(text_head.layer.state_dict())
            self.draft_vocab.copy_(text_head.draft_vocab)
        self._sub_weight = None
        return self

    # ------------------------------------------------------------------ cache and positions
    def _rope_positions(self, input_pos, cache):
        offset = getattr(cache, "position_offset", None)
        return input_pos if offset is None else input_pos + offset[:, None]

    def _draft_inputs(self, hidden, input_ids, target, cache):
        g = getattr(cache, "global_vec", None)
        if g is not None:  # ViSpec: every pair after the prompt sees the row's image vector
            g = g[:, None].expand(-1, hidden.shape[1], -1)
        return self._fuse(hidden, input_ids, target, g)

    def _fuse(self, hidden, input_ids, target, global_vec=None):
        """Text pairs: `fc([emb(x); h'])` with `h' = img_fc([h; g])` (ViSpec; `g` zeros where None) or `h`."""
        if hasattr(self, "img_fc"):
            h = hidden.to(self.fc.weight.dtype)
            g = torch.zeros_like(h) if global_vec is None else global_vec.to(h.dtype)
            hidden = self.img_fc(torch.cat([h, g], dim=-1))
        return self._inputs(hidden, input_ids, target)

    # ------------------------------------------------------------------ the draft's view of a sequence
    def draft_sequence(self, hidden, input_ids, target, valid, inputs_embeds, image_mask, prompt_lengths=None,
                       generator=None, host_prompt=None, image_layout=None) -> DraftSequence:  # fmt: skip
        """Compact pairs `(hidden[:, i], input_ids[:, i])` (`[rows, N]`, `valid [rows, N]`) into the draft's sequence:
        pairs whose `x[i+1]` is an image token (`image_mask [rows, N + 1]` over the unshifted sequence, with
        `inputs_embeds [rows, N + 1, dim]`) are replaced by the policy's tokens at their target positions.
        `host_prompt`: optional `(prompt lengths, image tokens)` per row as host lists (the prompt's host copy):
        the shapes then need no device read (`mmspec.compressors.gather_images`' `counts`). `image_layout`: each
        row's images by length (`ImageLayout`, host-known) where they differ in size; None: runs of
        `tokens_per_image`."""
        from mmspec.compressors import gather_images

        rows, n = input_ids.shape
        if tuple(image_mask.shape) != (rows, n + 1) or tuple(inputs_embeds.shape[:2]) != (rows, n + 1):
            raise ValueError(f"image_mask / inputs_embeds must cover the unshifted sequence [rows={rows}, {n + 1}], "
                             f"got {tuple(image_mask.shape)} / {tuple(inputs_embeds.shape)}")  # fmt: skip
        device = input_ids.device
        dtype = self.fc.weight.dtype
        if prompt_lengths is None:
            prompt_lengths = valid.sum(1) + 1
        question = question_embedding(inputs_embeds.to(dtype), image_mask, prompt_lengths)
        host_lengths, host_images = (None, None) if host_prompt is None else host_prompt
        if image_layout is not None and not isinstance(image_layout, ImageLayout):
            raise TypeError(f"image_layout must be an ImageLayout or None, got {type(image_layout).__name__}")
        image = self.vision(gather_images(inputs_embeds.to(dtype), image_mask, counts=host_images, layout=image_layout),
                            question=question, generator=generator)  # fmt: skip
        # text pairs: position i + 1, fused; ViSpec's g only after the row's last image token
        pos = torch.arange(n, device=device)[None].expand(rows, n) + 1
        g = None
        if image.global_vec is not None:
            last_image = torch.where(image_mask.any(1), image_mask.shape[1] - 1 - image_mask.flip(1).float().argmax(1),
                                     torch.full_like(prompt_lengths, n + 1))  # fmt: skip
            after = (pos > last_image[:, None]).to(dtype)[..., None]
            g = image.global_vec.to(dtype)[:, None] * after
        text = self._fuse(hidden, input_ids, target, g)  # [rows, N, dim]
        text_valid = valid & ~image_mask[:, 1:]
        # merge with the policy tokens and sort every row by position (padding last)
        inputs = torch.cat([text, image.tokens.to(text.dtype)], dim=1)
        positions = torch.cat([pos, image.positions.to(pos.dtype)], dim=1)
        keep = torch.cat([text_valid, image.valid], dim=1)
        source = torch.cat([torch.arange(n, device=device)[None].expand(rows, n),
                            torch.full_like(image.positions, -1, dtype=torch.long)], dim=1)  # fmt: skip
        big = positions.max() + 1 if positions.numel() else 1
        order = torch.sort(torch.where(keep, positions, big + positions), dim=1, stable=True).indices
        if host_prompt is not None:  # a host-side bound: text pairs (<= L_r - image tokens) + the policy's tokens
            t, most = self.vision.tokens_per_image, self.vision.keep
            kept = ([(im // t) * most for im in host_images] if image_layout is None
                    else self.vision.tokens_out_layout(image_layout))  # fmt: skip
            bound = max((ln - im + k for ln, im, k in zip(host_lengths, host_images, kept, strict=True)), default=0)
            width = min(bound, keep.shape[1])
        if host_prompt is None or host_checks_enabled(device):  # exact where a read is free (or nothing is known)
            exact = int(keep.sum(1).max()) if keep.numel() else 0
            if host_prompt is not None and exact > width:
                raise RuntimeError(f"draft sequence of {exact} entries past its host-side bound {width}")
            width = exact
        order = order[:, :width]
        take = lambda t: t.gather(1, order)  # noqa: E731
        inputs = inputs.gather(1, order[..., None].expand(-1, -1, inputs.shape[-1]))
        valid_out = take(keep)
        return DraftSequence(inputs=inputs, positions=take(positions), valid=valid_out,
                             source=torch.where(valid_out, take(source), -1), image_tokens=image.valid.sum(1),
                             choice=image.choice, global_vec=image.global_vec, pair_global=g,
                             host_image_tokens=image.host_counts)  # fmt: skip

    # ------------------------------------------------------------------ inference: the prompt
    @torch.no_grad()
    def prefill_prompt(self, target, cache, hidden, input_ids, num_valid, inputs_embeds, image_mask, host_prompt=None,
                       image_layout=None):  # fmt: skip
        """Write a prompt's pairs but the last into `cache` (a fresh `setup_cache`), compacted (`draft_sequence`).

        Args:
            target: the target model (embeddings / output head).
            cache: this head's `VisionDraftCache`, lengths 1.
            hidden: `[rows, L, dim]` the target's final-norm states over the prompt.
            input_ids: `[rows, L]` `x[t+1]` per column (the first sampled token at column `L_r - 1`).
            num_valid: `[rows]` prompt lengths `L_r`.
            inputs_embeds, image_mask: `[rows, L, dim]`, `[rows, L]` the decoder's inputs over the prompt.
            host_prompt: optional `(num_valid, image tokens per row)` as host lists: no device read (`draft_sequence`).
            image_layout: optional, each row's images by length (`ImageLayout`): images of different sizes.

        Afterwards the pending pair `(h[L_r - 1], first token)` goes in through `commit_accepted` at slot
        `lengths[r]`, position `L_r`. Returns `{"draft_image_tokens": [rows], "choice": [rows] | None,
        "choice_names": list | None}`.
        """
        rows, length = input_ids.shape
        if (not isinstance(cache, VisionDraftCache) or cache.rows != rows
                or (host_checks_enabled(cache.lengths.device) and bool((cache.lengths != 1).any()))):  # fmt: skip
            raise ValueError("cache must be a fresh VisionDraftCache of this head (setup_cache) with one row per row")
        valid = (
            torch.arange(length, device=input_ids.device)[None] < (num_valid - 1)[:, None]
        )  # all pairs but the last
        # pair i sees x[i+1]: the unshifted sequence is the prompt; its column L is never an image token
        mask = torch.cat([image_mask, image_mask.new_zeros(rows, 1)], dim=1)
        embeds = torch.cat([inputs_embeds, inputs_embeds.new_zeros(rows, 1, inputs_embeds.shape[-1])], dim=1)
        seq = self.draft_sequence(hidden, input_ids, target, valid, embeds, mask, prompt_lengths=num_valid,
                                  host_prompt=host_prompt, image_layout=image_layout)  # fmt: skip
        m = seq.inputs.shape[1]
        count = seq.valid.sum(1)  # [rows]
        if m:
            slots = 1 + torch.arange(m, device=input_ids.device)[None].expand(rows, m)
            cache.check_slots(slots)
            causal = torch.ones(m, m, dtype=torch.bool, device=slots.device).tril()[None] & seq.valid[:, None, :]
            causal = causal | torch.eye(m, dtype=torch.bool, device=slots.device)[None]  # padding sees itself
            visible = cache.visibility(slots, causal)
            hf_cache = StaticCache(cache)
            hf_cache.write_slots = slots
            self._layer(seq.inputs, seq.positions, visible[:, None], hf_cache)
        cache.commit(count)
        cache.position_offset = (num_valid - 1) - count  # next pair: slot 1 + count, position L_r
        cache.global_vec = seq.global_vec
        names = getattr(self.vision, "names", None)
        tokens = seq.image_tokens if seq.host_image_tokens is None else seq.host_image_tokens
        return {"draft_image_tokens": tokens, "choice": seq.choice, "choice_names": names}

    # ------------------------------------------------------------------ training
    def forward_unrolled(self, hidden, input_ids, target, steps, valid=None, *, inputs_embeds=None, image_mask=None,
                         prompt_lengths=None, generator=None, image_layout=None):  # fmt: skip
        """`TextEagleHead.forward_unrolled` on the draft's compacted view (`draft_sequence`): outputs are scattered
        back to pair indices `[B, N, dim]` (zeros at pairs the policy replaced). `inputs_embeds [B, N + 1, dim]` and
        `image_mask [B, N + 1]` cover the unshifted sequence; without them this is a text EAGLE head on text.
        `image_layout`: as `draft_sequence`'s."""
        b, n = input_ids.shape
        valid = torch.ones(b, n, dtype=torch.bool, device=input_ids.device) if valid is None else valid
        if inputs_embeds is None or image_mask is None:
            raise ValueError("inputs_embeds and image_mask are required (the target's decoder inputs)")
        seq = self.draft_sequence(hidden, input_ids, target, valid, inputs_embeds, image_mask, prompt_lengths,
                                  generator, image_layout=image_layout)  # fmt: skip
        text = seq.source >= 0
        src = seq.source.clamp(min=0)
        ids = input_ids.gather(1, src)
        g = (
            None
            if seq.pair_global is None
            else seq.pair_global.gather(1, src[..., None].expand(-1, -1, hidden.shape[-1]))
        )
        first = {"step": True}

        def inputs_of(feats):  # step 0: the teacher-forced view; later: text entries re-fused from shifted features
            if first.pop("step", False):
                return seq.inputs
            return torch.where(text[..., None], self._fuse(feats, ids, target, g), seq.inputs)

        outs = self.unrolled_steps(inputs_of, None, seq.positions, steps, seq.valid)
        dim = outs[0].shape[-1]
        index = torch.where(text, seq.source, n)[..., None].expand(-1, -1, dim)  # policy tokens -> a dropped column
        return [out.new_zeros(b, n + 1, dim).scatter(1, index, out)[:, :n] for out in outs]
