"""The MAR family: MAR (`model.py`), its diffusion head and injected-noise sampler (`diffloss.py`, `diffusion.py`),
the KL autoencoder (`kl_vae.py`), official checkpoints (`checkpoints.py`) and the masked loop's adapter
(`runner.py`).

The main classes are offered here lazily (`mmspec.models.mar.MAR`, the path saved pipelines name)."""

from mmspec.models import family_getattr


_LAZY = {"MAR": "model", "MAR_PRESETS": "model", "AutoencoderKL": "kl_vae", "DiffLossHead": "diffloss"}


# the names above, and any other public name of `model.py` (what `mmspec.models.mar` was before the family folders)
__getattr__ = family_getattr(__name__, _LAZY, "model")
