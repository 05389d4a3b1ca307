"""Model code: LlamaGen-family GPT, VQ tokenizer, KL autoencoder (MAR), MNIST classifier, EAGLE head, and the loader.

Every zoo model is a diffusers `ModelMixin, ConfigMixin`, so a zoo folder is a plain diffusers model folder
(`config.json` with `_class_name` + `diffusion_pytorch_model.safetensors`) and pipelines can register it.
`load(path)` picks the class from `config.json` and refuses anything it does not know: zoo classes come from the
`MODEL_CLASSES` allow-list; transformers model folders (`config.json` with `model_type`, no `_class_name`) load
with transformers' own classes only (`trust_remote_code=False`, local files, safetensors weights).

Loading is strict and checks before it builds: `read_config(path)` refuses unknown config fields and fields of the
wrong type or range (rules in `mmspec.models.config_fields`, no torch needed); the weights must then hold exactly the
tensors the config gives, with its shapes and finite values (no key missing, none unexpected, nothing randomly
initialised). Every failure is a `ValueError` naming the folder and the field or key.
"""

import importlib
import json
import logging
from pathlib import Path

from mmspec.data.zoo import DEFAULT_ZOO  # the shipped zoo: the default root of every `from_zoo`


logger = logging.getLogger(__name__)


class _NoEmptyFloat32Warning(logging.Filter):
    """diffusers' `ModelMixin.to(dtype)` warns "There are modules in X that should be kept in float32: []" for every
    model, also when the list is empty (`_keep_in_fp32_modules or []` is never None); none of ours keeps any module in
    float32, so that message is noise and is dropped (a non-empty list still warns)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32: []" not in record.getMessage()


logging.getLogger("diffusers.models.modeling_utils").addFilter(_NoEmptyFloat32Warning())

# `_class_name` in config.json -> defining module. Only these classes are ever instantiated from disk.
MODEL_CLASSES = {
    "LlamaGenGPT": "mmspec.models.llamagen.gpt",
    "LlamaGenVQ": "mmspec.models.llamagen.vq",
    "AutoencoderKL": "mmspec.models.mar.kl_vae",
    "MNISTClassifier": "mmspec.models.classifier",
    "EagleHead": "mmspec.models.llamagen.eagle",
    "MAR": "mmspec.models.mar.model",
    "TextEagleHead": "mmspec.models.hf.eagle",
    "Eagle3Head": "mmspec.models.hf.eagle3",
    "VisionEagleHead": "mmspec.drafters.vision_eagle",
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


def quantised_state(folder, path=None):
    """The dequantised `{name: tensor}` of a transformers folder whose `model.safetensors` (or shards) hold int8 /
    int4 storage (`mmspec.models.storage`), or None for a plain folder (transformers reads it itself). Load it with
    `cls.from_pretrained(None, config=config, state_dict=state)` (transformers' own key checks still apply)."""
    from mmspec.models.storage import METADATA_KEY, read_weights

    path = folder if path is None else path

    files = sorted(Path(folder).glob("model*.safetensors"))
    if not files or not any(METADATA_KEY in _metadata(f, path) for f in files):
        return None
    state = {}
    for file in files:
        state.update(read_weights(file, label=f"{_where(path)}: cannot read {file.name}"))
    return state


def _metadata(file, path):
    from safetensors import safe_open

    try:
        with safe_open(file, "pt") as handle:
            return handle.metadata() or {}
    except Exception as err:  # noqa: BLE001 - a damaged header fails in many ways
        raise ValueError(
            f"{_where(path)}: cannot read {file.name}: corrupt or not a safetensors file ({err})"
        ) from err


def _load_transformers(folder, path, dtype):
    import torch
    from safetensors import SafetensorError
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"path={str(path)!r}: not a model type transformers knows ({err})") from err
    cls = _transformers_class(config)
    state = quantised_state(folder, path)
    if state is not None and hasattr(cls, "_model_mapping"):  # an Auto class loads a state only through its model
        cls = cls._model_mapping[type(config)]
    try:
        model, info = cls.from_pretrained(
            None if state is not None else folder,
            config=config,
            state_dict=state,
            trust_remote_code=False,
            local_files_only=True,
            use_safetensors=True,
            dtype=dtype or torch.float32,
            output_loading_info=True,
        )
    except (OSError, RuntimeError, ValueError, KeyError, SafetensorError) as err:
        raise ValueError(f"path={str(path)!r}: cannot load {cls.__name__} weights: {err}") from err
    if state is not None and (Path(folder) / "generation_config.json").is_file():  # from_pretrained(None) skips it
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    problems = {k: sorted(map(str, v)) for k, v in info.items() if v}  # missing / unexpected / mismatched keys
    if problems:
        raise ValueError(f"path={str(path)!r}: weights do not match the {type(model).__name__} config: {problems}")
    return model


