"""The LlamaGen family: GPT (`gpt.py`), VQ-16 tokenizer (`vq.py`), EAGLE head (`eagle.py`), the engine adapter
(`target.py`), official `.pt` checkpoints (`checkpoints.py`) and the t2i text encoder (`text.py`).

The main classes are offered here lazily (`mmspec.models.llamagen.LlamaGenGPT`, the path saved pipelines name)."""

import importlib


_LAZY = {"LlamaGenGPT": "gpt", "LlamaGenVQ": "vq", "EagleHead": "eagle", "LlamaGenTarget": "target"}


def __getattr__(name):
    """The names above, and any other public name of `gpt.py`: `mmspec.models.llamagen` was that module before the
    family folders, and saved pipelines' `model_index.json` (read by diffusers) name it."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY.get(name, 'gpt')}"), name)
