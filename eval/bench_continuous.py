"""`mmspec bench continuous`: MAR and CSpD side by side, in one process, on the same labels and seeds.

Methods (names fixed for the JSON): ``plain`` (MAR at ``--num-ar-steps``), ``fewer-steps-N`` (MAR with N AR steps,
one per ``--fewer-steps`` entry: the honest competitor, since CSpD's ``"block"`` mode is itself a coarser target
schedule), ``cspd-block`` and ``cspd-exact`` (CSpD, one per ``--verify-modes`` entry).

Protocol: every image ``i`` has its own generator (seed ``--seed + i``) and label ``i % 10``, so an image is the same
whatever batch it is in. Speed, for each ``--batch-size`` (a comma list): ``--timing-batches`` batches, every method
on each batch in turn (interleaved, so load drift hits all alike), after one warm-up call per method; ``latency_s``
is the median wall time of a batch, ``speedup`` = plain's / the method's (per batch size under ``by_batch_size``;
the first batch size's also at the top level of each method). Quality: ``--num-images`` images per method (generated in
batches of ``--quality-batch-size``; with per-image generators they are the images any batch size would give),
scored by the zoo classifier: ``accuracy`` on the requested digit and ``fid_in_domain`` (Frechet distance of its
features against the shipped MNIST-test statistics, `assets/reference-stats/mnist-test-classifier.npz`).
``target_calls`` / ``draft_calls``: target / draft transformer passes per batch (a CFG pass of both branches is
one); ``acceptance_rate``: accepted / drafted tokens.
"""

import argparse
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
    MAX_THREADS,
    int_in_range,
    int_list_in_range,
    limited_float,
    positive_int,
    positive_int_list,
    probability,
    seed_int,
)
from mmspec.cli.checks import check_device, check_output_file, check_zoo_folders
from mmspec.decoding.masked_params import VERIFY_MODES
from mmspec.methods import CONTINUOUS_DEFAULTS as DEFAULTS
from mmspec.methods import CONTINUOUS_LIMITS as LIMITS


logger = logging.getLogger(__name__)


def _modes(text):
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = sorted(set(modes) - set(VERIFY_MODES))
    if bad:
        raise argparse.ArgumentTypeError(f"unknown verify modes {bad}; known: {','.join(VERIFY_MODES)}")
    return modes


MAX_IMAGES = 100_000  # `--num-images` per method for quality
MAX_TIMING_BATCHES = 1000
MAX_INFERENCE_STEPS = 1000  # the head's respaced diffusion steps: at most its 1000 training steps
REFERENCE = Path("reference-stats") / "mnist-test-classifier.npz"  # in the zoo


def add_arguments(parser):
    parser.add_argument("--zoo", default=DEFAULT_ZOO,
                        help="folder with mnist-mar, mnist-kl, mnist-mar-draft, mnist-classifier and "
                             f"{REFERENCE}")  # fmt: skip
    parser.add_argument(
        "--batch-size", type=int_list_in_range(1, MAX_BATCH), default=[1], help="images per timed call (comma list)"
    )
    parser.add_argument("--timing-batches", type=int_in_range(1, MAX_TIMING_BATCHES), default=8,
                        help="timed calls per method")  # fmt: skip
    parser.add_argument("--num-images", type=int_in_range(0, MAX_IMAGES), default=1000,
                        help="images per method for quality (0: speed only; else >= 2 for the FID)")  # fmt: skip
    parser.add_argument("--quality-batch-size", type=int_in_range(1, MAX_BATCH), default=100)
    parser.add_argument("--skip-quality", default="", help="comma list of methods timed but not scored (e.g. "
                        "cspd-exact: lossless, so its expected FID is plain's, and slow on a CPU)")  # fmt: skip
    parser.add_argument("--num-ar-steps", type=positive_int, default=DEFAULTS["num_ar_steps"],
                        help="AR steps, in [1, the zoo's tokens]")  # fmt: skip
    parser.add_argument(
        "--fewer-steps", type=positive_int_list, default=[32, 16], help="AR steps of the fewer-steps runs"
    )
    parser.add_argument("--verify-modes", type=_modes, default=["block", "exact"])
    parser.add_argument("--num-draft-tokens", type=positive_int, default=DEFAULTS["num_draft_tokens"],
                        help="AR steps per CSpD block (at most --num-ar-steps)")  # fmt: skip
    parser.add_argument("--prefill-ratio", type=probability, default=DEFAULTS["prefill_ratio"])
    parser.add_argument("--num-inference-steps", type=int_in_range(2, MAX_INFERENCE_STEPS), default=None,
                        help="head steps (config default)")  # fmt: skip
    # the pipeline's bounds (mmspec.methods.CONTINUOUS_LIMITS = pipelines.continuous.LIMITS)
    parser.add_argument("--guidance-scale", type=limited_float("guidance_scale", 1.0, LIMITS["guidance_scale"]),
                        default=DEFAULTS["guidance_scale"],
                        help=f"CFG scale (in [1, {LIMITS['guidance_scale']:g}]; 1 = off)")  # fmt: skip
    parser.add_argument("--temperature", type=limited_float("temperature", 0.0, LIMITS["temperature"], low_open=True),
                        default=DEFAULTS["temperature"],
                        help=f"the head's noise temperature (in (0, {LIMITS['temperature']:g}])")  # fmt: skip
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--threads", type=int_in_range(0, MAX_THREADS), default=0,
                        help="torch CPU threads (0: default)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--plot", type=Path, default=None,
                        help="speed-vs-FID plot (PNG) of every batch size (needs --num-images)")  # fmt: skip