# the zoo layout `<root>/<prefix>-<suffix>`: pipeline component -> folder suffix (drafters optional)
ZOO_PARTS = {"transformer": "c2i", "vqvae": "vq", "draft_model": "c2i-draft", "eagle_head": "c2i-eagle"}
ZOO_REQUIRED = ("transformer", "vqvae")

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _where(path):
    return f"path={str(path)!r}"


def read_config(path):
    """A model folder's `config.json`, checked without loading any weights (cheap: no torch import).

    Zoo configs (`_class_name` in `MODEL_CLASSES`) must name only fields of that class's constructor, each of the
    right type and range (`mmspec.models.config_fields`); transformers configs (`model_type`, no `_class_name`) are
    returned as read.

    Returns:
        the config dict.

    Raises:
        ValueError: no folder / no `config.json`, invalid JSON, unknown class, unknown field, or a field of the wrong
            type or range; the message names `path` and the field.
    """
    from mmspec.models.config_fields import CONFIG_FIELDS, check_fields

    folder = Path(path)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise ValueError(f"{_where(path)} is not a model folder: no such directory")
    if not config_file.is_file():
        raise ValueError(f"{_where(path)} is not a model folder: no config.json")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{_where(path)}: config.json is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{_where(path)}: config.json is not a JSON object")
    class_name = config.get("_class_name")
    if class_name is None and "model_type" in config:
        return config
    if class_name not in MODEL_CLASSES:
        raise ValueError(
            f"{_where(path)}: config.json names _class_name={class_name!r} and no transformers model_type; "
            f"known zoo classes: {sorted(MODEL_CLASSES)}"
        )
    fields = CONFIG_FIELDS.get(class_name)
    if fields is None:  # a class without field rules: its constructor is the only check
        return config
    unknown = sorted(k for k in config if not k.startswith("_") and k not in fields)
    if unknown:
        raise ValueError(
            f"{_where(path)}: config.json has field(s) {unknown} that {class_name} does not take; "
            f"its fields: {sorted(fields)}"
        )
    try:
        check_fields(class_name, config)
    except ValueError as err:
        raise ValueError(f"{_where(path)}: config.json: {err}") from err
    return config


def zoo_folders(root=DEFAULT_ZOO, prefix="mnist", kind="c2i"):
    """`{component: folder}` for the zoo folders `<root>/<prefix>-{<kind>,vq,<kind>-draft,<kind>-eagle}` that exist
    (`kind`: "c2i" or "t2i"); nothing is read or loaded. Raises ValueError naming `root` if it is not a directory or
    lacks the transformer / vq folder."""
    if kind not in ("c2i", "t2i"):
        raise ValueError(f"kind must be 'c2i' or 't2i', got {kind!r}")
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"root={str(root)!r} is not a directory")
    folders = {}
    for name, suffix in ZOO_PARTS.items():
        folder = root / f"{prefix}-{suffix.replace('c2i', kind)}"
        if folder.is_dir():
            folders[name] = folder
        elif name in ZOO_REQUIRED:
            raise ValueError(f"root={str(root)!r}: missing zoo folder {folder}")
    return folders


def _weight_files(folder, path):
    """The safetensors file(s) of a zoo folder: the single file, or the shards listed by the index."""
    single, index = folder / WEIGHTS_NAME, folder / WEIGHTS_INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{_where(path)}: {WEIGHTS_INDEX_NAME} is not a valid shard index ({err!r})") from err
        files = []
        for name in names:
            shard = folder / str(name)
            if Path(str(name)).name != name or not shard.is_file():
                raise ValueError(f"{_where(path)}: shard {name!r} listed in {WEIGHTS_INDEX_NAME} is not in the folder")
            files.append(shard)
        return files
    pickles = sorted(f.name for f in folder.iterdir() if f.suffix in _PICKLE_SUFFIXES)
    found = f" (found {pickles}: pickle weights are never loaded; convert them to safetensors)" if pickles else ""
    raise ValueError(f"{_where(path)}: no weights file {WEIGHTS_NAME}{found}")


def _read_weights(folder, path):
    """`{name: tensor}` from the folder's safetensors file(s), quantised storage dequantised; a corrupt file is a
    ValueError naming it."""
    from mmspec.models.storage import read_weights

    state = {}
    for file in _weight_files(folder, path):
        part = read_weights(file, label=f"{_where(path)}: cannot read {file.name}")  # int8 / int4 dequantised here
        twice = sorted(set(part) & set(state))
        if twice:
            raise ValueError(f"{_where(path)}: key {twice[0]!r} is stored in more than one shard")
        state.update(part)
    return state


