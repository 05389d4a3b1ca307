"""`mmspec vlm`: ask the VLM zoo (`assets/mnist-vlm` + its draft LM and EAGLE head) about an image, speculatively;
prints the answer, the decoding stats and, unless `--no-baseline`, plain decoding's time on the same input as JSON.

    mmspec vlm                                              # a held-out MNIST canvas, "Describe the image.", EAGLE
    mmspec vlm --image my.png --prompt "Which digit is at the top left?" --drafter model
    mmspec vlm --do-sample --temperature 0.7 --seed 3       # sampled (lossless: the target's own law)
    mmspec vlm --eagle-head vispec                          # a vision-aware head (assets/mnist-vlm-vispec)
    mmspec vlm --target my-qwen --head runs/my-eagle3 --image cat.jpg --prompt "What is the cat doing?"

`--target` asks your own VLM (a transformers folder: `mmspec.models.hf.vlm_folder`) instead of the zoo's, drafted
by the head `--head` (`vlm-eagle3` / `vlm-eagle` / `vlm-vision` output) or the draft LM `--draft` (`vlm-draft`
output) trained for it.

Without `--image` the canvas is a held-out one of MNIST test digits (`--seed`); `--save-image` writes it.
"""

import argparse
import json
import logging
import sys
from pathlib import Path

from mmspec.cli.args import (
    DEFAULT_ZOO,
    MAX_THREADS,
    SPEEDUP_REPEATS,
    HelpFormatter,
    add_knob_arguments,
    int_in_range,
    sampling_type,
    seed_int,
)
from mmspec.cli.checks import (
    check_device,
    check_method,
    check_output_file,
    check_own_vlm,
    check_packed_linear,
    check_top_k_vocab,
    check_zoo_folders,
)
from mmspec.methods import DRAFT_LENGTH_KNOBS, EAGLE_HEADS, KNOBS, VLM_LIMITS


logger = logging.getLogger(__name__)


def add_arguments(parser):
    parser.add_argument("--zoo", default=DEFAULT_ZOO, help="folder holding mnist-vlm (and -draft, -eagle)")
    parser.add_argument("--image", default=None, help="image file (default: a held-out MNIST canvas, see --seed)")
    parser.add_argument("--prompt", default="Describe the image.", help="the question")
    parser.add_argument("--acceptance", choices=("none", "exact", "greedy"), default="exact")
    parser.add_argument("--drafter", choices=("eagle", "model"), default="eagle")
    parser.add_argument("--eagle-head", choices=EAGLE_HEADS, default=None,
                        help="which EAGLE head drafts (--drafter eagle): eagle (the target's hidden states at every "
                             "image token), vispec / specvlm / msd (vision-aware: the zoo's mnist-vlm-<name>); "
                             "default eagle")  # fmt: skip
    parser.add_argument("--target", default=None, metavar="FOLDER",
                        help="your own VLM (a transformers folder) instead of the zoo's; needs --image")  # fmt: skip
    parser.add_argument("--head", default=None, metavar="FOLDER",
                        help="with --target: the EAGLE / EAGLE-3 / vision-aware head trained for it (--drafter eagle)")  # fmt: skip
    parser.add_argument("--draft", default=None, metavar="FOLDER",
                        help="with --target: its draft LM, a vlm-draft folder (--drafter model)")  # fmt: skip
    parser.add_argument(
        "--max-new-tokens",
        type=int_in_range(1, VLM_LIMITS["max_new_tokens"]),
        default=96,
        help="tokens to generate at most (the prompt + these must fit the model's context)",
    )
    parser.add_argument("--do-sample", action="store_true", help="sample (default: greedy decoding)")
    # the pipeline's own rules (mmspec.sampling.SamplingParams; top-k also at most the vocabulary, see check_args)
    parser.add_argument("--temperature", type=sampling_type("temperature", float), default=1.0,
                        help="sampling temperature (--do-sample; finite, >= 0, 0 = greedy)")  # fmt: skip
    parser.add_argument("--top-k", type=sampling_type("top_k", int), default=None,
                        help="keep the K most likely tokens (--do-sample; at most the vocabulary)")  # fmt: skip
    parser.add_argument("--top-p", type=sampling_type("top_p", float), default=None,
                        help="nucleus mass in (0, 1] (--do-sample)")  # fmt: skip
    parser.add_argument(
        "--num-draft-tokens",
        type=int_in_range(1, VLM_LIMITS["num_draft_tokens"]),
        default=None,
        help=KNOBS["num_draft_tokens"].help,
    )
    parser.add_argument(
        "--tree-nodes",
        type=int_in_range(1, VLM_LIMITS["tree_nodes"]),
        default=None,
        help=KNOBS["tree_nodes"].help + f" (default: {KNOBS['tree_nodes'].default})",
    )
    parser.add_argument(
        "--tree-depth",
        type=int_in_range(1, VLM_LIMITS["tree_depth"]),
        default=None,
        help="EAGLE chain length / tree depth",
    )
    parser.add_argument(
        "--tree-top-k", type=int_in_range(1, VLM_LIMITS["tree_top_k"]), default=1, help="> 1: EAGLE-2 trees"
    )
    add_knob_arguments(parser, DRAFT_LENGTH_KNOBS)
    parser.add_argument("--seed", type=seed_int, default=0, help="canvas and sampling seed")
    parser.add_argument("--save-image", default=None, help="write the canvas used here (PNG)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding run")
    parser.add_argument(
        "--threads", type=int_in_range(0, MAX_THREADS), default=0, help="torch CPU threads (0: torch's default)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--packed-linear", action="store_true",
                        help="CPU: run the verification's 2-64-row linears on oneDNN-packed weights "
                             "(pipe.enable_packed_linear(): faster speculative rounds, a second float32 copy of the "
                             "linear weights in memory; plain decoding's one-token steps unchanged)")  # fmt: skip


