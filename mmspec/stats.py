"""Speed statistics shared by every speculative pipeline and by the benchmarks.

Conventions (both are reported, since papers disagree):
- `mean_accepted_length` counts the bonus/correction token: tokens emitted per verification round
  (EAGLE's and Spec-Bench's tau; plain AR decoding has 1.0).
- `mean_accepted_drafts` excludes it (gpt-fast's "Mean Accepted"; plain AR has 0.0).
- `step_compression` = tokens generated per row / target forwards, counted over the whole generation *including* the
  prefill forward (which emits the first token; plain AR decoding has exactly 1.0). A CFG forward of both streams
  counts as one target forward.

Rounds are logged as tensor references during decoding (no work and no host sync per round) and added up into
plain lists by `finalize()`, which the pipelines call before returning.

Timing: `time_prefill_s`, `time_decode_s` and `time_total_s` are measured once per call. The per-round phases
(`time_draft_s`, `time_verify_s`) need a device sync at each phase boundary (six per round on CUDA), so they are
opt-in: `SpecStats(..., time_phases=True)`; without it the loop's rounds are not timed and both fields are None
(absent from the report, not zeros).
"""

import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class SpecStats:
    """Per-call counters: one instance per pipeline call, filled round by round.

    Args:
        batch_size: number of generated sequences (rows), CFG streams not counted.
        num_draft_tokens: the draft budget K per round (sizes the acceptance histogram).
        extra: method-specific fields (e.g. residual fallbacks of a continuous rule), reported as they are.
        time_phases: time the decoding loop's per-round phases (`time_draft_s`, `time_verify_s`; a CUDA sync on
            entry and exit of each phase). Off by default, so the hot loop keeps its one host sync per round; the
            phase times are then None.
    """

    batch_size: int
    num_draft_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted_tokens: list[int] = field(default_factory=list)  # [B] draft tokens proposed to the verifier
    accepted_tokens: list[int] = field(default_factory=list)  # [B] accepted draft tokens (bonus excluded)
    generated_tokens: list[int] = field(default_factory=list)  # [B] tokens committed to the output
    prefill_tokens: list[int] = field(default_factory=list)  # [B] tokens the target emitted outside rounds
    rounds: list[int] = field(default_factory=list)  # [B] verification rounds the row took part in
    accept_histogram: list[int] = field(default_factory=list)  # [K+1] rounds with exactly k accepted drafts
    time_prefill_s: float = 0.0
    time_draft_s: float | None = None  # None unless time_phases
    time_verify_s: float | None = None  # None unless time_phases
    time_decode_s: float = 0.0
    time_total_s: float = 0.0
    extra: dict = field(default_factory=dict)
    time_phases: bool = False

    def __post_init__(self):
        if not isinstance(self.time_phases, bool):
            raise TypeError(f"time_phases must be a bool, got {self.time_phases!r}")
        if self.time_phases:
            self.time_draft_s = self.time_draft_s or 0.0
            self.time_verify_s = self.time_verify_s or 0.0
        b, k = self.batch_size, self.num_draft_tokens
        self.drafted_tokens = self.drafted_tokens or [0] * b
        self.accepted_tokens = self.accepted_tokens or [0] * b
        self.generated_tokens = self.generated_tokens or [0] * b
        self.prefill_tokens = self.prefill_tokens or [0] * b
        self.rounds = self.rounds or [0] * b
        self.accept_histogram = self.accept_histogram or [0] * (k + 1)
        self._rounds_log = []  # per round: (rows, drafted, accepted, generated) tensors, summed by finalize()

    def record_prefill(self, num_tokens=1):
        """The prefill forward: one target forward that emits `num_tokens` per row, not a verification round."""
        self.target_forwards += 1
        for b in range(self.batch_size):
            self.generated_tokens[b] += num_tokens
            self.prefill_tokens[b] += num_tokens

    def record_round(self, num_drafted, num_accepted, num_generated, rows=None):
        """Record one verification round: `[B']` tensors, one entry per row that took part; `rows [B']` are the
        batch rows they belong to (default `0 .. B-1`; pipelines that compact finished rows away pass the survivors'
        ids). `num_generated` is what the row committed this round (accepted drafts + the next token, fewer when
        the sequence ends). Logged as tensor references (no work, no host sync); `finalize()` adds them up."""
        if rows is None:
            accepted = torch.as_tensor(num_accepted)
            rows = torch.arange(accepted.numel(), device=accepted.device)
        self._rounds_log.append((rows, num_drafted, num_accepted, num_generated))

    def finalize(self):
        """Add the logged rounds into the list fields (one host sync). Idempotent."""
        if not self._rounds_log:
            return self
        log, self._rounds_log = self._rounds_log, []
        rows, drafted, accepted, generated = (
            torch.cat([torch.as_tensor(x[i]).reshape(-1) for x in log]) for i in range(4)
        )  # fmt: skip
        device = accepted.device
        sums = torch.zeros(4, self.batch_size, dtype=torch.long, device=device)
        for i, value in enumerate((drafted, accepted, generated, torch.ones_like(accepted))):
            sums[i].index_add_(0, rows.to(device), value.to(device).long())
        bins = len(self.accept_histogram)
        hist = torch.zeros(bins, dtype=torch.long, device=device)  # a bincount without its data-dependent length
        hist.index_add_(0, accepted.long().clamp(max=bins - 1).to(device), torch.ones_like(accepted, dtype=torch.long))
        values = torch.cat([sums.reshape(-1), hist]).tolist()  # the one host read
        for i, attr in enumerate(("drafted_tokens", "accepted_tokens", "generated_tokens", "rounds")):
            add = values[i * self.batch_size : (i + 1) * self.batch_size]
            setattr(self, attr, [a + b for a, b in zip(getattr(self, attr), add)])
        self.accept_histogram = [a + b for a, b in zip(self.accept_histogram, values[4 * self.batch_size :])]
        return self

    def phase(self, phase, device=None):
        """Time one per-round phase of the decoding loop (`"draft"`, `"verify"`) into `time_<phase>_s` when
        `time_phases` is on (a `timer`, syncing CUDA around the block); otherwise a no-op: no sync, no clock."""
        return self.timer(phase, device) if self.time_phases else nullcontext()

    @contextmanager
    def timer(self, phase, device=None):
        """Accumulate wall time of a block into `time_<phase>_s` (synchronising CUDA around it). For once-per-call
        spans (prefill, decode, total); the loop's per-round phases go through `phase`."""
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            attr = f"time_{phase}_s"
            setattr(self, attr, (getattr(self, attr) or 0.0) + time.perf_counter() - start)

    @property
    def mean_accepted_length(self):
        """Tokens emitted per verification round (bonus included; fewer only where a sequence ended)."""
        self.finalize()
        rounds = sum(self.rounds)
        return (sum(self.generated_tokens) - sum(self.prefill_tokens)) / rounds if rounds else 0.0

    @property
    def mean_accepted_drafts(self):
        self.finalize()
        rounds = sum(self.rounds)
        return sum(self.accepted_tokens) / rounds if rounds else 0.0

    @property
    def acceptance_rate(self):
        self.finalize()
        drafted = sum(self.drafted_tokens)
        return sum(self.accepted_tokens) / drafted if drafted else 0.0

    @property
    def step_compression(self):
        """Tokens generated per row / target forwards (each forward serves every row at once; prefill included)."""
        self.finalize()
        if not self.target_forwards:
            return 0.0
        return sum(self.generated_tokens) / self.batch_size / self.target_forwards

    def to_dict(self):
        self.finalize()
        out = {k: v for k, v in asdict(self).items()}
        out.update(
            mean_accepted_length=self.mean_accepted_length,
            mean_accepted_drafts=self.mean_accepted_drafts,
            acceptance_rate=self.acceptance_rate,
            step_compression=self.step_compression,
        )
        return out
