"""The VLM drafters' distillation set: `python -m mmspec.train vlm-answers --target assets/mnist-vlm
--out runs/vlm-answers.pt`.

`--workload templated` (the default): training canvases (MNIST *train* digits, `mmspec.data.canvases`) with
questions of every kind (mostly "Describe the image.", whose answers are the long ones), answered by the target itself
with greedy decoding (mmspec's plain loop). `--workload free-form`: training canvases with the *train* templates of
the free-form prompts (`mmspec.data.vlm_prompts`: detail, story, layout, compare, two-turn follow-ups; canvases drawn
with seed `--seed` + 1), each answered greedily or, with probability `--sampled-fraction`, sampled at
`--temperature` (a generator per row, seeded from `--seed` and the row: resumes and batch sizes give the same rows).
`--workload both`: the `--num` templated rows, then `--num` free-form rows. `--workload readout`: the dense-readout
grids (`mmspec.data.grids`: 4x4 digits on 128x128 canvases, the train templates of rows / columns / list / find at
`grids.KIND_WEIGHTS` odds, greedy), answered by a readout target (`--target assets/mnist-vlm-readout`; a target that
reads other image sizes is a usage error). `--prompts FILE` (your own VLM): the conversations and images of a JSON
Lines file (`mmspec.data.prompt_file`: one `{"image": ..., "prompt": ...}` or `{"images": [...], "messages": [...]}` a
line, checked line by line before any model loads), answered greedily (or, for a `--sampled-fraction` of the rows,
sampled at `--temperature`) by any VLM `--target`: the zoo's or a
transformers folder (`mmspec.models.hf.vlm_folder`: Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision, ...); `--num` then caps the
lines used (default: all). `--merge A.pt B.pt ...` generates nothing:
it concatenates finished answer files (e.g. a templated and a free-form run) into `--out`. Held-out canvases and templates
(`mmspec bench vlm --workload free-form`) never appear here.
Drafters distilled on the target's own answers learn what they will be asked to draft (Medusa-2 / EAGLE-3 style
self-distillation). Written chunk by chunk: re-running the command resumes after the last finished chunk; the file
records the flags that define its rows (`run_flags`: target weights, seed, number, batch size, answer length) and a
resume with other ones is refused.

Saved (`torch.save`, loads with `weights_only=True`): `canvases uint8 [N, 64, 64]` (readout: [N, 128, 128]; a
`--prompts` run instead records each row's `image_files` and their `image_sha256`, reopened by the trainers), `input_ids [N, T]`
(prompt + answer, right-padded with the pad id; the prompt of a follow-up holds both turns and the first answer),
`prompt_lengths [N]`, `lengths [N]`, `questions` (list of str: the last user turn), `messages` (the conversations),
`kinds` / `templates` (templated rows: "templated"), `sampled` (bool [N]), and the generation settings.
"""

import logging
from pathlib import Path

import torch

from mmspec.cli.args import int_in_range, non_negative_int, positive_float, probability
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
WORKLOADS = ("templated", "free-form", "both", "readout")
FILE_WORKLOAD = "file"  # the workload of a --prompts run
DEFAULT_NUM = 512
SAMPLE_SEED_STRIDE = 1_000_003  # row r of a run with --seed s samples with a generator seeded s * stride + r


