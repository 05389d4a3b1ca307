"""Loading the official MAR checkpoints (LTH14/mar ``checkpoint-last.pth`` of MAR-B / MAR-L / MAR-H) safely.

Upstream's ``main_mar.py`` saves ``{"model": state_dict, "model_ema": state_dict, "optimizer": ..., "epoch": ...,
"scaler": ..., "args": argparse.Namespace}``; the released files keep ``model`` and ``model_ema`` (about twice the
parameter count in float32), and the README / demo notebook sample with ``model_ema``, so that is the default here.
Files are read with ``torch.load(weights_only=True)`` (tensors, containers, primitives, plus ``argparse.Namespace``
for ``args``): no code is ever unpickled, and every mismatch is a ``ValueError`` naming the file and the knob that is
likely wrong.

The model size is the preset (``mar_base`` / ``mar_large`` / ``mar_huge``); the diffusion head's depth and width are
training arguments that the checkpoint does not record, so they default to the README's evaluation commands (the
``diffloss_d`` / ``diffloss_w`` of `mmspec.models.mar.model.MAR_PRESETS`: 6/1024, 8/1280, 12/1536).

Examples:
    >>> transformer = load_official_mar("pretrained_models/mar/mar_large/checkpoint-last.pth", "mar_large")
    >>> parts = official_continuous_parts(
    ...     "pretrained_models/mar/mar_large/checkpoint-last.pth", "pretrained_models/vae/kl16.ckpt",
    ...     draft_ckpt="pretrained_models/mar/mar_base/checkpoint-last.pth", draft_model="mar_base")
    >>> pipe = SpeculativeContinuousARPipeline(**parts)  # = SpeculativeContinuousARPipeline.from_official(...)
    >>> images = pipe([207, 360], acceptance="continuous", generator=torch.Generator().manual_seed(0)).images
"""

import argparse
import inspect
import logging
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch

from mmspec.models.mar.model import MAR, MAR_PRESETS


logger = logging.getLogger(__name__)

__all__ = ["build_official_mar", "load_official_mar", "official_continuous_parts"]

# MAR fields that `build_official_mar` derives from upstream's arguments (img_size, vae_stride, ...)
_DERIVED = ("seq_h", "seq_w", "token_embed_dim", "class_num", "buffer_size", "diffloss_d", "diffloss_w",
            "num_sampling_steps")  # fmt: skip


def _where(path) -> str:
    return f"mar_ckpt={os.fspath(path)!r}"


def check_file_argument(name: str, path) -> Path:
    """`ValueError` naming the argument `name` unless `path` is an existing, readable file (run before building
    any model: MAR-huge takes about 4 GB and 30 s to build)."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{name}={os.fspath(path)!r}: no such file")
    if not path.is_file():
        raise ValueError(f"{name}={os.fspath(path)!r}: is a {'folder' if path.is_dir() else 'not a regular file'}, "
                         "expected a checkpoint file")  # fmt: skip
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise ValueError(f"{name}={os.fspath(path)!r}: not readable ({err.strerror or err})") from err
    return path


def build_official_mar(
    model: str = "mar_large",
    *,
    img_size: int = 256,
    vae_stride: int = 16,
    patch_size: int = 1,
    vae_embed_dim: int = 16,
    class_num: int = 1000,
    buffer_size: int = 64,
    diffloss_d: int | None = None,
    diffloss_w: int | None = None,
    num_sampling_steps: str = "100",
    **overrides,
) -> MAR:
    """An untrained `MAR` shaped like upstream's ``mar.__dict__[model](...)`` with ``main_mar.py``'s arguments.

    Arguments as `load_official_mar` (which calls this, then loads the weights). Run it under
    ``with torch.device("meta")`` to get the key names and shapes without allocating the weights.
    """
    if model not in MAR_PRESETS:
        raise ValueError(f"model={model!r}: unknown MAR preset, expected one of {sorted(MAR_PRESETS)}")
    if patch_size != 1:
        raise ValueError(f"patch_size={patch_size!r}: only patch_size=1 is supported (every released MAR uses 1)")
    if img_size % vae_stride:
        raise ValueError(f"img_size={img_size} must be a multiple of vae_stride={vae_stride}")
    fields = set(inspect.signature(MAR.__init__).parameters) - {"self"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"overrides {unknown} are not MAR fields; known: {sorted(fields - set(_DERIVED))}")
    derived = sorted(set(overrides) & set(_DERIVED))
    if derived:
        raise ValueError(
            f"overrides {derived} are derived here: pass img_size / vae_stride / vae_embed_dim / class_num / "
            "buffer_size / diffloss_d / diffloss_w / num_sampling_steps instead"
        )
    preset = MAR_PRESETS[model]
    side = img_size // vae_stride // patch_size
    config = dict(
        seq_h=side,
        seq_w=side,
        token_embed_dim=vae_embed_dim * patch_size**2,
        class_num=class_num,
        buffer_size=buffer_size,
        diffloss_d=preset["diffloss_d"] if diffloss_d is None else diffloss_d,
        diffloss_w=preset["diffloss_w"] if diffloss_w is None else diffloss_w,
        num_sampling_steps=str(num_sampling_steps),
    )
    return MAR.from_preset(model, **config, **overrides)


def _read_state_dict(path, use_ema: bool) -> dict:
    """The ``model_ema`` (or ``model``) state dict of an official checkpoint, read without unpickling code."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{_where(path)}: no such file")
    try:
        # mmap: the unused half (raw or EMA weights) is never read into memory; zip files only (torch >= 1.6 format)
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found is None:  # the restricted unpickler also fails this way on garbage bytes
            raise ValueError(f"{_where(path)}: cannot read it: corrupt or not a torch checkpoint ({err})") from err
        raise ValueError(
            f"{_where(path)}: holds a pickled {found.group(1)!r}, not only tensors / containers; refusing to unpickle "
            "it (weights_only=True)"
        ) from err
    except Exception as err:  # noqa: BLE001 - a damaged file can make the unpickler raise almost anything
        raise ValueError(f"{_where(path)}: cannot read it: corrupt or not a torch checkpoint ({err})") from err
    key, other = ("model_ema", "model") if use_ema else ("model", "model_ema")
    if not isinstance(obj, dict):
        raise ValueError(f"{_where(path)}: holds a {type(obj).__name__}, expected the official checkpoint dict")
    if not isinstance(obj.get(key), dict):
        found = "is None" if key in obj else "is missing"
        switch = (
            f"; use_ema={not use_ema} would load its {other!r} weights" if isinstance(obj.get(other), dict) else ""
        )
        raise ValueError(f"{_where(path)}: entry {key!r} {found} (keys: {sorted(map(str, obj))[:8]}){switch}")
    state = obj[key]
    for name, value in state.items():
        if not torch.is_tensor(value):
            raise ValueError(f"{_where(path)}: {key}[{name!r}] is a {type(value).__name__}, not a tensor")
    return state


