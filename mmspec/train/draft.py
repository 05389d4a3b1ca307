"""Distil a small LlamaGen GPT draft from the target: `python -m mmspec.train draft --target assets/mnist-c2i
--data runs/mnist-codes.pt --out assets/mnist-draft`.

The draft is a plain `LlamaGenGPT` (default 2 layers, dim 128, 4 heads: about 1/16 of the 8L/256 target's
per-token matmul cost) with the target's vocabulary, classes and token grid. Loss: soft cross-entropy to the
target's next-token distribution on real token grids (teacher forcing), per CFG stream: a fraction `--null-prob` of
the rows get the null class for both models, so the draft also learns the unconditional stream. `--hard-weight`
optionally mixes in the ordinary cross-entropy to the data tokens.
"""

import logging

import torch
import torch.nn.functional as F

from mmspec.cli.args import non_negative_float, probability
from mmspec.train.common import (
    add_common_arguments,
    card_metrics,
    configure_threads,
    seed_everything,
    train_and_save,
    write_model_card,
)
from mmspec.train.gpt import (
    add_data_arguments,
    add_size_arguments,
    add_target_argument,
    build_gpt,
    build_optimizer,
    check_args,  # noqa: F401  (the task's usage checks: --dim / --n-head)
    distill_batch,
    evaluate_nll,
    load_target_and_data,
    one_step_agreement,
    soft_cross_entropy,
)


logger = logging.getLogger(__name__)


def add_arguments(parser):
    add_common_arguments(parser, steps=4000, batch_size=64, lr=2e-3, warmup_steps=200, checkpoint_every=500, threads=2)
    parser.set_defaults(weight_decay=0.05)
    add_target_argument(parser)
    add_data_arguments(parser)
    add_size_arguments(parser, dim=128, n_layer=2, n_head=4, multiple_of=128)
    parser.add_argument("--dropout", type=probability, default=0.0)
    parser.add_argument("--null-prob", type=probability, default=0.1, help="fraction of rows on the null class")
    parser.add_argument(
        "--hard-weight", type=non_negative_float, default=0.0, help="weight of the data cross-entropy term"
    )


@torch.no_grad()
def evaluate_draft(draft, target, codes, labels, batch_size=250):
    """One-step agreement with the target (true class and null class) + the draft's own held-out NLL."""
    metrics = {}
    for suffix, null in (("", False), ("_uncond", True)):
        acc, top1, n = 0.0, 0.0, 0
        for i in range(0, len(codes), batch_size):
            x, y = codes[i : i + batch_size], labels[i : i + batch_size]
            drop = torch.full((len(x),), null, dtype=torch.bool)
            m = one_step_agreement(
                draft.forward_train(x, y, drop=drop).logits, target.forward_train(x, y, drop=drop).logits
            )
            acc, top1, n = acc + m["accept_prob"] * len(x), top1 + m["top1_agree"] * len(x), n + len(x)
        metrics[f"accept_prob{suffix}"] = acc / max(n, 1)
        metrics[f"top1_agree{suffix}"] = top1 / max(n, 1)
    metrics.update(evaluate_nll(draft, codes, labels, batch_size))
    return metrics


def run(args):
    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    target, codes, labels, eval_codes, eval_labels = load_target_and_data(args)
    tc = target.config
    draft = build_gpt(args, tc.vocab_size, tc.block_size, args.null_prob, model_type=tc.model_type,
                      num_classes=tc.num_classes, cls_token_num=tc.cls_token_num)  # fmt: skip
    draft.init_weights(generator=generator)
    optimizer = build_optimizer(draft, args.lr, args.weight_decay)

    def step_fn(step):
        x, y, drop = distill_batch(codes, labels, args, generator)
        with torch.no_grad():
            p_target = target.forward_train(x, y, drop=drop).logits.softmax(-1)
        logits = draft.forward_train(x, y, drop=drop).logits
        soft = soft_cross_entropy(logits, p_target)
        hard = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))
        loss = soft + args.hard_weight * hard if args.hard_weight else soft
        # soft CE minus the target's entropy = KL(p_target || q_draft)
        kl = soft - (-(p_target * p_target.clamp_min(1e-12).log()).sum(-1).mean())
        return {"loss": loss, "kl": kl.detach(), "hard_ce": hard.detach()}

    result, saved = train_and_save(draft, optimizer, step_fn, args, generator)
    metrics = evaluate_draft(saved, target, eval_codes, eval_labels)
    logger.info("%s metrics: %s", args.eval_split, metrics)
    n_draft = sum(p.numel() for n, p in saved.named_parameters() if n.startswith("layers."))
    n_target = sum(p.numel() for n, p in target.named_parameters() if n.startswith("layers."))
    write_model_card(
        args.out,
        title=f"MNIST small-GPT draft ({args.n_layer}L/{args.dim}) for {args.target}",
        description=(
            "A small `LlamaGenGPT` (same vocabulary, classes and token grid as the target) distilled with soft "
            "cross-entropy to the target's next-token distributions on real MNIST token grids (teacher forcing); "
            f"{args.null_prob:.0%} of the rows use the null class for both models so the unconditional CFG stream is "
            "learned too. `accept_prob` is the mean one-step acceptance probability sum_v min(p_target, q_draft) "
            f"(temperature 1, no guidance) on the first {len(eval_codes)} `{args.eval_split}` items."
        ),
        model=saved,
        data=f"{args.data} ({args.train_split}: {len(codes)} items)",
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(result, (f"{args.eval_split}_", metrics)),
        extra={
            "target": str(args.target),
            "block_params_ratio_draft_over_target": n_draft / max(n_target, 1),
        },
        history=result.history,
    )
    return saved