def _examples(keys, limit=3):
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def check_weights(state, model, path):
    """Raise ValueError (naming `path` and the key) unless `state` has exactly the model's keys, each with the
    model's shape and kind (floating or not) and, for floating tensors, only finite values."""
    import torch

    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    hint = (
        f"; does config.json match the weights? ({type(model).__name__} with this config has {len(expected)} tensors)"
    )
    if missing:
        raise ValueError(f"{_where(path)}: weights lack {_examples(missing)}{hint}")
    if unexpected:
        raise ValueError(f"{_where(path)}: weights have unexpected keys {_examples(unexpected)}{hint}")
    for key, want in expected.items():
        got = state[key]
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(
                f"{_where(path)}: weight {key!r} has shape {tuple(got.shape)}, the config gives {tuple(want.shape)}"
            )
        if got.is_floating_point() != want.is_floating_point():
            raise ValueError(f"{_where(path)}: weight {key!r} has dtype {got.dtype}, expected a {want.dtype} tensor")
        if got.is_floating_point() and not torch.isfinite(got).all():
            raise ValueError(f"{_where(path)}: weight {key!r} holds non-finite values (NaN or inf)")


def _has_real_tensors(model):
    return any(t.device.type != "meta" for t in model.state_dict().values())


def _load_zoo(folder, path, config):
    """Build the zoo class of `config` without initialising weights (meta device), then load every tensor strictly."""
    import torch

    class_name = config["_class_name"]
    cls = _zoo_class(class_name)
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    state = _read_weights(folder, path)
    try:
        with torch.device("meta"):
            model = cls(**kwargs)
        if set(dict(model.named_buffers())) - set(model.state_dict()):  # computed buffers (RoPE): build for real,
            with torch.random.fork_rng(devices=[]):  # leaving the caller's global RNG as it was
                model = cls(**kwargs)
    except (ValueError, TypeError) as err:  # cross-field rules (dim / n_head, block_size square, ...)
        raise ValueError(f"{_where(path)}: config.json: {err}") from err
    check_weights(state, model, path)
    model.load_state_dict(state, strict=True, assign=not _has_real_tensors(model))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:  # a non-persistent buffer would need computing; no zoo class has one today
        raise ValueError(f"{_where(path)}: {class_name} tensors {left[:3]} are not stored in the weights")
    hidden = {k: v for k, v in config.items() if k.startswith("_")}  # as diffusers' from_pretrained keeps them
    model.register_to_config(**(hidden | {"_name_or_path": str(path)}))
    return model


def load(path, device=None, dtype=None):
    """Load a zoo model folder (e.g. `mmspec.models.load("assets/mnist-c2i")`) or a transformers model folder.

    Zoo folders load strictly: `config.json` names only fields of its class, each of the right type and range
    (`read_config`), and the weights hold exactly the tensors that config gives, with its shapes and finite values;
    nothing is ever left randomly initialised.

    Args:
        path: folder holding `config.json` and the safetensors weights: a zoo folder (`_class_name` in the config,
            `diffusion_pytorch_model.safetensors` or its shards + index) or a transformers folder (`model_type` in
            the config, `model.safetensors` or shards); see the module docstring for which classes can load.
        device: optional device to move the model to.
        dtype: optional dtype (default: float32, whatever the stored dtype).

    Returns:
        the model, in eval mode.

    Raises:
        ValueError: `path` is not a model folder, names an unknown class, model type or config field, has a field of
            the wrong type or range, or holds a corrupt / mismatched / missing weights file; the message names
            `path` and the offending field or key.
    """
    import torch

    folder = Path(path)
    config = read_config(folder)
    if config.get("_class_name") is None:
        model = _load_transformers(folder, path, dtype)
        if device is not None:
            model.to(device)
        return model.eval()
    model = _load_zoo(folder, path, config)
    # plain nn.Module.to: ModelMixin.to warns about dtype casts that are intended here (fp16 storage -> fp32)
    torch.nn.Module.to(model, device=device, dtype=dtype or torch.float32)
    return model.eval()


def import_index_modules(folder):
    """Import the mmspec modules a saved pipeline's `model_index.json` names (diffusers loads a component's class only
    from a module already imported), old paths (`mmspec.models.MOVED`) included. Called by the pipelines'
    `from_pretrained` before diffusers reads the index; a folder without an index is left alone."""
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        return
    import mmspec.models  # noqa: F401  (installs the old-path aliases)

    for value in json.loads(index.read_text()).values():
        if isinstance(value, list) and value and isinstance(value[0], str) and value[0].startswith("mmspec."):
            importlib.import_module(value[0])
