"""`mmspec eval sweep`: every method and knob setting of one model on the same axes — quality (in-domain FID,
KID, IS, classifier accuracy; optionally Inception FID) against speed (speedup at batch 1, step compression).

One harness over one verifier core: each grid point is a preset of `mmspec.methods.PRESETS` plus knob values,
sampled with `mmspec.eval.fid_sampling` (resumable shards, per-image seeds) and scored with `mmspec.eval.metrics`.
Plain AR sampling runs with `--plain-seeds` different seeds: the spread of its metrics is the sampling noise that a
lossless method's numbers must stay within (`within_plain_noise`: |metric - plain mean| <= 2 * plain std, the
std over the plain seeds).

Speed protocol: for every grid point, `--speed-images` single images (batch 1, the latency regime speculative
decoding is for) are drawn by plain AR and by the method alternately, with the same seeds; `speedup` = median
plain wall time / median method wall time of that pairing, so slow drift of the machine hits both alike.
`step_compression` = image tokens / target forwards, averaged over those images.

Outputs: one JSON line per grid point (`--table`, appended as points finish: an interrupted sweep resumes, skipping
finished points and finished shards), a Markdown table (`--markdown`) and a Pareto plot (`--plot`, matplotlib).
Every row records its `fingerprint` (`mmspec.eval.fingerprint`: the hash of the pipeline's and the classifier's
weights, the seed, the image count, the method, knobs, guidance and temperature, the device type, the timed image
count): a row is reused only when it equals the current run's; a row of another zoo or other settings (or without a
fingerprint) is refused before anything runs, naming the table, the row and the differing fields (pass a new
`--table` / `--out`, or `--overwrite` to recompute the stale rows in place). A metric asked for later
(`--metrics in-domain,inception` after an in-domain sweep) is computed for the finished rows from their shards.
The README's MNIST-zoo table and plot come from:

    mmspec eval sweep --table assets/sweep/mnist-sweep.jsonl --markdown assets/sweep/mnist-sweep.md \\
        --plot assets/sweep/mnist-sweep.png

`--dataset natural` sweeps the natural-image zoo (`natural-c2i`, `natural-vq`, `natural-c2i-eagle`; issue 30: the
high-entropy regime SJD-PAC and SCD were made for) on the same axes, with quality as Inception FID against the
dataset's held-out crops (`fid_heldout`, `mmspec.eval.image_quality`: no digit classifier applies); its default grid
has no draft model (the zoo has none) and adds SJD-PAC at its default and its paper settings.
"""

import argparse
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
# metric key in a row -> (label, lower is better)
QUALITY = {
    "fid_in_domain": ("in-domain FID", True),
    "kid_in_domain": ("in-domain KID", True),
    "is_in_domain": ("in-domain IS", False),
    "accuracy": ("classifier accuracy", False),
    "fid_inception": ("Inception FID", True),
    "fid_heldout": ("held-out FID (Inception)", True),  # --dataset natural
}
DATASETS = ("mnist", "natural")  # `--dataset` -> the zoo folders' prefix is the same name
PANELS = {"mnist": ("fid_in_domain", "accuracy"), "natural": ("fid_heldout",)}  # the plot's quality axes


@dataclass(frozen=True)
class SweepPoint:
    """One run of the sweep: a preset of `mmspec.methods.PRESETS` with knob overrides."""

    name: str
    preset: str
    knobs: dict = field(default_factory=dict)

    def call_kwargs(self) -> dict:
        from mmspec.methods import KNOBS, PRESETS, check_knobs

        unknown = sorted(set(self.knobs) - set(KNOBS))
        if unknown:
            raise ValueError(f"sweep point {self.name!r}: unknown knobs {unknown}; known: {sorted(KNOBS)}")
        return PRESETS[self.preset] | check_knobs(**self.knobs)