def add_arguments(parser):
    parser.add_argument("--target", default=zoo_folder("mnist-vlm"),
                        help="the VLM: a zoo folder (default: the shipped) or, with --prompts, your own transformers "
                             "VLM folder (Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision, ...)")  # fmt: skip
    parser.add_argument("--out", required=True, help="output file (.pt); resumes if it exists")
    parser.add_argument("--num", type=int_in_range(1, 1_000_000), default=None,
                        help=f"canvases (one question each) per workload (default {DEFAULT_NUM}); with --prompts, the "
                             "first lines used (default: all)")  # fmt: skip
    parser.add_argument("--workload", choices=WORKLOADS, default=None,
                        help="templated questions (the default), free-form train prompts (mmspec.data.vlm_prompts), "
                             "both, or the dense-readout grids (mmspec.data.grids; needs a readout --target)")  # fmt: skip
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="your own prompts and images, a JSON Lines file (mmspec.data.prompt_file), answered "
                             "(greedily by default) instead of a --workload")  # fmt: skip
    parser.add_argument("--sampled-fraction", type=probability, default=None,
                        help="free-form (default 0.5) or --prompts (default 0: greedy) rows answered by sampling, "
                             "at --temperature (the rest greedy)")  # fmt: skip
    parser.add_argument("--temperature", type=positive_float, default=1.0, help="of the sampled answers")
    parser.add_argument("--batch-size", type=int_in_range(1, 4096), default=16, help="answers generated per call")
    parser.add_argument("--max-new-tokens", type=int_in_range(1, VLM_LIMITS["max_new_tokens"]), default=256,
                        help="answer length cap (free-form answers run past 128 tokens)")  # fmt: skip
    parser.add_argument("--seed", type=non_negative_int, default=1234, help="canvas / question seed")
    parser.add_argument("--threads", type=int_in_range(0, MAX_THREADS), default=2,
                        help="torch CPU threads (0: torch's default)")  # fmt: skip
    declare_paths(parser, model_folders=("target",), input_files=("prompts",), output_files=("out",))
    parser.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                        help="concatenate these finished answer files into --out instead of generating")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def sample_questions(num, generator, split="train"):
    """`num` (canvas float [64, 64], question) pairs over MNIST `split`, kinds drawn by `KIND_WEIGHTS`."""
    from mmspec.data.canvases import make_qa, mnist_digits, sample_batch

    images, labels = mnist_digits(split)
    layouts, canvases = sample_batch(num, images, labels, generator)
    kinds = list(KIND_WEIGHTS)
    picks = torch.multinomial(torch.tensor([KIND_WEIGHTS[k] for k in kinds]), num, True, generator=generator)
    questions = [make_qa(layout, kinds[int(k)], generator)[0] for layout, k in zip(layouts, picks)]
    return canvases, questions


def user_turn(question):
    """A one-turn conversation: the image, then `question` (what the pipeline builds from a `prompt`)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def file_rows(rows, num=None, seed=0, sampled_fraction=0.0):
    """The rows of a `--prompts` file as `read_prompt_file` returned them (the read `answers_flags` recorded; its
    first `num` lines, all by default): `workload_rows`' fields with `image_files` / `image_sha256` (per row) in
    place of `canvases`; a row is sampled with probability `sampled_fraction` (drawn from a generator seeded `seed`),
    else answered greedily."""
    lines = list(rows)[:num]
    sampled = torch.rand(len(lines), generator=torch.Generator().manual_seed(seed)) < sampled_fraction
    return {
        "messages": [r.messages for r in lines],
        "questions": [r.question for r in lines],
        "kinds": [FILE_WORKLOAD] * len(lines),
        "templates": [FILE_WORKLOAD] * len(lines),
        "sampled": sampled.tolist(),
        "image_files": [list(r.image_files) for r in lines],
        "image_sha256": [list(r.image_sha256) for r in lines],
    }


def workload_rows(workload, num, seed, sampled_fraction):
    """The rows to answer: dict of `canvases` float [N, 64, 64], `messages`, `questions`, `kinds`, `templates`,
    `sampled` (list of bool); templated rows (as `sample_questions` with `--seed`) first, then free-form ones."""
    from mmspec.data.vlm_prompts import sample_prompts

    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r}: use one of {WORKLOADS}")
    num = DEFAULT_NUM if num is None else num
    canvases, rows = [], {"messages": [], "questions": [], "kinds": [], "templates": [], "sampled": []}
    generator = torch.Generator().manual_seed(seed)
    if workload in ("templated", "both"):
        templated, questions = sample_questions(num, generator)
        canvases.append(templated)
        rows["messages"] += [user_turn(q) for q in questions]
        rows["questions"] += questions
        rows["kinds"] += ["templated"] * num
        rows["templates"] += ["templated"] * num
        rows["sampled"] += [False] * num
    if workload == "readout":
        from mmspec.data import grids
        from mmspec.data.canvases import mnist_digits

        _, grid, prompts = grids.sample_training(num, *mnist_digits("train"), generator)
        canvases.append(grid)
        rows["messages"] += [p.messages for p in prompts]
        rows["questions"] += [p.text for p in prompts]
        rows["kinds"] += [p.kind for p in prompts]
        rows["templates"] += [p.template for p in prompts]
        rows["sampled"] += [False] * num
    if workload in ("free-form", "both"):
        _, free, prompts = sample_prompts(num, "train", seed + 1)
        canvases.append(free)
        rows["messages"] += [p.messages for p in prompts]
        rows["questions"] += [p.text for p in prompts]
        rows["kinds"] += [p.kind for p in prompts]
        rows["templates"] += [p.template for p in prompts]
        rows["sampled"] += (torch.rand(num, generator=generator) < sampled_fraction).tolist()
    rows["canvases"] = torch.cat(canvases)
    return rows


def pad_cat(rows, pad):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


def target_image_size(folder) -> int:
    """The image side the VLM folder's vision tower reads (its config.json)."""
    import json

    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("vision_config", {}).get("image_size", 0))


