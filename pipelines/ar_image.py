"""Speculative decoding for discrete-token AR image models (LlamaGen family): `SpeculativeARImagePipeline`.

One Diffusers-style pipeline, every method on one verifier core (`mmspec.verify`):

| `acceptance` | default `drafter` | method                                                        | lossless |
|--------------|-------------------|---------------------------------------------------------------|----------|
| `"none"`     | -                 | plain AR sampling (the baseline)                              | yes      |
| `"exact"`    | eagle/model/jacobi | speculative sampling (Leviathan 2023; EAGLE-2 trees)          | yes      |
| `"relaxed"`  | eagle             | LANTERN latent-proximity acceptance (Jang et al. 2024), TV <= delta | no  |
| `"grouped"`  | jacobi            | GSD grouped acceptance (So et al. 2025) on Jacobi drafts      | no       |
| `"jacobi"`   | jacobi            | SJD (Teng et al. 2024), optional SCD coupling                 | yes      |

Drafters: `"model"` (a small `LlamaGenGPT` drafts a chain of `num_draft_tokens`), `"eagle"` (an `EagleHead` drafts
a chain of `tree_depth` tokens sampled from its `q_draft` when `tree_top_k=1`, the default, or an EAGLE-2 dynamic
tree of `num_draft_tokens` nodes, `tree_depth` levels and `tree_top_k` deterministic children per node),
`"jacobi"` (the target drafts for itself: a window of `jacobi_window` tokens from its previous iteration).

Classifier-free guidance: every target forward scores both streams (rows `[cond; uncond]`, same tokens, same cache
commits), and `p_target` / `q_draft` are the guided, temperature/top-k/top-p processed distributions
(`mmspec.sampling.SamplingParams`), exactly what plain sampling draws from. Batches are ragged: every row accepts its
own number of tokens per round and keeps its own cache length, so no row waits for another to catch up; a finished
row is compacted out of the target/draft caches and later forwards (the call returns when every row is done).
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from mmspec.cache import tree_inputs
from mmspec.drafters.eagle import EagleHead, draft_chain, draft_tree, prepend_root
from mmspec.drafters.jacobi import JacobiDrafter
from mmspec.drafters.model import ModelDrafter
from mmspec.models.llamagen import LlamaGenGPT
from mmspec.models.vq import LlamaGenVQ
from mmspec.sampling import SamplingParams, sample
from mmspec.stats import SpecStats
from mmspec.verify import (
    codebook_neighbours,
    verify_exact,
    verify_greedy,
    verify_grouped,
    verify_jacobi,
    verify_relaxed,
    verify_tree,
)


logger = logging.getLogger(__name__)

ACCEPTANCES = ("none", "exact", "relaxed", "grouped", "jacobi")
DRAFTERS = ("model", "eagle", "jacobi")
OUTPUT_TYPES = ("pil", "np", "pt", "tokens")


@dataclass
class SpeculativeImageOutput(BaseOutput):
    """Output of the speculative image pipelines.

    Attributes:
        images: PIL images, a float NHWC array in [0, 1] (`"np"`), a float NCHW tensor in [0, 1] (`"pt"`) or the
            token grids `[B, N]` (`"tokens"`).
        stats: `mmspec.stats.SpecStats` of the call (always filled, so `out[1]` is stable).
    """

    images: list | np.ndarray | torch.Tensor
    stats: SpecStats


class _Tokens:
    """Per-call token buffer of the rows still being decoded: `tokens [B', N]` (-1 = not generated), `count [B']`
    tokens generated per row, `ids [B']` their rows in the call's batch. Finished rows are compacted out of the
    per-round work (`keep`); `full()` is the whole `[B, N]` grid.

    The last generated token of a row is *pending*: emitted, but not yet fed to the target (its cache length is
    `cls_token_num + count - 1`)."""

    def __init__(self, first, num_tokens):
        b = first.shape[0]
        self.tokens = torch.full((b, num_tokens), -1, dtype=torch.long, device=first.device)
        self.tokens[:, 0] = first
        self.count = torch.ones(b, dtype=torch.long, device=first.device)
        self.rows = torch.arange(b, device=first.device)
        self.ids = self.rows
        self._grid = self.tokens.clone()  # rows that left keep their tokens here

    @property
    def active(self):
        return self.count < self.tokens.shape[1]

    @property
    def pending(self):
        return self.tokens[self.rows, self.count - 1]

    @property
    def last_committed(self):
        return self.tokens[self.rows, (self.count - 2).clamp(min=0)]

    def remaining(self):
        return self.tokens.shape[1] - self.count

    def num_generated(self):
        """Tokens generated so far over the whole batch."""
        return int(self.count.sum()) + self.tokens.shape[1] * (self._grid.shape[0] - self.ids.shape[0])

    def full(self):
        """The `[B, N]` token grid of every row of the call."""
        grid = self._grid.clone()
        grid[self.ids] = self.tokens
        return grid

    def replace(self, grid):
        """Take a (callback-edited) `[B, N]` grid."""
        self._grid = grid.clone()
        self.tokens = grid[self.ids].clone()

    def keep(self, index):
        """Keep only rows `index` (positions in the current buffer) for the rounds to come."""
        self._grid[self.ids] = self.tokens
        self.tokens, self.count, self.ids = self.tokens[index], self.count[index], self.ids[index]
        self.rows = torch.arange(index.shape[0], device=index.device)

    def emit(self, new_tokens, num_new):
        """Append `new_tokens[b, :num_new[b]]` to each active row (truncated at N); returns tokens appended [B']."""
        n_max = self.tokens.shape[1]
        num = torch.where(self.active, torch.minimum(num_new, self.remaining()), 0)
        j = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        keep = j[None, :] < num[:, None]
        cols = (self.count[:, None] + j[None, :]).clamp(max=n_max - 1)
        self.tokens[self.rows[:, None].expand_as(cols)[keep], cols[keep]] = new_tokens[keep]
        self.count = self.count + num
        return num


def _two(x):
    """Batch items -> CFG rows `[cond; uncond]` (same tokens on both streams)."""
    return torch.cat([x, x], dim=0)


class SpeculativeARImagePipeline(DiffusionPipeline):
    """Speculative sampling for class-conditional LlamaGen-family image models (see the module docstring).

    This model inherits from [`DiffusionPipeline`]: `save_pretrained` / `from_pretrained` round-trip to a folder
    with `model_index.json`.

    Args:
        transformer: the target `LlamaGenGPT` (c2i).
        vqvae: the `LlamaGenVQ` tokenizer whose codebook the target's vocabulary indexes.
        draft_model: optional small `LlamaGenGPT` for `drafter="model"`.
        eagle_head: optional `EagleHead` trained on the target, for `drafter="eagle"`.

    Examples:
        >>> from mmspec.pipelines import SpeculativeARImagePipeline
        >>> pipe = SpeculativeARImagePipeline.from_zoo("assets")
        >>> out = pipe(class_labels=[3, 7], acceptance="relaxed", generator=torch.Generator().manual_seed(0))
        >>> out.images[0].save("three.png"); print(out.stats.step_compression)
    """

    model_cpu_offload_seq = "transformer->vqvae"
    _optional_components = ["draft_model", "eagle_head"]
    _exclude_from_cpu_offload = ["draft_model", "eagle_head"]
    _callback_tensor_inputs = ["tokens"]

    def __init__(
        self,
        transformer: LlamaGenGPT,
        vqvae: LlamaGenVQ,
        draft_model: LlamaGenGPT | None = None,
        eagle_head: EagleHead | None = None,
    ):
        super().__init__()
        if transformer.config.model_type != "c2i":
            raise ValueError("SpeculativeARImagePipeline supports class-conditional (c2i) transformers")
        if vqvae.config.codebook_size != transformer.config.vocab_size:
            raise ValueError(
                f"vqvae codebook_size={vqvae.config.codebook_size} does not match the transformer's "
                f"vocab_size={transformer.config.vocab_size}"
            )
        if draft_model is not None:
            ModelDrafter.check_compatible(draft_model, transformer)
        if eagle_head is not None:
            eagle_head.check_target(transformer)
        self.register_modules(transformer=transformer, vqvae=vqvae, draft_model=draft_model, eagle_head=eagle_head)
        self._neighbours = {}

    @classmethod
    def from_zoo(cls, root="assets", prefix="mnist", **kwargs):
        """Build the pipeline from zoo folders `<root>/<prefix>-{c2i,vq,c2i-draft,c2i-eagle}` (drafters optional)."""
        from mmspec.models import load

        root = Path(root)
        parts = {"transformer": "c2i", "vqvae": "vq", "draft_model": "c2i-draft", "eagle_head": "c2i-eagle"}
        components = {}
        for name, suffix in parts.items():
            folder = root / f"{prefix}-{suffix}"
            if folder.is_dir():
                components[name] = load(folder)
            elif name in ("transformer", "vqvae"):
                raise ValueError(f"root={str(root)!r}: missing zoo folder {folder}")
        components.update(kwargs)
        return cls(**components)

    # ------------------------------------------------------------------ inputs
    def check_inputs(self, class_labels, acceptance, drafter, num_draft_tokens, output_type, guidance_scale,
                     callback_on_step_end_tensor_inputs, num_images_per_prompt, **sizes):  # fmt: skip
        if acceptance not in ACCEPTANCES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCES}, got {acceptance!r}")
        if drafter is not None and drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
        if acceptance == "jacobi" and drafter not in (None, "jacobi"):
            raise ValueError(f"acceptance='jacobi' (SJD) drafts with the target itself; got drafter={drafter!r}")
        if drafter == "model" and self.draft_model is None:
            raise ValueError("drafter='model' needs a draft_model component")
        if drafter == "eagle" and self.eagle_head is None:
            raise ValueError("drafter='eagle' needs an eagle_head component")
        for name, value in dict(num_draft_tokens=num_draft_tokens, **sizes).items():
            if value is not None and int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if int(num_images_per_prompt) < 1:
            raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        if guidance_scale != 1.0 and self.transformer.cls_embedding.embedding_table.num_embeddings <= (
            self.transformer.config.num_classes
        ):
            raise ValueError("guidance_scale != 1 needs a null class, but the transformer has no null-class embedding")
        bad = set(callback_on_step_end_tensor_inputs or []) - set(self._callback_tensor_inputs)
        if bad:
            raise ValueError(f"callback_on_step_end_tensor_inputs {sorted(bad)} not in {self._callback_tensor_inputs}")
        if class_labels is None:
            raise ValueError("class_labels is required for a class-conditional transformer")

    def prepare_class_labels(self, class_labels, num_images_per_prompt, device):
        """`class_labels` (int, list or tensor) -> LongTensor `[B]` (each repeated `num_images_per_prompt` times)."""
        labels = torch.as_tensor(class_labels if not isinstance(class_labels, int) else [class_labels], device=device)
        if labels.dim() != 1 or labels.is_floating_point() or labels.dtype == torch.bool or labels.numel() == 0:
            raise ValueError(f"class_labels must be integer class ids (int, list or 1-D tensor), got {class_labels!r}")
        n = self.transformer.config.num_classes
        if int(labels.min()) < 0 or int(labels.max()) >= n:
            raise ValueError(f"class_labels must be in [0, {n}), got range [{int(labels.min())}, {int(labels.max())}]")
        return labels.long().repeat_interleave(int(num_images_per_prompt))

    def neighbours(self, k):
        """LANTERN latent-proximity neighbourhoods `[V, k]` of the VQ codebook (computed once per k; k is capped at
        V - 1, the whole codebook)."""
        k = min(int(k), self.vqvae.config.codebook_size - 1)
        if k not in self._neighbours:
            self._neighbours[k] = codebook_neighbours(self.vqvae.codebook.detach().float(), k)
        return self._neighbours[k]

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(
        self,
        class_labels=None,
        guidance_scale: float = 2.0,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        do_sample: bool = True,
        num_images_per_prompt: int = 1,
        acceptance: str = "exact",
        drafter: str | None = None,
        num_draft_tokens: int | None = None,
        tree_depth: int | None = None,
        tree_top_k: int = 1,
        relaxation_top_k: int = 16,
        relaxation_delta: float = 0.2,
        relaxation_lambda: float | None = None,
        group_size: int = 25,
        group_prob_threshold: float = 0.15,
        group_dist_threshold: float = 1.0,
        jacobi_window: int = 16,
        jacobi_init: str = "repeat",
        coupling: bool = True,
        resample: str = "optimal",
        generator: torch.Generator | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs=("tokens",),
    ):
        """Generate images for `class_labels`.

        Args:
            class_labels: class id(s) in `[0, num_classes)`.
            guidance_scale, temperature, top_k, top_p, do_sample: sampling knobs, applied identically to target and
                draft distributions (`do_sample=False` = greedy).
            num_images_per_prompt: images per class label.
            acceptance: `"none"` | `"exact"` | `"relaxed"` | `"grouped"` | `"jacobi"` (module docstring).
            drafter: `"model"` | `"eagle"` | `"jacobi"`; default: eagle for exact/relaxed (falling back to model,
                then jacobi, by what is loaded), jacobi for grouped/jacobi.
            num_draft_tokens: chain length K (`"model"`, default 4) or tree nodes (`"eagle"` trees, default 24).
            tree_depth, tree_top_k: EAGLE drafting (`tree_depth` default: 5, or 7 for `"relaxed"` / `"grouped"`,
                whose looser acceptance keeps longer chains). `tree_top_k=1` (default): a chain of `tree_depth`
                tokens, each sampled from the head's processed distribution (accepted with probability
                `sum min(p, q)`; on a CPU the cheapest EAGLE mode). `tree_top_k > 1`: the EAGLE-2 dynamic tree
                (`tree_depth` levels, `tree_top_k` top-k children per node, best `num_draft_tokens` nodes kept),
                verified node by node (deterministic drafts: a child is accepted with probability `p(x)` of the
                current residual).
            relaxation_top_k, relaxation_delta, relaxation_lambda: LANTERN neighbourhood size k, additive TV budget
                delta, or LANTERN++'s multiplicative lambda (> 1; replaces delta when set).
            group_size, group_prob_threshold, group_dist_threshold: GSD rank window and its probability / squared
                distance filters; distances are between the L2-normalised VQ codebook vectors (in [0, 4]), not the
                LLM input embeddings of the GSD release, so the default threshold is 1.0 rather than 0.5.
            jacobi_window, jacobi_init, coupling: SJD window (draft tokens per forward), fresh-token init
                (`"repeat"` | `"random"`), and SCD maximal-coupling re-drafts (default on: lossless and raises
                acceptance; `coupling=False` is the original SJD).
            resample: `"optimal"` (TV-optimal residual for relaxed rules) or `"released"` (as the papers' code).
            generator: the only source of randomness.
            output_type: `"pil"` | `"np"` | `"pt"` | `"tokens"`.
            return_dict: return a `SpeculativeImageOutput` (else a tuple `(images, stats)`).
            callback_on_step_end: `fn(pipe, round, generated_tokens, callback_kwargs) -> dict` after every round;
                may return a replaced `tokens` tensor for rows' *future* use only (it is read back for decoding).

        Returns:
            `SpeculativeImageOutput(images, stats)` or `(images, stats)`.
        """
        # 1. check inputs, resolve the method
        self.check_inputs(class_labels, acceptance, drafter, num_draft_tokens, output_type, guidance_scale,
                          callback_on_step_end_tensor_inputs, num_images_per_prompt, tree_depth=tree_depth,
                          tree_top_k=tree_top_k, jacobi_window=jacobi_window)  # fmt: skip
        if acceptance != "none" and drafter is None:
            drafter = self._default_drafter(acceptance)
        if num_draft_tokens is None:
            num_draft_tokens = {"eagle": 24}.get(drafter, 4)
        if tree_depth is None:
            tree_depth = 7 if acceptance in ("relaxed", "grouped") else 5
        sampling = SamplingParams(guidance_scale, temperature, top_k, top_p, do_sample)
        if sampling.greedy and acceptance == "grouped":
            raise ValueError("acceptance='grouped' (GSD) is a sampling rule; use do_sample=True and temperature > 0")
        device = self._execution_device
        labels = self.prepare_class_labels(class_labels, num_images_per_prompt, device)
        batch, n_tokens = labels.shape[0], self.transformer.config.block_size
        knobs = self._acceptance_knobs(acceptance, relaxation_top_k, relaxation_delta, relaxation_lambda, group_size,
                                       group_prob_threshold, group_dist_threshold)  # fmt: skip
        k = {"jacobi": jacobi_window, "model": num_draft_tokens}.get(drafter, 0)
        stats = SpecStats(batch, k if drafter != "eagle" else tree_depth)

        # 2. prefill both CFG streams; the first token comes from the target alone
        scratch = max(num_draft_tokens, jacobi_window, tree_depth * tree_top_k) + 2  # largest scratch forward
        max_seq = self.transformer.config.cls_token_num + n_tokens + scratch
        cache = self.transformer.setup_cache(2 * batch, max_seq)
        cond = torch.cat([labels, self.transformer.null_condition(batch)])
        with stats.timer("total", device), stats.timer("verify", device):
            first = self.transformer.prefill(cond, cache, return_hidden=drafter == "eagle")
            p0 = sampling.probs(*first.logits[:, -1].chunk(2))
            state = _Tokens(sample(p0, generator), n_tokens)
        stats.record_prefill(1)
        loop_args = dict(state=state, cache=cache, sampling=sampling, generator=generator, stats=stats,
                         callback=callback_on_step_end, callback_inputs=callback_on_step_end_tensor_inputs)  # fmt: skip

        # 3. decode
        with stats.timer("total", device):
            if acceptance == "none":
                self._decode_plain(**loop_args)
            elif drafter == "model":
                self._decode_chain(cond, num_draft_tokens, acceptance, knobs, resample, **loop_args)
            elif drafter == "eagle":
                self._decode_tree(first.hidden, num_draft_tokens, tree_depth, tree_top_k, acceptance, knobs,
                                  resample, **loop_args)  # fmt: skip
            else:
                self._decode_jacobi(jacobi_window, jacobi_init, coupling, acceptance, knobs, resample, **loop_args)

            # 4. tokens -> images
            with stats.timer("decode", device):
                images = self.postprocess(state.full(), output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return images, stats
        return SpeculativeImageOutput(images=images, stats=stats)

    def _default_drafter(self, acceptance):
        if acceptance in ("grouped", "jacobi"):
            return "jacobi"
        if self.eagle_head is not None:
            return "eagle"
        return "model" if self.draft_model is not None else "jacobi"

    def _acceptance_knobs(self, acceptance, k, delta, lam, group_size, prob_threshold, dist_threshold):
        if acceptance == "relaxed":
            if lam is not None and lam <= 1:
                raise ValueError(f"relaxation_lambda must be > 1 (LANTERN++), got {lam}")
            if lam is None and not 0 <= delta <= 1:
                raise ValueError(f"relaxation_delta must be in [0, 1], got {delta}")
            return dict(neighbours=self.neighbours(int(k)), delta=None if lam is not None else delta, lam=lam)
        if acceptance == "grouped":
            if group_size < 1:
                raise ValueError(f"group_size must be >= 1, got {group_size}")
            return dict(group_size=int(group_size), prob_threshold=prob_threshold, dist_threshold=dist_threshold,
                        embeddings=self.vqvae.codebook.detach().float())  # fmt: skip
        return {}

    def _verify_chain(self, drafts, p_target, q_draft, acceptance, knobs, resample, sampling, generator, num_draft):
        """One chain verification with the selected acceptance rule."""
        if acceptance == "exact" or acceptance == "jacobi":
            if sampling.greedy:
                return verify_greedy(drafts, p_target, num_draft=num_draft)
            return verify_exact(drafts, p_target, q_draft, generator=generator, num_draft=num_draft, validate=False)
        if acceptance == "relaxed":
            return verify_relaxed(drafts, p_target, q_draft, generator=generator, num_draft=num_draft, validate=False,
                                  resample=resample, greedy=sampling.greedy, **knobs)  # fmt: skip
        return verify_grouped(drafts, p_target, q_draft, generator=generator, num_draft=num_draft, validate=False,
                              resample=resample, **knobs)  # fmt: skip

    def _end_round(self, state, round_index, callback, callback_inputs):
        if callback is None:
            return
        tensors = {name: state.full() if name == "tokens" else getattr(state, name) for name in callback_inputs}
        out = callback(self, round_index, state.num_generated(), tensors)
        if out and "tokens" in out:
            state.replace(out["tokens"])

    @staticmethod
    def _drop_finished(state, caches=(), per_row=()):
        """Compact finished rows out of the per-round work: `state`, the KV `caches` and the `per_row` tensors (all
        in CFG rows `[cond; uncond]`) keep only the active rows. Returns the compacted `per_row` tensors and the kept
        positions `[B']` (None when nothing changed), for drafter state in batch-item rows."""
        active = state.active
        if bool(active.all()) or not bool(active.any()):
            return per_row, None
        index = active.nonzero()[:, 0]
        both = torch.cat([index, index + active.shape[0]])
        state.keep(index)
        for cache in caches:
            cache.select_rows(both)
        return tuple(t[both] for t in per_row), index

    def _target_chain(self, cache, state, drafts, sampling, stats, device):
        """Score `[pending, drafts]` for both CFG streams: returns `p_target [B, K+1, V]`."""
        feed = _two(torch.cat([state.pending[:, None], drafts], dim=1))
        with stats.timer("verify", device):
            logits = self.transformer(feed, cache).logits  # [2B, K+1, V]
            stats.target_forwards += 1
            return sampling.probs(*logits.chunk(2))

    # ------------------------------------------------------------------ decoding loops
    def _decode_plain(self, state, cache, sampling, generator, stats, callback, callback_inputs):
        """Plain AR sampling: one target forward per token (the baseline)."""
        device, rnd = cache.device, 0
        while bool(state.active.any()):
            active = state.active
            p = self._target_chain(cache, state, state.tokens[:, :0], sampling, stats, device)[:, 0]  # [B, V]
            cache.commit(_two(active.long()))
            num = state.emit(sample(p, generator)[:, None], torch.ones_like(state.count))
            stats.record_round(torch.zeros_like(num), torch.zeros_like(num), num, active, rows=state.ids)
            rnd += 1
            self._end_round(state, rnd, callback, callback_inputs)

    def _decode_chain(self, cond, k, acceptance, knobs, resample, state, cache, sampling, generator, stats, callback,
                      callback_inputs):  # fmt: skip
        """Draft-model speculative sampling: K draft forwards, one target forward over `[pending, K drafts]`."""
        device, drafter = cache.device, ModelDrafter(self.draft_model)
        drafter.prefill(cond, cache.max_seq)
        rnd = 0
        while bool(state.active.any()):
            active = state.active
            num_draft = state.remaining().clamp(min=1, max=k)
            k_round = int(num_draft.max())  # no drafts past the last image token
            with stats.timer("draft", device):
                drafts, q_draft = drafter.draft(state.last_committed, state.pending, k_round, sampling, generator)
                stats.draft_forwards += k_round
            p_target = self._target_chain(cache, state, drafts, sampling, stats, device)
            with stats.timer("verify", device):
                res = self._verify_chain(drafts, p_target, q_draft, acceptance, knobs, resample, sampling, generator,
                                         num_draft)  # fmt: skip
            cache.commit(_two(torch.where(active, res.num_accepted + 1, 0)))
            num = state.emit(res.tokens, res.num_accepted + 1)
            drafter.commit(cache.lengths[: state.count.shape[0]])
            stats.record_round(num_draft, res.num_accepted, num, active, rows=state.ids)
            rnd += 1
            self._end_round(state, rnd, callback, callback_inputs)
            self._drop_finished(state, (cache, drafter.cache))

    def _decode_tree(self, prefill_hidden, total, depth, top_k, acceptance, knobs, resample, state, cache, sampling,
                     generator, stats, callback, callback_inputs):  # fmt: skip
        """EAGLE speculative sampling: the head drafts an EAGLE-2 dynamic tree (`top_k > 1`, deterministic top-k
        children) or a chain of `min(depth, total)` tokens sampled from its `q_draft` (`top_k == 1`); one target
        forward scores it."""
        device, head, target = cache.device, self.eagle_head, self.transformer
        chain = min(depth, total) if top_k == 1 else 0
        head_cache = head.setup_cache(cache.rows, cache.max_seq)
        hidden_in, ids_in = prefill_hidden, _two(state.pending[:, None])  # pairs (h_t, x_{t+1})
        num_valid = torch.ones(2 * state.count.shape[0], dtype=torch.long, device=device)
        rnd = 0
        while bool(state.active.any()):
            active, batch = state.active, state.count.shape[0]
            num_draft = state.remaining().clamp(min=1, max=chain or None)
            with stats.timer("draft", device):
                if chain:
                    length = int(num_draft.max())  # no drafts past the last image token
                    drafts, q_draft = draft_chain(head, target, head_cache, hidden_in, ids_in, num_valid,
                                                  length=length, sampling=sampling, generator=generator)  # fmt: skip
                    tokens_v = torch.cat([state.pending[:, None], drafts], dim=1)
                else:
                    tree = draft_tree(head, target, head_cache, hidden_in, ids_in, num_valid, depth=depth,
                                      top_k=top_k, total=total, guidance_scale=sampling.guidance_scale)  # fmt: skip
                    tokens_v, parents_v = prepend_root(state.pending, tree.tokens, tree.parents)  # [B, N+1]
                head_cache.rollback(head_cache.lengths - _two(torch.where(active, 0, num_valid[:batch])))
                stats.draft_forwards += length if chain else depth
            with stats.timer("verify", device):
                inputs = () if chain else tree_inputs(_two(parents_v), cache.lengths)  # tree positions/slots/mask
                out = target(_two(tokens_v), cache, *inputs, return_hidden=True)
                stats.target_forwards += 1
                p_target = sampling.probs(*out.logits.chunk(2))  # [B, N+1, V]
                if chain:
                    res = self._verify_chain(drafts, p_target, q_draft, acceptance, knobs, resample, sampling,
                                             generator, num_draft)  # fmt: skip
                else:
                    res = verify_tree(tree.tokens, tree.parents, p_target, mode="deterministic", generator=generator,
                                      greedy=sampling.greedy, acceptance=acceptance, resample=resample,
                                      validate=False, **knobs)  # fmt: skip
            path_len = torch.where(active, res.num_accepted + 1, 0)
            if chain:
                cache.commit(_two(path_len))
                hidden_in = out.hidden  # pairs (h[pending], d_1), ..., (h[d_K], next); the first k + 1 are valid
            else:
                path = res.path.clamp(min=0)
                cache.commit_path(_two(path), _two(path_len))
                # next head input: pairs (h[root], a_1), (h[a_1], a_2), ..., (h[a_k], next token)
                hidden_in = out.hidden.gather(1, _two(path)[:, :, None].expand(-1, -1, out.hidden.shape[-1]))
            num = state.emit(res.tokens, res.num_accepted + 1)
            ids_in = _two(res.tokens.clamp(min=0))
            num_valid = _two(res.num_accepted + 1)
            drafted = num_draft if chain else torch.full_like(num, tokens_v.shape[1] - 1)
            stats.record_round(drafted, res.num_accepted, num, active, rows=state.ids)
            rnd += 1
            self._end_round(state, rnd, callback, callback_inputs)
            (hidden_in, ids_in, num_valid), _ = self._drop_finished(
                state, (cache, head_cache), (hidden_in, ids_in, num_valid)
            )

    def _decode_jacobi(self, window, init, coupling, acceptance, knobs, resample, state, cache, sampling, generator,
                       stats, callback, callback_inputs):  # fmt: skip
        """Jacobi self-drafting: SJD (`acceptance="jacobi"`/`"exact"`), or GSD/LANTERN acceptance on its drafts."""
        device = cache.device
        jacobi = JacobiDrafter(self.transformer.config.vocab_size, window, init)
        jacobi.reset(state.pending, generator)
        rule = "exact" if acceptance in ("jacobi", "exact") else acceptance
        rnd = 0
        while bool(state.active.any()):
            active = state.active
            num_draft = state.remaining().clamp(min=1, max=window)
            jacobi.narrow(int(num_draft.max()))  # near the end: no drafts past the last image token
            p_target = self._target_chain(cache, state, jacobi.drafts, sampling, stats, device)
            with stats.timer("verify", device):
                res = verify_jacobi(jacobi.drafts, p_target, jacobi.q_draft, generator=generator, coupling=coupling,
                                    num_draft=num_draft, acceptance=rule, resample=resample, validate=False,
                                    **knobs)  # fmt: skip
            cache.commit(_two(torch.where(active, res.num_accepted + 1, 0)))
            num = state.emit(res.tokens, res.num_accepted + 1)
            with stats.timer("draft", device):
                jacobi.update(res, state.pending, generator)
            stats.record_round(num_draft, res.num_accepted, num, active, rows=state.ids)
            rnd += 1
            self._end_round(state, rnd, callback, callback_inputs)
            _, kept = self._drop_finished(state, (cache,))
            if kept is not None:
                jacobi.select_rows(kept)

    # ------------------------------------------------------------------ output
    def postprocess(self, tokens, output_type):
        """Token grids `[B, N]` -> the requested output type."""
        if output_type == "tokens":
            return tokens
        images = (self.vqvae.decode_codes(tokens).float() + 1) / 2  # [B, C, H, W] in [0, 1]
        if output_type == "pt":
            return images
        return images.permute(0, 2, 3, 1).cpu().numpy() if output_type == "np" else to_pil(images)


def to_pil(images):
    """Float images `[B, C, H, W]` in [0, 1] -> list of PIL images (mode "L" for one channel)."""
    array = (images.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)  # [B, H, W, C]
    return [PIL.Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in array]
