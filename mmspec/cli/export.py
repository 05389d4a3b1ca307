"""`mmspec export eagle3 HEAD --target TARGET --format vllm|sglang OUT`: write an EAGLE-3 head
(`python -m mmspec.train vlm-eagle3`) as the draft-model folder vLLM (`--speculative-config '{"method": "eagle3",
"model": OUT, ...}'`) or SGLang (`--speculative-algorithm EAGLE3 --speculative-draft-model-path OUT`) loads:
`config.json` + bf16 `model.safetensors` (`mmspec.models.hf.eagle3_export`; docs/serving.md).

    mmspec export eagle3 assets/mnist-vlm-eagle3 --format vllm runs/mnist-vlm-eagle3-vllm
    mmspec export eagle3 runs/my-eagle3 --target runs/my-vlm --format sglang --embed-tokens runs/my-eagle3-sglang

`--target`: the VLM the head was trained on (default: the zoo's mnist-vlm; a transformers model folder otherwise);
the head is checked against it (hidden size, vocabulary, aux layers). A head the engine would refuse (not EAGLE-3,
not three aux layers, aux layer 0 for SGLang) is an error naming why, before anything is written.
"""

import argparse
import logging
import sys
from pathlib import Path

from mmspec.cli.args import HelpFormatter
from mmspec.cli.checks import check_output_folder


logger = logging.getLogger(__name__)

KINDS = ("eagle3",)
FORMATS = ("vllm", "sglang")


def add_arguments(parser):
    parser.add_argument("kind", choices=KINDS, help="what to export (an EAGLE-3 head)")
    parser.add_argument("head", help="the head's model folder (mmspec.train vlm-eagle3 --out, or a zoo folder)")
    parser.add_argument("out", help="output folder (config.json + model.safetensors)")
    parser.add_argument("--target", default=None,
                        help="the VLM the head drafts for: the zoo's mnist-vlm (default) or a transformers folder")  # fmt: skip
    parser.add_argument("--format", choices=FORMATS, required=True, help="the serving engine that loads OUT")
    parser.add_argument("--embed-tokens", action="store_true",
                        help="also write the target's input embedding (both engines share the target's otherwise)")  # fmt: skip


def _target_folder(value):
    from mmspec.models.hf.zoo import ZOO_ROOT

    if value is None:
        return ZOO_ROOT / "mnist-vlm"
    path = Path(value)
    return path if path.is_dir() or not (ZOO_ROOT / value).is_dir() else ZOO_ROOT / value


def check_args(parser, args):
    """Usage errors before any model loads: the head folder holds an mmspec head config, the target is a model
    folder, the output folder can be written and is not the head's."""
    from mmspec.models import read_config

    try:
        config = read_config(args.head)
    except ValueError as err:
        parser.error(f"argument head: {err}")
    if config.get("_class_name") is None:
        parser.error(f"argument head: {args.head!r} is a transformers model folder, not an mmspec EAGLE head")
    args.target = _target_folder(args.target)
    if not (Path(args.target) / "config.json").is_file():
        parser.error(f"argument --target: {str(args.target)!r} is not a model folder (no config.json)")
    if Path(args.out).resolve() == Path(args.head).resolve():
        parser.error("argument out: is the head's own folder; export to another folder")
    check_output_folder(parser, "out", args.out)


def load_target(folder):
    """The target model: an mmspec zoo VLM folder (`load_vlm`) or a transformers folder (`mmspec.models.load`)."""
    from mmspec.models.hf.zoo import WEIGHTS_NAME, load_vlm

    if (Path(folder) / WEIGHTS_NAME).is_file():
        return load_vlm(folder)[0]
    from mmspec.models import load

    return load(folder)


def run(args):
    from mmspec.models import load
    from mmspec.models.hf.eagle3_export import export_eagle3

    head = load(args.head)
    target = load_target(args.target)
    out = export_eagle3(head, target, args.out, args.format, embed_tokens=args.embed_tokens)
    logger.info("exported %s for %s to %s", args.head, args.format, out)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mmspec export", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = run(args)
    except ValueError as err:  # a head the engine would refuse, or one made for another target
        parser.exit(1, f"mmspec export: error: {err}\n")
    print(out)
    return 0
