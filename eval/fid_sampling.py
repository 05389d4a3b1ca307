"""Resumable, sharded sampling of many images with a pipeline, method and knobs: the first half of `mmspec eval fid`.

Image `i` of a run has class label `i % num_classes` and its own generator, seeded `seed * 1_000_003 + i` on the
model's device (`mmspec.random`: per-image generators make an image independent of its batch), so the images do not
depend on the shard size, the batch size, the number of ranks or on interruptions. Shard `s` holds images
`[s * shard_size, (s + 1) * shard_size)` as `shard_{s:05d}.npz` (`images` uint8 `[n, H, W, C]`, `labels` int64 `[n]`),
written atomically (temporary file, then rename): a killed run leaves only complete shards, and a rerun with the same
settings skips them. `manifest.json` records every setting that determines the images; a rerun with different
settings in the same folder is refused.

Every shard also carries its own fingerprint (`mmspec.eval.fingerprint`: the hash of the pipeline's weights, the
seed, the method and its knobs, the device type, the number of classes, its shard index and image range) and a
checksum of its images and labels, so a lost `manifest.json` cannot let shards of one setting serve another. On
resume each shard on disk is checked before anything is sampled: an unreadable / truncated shard, one whose
content does not match its checksum or its labels, or one holding another image range (copied from another shard)
is corrupt: it is recomputed with a warning naming the file. A shard made by other weights or settings (or without a
fingerprint) is stale: it is refused (`StaleArtefactError`, naming the file and the differing fields) unless
`overwrite=True`, which recomputes it with a warning.

Ranks: under `torchrun` / `accelerate launch` (`WORLD_SIZE` > 1 in the environment) each rank takes the shards
`s % world_size == rank`; every image is sampled exactly once.
"""

import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np
import torch


logger = logging.getLogger(__name__)

__all__ = ["SEED_STRIDE", "check_manifest_settings", "image_seed", "load_shards", "missing_shards", "run_fingerprint", "sample_shards",
           "shard_path"]  # fmt: skip

FORMAT = 2  # shard layout: images, labels, fingerprint (JSON), content (checksum)
# fingerprint fields that place a shard in its run: a mismatch means the file holds another shard's images
_PLACE = ("shard", "start", "stop")

SEED_STRIDE = 1_000_003


def image_seed(seed: int, index: int) -> int:
    """The generator seed of image `index` of a run seeded `seed`."""
    return seed * SEED_STRIDE + index


def shard_path(out_dir, shard: int) -> Path:
    return Path(out_dir) / f"shard_{shard:05d}.npz"


def _num_shards(num_images: int, shard_size: int) -> int:
    return (num_images + shard_size - 1) // shard_size


def missing_shards(out_dir, num_images: int, shard_size: int) -> list[int]:
    """Shards of the run not yet on disk."""
    return [s for s in range(_num_shards(num_images, shard_size)) if not shard_path(out_dir, s).is_file()]


def _check_manifest(out_dir: Path, manifest: dict, overwrite: bool = False) -> None:
    from mmspec.eval.fingerprint import StaleArtefactError, describe, diff_fields

    path = out_dir / "manifest.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"out_dir={str(out_dir)!r}: manifest.json is not valid JSON ({err})") from err
        if not isinstance(old, dict):
            raise ValueError(f"out_dir={str(out_dir)!r}: manifest.json is not a JSON object")
        diff = diff_fields(old.get("sampling", {}), manifest["sampling"])
        if not diff:
            return
        what = describe(old.get("sampling", {}), manifest["sampling"], diff)
        if "format" not in old.get("sampling", {}):
            what = f"written by an older mmspec, without weights hashes or shard fingerprints ({what})"
        if not overwrite:
            raise StaleArtefactError(
                f"out_dir={str(out_dir)!r} holds shards of a run with other settings: {what}; "
                "use a new folder (--out), the same settings to resume, or --overwrite to recompute them"
            )
        logger.warning("%s: other settings (%s): overwriting the run's manifest; stale shards are recomputed", path,
                       what)  # fmt: skip
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, path)


