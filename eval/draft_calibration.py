"""How well a draft LM predicts its target, and whether its own confidence says when: teacher-forced along the
target's greedy answers.

For each (image, prompt) the target answers greedily (the pipeline's plain decoding); the draft LM then reads the
prompt and the whole answer in one forward, and at every answer position its argmax (over the FR-Spec draft
vocabulary when one is given) is compared with the target's token there. A greedy chain drafted from a correct
prefix is accepted exactly where the two agree, so the agreement is the draft's per-token acceptance along the
target's own text, and the acceptance by bin of the draft's raw probability (of its argmax) is what a confidence
stop (`draft_length="confidence"`, transformers' `assistant_confidence_threshold`) or the calibrated stop
(`"calibrated"`) can read. docs/benchmarks.md quotes it for the VLM zoo's draft LM."""

import torch


__all__ = ["draft_calibration"]


@torch.no_grad()
def draft_calibration(pipe, images, prompt: str, max_new_tokens: int = 96, draft_vocab=None, bins: int = 10) -> dict:
    """`{"tokens", "agreement", "bins": [{"low", "high", "drafts", "accepted", "rate"}, ...]}` over the answers to
    `prompt` about each of `images` (`pipe`: a `SpeculativeVLMPipeline` with a `draft_model`; one answer at a time,
    so no padding enters the draft's forward). `draft_vocab`: the FR-Spec vocabulary the draft scores (None: all)."""
    if pipe.draft_model is None:
        raise ValueError("pipe has no draft_model to calibrate")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be an int >= 1, got {bins!r}")
    device = pipe.device
    drafts, accepted = torch.zeros(bins), torch.zeros(bins)
    for image in images:
        out = pipe(images=[image], prompt=[prompt], max_new_tokens=max_new_tokens, acceptance="none",
                   output_type="ids")  # fmt: skip
        answer = torch.tensor([t for t in out.sequences[0].tolist() if t >= 0], device=device)
        ids, lengths, extra = pipe.encode([image], [prompt], None, device)
        n = int(lengths[0])
        full = torch.cat([ids[0, :n], answer])[None]
        logits = pipe.draft_model(input_ids=full, attention_mask=torch.ones_like(full), **extra).logits[0]
        logits = logits[n - 1 : n - 1 + answer.numel()].float()  # the logits that predict each answer token
        if draft_vocab is not None:
            vocab = torch.as_tensor(draft_vocab, device=device)
            probs, index = logits[:, vocab].softmax(-1).max(-1)
            guess = vocab[index]
        else:
            probs, guess = logits.softmax(-1).max(-1)
        which = (probs * bins).long().clamp(0, bins - 1).cpu()
        drafts += torch.bincount(which, minlength=bins).float()
        accepted += torch.bincount(which, weights=(guess == answer).float().cpu(), minlength=bins)
    total = float(drafts.sum())
    return {
        "tokens": int(total),
        "agreement": float(accepted.sum()) / total if total else None,
        "bins": [
            {
                "low": b / bins,
                "high": (b + 1) / bins,
                "drafts": int(drafts[b]),
                "accepted": int(accepted[b]),
                "rate": float(accepted[b] / drafts[b]) if drafts[b] else None,
            }  # fmt: skip
            for b in range(bins)
        ],
    }