def _length_knobs(args):
    """The draft-length flags that were set, as pipeline keywords."""
    return {name: getattr(args, name) for name in DRAFT_LENGTH_KNOBS if getattr(args, name, None) is not None}


def _text_config(parser, zoo):
    """`text_config` of the zoo's `mnist-vlm/config.json` (read as JSON: no model loads)."""
    path = Path(zoo) / "mnist-vlm" / "config.json"
    try:
        text = json.loads(path.read_text()).get("text_config") or {}
    except (OSError, ValueError, AttributeError) as err:
        parser.error(f"argument --zoo: {str(path)!r} is not a readable model config ({err})")
    return text if isinstance(text, dict) else {}


def check_args(parser, args):
    """Usage errors (exit 2) before any model loads: every flag alone, the flags together, and a cheap look at the
    disk (the zoo's folders and config, the image file, the --save-image path, the device)."""
    if not args.prompt.strip():
        parser.error("argument --prompt: must not be empty")
    if args.image is not None:
        if not Path(args.image).is_file():
            parser.error(f"argument --image: no such file {args.image!r}")
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(args.image) as image:
                image.verify()
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            parser.error(f"argument --image: {args.image!r} is not a readable image ({err})")
    if args.target is not None:
        return _check_own(parser, args)
    for flag, value in (("--head", args.head), ("--draft", args.draft)):
        if value is not None:
            parser.error(f"argument {flag}: only with --target (the zoo's drafters come from --zoo)")
    check_zoo_folders(parser, args.zoo, ["mnist-vlm"])
    if args.eagle_head is not None and (args.acceptance == "none" or args.drafter != "eagle"):
        parser.error("argument --eagle-head: only used with --drafter eagle (and an --acceptance other than none)")
    if args.eagle_head is not None and args.eagle_head != "eagle":
        check_zoo_folders(parser, args.zoo, [f"mnist-vlm-{args.eagle_head}"], flag="--eagle-head")
    args.eagle_head = args.eagle_head or "eagle"
    if args.acceptance != "none":
        folder, marker = {"eagle": (f"mnist-vlm-{args.eagle_head}", "config.json"),
                          "model": ("mnist-vlm-draft", "draft.json")}[args.drafter]  # fmt: skip
        if not (Path(args.zoo) / folder / marker).is_file():
            parser.error(f"argument --drafter: {args.drafter!r} needs {str(Path(args.zoo) / folder)!r}, not found")
    _check_common(parser, args, _text_config(parser, args.zoo), f"{args.zoo}/mnist-vlm")


