"""`mmspec bench t2i`: the training-free methods side by side on a transformers text-to-image model (Janus /
Janus-Pro), in one process, on the same prompts and seeds.

The target is `SpeculativeJanusPipeline.from_pretrained(--model)`: the shipped `mnist-janus` zoo model by default (a
real `JanusForConditionalGeneration`, trained here on MNIST prompts), or a local folder / hub id such as
`deepseek-ai/Janus-Pro-1B` for online users. Methods are the presets of `mmspec.methods.PRESETS` that need no
trained drafter (the target drafts for itself: SJD, SCD, SJD-PAC, GSD, LANTERN on Jacobi drafts, exact speculative
sampling of Jacobi drafts) plus `plain`; see `T2I_PRESETS`. The protocol, timing and report fields are those of
`mmspec bench ar-image` (`mmspec.eval.bench_ar_image.measure`): one warm-up call per method, then `--repeats`
interleaved rounds on the same seeds; `speedup` = plain latency / method latency from the same run;
`step_compression` = image tokens / target forwards of a call.

Prompts: `--prompts FILE` (one per line), else the digit prompts "a handwritten <digit>", and then `accuracy` is the
zoo classifier's accuracy on the digit each prompt names (null for other prompts).
"""

import json
import logging
import re
import time
from pathlib import Path

import torch

from mmspec.cli.args import (
    DEFAULT_ZOO,
    MAX_BATCH,
    add_knob_arguments,
    int_in_range,
    knob_values,
    names_of,
    sampling_type,
    seed_int,
    threads_int,
)
from mmspec.cli.checks import check_device, check_zoo_folders
from mmspec.eval.bench_ar_image import DIGIT_PROMPTS, MAX_IMAGES, MAX_REPEATS, check_batch_size, image_report, measure
from mmspec.methods import PRESETS, resolve_drafter


logger = logging.getLogger(__name__)

DEFAULT_MODEL = str(Path(DEFAULT_ZOO) / "mnist-janus")
MAX_PROMPTS = 10_000
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")  # owner/name on the hub


def _training_free(presets):
    """The presets that run without a trained drafter (their drafter resolves with no component loaded)."""
    names = {}
    for name, preset in presets.items():
        try:
            resolve_drafter(preset["acceptance"], preset.get("drafter"), set())
        except ValueError:
            continue
        names[name] = preset
    return names


# training-free presets of the registry, plus the variants a self-drafting target adds: SJD without SCD coupling,
# LANTERN on Jacobi drafts ("LANTERN-on-Jacobi"), exact speculative sampling of Jacobi drafts
T2I_PRESETS = _training_free(PRESETS) | {
    "relaxed-jacobi": dict(acceptance="relaxed", drafter="jacobi"),
    "exact-jacobi": dict(acceptance="exact", drafter="jacobi"),
}