def check_manifest_settings(out_dir, settings: dict) -> None:
    """Before any model loads: StaleArtefactError if `out_dir`'s manifest records other values of `settings` (the
    ones known without the model: counts, seed, method and knobs, model folder); the weights are checked later."""
    from mmspec.eval.fingerprint import StaleArtefactError, describe, diff_fields

    path = Path(out_dir) / "manifest.json"
    try:
        old = json.loads(path.read_text()).get("sampling", {}) if path.is_file() else None
    except (json.JSONDecodeError, AttributeError):
        old = {}
    if old is None:
        return
    old = {k: old.get(k, "<absent>") for k in settings}
    diff = diff_fields(old, settings)
    if diff:
        raise StaleArtefactError(
            f"out_dir={str(out_dir)!r} holds shards of a run with other settings: {describe(old, settings, diff)}; "
            "use a new folder (--out), the same settings to resume, or --overwrite to recompute them"
        )


def run_fingerprint(pipe, *, seed: int, call_kwargs: dict | None = None, weights: str | None = None) -> dict:
    """What determines the images of a run of `pipe` (without the shard's own index and range): the weights hash
    (`weights`, or computed from `pipe`), seed, method and knobs, device type and number of classes."""
    from mmspec.eval.fingerprint import pipeline_weights_hash

    return dict(format=FORMAT, weights=weights or pipeline_weights_hash(pipe), seed=seed,
                call_kwargs=json.loads(json.dumps(dict(call_kwargs or {}), default=str)),
                device=pipe._execution_device.type, num_classes=int(pipe.transformer.config.num_classes))  # fmt: skip


def _shard_fingerprint(base: dict, shard: int, shard_size: int, num_images: int) -> dict:
    start = shard * shard_size
    return base | dict(shard=shard, start=start, stop=min(start + shard_size, num_images))


def _shard_problem(path: Path, expected: dict) -> tuple[str, str] | None:
    """None if the shard at `path` is the one `expected` describes, else ("corrupt" | "stale", why)."""
    from mmspec.eval.fingerprint import array_hash, decode, describe, diff_fields

    try:
        with np.load(path, allow_pickle=False) as data:
            keys = set(data.files)
            if not {"images", "labels"} <= keys:
                return "corrupt", f"has keys {sorted(keys)}, expected images and labels"
            images, labels = data["images"], data["labels"]
            stored = decode(data["fingerprint"]) if "fingerprint" in keys else None
            content = str(data["content"]) if "content" in keys else None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError) as err:
        return "corrupt", f"is unreadable or truncated ({type(err).__name__}: {err})"
    if stored is None:
        return "stale", "has no fingerprint (written by an older mmspec or another tool)"
    fields = diff_fields(stored, expected)
    if fields and set(fields) <= set(_PLACE):
        return "corrupt", f"holds the images of another shard: {describe(stored, expected, fields)}"
    if fields:
        return "stale", f"was made by other weights or settings: {describe(stored, expected, fields)}"
    n = expected["stop"] - expected["start"]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[0] != n or labels.shape != (n,):
        return "corrupt", f"holds images {images.shape} {images.dtype} and labels {labels.shape}, expected {n} of each"
    want = np.arange(expected["start"], expected["stop"]) % expected["num_classes"]
    if not np.array_equal(labels, want):
        return "corrupt", "has labels that are not image index % num_classes"
    if content != array_hash(images, labels):
        return "corrupt", "does not match its checksum (images or labels changed after writing)"
    return None


