"""transformers targets: causal LMs and LLaVA-family VLMs on the static KV cache (`target.py`), the decoder's merged
image inputs (`inputs.py`), layer-truncated draft LMs (`draft.py`), the text EAGLE head (`eagle.py`), SmolLM2-135M
from its GGUF (`smollm2.py`) and the zoo's LLaVA (`zoo.py`)."""

import importlib


_LAZY = {"HFTarget": "target", "StaticCache": "target", "Positions": "target", "TextEagleHead": "eagle"}


def __getattr__(name):
    """The names above, and any other public name of `target.py`: `mmspec.models.hf` was that module before the
    family folders, and saved pipelines' `model_index.json` (read by diffusers) name it."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY.get(name, 'target')}"), name)
