"""Generic test fixtures (keep small; shared by all test modules).

Tests are grouped by subject in folders (`core/`, `verify/`, `decoding/`, `models/`, `drafters/`, `pipelines/`,
`eval/`, `cli/`, `demo/`, `train/`); the modules beside this file are shared by all of them: `factories.py` (tiny
models, one `tiny_gpt`), `pipeline_mixin.py` (the contract every pipeline passes), `janus_fixtures.py`,
`vlm_fixtures.py`, `vision_seam_fixtures.py`, `readme_*.py`. A test module may reuse another subject's helpers by
module name (`from test_pipeline_vlm import make_pipe`): every subject folder is on `sys.path`.

The fast local loop skips the long statistical and end-to-end tests: `python -m pytest -q -n 2 -m "not slow"`;
CI runs everything.
"""

import sys
from pathlib import Path

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


HERE = Path(__file__).resolve().parent
for _folder in sorted(p for p in HERE.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# Each pytest-xdist worker gets one torch thread: two workers x two threads on two cores slows small ops ~10x.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Back to one torch thread after every test: commands run in-process with `--threads N` (or a trainer's default
    of 2) set it for the whole worker, and every later test of that worker ran N-threaded (4-6x slower on a shared
    2-core host)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