def default_grid(dataset: str = "mnist") -> list[SweepPoint]:
    """Exact (draft model, EAGLE chain), SJD without / with SCD coupling, LANTERN delta / k / lambda, GSD group
    sizes. (The EAGLE-2 tree and other Jacobi windows are in `mmspec bench ar-image`; add them with `--grid`.)
    `dataset="natural"`: no draft model (the natural zoo has none), and SJD-PAC at its default and paper settings."""
    if dataset == "natural":
        extra = [SweepPoint("sjd-pac", "sjd-pac"), SweepPoint("sjd-pac-wide", "sjd-pac-wide")]
        return [p for p in default_grid() if p.preset != "exact-draft"] + extra
    if dataset != "mnist":
        raise ValueError(f"dataset={dataset!r}: use one of {DATASETS}")
    return [
        SweepPoint("exact-draft", "exact-draft"),
        SweepPoint("exact-eagle", "exact-eagle"),
        SweepPoint("sjd", "jacobi", {"coupling": False}),
        SweepPoint("sjd+scd", "jacobi", {"coupling": True}),
        SweepPoint("lantern d=0.1", "relaxed", {"relaxation_delta": 0.1}),
        SweepPoint("lantern d=0.2", "relaxed", {"relaxation_delta": 0.2}),
        SweepPoint("lantern d=0.4", "relaxed", {"relaxation_delta": 0.4}),
        SweepPoint("lantern d=0.2 k=4", "relaxed", {"relaxation_delta": 0.2, "relaxation_top_k": 4}),
        SweepPoint("lantern++ l=2", "relaxed", {"relaxation_lambda": 2.0}),
        SweepPoint("gsd G=3", "grouped", {"group_size": 3}),
        SweepPoint("gsd G=25", "grouped", {"group_size": 25}),
    ]


def load_grid(path) -> list[SweepPoint]:
    """A grid from JSON: `[{"name": ..., "preset": ..., "knobs": {...}}, ...]` (validated)."""
    from mmspec.methods import PRESETS

    try:
        items = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"grid={str(path)!r} is not a readable JSON file: {err}") from err
    if not isinstance(items, list) or not items:
        raise ValueError(f"grid={str(path)!r} must hold a non-empty JSON list of points")
    points = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or set(item) - {"name", "preset", "knobs"} or "preset" not in item:
            raise ValueError(f"grid point {i} must be {{'name', 'preset', 'knobs'}}, got {item!r}")
        if item["preset"] not in PRESETS:
            raise ValueError(f"grid point {i}: unknown preset {item['preset']!r}; known: {list(PRESETS)}")
        point = SweepPoint(item.get("name", item["preset"]), item["preset"], dict(item.get("knobs", {})))
        point.call_kwargs()  # knob names, types and ranges
        points.append(point)
    return points


# ----------------------------------------------------------------------------------------------------------------
# one grid point


def _speed(pipe, call_kwargs: dict, common: dict, num_images: int, seed: int) -> dict:
    """Batch-1 wall time of the method and of plain AR, alternated on the same seeds (see the module docstring)."""
    device = pipe._execution_device
    n_classes = pipe.transformer.config.num_classes
    tokens = pipe.transformer.config.block_size
    plain, method, compression, accepted = [], [], [], []
    for i in range(-1, num_images):  # i = -1: warm-up, not timed
        label = [max(i, 0) % n_classes]
        times = {}
        for name, kw in (("plain", dict(acceptance="none")), ("method", call_kwargs)):
            gen = torch.Generator(device=device).manual_seed(seed + 7919 * max(i, 0))
            start = time.perf_counter()
            out = pipe(class_labels=label, generator=gen, output_type="pt", **common, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name] = time.perf_counter() - start
        if i >= 0:
            plain.append(times["plain"])
            method.append(times["method"])
            compression.append(tokens / out.stats.target_forwards)
            accepted.append(out.stats.mean_accepted_length)
    return {
        "speedup": statistics.median(plain) / statistics.median(method),
        "latency_s": statistics.median(method),
        "plain_latency_s": statistics.median(plain),
        "step_compression": statistics.mean(compression),
        "mean_accepted_length": statistics.mean(accepted),
        "speed_images": num_images,
    }


def row_fingerprint(point: SweepPoint, seed: int, args, weights: str, classifier: str) -> dict:
    """What determines a row: both models' weights hashes and every setting that changes its numbers."""
    kwargs = point.call_kwargs() | dict(guidance_scale=args.guidance_scale, temperature=args.temperature)
    return dict(format=1, weights=weights, classifier=classifier, seed=seed, num_images=args.num_images,
                call_kwargs=kwargs, device=torch.device(args.device).type,
                speed_images=0 if kwargs["acceptance"] == "none" else args.speed_images)  # fmt: skip


