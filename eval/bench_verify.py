"""`mmspec bench verify`: cost per call of every `mmspec.verify` rule at batch 1 and 16, K=8 draft tokens,
V=16384 (LlamaGen's codebook), float32 on CPU by default; median (plus p10/p90) over repeats after warm-up calls,
with a device synchronise on accelerators (`benchmark`).
"""

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

from mmspec.cli.args import MAX_BATCH, int_in_range, non_negative_int, seed_int, threads_int
from mmspec.cli.checks import check_device


logger = logging.getLogger(__name__)

__all__ = ["add_arguments", "benchmark", "run"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def benchmark(fn: Callable[[], object], *, repeats: int = 20, warmup: int = 3, device="cpu") -> dict:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones -> median / p10 / p90 / min in ms."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    pick = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"median_ms": statistics.median(times), "p10_ms": pick(0.1), "p90_ms": pick(0.9), "min_ms": times[0]}


# ----------------------------------------------------------------------------------------------------------------
# verify


def _eagle_like_tree(num_nodes: int = 59) -> list[int]:
    """A fixed EAGLE-2-sized tree (59 nodes, depth 4, up to 10 siblings): parents list."""
    parents = [-1] * 10  # depth 1: nodes 0..9
    parents += [0] * 10 + [1] * 5 + [2] * 5  # depth 2: nodes 10..29
    parents += [10] * 10 + [11] * 5  # depth 3: nodes 30..44
    parents += [30] * 10 + [31] * 4  # depth 4: nodes 45..58
    assert len(parents) == num_nodes
    return parents


# the cases `_verify_cases` builds, in order (`--rules` picks among them)
CASES = ("greedy", "exact", "exact_no_validate", "exact_point_mass", "tree_deterministic_8", "tree_iid_8",
         "tree_without_replacement_8", "tree_deterministic_59", "relaxed_point_mass", "relaxed_sampled",
         "relaxed_tree_59", "grouped_point_mass", "grouped_sampled", "grouped_sampled_gstar", "jacobi",
         "jacobi_coupled", "continuous")  # fmt: skip
MAX_ELEMENTS = 2**30  # float32 elements of one batch's inputs (4 GiB): more is a typo, not a benchmark


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int_in_range(1, MAX_BATCH), nargs="+", default=[1, 16])
    parser.add_argument("--num-draft", "-k", type=int_in_range(1, 256), default=8,
                        help="K draft tokens (chain) / nodes (small tree)")  # fmt: skip
    parser.add_argument("--vocab", type=int_in_range(2, 2**20), default=16384)
    parser.add_argument("--codebook-dim", type=int_in_range(1, 4096), default=8,
                        help="VQ codebook / embedding dim (LlamaGen: 8)")  # fmt: skip
    parser.add_argument("--neighbours", type=non_negative_int, default=1000, help="LANTERN k (at most --vocab - 1)")
    parser.add_argument("--value-dim", type=int_in_range(1, 4096), default=16, help="continuous token dim (MAR: 16)")
    parser.add_argument("--repeats", type=int_in_range(1, 100_000), default=20)
    parser.add_argument("--warmup", type=int_in_range(0, 10_000), default=3)
    parser.add_argument("--threads", type=threads_int, default=None, help="torch.set_num_threads (default: unchanged)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--rules", nargs="*", default=None, choices=CASES, metavar="CASE",
                        help=f"subset of case names to run: {', '.join(CASES)}")  # fmt: skip


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Before any tensor is made: LANTERN's k fits the vocabulary, one batch's inputs fit in memory, the device."""
    if args.neighbours > args.vocab - 1:
        parser.error(f"argument --neighbours: {args.neighbours} is more than --vocab - 1 = {args.vocab - 1}")
    elements = max(args.batch_sizes) * (2 * args.num_draft + 1 + 60) * args.vocab + args.neighbours * args.vocab
    if elements > MAX_ELEMENTS:
        parser.error(f"arguments --batch-sizes / --num-draft / --vocab / --neighbours: one batch would need "
                     f"{elements * 4 / 2**30:.1f} GiB of inputs (at most {MAX_ELEMENTS * 4 / 2**30:.0f} GiB)")  # fmt: skip
    check_device(parser, args.device)


def _verify_cases(batch: int, args: argparse.Namespace, shared: dict) -> dict[str, Callable[[], object]]:
    from mmspec import verify as vf

    dev, k, vocab = torch.device(args.device), args.num_draft, args.vocab
    gen = torch.Generator(device=dev).manual_seed(args.seed + batch)
    p = (torch.randn(batch, k + 1, vocab, generator=gen, device=dev) * 3).softmax(-1)  # [B, K+1, V]
    q = (torch.randn(batch, k, vocab, generator=gen, device=dev) * 3).softmax(-1)  # [B, K, V]
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    nb, emb = shared["neighbours"], shared["embeddings"]

    small_parents = torch.tensor([-1, -1, -1, 0, 0, 1, 3, 3][:k] if k <= 8 else [-1] * k, device=dev)
    n_small = small_parents.numel()
    p_small = p[:, : n_small + 1] if n_small + 1 <= k + 1 else p
    tree_q = q[:, :n_small]
    tree_tok = torch.multinomial(tree_q.reshape(-1, vocab), 1, generator=gen).reshape(batch, n_small)
    wor_tok = torch.arange(n_small, device=dev).expand(batch, n_small)  # distinct siblings
    eagle = torch.tensor(_eagle_like_tree(), device=dev)
    p_eagle = (torch.randn(batch, eagle.numel() + 1, vocab, generator=gen, device=dev) * 3).softmax(-1)
    eagle_tok = torch.randint(0, vocab, (batch, eagle.numel()), generator=gen, device=dev)

    d = args.value_dim
    x = torch.randn(batch, k, d, generator=gen, device=dev)
    mu_p = x + 0.1 * torch.randn(batch, k, d, generator=gen, device=dev)
    sd = torch.full((batch, k, d), 0.5, device=dev)

    run = torch.Generator(device=dev).manual_seed(args.seed)
    return {
        "greedy": lambda: vf.verify_greedy(drafts, p),
        "exact": lambda: vf.verify_exact(drafts, p, q, generator=run),
        "exact_no_validate": lambda: vf.verify_exact(drafts, p, q, generator=run, validate=False),
        "exact_point_mass": lambda: vf.verify_exact(drafts, p, None, generator=run),
        "tree_deterministic_8": lambda: vf.verify_tree(tree_tok, small_parents, p_small, generator=run),
        "tree_iid_8": lambda: vf.verify_tree(tree_tok, small_parents, p_small, tree_q, mode="iid", generator=run),
        "tree_without_replacement_8": lambda: vf.verify_tree(
            wor_tok, small_parents, p_small, tree_q, mode="without_replacement", generator=run
        ),
        "tree_deterministic_59": lambda: vf.verify_tree(eagle_tok, eagle, p_eagle, generator=run),
        "relaxed_point_mass": lambda: vf.verify_relaxed(drafts, p, None, neighbours=nb, delta=0.1, generator=run),
        "relaxed_sampled": lambda: vf.verify_relaxed(drafts, p, q, neighbours=nb, lam=5.0, generator=run),
        "relaxed_tree_59": lambda: vf.verify_tree(
            eagle_tok, eagle, p_eagle, generator=run, acceptance="relaxed", neighbours=nb, delta=0.1
        ),
        "grouped_point_mass": lambda: vf.verify_grouped(drafts, p, None, embeddings=emb, generator=run),
        "grouped_sampled": lambda: vf.verify_grouped(drafts, p, q, embeddings=emb, resample="released", generator=run),
        "grouped_sampled_gstar": lambda: vf.verify_grouped(
            drafts, p, q, embeddings=emb, resample="optimal", generator=run
        ),
        "jacobi": lambda: vf.verify_jacobi(drafts, p, q, generator=run),
        "jacobi_coupled": lambda: vf.verify_jacobi(drafts, p, q, generator=run, coupling=True),
        "continuous": lambda: vf.verify_continuous(x, mu_p, sd, x, sd, generator=run),
    }


def run(args: argparse.Namespace) -> dict:
    from mmspec.verify import codebook_neighbours

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    codebook = torch.randn(args.vocab, args.codebook_dim, generator=gen, device=dev)
    start = time.perf_counter()
    neighbours = codebook_neighbours(codebook, args.neighbours)
    _sync(dev)
    neighbours_s = time.perf_counter() - start
    shared = {"neighbours": neighbours, "embeddings": torch.nn.functional.normalize(codebook, dim=-1)}
    results: dict[str, dict[str, dict]] = {}
    for batch in args.batch_sizes:
        cases = _verify_cases(batch, args, shared)
        for name, fn in cases.items():
            if args.rules and name not in args.rules:
                continue
            stats = benchmark(fn, repeats=args.repeats, warmup=args.warmup, device=dev)
            results.setdefault(name, {})[str(batch)] = stats
            logger.info("verify %-28s B=%-3d %8.3f ms (median)", name, batch, stats["median_ms"])
    return {
        "config": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": str(dev),
            "dtype": "float32",
            "K": args.num_draft,
            "V": args.vocab,
            "codebook_dim": args.codebook_dim,
            "lantern_k": args.neighbours,
            "value_dim": args.value_dim,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "batch_sizes": args.batch_sizes,
            "tree_59": "EAGLE-2-sized fixed tree, 59 nodes, depth 4, up to 10 siblings",
            "tree_8": "parents [-1, -1, -1, 0, 0, 1, 3, 3] (depth 3)",
            "codebook_neighbours_s": neighbours_s,
        },
        "results": results,
    }
