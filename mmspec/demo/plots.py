"""The acceptance histogram of a speculative run: how many verification rounds accepted exactly k drafts."""

import numpy as np
from matplotlib.figure import Figure

from mmspec.decoding.trace import ACCEPTED, PREFILL


__all__ = ["accepted_per_round", "histogram_figure"]


def accepted_per_round(trace, row=0):
    """`[rounds]` int: accepted drafts in each verification round of batch row `row` (rounds with a generated token,
    prefill excluded), read from the trace; `np.bincount` of it is the acceptance histogram."""
    rounds = trace.round[row].detach().cpu().numpy().astype(np.int64)
    origins = trace.origin[row].detach().cpu().numpy().astype(np.int64)
    verified = (rounds >= 0) & (origins != PREFILL)
    present = np.unique(rounds[verified])
    return np.array([int(((rounds == r) & (origins == ACCEPTED)).sum()) for r in present], dtype=np.int64)


def histogram_figure(counts, title="acceptance histogram", xlabel="drafts accepted in a round"):
    """A matplotlib `Figure` with one bar per k (accepted drafts per round), height = rounds; `counts[k]`."""
    counts = np.asarray(counts, dtype=np.int64)
    fig = Figure(figsize=(4.2, 2.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.bar(np.arange(counts.size), counts, color="#3b75af")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("rounds")
    ax.set_xticks(np.arange(counts.size))
    ax.set_title(title, fontsize=10)
    return fig
