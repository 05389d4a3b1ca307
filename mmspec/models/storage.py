"""Weight-only quantised *storage* for the zoo's safetensors files, dequantised at load.

The shipped zoo must stay small (users clone it; a GPU run copies the repository), so its weights are stored in
fewer bits than they run in. Storage only: every model still runs in float32 (or the dtype asked for); the stored
file is a plain safetensors file whose header records the scheme, so any tool can read it and see what it holds.

Schemes (`STORAGE_SCHEMES`):

* `float32` / `float16` -- every floating tensor cast to that dtype (the zoo used float16 before; no header entry);
* `int8` -- each floating tensor of two or more dimensions, per output row (dim 0, the rest flattened): symmetric
  absmax scale `s = max|w| / 127` (float32) and `q = round(w / s)` (int8); others (norms, biases) in float16;
* `int4` -- the same per group of `group_size` consecutive inputs of a row (default 32; a row whose length the group
  does not divide falls back to `int8`): `s = max|w| / 7`, `q` in [-7, 7] packed two per byte, scales in float16.

A quantised tensor `name` is stored as `name.qweight` (+ `name.qscale`), never under its own name, so a loader that
does not know the scheme (`diffusers`' or `transformers`' `from_pretrained`) fails on missing keys instead of loading
integers as weights. The header's metadata `mmspec_storage` (JSON: scheme, group size, and each quantised tensor's
shape) is what `read_weights` follows; a file without it is read as is.
"""

import json
import math
from pathlib import Path

import torch


__all__ = ["STORAGE_SCHEMES", "dequantize", "quantize", "read_weights", "storage_of", "write_weights"]

STORAGE_SCHEMES = ("float32", "float16", "int8", "int4")
DEFAULT_GROUP_SIZE = 32
METADATA_KEY = "mmspec_storage"
_MIN_NUMEL = 256  # smaller tensors (norms, biases, tiny tables) stay float16: a scale per row would not pay


def _quantize_rows(weight, bits, group_size):
    rows = weight.detach().float().reshape(weight.shape[0], -1)
    qmax = 2 ** (bits - 1) - 1
    if bits == 4:
        rows = rows.reshape(rows.shape[0], -1, group_size)
    scale = rows.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / qmax
    q = torch.round(rows / scale).clamp(-qmax, qmax).to(torch.int8)
    if bits == 8:
        return q, scale[:, 0].to(torch.float32)
    q = (q.reshape(q.shape[0], -1) + 8).to(torch.uint8)  # [0, 15]: two per byte, low nibble first
    return q[:, 0::2] | (q[:, 1::2] << 4), scale[..., 0].to(torch.float16)


def quantize(state, scheme="int8", group_size=DEFAULT_GROUP_SIZE, int8_prefixes=()):
    """`(tensors, metadata)` to write for `state` ({name: tensor}) in `scheme` (see the module docstring); tensors
    whose names start with one of `int8_prefixes` are stored int8 in an int4 file (e.g. a model's image decoder)."""
    if scheme not in STORAGE_SCHEMES:
        raise ValueError(f"storage must be one of {STORAGE_SCHEMES}, got {scheme!r}")
    if not (isinstance(group_size, int) and group_size >= 2 and group_size % 2 == 0):
        raise ValueError(f"group_size must be an even integer >= 2, got {group_size!r}")
    tensors, entries = {}, {}
    for name, value in state.items():
        value = value.detach().cpu()
        if not value.is_floating_point():
            tensors[name] = value.contiguous()
            continue
        if scheme == "float32":
            tensors[name] = value.to(torch.float32).contiguous()
            continue
        if scheme == "float16" or value.dim() < 2 or value.numel() < _MIN_NUMEL:
            tensors[name] = value.to(torch.float16).contiguous()
            continue
        row = value.numel() // value.shape[0]
        bits = 4 if scheme == "int4" and row % group_size == 0 and not name.startswith(tuple(int8_prefixes)) else 8
        q, scale = _quantize_rows(value, bits, group_size)
        tensors[f"{name}.qweight"], tensors[f"{name}.qscale"] = q.contiguous(), scale.contiguous()
        entries[name] = {"bits": bits, "shape": list(value.shape)}
    metadata = {"format": "pt"}
    if entries:
        metadata[METADATA_KEY] = json.dumps({"scheme": scheme, "group_size": group_size, "tensors": entries})
    return tensors, metadata


def _dequantize_one(name, entry, tensors, group_size, where):
    try:
        q, scale, shape, bits = tensors[f"{name}.qweight"], tensors[f"{name}.qscale"], entry["shape"], entry["bits"]
    except (KeyError, TypeError) as err:
        raise ValueError(f"{where}: quantised tensor {name!r} is incomplete ({err!r} missing)") from err
    numel = math.prod(shape)
    rows = shape[0] if shape else 0
    if bits == 8 and q.dtype == torch.int8 and q.numel() == numel and scale.shape == (rows,):
        return (q.reshape(rows, -1).float() * scale.float()[:, None]).reshape(shape)
    if bits == 4 and q.dtype == torch.uint8 and 2 * q.numel() == numel and scale.numel() * group_size == numel:
        low, high = (q & 0xF).to(torch.int8) - 8, (q >> 4).to(torch.int8) - 8
        values = torch.stack([low, high], dim=-1).reshape(rows, -1, group_size).float()
        return (values * scale.float().reshape(rows, -1, 1)).reshape(shape)
    raise ValueError(f"{where}: quantised tensor {name!r} does not match its recorded shape {shape} / {bits} bits")


