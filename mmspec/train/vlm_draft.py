"""Draft LM for a VLM: `python -m mmspec.train vlm-draft --target assets/mnist-vlm --data runs/vlm-answers.pt
--out runs/vlm-draft` (or `--target` your own transformers VLM folder and `--data` its `vlm-answers --prompts`
answers: `mmspec.models.hf.vlm_folder`).

The draft is the target cut to its first `--num-layers` decoder layers (`mmspec.models.hf.draft.truncated_draft`:
same tokenizer, embedding, output head, vision tower and projector), distilled on the target's own greedy answers
(`mmspec.train vlm-answers`): cross-entropy to the target's next token at every answer position, training only the
last `--train-layers` kept layers and the final norm. The folder stores only those tensors (`draft.json` +
`model.safetensors`); the rest comes from the target at load time (`mmspec.models.hf.draft.load_vlm_draft`). The
draft reads each row's images as the target does (`vlm_eagle.target_inputs`: the processor's outputs, M-RoPE
positions on Qwen-VL).
"""

import logging

import torch
import torch.nn.functional as F

from mmspec.train.common import (
    add_common_arguments,
    card_metrics,
    configure_threads,
    seed_everything,
    size_int,
    train_with_args,
    write_model_card,
)
from mmspec.train.vlm_eagle import (
    add_vlm_data_arguments,
    answer_mask,
    check_vlm_target,
    load_answer_data,
    row_images,
    target_inputs,
)


logger = logging.getLogger(__name__)


def add_arguments(parser):
    add_common_arguments(parser, steps=300, batch_size=4, lr=3e-4, warmup_steps=30, checkpoint_every=50, threads=2)
    add_vlm_data_arguments(parser)
    parser.add_argument("--num-layers", type=size_int, default=4, help="decoder layers the draft keeps")
    parser.add_argument("--train-layers", type=size_int, default=1, help="last kept layers that are fine-tuned")
    parser.add_argument("--eval-items", type=size_int, default=32, help="held-back answers for the metrics")


def check_args(parser, args):
    """Usage errors before any model loads: the draft keeps at most the target's decoder layers and fine-tunes at
    most the layers it keeps."""
    from mmspec.models.hf.vlm_folder import text_config

    check_vlm_target(parser, args)
    layers = text_config(args.target).get("num_hidden_layers")
    if layers is not None and args.num_layers > layers:
        parser.error(f"argument --num-layers: {args.num_layers} is more than the target's {layers} decoder layers")
    if args.train_layers > args.num_layers:
        parser.error(f"argument --train-layers: {args.train_layers} is more than --num-layers {args.num_layers}")


def draft_loss(draft, processor, ids, lengths, weight, images):
    """Mean next-token cross-entropy of `draft` on the answer tokens (`weight [B, T]`) of `ids [B, T]` whose images
    are `images` (PIL, in row order: `vlm_eagle.row_images`)."""
    inputs, _ = target_inputs(draft, processor, ids, lengths, images)
    logits = draft(input_ids=ids, **inputs, use_cache=False).logits[:, :-1]
    w = weight[:, 1:].float()
    ce = F.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
    agree = ((logits.argmax(-1) == ids[:, 1:]).float() * w).sum() / w.sum()
    return (ce * w).sum() / w.sum(), agree


def run(args):
    from mmspec.models.hf.draft import save_draft_delta, truncated_draft
    from mmspec.models.hf.vlm_folder import load_target_vlm

    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    data = load_answer_data(args.data)
    target, processor = load_target_vlm(args.target)
    target_class = type(target).__name__
    draft = truncated_draft(target, args.num_layers)
    del target
    first = args.num_layers - min(args.train_layers, args.num_layers)
    final_norm = "model.language_model.norm.weight" if hasattr(draft.model, "language_model") else "model.norm.weight"
    tuned = tuple(f"layers.{i}." for i in range(first, args.num_layers))
    trained = [n for n, _ in draft.named_parameters()
               if n == final_norm or ("vision_tower" not in n and any(t in n for t in tuned))]  # fmt: skip
    for name, p in draft.named_parameters():
        p.requires_grad_(name in trained)
    ids, lengths, prompt_lengths = data["input_ids"], data["lengths"], torch.tensor(data["prompt_lengths"])
    weight = answer_mask(lengths, prompt_lengths, ids.shape[1])
    n_eval = min(args.eval_items, len(ids) // 4)
    train_idx = torch.arange(n_eval, len(ids))
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)

    def step_fn(step):
        idx = train_idx[torch.randint(len(train_idx), (args.batch_size,), generator=generator)]
        width = int(lengths[idx].max())
        loss, agree = draft_loss(draft, processor, ids[idx, :width], lengths[idx], weight[idx, :width],
                                 row_images(data, idx.tolist()))  # fmt: skip
        return {"loss": loss, "agree": agree.detach()}

    before = evaluate(draft, processor, data, ids, lengths, weight, n_eval)
    result = train_with_args(draft, optimizer, step_fn, args, generator)
    draft.eval()
    save_draft_delta(draft, args.out, trained, args.num_layers, {"target": str(args.target)}, storage=args.storage)
    after = evaluate(draft, processor, data, ids, lengths, weight, n_eval)
    logger.info("held-out greedy agreement: %.3f before, %.3f after distillation", before["agree"], after["agree"])
    write_model_card(
        args.out,
        title=f"Draft LM for {args.target}: its {target_class} cut to {args.num_layers} layers, distilled",
        description=__doc__.split("\n\n", 1)[1],
        model=None,
        data=f"{args.data}: {len(ids)} target answers ({n_eval} held back for the metrics)",
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(
            result,
            {
                "heldout_agree_before": before["agree"],
                "heldout_agree_after": after["agree"],
                "heldout_ce_before": before["ce"],
                "heldout_ce_after": after["ce"],
            },
        ),  # fmt: skip
        extra={"trained_tensors": len(trained), "trained_parameters": sum(p.numel() for p in params)},
        history=result.history,
    )
    return draft


@torch.no_grad()
def evaluate(draft, processor, data, ids, lengths, weight, n_eval, batch_size=8):
    """Held-out answer CE and greedy agreement (draft argmax == the target's token) on the first `n_eval` items."""
    ce = agree = 0.0
    for lo in range(0, n_eval, batch_size):
        hi = min(lo + batch_size, n_eval)
        width = int(lengths[lo:hi].max())
        c, a = draft_loss(draft, processor, ids[lo:hi, :width], lengths[lo:hi], weight[lo:hi, :width],
                          row_images(data, range(lo, hi)))  # fmt: skip
        ce, agree = ce + float(c) * (hi - lo), agree + float(a) * (hi - lo)
    return {"ce": ce / n_eval, "agree": agree / n_eval}