def resolve_defaults(args):
    """Fill the defaults that depend on other flags (idempotent): `--workload` "file" with `--prompts`, else
    "templated"; `--num` `DEFAULT_NUM` for a drawn workload (a `--prompts` run keeps None: every line);
    `--sampled-fraction` 0 with `--prompts` (greedy answers), else 0.5 (free-form rows)."""
    if getattr(args, "sampled_fraction", None) is None:
        args.sampled_fraction = 0.0 if getattr(args, "prompts", None) is not None else 0.5
    if getattr(args, "prompts", None) is not None:
        args.workload = args.workload or FILE_WORKLOAD
    else:
        args.workload = args.workload or "templated"
        args.num = DEFAULT_NUM if args.num is None else args.num
    return args


def answers_flags(args, prompts=None) -> dict:
    """`run_flags(args)`, where a `--prompts` file's sha256 covers its images too (each image's sha256, in order): a
    resume after an image changed is refused like one after the file changed. `prompts`: what
    `mmspec.data.prompt_file.read_prompts` returned for the file (read here when not given), so the flags record
    the very read whose rows are answered."""
    flags = run_flags(args)
    if getattr(args, "prompts", None) is not None:
        from mmspec.data.prompt_file import read_prompts

        flags["prompts"]["sha256"] = (prompts or read_prompts(args.prompts))[1]
    return flags


