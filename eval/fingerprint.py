"""Fingerprints of resumable evaluation artefacts (FID shards, sweep rows, reference feature chunks).

A fingerprint is a small JSON-able dict of everything that determines an artefact: a hash of the weights of every
model that produced it (`weights_hash`, over the state dict: names, dtypes, shapes and bytes, computed once per
run), the settings that change the output, the counts, the seeds and the index range. It is stored *inside* the
artefact (an `.npz` key, a JSONL field), so a lost or edited side file (`manifest.json`) can never let an artefact of
one run serve another; on reuse it is compared field by field (`diff_fields`) with the fingerprint the current run
would write, and a mismatch names the file and the differing fields (`StaleArtefactError`).
"""

import hashlib
import json

import numpy as np
import torch


__all__ = ["StaleArtefactError", "array_hash", "decode", "describe", "diff_fields", "encode", "pipeline_weights_hash",
           "weights_hash"]  # fmt: skip


class StaleArtefactError(ValueError):
    """A resumable artefact on disk was made by another model or other settings than the current run."""


def _update(h, tensor: torch.Tensor) -> None:
    t = tensor.detach()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def weights_hash(modules) -> str:
    """sha256 (hex, first 16 digits) of the state dicts of `modules`: an `nn.Module` or a dict name -> module
    (None entries skipped). Equal weights give equal hashes on any device."""
    if isinstance(modules, torch.nn.Module):
        modules = {"": modules}
    h = hashlib.sha256()
    for name in sorted(modules):
        module = modules[name]
        if module is None:
            continue
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"modules[{name!r}] must be a torch.nn.Module, got {type(module).__name__}")
        h.update(f"<{name}>".encode())
        for key, value in sorted(module.state_dict().items()):
            h.update(key.encode())
            _update(h, value)
    return h.hexdigest()[:16]


def pipeline_weights_hash(pipe) -> str:
    """`weights_hash` of every `nn.Module` component of a Diffusers-style pipeline (target, VQ, drafters, ...)."""
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        raise TypeError(f"pipe must be a pipeline with .components, got {type(pipe).__name__}")
    return weights_hash({k: v for k, v in components.items() if isinstance(v, torch.nn.Module)})


def array_hash(*arrays) -> str:
    """sha256 (hex, first 16 digits) of numpy arrays / tensors (dtype, shape and bytes): the content check."""
    h = hashlib.sha256()
    for a in arrays:
        if isinstance(a, torch.Tensor):
            _update(h, a)
        else:
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(a.data)
    return h.hexdigest()[:16]


def _plain(value):
    """JSON round trip (tuples -> lists, Paths -> str), so a fingerprint compares equal to its stored copy."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def encode(fingerprint: dict) -> np.str_:
    """A fingerprint as an `.npz` value (a JSON string; no pickle)."""
    return np.str_(json.dumps(_plain(fingerprint), sort_keys=True))


def decode(value) -> dict:
    """The fingerprint dict of an `.npz` value written by `encode` (ValueError if it is not one)."""
    try:
        out = json.loads(str(value))
    except json.JSONDecodeError as err:
        raise ValueError(f"fingerprint is not JSON ({err})") from err
    if not isinstance(out, dict):
        raise ValueError(f"fingerprint must be a JSON object, got {type(out).__name__}")
    return out


def diff_fields(stored: dict, expected: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two fingerprints (nested dicts compared per key)."""
    stored, expected = _plain(stored), _plain(expected)
    out = []
    for key in sorted(set(stored) | set(expected), key=str):
        a, b = stored.get(key, "<absent>"), expected.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def describe(stored: dict, expected: dict, fields: list[str]) -> str:
    """'field (stored X, now Y)' for the first few differing fields."""
    stored, expected = _plain(stored), _plain(expected)

    def get(d, dotted):
        for part in dotted.split("."):
            d = d.get(part, "<absent>") if isinstance(d, dict) else "<absent>"
        return d

    parts = [f"{f} (stored {get(stored, f)!r}, now {get(expected, f)!r})" for f in fields[:4]]
    return ", ".join(parts) + (f" and {len(fields) - 4} more" if len(fields) > 4 else "")
