"""Continuous-token AR image generation (MAR + diffusion head) with CSpD continuous speculative decoding:
`SpeculativeContinuousARPipeline`.

Components: ``transformer`` (the target `MAR`), ``vae`` (`AutoencoderKL`: tokens <-> images) and an optional
``draft_transformer`` (a smaller `MAR` on the same tokens). ``acceptance="none"`` is MAR's own sampler;
``acceptance="continuous"`` is CSpD (Wang et al., arXiv 2411.11925): target-only pre-fill, then blocks of
``num_draft_tokens`` AR steps drafted by the draft MAR and verified by the target (`mmspec.decoding.masked` has the
rule, what each ``verify_mode`` preserves, and where it differs from the release).
"""

import logging
import numbers
from dataclasses import dataclass

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from mmspec.decoding.masked import ImageNoise, decode_masked
from mmspec.decoding.masked_params import CFG_SCHEDULES, VERIFY_MODES, MaskedParams
from mmspec.decoding.trace import DecodeTrace
from mmspec.methods import CONTINUOUS_DEFAULTS, CONTINUOUS_LIMITS, acceptance_names
from mmspec.models import DEFAULT_ZOO
from mmspec.models.mar.diffusion import GaussianDiffusion
from mmspec.models.mar.kl_vae import AutoencoderKL
from mmspec.models.mar.model import MAR
from mmspec.models.mar.runner import MARRunner
from mmspec.random import check_generator
from mmspec.stats import SpecStats

from .captured import CapturedForwards
from .packed import PackedLinears


logger = logging.getLogger(__name__)

__all__ = ["LIMITS", "SpeculativeContinuousARPipeline", "SpeculativeContinuousOutput"]

ACCEPTANCES = acceptance_names("continuous")  # ("none", "continuous"): the registry's entries for MAR
OUTPUT_TYPES = ("pil", "np", "pt", "latent")
# Upper bounds of the real-valued and count knobs: the registry's (`mmspec.methods.CONTINUOUS_LIMITS`, also read by
# `mmspec bench continuous`'s flags).
LIMITS = CONTINUOUS_LIMITS
DEFAULTS = CONTINUOUS_DEFAULTS  # the knobs' defaults, likewise the registry's


def _check_number(name, value, low, high, low_open=False):
    """A real number (not a bool) in ``[low, high]`` (``(low, high]`` with ``low_open``): TypeError / ValueError."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    ok = (low < value if low_open else low <= value) and value <= high  # also rejects NaN
    if not ok:
        raise ValueError(f"{name} must be finite and in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")


def _check_int(name, value, low, high, what=None):
    """An int (Python or NumPy, not a bool) in ``[low, high]``: TypeError / ValueError."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        bound = f" ({what})" if what else ""
        raise ValueError(f"{name} must be in [{low}, {high}]{bound}, got {value}")


@dataclass
class SpeculativeContinuousOutput(BaseOutput):
    """Images (or ``[B, L, D]`` latent tokens), the call's `SpecStats` and the per-token `DecodeTrace` (by token
    position: prefill = target-only step, accepted / resampled = CSpD block tokens, bonus = plain MAR)."""

    images: object
    stats: SpecStats
    trace: DecodeTrace