def _samples(pipe, point: SweepPoint, seed: int, args, weights: str | None):
    """The point's images (uint8 [N, C, H, W]) and labels, sampled into / resumed from its shard folder."""
    from mmspec.eval.fid_sampling import load_shards, run_fingerprint, sample_shards

    call_kwargs = point.call_kwargs() | dict(guidance_scale=args.guidance_scale, temperature=args.temperature)
    fingerprint = run_fingerprint(pipe, seed=seed, call_kwargs=call_kwargs, weights=weights)
    folder = args.out / f"{point.name.replace(' ', '_').replace('=', '')}-seed{seed}"
    sample_shards(pipe, folder, num_images=args.num_images, shard_size=args.shard_size, batch_size=args.batch_size,
                  seed=seed, call_kwargs=call_kwargs, manifest_extra=dict(zoo=str(Path(args.zoo).resolve())),
                  progress=not args.quiet, weights=fingerprint["weights"],
                  overwrite=getattr(args, "overwrite", False))  # fmt: skip
    images, labels = load_shards(folder, args.num_images, args.shard_size, fingerprint)
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), labels


def add_missing_metrics(pipe, row: dict, point: SweepPoint, seed: int, args, references: dict,
                        weights: str | None = None) -> list[str]:  # fmt: skip
    """Compute the metrics asked for (`references`) that a finished row lacks, from its shards; returns their keys."""
    missing = ["fid_inception"] if "inception" in references and row.get("fid_inception") is None else []
    if missing:
        from mmspec.eval.fid import inception_metrics

        x, _ = _samples(pipe, point, seed, args, weights)
        row["fid_inception"] = inception_metrics(x, references["inception"])["fid"]
    return missing


def run_point(pipe, point: SweepPoint, seed: int, args, references: dict, weights: str | None = None) -> dict:
    """Sample, score and time one grid point; returns its table row."""
    from mmspec.methods import ACCEPTANCES

    common = dict(guidance_scale=args.guidance_scale, temperature=args.temperature)
    kwargs = point.call_kwargs()
    x, labels = _samples(pipe, point, seed, args, weights)
    row = {
        "name": point.name,
        "preset": point.preset,
        "knobs": point.knobs,
        "call_kwargs": kwargs | common,
        "lossless": ACCEPTANCES[kwargs["acceptance"]].lossless,
        "seed": seed,
        "num_images": args.num_images,
    }
    if "in_domain" in references:
        from mmspec.eval.metrics import mnist_metrics

        ref, real_feats, classifier = references["in_domain"]
        m = mnist_metrics(x, labels, ref, classifier, reference_name="MNIST test", real_features=real_feats)
        row |= {"fid_in_domain": m["fid"], "kid_in_domain": m["kid"], "is_in_domain": m["inception_score"],
                "accuracy": m["accuracy"]}  # fmt: skip
    if "heldout" in references:  # --dataset natural: Inception FID against the held-out crops
        from mmspec.eval.image_quality import method_fids

        reference, path = references["heldout"]
        row["fid_heldout"] = method_fids({"x": [x.float() / 255]}, reference, path.name)["x"]
    if "inception" in references:
        from mmspec.eval.fid import inception_metrics

        row["fid_inception"] = inception_metrics(x, references["inception"])["fid"]
    if kwargs["acceptance"] == "none":  # the baseline itself
        row |= {"speedup": 1.0, "step_compression": 1.0, "mean_accepted_length": 1.0}
    elif args.speed_images > 0:
        row |= _speed(pipe, kwargs, common, args.speed_images, seed)
    return row


# ----------------------------------------------------------------------------------------------------------------
# summary: plain noise, table, plot


def plain_noise(rows: list[dict]) -> dict:
    """Mean and std (over seeds) of every quality metric of the plain rows."""
    plain = [r for r in rows if r["preset"] == "plain"]
    out = {}
    for key in QUALITY:
        values = [r[key] for r in plain if r.get(key) is not None]
        if values:
            out[key] = {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
                        "n": len(values)}  # fmt: skip
    return out


