"""The Janus family (transformers `JanusForConditionalGeneration`, Janus / Janus-Pro): image generation on the engine
(`target.py`), the zoo's word-level prompt processor (`processor.py`) and LlamaGen VQ -> `JanusVQVAE` (`vq.py`)."""

from mmspec.models import family_getattr


_LAZY = {"JanusTarget": "target", "special_token_ids": "target"}


# the names above, and any other public name of `target.py` (what `mmspec.models.janus` was before the family folders)
__getattr__ = family_getattr(__name__, _LAZY, "target")
