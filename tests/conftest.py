"""Generic test fixtures (keep small; shared by all test modules)."""

import numpy as np
import pytest
import torch
from scipy import stats


@pytest.fixture
def make_generator():
    """``make_generator(seed)`` -> a seeded CPU ``torch.Generator`` (tests never use the global RNG)."""

    def make(seed: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    return make


@pytest.fixture
def chi2_pvalue():
    """``chi2_pvalue(samples, probs)``: chi-square goodness-of-fit p-value of integer samples against ``probs``.

    Cells with expected count < 5 are pooled into one cell; observations in zero-probability cells give p = 0.
    """

    def pvalue(samples: torch.Tensor, probs) -> float:
        probs = np.asarray(probs, dtype=np.float64).ravel()
        counts = np.bincount(np.asarray(samples).ravel(), minlength=probs.size).astype(np.float64)
        if counts.size > probs.size or counts[probs == 0].sum() > 0:
            return 0.0
        expected = probs * counts.sum()
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        keep = exp > 0
        if keep.sum() < 2:  # a single cell: all mass where expected
            return 1.0
        return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)

    return pvalue


# Each pytest-xdist worker gets one torch thread: two workers x two threads on two cores slows small ops ~10x.
torch.set_num_threads(1)
