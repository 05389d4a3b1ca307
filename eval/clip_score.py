"""CLIP score of generated images against their prompts, through torchmetrics' `CLIPScore`, with the protocol recorded.

torchmetrics 1.9 computes, over N (image, prompt) pairs,

    CLIP score = max(100 * mean_i cos(E_image_i, E_text_i), 0)

with E the projected CLIP embeddings (note: the clamp at 0 applies to the mean, not to each pair as the formula in
its docstring suggests). Images reach the model through the CLIP processor, which expects pixel values in [0, 255]
(it rescales by 1/255 itself): float [0, 1] images are rounded to uint8 first, as when saved to PNG; then it
resizes the shortest edge (bicubic), center-crops to the model's input size and normalises with the CLIP mean / std.
Prompts longer than the text model's context (77 tokens) are truncated by the tokenizer with the end-of-text token
kept (torchmetrics alone would cut the token ids, end-of-text token included).

Two incompatibilities are handled here:
- transformers 5 returns a `BaseModelOutputWithPooling` from `get_image_features` / `get_text_features` where
  torchmetrics 1.9 expects the embedding tensor; `CLIPFeatureAdapter` returns the tensor (its `pooler_output`).
- No CLIP weights can be downloaded offline, and torchmetrics loads a model name from the hub. `load_clip` takes a
  hub name (online) or a local folder; `tiny_random_clip` builds a tiny random CLIP for tests and plumbing, with the
  real CLIP tokenizer built from the BPE file shipped in `open-clip-torch` (`pip install --no-deps open-clip-torch`;
  the package is never imported, only its data file is read).

Examples:
    >>> result = compute_clip_score(images, prompts)  # openai/clip-vit-base-patch16 from the hub (online)
    >>> result = compute_clip_score(images, prompts, "path/to/clip-folder")  # a local CLIP model + processor
    >>> result["clip_score"], result["protocol"]
    >>> compute_clip_score(images, prompts, tiny_random_clip(seed=0))  # random weights: plumbing only
"""

import gzip
import importlib.util
import json
import logging
import tempfile
from pathlib import Path

import torch
from torch import nn

from mmspec.eval.inception import to_uint8_rgb
from mmspec.eval.package_files import package_file


logger = logging.getLogger(__name__)

DEFAULT_CLIP = "openai/clip-vit-base-patch16"
OPEN_CLIP_PACKAGE = "open-clip-torch"
OPEN_CLIP_BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
CLIP_CONTEXT_LENGTH = 77
CLIP_VOCAB_SIZE = 49408  # 256 bytes + 256 bytes with "</w>" + 48,894 merges + 2 special tokens
SCORE_FORMULA = "max(100 * mean_i cos(E_image_i, E_text_i), 0) (torchmetrics CLIPScore; clamp on the mean)"
_NUM_MERGES = CLIP_VOCAB_SIZE - 2 * 256 - 2
_START, _END = "<|startoftext|>", "<|endoftext|>"


# --- tokenizer from open_clip's BPE file -------------------------------------------------------------------------


def open_clip_bpe_path() -> Path:
    """Path of the CLIP BPE merges file inside the installed `open-clip-torch` package (located, never imported)."""
    missing = (f"the CLIP tokenizer is built from the BPE file shipped in {OPEN_CLIP_PACKAGE}: pip install --no-deps "
               f"{OPEN_CLIP_PACKAGE}==3.3.0 (the package is not imported, its dependencies are not needed)")  # fmt: skip
    return package_file("open_clip", OPEN_CLIP_BPE_FILE, missing, OPEN_CLIP_PACKAGE)