def check_args(parser, args):
    """Before any model loads: the zoo's folders and reference statistics, step counts against the zoo's token
    grid, method names, the output plot and the device."""
    from mmspec.models import read_config

    check_zoo_folders(parser, args.zoo, ["mnist-mar", "mnist-kl", "mnist-classifier"])
    if args.verify_modes:
        check_zoo_folders(parser, args.zoo, ["mnist-mar-draft"], flag="--verify-modes (CSpD needs a draft)")
    try:
        config = read_config(Path(args.zoo) / "mnist-mar")
        read_config(Path(args.zoo) / "mnist-kl")
        if args.verify_modes:
            read_config(Path(args.zoo) / "mnist-mar-draft")
    except ValueError as err:
        parser.error(f"argument --zoo: {err}")
    seq_len = config.get("seq_h", 16) * config.get("seq_w", 16)
    for flag, steps in (("--num-ar-steps", [args.num_ar_steps]), ("--fewer-steps", args.fewer_steps)):
        bad = [n for n in steps if n > seq_len]
        if bad:
            parser.error(f"argument {flag}: {bad[0]} AR steps, but the zoo's images have {seq_len} tokens")
    if args.verify_modes and args.num_draft_tokens > args.num_ar_steps:
        parser.error(f"argument --num-draft-tokens: {args.num_draft_tokens} is more than --num-ar-steps "
                     f"{args.num_ar_steps}")  # fmt: skip
    known = set(methods(args))
    skip = [m.strip() for m in args.skip_quality.split(",") if m.strip()]
    unknown = sorted(set(skip) - known)
    if unknown:
        parser.error(f"argument --skip-quality: unknown methods {unknown}; this run has {','.join(known)}")
    if args.num_images:
        if args.num_images < 2:
            parser.error("argument --num-images: the FID needs at least 2 images (0: speed only)")
        if not (Path(args.zoo) / REFERENCE).is_file():
            parser.error(f"argument --zoo: {str(Path(args.zoo) / REFERENCE)!r} does not exist (the FID reference)")
    if args.plot is not None:
        if not args.num_images:
            parser.error("argument --plot: needs --num-images > 0 (the plot shows the FID)")
        check_output_file(parser, "--plot", args.plot, "image")
    check_device(parser, args.device)


def methods(args) -> dict[str, dict]:
    """Method name -> pipeline keywords."""
    out = {"plain": dict(num_ar_steps=args.num_ar_steps)}
    for n in args.fewer_steps:
        out[f"fewer-steps-{n}"] = dict(num_ar_steps=n)
    for mode in args.verify_modes:
        out[f"cspd-{mode}"] = dict(num_ar_steps=args.num_ar_steps, acceptance="continuous", verify_mode=mode,
                                   num_draft_tokens=args.num_draft_tokens, prefill_ratio=args.prefill_ratio)  # fmt: skip
    return out


