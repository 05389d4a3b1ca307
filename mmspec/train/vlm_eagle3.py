"""EAGLE-3 head for the VLM zoo: `python -m mmspec.train vlm-eagle3 --target assets/mnist-vlm
--data runs/vlm-answers.pt --out runs/vlm-eagle3`.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840) by online distillation from the target on its own answers
(`mmspec.train vlm-answers`): every step runs the frozen target on a batch of prompt + answer rows with their images
and records, in the same forward, the inputs of its decoder layers `--aux-layers` (default `(2, L // 2, L - 3)`, the
serving engines' default), its final-norm hidden states (its logits) and, with `--image-inputs embeds`, the merged
input embeddings (`mmspec.models.hf.inputs`). The head (`mmspec.models.hf.eagle3.Eagle3Head`) reads pairs
`(fc(a[i]), x[i+1])` and is trained to put the target's next-token law on its draft vocabulary:

    loss = sum_j decay^j soft-CE(p_target(x[i+2] | ...), q_draft_j(x[i+2]))  over answer positions i >= j

with `--unroll` training-time-test steps `j` (step `j` feeds the head its own step `j - 1` feature and attends like
the depth-`j + 1` node of a drafted chain, EAGLE-3's "training-time test"); no feature regression (EAGLE-3 drops it).
`p_target` is the target's softmax renormalised on the draft vocabulary (`--draft-vocab` most frequent answer tokens
of the training rows, FR-Spec; the head's `lm_head` starts from the target's rows there). `--target-cache` keeps each
row's target outputs after its first use (the same numbers: the target is frozen and the rows fixed) so later epochs
skip the target forward; it costs memory (`len(aux) + 1` hidden states per token, float16).

`--image-inputs` fixes what an image position feeds the head, at training and when drafting (recorded in the head's
config): `placeholder` (the image placeholder's token embedding; vLLM's convention) or `embeds` (the projected image
features the target's decoder received; SGLang's). The target gets the pipeline's inputs (`vlm_eagle.target_inputs`),
and on an M-RoPE target (Qwen2.5-VL / Qwen3-VL) the head's pairs sit at the target's own position ids of each row,
as both engines place them (`Eagle3Head` `positions="mrope"`, recorded in its config). The model card records the loss and, on held-out rows, the
agreement with the target's greedy token and the greedy chain's acceptance by depth.
"""

import logging
from contextlib import nullcontext

import torch

from mmspec.cli.args import int_in_range, non_negative_float
from mmspec.train.common import (
    add_common_arguments,
    card_metrics,
    not_run_defining,
    save_model,
    size_int,
    train_with_args,
    write_model_card,
)
from mmspec.train.vlm_eagle import (
    add_vlm_data_arguments,
    answer_mask,
    check_vlm_target,
    frozen_target,
    row_images,
    set_draft_vocabulary,
    target_inputs,
)


logger = logging.getLogger(__name__)

EVAL_DEPTH = 6  # draft depths reported (`top1_step0..5`, `accept_depth1..6`)
EVAL_CHUNK = 4  # held-out rows per evaluation forward


def _layer_list(text):
    """argparse `type` of `--aux-layers`: a comma list of layer indices >= 0, strictly ascending."""
    import argparse

    try:
        layers = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of layer indices, got {text!r}") from None
    if not layers or any(i < 0 for i in layers) or layers != sorted(set(layers)):
        raise argparse.ArgumentTypeError(f"must be strictly ascending layer indices >= 0, got {text!r}")
    return layers


def add_arguments(parser):
    add_common_arguments(parser, steps=600, batch_size=4, lr=5e-4, warmup_steps=50, checkpoint_every=100, threads=1)
    add_vlm_data_arguments(parser)
    parser.add_argument("--eval-items", type=size_int, default=32,
                        help="held-back rows for the metrics (the first of the templated and of the free-form rows)")  # fmt: skip
    parser.add_argument("--aux-layers", type=_layer_list, default=None,
                        help="target decoder layers whose inputs are fused (default: 2, L // 2, L - 3, the engines')")  # fmt: skip
    parser.add_argument("--image-inputs", choices=("placeholder", "embeds"), default="placeholder",
                        help="what an image position feeds the head: the placeholder token's embedding (vLLM) or "
                             "the target's projected image features (SGLang); recorded in the head's config")  # fmt: skip
    parser.add_argument("--unroll", type=size_int, default=3, help="training-time-test steps")
    parser.add_argument("--step-decay", type=non_negative_float, default=0.8, help="weight of step j: decay^j")
    parser.add_argument("--draft-vocab", type=int_in_range(0, 1 << 20), default=2048,
                        help="tokens the head scores (most frequent in the training answers; 0 = the full vocabulary)")  # fmt: skip
    parser.add_argument("--intermediate-size", type=int_in_range(1, 1 << 20), default=None,
                        help="the head's MLP width (default: the target's)")  # fmt: skip
    parser.add_argument("--num-attention-heads", type=int_in_range(1, 4096), default=None,
                        help="the head's attention heads (default: the target's)")  # fmt: skip
    parser.add_argument("--num-key-value-heads", type=int_in_range(1, 4096), default=None,
                        help="the head's key / value heads (default: the target's; must divide the heads)")  # fmt: skip
    parser.add_argument("--target-cache", action="store_true",
                        help="keep each row's target outputs after its first use (same numbers, less compute)")  # fmt: skip
    not_run_defining(parser, "target_cache")  # the same targets either way: a resume may switch it


