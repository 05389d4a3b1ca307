"""Resumable, sharded sampling of many images with a pipeline, method and knobs: the first half of `mmspec eval fid`.

Image `i` of a run has class label `i % num_classes` and its own generator, seeded `seed * 1_000_003 + i` on the
model's device (`mmspec.random`: per-image generators make an image independent of its batch), so the images do not
depend on the shard size, the batch size, the number of ranks or on interruptions. Shard `s` holds images
`[s * shard_size, (s + 1) * shard_size)` as `shard_{s:05d}.npz` (`images` uint8 `[n, H, W, C]`, `labels` int64 `[n]`),
written atomically (temporary file, then rename): a killed run leaves only complete shards, and a rerun with the same
settings skips them. `manifest.json` records every setting that determines the images; a rerun with different
settings in the same folder is refused.

Ranks: under `torchrun` / `accelerate launch` (`WORLD_SIZE` > 1 in the environment) each rank takes the shards
`s % world_size == rank`; every image is sampled exactly once.
"""

import json
import logging
import os
from pathlib import Path

import numpy as np
import torch


logger = logging.getLogger(__name__)

__all__ = ["SEED_STRIDE", "image_seed", "load_shards", "missing_shards", "sample_shards", "shard_path"]

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


def _check_manifest(out_dir: Path, manifest: dict) -> None:
    path = out_dir / "manifest.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"out_dir={str(out_dir)!r}: manifest.json is not valid JSON ({err})") from err
        if old.get("sampling") != manifest["sampling"]:
            diff = {k for k in set(old.get("sampling", {})) | set(manifest["sampling"])
                    if old.get("sampling", {}).get(k) != manifest["sampling"].get(k)}  # fmt: skip
            raise ValueError(
                f"out_dir={str(out_dir)!r} holds shards of a run with other settings ({sorted(diff)}); "
                "use a new folder or the same settings to resume"
            )
    else:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        os.replace(tmp, path)


def _to_uint8(images: torch.Tensor) -> np.ndarray:
    """Float images `[B, C, H, W]` in [0, 1] -> uint8 `[B, H, W, C]`."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def sample_shards(pipe, out_dir, *, num_images: int, shard_size: int = 100, batch_size: int = 50, seed: int = 0,
                  call_kwargs: dict | None = None, rank: int = 0, world_size: int = 1, manifest_extra: dict | None = None,
                  progress: bool = True) -> list[int]:  # fmt: skip
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
    """
    from tqdm.auto import tqdm

    for name, value, low in (("num_images", num_images, 1), ("shard_size", shard_size, 1),
                             ("batch_size", batch_size, 1), ("world_size", world_size, 1), ("rank", rank, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    call_kwargs = dict(call_kwargs or {})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sampling = dict(num_images=num_images, shard_size=shard_size, seed=seed, call_kwargs=call_kwargs,
                    **(manifest_extra or {}))  # fmt: skip
    manifest = dict(sampling=json.loads(json.dumps(sampling, default=str)), seed_rule="seed * 1000003 + image index",
                    labels_rule="image index % num_classes")  # fmt: skip
    if rank == 0:
        _check_manifest(out_dir, manifest)
    device = pipe._execution_device
    n_classes = pipe.transformer.config.num_classes
    todo = [s for s in missing_shards(out_dir, num_images, shard_size) if s % world_size == rank]
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
        np.savez(tmp, images=np.concatenate(images), labels=np.asarray(labels, dtype=np.int64))
        os.replace(tmp, path)  # atomic: a killed run never leaves a partial shard
        written.append(s)
    return written


def load_shards(out_dir, num_images: int, shard_size: int) -> tuple[np.ndarray, np.ndarray]:
    """All images (uint8 `[N, H, W, C]`) and labels `[N]` of a finished run, in image order."""
    missing = missing_shards(out_dir, num_images, shard_size)
    if missing:
        raise ValueError(f"out_dir={str(out_dir)!r} misses shards {missing[:5]}{'...' if len(missing) > 5 else ''}")
    images, labels = [], []
    for s in range(_num_shards(num_images, shard_size)):
        try:
            with np.load(shard_path(out_dir, s)) as data:
                images.append(data["images"])
                labels.append(data["labels"])
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"{shard_path(out_dir, s)} is corrupt ({err}); delete it and resume") from err
    return np.concatenate(images), np.concatenate(labels)