def run(args):
    from mmspec.eval.metrics import MNISTClassifierFeatures, fid_and_features
    from mmspec.eval.reference_stats import load_reference_stats
    from mmspec.models import load
    from mmspec.pipelines import SpeculativeContinuousARPipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    pipe = SpeculativeContinuousARPipeline.from_zoo(args.zoo).to(device)
    pipe.set_progress_bar_config(disable=True)
    classifier = load(Path(args.zoo) / "mnist-classifier").to(device).eval()
    common = dict(guidance_scale=args.guidance_scale, temperature=args.temperature,
                  num_inference_steps=args.num_inference_steps, output_type="pt")  # fmt: skip
    table = methods(args)

    def call(kw, start, n):
        gens = [torch.Generator(device).manual_seed(args.seed + i) for i in range(start, start + n)]
        labels = [i % 10 for i in range(start, start + n)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = pipe(labels, generator=gens, **common, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    # speed: interleaved timed batches, per batch size
    timing = {}
    for bs in args.batch_size:
        times = {name: [] for name in table}
        calls = {name: [] for name in table}
        for kw in table.values():  # warm-up
            call(kw, 0, bs)
        for b in tqdm(range(args.timing_batches), desc=f"timing b{bs}", disable=None):
            for name, kw in table.items():
                out, dt = call(kw, b * bs, bs)
                times[name].append(dt)
                calls[name].append(out.stats)
        timing[bs] = {}
        for name in table:
            lat = times[name]
            drafted = sum(sum(s.drafted_tokens) for s in calls[name])
            accepted = sum(sum(s.accepted_tokens) for s in calls[name])
            p10, p90 = _quantiles(lat)
            timing[bs][name] = {
                "latency_s": statistics.median(lat),
                "latency_p10_s": p10,
                "latency_p90_s": p90,
                "target_calls": statistics.mean(s.target_forwards for s in calls[name]),
                "draft_calls": statistics.mean(s.draft_forwards for s in calls[name]),
                "acceptance_rate": accepted / drafted if drafted else None,
            }
        base = timing[bs]["plain"]["latency_s"]
        for entry in timing[bs].values():
            entry["speedup"] = base / entry["latency_s"]
    # quality: per-image generators, large batches
    reference = load_reference_stats(Path(args.zoo) / "reference-stats" / "mnist-test-classifier.npz")
    extractor = MNISTClassifierFeatures(classifier)
    report = {}
    skip = {m.strip() for m in args.skip_quality.split(",") if m.strip()}
    for name, kw in table.items():
        images, labels, acc_stats = [], [], []
        num = 0 if name in skip else args.num_images
        for start in tqdm(range(0, num, args.quality_batch_size), desc=name, disable=None):
            n = min(args.quality_batch_size, num - start)
            out, _ = call(kw, start, n)
            images.append(out.images.cpu())
            labels += [i % 10 for i in range(start, start + n)]
            acc_stats.append(out.stats)
        entry = {"knobs": {**common, **kw, "output_type": None}}
        first = timing[args.batch_size[0]][name]
        entry.update(first)  # the first batch size's speed at the top level
        entry["by_batch_size"] = {str(bs): timing[bs][name] for bs in args.batch_size}
        drafted = sum(sum(s.drafted_tokens) for s in acc_stats)
        accepted = sum(sum(s.accepted_tokens) for s in acc_stats)
        entry["acceptance_rate_quality_run"] = accepted / drafted if drafted else None
        entry["residual_fallbacks"] = sum(s.extra.get("residual_fallbacks", 0) for s in acc_stats)
        if images:
            x = torch.cat(images)
            with torch.no_grad():
                pred = torch.cat([classifier(b.to(device) * 2 - 1).argmax(-1).cpu() for b in x.split(500)])
            entry["accuracy"] = float((pred == torch.tensor(labels)).float().mean())
            result, _, _ = fid_and_features(x, reference, extractor, batch_size=500)
            entry["fid_in_domain"] = result.fid
            entry["num_images"] = len(x)
        else:
            entry.update(accuracy=None, fid_in_domain=None, num_images=0)
        report[name] = entry
    for name, entry in report.items():
        logger.info("%-16s latency %.3fs speedup %.2fx acc %s fid %s accept %s", name, entry["latency_s"],
                    entry["speedup"], entry.get("accuracy"), entry.get("fid_in_domain"), entry["acceptance_rate"])  # fmt: skip
    pareto = {str(bs): pareto_report(report, bs) for bs in args.batch_size} if args.num_images else {}
    return {
        "bench": "continuous",
        "pareto": pareto,
        "zoo": str(args.zoo),
        "batch_sizes": args.batch_size,
        "timing_batches": args.timing_batches,
        "num_images": args.num_images,
        "seed": args.seed,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "methods": report,
    }


def finish(args, report):
    """After the report is written (`mmspec bench`): the `--plot`."""
    if args.plot is not None and args.num_images:
        plot(report["methods"], args.batch_size, args.plot)
        logger.info("wrote %s", args.plot)


def _quantiles(values):
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=10, method="inclusive")
    return q[0], q[-1]


def pareto_report(report, batch_size) -> dict:
    """Per CSpD method at one batch size: is it on the speed / in-domain-FID Pareto front of plain MAR at its step
    counts (plain + fewer-steps), and how far: ``fid_gap`` = its FID minus the front's FID at its speedup (linear
    interpolation between the neighbouring MAR points; negative = better than MAR at that speed), or None outside the
    front's speed range; ``dominator_speed_ratio``: how much faster the fastest MAR point that is at least as fast and
    at least as good is (None when on the front)."""
    key = str(batch_size)
    points = {n: (m["by_batch_size"][key]["speedup"], m["fid_in_domain"]) for n, m in report.items()
              if m.get("fid_in_domain") is not None}  # fmt: skip
    mar = sorted((v for n, v in points.items() if not n.startswith("cspd")), key=lambda p: p[0])
    front = [p for p in mar if not any(q[0] >= p[0] and q[1] <= p[1] and q != p for q in mar)]
    out = {}
    for name, (speed, fid) in points.items():
        if not name.startswith("cspd"):
            continue
        dominated_by = [n for n, (s2, f2) in points.items() if n != name and s2 >= speed and f2 <= fid]
        gap = None
        for (s0, f0), (s1, f1) in zip(front, front[1:], strict=False):
            if s0 <= speed <= s1:
                gap = fid - (f0 + (f1 - f0) * (speed - s0) / (s1 - s0))
        faster = max((points[n][0] for n in dominated_by), default=None)
        out[name] = {"speedup": speed, "fid_in_domain": fid, "on_front": not dominated_by,
                     "dominated_by": dominated_by, "fid_gap": gap,
                     "dominator_speed_ratio": None if faster is None else faster / speed}  # fmt: skip
    return out


def plot(report, batch_sizes, path):
    """Speedup (x) vs in-domain FID (y) per batch size: MAR at its step counts as a line, CSpD as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(5 * len(batch_sizes), 4), squeeze=False)
    for ax, bs in zip(axes[0], batch_sizes, strict=True):
        key = str(bs)
        mar = sorted((m["by_batch_size"][key]["speedup"], m["fid_in_domain"], n) for n, m in report.items()
                     if not n.startswith("cspd") and m.get("fid_in_domain") is not None)  # fmt: skip
        ax.plot([p[0] for p in mar], [p[1] for p in mar], "o-", color="tab:blue", label="MAR (plain / fewer steps)")
        for s, f, n in mar:
            ax.annotate(n.replace("fewer-steps-", "") if n != "plain" else "plain", (s, f), fontsize=8)
        for n, m in report.items():
            if n.startswith("cspd") and m.get("fid_in_domain") is not None:
                ax.plot(m["by_batch_size"][key]["speedup"], m["fid_in_domain"], "s", label=n)
        ax.set_xlabel(f"speedup vs plain (batch {bs})")
        ax.set_ylabel("in-domain FID (lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, pil_kwargs={"optimize": True})
    plt.close(fig)
