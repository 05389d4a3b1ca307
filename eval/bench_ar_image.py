"""`mmspec bench ar-image`: every AR-image method side by side, in one process, on the same seeds.

Methods are the named presets of `mmspec.methods.PRESETS` (names fixed for the JSON): `plain` (AR sampling),
`exact-draft` (small GPT drafter), `exact-eagle` (EAGLE head, pipeline default: a sampled chain), `exact-eagle-tree`
(EAGLE-2 dynamic tree: 24 nodes, depth 5, top-k 4), `relaxed` (LANTERN on EAGLE drafts), `grouped` (GSD on Jacobi
drafts), `jacobi` (SJD + SCD), `sjd-pac` (SJD-PAC: a Jacobi tree, width 3, depth 2, window 16). One option per pipeline knob of `mmspec.methods.KNOBS` (`--tree-depth`, `--coupling`, ...);
options left unset keep the pipeline's defaults; a method's own settings (e.g. the tree's) win over them.

Protocol: one warm-up call per method, then `--repeats` rounds; each round runs every method (interleaved, so drift
hits all alike) on the same `--num-images` class labels (balanced over the classes) with the same per-call seeds.
`latency_s` is the median over calls of wall time / images in the call; `speedup` = plain latency / method latency
from the same run; `accuracy` is the zoo classifier's accuracy on all generated images of the method.
`target_forwards_per_image` = sequential target forwards an image needs (its call's forwards: every image of a batched
call is in each of them; plain = image tokens). `step_compression` = image tokens / target forwards of the batched call (what latency sees: a batch finishes with
its slowest row); `row_step_compression` = the same per row, averaged (each row's own rounds + the prefill).
`syncs_per_round` (CUDA only, else null): host-device synchronisations of one call per round (prefill included),
counted with `torch.cuda.set_sync_debug_mode`.

`--dataset natural` runs the natural-image zoo (`natural-c2i`, `natural-vq`, `natural-c2i-eagle`: 32x32 crops of
scikit-image's photographs at two scales, 256 tokens, `mmspec.data.natural`), the regime SJD-PAC and SCD were made
for; `--dataset textures` the texture zoo (`texture-*`: 64x64 textile crops, high-entropy but nearly context-free).
For both `accuracy` is null, each method gets `fid` against the dataset's held-out crops
(`mmspec.eval.image_quality`), and `config.target_next_token` holds the target's next-token entropy, top-1
probability, k90 and stale-draft acceptance on 200 held-out crops, which say which regime the zoo is in.
"""

import inspect
import logging
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

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
from mmspec.cli.checks import check_device, check_knob_combination, check_method, check_zoo_folders
from mmspec.methods import PRESETS


logger = logging.getLogger(__name__)


