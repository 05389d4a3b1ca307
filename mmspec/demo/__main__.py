"""`mmspec demo` / `python -m mmspec.demo`: serve the Gradio demo (plain vs speculative decoding, side by side, one
tab per pipeline).

    mmspec demo                                   # the shipped zoo, http://127.0.0.1:7860
    mmspec demo --port 8000 --host 0.0.0.0        # reachable from other machines
    mmspec demo --pipeline-folder my-pipeline     # a saved pipeline folder (model_index.json): its one tab

Every flag is checked before anything loads (a bad one is a usage error, exit 2); models load on first use, once.
"""

import argparse
import logging
import os
import sys
from pathlib import Path

from mmspec.cli.args import DEFAULT_ZOO, HelpFormatter, int_in_range, non_negative_int
from mmspec.cli.checks import check_device


logger = logging.getLogger(__name__)

__all__ = ["check_args", "main", "make_parser"]


def make_parser():
    parser = argparse.ArgumentParser(prog="mmspec demo", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int_in_range(1, 65535), default=7860, help="port to listen on")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--zoo", default=None, help=f"zoo folder (default: the shipped zoo, {DEFAULT_ZOO})")
    source.add_argument("--pipeline-folder", default=None, help="a saved pipeline folder (model_index.json)")
    parser.add_argument("--share", action="store_true", help="also open a public Gradio share link (off)")
    parser.add_argument("--device", default="cpu", help="torch device of the pipelines")
    parser.add_argument("--threads", type=non_negative_int, default=0, help="torch CPU threads (0: torch's default)")
    return parser


def check_args(parser, args):
    """Usage errors (exit 2) before any model loads: the zoo / pipeline folder, the device, the host."""
    from mmspec.demo.models import folder_tab, zoo_tabs

    if args.pipeline_folder is not None:
        try:
            args.tabs = [folder_tab(args.pipeline_folder)]
        except ValueError as err:
            parser.error(f"argument --pipeline-folder: {err}")
    else:
        args.zoo = DEFAULT_ZOO if args.zoo is None else args.zoo
        if not Path(args.zoo).is_dir():
            parser.error(f"argument --zoo: {args.zoo!r} is not a directory")
        args.tabs = zoo_tabs(args.zoo)
        if not args.tabs:
            parser.error(f"argument --zoo: {args.zoo!r} has none of the zoo's models (mnist-c2i + mnist-vq, "
                         "mnist-t2i, mnist-mar + mnist-kl, mnist-vlm)")  # fmt: skip
    if not args.host.strip():
        parser.error("argument --host: empty")
    check_device(parser, args.device)


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no outbound calls unless --share
    import torch

    from mmspec.demo.app import CSS, build_app
    from mmspec.demo.models import PipelineCache

    if args.threads:
        torch.set_num_threads(args.threads)
    cache = PipelineCache(zoo=args.zoo if args.pipeline_folder is None else None,
                          pipeline_folder=args.pipeline_folder, device=args.device)  # fmt: skip
    demo = build_app(cache)
    try:
        # show_error=False: an exception Gradio raises itself (e.g. refusing a hand-made upload path) reaches the
        # client as a generic message; True would send its text, which names server paths
        demo.launch(server_name=args.host, server_port=args.port, share=args.share, css=CSS, show_error=False)
    except OSError as err:  # the port is taken / the address cannot be bound: nothing was loaded yet
        parser.error(f"argument --port: cannot listen on {args.host}:{args.port} ({err})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
