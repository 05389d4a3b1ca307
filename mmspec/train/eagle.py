"""Train an EAGLE head on the target's features: `python -m mmspec.train eagle --target assets/mnist-c2i
--data runs/mnist-codes.pt --out assets/mnist-eagle`.

EAGLE-1/2 recipe (Li et al. 2024; LANTERN's LlamaGen drafter): one target forward (teacher forcing on real token
grids) gives the final-norm features h and next-token distributions p; the head sees pairs (h[i] + noise, x[i])
and regresses h[i+1]:

    loss = SmoothL1(f_hat[i], h[i+1]) + p_weight * soft-CE(p_target[i+1], softmax(target.output(f_hat[i])))

with uniform feature noise U(-noise, noise) on the input features, `--null-prob` of the rows on the null class
(the head then also drafts the unconditional CFG stream), and the target frozen (its token embedding and output head
are reused, not copied).
"""

import logging

import torch
import torch.nn.functional as F

from mmspec.cli.args import non_negative_float, probability
from mmspec.models.llamagen.eagle import EagleHead
from mmspec.train.common import (
    add_common_arguments,
    card_metrics,
    configure_threads,
    declare_paths,
    seed_everything,
    size_int,
    train_and_save,
    write_model_card,
)
from mmspec.train.gpt import (
    add_data_arguments,
    add_target_argument,
    build_optimizer,
    distill_batch,
    load_target_and_data,
    one_step_agreement,
    soft_cross_entropy,
)


logger = logging.getLogger(__name__)


def add_arguments(parser):
    add_common_arguments(parser, steps=4000, batch_size=64, lr=1e-3, warmup_steps=200, checkpoint_every=500, threads=2)
    parser.set_defaults(grad_clip=0.5)
    add_target_argument(parser)
    add_data_arguments(parser)
    parser.add_argument(
        "--p-weight", type=non_negative_float, default=0.1, help="weight of the soft cross-entropy term"
    )
    parser.add_argument("--noise", type=non_negative_float, default=0.2, help="uniform input-feature noise half-width")
    parser.add_argument("--null-prob", type=probability, default=0.1, help="fraction of rows on the null class")
    parser.add_argument(
        "--unroll",
        type=size_int,
        default=1,
        help="training-time-test steps (1 = EAGLE-1; >1 feeds the head its own features)",
    )
    parser.add_argument(
        "--step-decay", type=non_negative_float, default=0.8, help="loss weight decay per unrolled step"
    )
    parser.add_argument("--init", default=None, help="start from this trained head folder (fine-tuning)")
    declare_paths(parser, model_folders=("init",))


def eagle_losses(head, target, x, y, drop, noise=0.0, generator=None, unroll=1, step_decay=1.0):
    """Losses of one batch of token grids `x [B, N]`, classes `y [B]`.

    Returns `(vloss, ploss)`: the step-weighted mean regression and distillation losses over `unroll`
    training-time-test steps (`EagleHead.forward_unrolled`; step j has weight `step_decay ** j` and counts positions
    `i >= j` only).
    """
    with torch.no_grad():
        out = target.forward_train(x, y, drop=drop, return_hidden=True)
    hidden, p_logits = out.hidden, out.logits  # [B, N, dim]: index i predicts x[:, i]
    inputs = hidden[:, :-1]
    if noise:
        u = torch.rand(inputs.shape, generator=generator).to(inputs.device)
        inputs = inputs + (2 * u - 1) * noise
    p_next = p_logits[:, 1:].softmax(-1)
    vloss = ploss = 0.0
    total_weight = 0.0
    for j, feats in enumerate(head.forward_unrolled(inputs, x[:, :-1], target, unroll)):  # pair i -> h[i + 1]
        q_logits = head.compute_logits(target, feats[:, j:])
        w = step_decay**j
        vloss = vloss + w * F.smooth_l1_loss(feats[:, j:], hidden[:, 1 + j :])
        ploss = ploss + w * soft_cross_entropy(q_logits, p_next[:, j:])
        total_weight += w
    return vloss / total_weight, ploss / total_weight