# `--model t2i`: digit d is requested as DIGIT_PROMPTS[d]
DIGIT_PROMPTS = [f"a handwritten {w}" for w in
                 ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")]  # fmt: skip


MAX_IMAGES = 10_000  # `--num-images` per method per repeat

MAX_REPEATS = 1000
ZOO_PREFIX = {"mnist": "mnist", "textures": "texture", "natural": "natural"}  # `--dataset` -> the zoo folders' prefix


def add_arguments(parser):
    parser.add_argument("--zoo", default=DEFAULT_ZOO,
                        help="folder with mnist-c2i (or mnist-t2i), mnist-vq, mnist-classifier and the drafters")  # fmt: skip
    parser.add_argument("--dataset", default="mnist", choices=tuple(ZOO_PREFIX),
                        help="the MNIST zoo (mnist-*), the natural-image zoo (natural-*, c2i only) or the texture "
                             "zoo (texture-*, c2i only)")  # fmt: skip
    parser.add_argument("--model", default="c2i", choices=("c2i", "t2i"),
                        help="the zoo's class-conditional (mnist-c2i) or text-to-image (mnist-t2i, prompts "
                             "'a handwritten <digit>') target")  # fmt: skip
    parser.add_argument("--batch-size", type=int_in_range(1, MAX_BATCH), default=1,
                        help="images per call (at most --num-images)")  # fmt: skip
    parser.add_argument("--num-images", type=int_in_range(1, MAX_IMAGES), default=40,
                        help="images per method per repeat (a multiple of --batch-size)")  # fmt: skip
    parser.add_argument("--repeats", type=int_in_range(1, MAX_REPEATS), default=2)
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--methods", type=names_of(PRESETS), default=",".join(PRESETS),
                        help="comma-separated subset of " + ",".join(PRESETS))  # fmt: skip
    parser.add_argument("--guidance-scale", type=sampling_type("guidance_scale", float), default=2.0)
    parser.add_argument("--temperature", type=sampling_type("temperature", float), default=1.0)
    parser.add_argument("--top-k", type=sampling_type("top_k", int), default=None)
    parser.add_argument("--threads", type=threads_int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--device", default="cpu", help="device the models run on (and the generators live on)")
    add_knob_arguments(parser)


def check_args(parser, args):
    """Before any model loads: the zoo has the target, VQ, classifier and every drafter the methods need; the
    methods accept the sampling settings; the batch size divides the images; the device exists."""
    from mmspec.cli.checks import check_dataset, check_sampling_only, check_top_k_vocab
    from mmspec.eval.cli_checks import check_inception
    from mmspec.methods import resolve_drafter
    from mmspec.models import read_config, zoo_folders

    if args.dataset != "mnist" and args.model != "c2i":
        parser.error(f"argument --model: the {args.dataset} zoo is class-conditional only: use --model c2i")
    try:
        folders = zoo_folders(args.zoo, prefix=ZOO_PREFIX[args.dataset], kind=args.model)
        configs = {name: read_config(folder) for name, folder in folders.items()}
    except ValueError as err:
        parser.error(f"argument --zoo: {err}")
    check_top_k_vocab(parser, args.top_k, configs["transformer"].get("vocab_size"), f"the zoo's target ({args.zoo})")
    if args.dataset == "mnist":
        check_zoo_folders(parser, args.zoo, ["mnist-classifier"])
    else:
        check_dataset(parser, "--dataset", args.dataset, "the FID reference and the regime statistics")
        check_inception(parser, "--dataset")
    for name in args.methods:
        preset = PRESETS[name]
        try:
            resolve_drafter(preset["acceptance"], preset.get("drafter"), set(folders))
        except ValueError as err:
            parser.error(f"argument --methods: {name}: {err}: the zoo {args.zoo!r} lacks its drafter folder")
        check_sampling_only(parser, preset["acceptance"], args.temperature, name)
        check_knob_combination(parser, knob_values(args) | preset)
        check_method(parser, preset["acceptance"], preset.get("drafter"), knob_values(args) | preset)
    check_batch_size(parser, args)
    check_device(parser, args.device)


def check_batch_size(parser, args):
    """Usage error unless `--batch-size` divides `--num-images` (every method makes exactly `--num-images` images per
    repeat)."""
    if args.batch_size > args.num_images or args.num_images % args.batch_size:
        parser.error(f"argument --batch-size: {args.batch_size} does not divide --num-images {args.num_images} "
                     "(every method must generate exactly --num-images images per repeat)")  # fmt: skip


def _knobs(args):
    """Sampling settings plus the knob options that were set (the rest keep the pipeline's defaults)."""
    knobs = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k)
    return knobs | knob_values(args)


def _effective_kwargs(pipe, kw):
    """Every `__call__` knob of the pipeline as used (defaults filled in), for the JSON config."""
    skip = {"class_labels", "prompt", "prompt_embeds", "prompt_attention_mask", "generator", "output_type",
            "return_dict", "callback_on_step_end",
            "callback_on_step_end_tensor_inputs"}  # fmt: skip
    params = inspect.signature(type(pipe).__call__).parameters
    return {k: kw.get(k, p.default) for k, p in params.items() if k != "self" and k not in skip}


