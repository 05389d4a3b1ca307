"""How uncertain a class-conditional image GPT is about its next token: the statistics that place an image zoo in a
speculative method's regime (SJD-PAC and LANTERN target high-entropy image tokens, as Lumina-mGPT's with top-k 2000;
a flat MNIST background is the opposite).

Measured teacher-forced on held-out token grids with their true class, at temperature 1, no top-k and no guidance:
for every position, the target's next-token distribution p gives its entropy, its top-1 probability, and `k90`, the
number of most likely tokens needed to cover 90 % of p. Averages run over all positions of all grids.
"""

import math

import torch


__all__ = ["next_token_stats"]


def _summaries(probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position entropy (nats), top-1 probability and k90 of `probs` [..., V]."""
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    ranked = probs.sort(dim=-1, descending=True).values
    k90 = (ranked.cumsum(-1) < 0.9).sum(-1) + 1
    return {"entropy": entropy, "top1": ranked[..., 0], "k90": k90.float()}


@torch.no_grad()
def next_token_stats(model, codes: torch.Tensor, labels: torch.Tensor, batch_size: int = 100) -> dict[str, float]:
    """Next-token statistics of a `LlamaGenGPT` c2i `model` on `codes` [N, T] (int) with classes `labels` [N].

    Returns:
        `entropy_nats` / `entropy_bits` (mean per-token entropy), `top1_prob` (mean top-1 probability),
        `k90_mean` / `k90_median` (tokens needed to cover 90 % of p), `frac_top1_above_0.9` (share of positions the
        target is nearly sure of), `vocab` and `positions` (how many were averaged).

    Raises:
        ValueError: `codes` and `labels` disagree in length, or `codes` is empty.
    """
    if len(codes) != len(labels) or len(codes) == 0:
        raise ValueError(f"codes ({len(codes)}) and labels ({len(labels)}) must be non-empty and of equal length")
    model.eval()
    parts: dict[str, list[torch.Tensor]] = {"entropy": [], "top1": [], "k90": []}
    for start in range(0, len(codes), batch_size):
        x, y = codes[start : start + batch_size].long(), labels[start : start + batch_size].long()
        drop = torch.zeros(len(x), dtype=torch.bool)
        probs = model.forward_train(x, y, drop=drop).logits.float().softmax(-1)
        for name, value in _summaries(probs).items():
            parts[name].append(value.flatten())
    entropy, top1, k90 = (torch.cat(parts[name]) for name in ("entropy", "top1", "k90"))
    return {
        "entropy_nats": float(entropy.mean()),
        "entropy_bits": float(entropy.mean()) / math.log(2),
        "top1_prob": float(top1.mean()),
        "frac_top1_above_0.9": float((top1 > 0.9).float().mean()),
        "k90_mean": float(k90.mean()),
        "k90_median": float(k90.median()),
        "vocab": int(probs.shape[-1]),
        "positions": int(entropy.numel()),
    }