def check_args(parser, args):
    """Usage errors before anything loads: a `--target` that is not a VLM folder (the zoo's or a transformers VLM),
    key / value heads that do not divide the attention heads."""
    check_vlm_target(parser, args)
    check_aux_layers(parser, args)
    heads, kv = args.num_attention_heads, args.num_key_value_heads
    if heads is not None and kv is not None and heads % kv:
        parser.error(f"argument --num-key-value-heads: {kv} does not divide --num-attention-heads {heads}")


def check_aux_layers(parser, args):
    """Usage error (from the target's config.json, before it loads) when `--aux-layers`, or the engines' default
    `(2, L // 2, L - 3)` for a target of L decoder layers, is not strictly ascending layers of that target."""
    from mmspec.models.hf.eagle3 import default_aux_layers
    from mmspec.models.hf.vlm_folder import text_config

    layers = text_config(args.target).get("num_hidden_layers")
    if not isinstance(layers, int):
        return  # the model's own loading names what is wrong with its config
    aux = args.aux_layers or list(default_aux_layers(layers))
    if aux != sorted(set(aux)) or min(aux) < 0 or max(aux) >= layers:
        given = "" if args.aux_layers else f" (the default (2, L // 2, L - 3) for L = {layers})"
        parser.error(f"argument --aux-layers: {','.join(map(str, aux))}{given} are not strictly ascending layers of "
                     f"a target with {layers} decoder layers (0..{layers - 1}): pass --aux-layers")  # fmt: skip


def eval_rows(data, n_eval):
    """Held-out row indices: the first `n_eval` templated rows and the first `n_eval` free-form rows (a merged
    `vlm-answers` file: templated first), or the first `n_eval` rows of a one-workload file."""
    kinds = data.get("kinds") or ["templated"] * len(data["input_ids"])
    templated = [i for i, k in enumerate(kinds) if k == "templated"]
    free = [i for i, k in enumerate(kinds) if k != "templated"]
    picked = templated[:n_eval] + free[:n_eval]
    return torch.tensor(sorted(picked), dtype=torch.long)


@torch.no_grad()
def target_outputs(model, processor, data, idx, width, aux_layers, embeds=False):
    """The frozen target on rows `idx` (prompt + answer, images; the pipeline's inputs, `vlm_eagle.target_inputs`):
    `(aux [B, T, len * dim], hidden [B, T, dim], inputs_embeds [B, T, dim] or None, positions [3, B, T] or None)`,
    recorded in one forward (`mmspec.models.hf.inputs`); `positions` are an M-RoPE target's position ids."""
    from mmspec.models.hf.inputs import capture_decoder_inputs, capture_layer_inputs

    ids, lengths = data["input_ids"][idx, :width], data["lengths"][idx]
    inputs, _ = target_inputs(model, processor, ids, lengths, row_images(data, idx.tolist()))
    with (
        capture_layer_inputs(model, aux_layers) as seen,
        capture_decoder_inputs(model) if embeds else nullcontext({}) as merged,
    ):
        out = model.model(input_ids=ids, **inputs)
    aux = torch.cat([seen[i] for i in aux_layers], dim=-1)
    return aux, out.last_hidden_state, merged.get("inputs_embeds"), inputs.get("position_ids")


def pair_positions(positions):
    """The RoPE positions of the pairs `(a[i], x[i+1])` of sequences with position ids `positions [3, B, T]`: the
    ids of their first tokens `[3, B, T - 1]` (`Eagle3Head`'s `"mrope"` positions); None stays None."""
    return None if positions is None else positions[..., :-1]


def target_draft_logits(head, target, hidden):
    """The target's logits on the head's draft vocabulary (all of it when the head scores every token)."""
    weight = target.get_output_embeddings().weight
    if head.config.draft_vocab_size:
        weight = weight[head.draft_vocab]
    return (hidden.to(weight.dtype) @ weight.t()).float()


