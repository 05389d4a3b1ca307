"""transformers targets: causal LMs and LLaVA-family VLMs on the static KV cache (`target.py`), the decoder's merged
image inputs (`inputs.py`), layer-truncated draft LMs (`draft.py`), the text EAGLE head (`eagle.py`), SmolLM2-135M
from its GGUF (`smollm2.py`) and the zoo's LLaVA (`zoo.py`)."""

from mmspec.models import family_getattr


_LAZY = {"HFTarget": "target", "StaticCache": "target", "Positions": "target", "TextEagleHead": "eagle"}


# the names above, and any other public name of `target.py` (what `mmspec.models.hf` was before the family folders)
__getattr__ = family_getattr(__name__, _LAZY, "target")
