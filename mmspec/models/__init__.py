"""Model code: LlamaGen-family GPT, VQ tokenizer, MNIST classifier, and the zoo loader.

Every model is a diffusers `ModelMixin, ConfigMixin`, so a zoo folder is a plain diffusers model folder
(`config.json` with `_class_name` + `diffusion_pytorch_model.safetensors`) and pipelines can register it.
`load(path)` picks the class from `config.json` and refuses anything it does not know.
"""

import importlib
import json
import logging
from pathlib import Path


logger = logging.getLogger(__name__)

# `_class_name` in config.json -> defining module. Only these classes are ever instantiated from disk.
MODEL_CLASSES = {
    "LlamaGenGPT": "mmspec.models.llamagen",
    "LlamaGenVQ": "mmspec.models.vq",
    "MNISTClassifier": "mmspec.models.classifier",
    "EagleHead": "mmspec.drafters.eagle",
}


def load(path, device=None, dtype=None):
    """Load a zoo model folder (e.g. `mmspec.models.load("assets/mnist-c2i")`).

    Args:
        path: folder holding `config.json` and `diffusion_pytorch_model.safetensors`.
        device: optional device to move the model to.
        dtype: optional dtype (default: float32, whatever the stored dtype).

    Raises:
        ValueError: `path` is not a model folder, names an unknown class, or holds a corrupt/mismatched file.
    """
    import torch

    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"path={str(path)!r} is not a model folder: no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"path={str(path)!r}: config.json is not valid JSON ({err})") from err
    class_name = config.get("_class_name")
    if class_name not in MODEL_CLASSES:
        raise ValueError(
            f"path={str(path)!r}: config.json names _class_name={class_name!r}; known: {sorted(MODEL_CLASSES)}"
        )
    cls = getattr(importlib.import_module(MODEL_CLASSES[class_name]), class_name)
    try:
        model = cls.from_pretrained(folder, low_cpu_mem_usage=False)
    except (OSError, RuntimeError, KeyError) as err:
        raise ValueError(f"path={str(path)!r}: cannot load {class_name} weights: {err}") from err
    # plain nn.Module.to: ModelMixin.to warns about dtype casts that are intended here (fp16 storage -> fp32)
    torch.nn.Module.to(model, device=device, dtype=dtype or torch.float32)
    return model.eval()