def check_args(parser, args):
    """Usage error (before any model loads) when `--out` holds answers made with other flags, or is broken; with
    `--merge`, when an input is missing, unfinished or not an answers file, or is `--out` itself; when the target
    is not a VLM folder; with `--prompts`, when a line of the file is malformed or names an image that does not open
    (the file and line named), or a `--workload` is given too; else when the target is not a zoo VLM or reads
    another image size than the workload's canvases (the processor would resize them silently)."""
    from mmspec.data import canvases, grids
    from mmspec.data.prompt_file import read_prompts
    from mmspec.models.hf.vlm_folder import ZOO, check_vlm_folder

    prompts = None
    try:
        kind = check_vlm_folder(args.target)
    except ValueError as err:
        parser.error(f"argument --target: {err}")
    if args.prompts is not None:
        if args.workload is not None:
            parser.error("argument --prompts: not allowed with --workload (the file is the workload)")
        if args.merge is not None:
            parser.error("argument --prompts: not allowed with --merge")
        try:
            prompts = read_prompts(args.prompts)
        except ValueError as err:
            parser.error(f"argument --prompts: {err}")
    resolve_defaults(args)
    if args.prompts is None and args.merge is None and kind != ZOO:
        parser.error(f"argument --target: {str(args.target)!r} is your own VLM; --workload "
                     f"{args.workload} draws MNIST canvases for the zoo's VLMs: pass your prompts "
                     "and images with --prompts FILE")  # fmt: skip
    if args.merge is None and args.prompts is None:
        side = grids.CANVAS if args.workload == "readout" else canvases.CANVAS
        size = target_image_size(args.target)
        if size != side:
            hint = "assets/mnist-vlm-readout" if args.workload == "readout" else "assets/mnist-vlm"
            parser.error(f"argument --target: {str(args.target)!r} reads {size}x{size} images, but --workload "
                         f"{args.workload} draws {side}x{side} canvases; use a target such as {hint}")  # fmt: skip
    if args.merge is not None:
        records = []
        for path in args.merge:
            if Path(path).resolve() == Path(args.out).resolve():
                parser.error(f"argument --merge: {path!r} is also --out")
            try:
                records.append(load_finished(Path(path)))
            except ValueError as err:
                parser.error(f"argument --merge: {err}")
        try:
            merged_images(records, args.merge)
        except ValueError as err:
            parser.error(f"argument --merge: {err}")
        return
    if Path(args.out).is_file():
        try:
            load_answers(Path(args.out), answers_flags(args, prompts))
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


FIELDS = ("rows", "prompt_lengths", "questions", "messages", "kinds", "templates", "sampled", "run_flags")
# a drawn workload's pixels, or a --prompts run's image files
IMAGE_FIELDS = (("canvases",), ("image_files", "image_sha256"))


def load_finished(path: Path) -> dict:
    """A finished answers file (as `run` writes it at the end), else a ValueError naming `path`."""
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist")
    record = load_checkpoint(path)
    missing = [k for k in FIELDS if not isinstance(record, dict) or k not in record]
    if not missing and not any(all(k in record for k in keys) for keys in IMAGE_FIELDS):
        missing = ["canvases"]
    if missing:
        raise ValueError(f"{str(path)!r} is not a finished vlm-answers file (no {missing[0]}): finish its run first")
    return record


def merged_images(records, paths) -> dict:
    """The image fields of finished answer `records` concatenated: `canvases` when every one has them, `image_files`
    / `image_sha256` when every one comes from `--prompts`; a ValueError naming both kinds' files otherwise (canvases
    and image files do not mix)."""
    files = [str(p) for p, r in zip(paths, records, strict=True) if "canvases" not in r]
    if not files:
        return {"canvases": torch.cat([r["canvases"] for r in records])}
    if len(files) < len(records):
        drawn = [str(p) for p, r in zip(paths, records, strict=True) if "canvases" in r]
        raise ValueError(f"{drawn[0]!r} holds drawn canvases and {files[0]!r} a --prompts file's images: they do not "
                         "merge (train on one kind, or answer both from --prompts files)")  # fmt: skip
    return {k: [x for r in records for x in r[k]] for k in IMAGE_FIELDS[1]}


def merge_answers(paths, pad: int) -> dict:
    """Concatenate finished answer files `paths` (rows in order); `run_flags` lists each input's flags."""
    records = [load_finished(Path(p)) for p in paths]
    merged = {k: [x for r in records for x in r[k]] for k in ("rows", "prompt_lengths", "questions", "messages",
                                                             "kinds", "templates")}  # fmt: skip
    merged.update(
        input_ids=pad_cat(merged["rows"], pad),
        lengths=torch.tensor([len(r) for r in merged["rows"]]),
        **merged_images(records, paths),
        sampled=torch.cat([torch.as_tensor(r["sampled"], dtype=torch.bool) for r in records]),
        workload="+".join(str(r.get("workload", "templated")) for r in records),
        run_flags={"merge": [r["run_flags"] for r in records]},
        merged_from=[str(p) for p in paths],
    )
    return merged


