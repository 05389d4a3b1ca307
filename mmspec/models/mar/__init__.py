"""The MAR family: MAR (`model.py`), its diffusion head and injected-noise sampler (`diffloss.py`, `diffusion.py`),
the KL autoencoder (`kl_vae.py`), official checkpoints (`checkpoints.py`) and the masked loop's adapter
(`runner.py`).

The main classes are offered here lazily (`mmspec.models.mar.MAR`, the path saved pipelines name)."""

import importlib


_LAZY = {"MAR": "model", "MAR_PRESETS": "model", "AutoencoderKL": "kl_vae", "DiffLossHead": "diffloss"}


def __getattr__(name):
    """The names above, and any other public name of `model.py`: `mmspec.models.mar` was that module before the
    family folders, and saved pipelines' `model_index.json` (read by diffusers) name it."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY.get(name, 'model')}"), name)
