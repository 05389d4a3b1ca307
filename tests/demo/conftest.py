"""The demo tests' shared fixture: one `PipelineCache` per test process, so `test_demo.py` (the handlers, called
directly) and `test_demo_served.py` (the served app) load each zoo pipeline once between them, not once each."""

import pytest
import torch

from mmspec.demo.models import PipelineCache


@pytest.fixture(scope="session")
def demo_cache():
    """The shipped zoo's pipelines, loaded on first use and kept for the session (the demo never changes them)."""
    torch.set_num_threads(1)
    return PipelineCache()