class SpeculativeContinuousARPipeline(PackedLinears, CapturedForwards, DiffusionPipeline):
    """MAR sampling, plain or with CSpD (module docstring)."""

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["draft_transformer"]

    def __init__(self, transformer: MAR, vae: AutoencoderKL, draft_transformer: MAR | None = None):
        super().__init__()
        if transformer.seq_len != vae.tokens_per_image or transformer.token_embed_dim != vae.token_dim:
            raise ValueError(
                f"transformer tokens ({transformer.seq_len} x {transformer.token_embed_dim}) do not match the vae "
                f"({vae.tokens_per_image} x {vae.token_dim})"
            )
        if draft_transformer is not None and (
            draft_transformer.seq_len != transformer.seq_len
            or draft_transformer.token_embed_dim != transformer.token_embed_dim
        ):
            raise ValueError("draft_transformer must generate the transformer's token grid and dim")
        self.register_modules(transformer=transformer, vae=vae, draft_transformer=draft_transformer)

    # ------------------------------------------------------------------ loading
    ZOO_PARTS = {"transformer": "mar", "vae": "kl", "draft_transformer": "mar-draft"}

    @classmethod
    def from_zoo(cls, root=None, prefix="mnist", **kwargs):
        """The pipeline from zoo folders ``<root>/<prefix>-{mar,kl,mar-draft}`` (the draft optional), each loaded
        strictly (`mmspec.models.load`); components given as keywords are used as they are."""
        root = DEFAULT_ZOO if root is None else root  # the shipped zoo, from any working directory
        from pathlib import Path

        from mmspec.models import load

        components = {}
        for name, suffix in cls.ZOO_PARTS.items():
            folder = Path(root) / f"{prefix}-{suffix}"
            if name in kwargs:
                continue
            if folder.is_dir():
                components[name] = load(folder)
            elif name != "draft_transformer":
                raise ValueError(f"root={str(root)!r}: missing zoo folder {folder}")
        components.update(kwargs)
        try:
            return cls(**components)
        except ValueError as err:
            raise ValueError(f"root={str(root)!r}: the zoo's models do not fit together: {err}") from err

    @classmethod
    def from_official(cls, mar_ckpt, vae_ckpt, model="mar_large", draft_ckpt=None, draft_model="mar_base", **kwargs):
        """The pipeline from official LTH14/mar files (``checkpoint-last.pth`` of ``mar_base/large/huge``, EMA
        weights by default, and ``kl16.ckpt``), read with ``torch.load(weights_only=True)`` and every key and shape
        checked (`mmspec.models.mar.checkpoints.official_continuous_parts` has the options).

        Examples:
            >>> pipe = SpeculativeContinuousARPipeline.from_official(
            ...     "mar_huge/checkpoint-last.pth", "kl16.ckpt", "mar_huge",
            ...     draft_ckpt="mar_base/checkpoint-last.pth", draft_model="mar_base", device="cuda")
            >>> out = pipe([207], acceptance="continuous", num_ar_steps=256, guidance_scale=3.2)
        """
        from mmspec.models.mar.checkpoints import official_continuous_parts

        return cls(**official_continuous_parts(mar_ckpt, vae_ckpt, model, draft_ckpt, draft_model, **kwargs))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """`DiffusionPipeline.from_pretrained`, with a local pipeline folder's components loaded strictly through
        `mmspec.models.load` (components passed as keywords are used as given)."""
        from mmspec.models.loading import import_index_modules

        import_index_modules(pretrained_model_name_or_path)
        from pathlib import Path

        folder = Path(pretrained_model_name_or_path)
        if (folder / "model_index.json").is_file():
            from mmspec.models import load

            for name in cls.ZOO_PARTS:
                if name not in kwargs and (folder / name / "config.json").is_file():
                    kwargs[name] = load(folder / name)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    # ------------------------------------------------------------------ checks
    def check_inputs(self, class_labels, guidance_scale, temperature, num_ar_steps, acceptance, num_draft_tokens,
                     prefill_ratio, verify_mode, output_type, num_inference_steps=None,
                     trajectory_alignment=DEFAULTS["trajectory_alignment"],
                     cfg_schedule_type=DEFAULTS["cfg_schedule_type"],
                     max_residual_tries=DEFAULTS["max_residual_tries"], return_dict=True,
                     callback_on_step_end=None):  # fmt: skip
        """Check every argument of `__call__` before any work: `TypeError` for a wrong type, `ValueError` out of
        range (`LIMITS`), both naming the argument. Returns the class labels as a 1-D long tensor."""
        for name, value, choices in (("acceptance", acceptance, ACCEPTANCES), ("verify_mode", verify_mode, VERIFY_MODES),
                                     ("output_type", output_type, OUTPUT_TYPES),
                                     ("cfg_schedule_type", cfg_schedule_type, CFG_SCHEDULES)):  # fmt: skip
            if not isinstance(value, str) or value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        if acceptance == "continuous" and self.draft_transformer is None:
            raise ValueError("acceptance='continuous' needs a draft_transformer component")
        seq_len = self.transformer.seq_len
        _check_number("guidance_scale", guidance_scale, 1.0, LIMITS["guidance_scale"])
        _check_number("temperature", temperature, 0.0, LIMITS["temperature"], low_open=True)
        _check_number("prefill_ratio", prefill_ratio, 0.0, 1.0)
        _check_int("num_ar_steps", num_ar_steps, 1, seq_len, "tokens per image")
        _check_int("num_draft_tokens", num_draft_tokens, 1, seq_len, "tokens per image")
        _check_int("max_residual_tries", max_residual_tries, 1, LIMITS["max_residual_tries"])
        for name, value in (("trajectory_alignment", trajectory_alignment), ("return_dict", return_dict)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
        if callback_on_step_end is not None and not callable(callback_on_step_end):
            raise TypeError(
                f"callback_on_step_end must be callable or None, got {type(callback_on_step_end).__name__}"
            )
        if num_inference_steps is not None:
            if isinstance(num_inference_steps, str):
                try:
                    steps = GaussianDiffusion(1000, num_inference_steps).num_steps
                except (ValueError, TypeError) as err:
                    raise ValueError(f"num_inference_steps={num_inference_steps!r}: {err}") from err
                if steps < 2:
                    raise ValueError(
                        f"num_inference_steps must keep >= 2 diffusion steps, got {num_inference_steps!r}"
                    )
            else:
                _check_int("num_inference_steps", num_inference_steps, 2, 1000, "the diffusion's training steps")
        try:
            labels = torch.as_tensor(class_labels)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"class_labels must be an int class id or a list / tensor of them, got {class_labels!r}"
            ) from err
        if labels.dim() > 1:
            raise ValueError(
                f"class_labels must be an int or a 1-D list / tensor of ints, got shape {tuple(labels.shape)}"
            )
        labels = labels.reshape(-1)
        if labels.numel() == 0 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise ValueError(f"class_labels must be one or more int class ids, got {class_labels!r}")
        n = self.transformer.config.class_num
        if bool(((labels < 0) | (labels >= n)).any()):
            raise ValueError(f"class_labels must be in [0, {n}), got {labels.tolist()}")
        return labels

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(
        self,
        class_labels,
        guidance_scale: float = DEFAULTS["guidance_scale"],
        temperature: float = DEFAULTS["temperature"],
        num_ar_steps: int = DEFAULTS["num_ar_steps"],
        num_inference_steps: int | None = None,
        acceptance: str = "none",
        num_draft_tokens: int = DEFAULTS["num_draft_tokens"],
        prefill_ratio: float = DEFAULTS["prefill_ratio"],
        trajectory_alignment: bool = DEFAULTS["trajectory_alignment"],
        verify_mode: str = DEFAULTS["verify_mode"],
        cfg_schedule_type: str = DEFAULTS["cfg_schedule_type"],
        max_residual_tries: int = DEFAULTS["max_residual_tries"],
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end=None,
    ):
        """Generate one image per class label.

        Args:
            class_labels: class id(s) in ``[0, class_num)``.
            guidance_scale: CFG scale on the head's epsilon (1 = conditional branch only), scheduled by
                ``cfg_schedule_type`` (``"linear"``, MAR's default: weak early, full at the end; or ``"constant"``);
                finite, in ``[1, LIMITS["guidance_scale"]]``.
            temperature: the head's noise scale at every stochastic denoising step (MAR's diffusion temperature);
                finite, in ``(0, LIMITS["temperature"]]``.
            num_ar_steps: MAR's AR steps (cosine schedule; ``seq_len`` = one token per step at the end).
            num_inference_steps: the head's respaced diffusion steps (default: the transformer's config); the draft
                uses the same (trajectory alignment needs the same steps).
            acceptance: ``"none"`` (MAR) | ``"continuous"`` (CSpD; needs ``draft_transformer``).
            num_draft_tokens: AR steps per CSpD block (the release's ``num_draft``).
            prefill_ratio: the leading fraction of AR steps the target does alone (at least one step).
            trajectory_alignment: the draft uses the target's ``x_T`` and per-step noise (CSpD §3.2); False draws
                its own (lower acceptance; same output law).
            verify_mode: ``"block"`` | ``"exact"`` (`mmspec.decoding.masked`).
            max_residual_tries: acceptance-rejection proposals per rejected token before the fallback to a plain
                target sample (counted in ``stats.extra["residual_fallbacks"]``).
            generator: one ``torch.Generator`` on the model's device, or one per image (an image then does not
                depend on its batch).
            output_type: ``"pil"`` | ``"np"`` | ``"pt"`` (``[B, C, H, W]`` in [0, 1]) | ``"latent"`` (tokens).
            return_dict: return a `SpeculativeContinuousOutput` (else ``(images, stats)``).
            callback_on_step_end: ``fn(pipe, step, num_steps, {"tokens": [B, L, D], "visible": [B, L]})`` after
                every plain step or CSpD block (read-only).

        Raises:
            TypeError / ValueError: an argument of the wrong type or out of range (named), before any model runs.
            ValueError: a model's outputs were not finite (NaN / inf: broken or overflowing weights), naming it:
                ``"transformer"``, ``"draft_transformer"`` (checked once per call, no host sync per step) or
                ``"vae"``.
        """
        # 1. check
        labels = self.check_inputs(class_labels, guidance_scale, temperature, num_ar_steps, acceptance,
                                   num_draft_tokens, prefill_ratio, verify_mode, output_type, num_inference_steps,
                                   trajectory_alignment, cfg_schedule_type, max_residual_tries, return_dict,
                                   callback_on_step_end)  # fmt: skip
        device = self._execution_device
        labels = labels.to(device)
        batch = labels.numel()
        check_generator(generator, batch, device)
        speculative = acceptance == "continuous"
        models = [self.transformer] + ([self.draft_transformer] if speculative else [])
        saved_steps = [m.diffloss.gen_diffusion for m in models]
        try:
            if num_inference_steps is not None:
                for m in models:
                    m.diffloss.set_sampling_steps(num_inference_steps)
            elif (
                speculative
                and self.draft_transformer.diffloss.num_sampling_steps != self.transformer.diffloss.num_sampling_steps
            ):
                self.draft_transformer.diffloss.gen_diffusion = self.transformer.diffloss.gen_diffusion
            params = MaskedParams.from_knobs(
                self.transformer.seq_len, num_ar_steps=num_ar_steps, guidance_scale=guidance_scale,
                cfg_schedule_type=cfg_schedule_type, temperature=temperature, speculative=speculative,
                num_draft_tokens=num_draft_tokens, prefill_ratio=prefill_ratio, verify_mode=verify_mode,
                max_residual_tries=max_residual_tries,
            )  # fmt: skip
            return self._generate(labels, params, speculative, guidance_scale != 1.0, trajectory_alignment,
                                  generator, output_type, return_dict, callback_on_step_end, device)  # fmt: skip
        finally:
            for m, diffusion in zip(models, saved_steps, strict=True):
                m.diffloss.gen_diffusion = diffusion

    def _generate(self, labels, params, speculative, guided, trajectory_alignment, generator, output_type, return_dict,
                  callback_on_step_end, device):  # fmt: skip
        # 2. prepare: noise (once per image; the draft's own without trajectory alignment), model runners
        batch, seq_len = labels.numel(), self.transformer.seq_len
        steps = self.transformer.diffloss.num_sampling_steps
        dim = self.transformer.token_embed_dim
        own_draft_noise = speculative and not trajectory_alignment
        noise = ImageNoise.draw(batch, seq_len, dim, steps, generator, device, draft=own_draft_noise)
        target = MARRunner(self.transformer, labels, guided, name="transformer")
        draft = MARRunner(self.draft_transformer, labels, guided, name="draft_transformer") if speculative else None
        self.attach_compiler(target, draft)
        stats = SpecStats(batch, params.num_draft_steps if speculative else 0)
        callback = None
        if callback_on_step_end is not None:

            def callback(step, state):
                callback_on_step_end(self, step, params.num_steps, {"tokens": state.tokens, "visible": state.visible})

        # 3-4. pre-fill + loop (plain: every step by the target)
        with stats.timer("total", device), stats.timer("decode", device):
            with self.progress_bar(total=batch * seq_len) as progress:
                state = decode_masked(target, draft, noise, params, generator=generator, stats=stats,
                                      progress=progress, callback=callback)  # fmt: skip
        # 5. postprocess
        with stats.timer("total", device):
            images = self.postprocess(state.tokens, output_type)
        self._fill_stats(stats, state, speculative, params.num_steps)
        self.maybe_free_model_hooks()
        if not return_dict:
            return images, stats
        return SpeculativeContinuousOutput(images=images, stats=stats, trace=state.trace)

    @staticmethod
    def _fill_stats(stats, state, speculative, num_ar_steps):
        counts = state.trace.counts()
        # one host read for every per-row count
        per_row = torch.stack([
            sum(counts.values()), counts["prefill"], counts["accepted"],
            torch.as_tensor(state.drafted, device=counts["prefill"].device).to(counts["prefill"].dtype),
            state.trace.round.max(1).values + 1,
        ])  # fmt: skip
        fallbacks = torch.as_tensor(state.num_fallbacks, device=per_row.device).to(per_row.dtype).reshape(1)
        flat = torch.cat([per_row.reshape(-1), fallbacks]).tolist()  # one host read for every count
        b = per_row.shape[1]
        generated, prefill, accepted, drafted, rounds = (flat[i * b : (i + 1) * b] for i in range(5))
        num_fallbacks = flat[-1]
        stats.generated_tokens, stats.prefill_tokens, stats.accepted_tokens = generated, prefill, accepted
        stats.drafted_tokens = drafted  # verified drafts (exact: incl. discarded steps)
        stats.rounds = rounds
        drafted = sum(stats.drafted_tokens)
        stats.extra.update(
            acceptance_rate=(sum(stats.accepted_tokens) / drafted) if drafted else None,
            residual_fallbacks=num_fallbacks,
            num_ar_steps=num_ar_steps,
            speculative=speculative,
        )
        stats.finalize()

    def postprocess(self, tokens, output_type):
        """Tokens ``[B, L, D]`` -> the requested output type (images in [0, 1])."""
        if output_type == "latent":
            return tokens
        decoded = self.vae.decode_tokens(tokens.to(self.vae.dtype))
        if not bool(torch.isfinite(decoded).all()):  # one host sync per call (tokens were checked finite)
            raise ValueError(
                "vae produced non-finite images (NaN / inf) from finite tokens: its weights or activations hold "
                "NaN / inf or overflow"
            )
        images = ((decoded.float() + 1) / 2).clamp(0, 1)
        if output_type == "pt":
            return images
        if output_type == "np":
            return images.permute(0, 2, 3, 1).numpy(force=True)
        from mmspec.pipelines.ar_image import to_pil

        return to_pil(images)
