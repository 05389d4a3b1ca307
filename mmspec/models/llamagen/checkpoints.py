"""Loading official FoundationVision/LlamaGen checkpoints (`c2i_*.pt`, `t2i_*.pt`) safely.

Upstream training scripts save `{"model": state_dict, "optimizer": ..., "steps": ..., "args": argparse.Namespace}`
(DDP), DeepSpeed saves `{"module": ...}`, others `{"state_dict": ...}`, and FSDP exports a bare state dict; upstream's
sample scripts unwrap them in that order. Here files are read with `torch.load(weights_only=True)` (only tensors,
containers and primitives, plus `argparse.Namespace` for the `args` entry) so no code is ever unpickled, and every
mismatch is refused with a `ValueError` naming the offending key.

Shared helpers (also meant for the VQ loader in `mmspec.models.llamagen.vq`):

* `load_official_state_dict(path)` -> the unwrapped `{name: tensor}` dict (prefixes `module.` / `_orig_mod.` removed);
* `check_state_dict(state_dict, expected)` -> raises `ValueError` on missing / unexpected / wrong-shape keys;
* `load_checked(model, state_dict, path)` -> that check, finite weights, then a strict load (VQ, MAR's KL-VAE).

GPT presets are upstream's `GPT_models` sizes (`GPT-B` 12L/768/12 heads ... `GPT-3B` 24L/3200/32 heads); vocabulary
16384 (VQ_16) and `block_size = (image_size // 16) ** 2`.
"""

import argparse
import logging
import os
import pickle
from pathlib import Path

import torch

from mmspec.models.llamagen.gpt import LlamaGenGPT


logger = logging.getLogger(__name__)

# upstream autoregressive/models/gpt.py GPT_models: (n_layer, n_head, dim)
GPT_PRESETS = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),  # 111M
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),  # 343M
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),  # 775M
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),  # 1.4B
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),  # 3.9B
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),  # 1.2B
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),  # 3.1B
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),  # 6.6B
}
WRAPPER_KEYS = ("model", "module", "state_dict")
STRIP_PREFIXES = ("module.", "_orig_mod.")
# non-parameter entries an upstream model may carry (rope table, masks, KV-cache buffers after setup_caches)
IGNORED_SUFFIXES = ("freqs_cis", "causal_mask", "kv_cache.k_cache", "kv_cache.v_cache")


