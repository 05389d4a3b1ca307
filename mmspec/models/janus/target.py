"""`JanusTarget`: a transformers `JanusForConditionalGeneration` (Janus / Janus-Pro) generating images, as a target of
the decoding loop (`mmspec.decoding.target.Target`).

Janus' image mode (transformers' `generate(generation_mode="image")`) is a plain AR loop over its Llama decoder:
the prompt (chat turn + the tokenizer's begin-of-image token) is embedded as text, every image token after it is
embedded by `prepare_embeddings_for_image_generation` (generation embeddings + aligner MLP), and the image-token
logits come from `model.model.generation_head`, not the LM head; `num_image_tokens` tokens (576 for 384 px), decoded
by the VQ (`decode_image_tokens`). Classifier-free guidance runs both streams as rows `[cond; uncond]`, the
unconditional prompt being the prompt with every token but BOS and BOI replaced by the pad token (same attention
mask), and guides the raw generation-head logits before temperature / top-k / top-p, as transformers does.

This adapter is `mmspec.models.hf.target.HFTarget` (static KV cache, chains and trees, attention windows, right-aligned
ragged prompts) with its hooks set: image-token embeddings in, generation-head logits out, CFG rows through
`mmspec.decoding.guidance.Guidance`. Left-padded prompts (the processor pads left) are right-aligned per row
(`right_align`): each row's positions are those of its unpadded prompt, as transformers derives them from the mask.
"""

import torch
from torch import Tensor

from mmspec.counting import on_host
from mmspec.decoding.guidance import Guidance
from mmspec.decoding.target import TargetOutput
from mmspec.models.hf.target import HFTarget, right_align


__all__ = ["JanusTarget", "special_token_ids"]


def special_token_ids(model, tokenizer=None) -> dict[str, int]:
    """BOS, BOI (begin of image) and pad ids of a Janus model, from its generation config as transformers reads
    them (`bos_token_id`, `generation_kwargs["boi_token_id"]`, `pad_token_id`); where the config lacks one, from
    `tokenizer` (its `bos_token_id`, `boi_token`, `pad_token_id`). Still missing, or a config id that is not the
    tokenizer's (the processor writes the tokenizer's tokens, the CFG null prompt keeps the config's): a ValueError
    naming them."""
    g = model.generation_config
    ids = {"bos_token_id": g.bos_token_id, "boi_token_id": (getattr(g, "generation_kwargs", None) or {}).get("boi_token_id"),
           "pad_token_id": g.pad_token_id}  # fmt: skip
    if tokenizer is not None:
        boi = getattr(tokenizer, "boi_token", None)
        known = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id,
                 "boi_token_id": None if boi is None else tokenizer.convert_tokens_to_ids(boi)}  # fmt: skip
        differ = [f"{k}={v} (the tokenizer's: {known[k]})" for k, v in ids.items()
                  if v is not None and known[k] is not None and v != known[k]]  # fmt: skip
        if differ:
            raise ValueError(f"{type(model).__name__}: the generation config's {', '.join(differ)} disagree with the "
                             "tokenizer: prompts carry the tokenizer's tokens, the CFG null prompt keeps the config's "
                             "(boi_token_id lives in generation_kwargs)")  # fmt: skip
        ids = {k: known[k] if v is None else v for k, v in ids.items()}
    missing = [name for name, value in ids.items() if not isinstance(value, int) or isinstance(value, bool)]
    if missing:
        raise ValueError(f"{type(model).__name__}: the generation config (and tokenizer) lack {', '.join(missing)}, "
                         "needed for the unconditional CFG prompt (boi_token_id lives in generation_kwargs)")  # fmt: skip
    return ids


class JanusTarget(HFTarget):
    """A `JanusForConditionalGeneration` generating image tokens (see the module docstring).

    Args:
        model: the Janus model (eval mode).
        guidance: the call's `Guidance`: one stream at `guidance_scale == 1`, rows `[cond; uncond]` otherwise.
        special_ids: `bos_token_id`, `boi_token_id`, `pad_token_id` (default: `special_token_ids(model)`).
    """

    supports_guidance = True

    def __init__(self, model, guidance: Guidance, special_ids: dict[str, int] | None = None):
        super().__init__(model, guidance)
        self.special_ids = special_token_ids(model) if special_ids is None else dict(special_ids)
        self.vocab_size = model.model.generation_head.vision_head.out_features
        self.num_image_tokens = int(model.model.vision_model.config.num_image_tokens)

    def token_inputs(self, tokens: Tensor) -> dict:
        return {"inputs_embeds": self.model.prepare_embeddings_for_image_generation(tokens)}

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.model.generation_head(hidden)

    def unconditional_ids(self, input_ids: Tensor) -> Tensor:
        """The CFG-free prompt: every token but BOS and BOI replaced by the pad token (as transformers)."""
        s = self.special_ids
        keep = (input_ids == s["bos_token_id"]) | (input_ids == s["boi_token_id"])
        return torch.where(keep, input_ids, s["pad_token_id"])

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None, num_tokens: int, scratch: int,
                return_hidden: bool = False) -> TargetOutput:  # fmt: skip
        """Write every row's prompt (any-side padded `input_ids [B, L]`, `attention_mask [B, L]`, 1 = token; with
        guidance on also the unconditional prompt) and return the first image token's distribution (validated)."""
        pad = self.special_ids["pad_token_id"]
        if self.guidance.streams == 2:
            input_ids = torch.cat([input_ids, self.unconditional_ids(input_ids)])
            attention_mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
        if attention_mask is None or attention_mask.shape != input_ids.shape:  # (a mismatch: `right_align` refuses)
            ids, mask = input_ids.cpu(), None if attention_mask is None else attention_mask.cpu()
        else:  # one copy to the host (free for the processor's host tensors), then host-side bookkeeping
            ids, mask = torch.stack([input_ids, attention_mask.to(input_ids.dtype)]).cpu().unbind(0)
        with on_host():
            ids, lengths = right_align(ids, mask, pad)
        return super().prefill(ids.to(self.model.device), lengths.to(self.model.device), num_tokens, scratch,
                               return_hidden=return_hidden)  # fmt: skip
