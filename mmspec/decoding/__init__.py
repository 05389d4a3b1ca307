"""The decoding engine shared by every pipeline: one loop over a target adapter, a drafter and an acceptance rule.

* `Guidance` (`guidance.py`): CFG row layout (`[cond; uncond]` only when guidance is on) and distribution processing.
* `SequenceState` (`state.py`): the ragged batch being extended (max length and EOS stopping, compaction of finished
  rows with their per-row generators, the whole grid on demand).
* `DecodeTrace` (`trace.py`): per emitted token, the round and its origin (prefill / accepted / resampled / bonus).
* `Target`, `TargetOutput` (`target.py`): what the loop needs from a target model.
* `decode` (`loop.py`): draft -> score -> verify -> commit -> emit, plain AR being the no-drafter case.

Drafters implement `mmspec.decoding.drafter.Drafter`; acceptance rules are `mmspec.verify` rule objects.
"""

from mmspec.decoding.guidance import Guidance
from mmspec.decoding.loop import decode, verify_proposal
from mmspec.decoding.state import SequenceState
from mmspec.decoding.target import Target, TargetOutput
from mmspec.decoding.trace import ACCEPTED, BONUS, NONE, ORIGINS, PREFILL, RESAMPLED, DecodeTrace


__all__ = [
    "ACCEPTED",
    "BONUS",
    "NONE",
    "ORIGINS",
    "PREFILL",
    "RESAMPLED",
    "DecodeTrace",
    "Guidance",
    "SequenceState",
    "Target",
    "TargetOutput",
    "decode",
    "verify_proposal",
]
