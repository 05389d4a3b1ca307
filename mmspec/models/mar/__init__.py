"""The MAR family: MAR (`model.py`), its diffusion head and injected-noise sampler (`diffloss.py`, `diffusion.py`),
the KL autoencoder (`kl_vae.py`), official checkpoints (`checkpoints.py`) and the masked loop's adapter
(`runner.py`).

The main classes are offered here lazily (`mmspec.models.mar.MAR`, the path saved pipelines name)."""

import importlib


_LAZY = {"MAR": "model", "MAR_PRESETS": "model", "AutoencoderKL": "kl_vae", "DiffLossHead": "diffloss"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
