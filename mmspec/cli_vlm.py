"""`mmspec vlm`: ask the VLM zoo (`assets/mnist-vlm` + its draft LM and EAGLE head) about an image, speculatively;
prints the answer, the decoding stats and, unless `--no-baseline`, plain decoding's time on the same input as JSON.

    mmspec vlm                                              # a held-out MNIST canvas, "Describe the image.", EAGLE
    mmspec vlm --image my.png --prompt "Which digit is at the top left?" --drafter model
    mmspec vlm --do-sample --temperature 0.7 --seed 3       # sampled (lossless: the target's own law)

Without `--image` the canvas is a held-out one of MNIST test digits (`--seed`); `--save-image` writes it.
"""

import argparse
import json
import logging
import sys
from pathlib import Path

from mmspec.cli import DEFAULT_ZOO, HelpFormatter, non_negative_int, positive_float, positive_int, probability


logger = logging.getLogger(__name__)


def add_arguments(parser):
    parser.add_argument("--zoo", default=DEFAULT_ZOO, help="folder holding mnist-vlm (and -draft, -eagle)")
    parser.add_argument("--image", default=None, help="image file (default: a held-out MNIST canvas, see --seed)")
    parser.add_argument("--prompt", default="Describe the image.", help="the question")
    parser.add_argument("--acceptance", choices=("none", "exact", "greedy"), default="exact")
    parser.add_argument("--drafter", choices=("eagle", "model"), default="eagle")
    parser.add_argument("--max-new-tokens", type=positive_int, default=96)
    parser.add_argument("--do-sample", action="store_true", help="sample (default: greedy decoding)")
    parser.add_argument("--temperature", type=positive_float, default=1.0)
    parser.add_argument("--top-k", type=positive_int, default=None)
    parser.add_argument("--top-p", type=probability, default=None)
    parser.add_argument("--num-draft-tokens", type=positive_int, default=None, help="chain length / tree nodes")
    parser.add_argument("--tree-depth", type=positive_int, default=None, help="EAGLE chain length / tree depth")
    parser.add_argument("--tree-top-k", type=positive_int, default=1, help="> 1: EAGLE-2 trees")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="canvas and sampling seed")
    parser.add_argument("--save-image", default=None, help="write the canvas used here (PNG)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding run")
    parser.add_argument("--threads", type=non_negative_int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")


def check_args(parser, args):
    """Usage errors (exit 2) before any model loads."""
    if args.image is not None and not Path(args.image).is_file():
        parser.error(f"argument --image: no such file {args.image!r}")
    if not (Path(args.zoo) / "mnist-vlm").is_dir():
        parser.error(f"argument --zoo: {args.zoo!r} has no mnist-vlm folder")
    if args.acceptance == "none" and args.num_draft_tokens is not None:
        parser.error("argument --num-draft-tokens: not used with --acceptance none")


def run(args):
    """Answer, stats and (unless `--no-baseline`) plain decoding's time on the same input; returns the report."""
    import torch
    from PIL import Image

    from mmspec.eval.bench_vlm import held_out_canvases
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.image is None:
        image = held_out_canvases(1, args.seed, min_digits=1)[0]
    else:
        image = Image.open(args.image).convert("RGB")
    if args.save_image:
        image.save(args.save_image)
    pipe = SpeculativeVLMPipeline.from_zoo(args.zoo).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p)  # fmt: skip
    knobs = dict(num_draft_tokens=args.num_draft_tokens, tree_depth=args.tree_depth, tree_top_k=args.tree_top_k)
    method = dict(acceptance=args.acceptance)
    if args.acceptance != "none":
        method.update(drafter=args.drafter, **knobs)
    runs = [("answer", method)]
    if not args.no_baseline and args.acceptance != "none":
        runs.append(("plain_baseline", dict(acceptance="none")))
    report = {"prompt": args.prompt, "image": args.image or f"held-out canvas (seed {args.seed})", **sampling}
    for name, kw in runs:
        generator = torch.Generator(args.device).manual_seed(args.seed)
        out = pipe(images=image, prompt=args.prompt, generator=generator, **sampling, **kw)
        stats = out.stats
        report[name] = {"text": out.text[0], "method": kw, "latency_s": round(stats.time_total_s, 3),
                        "prefill_s": round(stats.time_prefill_s, 3), "new_tokens": int((out.sequences >= 0).sum()),
                        "tau": round(stats.mean_accepted_length, 3),
                        "tokens_per_s": round(stats.extra.get("tokens_per_s") or 0.0, 2)}  # fmt: skip
    if "plain_baseline" in report:
        report["speedup_vs_plain"] = round(report["plain_baseline"]["latency_s"] / report["answer"]["latency_s"], 3)
        report["matches_plain"] = report["plain_baseline"]["text"] == report["answer"]["text"]
    print(json.dumps(report, indent=2))
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mmspec vlm", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.WARNING)
    run(args)
    return 0