@torch.no_grad()
def evaluate_head(head, target, codes, labels, batch_size=250, steps=4):
    """Held-out regression / distillation losses and agreement, true class and null class.

    `accept_prob` / `top1_agree` are for step 0 (the first draft token, from a true target feature);
    `accept_prob_step{j}` for the head's j-th unrolled step (the (j+1)-th token of a drafted chain).
    """
    head.eval()
    metrics = {}
    for suffix, null in (("", False), ("_uncond", True)):
        sums, n = {}, 0
        for i in range(0, len(codes), batch_size):
            x, y = codes[i : i + batch_size], labels[i : i + batch_size]
            drop = torch.full((len(x),), null, dtype=torch.bool)
            out = target.forward_train(x, y, drop=drop, return_hidden=True)
            m = {}
            for j, feats in enumerate(head.forward_unrolled(out.hidden[:, :-1], x[:, :-1], target, steps)):
                q_logits = head.compute_logits(target, feats[:, j:])
                agree = one_step_agreement(q_logits, out.logits[:, 1 + j :])
                if j == 0:
                    m.update(agree)
                    m["vloss"] = float(F.smooth_l1_loss(feats, out.hidden[:, 1:]))
                    m["ploss"] = float(soft_cross_entropy(q_logits, out.logits[:, 1:].softmax(-1)))
                m[f"accept_prob_step{j}"] = agree["accept_prob"]
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v * len(x)
            n += len(x)
        metrics.update({f"{k}{suffix}": v / max(n, 1) for k, v in sums.items()})
    return metrics


def _unroll_text(args):
    if args.unroll <= 1:
        return ""
    return (
        f"; training-time test: {args.unroll} unrolled steps (the head fed its own features, attending as at "
        f"inference), step j weighted {args.step_decay}^j" + (f"; initialised from {args.init}" if args.init else "")
    )


def run(args):
    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    target, codes, labels, eval_codes, eval_labels = load_target_and_data(args)
    if args.init:
        from mmspec.models import load

        head = load(args.init)
        if not isinstance(head, EagleHead):
            raise ValueError(f"--init {args.init!r} is not an EagleHead folder")
        head.check_target(target)
        head.train()
    else:
        head = EagleHead.from_target(target)
        head.init_weights(generator=generator)
    optimizer = build_optimizer(head, args.lr, args.weight_decay)

    def step_fn(step):
        x, y, drop = distill_batch(codes, labels, args, generator)
        vloss, ploss = eagle_losses(head, target, x, y, drop, args.noise, generator, args.unroll, args.step_decay)
        return {"loss": vloss + args.p_weight * ploss, "vloss": vloss.detach(), "ploss": ploss.detach()}

    result, saved = train_and_save(head, optimizer, step_fn, args, generator)
    metrics = evaluate_head(saved, target, eval_codes, eval_labels)
    logger.info("%s metrics: %s", args.eval_split, metrics)
    write_model_card(
        args.out,
        title=f"MNIST EAGLE head for {args.target}",
        description=(
            "`mmspec.models.llamagen.eagle.EagleHead`: fc([tok_emb(x[t+1]); h[t]]) -> one decoder layer of the target's "
            "block type -> f_hat[t+1], decoded by the target's own output head (token embedding and output head are "
            f"the target's, not stored here). Trained on the target's final-norm features: SmoothL1 regression + "
            f"{args.p_weight} x soft cross-entropy to the target's next-token distribution, uniform input-feature "
            f"noise U(-{args.noise}, {args.noise}), {args.null_prob:.0%} null-class rows{_unroll_text(args)}. "
            "`accept_prob` is the mean one-step acceptance probability sum_v min(p_target, q_draft) given the "
            "target's true feature (temperature 1, no guidance); `accept_prob_step{j}` the same for the (j+1)-th "
            f"token of a chain the head drafts on its own features; on the first {len(eval_codes)} "
            f"`{args.eval_split}` items."
        ),
        model=saved,
        data=f"{args.data} ({args.train_split}: {len(codes)} items)",
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(result, (f"{args.eval_split}_", metrics)),
        extra={
            "target": str(args.target),
        },
        history=result.history,
    )
    return saved
