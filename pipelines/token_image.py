"""`TokenImagePipeline`: the one call of the discrete-token image pipelines (LlamaGen: `SpeculativeARImagePipeline`,
Janus: `SpeculativeJanusPipeline`) over the shared decoding engine (`mmspec.decoding`).

`__call__` reads check -> prepare -> prefill -> loop -> postprocess; a subclass holds only what differs: loading,
the condition (class labels / caption features / chat prompts), the target adapter and its prefill, the drafters it
has, the call's memory / context checks and tokens -> images. The method (acceptance, drafter, knobs) resolves
once into a `mmspec.methods.MethodSettings` that the drafter and the rule read as it is.
"""

import inspect
import numbers
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from mmspec.decoding import DecodeTrace, Guidance, SequenceState, decode
from mmspec.drafters.jacobi_pac import make_jacobi_drafter
from mmspec.methods import ACCEPTANCES, KNOBS, resolve_drafter, resolve_method
from mmspec.random import check_generator
from mmspec.sampling import SamplingParams, sample
from mmspec.stats import SpecStats
from mmspec.verify import Exact, Grouped, Lantern, codebook_neighbours

from .captured import CapturedForwards
from .packed import PackedLinears


__all__ = ["OUTPUT_TYPES", "Condition", "SpeculativeImageOutput", "TokenImagePipeline", "with_knob_parameters"]

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


@dataclass
class Condition:
    """A call's prepared condition, one row per image: `inputs` (class ids `[B]`, caption features `[B, T, D]` or
    prompt ids `[B, L]`) and its `mask` (None: all valid)."""

    inputs: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.inputs.shape[0]


def with_knob_parameters(call):
    """Give a pipeline `__call__(..., drafter=None, **knobs, ...)` the signature with one keyword per registry knob
    (`mmspec.methods.KNOBS`, their defaults), placed after `drafter`: what `inspect.signature` / `help` show."""
    signature = inspect.signature(call)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    at = [p.name for p in params].index("drafter") + 1
    knobs = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=knob.default)
             for name, knob in KNOBS.items()]  # fmt: skip
    call.__signature__ = signature.replace(parameters=params[:at] + knobs + params[at:])
    return call


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