def byte_symbols() -> list[str]:
    """The 256 byte symbols of byte-level BPE (GPT-2 / CLIP) in vocabulary order.

    Printable Latin-1 bytes ('!'-'~', '¡'-'¬', '®'-'ÿ') stand for themselves and come first; the other 68 bytes
    (controls, space, soft hyphen, ...) follow in byte order as the characters chr(256), chr(257), ...
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in set(printable)]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def clip_bpe_vocab_and_merges(bpe_path: str | Path | None = None) -> tuple[dict[str, int], list[str]]:
    """(token -> id for all 49,408 tokens, merges as "a b" lines in rank order) from a CLIP BPE merges file."""
    path = open_clip_bpe_path() if bpe_path is None else Path(bpe_path)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = lines[1 : _NUM_MERGES + 1]  # line 0 is a header
    if len(merges) != _NUM_MERGES or any(len(m.split()) != 2 for m in merges):
        raise ValueError(f"{path} is not a CLIP BPE file: expected {_NUM_MERGES} 'a b' merge lines after the header")
    symbols = byte_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + [m.replace(" ", "") for m in merges] + [_START, _END]
    return {token: i for i, token in enumerate(tokens)}, merges


def clip_tokenizer_from_open_clip(cache_dir: str | Path | None = None):
    """The real CLIP tokenizer (transformers `CLIPTokenizer`, 49,408 tokens, 77-token context), offline.

    The ids equal OpenAI CLIP's / open_clip's ("a photo of a cat" -> [49406, 320, 1125, 539, 320, 2368, 49407]);
    padding uses the end-of-text token, as the hub CLIP tokenizers do.

    Args:
        cache_dir: folder that keeps `vocab.json` and `merges.txt` (written when missing, reused otherwise); None
            builds them in a temporary folder.
    """
    from transformers import CLIPTokenizer

    def load(folder: Path):
        if not ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
            vocab, merges = clip_bpe_vocab_and_merges()
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
            (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        return CLIPTokenizer.from_pretrained(str(folder), model_max_length=CLIP_CONTEXT_LENGTH)

    if cache_dir is not None:
        tokenizer = load(Path(cache_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="mmspec-clip-tokenizer-") as tmp:
            tokenizer = load(Path(tmp))
    if len(tokenizer) != CLIP_VOCAB_SIZE:
        raise ValueError(f"CLIP tokenizer has {len(tokenizer)} tokens, expected {CLIP_VOCAB_SIZE}")
    return tokenizer


# --- model adapter and loaders -----------------------------------------------------------------------------------


def _embedding_tensor(output, method: str) -> torch.Tensor:
    if isinstance(output, torch.Tensor):  # transformers < 5
        return output
    pooled = getattr(output, "pooler_output", None)  # transformers >= 5: BaseModelOutputWithPooling
    if isinstance(pooled, torch.Tensor):
        return pooled
    raise TypeError(f"{method} returned {type(output).__name__}, expected a tensor or an output with pooler_output")


class CLIPFeatureAdapter(nn.Module):
    """A CLIP model whose `get_image_features` / `get_text_features` return the projected embeddings [B, d].

    What torchmetrics' `CLIPScore` reads from its model: those two methods, `config` (for the text context length)
    and `.to(device)`. Floating inputs are cast to the model's dtype (fp16 / bf16 models take the processor's fp32
    pixels). The wrapped model is put in evaluation mode; `forward` calls it unchanged.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        if isinstance(model, CLIPFeatureAdapter):
            model = model.model
        for method in ("get_image_features", "get_text_features"):
            if not callable(getattr(model, method, None)):
                raise TypeError(f"model must have a {method} method (a CLIPModel), got {type(model).__name__}")
        self.model = model.eval()

    @property
    def config(self):
        return self.model.config

    def train(self, mode: bool = True) -> "CLIPFeatureAdapter":
        """Always stays in evaluation mode (a metric model is never trained)."""
        return super().train(False)

    def get_image_features(self, pixel_values: torch.Tensor, **kwargs) -> torch.Tensor:
        """pixel_values [B, 3, S, S] (processor output) -> image embeddings [B, projection_dim]."""
        param = next(self.model.parameters(), None)
        if param is not None and param.is_floating_point():
            pixel_values = pixel_values.to(param.dtype)
        out = self.model.get_image_features(pixel_values=pixel_values, **kwargs)
        return _embedding_tensor(out, "get_image_features")

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """input_ids, attention_mask [B, T] -> text embeddings [B, projection_dim]."""
        out = self.model.get_text_features(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return _embedding_tensor(out, "get_text_features")

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def load_clip(
    name_or_path: str | Path = DEFAULT_CLIP,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    use_safetensors: bool | None = None,
) -> tuple[CLIPFeatureAdapter, object]:
    """(adapted CLIP model, processor) from the hub (online) or a local folder (`save_pretrained` of both).

    Args:
        name_or_path: a hub id such as "openai/clip-vit-base-patch16" or a local folder.
        device, dtype: where the model goes and in which dtype (default: CPU, float32).
        use_safetensors: passed to `from_pretrained`; None loads `model.safetensors` when the checkpoint has one
            and otherwise the `.bin` file (read with `torch.load(weights_only=True)` by transformers); True refuses
            `.bin` files.
    """
    from transformers import CLIPModel, CLIPProcessor

    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"name_or_path must be a str or Path, got {type(name_or_path).__name__}")
    name = str(name_or_path)
    try:
        model = CLIPModel.from_pretrained(name, use_safetensors=use_safetensors)
        processor = CLIPProcessor.from_pretrained(name)
    except OSError as err:
        raise OSError(
            f"could not load CLIP {name!r}: {err}\nOffline, pass a local folder holding a CLIP model and its "
            "processor (or use tiny_random_clip() to test the plumbing)"
        ) from err
    model = model.to(device=device, dtype=dtype)
    logger.info("CLIP %s loaded (%s, %s)", name, next(model.parameters()).device, next(model.parameters()).dtype)
    return CLIPFeatureAdapter(model), processor