def dequantize(tensors, metadata, where="weights"):
    """{name: float32 tensor} from what `quantize` wrote (`metadata`: the file's header metadata, may be None)."""
    raw = (metadata or {}).get(METADATA_KEY)
    if raw is None:
        return dict(tensors)
    try:
        info = json.loads(raw)
        entries, group_size = info["tensors"], int(info["group_size"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{where}: unreadable {METADATA_KEY} metadata ({err!r})") from err
    state = {}
    for name, entry in entries.items():
        state[name] = _dequantize_one(name, entry, tensors, group_size, where)
    stored = {f"{n}.{part}" for n in entries for part in ("qweight", "qscale")}
    state.update({k: v for k, v in tensors.items() if k not in stored})
    return state


def read_weights(path, label=None):
    """{name: tensor} of a safetensors file, dequantised if it holds quantised storage (float tensors come back in
    float32 where dequantised, as stored otherwise). A corrupt file or inconsistent storage is a ValueError starting
    with `label` (default: the quoted path)."""
    from safetensors import safe_open

    path = Path(path)
    label = repr(str(path)) if label is None else label
    try:
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata()
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    except Exception as err:  # noqa: BLE001 - a damaged file can fail in many ways (header, size, dtype)
        raise ValueError(f"{label}: corrupt or not a safetensors file ({err})") from err
    return dequantize(tensors, metadata, where=label)


def write_weights(state, path, scheme="int8", group_size=DEFAULT_GROUP_SIZE, int8_prefixes=()):
    """Write `state` to the safetensors file `path` in `scheme`, atomically (temporary file + rename)."""
    from safetensors.torch import save_file

    tensors, metadata = quantize(state, scheme, group_size, int8_prefixes)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, tmp, metadata=metadata)
    tmp.replace(path)
    return path


def storage_of(path):
    """The storage scheme of a safetensors file: "int8" / "int4" (from its header) or the dtype of its floats."""
    from safetensors import safe_open

    with safe_open(Path(path), "pt") as handle:
        raw = (handle.metadata() or {}).get(METADATA_KEY)
        if raw is not None:
            return json.loads(raw)["scheme"]
        dtypes = {handle.get_slice(k).get_dtype() for k in handle.keys()}
    floats = sorted(d for d in dtypes if d.startswith(("F", "BF")))
    return {"F16": "float16", "F32": "float32", "BF16": "bfloat16"}.get(floats[0], floats[0]) if floats else "none"


def convert_folder(folder, scheme, group_size=DEFAULT_GROUP_SIZE, int8_prefixes=()):
    """Rewrite every `*.safetensors` file of a model folder in `scheme` (read through `read_weights`, so a file that
    is already quantised is re-quantised from its dequantised values). Returns {file name: (bytes before, after)}."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not folder.is_dir() or not files:
        raise ValueError(f"folder={str(folder)!r}: not a folder holding *.safetensors weights")
    sizes = {}
    for file in files:
        before = file.stat().st_size
        write_weights(read_weights(file), file, scheme, group_size, int8_prefixes)
        sizes[file.name] = (before, file.stat().st_size)
    return sizes


def main(argv=None):
    """`python -m mmspec.models.storage --storage int4 FOLDER...`: rewrite model folders' weights in a scheme."""
    import argparse
    import logging

    parser = argparse.ArgumentParser(prog="python -m mmspec.models.storage", description=main.__doc__)
    parser.add_argument("folders", nargs="+", help="model folders (every *.safetensors file in each is rewritten)")
    parser.add_argument("--storage", choices=STORAGE_SCHEMES, required=True, help="storage scheme")
    parser.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="int4 group size (even, >= 2)")
    parser.add_argument("--int8-prefix", action="append", default=[], help="int4: tensors with this name prefix int8")
    args = parser.parse_args(argv)
    if args.group_size < 2 or args.group_size % 2 or args.group_size > 4096:
        parser.error(f"--group-size must be an even integer in [2, 4096], got {args.group_size}")
    for folder in args.folders:
        if not Path(folder).is_dir() or not any(Path(folder).glob("*.safetensors")):
            parser.error(f"folder {folder!r} holds no *.safetensors weights")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for folder in args.folders:
        for name, (before, after) in convert_folder(folder, args.storage, args.group_size, args.int8_prefix).items():
            logging.getLogger(__name__).info("%s/%s: %d -> %d bytes (%s)", folder, name, before, after, args.storage)


if __name__ == "__main__":
    main()