def eagle3_losses(head, target, aux, hidden, ids, weight, *, unroll=1, step_decay=1.0, embeds=None, positions=None):
    """Per-step soft cross-entropies of `head` on rows `ids [B, T]` (list of `unroll` scalars).

    `aux [B, T, fused]`: the target's aux hidden states, `hidden [B, T, dim]`: its final-norm hidden states (the
    teacher's logits), `weight [B, T]` (bool): tokens whose prediction is trained (answer tokens), `embeds`
    (optional `[B, T, dim]`): the merged input embeddings (`image_inputs="embeds"`), `positions` (optional `[3, B,
    T]`): an M-RoPE target's position ids of the rows (a `positions="mrope"` head's). Output `i` of step `j` (pair
    `(a[i], x[i+1])`, `j` own steps deep) predicts `x[i+2]`; it is counted where `weight[:, i + 2]` and `i >= j`."""
    b = ids.shape[0]
    outs = head.forward_unrolled(aux[:, :-1], ids[:, 1:], target, unroll, embeds=None if embeds is None else
                                 embeds[:, 1:], positions=pair_positions(positions))  # fmt: skip
    with torch.no_grad():
        p = torch.softmax(target_draft_logits(head, target, hidden[:, 1:]), -1)  # [B, T-1, N]
    w = torch.cat([weight[:, 2:], weight.new_zeros(b, 1)], dim=1).float()
    losses = []
    for j, f in enumerate(outs):
        wj = w.clone()
        wj[:, :j] = 0
        logq = torch.log_softmax(head.draft_logits(target, f), -1)
        ce = -(p * logq).sum(-1)
        losses.append((ce * wj).sum() / wj.sum().clamp(min=1))
    return losses


@torch.no_grad()
def evaluate_eagle3(head, target, aux, hidden, ids, weight, depth=EVAL_DEPTH, embeds=None, positions=None):
    """Held-out agreement with the target's greedy token, as sums and counts (add over chunks, then divide):
    `top1_step{j}` (the head `j` own steps deep predicts the target's argmax) and `accept_depth{d}` (a greedy chain
    rooted at an answer position keeps its first `d` drafts: steps `0 .. d - 1` all right along it). `embeds`,
    `positions`: as `eagle3_losses`."""
    outs = head.forward_unrolled(aux[:, :-1], ids[:, 1:], target, depth, embeds=None if embeds is None else
                                 embeds[:, 1:], positions=pair_positions(positions))  # fmt: skip
    goal = target.get_output_embeddings()(hidden[:, 1:].float()).argmax(-1)  # [B, T-1]
    b, n = goal.shape
    w = torch.cat([weight[:, 2:], weight.new_zeros(b, 1)], dim=1)  # position i predicts an answer token
    right = [(head.compute_logits(target, f).argmax(-1) == goal) for f in outs]  # step j at i: depth j + 1 node
    sums = {}
    chain = torch.ones_like(goal, dtype=torch.bool)  # chain rooted at c, all right so far
    for j in range(depth):
        wj = w.clone()
        wj[:, :j] = False
        sums[f"top1_step{j}"] = (int((right[j] & wj).sum()), int(wj.sum()))
        # the chain rooted at c reaches depth j + 1 at position c + j
        step_right = torch.zeros_like(chain)
        step_right[:, : n - j] = right[j][:, j:]
        inside = torch.zeros_like(chain)
        inside[:, : n - j] = w[:, j:]
        chain = chain & step_right
        roots = w & inside  # roots whose depth-(j + 1) node is still an answer token
        sums[f"accept_depth{j + 1}"] = (int((chain & roots).sum()), int(roots.sum()))
    return sums


def merge_sums(parts):
    """`{name: (hits, count)}` summed over chunks -> `{name: hits / count}`."""
    total = {}
    for part in parts:
        for k, (hit, count) in part.items():
            h, c = total.get(k, (0, 0))
            total[k] = (h + hit, c + count)
    return {k: h / max(c, 1) for k, (h, c) in total.items()}


