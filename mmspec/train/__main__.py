"""Training entry point: `python -m mmspec.train TASK [options]`.

Each task lives in its own module exposing `add_arguments(parser)` and `run(args)`; runs are seeded,
checkpoint as they go (re-running the same command resumes; a resume with other flags that change the result is
refused), show a progress bar (`--quiet`: none), and write a
model card into `--out`. Only the chosen task's module is imported.
"""

import argparse
import importlib
import logging
import sys


TASKS = {
    "vq": ("mmspec.train.vq", "VQ tokenizer on MNIST (28x28 padded to 32x32)"),
    "classifier": ("mmspec.train.classifier", "MNIST digit classifier (accuracy + in-domain features)"),
    "kl": ("mmspec.train.kl", "KL autoencoder (continuous tokens) on MNIST"),
    "tokenize": ("mmspec.train.tokenize", "encode MNIST with a trained VQ into token grids"),
    "c2i": ("mmspec.train.gpt", "class-conditional LlamaGen GPT target on VQ tokens"),
    "draft": ("mmspec.train.draft", "small GPT draft distilled on the target's outputs"),
    "eagle": ("mmspec.train.eagle", "EAGLE-style feature head on the target's hidden states"),
    "mar": ("mmspec.train.mar", "class-conditional MAR (target or --preset draft) on KL tokens (mnist-mar)"),
    "vlm": ("mmspec.train.vlm", "offline VLM target: LLaVA = frozen SmolLM2-135M + small CLIP tower (mnist-vlm)"),
    "vlm-readout": (
        "mmspec.train.vlm_readout",
        "dense-readout VLM target: 4x4 digit grids, 256 image tokens (mnist-vlm-readout)",
    ),
    "t2i": ("mmspec.train.t2i", "text-to-image LlamaGen GPT on VQ tokens + MiniLM caption features (mnist-t2i)"),
    "janus-t2i": (
        "mmspec.train.janus_t2i",
        "text-to-image transformers Janus (small Llama + the converted VQ) (mnist-janus)",
    ),
    "vlm-answers": ("mmspec.train.vlm_answers", "the VLM target's own answers on training canvases (drafter data)"),
    "vlm-draft": ("mmspec.train.vlm_draft", "layer-truncated SmolLM2 draft distilled on the VLM target's answers"),
    "vlm-eagle": ("mmspec.train.vlm_eagle", "EAGLE head on the VLM target's features (training-time test)"),
    "vlm-eagle3": ("mmspec.train.vlm_eagle3", "EAGLE-3 head (aux hidden states) by online distillation from the VLM"),
    "vlm-vision": (
        "mmspec.train.vlm_vision",
        "vision-aware EAGLE head (vispec | msd | specvlm) by online distillation",
    ),
}


def main(argv=None):
    from mmspec.cli.args import HelpFormatter

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mmspec train", description=__doc__)
    sub = parser.add_subparsers(dest="task", required=True)
    chosen = None
    for name, (module_name, help_text) in TASKS.items():
        task_parser = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        if argv and argv[0] == name:  # only the chosen task's module (torch, diffusers) is imported
            module = importlib.import_module(module_name)
            module.add_arguments(task_parser)
            task_parser.set_defaults(_run=module.run)
            chosen = (task_parser, module)
    args = parser.parse_args(argv)
    if chosen is not None:  # bad paths and inconsistent flags: usage errors before any model or data loads
        from mmspec.train.common import check_train_args

        task_parser, module = chosen
        check_train_args(task_parser, args)
        if hasattr(module, "check_args"):
            module.check_args(task_parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args._run(args)


if __name__ == "__main__":
    sys.exit(main())