def load_official_state_dict(path, wrapper_keys=WRAPPER_KEYS):
    """Read an official `.pt` checkpoint without unpickling code and return its model state dict.

    Args:
        path: the `.pt` file.
        wrapper_keys: keys tried in order to unwrap `{key: state_dict, ...}`; a dict whose values are all tensors
            is taken as a bare state dict.

    Returns:
        `{name: tensor}` with `module.` / `_orig_mod.` prefixes removed.

    Raises:
        ValueError: the file is missing, unreadable/corrupt, contains pickled code, or holds no state dict.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"cannot read checkpoint {str(path)!r}: it holds objects other than tensors/containers; refusing to "
            f"unpickle it ({err})"
        ) from err
    except Exception as err:  # a corrupt file can make the unpickler raise anything (EOFError, IndexError, ...)
        raise ValueError(f"cannot read checkpoint {str(path)!r}: corrupt or not a torch checkpoint ({err})") from err
    if not isinstance(obj, dict):
        raise ValueError(f"checkpoint {str(path)!r} holds a {type(obj).__name__}, expected a dict")
    state = None
    for key in wrapper_keys:
        if key in obj and isinstance(obj[key], dict):
            state = obj[key]
            break
    if state is None:
        if obj and all(torch.is_tensor(v) for v in obj.values()):
            state = obj  # bare (e.g. FSDP) state dict
        else:
            listed = ", ".join(repr(k) for k in wrapper_keys[:-1]) + f" or {wrapper_keys[-1]!r}"
            raise ValueError(
                f"checkpoint {str(path)!r} has no state dict: no {listed} entry (keys: {sorted(obj)[:10]})"
            )
    out = {}
    for name, value in state.items():
        if not torch.is_tensor(value):
            raise ValueError(f"checkpoint {str(path)!r}: key {name!r} is a {type(value).__name__}, not a tensor")
        for prefix in STRIP_PREFIXES:
            while name.startswith(prefix):
                name = name[len(prefix) :]
        out[name] = value
    return out


def check_state_dict(state_dict, expected):
    """Raise ValueError naming the first missing, unexpected or wrong-shape key.

    Args:
        state_dict: `{name: tensor}` to load.
        expected: a module (its `state_dict()`) or `{name: tensor or shape}`.
    """
    if isinstance(expected, torch.nn.Module):
        expected = expected.state_dict()
    shapes = {k: tuple(v.shape) if torch.is_tensor(v) else tuple(v) for k, v in expected.items()}
    missing = [k for k in shapes if k not in state_dict]
    if missing:
        raise ValueError(f"state dict is missing key {missing[0]!r} ({len(missing)} missing in total)")
    unexpected = [k for k in state_dict if k not in shapes]
    if unexpected:
        raise ValueError(f"state dict has unexpected key {unexpected[0]!r} ({len(unexpected)} unexpected in total)")
    for k, shape in shapes.items():
        got = tuple(state_dict[k].shape)
        if got != shape:
            raise ValueError(f"state dict key {k!r} has shape {got}, expected {shape}")


def load_checked(model, state_dict, path):
    """Load `state_dict` into `model` strictly, after `check_state_dict` and a check that every floating-point
    tensor is finite (a ValueError naming `path` and the key). Returns `model`."""
    check_state_dict(state_dict, model)
    for key, value in state_dict.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ValueError(f"{os.fspath(path)!r}: key {key!r} holds non-finite values")
    model.load_state_dict(state_dict, strict=True)
    return model


def official_gpt_config(
    preset,
    model_type="c2i",
    image_size=256,
    downsample_size=16,
    vocab_size=16384,
    num_classes=1000,
    cls_token_num=None,
    **overrides,
):
    """`LlamaGenGPT` config kwargs for an upstream preset (`GPT-B`, `GPT-L`, `GPT-XL`, `GPT-XXL`, `GPT-XXXL`,
    `GPT-1B`, `GPT-3B`, `GPT-7B`). `cls_token_num` defaults to 1 (c2i) / 120 (t2i)."""
    if preset not in GPT_PRESETS:
        raise ValueError(f"preset must be one of {sorted(GPT_PRESETS)}, got {preset!r}")
    if image_size % downsample_size:
        raise ValueError(f"image_size={image_size} must be a multiple of downsample_size={downsample_size}")
    config = dict(GPT_PRESETS[preset])
    config.update(
        model_type=model_type,
        vocab_size=vocab_size,
        num_classes=num_classes,
        block_size=(image_size // downsample_size) ** 2,
        cls_token_num=cls_token_num if cls_token_num is not None else (1 if model_type == "c2i" else 120),
    )
    config.update(overrides)
    return config


def _infer_fields(state_dict):
    """model_type / vocab / classes / cls_token_num / caption_dim read off the official key shapes."""
    fields = {}
    if "tok_embeddings.weight" in state_dict:
        fields["vocab_size"] = state_dict["tok_embeddings.weight"].shape[0]
    if "cls_embedding.embedding_table.weight" in state_dict:
        fields["model_type"] = "c2i"
        fields["num_classes"] = state_dict["cls_embedding.embedding_table.weight"].shape[0] - 1
    elif "cls_embedding.uncond_embedding" in state_dict:
        fields["model_type"] = "t2i"
        fields["cls_token_num"], fields["caption_dim"] = state_dict["cls_embedding.uncond_embedding"].shape
    return fields


def convert_official_gpt_state_dict(state_dict, model):
    """Validate an upstream GPT state dict against `model` (names are identical) and return the dict to load:
    upstream-only buffers (rope table, KV caches) are dropped, tensors are cast to the model's dtypes."""
    state = {k: v for k, v in state_dict.items() if not k.endswith(IGNORED_SUFFIXES)}
    dropped = len(state_dict) - len(state)
    if dropped:
        logger.info("dropped %d non-parameter upstream entries (rope table / KV cache)", dropped)
    expected = model.state_dict()
    check_state_dict(state, expected)
    return {k: v.to(expected[k].dtype) for k, v in state.items()}


def load_official_gpt(
    path, preset, image_size=256, downsample_size=16, dtype=torch.float32, device=None, **config_kwargs
):
    """Build a `LlamaGenGPT` for an upstream preset and load an official checkpoint into it.

    `model_type`, `vocab_size`, `num_classes`, `cls_token_num` and `caption_dim` are read from the checkpoint's
    shapes unless given in `config_kwargs`; `n_layer` / `dim` / `n_head` come from `preset` and are checked.

    Examples:
        >>> model = load_official_gpt("c2i_L_384.pt", "GPT-L", image_size=384)
        >>> model = load_official_gpt("t2i_XL_stage1_256.pt", "GPT-XL", image_size=256)

    Raises:
        ValueError: unreadable/unsafe file, or a key that is missing, unexpected or of the wrong shape.
    """
    state = load_official_state_dict(path)
    inferred = _infer_fields(state)
    inferred.update(config_kwargs)
    model_type = inferred.pop("model_type", "c2i")
    config = official_gpt_config(
        preset, model_type=model_type, image_size=image_size, downsample_size=downsample_size, **inferred
    )
    with torch.device("meta"):
        skeleton = LlamaGenGPT(**config)
    state = convert_official_gpt_state_dict(state, skeleton)
    model = LlamaGenGPT(**config)
    model.load_state_dict(state, strict=True)
    model = model.to(dtype=dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()


def convert_official_gpt(
    path, out_dir, preset, image_size=256, downsample_size=16, dtype=torch.float32, **config_kwargs
):
    """Load an official checkpoint and write it as a zoo folder (`save_pretrained`), loadable by
    `mmspec.models.load(out_dir)`. Returns the model."""
    model = load_official_gpt(path, preset, image_size, downsample_size, dtype=dtype, **config_kwargs)
    model.save_pretrained(out_dir)
    logger.info("wrote %s (%s, %d parameters)", out_dir, preset, sum(p.numel() for p in model.parameters()))
    return model
