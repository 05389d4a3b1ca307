"""How uncertain a class-conditional image GPT is about its next token: the statistics that place an image zoo in a
speculative method's regime (SJD-PAC and LANTERN target high-entropy image tokens, as Lumina-mGPT's with top-k 2000;
a flat MNIST background is the opposite).

Measured teacher-forced on held-out token grids with their true class, at temperature 1, no top-k and no guidance:
for every position, the target's next-token distribution p gives its entropy, its top-1 probability, and `k90`, the
number of most likely tokens needed to cover 90 % of p. Averages run over all positions of all grids.

Entropy alone does not place a zoo in SJD's stall regime. Jacobi drafts a position from a stale guess of the tokens
before it, so what decides its acceptance is how much p moves when an earlier token changes: a near-uniform model
whose p hardly depends on the context accepts stale drafts as readily as a confident one. `stale_acceptance` measures
that directly: at a random position j of each grid, the token is redrawn from the model's own p, and the next
position's distribution before and after is compared, `sum_v min(p(v | x_<=j), p(v | x_<j, x'_j))`: the probability
that a draft sampled with a one-token-stale prefix is accepted (1 minus their total variation).

Before any training, `neighbour_information` bounds what a target can learn from its context: from the token grids
alone it gives the entropy of a token and its conditional entropy given the token to its left and the token above
(plug-in estimates from the bigram counts of a training split, scored on a held-out split). A tokenizer whose codes
carry almost no information about their neighbours yields a near-context-free target however long it trains: the
texture zoo's 512-code VQ has H(x) = 6.20 nats and H(x | left) = 6.06, 0.14 nats of information
(`docs/zoo.md`).
"""

import logging
import math

import torch


logger = logging.getLogger(__name__)

__all__ = ["held_out_next_token_stats", "neighbour_information", "next_token_stats", "stale_acceptance"]


def _summaries(probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position entropy (nats), top-1 probability and k90 of `probs` [..., V]."""
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    ranked = probs.sort(dim=-1, descending=True).values
    k90 = (ranked.cumsum(-1) < 0.9).sum(-1) + 1
    return {"entropy": entropy, "top1": ranked[..., 0], "k90": k90.float()}


def _pairs(codes: torch.Tensor, grid: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, token) pairs of row-major grids `codes` [N, grid * grid] at `offset` (1: left neighbour, `grid`:
    the one above), never across a row's start."""
    index = torch.arange(offset, grid * grid)
    if offset < grid:
        index = index[index % grid >= offset]
    return codes[:, index - offset].reshape(-1), codes[:, index].reshape(-1)


def neighbour_information(train: torch.Tensor, held_out: torch.Tensor, grid: int, vocab: int,
                          smoothing: float = 0.5) -> dict[str, float]:  # fmt: skip
    """How much a token tells about its neighbour, from token grids alone (module docstring): ``entropy`` H(x) and
    ``cond_entropy_left`` / ``cond_entropy_up`` (nats, H(x | left) and H(x | above)) as cross-entropies on `held_out`
    [M, grid * grid] of the unigram / bigram models counted on `train` [N, grid * grid], with add-`smoothing` counts;
    ``info_left`` / ``info_up`` are the differences (the nats a context of one neighbour can save, at most)."""
    train, held_out = train.long(), held_out.long()
    uni = torch.bincount(train.reshape(-1), minlength=vocab).double() + smoothing
    log_uni = (uni / uni.sum()).log()
    out = {"entropy": float(-log_uni[held_out.reshape(-1)].mean())}
    for name, offset in (("left", 1), ("up", grid)):
        ctx, tok = _pairs(train, grid, offset)
        joint = torch.bincount(ctx * vocab + tok, minlength=vocab * vocab).double().reshape(vocab, vocab) + smoothing
        log_cond = (joint / joint.sum(1, keepdim=True)).log()
        ctx, tok = _pairs(held_out, grid, offset)
        out[f"cond_entropy_{name}"] = float(-log_cond[ctx, tok].mean())
        out[f"info_{name}"] = out["entropy"] - out[f"cond_entropy_{name}"]
    return out


@torch.no_grad()
def stale_acceptance(model, codes: torch.Tensor, labels: torch.Tensor, generator: torch.Generator,
                     positions_per_row: int = 4, batch_size: int = 100) -> float:  # fmt: skip
    """Mean `sum_v min(p(v | x_<=j), p(v | x_<j, x'_j))` at position j + 1, over `positions_per_row` random positions
    j of every row of `codes` [N, T] (classes `labels` [N]), with x'_j drawn from the model's own p(. | x_<j); the
    positions and draws come from `generator`."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(codes), batch_size):
        x = codes[start : start + batch_size].long().repeat_interleave(positions_per_row, 0)
        y = labels[start : start + batch_size].long().repeat_interleave(positions_per_row, 0)
        drop = torch.zeros(len(x), dtype=torch.bool)
        probs = model.forward_train(x, y, drop=drop).logits.float().softmax(-1)  # [n, T, V]: p of token t
        rows = torch.arange(len(x))
        j = torch.randint(0, x.shape[1] - 1, (len(x),), generator=generator)
        redrawn = torch.multinomial(probs[rows, j], 1, generator=generator)[:, 0]
        stale = x.clone()
        stale[rows, j] = redrawn
        moved = model.forward_train(stale, y, drop=drop).logits.float().softmax(-1)
        total += float(torch.minimum(probs[rows, j + 1], moved[rows, j + 1]).sum(-1).sum())
        count += len(x)
    return total / count


@torch.no_grad()
def next_token_stats(model, codes: torch.Tensor, labels: torch.Tensor, batch_size: int = 100,
                     seed: int = 0) -> dict[str, float]:  # fmt: skip
    """Next-token statistics of a `LlamaGenGPT` c2i `model` on `codes` [N, T] (int) with classes `labels` [N];
    `stale_acceptance` draws from `torch.Generator().manual_seed(seed)`.

    Returns:
        `entropy_nats` / `entropy_bits` (mean per-token entropy), `top1_prob` (mean top-1 probability),
        `k90_mean` / `k90_median` (tokens needed to cover 90 % of p), `frac_top1_above_0.9` (share of positions the
        target is nearly sure of), `stale_acceptance` (above), `vocab` and `positions` (how many were averaged).

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
        "stale_acceptance": stale_acceptance(model, codes, labels, torch.Generator().manual_seed(seed)),
        "vocab": int(probs.shape[-1]),
        "positions": int(entropy.numel()),
    }


@torch.no_grad()
def held_out_next_token_stats(vq, transformer, dataset: str, count: int = 200) -> dict | None:
    """`next_token_stats` of `transformer` on the first `count` held-out (test) images of `dataset`, tokenized by
    `vq`, with their true classes; None (logged) for a zoo whose VQ or target does not fit the dataset's images (a
    test's tiny zoo: its grid or classes differ)."""
    from mmspec.data.datasets import load_images

    images, labels = load_images(dataset, "test")
    images, labels = images[:count], labels[:count]
    device = next(transformer.parameters()).device
    config = transformer.config
    tokens = (images.shape[-1] // vq.downsample_factor) ** 2
    if vq.config.sample_size != images.shape[-1] or config.block_size != tokens or labels.max() >= config.num_classes:
        logger.info("no next-token statistics: the zoo does not fit the %s images", dataset)
        return None
    codes = vq.encode(images.to(device))
    return next_token_stats(transformer, codes, labels.to(device)) | {"images": len(images)}