def run(args):
    from tqdm.auto import tqdm

    from mmspec.data.canvases import to_pil
    from mmspec.data.prompt_file import open_images, read_prompts
    from mmspec.models.hf.vlm_folder import load_target_vlm
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    configure_threads(args.threads)
    resolve_defaults(args)
    out = Path(args.out)
    if args.merge is not None:
        record = merge_answers(args.merge, load_target_vlm(args.target)[1].tokenizer.pad_token_id or 0)
        tmp = out.with_suffix(".partial")
        torch.save(record, tmp)
        tmp.replace(out)
        logger.info("merged %d answers from %s into %s", len(record["rows"]), ", ".join(args.merge), out)
        return record
    prompts = read_prompts(args.prompts) if args.prompts is not None else None  # one read: flags and rows
    flags = answers_flags(args, prompts)
    done = load_answers(out, flags) if out.is_file() else {"rows": [], "prompt_lengths": []}
    done["run_flags"] = flags
    seed_everything(args.seed)
    if args.workload == FILE_WORKLOAD:
        work = file_rows(prompts[0], args.num, args.seed, args.sampled_fraction)
        total = len(work["messages"])

        def row_images(r):  # hashed just now by read_prompts
            return open_images(work["image_files"][r])
    else:
        work = workload_rows(args.workload, args.num, args.seed, args.sampled_fraction)
        total = len(work["canvases"])

        def row_images(r):
            return [to_pil(work["canvases"][r])]

    model, processor = load_target_vlm(args.target)
    pipe = SpeculativeVLMPipeline(model, processor)
    pipe.set_progress_bar_config(disable=True)
    pad = processor.tokenizer.pad_token_id or 0
    start = len(done["prompt_lengths"])
    if start:
        logger.info("resuming %s after %d / %d answers", out, start, total)
    for lo in tqdm(range(start, total, args.batch_size), disable=args.quiet, desc="answers"):
        hi = min(lo + args.batch_size, total)
        answers = {}
        for sampled in (False, True):  # one call per decoding mode
            rows = [r for r in range(lo, hi) if work["sampled"][r] == sampled]
            if not rows:
                continue
            ims, chats = [im for r in rows for im in row_images(r)] or None, [work["messages"][r] for r in rows]
            ids, lengths, _ = pipe.encode(ims, None, chats, "cpu")
            knobs = dict(do_sample=False)
            if sampled:
                knobs = dict(do_sample=True, temperature=args.temperature,
                             generator=[torch.Generator().manual_seed(args.seed * SAMPLE_SEED_STRIDE + r) for r in rows])  # fmt: skip
            res = pipe(images=ims, messages=chats, max_new_tokens=args.max_new_tokens, acceptance="none",
                       output_type="ids", **knobs)  # fmt: skip
            for i, r in enumerate(rows):
                answer = [t for t in res.sequences[i].tolist() if t >= 0]
                answers[r] = (ids[i, : lengths[i]].tolist() + answer, int(lengths[i]))
        for r in range(lo, hi):
            done["rows"].append(answers[r][0])
            done["prompt_lengths"].append(answers[r][1])
        tmp = out.with_suffix(".partial")
        torch.save(done, tmp)
        tmp.replace(out)
    rows = done["rows"]
    if "canvases" in work:
        images = {"canvases": (work["canvases"] * 255).round().to(torch.uint8)}
    else:
        images = {k: work[k] for k in IMAGE_FIELDS[1]}
    record = {
        "rows": rows,
        "prompt_lengths": done["prompt_lengths"],
        "input_ids": pad_cat(rows, pad),
        "lengths": torch.tensor([len(r) for r in rows]),
        "questions": work["questions"],
        "messages": work["messages"],
        "kinds": work["kinds"],
        "templates": work["templates"],
        "sampled": torch.tensor(work["sampled"], dtype=torch.bool),
        **images,
        "workload": args.workload,
        "temperature": args.temperature,
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