class TokenImagePipeline(PackedLinears, CapturedForwards, DiffusionPipeline):
    """The shared call of the token-image pipelines (module docstring). Subclasses implement `prepare`,
    `make_target`, `prefill`, `check_call`, `codebook` and `postprocess`, and may override `loaded_drafters`,
    `make_drafter`, `check_guidance` and `call_device`."""

    _callback_tensor_inputs = ["tokens", "trace"]
    max_images_per_prompt: int | None = None  # a bound of `mmspec.methods.IMAGE_LIMITS`, or None (the memory budget)

    # ------------------------------------------------------------------ what a subclass provides
    @property
    def num_tokens(self) -> int:
        """Image tokens per image."""
        raise NotImplementedError

    def loaded_drafters(self) -> set[str]:
        """The drafter components that are loaded (`mmspec.methods.DRAFTERS`' `component` names)."""
        return set()

    def codebook(self) -> torch.Tensor:
        """The VQ codebook `[V, D]` (float32) LANTERN's neighbourhoods and GSD's distances are measured in."""
        raise NotImplementedError

    def call_device(self) -> torch.device:
        return self._execution_device

    def check_guidance(self, guidance):
        """Refuse a guidance the model cannot run (before anything is encoded)."""

    def prepare(self, condition, num_images_per_prompt, device) -> Condition:
        """The call's condition keywords -> a `Condition`, each item repeated `num_images_per_prompt` times."""
        raise NotImplementedError

    def make_target(self, guidance):
        """The engine's target adapter (`mmspec.decoding.target.Target`) for this call."""
        raise NotImplementedError

    def make_drafter(self, method, guidance, target, cond):
        """The engine drafter of this call, or None for plain decoding: Jacobi self-drafting (SJD / SCD, or SJD-PAC
        at `jacobi_tree_width > 1`) here; subclasses with trained drafters add theirs."""
        if method.drafter == "jacobi":
            return make_jacobi_drafter(target.vocab_size, method)
        return None

    def check_call(self, target, cond, method, guidance, draft, scratch, num_images_per_prompt, device):
        """Refuse a call that does not fit (context, memory budget): before the first forward."""
        raise NotImplementedError

    def prefill(self, target, cond, scratch, draft):
        """The target's prefill of every row's condition (`TargetOutput` of the first token's distribution)."""
        raise NotImplementedError

    def postprocess(self, tokens, output_type):
        """Token grids `[B, N]` -> the requested output type."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def check_inputs(self, acceptance, drafter, output_type, num_images_per_prompt, do_sample, return_dict=True,
                     time_phases=False, callback_on_step_end=None, callback_on_step_end_tensor_inputs=("tokens",)):  # fmt: skip
        """Validate the call's method and I/O arguments; returns the resolved drafter name."""
        drafter = resolve_drafter(acceptance, drafter, self.loaded_drafters())
        limit = self.max_images_per_prompt
        if isinstance(num_images_per_prompt, bool) or not isinstance(num_images_per_prompt, numbers.Integral):
            raise TypeError(f"num_images_per_prompt must be an int, got {num_images_per_prompt!r}")
        if num_images_per_prompt < 1 or limit is not None and num_images_per_prompt > limit:
            bound = ">= 1" if limit is None else f"in [1, {limit}]"
            raise ValueError(f"num_images_per_prompt must be {bound}, got {num_images_per_prompt}")
        for name, value in (("do_sample", do_sample), ("return_dict", return_dict), ("time_phases", time_phases)):
            _check_bool(name, value)
        if not isinstance(output_type, str) or output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        if callback_on_step_end is not None and not callable(callback_on_step_end):
            raise TypeError(
                f"callback_on_step_end must be callable or None, got {type(callback_on_step_end).__name__}"
            )
        names = callback_on_step_end_tensor_inputs
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"callback_on_step_end_tensor_inputs must be a list of names, got {names!r}")
        bad = set(names) - set(self._callback_tensor_inputs)
        if bad:
            raise ValueError(f"callback_on_step_end_tensor_inputs {sorted(bad)} not in {self._callback_tensor_inputs}")
        return drafter

    def neighbours(self, k):
        """LANTERN latent-proximity neighbourhoods `[V, k]` of the codebook (computed once per k; k is capped at
        V - 1, the whole codebook)."""
        codebook = self.codebook()
        k = min(int(k), codebook.shape[0] - 1)
        if k not in self._neighbours:
            self._neighbours[k] = codebook_neighbours(codebook, k)
        return self._neighbours[k]

    def make_rule(self, acceptance, knobs):
        """The `mmspec.verify` acceptance rule object of `acceptance` with the call's knobs (a `MethodSettings` or
        a mapping with the rule's knobs)."""
        if acceptance == Lantern.name:
            lam = knobs["relaxation_lambda"]
            return Lantern(neighbours=self.neighbours(knobs["relaxation_top_k"]), lam=lam,
                           delta=None if lam is not None else knobs["relaxation_delta"], resample=knobs["resample"])  # fmt: skip
        if acceptance == Grouped.name:
            return Grouped(embeddings=self.codebook(), group_size=knobs["group_size"],
                           prob_threshold=knobs["group_prob_threshold"], dist_threshold=knobs["group_dist_threshold"],
                           resample=knobs["resample"])  # fmt: skip
        return Exact()

    def generate(self, condition, *, guidance_scale, temperature, top_k, top_p, do_sample, num_images_per_prompt,
                 acceptance, drafter, knobs, generator, output_type, return_dict, callback_on_step_end,
                 callback_on_step_end_tensor_inputs, time_phases):  # fmt: skip
        """The call: check -> prepare -> prefill -> loop -> postprocess (`condition`: the subclass's condition
        keywords, for `prepare`; `knobs`: the method knobs given)."""
        # 1. check inputs, resolve the method once
        drafter = self.check_inputs(acceptance, drafter, output_type, num_images_per_prompt, do_sample, return_dict,
                                    time_phases, callback_on_step_end, callback_on_step_end_tensor_inputs)  # fmt: skip
        method = resolve_method(acceptance, drafter, None, **knobs)
        sampling = SamplingParams(guidance_scale, temperature, top_k, top_p, do_sample)
        if sampling.greedy and ACCEPTANCES[acceptance].sampling_only:
            raise ValueError(f"acceptance={acceptance!r} is a sampling rule; use do_sample=True and temperature > 0")
        guidance = Guidance(sampling)
        self.check_guidance(guidance)

        # 2. prepare the condition, generators, the target, the drafter and the rule
        device = self.call_device()
        cond = self.prepare(condition, num_images_per_prompt, device)
        batch, n_tokens = cond.batch, self.num_tokens
        check_generator(generator, batch, device)
        target = self.make_target(guidance)
        draft = self.make_drafter(method, guidance, target, cond)
        self.attach_compiler(target, draft)
        scratch = 1 + (draft.max_width if draft else 0)
        self.check_call(target, cond, method, guidance, draft, scratch, num_images_per_prompt, device)
        rule = self.make_rule(acceptance, method)
        stats = SpecStats(batch, 0 if draft is None else draft.max_width, time_phases=time_phases)

        # 3. prefill: every row's condition; the first token comes from the target alone
        with stats.timer("total", device), stats.timer("prefill", device):
            first = self.prefill(target, cond, scratch, draft)
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
            tensors = {name: state.full() if name == "tokens" else state.full_trace() for name in names}
            out = fn(self, round_index, int(state.num_generated().sum()), tensors)
            if out and "tokens" in out and not torch.equal(out["tokens"], state.full()):
                raise ValueError("callback_on_step_end may not change tokens: committed tokens live in the KV caches")

        return callback