def _check_own(parser, args):
    """`check_args` for your own VLM (`--target`): a VLM folder, an image, the drafter's folder (`--head` for
    `--drafter eagle`, `--draft` for `--drafter model`; neither is read with `--acceptance none`)."""
    check_own_vlm(parser, args.target)  # the target first: the flags below are about its drafters
    if args.image is None:
        parser.error("argument --target: needs --image (the held-out MNIST canvases are the zoo's)")
    if args.eagle_head is not None:
        parser.error("argument --eagle-head: names a zoo head; with --target give the head's folder as --head")
    needed = None if args.acceptance == "none" else {"eagle": "--head", "model": "--draft"}[args.drafter]
    for flag, value in (("--head", args.head), ("--draft", args.draft)):
        if value is not None and flag != needed:
            parser.error(f"argument {flag}: not used with --acceptance {args.acceptance} --drafter {args.drafter}")
    if needed == "--head" and args.head is None:
        parser.error("argument --drafter: eagle on --target needs --head FOLDER (the head trained for it)")
    if needed == "--draft" and args.draft is None:
        parser.error("argument --drafter: model on --target needs --draft FOLDER (a vlm-draft folder for it)")
    text = check_own_vlm(parser, args.target, args.head, args.draft)
    _check_common(parser, args, text, str(args.target))


def _check_common(parser, args, text, where):
    """The checks of both targets: the answer fits the context, top-k the vocabulary, the knobs the method."""
    context, vocab = text.get("max_position_embeddings"), text.get("vocab_size")
    if isinstance(context, int) and args.max_new_tokens >= context:
        parser.error(
            f"argument --max-new-tokens: {args.max_new_tokens} does not fit the model's context of {context} tokens "
            "(prompt included)"
        )
    check_top_k_vocab(parser, args.top_k, vocab, where)
    if args.acceptance == "greedy" and args.do_sample:
        parser.error("argument --do-sample: --acceptance greedy verifies greedy decoding (use --acceptance exact)")
    if args.acceptance == "none":
        for flag, value, default in (("--num-draft-tokens", args.num_draft_tokens, None),
                                     ("--tree-nodes", args.tree_nodes, None),
                                     ("--tree-depth", args.tree_depth, None), ("--tree-top-k", args.tree_top_k, 1)):  # fmt: skip
            if value != default:
                parser.error(f"argument {flag}: not used with --acceptance none")
    knobs = dict(num_draft_tokens=args.num_draft_tokens, tree_nodes=args.tree_nodes, tree_depth=args.tree_depth,
                 tree_top_k=args.tree_top_k, **_length_knobs(args))  # fmt: skip
    check_method(parser, args.acceptance, None if args.acceptance == "none" else args.drafter,
                 {k: v for k, v in knobs.items() if v is not None}, "vlm")  # fmt: skip
    if args.save_image is not None:
        check_output_file(parser, "--save-image", args.save_image, "image")
    check_device(parser, args.device)
    check_packed_linear(parser, args)


