"""Layer-truncated draft models for transformers targets: the first `num_layers` decoder layers of the target's
language model + its final norm, token embedding and output head (shared tokenizer by construction), and for a LLaVA
target the same vision tower and projector -- the classic self-derived draft LM (e.g. 4 of SmolLM2's 30 layers),
which `python -m mmspec.train vlm-draft` then fine-tunes by distillation.

A zoo draft folder stores only what differs from the target (`draft.json`: `num_layers`, `trained`: the parameter
names that were fine-tuned, + `model.safetensors` with exactly those tensors), so the language model is never copied.
"""

import copy
import json
import logging
from pathlib import Path

import torch

from mmspec.models.hf.inputs import decoder_of
from mmspec.models.storage import read_weights, write_weights


logger = logging.getLogger(__name__)

__all__ = ["load_vlm_draft", "save_draft_delta", "truncated_draft"]


def truncated_draft(target, num_layers: int):
    """A copy of `target` (causal LM or LLaVA) keeping decoder layers `0 .. num_layers - 1` (parameters copied, so
    fine-tuning the draft never touches the target)."""
    total = target.config.get_text_config().num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < total:
        raise ValueError(
            f"num_layers must be an int in [1, {total}) (the target has {total} layers), got {num_layers!r}"
        )
    layers = decoder_of(target).layers
    decoder_of(target).layers = layers[:num_layers]  # deep-copy only what the draft keeps
    try:
        draft = copy.deepcopy(target)
    finally:
        decoder_of(target).layers = layers
    draft.config.get_text_config().num_hidden_layers = num_layers
    draft.config._name_or_path = ""  # not the target's folder (`load_vlm_draft` records the draft's own)
    if hasattr(draft.config.get_text_config(), "layer_types") and draft.config.get_text_config().layer_types:
        text = draft.config.get_text_config()
        text.layer_types = text.layer_types[:num_layers]
    return draft.eval()


def save_draft_delta(draft, folder, trained: list[str], num_layers: int, extra: dict | None = None,
                     storage: str = "float16"):  # fmt: skip
    """Write `draft.json` + `model.safetensors` (stored as `storage`: float16 by default, or int8 / int4, see
    `mmspec.models.storage`) holding only the `trained` parameters of `draft`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = dict(draft.named_parameters())
    missing = [n for n in trained if n not in state]
    if missing:
        raise ValueError(f"trained names not in the draft: {missing[:3]}")
    write_weights({n: state[n].detach() for n in trained}, folder / "model.safetensors", storage)
    (folder / "draft.json").write_text(json.dumps({"num_layers": num_layers, "trained": trained, **(extra or {})}))


def load_vlm_draft(folder, target):
    """The zoo draft: `truncated_draft(target, num_layers)` with the fine-tuned tensors of `folder` loaded strictly
    (every listed tensor present with the right shape; a corrupt file is a ValueError naming it)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "draft.json").read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("trained"), list):
            raise ValueError("no 'trained' list")
        num_layers = meta["num_layers"]
    except (OSError, ValueError, KeyError, UnicodeDecodeError) as err:
        raise ValueError(f"{folder / 'draft.json'}: not a readable draft description ({err!r})") from err
    weights = read_weights(folder / "model.safetensors")  # ValueError naming the file; storage dequantised
    try:
        draft = truncated_draft(target, num_layers)
    except ValueError as err:
        raise ValueError(f"{folder / 'draft.json'}: {err}") from err
    params = dict(draft.named_parameters())
    if sorted(weights) != sorted(meta["trained"]):
        raise ValueError(f"{folder / 'model.safetensors'}: tensors do not match draft.json's 'trained' list")
    with torch.no_grad():
        for name, value in weights.items():
            if name not in params:
                raise ValueError(f"{folder / 'model.safetensors'}: {name} is not a tensor of the draft ({num_layers} "
                                 "of the target's layers)")  # fmt: skip
            if params[name].shape != value.shape:
                raise ValueError(f"{folder / 'model.safetensors'}: {name} {tuple(value.shape)} does not fit the draft "
                                 f"of this target (expected {tuple(params[name].shape)}, found "
                                 f"{tuple(value.shape)}): a draft made for another model?")  # fmt: skip
            if not value.is_floating_point() or not torch.isfinite(value).all():
                raise ValueError(f"{folder / 'model.safetensors'}: {name} is not a finite floating-point tensor")
            params[name].copy_(value.to(params[name].dtype))
    draft.config._name_or_path = str(folder)  # the pipeline's checks name it (`mmspec.drafters.compat`)
    return draft
