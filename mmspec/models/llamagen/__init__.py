"""The LlamaGen family: GPT (`gpt.py`), VQ-16 tokenizer (`vq.py`), EAGLE head (`eagle.py`), the engine adapter
(`target.py`), official `.pt` checkpoints (`checkpoints.py`) and the t2i text encoder (`text.py`).

The main classes are offered here lazily (`mmspec.models.llamagen.LlamaGenGPT`, the path saved pipelines name)."""

from mmspec.models import family_getattr


_LAZY = {"LlamaGenGPT": "gpt", "LlamaGenVQ": "vq", "EagleHead": "eagle", "LlamaGenTarget": "target"}


# the names above, and any other public name of `gpt.py` (what `mmspec.models.llamagen` was before the family folders)
__getattr__ = family_getattr(__name__, _LAZY, "gpt")