def _image_processor_class():
    # transformers 5 picks its torchvision backend for CLIPImageProcessor and, without torchvision, warns and falls
    # back to the PIL one; ask for the PIL one directly then.
    import transformers

    if importlib.util.find_spec("torchvision") is None and hasattr(transformers, "CLIPImageProcessorPil"):
        return transformers.CLIPImageProcessorPil
    return transformers.CLIPImageProcessor


@torch.no_grad()
def _init_from_generator(model: nn.Module, generator: torch.Generator, logit_scale: float) -> None:
    """Re-initialise every parameter from `generator`: LayerNorm (1, 0), other biases 0, `logit_scale` its config
    value, every other tensor normal(0, fan_in^-1/2) (fan_in = product of all but the first dimension, 1 for
    vectors such as the class embedding)."""
    norms = {p for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters(recurse=False)}
    for name, param in model.named_parameters():
        if param in norms:
            param.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name == "logit_scale":
            param.fill_(logit_scale)
        elif name.endswith("bias"):
            param.zero_()
        else:
            fan_in = param[0].numel() if param.dim() > 1 else 1
            param.copy_(torch.randn(param.shape, generator=generator) * fan_in**-0.5)


def tiny_random_clip(seed: int = 0, cache_dir: str | Path | None = None) -> tuple[CLIPFeatureAdapter, object]:
    """(adapted tiny random `CLIPModel`, `CLIPProcessor` with the real tokenizer): tests and offline plumbing only.

    Text: 49,408-token vocabulary, 77 positions, width 32, 2 layers, 2 heads. Vision: 32x32 images, 8x8 patches,
    width 32, 2 layers. Projection 16. The weights depend only on `seed` (drawn from a local `torch.Generator`; the
    global RNG is left untouched). The processor resizes the shortest edge to 32 and center-crops 32x32.

    Args:
        seed: seed of the weights.
        cache_dir: see `clip_tokenizer_from_open_clip`.
    """
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    tokenizer = clip_tokenizer_from_open_clip(cache_dir)
    width = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), max_position_embeddings=CLIP_CONTEXT_LENGTH,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **width),
        vision_config=dict(image_size=32, patch_size=8, **width),
        projection_dim=16,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # the constructor's own init draws from the global RNG
        model = CLIPModel(config)
    _init_from_generator(model, torch.Generator().manual_seed(seed), config.logit_scale_init_value)
    model.config._name_or_path = f"tiny-random-clip (seed {seed}; random weights, plumbing only)"
    size = config.vision_config.image_size
    image_processor = _image_processor_class()(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return CLIPFeatureAdapter(model), CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


# --- the metric --------------------------------------------------------------------------------------------------


class _TruncatingProcessor:
    """The processor, with prompts truncated by the tokenizer to the text context (end-of-text token kept)."""

    def __init__(self, processor, max_length: int):
        self.processor, self.max_length = processor, max_length

    def __call__(self, text=None, images=None, **kwargs):
        if text is not None:
            kwargs.update(truncation=True, max_length=self.max_length)
        return self.processor(text=text, images=images, **kwargs)


def _image_protocol(processor) -> dict:
    ip = getattr(processor, "image_processor", None)
    if ip is None:
        return {"image_processor": type(processor).__name__, "image_size": None, "resize": "unknown"}
    resample = getattr(ip, "resample", None)
    try:
        from PIL import Image

        resample = Image.Resampling(int(resample)).name.lower()
    except (TypeError, ValueError):
        resample = str(resample)
    size, crop = getattr(ip, "size", None) or {}, getattr(ip, "crop_size", None) or {}
    edge = size.get("shortest_edge", size)
    steps = []
    if getattr(ip, "do_resize", False):
        steps.append(f"resize shortest edge to {edge} ({resample})")
    if getattr(ip, "do_center_crop", False):
        steps.append(f"center crop {crop.get('height')}x{crop.get('width')}")
    if getattr(ip, "do_rescale", False):
        steps.append(f"x * {getattr(ip, 'rescale_factor', 1 / 255):.6g}")
    if getattr(ip, "do_normalize", False):
        steps.append(f"normalize mean {list(ip.image_mean)} std {list(ip.image_std)}")
    return {
        "image_processor": type(ip).__name__,
        "image_size": crop.get("height") if getattr(ip, "do_center_crop", False) else edge,
        "resize": "; ".join(steps),
    }


def _check_prompts(prompts, n: int) -> list[str]:
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of {n} strings (one per image), got {type(prompts).__name__}")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise TypeError(f"prompts must all be strings; prompts[{bad[0]}] is {type(prompts[bad[0]]).__name__}")
    if len(prompts) != n:
        raise ValueError(f"prompts has {len(prompts)} entries but images has {n}: one prompt per image")
    return list(prompts)


@torch.no_grad()
def compute_clip_score(
    images: torch.Tensor,
    prompts,
    model_and_processor=None,
    batch_size: int = 64,
    model_name: str | None = None,
) -> dict:
    """CLIP score of `images` against `prompts` (torchmetrics `CLIPScore`), with the protocol.

    Args:
        images: tensor [N, C, H, W], C in (1, 3) (grayscale is repeated to 3 channels), uint8 [0, 255] or float
            [0, 1] (rounded to uint8); any size (the processor resizes and crops). Moved to the model's device.
        prompts: list of N strings, the prompt of each image.
        model_and_processor: None (`DEFAULT_CLIP` from the hub), a hub id or local folder (`load_clip`), or a
            (model, processor) pair such as `load_clip(...)` or `tiny_random_clip()`; a bare `CLIPModel` is
            wrapped in `CLIPFeatureAdapter`. A name is loaded on every call: to score several image sets, load
            once with `load_clip` and pass the pair.
        batch_size: pairs per CLIP forward.
        model_name: recorded in the protocol (default: the hub id / folder, or the model config's name).

    Returns:
        {"clip_score": float in [0, 100], "num_samples": N, "protocol": dict}.
    """
    from torchmetrics.multimodal.clip_score import CLIPScore

    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    pixels = to_uint8_rgb(images, "images")  # [N, 3, H, W] uint8; checks shape, dtype and range
    channels = "1 (grayscale) repeated to 3" if images.shape[1] == 1 else "3"
    input_kind = "uint8 [0, 255]" if images.dtype == torch.uint8 else "float [0, 1] -> round(x * 255) as uint8"
    n = pixels.shape[0]
    prompts = _check_prompts(prompts, n)

    if model_and_processor is None or isinstance(model_and_processor, (str, Path)):
        model_name = model_name or str(model_and_processor or DEFAULT_CLIP)
        model, processor = load_clip(model_and_processor or DEFAULT_CLIP)
    elif isinstance(model_and_processor, (tuple, list)) and len(model_and_processor) == 2:
        model, processor = model_and_processor
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_and_processor[0] must be a CLIP nn.Module, got {type(model).__name__}")
        if not callable(processor):
            raise TypeError(f"model_and_processor[1] must be a CLIP processor, got {type(processor).__name__}")
        model = CLIPFeatureAdapter(model)
    else:
        raise TypeError(
            "model_and_processor must be None, a hub id / local folder or a (model, processor) pair, "
            f"got {type(model_and_processor).__name__}"
        )
    config = model.config
    model_name = model_name or getattr(config, "_name_or_path", None) or type(model.model).__name__
    max_length = int(getattr(getattr(config, "text_config", config), "max_position_embeddings", CLIP_CONTEXT_LENGTH))
    device = next(model.parameters(), torch.empty(0)).device

    metric = CLIPScore(model_name_or_path=lambda: (model, _TruncatingProcessor(processor, max_length)))
    metric.to(device)  # the metric moves its model to the images' device; keep both on the model's device
    for start in range(0, n, batch_size):
        metric.update(pixels[start : start + batch_size].to(device), prompts[start : start + batch_size])
    score = float(metric.compute())

    protocol = {
        "metric": "CLIP score",
        "model": model_name,
        **_image_protocol(processor),
        "input": input_kind,
        "channels": channels,
        "text": f"{type(getattr(processor, 'tokenizer', processor)).__name__}, truncated to {max_length} tokens "
        "(end-of-text kept)",
        "score": SCORE_FORMULA,
        "backend": f"torchmetrics {_version('torchmetrics')} CLIPScore, transformers {_version('transformers')}",
        "num_samples": n,
    }
    logger.info("CLIP score %.4f (%d pairs, %s)", score, n, model_name)
    return {"clip_score": score, "num_samples": n, "protocol": protocol}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"