def _to_uint8(images: torch.Tensor) -> np.ndarray:
    """Float images `[B, C, H, W]` in [0, 1] -> uint8 `[B, H, W, C]`."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def sample_shards(pipe, out_dir, *, num_images: int, shard_size: int = 100, batch_size: int = 50, seed: int = 0,
                  call_kwargs: dict | None = None, rank: int = 0, world_size: int = 1, manifest_extra: dict | None = None,
                  progress: bool = True, weights: str | None = None, overwrite: bool = False) -> list[int]:  # fmt: skip
    """Sample the missing shards of this rank into `out_dir`; returns the shards this call wrote.

    Args:
        pipe: an image pipeline with `class_labels`, `generator` (a list, one per image), `output_type="pt"`.
        out_dir: the run's folder (created).
        num_images, shard_size, batch_size: run size, images per shard file, images per pipeline call.
        seed: run seed (image `i` uses `image_seed(seed, i)`).
        call_kwargs: the method and its knobs (`acceptance`, `drafter`, `guidance_scale`, ...), recorded in the
            manifest.
        rank, world_size: this process's share of the shards.
        manifest_extra: more settings that determine the images (e.g. the model folder), recorded and checked.
        weights: the pipeline's weights hash (`mmspec.eval.fingerprint.pipeline_weights_hash`), if already known.
        overwrite: recompute shards made by other weights or settings (with a warning) instead of refusing them.

    Raises:
        StaleArtefactError: (a ValueError) a shard or the manifest on disk was made by other weights or settings,
            naming the file and the differing fields (nothing is sampled then).
    """
    from tqdm.auto import tqdm

    from mmspec.eval.fingerprint import StaleArtefactError, array_hash, encode

    for name, value, low in (("num_images", num_images, 1), ("shard_size", shard_size, 1),
                             ("batch_size", batch_size, 1), ("world_size", world_size, 1), ("rank", rank, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    call_kwargs = dict(call_kwargs or {})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = run_fingerprint(pipe, seed=seed, call_kwargs=call_kwargs, weights=weights)
    sampling = dict(num_images=num_images, shard_size=shard_size, **base, **(manifest_extra or {}))
    manifest = dict(sampling=json.loads(json.dumps(sampling, default=str)), seed_rule="seed * 1000003 + image index",
                    labels_rule="image index % num_classes")  # fmt: skip
    if rank == 0:
        _check_manifest(out_dir, manifest, overwrite)
    device = pipe._execution_device
    n_classes = pipe.transformer.config.num_classes
    todo = []
    for s in range(rank, _num_shards(num_images, shard_size), world_size):  # check every shard before sampling
        path = shard_path(out_dir, s)
        problem = _shard_problem(path, _shard_fingerprint(base, s, shard_size, num_images)) if path.is_file() else None
        if problem is not None and problem[0] == "stale" and not overwrite:
            raise StaleArtefactError(
                f"{path} {problem[1]}; use a new folder (--out), the settings it was made with, or --overwrite to "
                "recompute it"
            )
        if problem is not None:
            logger.warning("%s %s: recomputing it", path, problem[1])
        if problem is not None or not path.is_file():
            todo.append(s)
    written = []
    for s in tqdm(todo, desc=f"shards (rank {rank})", unit="shard", disable=not progress):
        index = range(s * shard_size, min((s + 1) * shard_size, num_images))
        images, labels = [], []
        for start in range(0, len(index), batch_size):
            ids = list(index[start : start + batch_size])
            gens = [torch.Generator(device=device).manual_seed(image_seed(seed, i)) for i in ids]
            batch_labels = [i % n_classes for i in ids]
            out = pipe(class_labels=batch_labels, generator=gens, output_type="pt", **call_kwargs)
            images.append(_to_uint8(out.images))
            labels += batch_labels
        path = shard_path(out_dir, s)
        tmp = path.with_name(path.stem + ".tmp.npz")
        images, labels = np.concatenate(images), np.asarray(labels, dtype=np.int64)
        np.savez(tmp, images=images, labels=labels, content=np.str_(array_hash(images, labels)),
                 fingerprint=encode(_shard_fingerprint(base, s, shard_size, num_images)))  # fmt: skip
        os.replace(tmp, path)  # atomic: a killed run never leaves a partial shard
        written.append(s)
    return written


def load_shards(
    out_dir, num_images: int, shard_size: int, fingerprint: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """All images (uint8 `[N, H, W, C]`) and labels `[N]` of a finished run, in image order.

    Every shard is checked (readable, labels, checksum) and, given `fingerprint` (`run_fingerprint` of the run),
    that it was made by that run; a bad shard is a ValueError naming the file."""
    from mmspec.eval.fingerprint import StaleArtefactError

    missing = missing_shards(out_dir, num_images, shard_size)
    if missing:
        raise ValueError(f"out_dir={str(out_dir)!r} misses shards {missing[:5]}{'...' if len(missing) > 5 else ''}")
    images, labels = [], []
    for s in range(_num_shards(num_images, shard_size)):
        path = shard_path(out_dir, s)
        if fingerprint is not None:
            problem = _shard_problem(path, _shard_fingerprint(fingerprint, s, shard_size, num_images))
            if problem is not None:
                kind = StaleArtefactError if problem[0] == "stale" else ValueError
                raise kind(f"{path} is {problem[0]}: it {problem[1]}; rerun the command to recompute it")
        try:
            with np.load(path, allow_pickle=False) as data:
                images.append(data["images"])
                labels.append(data["labels"])
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError) as err:
            raise ValueError(f"{path} is corrupt ({err}); rerun the command to recompute it") from err
    return np.concatenate(images), np.concatenate(labels)