def run(args):
    """Answer, stats and (unless `--no-baseline`) plain decoding's time on the same input; returns the report.

    `latency_s` of each run is its first call's (the first is cold); `speedup_vs_plain` is timed fairly after them:
    `SPEEDUP_REPEATS` interleaved calls of each, medians (`mmspec.timing.fair_speedup`; `speedup_timing` says so, and
    the same line goes to stderr)."""
    import torch
    from PIL import Image

    from mmspec.data.canvases import held_out_canvases
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline
    from mmspec.timing import fair_speedup, speedup_line

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.image is None:
        image = held_out_canvases(1, args.seed, min_digits=1)[0]
    else:
        image = Image.open(args.image).convert("RGB")
    if args.save_image:
        image.save(args.save_image)
    if getattr(args, "target", None) is not None:  # your own VLM and the drafter trained for it
        pipe = SpeculativeVLMPipeline.from_folders(args.target, eagle_head=args.head, draft=args.draft)
    else:
        pipe = SpeculativeVLMPipeline.from_zoo(args.zoo, eagle=getattr(args, "eagle_head", None) or "eagle")
    pipe = pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    if getattr(args, "packed_linear", False):
        pipe.enable_packed_linear()
    sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p)  # fmt: skip
    knobs = dict(num_draft_tokens=args.num_draft_tokens, tree_depth=args.tree_depth, tree_top_k=args.tree_top_k,
                 **_length_knobs(args))  # fmt: skip
    if args.tree_nodes is not None:
        knobs["tree_nodes"] = args.tree_nodes
    method = dict(acceptance=args.acceptance)
    if args.acceptance != "none":
        method.update(drafter=args.drafter, **knobs)
    runs = [("answer", method)]
    if not args.no_baseline and args.acceptance != "none":
        runs.append(("plain_baseline", dict(acceptance="none")))
    report = {"prompt": args.prompt, "image": args.image or f"held-out canvas (seed {args.seed})", **sampling}
    report["packed_linear"] = bool(getattr(args, "packed_linear", False))
    if getattr(args, "target", None) is not None:
        report.update(target=str(args.target), head=args.head and str(args.head), draft=args.draft and str(args.draft))
    elif args.acceptance != "none" and args.drafter == "eagle":
        report["eagle_head"] = getattr(args, "eagle_head", None) or "eagle"

    def call(kw):
        generator = torch.Generator(args.device).manual_seed(args.seed)
        out = pipe(images=image, prompt=args.prompt, generator=generator, **sampling, **kw)
        if torch.device(args.device).type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(args.device)
        return out

    for name, kw in runs:
        out = call(kw)
        stats = out.stats
        report[name] = {"text": out.text[0], "method": kw, "latency_s": round(stats.time_total_s, 3),
                        "prefill_s": round(stats.time_prefill_s, 3), "new_tokens": int((out.sequences >= 0).sum()),
                        "tau": round(stats.mean_accepted_length, 3),
                        "tokens_per_s": round(stats.extra.get("tokens_per_s") or 0.0, 2)}  # fmt: skip
        for key in ("draft_image_tokens", "gate_choice"):  # what the drafter read of the image
            if key in stats.extra:
                report[name][key] = stats.extra[key]
    line = None
    if "plain_baseline" in report:
        # the runs above are the warm-up of both (the first of them was cold): the speedup is timed apart, the two
        # interleaved, median over repeats (mmspec.timing)
        timing = fair_speedup(lambda: call(runs[1][1]), lambda: call(runs[0][1]), repeats=SPEEDUP_REPEATS, warmup=0)
        what = "the same answer (same image, prompt and seed)"
        line = speedup_line(timing, what, torch.get_num_threads(), warmed_by="one untimed run of each")
        report["speedup_vs_plain"] = None if timing["speedup"] is None else round(timing["speedup"], 3)
        report["speedup_timing"] = dict(what=what, repeats=timing["repeats"],
                                        plain_median_s=round(timing["a_median_s"], 4),
                                        speculative_median_s=round(timing["b_median_s"], 4), note=line)  # fmt: skip
        report["matches_plain"] = report["plain_baseline"]["text"] == report["answer"]["text"]
    print(json.dumps(report, indent=2))
    if line is not None:
        print(line, file=sys.stderr)
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