def add_arguments(parser):
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a Janus / Janus-Pro folder or hub id (default: the zoo's mnist-janus)")  # fmt: skip
    parser.add_argument("--prompts", type=Path, default=None,
                        help="a text file with one prompt per line (default: 'a handwritten <digit>', judged by the "
                             "zoo's MNIST classifier)")  # fmt: skip
    parser.add_argument("--zoo", default=DEFAULT_ZOO, help="folder with mnist-classifier (digit prompts only)")
    parser.add_argument("--batch-size", type=int_in_range(1, MAX_BATCH), default=1,
                        help="images per call (at most --num-images)")  # fmt: skip
    parser.add_argument("--num-images", type=int_in_range(1, MAX_IMAGES), default=20,
                        help="images per method per repeat (a multiple of --batch-size)")  # fmt: skip
    parser.add_argument("--repeats", type=int_in_range(1, MAX_REPEATS), default=2)
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--methods", type=names_of(T2I_PRESETS), default=",".join(T2I_PRESETS),
                        help="comma-separated subset of " + ",".join(T2I_PRESETS))  # fmt: skip
    parser.add_argument("--guidance-scale", type=sampling_type("guidance_scale", float), default=2.0,
                        help="classifier-free guidance (the zoo model's; transformers' Janus default is 5)")  # fmt: skip
    parser.add_argument("--temperature", type=sampling_type("temperature", float), default=1.0)
    parser.add_argument("--top-k", type=sampling_type("top_k", int), default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="weights dtype (bfloat16 for Janus-Pro on a GPU)")  # fmt: skip
    parser.add_argument("--threads", type=threads_int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--device", default="cpu", help="device the model runs on (and the generators live on)")
    add_knob_arguments(parser)


def read_prompts(path: Path) -> list[str]:
    """Non-empty lines of a UTF-8 text file; ValueError naming the file when there are none or too many."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {str(path)!r}: {err}") from None
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"{str(path)!r} has no prompt (one per line)")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"{str(path)!r} has {len(prompts)} prompts; at most {MAX_PROMPTS}")
    return prompts


def check_args(parser, args):
    """Before any model loads: the model folder (when local) holds a transformers config, the prompts file reads,
    the classifier is there for digit prompts, the methods accept the sampling settings, the batch size divides the
    images, the device exists."""
    from mmspec.cli.checks import check_sampling_only, check_top_k_vocab

    local = Path(args.model).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            parser.error(f"argument --model: {args.model!r} is not a transformers model folder (no config.json)")
        try:  # the image vocabulary (VQ codebook size), for --top-k, without loading the model
            vocab = (json.loads((local / "config.json").read_text()).get("vq_config") or {}).get("num_embeddings")
        except (OSError, ValueError, AttributeError) as err:
            parser.error(f"argument --model: {str(local / 'config.json')!r} is not a readable config ({err})")
        check_top_k_vocab(parser, args.top_k, vocab, f"{args.model} (its VQ codebook)")
    elif not HUB_ID.fullmatch(args.model):
        parser.error(f"argument --model: {args.model!r} is neither a folder nor a hub id like "
                     "'deepseek-ai/Janus-Pro-1B'")  # fmt: skip
    if args.prompts is not None:
        try:
            args.prompt_list = read_prompts(args.prompts)
        except ValueError as err:
            parser.error(f"argument --prompts: {err}")
    else:
        args.prompt_list = None
        check_zoo_folders(parser, args.zoo, ["mnist-classifier"])
    for name in args.methods:
        check_sampling_only(parser, T2I_PRESETS[name]["acceptance"], args.temperature, name)
    check_batch_size(parser, args)
    check_device(parser, args.device)


@torch.no_grad()
def run(args):
    names = list(args.methods)
    if "plain" not in names:
        names.insert(0, "plain")  # speedups are relative to plain AR from the same run
    prompt_list = getattr(args, "prompt_list", None)
    if prompt_list is None and args.prompts is not None:
        prompt_list = read_prompts(args.prompts)

    from mmspec.models import load
    from mmspec.pipelines import SpeculativeJanusPipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = SpeculativeJanusPipeline.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype))
    pipe = pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)  # one bar over all calls instead (measure)
    device = pipe._execution_device
    knobs = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k)
    knobs |= knob_values(args)
    bs = args.batch_size
    calls = -(-args.num_images // bs)
    prompts = prompt_list or DIGIT_PROMPTS
    index = [[(c * bs + i) % len(prompts) for i in range(bs)] for c in range(calls)]

    def call(name, c, seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        start = time.perf_counter()
        out = pipe(prompt=[prompts[i] for i in index[c]], generator=gen, output_type="pt",
                   **(knobs | T2I_PRESETS[name]))  # fmt: skip
        return out, time.perf_counter() - start

    judge = None
    if prompt_list is None:  # digit prompts: is the image the digit the prompt names?
        classifier = load(Path(args.zoo) / "mnist-classifier", device=device)

        def judge(out, c):
            images = out.images.to(device=device, dtype=torch.float32)
            if images.shape[1] == 3:
                images = images.mean(1, keepdim=True)
            pred = classifier(images * 2 - 1).argmax(-1)
            return int((pred == torch.tensor(index[c], device=pred.device)).sum())

    n_tok = pipe.num_image_tokens
    methods = measure(names, call, calls, bs, n_tok, args, device, judge)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("json", "prompt_list")}
    config |= {"methods": names, "prompts": None if args.prompts is None else str(args.prompts)}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return image_report(config, {n: knobs | T2I_PRESETS[n] for n in names}, methods, args, calls, n_tok,
                        device_name=device_name)  # fmt: skip
