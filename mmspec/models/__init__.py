"""Model code: LlamaGen-family GPT, VQ tokenizer, MNIST classifier, EAGLE head, and the model loader.

Every zoo model is a diffusers `ModelMixin, ConfigMixin`, so a zoo folder is a plain diffusers model folder
(`config.json` with `_class_name` + `diffusion_pytorch_model.safetensors`) and pipelines can register it.
`load(path)` picks the class from `config.json` and refuses anything it does not know: zoo classes come from the
`MODEL_CLASSES` allow-list; transformers model folders (`config.json` with `model_type`, no `_class_name`) load
with transformers' own classes only (`trust_remote_code=False`, local files, safetensors weights).
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
    "EagleHead": "mmspec.models.eagle",
}
# where a class lived before it moved: used only while its `MODEL_CLASSES` module does not exist
_FORMER_MODULES = {"EagleHead": "mmspec.drafters.eagle"}


def _zoo_class(class_name):
    module_name = MODEL_CLASSES[class_name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name or class_name not in _FORMER_MODULES:
            raise
        module = importlib.import_module(_FORMER_MODULES[class_name])
    return getattr(module, class_name)


def _transformers_class(config):
    """The transformers class for `config`: a VLM (image-text-to-text) loads as the architecture its config names
    (if transformers has it) or `AutoModelForImageTextToText`, a causal LM as `AutoModelForCausalLM`, anything else
    as the architecture its config names or `AutoModel`."""
    import transformers
    from transformers.models.auto import modeling_auto

    named = [getattr(transformers, a, None) for a in (getattr(config, "architectures", None) or [])]
    named = [c for c in named if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)]
    architecture = named[0] if named else None
    model_type = config.model_type
    if model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return architecture or transformers.AutoModelForImageTextToText
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return architecture or transformers.AutoModel


def _load_transformers(folder, path, dtype):
    import torch
    from safetensors import SafetensorError
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"path={str(path)!r}: not a model type transformers knows ({err})") from err
    cls = _transformers_class(config)
    try:
        model, info = cls.from_pretrained(
            folder,
            config=config,
            trust_remote_code=False,
            local_files_only=True,
            use_safetensors=True,
            dtype=dtype or torch.float32,
            output_loading_info=True,
        )
    except (OSError, RuntimeError, ValueError, KeyError, SafetensorError) as err:
        raise ValueError(f"path={str(path)!r}: cannot load {cls.__name__} weights: {err}") from err
    problems = {k: sorted(map(str, v)) for k, v in info.items() if v}  # missing / unexpected / mismatched keys
    if problems:
        raise ValueError(f"path={str(path)!r}: weights do not match the {type(model).__name__} config: {problems}")
    return model


def load(path, device=None, dtype=None):
    """Load a zoo model folder (e.g. `mmspec.models.load("assets/mnist-c2i")`) or a transformers model folder.

    Args:
        path: folder holding `config.json` and the safetensors weights: a zoo folder (`_class_name` in the config,
            `diffusion_pytorch_model.safetensors`) or a transformers folder (`model_type` in the config,
            `model.safetensors` or shards); see the module docstring for which classes can load.
        device: optional device to move the model to.
        dtype: optional dtype (default: float32, whatever the stored dtype).

    Returns:
        the model, in eval mode.

    Raises:
        ValueError: `path` is not a model folder, names an unknown class or model type, or holds a corrupt /
            mismatched / missing weights file.
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
    if not isinstance(config, dict):
        raise ValueError(f"path={str(path)!r}: config.json is not a JSON object")
    class_name = config.get("_class_name")
    if class_name is None and "model_type" in config:
        model = _load_transformers(folder, path, dtype)
        if device is not None:
            model.to(device)
        return model.eval()
    if class_name not in MODEL_CLASSES:
        raise ValueError(
            f"path={str(path)!r}: config.json names _class_name={class_name!r} and no transformers model_type; "
            f"known zoo classes: {sorted(MODEL_CLASSES)}"
        )
    cls = _zoo_class(class_name)
    try:
        model = cls.from_pretrained(folder, low_cpu_mem_usage=False)
    except (OSError, RuntimeError, KeyError) as err:
        raise ValueError(f"path={str(path)!r}: cannot load {class_name} weights: {err}") from err
    # plain nn.Module.to: ModelMixin.to warns about dtype casts that are intended here (fp16 storage -> fp32)
    torch.nn.Module.to(model, device=device, dtype=dtype or torch.float32)
    return model.eval()
