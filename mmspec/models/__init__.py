"""Models, one folder per family, and the strict loader.

* `llamagen/`: the LlamaGen GPT (`gpt.py`), its VQ tokenizer, EAGLE head, engine adapter (`target.py`), official
  checkpoints and t2i text encoder.
* `mar/`: MAR (`model.py`), its diffusion head and sampler, the KL autoencoder, official checkpoints, and the masked
  loop's adapter (`runner.py`).
* `janus/`: transformers Janus / Janus-Pro image generation on the engine, the zoo's prompt processor and VQ.
* `hf/`: transformers targets on the static cache (`target.py`), the merged image inputs, draft LMs, the text EAGLE
  head, SmolLM2 and the zoo's LLaVA.
* shared: `loading.py` (`load`, `read_config`, the class allow-list), `config_fields.py`, `layout.py`,
  `classifier.py`.

`import mmspec.models` is cheap (no torch). Module paths from before the family folders (`mmspec.models.vq`,
`mmspec.models.hf_eagle`, ...: saved pipelines' `model_index.json` name them) still import, as aliases of the new
modules (`MOVED`).
"""

import importlib
import importlib.abc
import importlib.util
import sys

from mmspec.models.loading import (
    DEFAULT_ZOO,
    MODEL_CLASSES,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    ZOO_PARTS,
    ZOO_REQUIRED,
    check_weights,
    load,
    read_config,
    zoo_folders,
)


__all__ = ["DEFAULT_ZOO", "MODEL_CLASSES", "MOVED", "family_getattr", "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "ZOO_PARTS",
           "ZOO_REQUIRED", "check_weights", "load", "read_config", "zoo_folders"]  # fmt: skip

# module path before the family folders -> where it lives now
MOVED = {
    "mmspec.models.checkpoints": "mmspec.models.llamagen.checkpoints",
    "mmspec.models.llamagen_target": "mmspec.models.llamagen.target",
    "mmspec.models.eagle": "mmspec.models.llamagen.eagle",
    "mmspec.models.vq": "mmspec.models.llamagen.vq",
    "mmspec.models.text": "mmspec.models.llamagen.text",
    "mmspec.models.mar_checkpoints": "mmspec.models.mar.checkpoints",
    "mmspec.models.diffloss": "mmspec.models.mar.diffloss",
    "mmspec.models.diffusion": "mmspec.models.mar.diffusion",
    "mmspec.models.kl_vae": "mmspec.models.mar.kl_vae",
    "mmspec.models.janus_processor": "mmspec.models.janus.processor",
    "mmspec.models.janus_vq": "mmspec.models.janus.vq",
    "mmspec.models.hf_draft": "mmspec.models.hf.draft",
    "mmspec.models.hf_eagle": "mmspec.models.hf.eagle",
    "mmspec.models.vlm_inputs": "mmspec.models.hf.inputs",
    "mmspec.models.vlm_zoo": "mmspec.models.hf.zoo",
    "mmspec.models.smollm2": "mmspec.models.hf.smollm2",
    "mmspec.models.vision_eagle": "mmspec.drafters.vision_eagle",
}


def family_getattr(package, lazy, former):
    """A family package's module `__getattr__`: `lazy` maps names to the submodule that defines them; any other
    public name comes from `former`, the module the package was before the family folders (saved pipelines'
    `model_index.json`, read by diffusers, name that path)."""

    def __getattr__(name):
        if name.startswith("_"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{lazy.get(name, former)}"), name)

    return __getattr__


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a `MOVED` module path as the module that now holds its code (the same object)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
