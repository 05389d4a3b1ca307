"""The VLM drafters' distillation set: `python -m mmspec.train vlm-answers --target assets/mnist-vlm
--out runs/vlm-answers.pt`.

Training canvases (MNIST *train* digits, `mmspec.train.vlm_data`) with questions of every kind (mostly "Describe the
image.", whose answers are the long ones), answered by the target itself with greedy decoding (mmspec's plain loop).
Drafters distilled on the target's own answers learn what they will be asked to draft (Medusa-2 / EAGLE-3 style
self-distillation). Written chunk by chunk: re-running the command resumes after the last finished chunk; the file
records the flags that define its rows (`run_flags`: target weights, seed, number, batch size, answer length) and a
resume with other ones is refused.

Saved (`torch.save`, loads with `weights_only=True`): `canvases uint8 [N, 64, 64]`, `input_ids [N, T]`
(prompt + answer, right-padded with the pad id), `prompt_lengths [N]`, `lengths [N]`, `questions` (list of str), and
the generation settings.
"""

import logging
from pathlib import Path

import torch

from mmspec.cli import int_in_range, non_negative_int
from mmspec.methods import VLM_LIMITS
from mmspec.train.common import (
    MAX_THREADS,
    check_run_flags,
    configure_threads,
    declare_paths,
    load_checkpoint,
    run_flags,
    seed_everything,
    zoo_folder,
)


logger = logging.getLogger(__name__)

KIND_WEIGHTS = {"describe": 0.6, "what": 0.15, "which": 0.15, "count": 0.1}


def add_arguments(parser):
    parser.add_argument("--target", default=zoo_folder("mnist-vlm"), help="the VLM zoo folder (default: the shipped)")
    parser.add_argument("--out", required=True, help="output file (.pt); resumes if it exists")
    parser.add_argument("--num", type=int_in_range(1, 1_000_000), default=512, help="canvases (one question each)")
    parser.add_argument("--batch-size", type=int_in_range(1, 4096), default=16, help="answers generated per call")
    parser.add_argument("--max-new-tokens", type=int_in_range(1, VLM_LIMITS["max_new_tokens"]), default=128,
                        help="answer length cap")  # fmt: skip
    parser.add_argument("--seed", type=non_negative_int, default=1234, help="canvas / question seed")
    parser.add_argument("--threads", type=int_in_range(0, MAX_THREADS), default=2,
                        help="torch CPU threads (0: torch's default)")  # fmt: skip
    declare_paths(parser, model_folders=("target",), output_files=("out",))
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def sample_questions(num, generator, split="train"):
    """`num` (canvas float [64, 64], question) pairs over MNIST `split`, kinds drawn by `KIND_WEIGHTS`."""
    from mmspec.train.vlm_data import make_qa, mnist_digits, sample_batch

    images, labels = mnist_digits(split)
    layouts, canvases = sample_batch(num, images, labels, generator)
    kinds = list(KIND_WEIGHTS)
    picks = torch.multinomial(torch.tensor([KIND_WEIGHTS[k] for k in kinds]), num, True, generator=generator)
    questions = [make_qa(layout, kinds[int(k)], generator)[0] for layout, k in zip(layouts, picks)]
    return canvases, questions


def pad_cat(rows, pad):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


def check_args(parser, args):
    """Usage error (before any model loads) when `--out` holds answers made with other flags, or is broken."""
    if Path(args.out).is_file():
        try:
            load_answers(Path(args.out), run_flags(args))
        except ValueError as err:
            parser.error(str(err))


def load_answers(path: Path, flags: dict) -> dict:
    """The (partial) answers file `path` of an earlier run, checked against this run's `flags`.

    Raises:
        ValueError: unreadable / not an answers file, or made with other flags (the flag, both values, what to do).
    """
    done = load_checkpoint(path)
    if not isinstance(done, dict) or not {"rows", "prompt_lengths"} <= set(done):
        raise ValueError(f"{str(path)!r} is not a vlm-answers file (no rows / prompt_lengths): pass another --out")
    stored = done.get("run_flags")
    if stored is None and "seed" in done:  # a finished file of an older mmspec records some of its flags
        stored = {"seed": done["seed"], "max_new_tokens": done["max_new_tokens"]}
    check_run_flags(stored, flags, path, "--out")
    return {"rows": list(done["rows"]), "prompt_lengths": list(done["prompt_lengths"])}


def run(args):
    from tqdm.auto import tqdm

    from mmspec.models.vlm_zoo import load_vlm
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline
    from mmspec.train.vlm_data import to_pil

    configure_threads(args.threads)
    out = Path(args.out)
    flags = run_flags(args)
    done = load_answers(out, flags) if out.is_file() else {"rows": [], "prompt_lengths": []}
    done["run_flags"] = flags
    generator = seed_everything(args.seed)
    canvases, questions = sample_questions(args.num, generator)
    model, processor = load_vlm(args.target)
    pipe = SpeculativeVLMPipeline(model, processor)
    pipe.set_progress_bar_config(disable=True)
    pad = processor.tokenizer.pad_token_id or 0
    start = len(done["prompt_lengths"])
    if start:
        logger.info("resuming %s after %d / %d answers", out, start, args.num)
    for lo in tqdm(range(start, args.num, args.batch_size), disable=args.quiet, desc="answers"):
        hi = min(lo + args.batch_size, args.num)
        ims = [to_pil(c) for c in canvases[lo:hi]]
        ids, lengths, _ = pipe.encode(ims, questions[lo:hi], None, "cpu")
        res = pipe(images=ims, prompt=questions[lo:hi], max_new_tokens=args.max_new_tokens, acceptance="none",
                   output_type="ids")  # fmt: skip
        for r in range(hi - lo):
            answer = [t for t in res.sequences[r].tolist() if t >= 0]
            done["rows"].append(ids[r, : lengths[r]].tolist() + answer)
            done["prompt_lengths"].append(int(lengths[r]))
        tmp = out.with_suffix(".partial")
        torch.save(done, tmp)
        tmp.replace(out)
    rows = done["rows"]
    record = {
        "rows": rows,
        "prompt_lengths": done["prompt_lengths"],
        "input_ids": pad_cat(rows, pad),
        "lengths": torch.tensor([len(r) for r in rows]),
        "canvases": (canvases * 255).round().to(torch.uint8),
        "questions": questions,
        "max_new_tokens": args.max_new_tokens,
        "target": str(args.target),
        "seed": args.seed,
        "run_flags": flags,
    }
    torch.save(record, out)
    answer_lengths = record["lengths"] - torch.tensor(done["prompt_lengths"])
    logger.info("%d answers, %.1f tokens on average (min %d, max %d)", len(rows), answer_lengths.float().mean(),
                answer_lengths.min(), answer_lengths.max())  # fmt: skip
    return record
