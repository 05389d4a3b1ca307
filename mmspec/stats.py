"""Speed statistics shared by every speculative pipeline and by the benchmarks.

Conventions (both are reported, since papers disagree):
- `mean_accepted_length` counts the bonus/correction token: tokens emitted per verification round
  (EAGLE's and Spec-Bench's tau; plain AR decoding has 1.0).
- `mean_accepted_drafts` excludes it (gpt-fast's "Mean Accepted"; plain AR has 0.0).
- `step_compression` = tokens generated / target forwards (the AR-image papers' name for tau, counted over
  the whole generation, prefill excluded). A CFG forward of both streams counts as one target forward.
"""

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class SpecStats:
    """Per-call counters: one instance per pipeline call, filled round by round.

    Args:
        batch_size: number of generated sequences (rows), CFG streams not counted.
        num_draft_tokens: the draft budget K per round (sizes the acceptance histogram).
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
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_decode_s: float = 0.0
    time_total_s: float = 0.0

    def __post_init__(self):
        b, k = self.batch_size, self.num_draft_tokens
        self.drafted_tokens = self.drafted_tokens or [0] * b
        self.accepted_tokens = self.accepted_tokens or [0] * b
        self.generated_tokens = self.generated_tokens or [0] * b
        self.prefill_tokens = self.prefill_tokens or [0] * b
        self.rounds = self.rounds or [0] * b
        self.accept_histogram = self.accept_histogram or [0] * (k + 1)

    def record_prefill(self, num_tokens=1):
        """The prefill forward: one target forward that emits `num_tokens` per row, not a verification round."""
        self.target_forwards += 1
        for b in range(self.batch_size):
            self.generated_tokens[b] += num_tokens
            self.prefill_tokens[b] += num_tokens

    def record_round(self, num_drafted, num_accepted, num_generated, active=None, rows=None):
        """Record one verification round (tensors or lists, one entry per row that took part).

        `num_generated` is what the row committed this round (accepted drafts + the next token, fewer when the
        sequence ends); `active` masks rows that did not take part (finished rows); `rows` are the batch rows the
        entries belong to (default `0 .. B-1`; pipelines that compact finished rows away pass the survivors' ids).
        """
        drafted, accepted, generated = (
            torch.as_tensor(x).tolist() for x in (num_drafted, num_accepted, num_generated)
        )
        rows = list(range(self.batch_size)) if rows is None else torch.as_tensor(rows).tolist()
        active = [True] * len(rows) if active is None else torch.as_tensor(active).tolist()
        for i, b in enumerate(rows):
            if not active[i]:
                continue
            self.drafted_tokens[b] += drafted[i]
            self.accepted_tokens[b] += accepted[i]
            self.generated_tokens[b] += generated[i]
            self.rounds[b] += 1
            k = min(accepted[i], len(self.accept_histogram) - 1)
            self.accept_histogram[k] += 1

    @contextmanager
    def timer(self, phase, device=None):
        """Accumulate wall time of a block into `time_<phase>_s` (synchronising CUDA around it)."""
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            attr = f"time_{phase}_s"
            setattr(self, attr, getattr(self, attr) + time.perf_counter() - start)

    @property
    def mean_accepted_length(self):
        """Tokens emitted per verification round (bonus included; fewer only where a sequence ended)."""
        rounds = sum(self.rounds)
        return (sum(self.generated_tokens) - sum(self.prefill_tokens)) / rounds if rounds else 0.0

    @property
    def mean_accepted_drafts(self):
        rounds = sum(self.rounds)
        return sum(self.accepted_tokens) / rounds if rounds else 0.0

    @property
    def acceptance_rate(self):
        drafted = sum(self.drafted_tokens)
        return sum(self.accepted_tokens) / drafted if drafted else 0.0

    @property
    def step_compression(self):
        """Tokens generated per row / target forwards (each forward serves every row at once)."""
        if not self.target_forwards:
            return 0.0
        return sum(self.generated_tokens) / self.batch_size / self.target_forwards

    def to_dict(self):
        out = asdict(self)
        out.update(
            mean_accepted_length=self.mean_accepted_length,
            mean_accepted_drafts=self.mean_accepted_drafts,
            acceptance_rate=self.acceptance_rate,
            step_compression=self.step_compression,
        )
        return out
