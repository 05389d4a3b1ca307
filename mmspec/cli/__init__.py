"""Command line: `mmspec COMMAND [options]`, commands registered in `COMMANDS` (one line each).

`mmspec generate` (`mmspec.cli.generate`, the README's main job) samples a grid of digits from the shipped MNIST zoo
with speculative decoding and prints the speed statistics next to plain AR decoding of the same images; `mmspec vlm`
(`mmspec.cli.vlm`) asks the VLM zoo about an image; `mmspec export` (`mmspec.cli.export`) writes an EAGLE-3 head as
the draft folder vLLM / SGLang load. `mmspec bench`, `train`, `eval` and `demo` hand their arguments
to their own entry points (`mmspec bench --help`, ...). Only the chosen command's module is imported, so
`mmspec --help` does not import torch.

The pieces every command line shares live beside this file: `mmspec.cli.args` (argparse types with bounds, the
method-knob flags from the registry `mmspec.methods`, `HelpFormatter`, `dispatch`) and `mmspec.cli.checks` (the
parse-time checks: output paths, device, zoo folders, knob combinations; `write_json`).
"""

import sys

from mmspec.cli.args import dispatch


__all__ = ["COMMANDS", "main"]

# command -> ("module:function" called with the remaining arguments, help); one line each
COMMANDS = {
    "generate": ("mmspec.cli.generate:main", "sample a digit grid from the MNIST zoo and print speed stats"),
    "vlm": ("mmspec.cli.vlm:main", "ask the VLM zoo about an image (speculative decoding) and print speed stats"),
    "bench": ("mmspec.eval.bench:main", "benchmarks (see `mmspec bench --help`)"),
    "train": ("mmspec.train.__main__:main", "train zoo models (see `mmspec train --help`)"),
    "export": ("mmspec.cli.export:main", "export an EAGLE-3 head for vLLM / SGLang (see `mmspec export --help`)"),
    "eval": ("mmspec.eval:main", "evaluation scripts: fid (see `mmspec eval --help`)"),
    "demo": (
        "mmspec.demo.__main__:main",
        "serve the Gradio demo: plain vs speculative decoding side by side, one tab per pipeline",
    ),
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    return dispatch(COMMANDS, argv, "mmspec", __doc__.split("\n\n")[0])
