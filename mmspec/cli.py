"""Command line: `mmspec generate | bench | train`.

`mmspec generate` (the README's main job) samples a grid of digits from the shipped MNIST zoo with speculative
decoding and prints the speed statistics next to plain AR decoding of the same images.
"""

import argparse
import json
import logging
import sys
import time
from pathlib import Path


logger = logging.getLogger(__name__)


def _generate_args(parser):
    parser.add_argument("--zoo", default=str(Path(__file__).resolve().parent.parent / "assets"),
                        help="folder holding the zoo (mnist-c2i, mnist-vq, drafters); default: the shipped assets")  # fmt: skip
    parser.add_argument("--classes", default="0,1,2,3,4,5,6,7,8,9", help="comma-separated class ids")
    parser.add_argument("--num-per-class", type=int, default=2)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="images per pipeline call (1 = the latency regime speculative decoding targets)",
    )
    parser.add_argument(
        "--acceptance",
        default="jacobi",
        help="none | exact | relaxed | grouped | jacobi (default: SJD + SCD coupling, lossless)",
    )
    parser.add_argument("--drafter", default=None, help="model | eagle | jacobi (default: per acceptance)")
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--guidance-scale", type=float, default=2.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="mmspec_samples.png", help="PNG grid to write (one row per class)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain-AR comparison run")


def generate(args):
    import torch

    from mmspec.eval.images import make_grid
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_zoo(args.zoo)
    classes = [int(c) for c in args.classes.split(",") if c.strip()]
    common = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k)
    labels = [c for c in classes for _ in range(args.num_per_class)]
    runs = {}
    methods = [("speculative", dict(acceptance=args.acceptance, drafter=args.drafter,
                                    num_draft_tokens=args.num_draft_tokens))]  # fmt: skip
    if not args.no_baseline and args.acceptance != "none":
        methods.append(("plain", dict(acceptance="none")))
    for name, kw in methods:
        images, forwards, compression, accepted, wall = [], 0, [], [], 0.0
        for i in range(0, len(labels), args.batch_size):
            gen = torch.Generator().manual_seed(args.seed + i)
            start = time.perf_counter()
            out = pipe(class_labels=labels[i : i + args.batch_size], generator=gen, **common, **kw)
            wall += time.perf_counter() - start
            images += out.images
            forwards += out.stats.target_forwards
            compression.append(out.stats.step_compression)
            accepted.append(out.stats.mean_accepted_length)
        runs[name] = dict(images=images, wall_s=round(wall, 3), target_forwards=forwards,
                          step_compression=round(sum(compression) / len(compression), 3),
                          mean_accepted_length=round(sum(accepted) / len(accepted), 3))  # fmt: skip
    make_grid(runs["speculative"].pop("images"), args.num_per_class).save(args.out)
    runs.get("plain", {}).pop("images", None)
    report = {"out": args.out, "images": len(labels), "batch_size": args.batch_size, "acceptance": args.acceptance}
    report.update(runs)
    if "plain" in runs:
        report["speedup"] = round(runs["plain"]["wall_s"] / runs["speculative"]["wall_s"], 3)
    print(json.dumps(report, indent=2))
    return report


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from mmspec.eval.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "train":
        from mmspec.train.__main__ import main as train_main

        return train_main(argv[1:])
    parser = argparse.ArgumentParser(prog="mmspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_args(sub.add_parser("generate", help="sample a digit grid from the MNIST zoo and print speed stats"))
    sub.add_parser("bench", help="benchmarks (see `mmspec bench --help`)")
    sub.add_parser("train", help="train zoo models (see `mmspec train --help`)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.command == "generate":
        generate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
