"""Sample quality of a class-conditional zoo model: `python -m mmspec.eval.zoo_eval --zoo assets`.

Draws `--per-class` images of every class with the pipeline (plain AR by default, or any speculative method),
classifies them with the zoo classifier (`mnist-classifier`), saves a grid (one row per class) next to the model
and records the accuracy in `<model>/sample_eval.json` and in the model card (`README.md`).
"""

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from mmspec.cli.args import DEFAULT_ZOO, MAX_BATCH, int_in_range, sampling_type, seed_int
from mmspec.cli.checks import check_device, check_output_file, check_zoo_folders, write_json
from mmspec.methods import ACCEPTANCES, resolve_drafter


logger = logging.getLogger(__name__)
CARD_MARKER = "<!-- sample-eval -->"
MAX_PER_CLASS = 10_000


@torch.no_grad()
def evaluate(pipe, classifier, per_class, batch_size=250, seed=0, **call_kwargs):
    """Generate `per_class` images of every class; return (accuracy, per-class accuracy, images [N,C,H,W], labels)."""
    n_classes = pipe.transformer.config.num_classes
    device = pipe._execution_device  # generators live where the pipeline draws
    classifier_device = next(classifier.parameters()).device
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    images, preds = [], []
    for start in range(0, len(labels), batch_size):
        chunk = labels[start : start + batch_size]
        gen = torch.Generator(device=device).manual_seed(seed + start)
        out = pipe(class_labels=chunk, generator=gen, output_type="pt", **call_kwargs)
        images.append(out.images.cpu())
        preds.append(classifier(out.images.to(classifier_device) * 2 - 1).argmax(-1).cpu())
    images, preds = torch.cat(images), torch.cat(preds)
    correct = preds == labels
    per = [float(correct[labels == c].float().mean()) for c in range(n_classes)]
    return float(correct.float().mean()), per, images, labels


def _update_card(model_dir, result):
    card = Path(model_dir) / "README.md"
    text = card.read_text() if card.exists() else ""
    text = text.split(CARD_MARKER)[0].rstrip() + "\n\n" + CARD_MARKER + "\n"
    text += (
        "## Samples\n\n"
        f"![samples]({result['grid']}) — {result['per_class']} per class shown in rows of 10 (first 10 of each class), "
        f"{result['method']}, guidance scale {result['guidance_scale']}, temperature {result['temperature']}.\n\n"
        f"Zoo classifier accuracy on {result['num_images']} generated images ({result['per_class']} per class): "
        f"**{result['accuracy']:.3f}** (per class: {', '.join(f'{a:.2f}' for a in result['per_class_accuracy'])}).\n"
        f"Command: `{result['command']}` ({result['wall_s']:.0f} s).\n"
    )
    card.write_text(text)


def check_args(parser, args):
    """Before any model loads: the zoo's folders (and drafter, for a speculative `--acceptance`), the sampling
    settings the rule takes, the device, and (unless `--no-write`) that the model folder's outputs can be written."""
    from mmspec.models import read_config, zoo_folders

    try:
        folders = zoo_folders(args.zoo, prefix=args.prefix)
        for folder in folders.values():
            read_config(folder)
    except ValueError as err:
        parser.error(f"argument --zoo: {err} (--prefix {args.prefix})")
    check_zoo_folders(parser, args.zoo, [f"{args.prefix}-classifier"])
    try:
        resolve_drafter(args.acceptance, None, set(folders))
    except ValueError as err:
        parser.error(f"argument --acceptance: {err}: the zoo {args.zoo!r} lacks its drafter folder")
    if ACCEPTANCES[args.acceptance].sampling_only and args.temperature == 0:
        parser.error(f"argument --temperature: 0 (greedy) does not work with the sampling rule --acceptance "
                     f"{args.acceptance}")  # fmt: skip
    check_device(parser, args.device)
    if not args.no_write:
        model_dir = Path(args.zoo) / f"{args.prefix}-c2i"
        for name, kind in (("sample_eval.json", (".json",)), ("samples.png", "image"), ("README.md", (".md",))):
            check_output_file(parser, "--zoo", model_dir / name, kind)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mmspec.eval.zoo_eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--zoo", default=DEFAULT_ZOO, help="the zoo folder (default: the shipped zoo)")
    parser.add_argument("--prefix", default="mnist", help="zoo folders <prefix>-c2i, <prefix>-vq, <prefix>-classifier")
    parser.add_argument("--per-class", type=int_in_range(1, MAX_PER_CLASS), default=100)
    parser.add_argument("--guidance-scale", type=sampling_type("guidance_scale", float), default=2.0)
    parser.add_argument("--temperature", type=sampling_type("temperature", float), default=1.0)
    parser.add_argument("--acceptance", default="none", choices=list(ACCEPTANCES))
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--batch-size", type=int_in_range(1, MAX_BATCH), default=250)
    parser.add_argument("--device", default="cpu", help="device the models run on (and the generators live on)")
    parser.add_argument("--no-write", action="store_true", help="only print; do not touch the model folder")
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from mmspec.eval.images import make_grid
    from mmspec.models import load
    from mmspec.pipelines import SpeculativeARImagePipeline
    from mmspec.pipelines.ar_image import to_pil

    pipe = SpeculativeARImagePipeline.from_zoo(args.zoo, prefix=args.prefix).to(args.device)
    classifier = load(Path(args.zoo) / f"{args.prefix}-classifier", device=pipe._execution_device)
    start = time.perf_counter()
    acc, per, images, labels = evaluate(pipe, classifier, args.per_class, args.batch_size, args.seed,
                                        guidance_scale=args.guidance_scale, temperature=args.temperature,
                                        acceptance=args.acceptance)  # fmt: skip
    wall = time.perf_counter() - start
    model_dir = Path(args.zoo) / f"{args.prefix}-c2i"
    result = {
        "method": "plain AR sampling" if args.acceptance == "none" else f"acceptance={args.acceptance}",
        "guidance_scale": args.guidance_scale,
        "temperature": args.temperature,
        "per_class": args.per_class,
        "num_images": len(labels),
        "accuracy": acc,
        "per_class_accuracy": per,
        "seed": args.seed,
        "wall_s": wall,
        "grid": "samples.png",
        "command": "python -m mmspec.eval.zoo_eval " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_class_accuracy"}, indent=2))
    if not args.no_write:
        n_classes = pipe.transformer.config.num_classes
        show = min(10, args.per_class)
        rows = [images[labels == c][:show] for c in range(n_classes)]
        write_json(model_dir / "sample_eval.json", result)  # the report first: the extras below cannot lose it
        make_grid(to_pil(torch.cat(rows)), show).save(model_dir / "samples.png")
        _update_card(model_dir, result)
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