def _examples(keys, limit=4) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _keys_hint(keys, model) -> str:
    if all(k.startswith("diffloss.net.res_blocks.") for k in keys):
        return "diffloss_d (the head's residual blocks; the README's values are in MAR_PRESETS)"
    return f"model={model!r} (the checkpoint may be another MAR size: {sorted(MAR_PRESETS)})"


def _shape_hint(key, got, want, model) -> str:
    if key.endswith("pos_embed_learned"):
        extra = "" if key.startswith("diffusion") else " and buffer_size"
        return f"img_size / vae_stride (the token grid){extra}"
    if key == "class_emb.weight" and got[0] != want[0]:
        return f"class_num (the checkpoint has {got[0]} classes)"
    if key == "z_proj.weight" and got[1] != want[1]:
        return "vae_embed_dim (the token dim)"
    if key.startswith("diffloss."):
        return "diffloss_w (the head's width; the README's values are in MAR_PRESETS) or vae_embed_dim"
    return f"model={model!r} (the checkpoint may be another MAR size: {sorted(MAR_PRESETS)})"


def _check(state, mar: MAR, path, model):
    expected = mar.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = ([f"lacks {_examples(missing)}"] if missing else []) + (
            [f"has unexpected {_examples(unexpected)}"] if unexpected else []
        )
        raise ValueError(
            f"{_where(path)}: the checkpoint {'; '.join(parts)}; check {_keys_hint(missing + unexpected, model)}"
        )
    wrong = [k for k, v in expected.items() if tuple(state[k].shape) != tuple(v.shape)]
    if wrong:
        key = wrong[0]
        got, want = tuple(state[key].shape), tuple(expected[key].shape)
        more = f" ({len(wrong)} keys differ)" if len(wrong) > 1 else ""
        raise ValueError(
            f"{_where(path)}: {key!r} has shape {got} in the checkpoint but {want} in the model{more}; "
            f"check {_shape_hint(key, got, want, model)}"
        )


