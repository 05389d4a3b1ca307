"""The Janus family (transformers `JanusForConditionalGeneration`, Janus / Janus-Pro): image generation on the engine
(`target.py`), the zoo's word-level prompt processor (`processor.py`) and LlamaGen VQ -> `JanusVQVAE` (`vq.py`)."""

import importlib


_LAZY = {"JanusTarget": "target", "special_token_ids": "target"}


def __getattr__(name):
    """The names above, and any other public name of `target.py`: `mmspec.models.janus` was that module before the
    family folders, and saved pipelines' `model_index.json` (read by diffusers) name it."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY.get(name, 'target')}"), name)
