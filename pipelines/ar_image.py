"""Speculative decoding for discrete-token AR image models (LlamaGen family): `SpeculativeARImagePipeline`.

One Diffusers-style pipeline over the shared decoding engine (`mmspec.decoding`): a target adapter, a drafter, an
acceptance rule (`mmspec.verify`) and one loop. Every method is a registry entry (`mmspec.methods`):

| `acceptance` | default `drafter` | method                                                        | lossless |
|--------------|-------------------|---------------------------------------------------------------|----------|
| `"none"`     | -                 | plain AR sampling (the baseline)                              | yes      |
| `"exact"`    | eagle/model/jacobi | speculative sampling (Leviathan 2023; EAGLE-2 trees)          | yes      |
| `"relaxed"`  | eagle/model/jacobi | LANTERN latent-proximity acceptance (Jang et al. 2024)       | no (bound below) |
| `"grouped"`  | jacobi            | GSD grouped acceptance (So et al. 2025) on Jacobi drafts      | no       |
| `"jacobi"`   | jacobi            | SJD (Teng et al. 2024), optional SCD coupling                 | yes      |

How far `"relaxed"` may move each token's law from `p_target` (total variation, per emitted token, given the
prefix) depends on the drafts it relaxes: `<= delta` for point-mass drafts (Jacobi fresh tokens, a tree's single
top-1 child); `<= sum_v min(q_draft(v), delta)` for drafts sampled from `q_draft` (EAGLE / model chains: up to
`min(1, V * delta)`, measured up to ~11 delta on the MNIST zoo); LANTERN++'s `relaxation_lambda` bounds the ratio
instead: `<= (lambda - 1) * sum_{q > p} p`. `tests/test_pipeline_ar_image.py` measures the first two through the
pipeline. An EAGLE-2 tree with `m` deterministic siblings per node can pass on `delta` at every rejected sibling (up
to `m * delta`; 2.8 delta measured with 4 siblings).

Drafters: `"model"` (a small `LlamaGenGPT` drafts a chain of `num_draft_tokens`), `"eagle"` (an `EagleHead` drafts
a chain of `tree_depth` tokens sampled from its `q_draft` when `tree_top_k=1`, the default, or an EAGLE-2 dynamic
tree of `num_draft_tokens` nodes, `tree_depth` levels and `tree_top_k` deterministic children per node),
`"jacobi"` (the target drafts for itself: a window of `jacobi_window` tokens from its previous iteration).

Classifier-free guidance: with `guidance_scale != 1` every forward scores both streams (rows `[cond; uncond]`, same
tokens, same cache commits) and `p_target` / `q_draft` are the guided, temperature/top-k/top-p processed
distributions, exactly what plain sampling draws from; with `guidance_scale == 1` only the conditional stream runs.
Batches are ragged: every row accepts its own number of tokens per round and keeps its own cache length; a finished
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

from mmspec.decoding import DecodeTrace, Guidance, SequenceState, decode
from mmspec.drafters.eagle import EagleDrafter
from mmspec.drafters.jacobi import JacobiDrafter
from mmspec.drafters.model import ModelDrafter
from mmspec.methods import ACCEPTANCES, KNOBS, check_knobs, resolve_drafter
from mmspec.models.eagle import EagleHead
from mmspec.models.llamagen import LlamaGenGPT
from mmspec.models.llamagen_target import LlamaGenTarget
from mmspec.models.vq import LlamaGenVQ
from mmspec.random import check_generator
from mmspec.sampling import SamplingParams, sample
from mmspec.stats import SpecStats
from mmspec.verify import Exact, Grouped, Lantern, codebook_neighbours


logger = logging.getLogger(__name__)

OUTPUT_TYPES = ("pil", "np", "pt", "tokens")


@dataclass
class SpeculativeImageOutput(BaseOutput):
    """Output of the speculative image pipelines.

    Attributes:
        images: PIL images, a float NHWC array in [0, 1] (`"np"`), a float NCHW tensor in [0, 1] (`"pt"`) or the
            token grids `[B, N]` (`"tokens"`).
        stats: `mmspec.stats.SpecStats` of the call (always filled, so `out[1]` is stable).
        trace: `mmspec.decoding.DecodeTrace`: per token, the round it was emitted in and its origin (prefill,
            accepted draft, resampled correction, bonus); `trace.acceptance_map()` is the acceptance map.
    """

    images: list | np.ndarray | torch.Tensor
    stats: SpecStats
    trace: DecodeTrace | None = None


def _check_type(name, value, kind, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TypeError(f"{name} must be {names}, got {value!r} ({type(value).__name__})")


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
    _callback_tensor_inputs = ["tokens", "trace"]

    def __init__(
        self,
        transformer: LlamaGenGPT,
        vqvae: LlamaGenVQ,
        draft_model: LlamaGenGPT | None = None,
        eagle_head: EagleHead | None = None,
    ):
        super().__init__()
        for name, value, kind in (("transformer", transformer, LlamaGenGPT), ("vqvae", vqvae, LlamaGenVQ),
                                  ("draft_model", draft_model, LlamaGenGPT), ("eagle_head", eagle_head, EagleHead)):  # fmt: skip
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
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
    def check_inputs(self, acceptance, drafter, output_type, num_images_per_prompt, do_sample, callback_on_step_end,
                     callback_on_step_end_tensor_inputs):  # fmt: skip
        """Validate the call's method and I/O arguments; returns the resolved drafter name."""
        loaded = {name for name in ("draft_model", "eagle_head") if getattr(self, name, None) is not None}
        drafter = resolve_drafter(acceptance, drafter, loaded)
        _check_type("num_images_per_prompt", num_images_per_prompt, int)
        if num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
        _check_type("do_sample", do_sample, bool)
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        if callback_on_step_end is not None and not callable(callback_on_step_end):
            raise TypeError(
                f"callback_on_step_end must be callable or None, got {type(callback_on_step_end).__name__}"
            )
        bad = set(callback_on_step_end_tensor_inputs or []) - set(self._callback_tensor_inputs)
        if bad:
            raise ValueError(f"callback_on_step_end_tensor_inputs {sorted(bad)} not in {self._callback_tensor_inputs}")
        return drafter

    def prepare_class_labels(self, class_labels, num_images_per_prompt, device):
        """`class_labels` (int, list of ints or 1-D integer tensor) -> LongTensor `[B]` (each repeated
        `num_images_per_prompt` times)."""
        if class_labels is None:
            raise ValueError("class_labels is required for a class-conditional transformer")
        if isinstance(class_labels, (str, bytes, float, bool)) or (
            isinstance(class_labels, (list, tuple))
            and not all(isinstance(c, int) and not isinstance(c, bool) for c in class_labels)  # fmt: skip
        ):
            raise TypeError(f"class_labels must be integer class ids (int, list or 1-D tensor), got {class_labels!r}")
        labels = torch.as_tensor([class_labels] if isinstance(class_labels, int) else class_labels, device=device)
        if labels.dim() != 1 or labels.is_floating_point() or labels.dtype == torch.bool or labels.numel() == 0:
            raise ValueError(f"class_labels must be integer class ids (int, list or 1-D tensor), got {class_labels!r}")
        n = self.transformer.config.num_classes
        if int(labels.min()) < 0 or int(labels.max()) >= n:
            raise ValueError(f"class_labels must be in [0, {n}), got range [{int(labels.min())}, {int(labels.max())}]")
        return labels.long().repeat_interleave(num_images_per_prompt)

    def neighbours(self, k):
        """LANTERN latent-proximity neighbourhoods `[V, k]` of the VQ codebook (computed once per k; k is capped at
        V - 1, the whole codebook)."""
        k = min(int(k), self.vqvae.config.codebook_size - 1)
        if k not in self._neighbours:
            self._neighbours[k] = codebook_neighbours(self.vqvae.codebook.detach().float(), k)
        return self._neighbours[k]

    def make_rule(self, acceptance, knobs):
        """The `mmspec.verify` acceptance rule object of `acceptance` with the call's knobs."""
        if acceptance == "relaxed":
            lam = knobs["relaxation_lambda"]
            return Lantern(neighbours=self.neighbours(knobs["relaxation_top_k"]), lam=lam,
                           delta=None if lam is not None else knobs["relaxation_delta"], resample=knobs["resample"])  # fmt: skip
        if acceptance == "grouped":
            return Grouped(embeddings=self.vqvae.codebook.detach().float(), group_size=knobs["group_size"],
                           prob_threshold=knobs["group_prob_threshold"], dist_threshold=knobs["group_dist_threshold"],
                           resample=knobs["resample"])  # fmt: skip
        return Exact()

    def make_drafter(self, drafter, guidance, knobs, cond):
        """The engine drafter object for this call (`mmspec.drafters`), or None for plain decoding."""
        if drafter == "model":
            return ModelDrafter(self.draft_model, guidance, knobs["num_draft_tokens"] or 4, cond)
        if drafter == "eagle":
            return EagleDrafter(self.eagle_head, self.transformer, guidance, knobs["tree_depth"], knobs["tree_top_k"],
                                knobs["num_draft_tokens"] or 24)  # fmt: skip
        if drafter == "jacobi":
            return JacobiDrafter(self.transformer.config.vocab_size, knobs["jacobi_window"], knobs["jacobi_init"],
                                 knobs["coupling"])  # fmt: skip
        return None

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
        num_draft_tokens: int | None = KNOBS["num_draft_tokens"].default,
        tree_depth: int | None = KNOBS["tree_depth"].default,
        tree_top_k: int = KNOBS["tree_top_k"].default,
        relaxation_top_k: int = KNOBS["relaxation_top_k"].default,
        relaxation_delta: float = KNOBS["relaxation_delta"].default,
        relaxation_lambda: float | None = KNOBS["relaxation_lambda"].default,
        group_size: int = KNOBS["group_size"].default,
        group_prob_threshold: float = KNOBS["group_prob_threshold"].default,
        group_dist_threshold: float = KNOBS["group_dist_threshold"].default,
        jacobi_window: int = KNOBS["jacobi_window"].default,
        jacobi_init: str = KNOBS["jacobi_init"].default,
        coupling: bool = KNOBS["coupling"].default,
        resample: str = KNOBS["resample"].default,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs=("tokens",),
    ):
        """Generate images for `class_labels`.

        Args:
            class_labels: class id(s) in `[0, num_classes)`.
            guidance_scale, temperature, top_k, top_p, do_sample: sampling knobs, applied identically to target and
                draft distributions (`do_sample=False` = greedy; `guidance_scale=1` runs the conditional stream only).
            num_images_per_prompt: images per class label.
            acceptance: `"none"` | `"exact"` | `"relaxed"` | `"grouped"` | `"jacobi"` (module docstring).
            drafter: `"model"` | `"eagle"` | `"jacobi"`; default: the acceptance's first drafter that is loaded
                (`mmspec.methods.ACCEPTANCES`: eagle, model, jacobi for exact/relaxed; jacobi for grouped/jacobi).
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
                LLM input embeddings of the GSD release (`mmspec.verify.Grouped` has the defaults and why).
            jacobi_window, jacobi_init, coupling: SJD window (draft tokens per forward), fresh-token init
                (`"repeat"` | `"random"`), and SCD maximal-coupling re-drafts (default on: lossless and raises
                acceptance; `coupling=False` is the original SJD).
            resample: `"optimal"` (TV-optimal residual for relaxed rules) or `"released"` (as the papers' code).
            generator: the only source of randomness: one `torch.Generator` on the model's device, or a list with
                one per image (then an image does not depend on what else is in its batch).
            output_type: `"pil"` | `"np"` | `"pt"` | `"tokens"`.
            return_dict: return a `SpeculativeImageOutput` (else a tuple `(images, stats)`).
            callback_on_step_end: `fn(pipe, round, generated_tokens, callback_kwargs)` after every round, with the
                requested `callback_on_step_end_tensor_inputs` (`"tokens"`: the `[B, N]` grid, -1 = not yet;
                `"trace"`: the `DecodeTrace`). Read-only: returning changed tokens raises `ValueError` (committed
                tokens live in the KV caches).

        Returns:
            `SpeculativeImageOutput(images, stats, trace)` or `(images, stats)`.
        """
        # 1. check inputs, resolve the method
        drafter = self.check_inputs(acceptance, drafter, output_type, num_images_per_prompt, do_sample,
                                    callback_on_step_end, callback_on_step_end_tensor_inputs)  # fmt: skip
        knobs = check_knobs(num_draft_tokens=num_draft_tokens, tree_depth=tree_depth, tree_top_k=tree_top_k,
                            relaxation_top_k=relaxation_top_k, relaxation_delta=relaxation_delta,
                            relaxation_lambda=relaxation_lambda, group_size=group_size,
                            group_prob_threshold=group_prob_threshold, group_dist_threshold=group_dist_threshold,
                            jacobi_window=jacobi_window, jacobi_init=jacobi_init, coupling=coupling,
                            resample=resample)  # fmt: skip
        if knobs["tree_depth"] is None:
            knobs["tree_depth"] = 7 if acceptance in ("relaxed", "grouped") else 5
        sampling = SamplingParams(guidance_scale, temperature, top_k, top_p, do_sample)
        if sampling.greedy and ACCEPTANCES[acceptance].sampling_only:
            raise ValueError(f"acceptance={acceptance!r} is a sampling rule; use do_sample=True and temperature > 0")
        guidance = Guidance(sampling)
        if guidance.streams == 2 and self.transformer.cls_embedding.embedding_table.num_embeddings <= (
            self.transformer.config.num_classes
        ):
            raise ValueError("guidance_scale != 1 needs a null class, but the transformer has no null-class embedding")

        # 2. prepare conditions, generators, the rule and the drafter
        device = self._execution_device
        labels = self.prepare_class_labels(class_labels, num_images_per_prompt, device)
        batch, n_tokens = labels.shape[0], self.transformer.config.block_size
        check_generator(generator, batch, device)
        rule = self.make_rule(acceptance, knobs)
        target = LlamaGenTarget(self.transformer, guidance)
        cond_rows = guidance.condition_rows(labels, self.transformer.null_condition(batch))  # for a draft model
        draft = self.make_drafter(drafter, guidance, knobs, cond_rows)
        stats = SpecStats(batch, 0 if draft is None else draft.max_width)

        # 3. prefill: the condition prefix of every row; the first token comes from the target alone
        with stats.timer("total", device), stats.timer("prefill", device):
            first = target.prefill(labels, n_tokens, scratch=1 + (draft.max_width if draft else 0),
                                   return_hidden=draft is not None and draft.needs_hidden)  # fmt: skip
            state = SequenceState(sample(first.p_target[:, 0], generator), n_tokens, generator=generator)
            if draft is not None:
                draft.prefill(state, first)
        stats.record_prefill(1)

        # 4. decode: draft -> verify -> commit rounds until every image is complete
        callback = None
        if callback_on_step_end is not None:
            callback = self._callback(callback_on_step_end, callback_on_step_end_tensor_inputs)
        with stats.timer("total", device), self.progress_bar(total=batch * n_tokens) as progress:
            decode(target, draft, rule, state, guidance, stats, progress=progress, callback=callback)
        stats.draft_forwards = getattr(draft, "draft_forwards", 0)

        # 5. tokens -> images
        with stats.timer("total", device), stats.timer("decode", device):
            images = self.postprocess(state.full(), output_type)
        stats.finalize()
        self.maybe_free_model_hooks()
        if not return_dict:
            return images, stats
        return SpeculativeImageOutput(images=images, stats=stats, trace=state.full_trace())

    def _callback(self, fn, names):
        """Wrap the user's `callback_on_step_end` as the loop's `callback(state, round)`."""

        def callback(state, round_index):
            tensors = {}
            for name in names:
                tensors[name] = state.full() if name == "tokens" else state.full_trace()
            out = fn(self, round_index, int(state.num_generated().sum()), tensors)
            if out and "tokens" in out and not torch.equal(out["tokens"], state.full()):
                raise ValueError("callback_on_step_end may not change tokens: committed tokens live in the KV caches")

        return callback

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