def load_official_mar(
    path: str | os.PathLike,
    model: str = "mar_large",
    *,
    use_ema: bool = True,
    img_size: int = 256,
    vae_stride: int = 16,
    patch_size: int = 1,
    vae_embed_dim: int = 16,
    class_num: int = 1000,
    buffer_size: int = 64,
    diffloss_d: int | None = None,
    diffloss_w: int | None = None,
    num_sampling_steps: str = "100",
    torch_dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    **overrides,
) -> MAR:
    """Load an official MAR ``checkpoint-last.pth`` strictly into `MAR`.

    Args:
        path: the checkpoint file.
        model: ``"mar_base"`` | ``"mar_large"`` | ``"mar_huge"`` (upstream's ``--model``).
        use_ema: load ``model_ema`` (the weights upstream evaluates and releases) instead of ``model``.
        img_size, vae_stride, patch_size, vae_embed_dim, class_num, buffer_size: upstream's arguments (defaults:
            ``main_mar.py``'s); the token grid is ``img_size // vae_stride`` per side. Only ``patch_size=1``.
        diffloss_d, diffloss_w: the head's blocks and width (default: the README's values for ``model``).
        num_sampling_steps: the head's respaced sampling steps (upstream's ``--num_sampling_steps``).
        torch_dtype, device: optional dtype / device to move the model to.
        **overrides: other `MAR` fields on top of the preset (sizes for tests, e.g. ``encoder_depth=1``).

    Returns:
        the `MAR` in eval mode.

    Raises:
        ValueError: missing / unreadable / unsafe file, no ``model_ema`` (``model``) entry, unknown preset, missing /
            unexpected keys or wrong shapes (the message names the key, both shapes and the likely wrong argument).
    """
    check_file_argument("mar_ckpt", path)  # before building the model (named as in the other messages)
    mar = build_official_mar(
        model,
        img_size=img_size,
        vae_stride=vae_stride,
        patch_size=patch_size,
        vae_embed_dim=vae_embed_dim,
        class_num=class_num,
        buffer_size=buffer_size,
        diffloss_d=diffloss_d,
        diffloss_w=diffloss_w,
        num_sampling_steps=num_sampling_steps,
        **overrides,
    )
    state = _read_state_dict(path, use_ema)
    _check(state, mar, path, model)
    mar.load_state_dict(state, strict=True)
    # plain nn.Module.to: ModelMixin.to warns about intended dtype casts
    torch.nn.Module.to(mar, device=device, dtype=torch_dtype)
    logger.info("loaded %s %s weights from %s", model, "EMA" if use_ema else "raw", path)
    return mar.eval()


def official_continuous_parts(
    mar_ckpt: str | os.PathLike,
    vae_ckpt: str | os.PathLike,
    model: str = "mar_large",
    draft_ckpt: str | os.PathLike | None = None,
    draft_model: str = "mar_base",
    *,
    draft_kw: dict | None = None,
    vae_config: dict | None = None,
    **kw,
):
    """The parts of a `SpeculativeContinuousARPipeline` (`transformer`, `vae`, `draft_transformer`, keywords of its
    constructor) from the official MAR checkpoint(s) and ``kl16.ckpt``.

    Args:
        mar_ckpt, model: the target's checkpoint and preset (`load_official_mar`).
        vae_ckpt: the KL-VAE checkpoint (`mmspec.models.mar.kl_vae.load_official_kl`; ``scale_factor`` 0.2325 as MAR).
        draft_ckpt, draft_model: optional draft MAR (needed for ``acceptance="continuous"``).
        draft_kw: `load_official_mar` arguments for the draft only (on top of ``kw``).
        vae_config: `AutoencoderKL` overrides on top of kl16 (default resolution: ``img_size``).
        **kw: `load_official_mar` arguments shared by target and draft (``img_size``, ``num_sampling_steps``,
            ``torch_dtype``, ``device``, ...); each model's ``diffloss_d`` / ``diffloss_w`` default to its preset.
    """
    from mmspec.models.mar.kl_vae import load_official_kl

    # every path before any model is built (MAR-huge: about 4 GB and 30 s)
    for name, path in (("mar_ckpt", mar_ckpt), ("vae_ckpt", vae_ckpt), ("draft_ckpt", draft_ckpt)):
        if path is not None or name != "draft_ckpt":
            check_file_argument(name, path)
    transformer = load_official_mar(mar_ckpt, model, **kw)
    draft = None
    if draft_ckpt is not None:
        draft = load_official_mar(draft_ckpt, draft_model, **{**kw, **(draft_kw or {})})
    defaults = dict(resolution=kw.get("img_size", 256), embed_dim=kw.get("vae_embed_dim", 16))
    vae = load_official_kl(vae_ckpt, **{**defaults, **(vae_config or {})})
    stride = kw.get("vae_stride", 16)
    if vae.downsample_factor != stride:
        raise ValueError(f"vae_ckpt={os.fspath(vae_ckpt)!r}: the VAE downsamples by {vae.downsample_factor}, "
                         f"but vae_stride={stride}")  # fmt: skip
    torch.nn.Module.to(vae, device=kw.get("device"), dtype=kw.get("torch_dtype"))
    return {"transformer": transformer, "vae": vae, "draft_transformer": draft}
