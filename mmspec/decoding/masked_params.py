"""The masked-AR loop's settings (`mmspec.decoding.masked`): `MaskedParams`, one frozen value built once per call
from the pipeline's checked knobs and passed down the loop as one argument, with the MaskGIT / MAR schedules it
holds (`mar_schedule`, `cfg_schedule`). The defaults are the registry's (`mmspec.methods.CONTINUOUS_DEFAULTS`)."""

import math
from dataclasses import dataclass, field

from mmspec.methods import CONTINUOUS_DEFAULTS


__all__ = ["CFG_SCHEDULES", "VERIFY_MODES", "MaskedParams", "cfg_schedule", "mar_schedule"]

VERIFY_MODES = ("block", "exact")
CFG_SCHEDULES = ("linear", "constant")


def mar_schedule(seq_len: int, num_steps: int) -> tuple[list[int], list[int]]:
    """MAR's cosine schedule: tokens revealed per step and the masked count after each step (``mask_len``).

    ``mask_len_s = max(1, min(masked - 1, floor(L cos(pi/2 (s+1)/N))))``; the last step reveals every remaining token
    (upstream ``sample_tokens``)."""
    if not 1 <= num_steps <= seq_len:
        raise ValueError(f"num_ar_steps must be in [1, {seq_len}] (tokens per image), got {num_steps}")
    counts, mask_lens, masked = [], [], seq_len
    for s in range(num_steps):
        mask_len = max(1, min(masked - 1, math.floor(seq_len * math.cos(math.pi / 2 * (s + 1) / num_steps))))
        reveal = masked if s == num_steps - 1 else masked - mask_len
        counts.append(reveal)
        mask_lens.append(mask_len)
        masked -= reveal
    return counts, mask_lens


def cfg_schedule(guidance_scale: float, seq_len: int, mask_lens: list[int], schedule: str = "linear") -> list[float]:
    """Per-step CFG scale: ``"linear"`` (MAR's default: ``1 + (cfg - 1)(L - mask_len)/L``) or ``"constant"``."""
    if schedule == "constant":
        return [float(guidance_scale)] * len(mask_lens)
    if schedule != "linear":
        raise ValueError(f"cfg_schedule must be 'linear' or 'constant', got {schedule!r}")
    return [1 + (guidance_scale - 1) * (seq_len - m) / seq_len for m in mask_lens]


@dataclass(frozen=True)
class MaskedParams:
    """Everything the masked loop reads that stays fixed for a call (the per-call randomness is `ImageNoise`).

    Attributes:
        counts: tokens revealed by each AR step (`mar_schedule`).
        cfg_scales: each step's CFG scale (`cfg_schedule`; 1 = conditional branch only).
        temperature: the diffusion head's noise scale at every stochastic step.
        num_draft_steps: AR steps per CSpD block (K).
        num_prefill_steps: leading steps the target does alone (plain MAR: every step, whatever this says).
        verify_mode: ``"block"`` | ``"exact"`` (`mmspec.decoding.masked`).
        max_residual_tries: acceptance-rejection proposals per rejected token before a plain target draw.
        starts: derived: ``starts[s]`` = tokens revealed before step ``s`` (``len(counts) + 1`` entries).
    """

    counts: tuple[int, ...]
    cfg_scales: tuple[float, ...]
    temperature: float = CONTINUOUS_DEFAULTS["temperature"]
    num_draft_steps: int = CONTINUOUS_DEFAULTS["num_draft_tokens"]
    num_prefill_steps: int = 0
    verify_mode: str = CONTINUOUS_DEFAULTS["verify_mode"]
    max_residual_tries: int = CONTINUOUS_DEFAULTS["max_residual_tries"]
    starts: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self):
        counts, cfg_scales = tuple(self.counts), tuple(self.cfg_scales)
        if len(counts) != len(cfg_scales):
            raise ValueError(f"cfg_scales must have one scale per AR step ({len(counts)}), got {len(cfg_scales)}")
        if self.verify_mode not in VERIFY_MODES:
            raise ValueError(f"verify_mode must be one of {VERIFY_MODES}, got {self.verify_mode!r}")
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "cfg_scales", cfg_scales)
        object.__setattr__(self, "starts", tuple(starts))

    @property
    def num_steps(self) -> int:
        """AR steps of the schedule."""
        return len(self.counts)

    @classmethod
    def from_knobs(cls, seq_len: int, *, num_ar_steps: int, guidance_scale: float, cfg_schedule_type: str,
                   temperature: float, speculative: bool, num_draft_tokens: int, prefill_ratio: float,
                   verify_mode: str, max_residual_tries: int) -> "MaskedParams":  # fmt: skip
        """The settings from a continuous pipeline's (checked) call knobs: MAR's cosine schedule of ``num_ar_steps``
        over ``seq_len`` tokens, its CFG schedule, and (CSpD) ``max(1, round(prefill_ratio * num_ar_steps))``
        pre-fill steps."""
        counts, mask_lens = mar_schedule(seq_len, num_ar_steps)
        return cls(
            counts=counts,
            cfg_scales=cfg_schedule(guidance_scale, seq_len, mask_lens, cfg_schedule_type),
            temperature=temperature,
            num_draft_steps=num_draft_tokens,
            num_prefill_steps=max(1, round(prefill_ratio * num_ar_steps)) if speculative else num_ar_steps,
            verify_mode=verify_mode,
            max_residual_tries=max_residual_tries,
        )