def count_syncs(fn, device):
    """Run `fn() -> (out, wall)`; on CUDA also count its host-device syncs (`torch.cuda.set_sync_debug_mode`) and
    return them per decoding round of the call's slowest row (None elsewhere: a CPU has no device syncs)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        fn()
        return None
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, _ = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    count = sum("synchroniz" in str(w.message) for w in caught)
    return count / max(1, max(out.stats.rounds, default=0) + 1)  # + 1: the prefill


def measure(names, call, calls, batch_size, image_tokens, args, device, judge=None, collect=None):
    """The benchmarks' protocol over `names` (a warm-up call each, then `args.repeats` interleaved rounds of `calls`
    calls on the same seeds): `call(name, c, seed) -> (out, wall_s)` runs one call of a pipeline that returns a
    `SpeculativeImageOutput`, `judge(out, c) -> correct images` (or None: no accuracy), `collect(name, out)` (or
    None) sees every measured call's output. Returns the per-method report (median latency per image, speedup over
    `plain`, compression, accepted length, accuracy)."""
    syncs = {}
    for name in names:  # warm-up; on CUDA it also counts the host syncs of one call
        syncs[name] = count_syncs(lambda name=name: call(name, 0, args.seed), device)
    results = {n: dict(latency=[], forwards=[], accepted_len=[], compression=[], row_compression=[], correct=0, total=0)
               for n in names}  # fmt: skip
    bar = tqdm(total=args.repeats * calls * len(names), unit="call", disable=args.quiet)
    for rep in range(args.repeats):
        for c in range(calls):
            seed = args.seed + 1000 * rep + c
            for name in names:
                out, wall = call(name, c, seed)
                bar.update(1)
                r, s = results[name], out.stats
                r["latency"].append(wall / batch_size)
                r["forwards"].append(s.target_forwards)
                r["accepted_len"].append(s.mean_accepted_length)
                r["compression"].append(s.step_compression)
                r["row_compression"].extend(image_tokens / (rounds + 1) for rounds in s.rounds)
                if judge is not None:
                    r["correct"] += judge(out, c)
                if collect is not None:
                    collect(name, out)
                r["total"] += batch_size
        logger.info("repeat %d/%d done", rep + 1, args.repeats)
    bar.close()

    plain_latency = statistics.median(results["plain"]["latency"])
    methods = {}
    for name in names:
        r = results[name]
        latency = statistics.median(r["latency"])
        methods[name] = {
            "target_forwards_per_image": statistics.mean(r["forwards"]),
            "mean_accepted_length": statistics.mean(r["accepted_len"]),
            "step_compression": statistics.mean(r["compression"]),
            "row_step_compression": statistics.mean(r["row_compression"]),
            "latency_s": latency,
            "speedup": plain_latency / latency,
            "accuracy": r["correct"] / r["total"] if judge is not None else None,
            "images": r["total"],
            "syncs_per_round": syncs[name],
        }
    return methods


@torch.no_grad()
def run(args):
    names = args.methods
    unknown = sorted(set(names) - set(PRESETS))
    if unknown:
        raise ValueError(f"--methods has unknown names {unknown}; known: {list(PRESETS)}")
    if "plain" not in names:
        names.insert(0, "plain")  # speedups are relative to plain AR from the same run

    from mmspec.models import load
    from mmspec.pipelines import SpeculativeARImagePipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = SpeculativeARImagePipeline.from_zoo(args.zoo, prefix=ZOO_PREFIX[args.dataset], kind=args.model)
    pipe = pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)  # one bar over all calls instead (below)
    device = pipe._execution_device  # generators and the classifier live where the pipeline runs
    by_fid = args.dataset != "mnist"  # no digit classifier: FID against held-out crops
    classifier = None if by_fid else load(Path(args.zoo) / "mnist-classifier", device=device)
    n_classes = pipe.transformer.config.num_classes if args.model == "c2i" else len(DIGIT_PROMPTS)
    knobs = _knobs(args)
    bs = args.batch_size
    calls = -(-args.num_images // bs)
    labels = [[(c * bs + i) % n_classes for i in range(bs)] for c in range(calls)]

    def call(name, c, seed):
        kw = knobs | PRESETS[name]
        gen = torch.Generator(device=device).manual_seed(seed)
        start = time.perf_counter()
        if args.model == "c2i":
            condition = dict(class_labels=labels[c])
        else:  # the digit d is asked for by a prompt; accuracy is still judged against d
            condition = dict(prompt=[DIGIT_PROMPTS[d] for d in labels[c]])
        out = pipe(generator=gen, output_type="pt", **condition, **kw)
        return out, time.perf_counter() - start

    n_tok = pipe.transformer.config.block_size

    def judge(out, c):
        pred = classifier(out.images.to(device) * 2 - 1).argmax(-1)
        return int((pred == torch.tensor(labels[c], device=pred.device)).sum())

    from mmspec.eval.entropy import held_out_next_token_stats
    from mmspec.eval.image_quality import held_out_reference, method_fids

    # the FID reference first (made once, ~9 min of Inception when missing): a broken one fails before any generation
    reference, path = held_out_reference(args.dataset, progress=not args.quiet) if by_fid else (None, None)
    images = {name: [] for name in names}

    def collect(name, out):
        images[name].append(out.images.float().cpu())

    methods = measure(names, call, calls, bs, n_tok, args, device, None if by_fid else judge,
                      collect if by_fid else None)  # fmt: skip
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "json"} | {"methods": names}
    if by_fid:
        config["target_next_token"] = held_out_next_token_stats(pipe.vqvae, pipe.transformer, args.dataset)
        fids = method_fids(images, reference, path.name)
        for name in names:
            methods[name]["fid"] = fids[name]
        config["fid_reference"] = f"{path.name}: {reference.protocol.get('reference', '')}"
    method_kwargs = {n: _effective_kwargs(pipe, knobs | PRESETS[n]) for n in names}
    return image_report(config, method_kwargs, methods, args, calls, n_tok)


def image_report(config, method_kwargs, methods, args, calls, n_tok, **host):
    """The report of an image bench (ar-image, t2i), logged: `config` (the flags and methods), then each method's
    kwargs, the versions and host (`host`: more fields after `processor`), the seeds of every call and the image
    tokens per image; and the per-method `methods` of `measure`."""
    report = {
        "config": dict(
            config,
            method_kwargs=method_kwargs,
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            python=platform.python_version(),
            machine=platform.machine(),
            processor=platform.processor(),
            **host,
            seeds=[args.seed + 1000 * r + c for r in range(args.repeats) for c in range(calls)],
            image_tokens=n_tok,
        ),
        "methods": methods,
    }
    log_methods(methods)
    return report


def log_methods(methods):
    for name, m in methods.items():
        acc = "" if m["accuracy"] is None else f"  acc {m['accuracy']:.3f}"
        acc += f"  FID {m['fid']:.2f}" if m.get("fid") is not None else ""
        logger.info("%-14s compression %.2f  speedup %.2fx%s", name, m["step_compression"], m["speedup"], acc)
