"""The Janus family (transformers `JanusForConditionalGeneration`, Janus / Janus-Pro): image generation on the engine
(`target.py`), the zoo's word-level prompt processor (`processor.py`) and LlamaGen VQ -> `JanusVQVAE` (`vq.py`)."""

import importlib


_LAZY = {"JanusTarget": "target", "special_token_ids": "target"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
