"""Train the class-conditional LlamaGen GPT target on MNIST token grids: `python -m mmspec.train c2i
--data runs/mnist-codes.pt --out assets/mnist-c2i`.

Data: the tokenized-MNIST file of `python -m mmspec.train tokenize` (codes [N, 64] from the 8x8 VQ grid, 256 codes,
labels [N]). Model: `LlamaGenGPT` c2i (default 8 layers, dim 256, 8 heads, 2-D RoPE over the 8x8 grid), trained with
next-token cross-entropy, class dropout 0.1 to the null class 10 (for classifier-free guidance), AdamW
(betas 0.9/0.95, weight decay on matrices only, as upstream), linear warmup + cosine decay.

Also holds the helpers shared by the `draft` and `eagle` tasks (target loading, soft cross-entropy, one-step
acceptance metrics).
"""

import logging
import math

import torch
import torch.nn.functional as F

from mmspec.cli.args import probability
from mmspec.models.llamagen.gpt import LlamaGenGPT
from mmspec.train.common import (
    add_common_arguments,
    card_metrics,
    configure_threads,
    declare_paths,
    load_checkpoint,
    not_run_defining,
    random_batch_indices,
    seed_everything,
    size_int,
    train_and_save,
    write_model_card,
    zoo_folder,
)


logger = logging.getLogger(__name__)


def add_data_arguments(parser, **defaults):
    parser.add_argument("--data", default="runs/mnist-codes.pt", help="tokenized MNIST (mmspec.train tokenize)")
    parser.add_argument("--train-split", default="train", help="'+'-joined splits to train on")
    parser.add_argument("--eval-split", default="val", help="split for the held-out metrics")
    parser.add_argument("--eval-size", type=size_int, default=2000, help="held-out items evaluated at the end")
    not_run_defining(parser, "eval_split", "eval_size")
    declare_paths(parser, input_files=("data",))


def add_target_argument(parser):
    """--target: the trained c2i target the draft / eagle tasks distil (a model folder, checked before any work)."""
    parser.add_argument("--target", default=zoo_folder("mnist-c2i"), help="trained target model folder")
    declare_paths(parser, model_folders=("target",))


def add_size_arguments(parser, dim, n_layer, n_head, multiple_of):
    """--dim / --n-layer / --n-head / --multiple-of of a `LlamaGenGPT` (`build_gpt`), with the task's defaults; the
    help names the SwiGLU width the defaults give (`LlamaGenGPT`: `multiple_of` rounding of 8 * dim / 3)."""
    ffn = -(-(8 * dim // 3) // multiple_of) * multiple_of
    parser.add_argument("--dim", type=size_int, default=dim)
    parser.add_argument("--n-layer", type=size_int, default=n_layer)
    parser.add_argument("--n-head", type=size_int, default=n_head)
    parser.add_argument(
        "--multiple-of", type=size_int, default=multiple_of, help=f"SwiGLU width rounding (dim {dim} -> {ffn})"
    )


def add_arguments(parser):
    add_common_arguments(parser, steps=6000, batch_size=64, lr=1e-3, warmup_steps=200, checkpoint_every=500, threads=2)
    parser.set_defaults(weight_decay=0.05)
    add_data_arguments(parser)
    add_size_arguments(parser, dim=256, n_layer=8, n_head=8, multiple_of=256)
    parser.add_argument(
        "--dropout", type=probability, default=0.1, help="token / residual / FFN dropout (upstream 0.1)"
    )
    parser.add_argument("--class-dropout", type=probability, default=0.1, help="probability of the null class (CFG)")


# ----------------------------------------------------------------------------- shared helpers
def load_data(args):
    """(codes, labels) for training and a held-out (codes, labels) slice, plus the file's metadata."""
    from mmspec.train.tokenize import load_codes

    codes, labels = load_codes(args.data, split=args.train_split)
    eval_codes, eval_labels = load_codes(args.data, split=args.eval_split)
    meta = load_checkpoint(args.data)
    n = min(args.eval_size, len(eval_codes))
    logger.info("data %s: train %s, eval %s x %d", args.data, tuple(codes.shape), args.eval_split, n)
    return codes, labels, eval_codes[:n], eval_labels[:n], meta


def check_args(parser, args):
    """Usage error before any data loads: `--dim` must split into `--n-head` heads (also the draft and t2i tasks)."""
    if args.dim % args.n_head:
        parser.error(f"argument --n-head: --dim {args.dim} is not divisible by --n-head {args.n_head}")


def build_gpt(args, vocab_size, block_size, null_prob, **condition):
    """A `LlamaGenGPT` from a task's `--dim / --n-layer / --n-head / --multiple-of / --dropout` arguments;
    `condition`: `model_type` and its fields (c2i: `num_classes`; t2i: `caption_dim`, `cls_token_num`)."""
    return LlamaGenGPT(vocab_size=vocab_size, dim=args.dim, n_layer=args.n_layer, n_head=args.n_head,
                       multiple_of=args.multiple_of, token_dropout_p=args.dropout, resid_dropout_p=args.dropout,
                       ffn_dropout_p=args.dropout, class_dropout_prob=null_prob, block_size=block_size,
                       **condition)  # fmt: skip


def build_optimizer(model, lr, weight_decay, betas=(0.9, 0.95)):
    """AdamW with weight decay on matrices / embeddings only (upstream `configure_optimizers`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def load_target_and_data(args):
    """The frozen `--target` (`load_target`) and the token data (`load_data`), checked against each other (grids of the
    target's `block_size`, codes below its vocabulary). Returns `(target, codes, labels, eval_codes, eval_labels)`."""
    target = load_target(args.target)
    codes, labels, eval_codes, eval_labels, meta = load_data(args)
    tc = target.config
    if codes.shape[1] != tc.block_size or int(codes.max()) >= tc.vocab_size:
        raise ValueError(
            f"data {args.data!r} does not match the target (block_size {tc.block_size}, vocab {tc.vocab_size})"
        )
    return target, codes, labels, eval_codes, eval_labels


def distill_batch(codes, labels, args, generator):
    """A training batch of the draft / eagle tasks: `--batch-size` random rows `(x, y)` and the rows on the null
    class (`--null-prob`), drawn from `generator` in that order."""
    idx = random_batch_indices(len(codes), args.batch_size, generator)
    x, y = codes[idx], labels[idx]
    return x, y, null_drop(len(x), args.null_prob, generator)


def load_target(path):
    """A trained target from the zoo, frozen (float32, eval, no grads)."""
    from mmspec.models import load

    target = load(path)
    if not isinstance(target, LlamaGenGPT):
        raise ValueError(f"target={str(path)!r} is a {type(target).__name__}, expected a LlamaGenGPT")
    target.requires_grad_(False)
    return target.eval()


def soft_cross_entropy(logits, target_probs):
    """Mean over positions of `-sum_v p_target(v) log q(v)` (logits [..., V], target_probs [..., V])."""
    return -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def null_drop(batch, prob, generator):
    """Bool [batch]: rows that get the null condition."""
    return torch.rand(batch, generator=generator) < prob


@torch.no_grad()
def one_step_agreement(q_logits, p_logits):
    """Metrics of a draft q vs the target p (per position, no CFG, T=1): mean acceptance probability of standard
    speculative sampling `sum_v min(p, q)` (= 1 - TV) and top-1 agreement."""
    p, q = p_logits.float().softmax(-1), q_logits.float().softmax(-1)
    return {
        "accept_prob": float(torch.minimum(p, q).sum(-1).mean()),
        "top1_agree": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
    }


@torch.no_grad()
def evaluate_nll(model, codes, labels, batch_size=250):
    """Held-out next-token NLL (nats/token) with the true class and with the null class, and bits per image."""
    model.eval()
    out = {}
    for name, null in (("nll", False), ("nll_uncond", True)):
        total, count = 0.0, 0
        for i in range(0, len(codes), batch_size):
            x, y = codes[i : i + batch_size], labels[i : i + batch_size]
            drop = torch.full((len(x),), null, dtype=torch.bool)
            logits = model.forward_train(x, y, drop=drop).logits
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1), reduction="sum"))
            count += x.numel()
        out[name] = total / max(count, 1)
    out["bits_per_image"] = out["nll"] * codes.shape[1] / math.log(2)
    return out