def run(args):
    from mmspec.models.hf.eagle3 import Eagle3Head, default_aux_layers

    generator, data, model, processor = frozen_target(args)
    text = model.config.get_text_config()
    aux_layers = tuple(args.aux_layers or default_aux_layers(text.num_hidden_layers))
    ids, lengths, prompt_lengths = data["input_ids"], data["lengths"], torch.tensor(data["prompt_lengths"])
    weight = answer_mask(lengths, prompt_lengths, ids.shape[1])
    held = eval_rows(data, min(args.eval_items, len(ids) // 8))
    kept = set(held.tolist())
    train_idx = torch.tensor([i for i in range(len(ids)) if i not in kept], dtype=torch.long)
    size = min(args.draft_vocab, model.get_output_embeddings().weight.shape[0])
    sizes = {k: getattr(args, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")}
    head = Eagle3Head.from_target(model, draft_vocab_size=size, aux_layers=aux_layers, image_inputs=args.image_inputs,
                                  **{k: v for k, v in sizes.items() if v is not None})  # fmt: skip
    head.check_target(model)
    head.init_weights(generator=generator)
    covered = set_draft_vocabulary(head, ids[train_idx], weight[train_idx], size, processor.tokenizer.eos_token_id)
    head.init_from_target(model)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    embeds = args.image_inputs == "embeds"
    cache = {}

    def outputs(idx, width):
        if not args.target_cache:
            return target_outputs(model, processor, data, idx, width, aux_layers, embeds)
        missing = [i for i in idx.tolist() if i not in cache]
        if missing:
            rows = torch.tensor(missing)
            w = int(lengths[rows].max())
            got = target_outputs(model, processor, data, rows, w, aux_layers, embeds)
            for r, i in enumerate(missing):
                n = int(lengths[i])
                cache[i] = tuple(None if t is None else t[r, :n].to(torch.float16) for t in got[:3])
        parts = []
        for k in range(3):
            if cache[int(idx[0])][k] is None:
                parts.append(None)
                continue
            rows = [cache[i][k].float() for i in idx.tolist()]
            parts.append(torch.stack([torch.nn.functional.pad(r, (0, 0, 0, width - len(r))) for r in rows]))
        # M-RoPE positions: exact and cheap to redo (the image processor's grids, no forward)
        inputs, _ = target_inputs(model, processor, ids[idx, :width], lengths[idx], row_images(data, idx.tolist()))
        return (*parts, inputs.get("position_ids"))

    def step_fn(step):
        idx = train_idx[torch.randint(len(train_idx), (args.batch_size,), generator=generator)]
        width = int(lengths[idx].max())
        aux, hidden, merged, positions = outputs(idx, width)
        losses = eagle3_losses(head, model, aux, hidden, ids[idx, :width], weight[idx, :width], unroll=args.unroll,
                               step_decay=args.step_decay, embeds=merged, positions=positions)  # fmt: skip
        scale = sum(args.step_decay**j for j in range(len(losses)))
        loss = sum(args.step_decay**j * value for j, value in enumerate(losses)) / scale
        return {"loss": loss, **{f"loss_step{j}": value.detach() for j, value in enumerate(losses)}}

    result = train_with_args(head, optimizer, step_fn, args, generator)
    head.eval()
    save_model(head, args.out, storage=args.storage)
    metrics = evaluate(head, model, processor, data, held, weight, aux_layers, embeds)
    logger.info("held-out metrics: %s", metrics)
    write_model_card(
        args.out,
        title=f"EAGLE-3 head for {args.target} ({type(model).__name__})",
        description=__doc__.split("\n\n", 1)[1],
        model=head,
        data=f"{args.data}: {len(ids)} target answers ({len(held)} held back for the metrics)",
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(result, metrics, {"draft_vocab_coverage": covered}),
        extra={"aux_layers": list(aux_layers), "image_inputs": args.image_inputs, "positions": head.config.positions},
        history=result.history,
    )
    return head


def evaluate(head, model, processor, data, held, weight, aux_layers, embeds):
    """`evaluate_eagle3` on the held-out rows, per workload (`templated_*`, `free-form_*`) and over both."""
    kinds = data.get("kinds") or ["templated"] * len(data["input_ids"])
    groups = {"": held.tolist()}
    for name, pick in (("templated_", lambda k: k == "templated"), ("free-form_", lambda k: k != "templated")):
        rows = [i for i in held.tolist() if pick(kinds[i])]
        if rows and len(rows) < len(held):
            groups[name] = rows
    per_row = {}
    for lo in range(0, len(held), EVAL_CHUNK):
        idx = held[lo : lo + EVAL_CHUNK]
        width = int(data["lengths"][idx].max())
        aux, hidden, merged, positions = target_outputs(model, processor, data, idx, width, aux_layers, embeds)
        tokens, masks = data["input_ids"][idx], weight[idx]  # the chunk's rows, in the order of its target outputs
        for r, i in enumerate(idx.tolist()):
            n = int(data["lengths"][i])
            sl = slice(r, r + 1)
            per_row[i] = evaluate_eagle3(head, model, aux[sl, :n], hidden[sl, :n], tokens[sl, :n], masks[sl, :n],
                                         embeds=None if merged is None else merged[sl, :n],
                                         positions=None if positions is None else positions[:, sl, :n])  # fmt: skip
    metrics = {}
    for prefix, rows in groups.items():
        metrics.update({prefix + k: v for k, v in merge_sums(per_row[i] for i in rows).items()})
    return metrics