def annotate(rows: list[dict]) -> list[dict]:
    """Add `within_plain_noise` (per metric: |value - plain mean| <= 2 std of the plain seeds) to every row."""
    noise = plain_noise(rows)
    for row in rows:
        row["within_plain_noise"] = {
            key: abs(row[key] - n["mean"]) <= 2 * n["std"]
            for key, n in noise.items()
            if n["std"] is not None and row.get(key) is not None
        }
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The sweep as a Markdown table (plain seeds first, then the grid in order)."""
    keys = [k for k in QUALITY if any(r.get(k) is not None for r in rows)]
    head = ["method", "lossless", "seed", "speedup (b1)", "step compression"] + [QUALITY[k][0] for k in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], "yes" if r["lossless"] else "no", str(r["seed"]),
                 _fmt(r.get("speedup"), "{:.2f}x"), _fmt(r.get("step_compression"), "{:.2f}")]  # fmt: skip
        for k in keys:
            mark = "" if r.get("within_plain_noise", {}).get(k, True) else " (!)"
            cells.append(_fmt(r.get(k), "{:.4f}" if k in ("kid_in_domain", "accuracy") else "{:.3f}") + mark)
        lines.append("| " + " | ".join(cells) + " |")
    noise = plain_noise(rows)
    notes = [f"{QUALITY[k][0]} {n['mean']:.4g} ± {n['std']:.2g}" for k, n in noise.items() if n["std"] is not None]
    if notes:
        lines.append("")
        lines.append(f"Plain AR over {max(n['n'] for n in noise.values())} seeds (mean ± std): " + "; ".join(notes)
                     + ". (!) = more than 2 std from the plain mean.")  # fmt: skip
    return "\n".join(lines) + "\n"


def _fmt(value, spec):
    return "–" if value is None else spec.format(value)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated for (maximise x, minimise y), in increasing x."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return sorted(front, key=lambda i: points[i][0])


def plot(rows: list[dict], path: Path) -> Path:
    """Pareto plot: speedup and step compression against each quality axis the rows have (`PANELS`: in-domain FID
    and accuracy for MNIST, held-out FID for the natural zoo), one panel each."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("the sweep plot needs matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    noise = plain_noise(rows)
    runs = [r for r in rows if r.get("speedup") is not None]
    y_keys = [k for keys in PANELS.values() for k in keys if any(r.get(k) is not None for r in runs)]
    fig, axes = plt.subplots(len(y_keys), 2, figsize=(11, 4.25 * len(y_keys)), squeeze=False)
    for col, x_key in enumerate(("speedup", "step_compression")):
        for row_i, y_key in enumerate(y_keys):
            lower = QUALITY[y_key][1]
            ax = axes[row_i, col]
            xs = [r[x_key] for r in runs]
            ys = [r[y_key] for r in runs]
            n = noise.get(y_key)
            if n and n["std"] is not None:
                ax.axhspan(n["mean"] - 2 * n["std"], n["mean"] + 2 * n["std"], color="0.85", label="plain ± 2 std")
            for r, x, y in zip(runs, xs, ys):
                ax.scatter(x, y, marker="o" if r["lossless"] else "^", s=40,
                           color=_family_color(r["preset"]), edgecolor="k", linewidth=0.5, zorder=3)  # fmt: skip
                if r["preset"] != "plain" or r["seed"] == min(p["seed"] for p in runs if p["preset"] == "plain"):
                    ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            front = pareto_front([(x, y if lower else -y) for x, y in zip(xs, ys)])
            ax.plot([xs[i] for i in front], [ys[i] for i in front], "k--", linewidth=0.8, label="Pareto front")
            ax.set_xlabel(
                "speedup vs plain (batch 1)" if x_key == "speedup" else "step compression (tokens / forward)"
            )
            ax.set_ylabel(QUALITY[y_key][0] + (" (lower is better)" if lower else " (higher is better)"))
            ax.grid(alpha=0.3)
            if row_i == 0 and col == 0:
                ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("mmspec sweep: quality vs speed (o lossless, ^ relaxed)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, pil_kwargs={"optimize": True})
    plt.close(fig)
    return path


def _family_color(preset: str) -> str:
    colors = {"plain": "0.3", "exact-draft": "tab:blue", "exact-eagle": "tab:cyan", "exact-eagle-tree": "tab:purple",
              "jacobi": "tab:green", "relaxed": "tab:orange", "grouped": "tab:red"}  # fmt: skip
    return colors.get(preset, "tab:gray")


# ----------------------------------------------------------------------------------------------------------------
# command


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"--table {path}: line {n} is not JSON ({err}); fix or delete it") from err
    return rows