# ----------------------------------------------------------------------------- task
def run(args):
    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    codes, labels, eval_codes, eval_labels, meta = load_data(args)
    num_classes = int(labels.max()) + 1
    vocab = int(meta.get("codebook_size", int(codes.max()) + 1))
    model = build_gpt(args, vocab, codes.shape[1], args.class_dropout, model_type="c2i", num_classes=num_classes)
    model.init_weights(generator=generator)  # upstream init, output layer zeroed
    optimizer = build_optimizer(model, args.lr, args.weight_decay)

    def step_fn(step):
        idx = random_batch_indices(len(codes), args.batch_size, generator)
        x, y = codes[idx], labels[idx]
        logits = model.forward_train(x, y, generator=generator).logits  # class dropout from `generator`
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))
        return {"loss": loss}

    result, saved = train_and_save(model, optimizer, step_fn, args, generator)
    from mmspec.eval.entropy import next_token_stats

    metrics = evaluate_nll(saved, eval_codes, eval_labels)
    metrics.update({f"next_token_{k}": v for k, v in next_token_stats(saved, eval_codes, eval_labels).items()})
    logger.info("%s metrics: %s", args.eval_split, metrics)
    names = {"mnist": "MNIST", "textures": "texture", "natural": "natural-image"}
    name = names.get(meta.get("dataset", "mnist"), meta.get("dataset"))
    write_model_card(
        args.out,
        title=f"{name} class-conditional LlamaGen GPT ({args.n_layer}L/{args.dim}, {codes.shape[1]} tokens)",
        description=(
            "`mmspec.models.llamagen.gpt.LlamaGenGPT` (official LlamaGen parameter names, 2-D RoPE, c2i) trained from "
            f"scratch on VQ token grids of {name} ({vocab} codes, {codes.shape[1]} tokens in raster order) with "
            f"next-token cross-entropy; class dropout {args.class_dropout} to the null class {num_classes} (use "
            "it as the unconditional stream for classifier-free guidance). Held-out metrics are per-token NLL (nats) "
            f"on the first {len(eval_codes)} items of the `{args.eval_split}` split, with the true and the null class; "
            "`next_token_*` are the target's next-token entropy, top-1 probability and 90 % coverage (k90) there, "
            "teacher-forced with the true class at T=1 (`mmspec.eval.entropy`)."
        ),
        model=saved,
        data=f"{args.data} ({args.train_split}: {len(codes)} items; VQ {meta.get('vq', '?')})",
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(result, (f"{args.eval_split}_", metrics)),
        extra={
            "null_class": num_classes,
            "vq_sha256": meta.get("vq_sha256", ""),
        },
        history=result.history,
    )
    return saved