def add_arguments(parser):
    from mmspec.cli.args import DEFAULT_ZOO, MAX_THREADS, int_in_range, sampling_type
    from mmspec.eval import cli_checks as checks

    parser.add_argument(
        "--zoo", type=Path, default=Path(DEFAULT_ZOO), help="zoo folder (mnist-c2i, drafters, classifier)"
    )
    parser.add_argument("--dataset", choices=DATASETS, default="mnist",
                        help="the MNIST zoo (mnist-*: in-domain metrics) or the natural-image zoo (natural-*: "
                             "Inception FID against held-out crops)")  # fmt: skip
    parser.add_argument("--grid", default="default", help="'default' or a JSON file [{name, preset, knobs}, ...]")
    parser.add_argument("--num-images", type=int_in_range(2, checks.MAX_IMAGES), default=1000,
                        help="images per grid point (quality; >= 2: FID needs a covariance)")  # fmt: skip
    parser.add_argument("--plain-seeds", type=int_in_range(1, checks.MAX_PLAIN_SEEDS), default=4,
                        help="plain AR runs (seeds 0..n-1): the noise level (the shipped sweep used 4)")  # fmt: skip
    parser.add_argument("--seed", type=int_in_range(0, checks.MAX_SEED), default=0, help="seed of the grid points")
    parser.add_argument("--speed-images", type=int_in_range(0, checks.MAX_SPEED_IMAGES), default=20,
                        help="batch-1 images per point for the speedup")  # fmt: skip
    parser.add_argument("--batch-size", type=int_in_range(1, checks.MAX_BATCH_SIZE), default=50,
                        help="images per pipeline call while sampling")  # fmt: skip
    parser.add_argument("--shard-size", type=int_in_range(1, checks.MAX_SHARD_SIZE), default=250,
                        help="images per shard file (the unit of resuming)")  # fmt: skip
    parser.add_argument("--guidance-scale", type=sampling_type("guidance_scale", float), default=2.0)
    parser.add_argument("--temperature", type=sampling_type("temperature", float), default=1.0)
    parser.add_argument("--metrics", default="in-domain", choices=("in-domain", "in-domain,inception"),
                        help="add Inception FID (slow on CPU: ~3 min per 1,000 images; MNIST only, the natural zoo "
                             "is always scored by Inception FID)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("runs") / "sweep", help="folder of the sample shards")
    parser.add_argument("--table", type=Path, default=None, help="JSONL, a row per point (default <out>/sweep.jsonl)")
    parser.add_argument("--markdown", type=Path, default=None, help="Markdown table (default <out>/sweep.md)")
    parser.add_argument("--plot", type=Path, default=None, help="Pareto plot PNG (default <out>/sweep.png)")
    parser.add_argument("--overwrite", action="store_true",
                        help="recompute the rows and shards made by other weights or settings (else refused)")  # fmt: skip
    parser.add_argument("--threads", type=int_in_range(1, MAX_THREADS), default=None,
                        help="torch.set_num_threads")  # fmt: skip
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def check_arguments(args, parser):
    """Usage errors (exit 2, one line naming the flag) before any model loads: every path, count, file and device."""
    from mmspec.cli.checks import (
        check_device,
        check_mnist,
        check_output_file,
        check_output_folder,
        check_sampling_only,
        check_zoo_folders,
    )
    from mmspec.eval import cli_checks as checks

    try:
        args.points = default_grid(args.dataset) if args.grid == "default" else load_grid(args.grid)
    except (ValueError, TypeError) as err:
        parser.error(f"argument --grid: {' '.join(str(err).split())}")
    names = [p.name for p in args.points]
    if "plain" in names or len(set(names)) != len(names):
        parser.error("argument --grid: point names must be unique and not 'plain' (the baseline rows)")
    for point in args.points:  # GSD is undefined under greedy decoding
        check_sampling_only(parser, point.call_kwargs()["acceptance"], args.temperature, f"{point.name!r} (--grid)")
    drafters = {p.call_kwargs().get("drafter") for p in args.points}
    if args.dataset == "mnist":
        folders = sorted(checks.DRAFTER_FOLDERS[d] for d in drafters if d in checks.DRAFTER_FOLDERS)
        check_zoo_folders(parser, args.zoo, ["mnist-c2i", "mnist-vq", "mnist-classifier"] + folders)
        check_mnist(parser, "--metrics", "in-domain")
        if "inception" in args.metrics:
            checks.check_inception(parser, "--metrics")
    else:
        from mmspec.cli.checks import check_dataset
        from mmspec.models import zoo_folders

        if "model" in drafters:
            parser.error(f"argument --grid: the {args.dataset} zoo has no draft model (exact-draft); use exact-eagle")
        if args.metrics != "in-domain":
            parser.error(f"argument --metrics: the {args.dataset} zoo is always scored by Inception FID against its "
                         "held-out crops; leave --metrics at its default")  # fmt: skip
        try:
            components = zoo_folders(args.zoo, prefix=args.dataset)
        except ValueError as err:
            parser.error(f"argument --zoo: {err}")
        for drafter in sorted(drafters & set(checks.DRAFTER_COMPONENTS)):
            if checks.DRAFTER_COMPONENTS[drafter] not in components:
                parser.error(f"argument --zoo: {str(args.zoo)!r} has no {args.dataset} {drafter} drafter folder, "
                             "which the grid's points use")  # fmt: skip
        check_dataset(parser, "--dataset", args.dataset, "the held-out FID reference")
        checks.check_inception(parser, "--dataset")
    check_output_folder(parser, "--out", args.out)
    args.table = args.table or args.out / "sweep.jsonl"
    args.markdown = args.markdown or args.out / "sweep.md"
    args.plot = args.plot or args.out / "sweep.png"
    for flag, extensions in (("table", (".jsonl",)), ("markdown", (".md",)), ("plot", (".png", ".pdf", ".svg"))):
        check_output_file(parser, f"--{flag}", getattr(args, flag), extensions, create_folder=True)
    try:
        rows = read_rows(args.table)
    except ValueError as err:
        parser.error(f"argument --table: {err}")
    check_device(parser, args.device)
    if not args.overwrite:  # rows of other settings (or without a fingerprint): refused before the models load
        from mmspec.eval.fingerprint import StaleArtefactError

        todo = _todo(args)
        try:
            _stale_rows(rows, todo, [row_fingerprint(p, s, args, None, None) for p, s in todo], args,
                        ignore=("weights", "classifier"))  # fmt: skip
        except StaleArtefactError as err:
            parser.error(" ".join(str(err).split()))


def _todo(args) -> list[tuple[SweepPoint, int]]:
    """(point, seed) of every row of the sweep: plain AR with seeds 0..plain_seeds-1, then the grid."""
    return [(SweepPoint("plain", "plain"), s) for s in range(args.plain_seeds)] + [(p, args.seed) for p in args.points]


def _write_rows(path: Path, rows: list[dict]) -> None:
    """Rewrite the whole table atomically (a stale row replaced, a metric added)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def _matches(row: dict, expected: dict) -> bool:
    from mmspec.eval.fingerprint import diff_fields

    return isinstance(row.get("fingerprint"), dict) and not diff_fields(row["fingerprint"], expected)


def _stale_rows(rows: list[dict], todo: list, fingerprints: list[dict], args, ignore=()) -> set:
    """The (name, seed) of the points of `todo` whose rows in the table were all made by other weights or settings
    (or have no fingerprint). Refused before anything runs (naming the table, the row and the differing fields)
    unless `--overwrite`, which recomputes them. `ignore`: fields not compared (the weights, before loading)."""
    from mmspec.eval.fingerprint import StaleArtefactError, describe, diff_fields

    stale = set()
    for (point, seed), expected in zip(todo, fingerprints):
        mine = [(i, r) for i, r in enumerate(rows) if (r.get("name"), r.get("seed")) == (point.name, seed)]
        if ignore:
            expected = {k: v for k, v in expected.items() if k not in ignore}
            mine = [(i, r | {"fingerprint": {k: v for k, v in r["fingerprint"].items() if k not in ignore}})
                    if isinstance(r.get("fingerprint"), dict) else (i, r) for i, r in mine]  # fmt: skip
        if not mine or any(_matches(r, expected) for _, r in mine):
            continue
        i, row = mine[-1]
        stored = row.get("fingerprint")
        fields = diff_fields(stored, expected) if isinstance(stored, dict) else []
        why = (f"was made by other weights or settings: {describe(stored, expected, fields)}" if fields
               else "has no fingerprint (made by an older mmspec)")  # fmt: skip
        if not args.overwrite:
            raise StaleArtefactError(
                f"--table {args.table}: row {i + 1} ({point.name!r} seed {seed}) {why}; pass a new --table and "
                "--out, the settings it was made with, or --overwrite to recompute the stale rows"
            )
        logger.warning("%s: row %d (%r seed %d) %s: recomputing it", args.table, i + 1, point.name, seed, why)
        stale.add((point.name, seed))
    return stale


def run(args) -> list[dict]:
    from tqdm.auto import tqdm

    from mmspec.eval.fingerprint import pipeline_weights_hash, weights_hash
    from mmspec.eval.metrics import mnist_reference
    from mmspec.models import load
    from mmspec.pipelines import SpeculativeARImagePipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = SpeculativeARImagePipeline.from_zoo(args.zoo, prefix=args.dataset).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    mnist = args.dataset == "mnist"
    classifier = load(args.zoo / "mnist-classifier", device=pipe._execution_device) if mnist else None
    weights = pipeline_weights_hash(pipe)  # once per sweep
    classifier_weights = weights_hash(classifier) if mnist else None
    todo = _todo(args)
    fingerprints = [row_fingerprint(p, s, args, weights, classifier_weights) for p, s in todo]
    args.table.parent.mkdir(parents=True, exist_ok=True)
    rows = read_rows(args.table)
    stale = _stale_rows(rows, todo, fingerprints, args)  # refuses stale rows before any work
    if stale:  # --overwrite: drop the stale rows now, recompute them below
        rows = [r for r in rows if (r.get("name"), r.get("seed")) not in stale]
        _write_rows(args.table, rows)
    references = {}
    if not all(any(_matches(r, f) for r in rows) for f in fingerprints):  # some point to run: its metrics' reference
        if mnist:
            ref, real_feats = mnist_reference(classifier)  # 10,000 MNIST test images: seconds
            references["in_domain"] = (ref, real_feats, classifier)
        else:
            from mmspec.eval.image_quality import held_out_reference

            references["heldout"] = held_out_reference(args.dataset, progress=not args.quiet)  # made once, kept
    if "inception" in args.metrics:
        references["inception"] = None  # the shipped MNIST test statistics (see `inception_metrics`)
    bar = tqdm(list(zip(todo, fingerprints)), desc="sweep", unit="point", disable=args.quiet)
    result = []
    for (point, seed), fingerprint in bar:
        bar.set_postfix_str(point.name)
        i = next((j for j, r in enumerate(rows)
                  if (r.get("name"), r.get("seed")) == (point.name, seed) and _matches(r, fingerprint)), None)  # fmt: skip
        if i is not None:
            added = add_missing_metrics(pipe, rows[i], point, seed, args, references, weights)
            if added:
                logger.info("%s seed %d: added %s to its finished row", point.name, seed, added)
                _write_rows(args.table, rows)
            result.append(rows[i])
            continue
        row = run_point(pipe, point, seed, args, references, weights) | {"fingerprint": fingerprint}
        rows.append(row)
        result.append(row)
        with args.table.open("a") as f:  # one line per finished point: a killed sweep loses at most the current one
            f.write(json.dumps(row) + "\n")
        logger.info("%s seed %d: %s speedup %s", point.name, seed,
                    ", ".join(f"{k} {row[k]:.4g}" for k in PANELS[args.dataset]), row.get("speedup"))  # fmt: skip
    rows = annotate(result)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(markdown_table(rows))
    plot(rows, args.plot)
    logger.info("wrote %s, %s, %s", args.table, args.markdown, args.plot)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mmspec eval sweep", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_arguments(args, parser)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO)
    from mmspec.eval.fingerprint import StaleArtefactError

    try:
        rows = run(args)
    except StaleArtefactError as err:  # checked before anything is sampled: nothing is lost
        parser.error(" ".join(str(err).split()))
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
