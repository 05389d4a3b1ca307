"""Vision-aware EAGLE heads for the VLM zoo (ViSpec, MSD, SpecVLM; `mmspec.drafters.vision_eagle.VisionEagleHead`):
`python -m mmspec.train vlm-vision --policy vispec|msd|specvlm --data runs/vlm-answers.pt --init runs/vlm-eagle
--out runs/vlm-vispec`.

Online distillation (SpecVLM): every step samples a batch of the target's own answers (`mmspec.train vlm-answers`),
runs the frozen target on prompt + answer with the image and records, in the same forward, its final-norm features
`h` (the teacher's penultimate features; its logits are `lm_head(h)`) and the decoder's merged input embeddings with
the image mask (`mmspec.models.hf.inputs.capture_decoder_inputs`); nothing is stored. The head is trained in the
same step on the answer positions, with the losses of `vlm-eagle` (`eagle_text_losses`: `--unroll` training-time-test
steps, uniform input-feature noise, the soft CE at `--ce-positions` random answer positions per row):

    loss = feat_weight * SmoothL1(f, h_next) + logit_weight * soft-CE(p_target, q_draft)

(defaults 1.0 / 0.1, EAGLE-1 / SpecVLM). `--init` starts the fc, the decoder layer and the draft vocabulary from a
trained text EAGLE head (ViSpec's and MSD's stage 1). MSD curriculum (`--text-steps`, `--ramp-steps`): a sample is
multimodal with probability `r(step) = clamp((step - text_steps) / ramp_steps, 0, 1)` (drawn per sample), else
text-only (its image tokens removed from the prompt, no pixel values: the teacher runs text-only too).
"""

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mmspec.cli.args import int_in_range, non_negative_float, positive_float
from mmspec.train.common import (
    MAX_STEPS,
    add_common_arguments,
    card_metrics,
    configure_threads,
    declare_paths,
    save_model,
    seed_everything,
    size_int,
    train_with_args,
    write_model_card,
)
from mmspec.train.vlm_eagle import (
    add_head_loss_arguments,
    add_vlm_data_arguments,
    answer_mask,
    check_vlm_target,
    draft_vocabulary,
    eagle_text_losses,
    evaluate_text_head,
    load_answer_data,
    row_images,
    target_inputs,
)


logger = logging.getLogger(__name__)

#: "eagle": the control -- a plain `TextEagleHead` through the same online loop (the image only through the target's
#: features), to tell what the vision policy adds from what more training adds.
POLICIES = ("vispec", "msd", "specvlm", "eagle")
#: `--text-steps` / `--ramp-steps` when not given: MSD's two stages (text-only, then a ramp to multimodal) sized to the
#: shipped run's budget; the other policies train multimodal from the first step.
CURRICULUM = {"vispec": (0, 0), "msd": (50, 100), "specvlm": (0, 0), "eagle": (0, 0)}
#: The policy flags, the policies they belong to and their value when not given (`num_queries`: ViSpec's queries and
#: SpecVLM's resampler expert).
POLICY_FLAGS = {"num_queries": (("vispec", "specvlm"), 2), "ratio": (("specvlm",), 4), "gate_tau": (("specvlm",), 1.0)}
INIT_NOTE = (
    "init_* = the --init text head on the same held-out rows (with its image as it sees it: through the "
    "target's features); it may have trained on them (vlm-eagle holds back only its own first --eval-items "
    "rows), so its numbers can be optimistic"
)
EVAL_STEPS = 3  # draft depths reported (`top1_step0..2`)
EVAL_CHUNK = 4  # held-out rows per evaluation forward (the full-vocabulary argmax is [rows, T, 49152])


def add_arguments(parser):
    add_common_arguments(parser, steps=200, batch_size=4, lr=2e-4, warmup_steps=10, checkpoint_every=10, threads=1)
    parser.add_argument("--policy", choices=POLICIES, required=True, action=_Policy,
                        help="the draft-side vision-token policy (sets the defaults of its flags below)")  # fmt: skip
    add_vlm_data_arguments(parser, "`vlm-answers` output (templated + free-form)")
    parser.add_argument("--init", default=None,
                        help="a trained text EAGLE head folder (vlm-eagle): fc, layer and draft vocabulary start "
                             "from it (stage 1); default: fresh weights")  # fmt: skip
    declare_paths(parser, model_folders=("init",))
    parser.add_argument("--eval-items", type=size_int, default=32,
                        help="held-out rows per workload (the first of the templated and of the free-form rows)")  # fmt: skip
    parser.add_argument("--feat-weight", type=non_negative_float, default=1.0, help="lambda_feat (SmoothL1)")
    parser.add_argument("--logit-weight", type=non_negative_float, default=0.1, help="lambda_logit (soft CE)")
    add_head_loss_arguments(parser, "without --init: tokens the head scores (most frequent answer tokens; 0 = all)")
    parser.add_argument("--text-steps", type=int_in_range(0, MAX_STEPS), default=None,
                        help=f"MSD stage 1: text-only steps (default: {_defaults_text(0)})")  # fmt: skip
    parser.add_argument("--ramp-steps", type=int_in_range(0, MAX_STEPS), default=None,
                        help=f"MSD stage 2: steps of the linear ramp of the multimodal share (default: {_defaults_text(1)})")  # fmt: skip
    parser.add_argument("--num-queries", type=int_in_range(2, 4096), default=None,
                        help="vispec: learned queries per image (num_q - 1 sequence tokens + 1 global); specvlm: of its resampler expert (default 2)")  # fmt: skip
    parser.add_argument("--ratio", type=int_in_range(1, 4096), default=None,
                        help="specvlm: the experts' compression ratio (default 4)")  # fmt: skip
    parser.add_argument("--gate-tau", type=positive_float, default=None,
                        help="specvlm: Gumbel-softmax temperature of the gate (default 1.0)")  # fmt: skip


class _Policy(argparse.Action):
    """`--policy`: also fills in the defaults of its own flags (`POLICY_FLAGS`, `CURRICULUM`) where they are not
    given (before or after it), so the run's recorded flags hold the values used; another policy's flags stay None."""

    def __call__(self, parser, namespace, value, option_string=None):
        for dest, default in getattr(namespace, "_policy_filled", {}).items():  # a repeated --policy: the last
            if getattr(namespace, dest) == default:  # one's defaults (a value given since is kept)
                setattr(namespace, dest, None)
        text, ramp = CURRICULUM[value]
        defaults = {"text_steps": text, "ramp_steps": ramp}
        defaults.update({k: d for k, (policies, d) in POLICY_FLAGS.items() if value in policies})
        filled = {}
        for dest, default in defaults.items():
            if getattr(namespace, dest, None) is None:
                setattr(namespace, dest, default)
                filled[dest] = default
        namespace._policy_filled = filled
        setattr(namespace, self.dest, value)


def _defaults_text(k):
    return ", ".join(f"{p} {v[k]}" for p, v in CURRICULUM.items())


def check_args(parser, args):
    """Usage errors before anything loads: a `--target` that is not a VLM folder (the zoo's or a transformers VLM), a
    policy flag given to another policy, more text-only steps than steps."""
    check_vlm_target(parser, args)
    for dest, (policies, _) in POLICY_FLAGS.items():
        if getattr(args, dest) is not None and args.policy not in policies:
            parser.error(
                f"argument --{dest.replace('_', '-')}: only for --policy {' | '.join(policies)} (got --policy {args.policy})"
            )
    text_steps, _ = curriculum(args)
    if text_steps > args.steps:
        parser.error(f"argument --text-steps: {text_steps} text-only steps is more than --steps {args.steps}")


def curriculum(args):
    """`(text_steps, ramp_steps)` of the run (the policy's `CURRICULUM` where a flag is not given)."""
    text, ramp = CURRICULUM[args.policy]
    return (text if args.text_steps is None else args.text_steps, ramp if args.ramp_steps is None else args.ramp_steps)


def policy_kwargs(args):
    """The `VisionEagleHead` keyword arguments of `args.policy` (its flags, defaults filled in)."""
    return {k: (default if getattr(args, k) is None else getattr(args, k))
            for k, (policies, default) in POLICY_FLAGS.items() if args.policy in policies}  # fmt: skip


def multimodal_probability(step, text_steps, ramp_steps):
    """MSD's share of multimodal samples at `step` (0-based): 0 for the first `text_steps` steps, then a linear ramp
    reaching 1 at `text_steps + ramp_steps`, 1 after (`ramp_steps` 0: a jump)."""
    if step < text_steps:
        return 0.0
    if step >= text_steps + ramp_steps:
        return 1.0
    return (step - text_steps) / ramp_steps


@dataclass
class TeacherBatch:
    """One online-distillation batch: sequences right-padded to the longest, with what the frozen target computed."""

    ids: torch.Tensor  # [B, T] prompt + answer (pad after `lengths`)
    lengths: torch.Tensor  # [B]
    prompt_lengths: torch.Tensor  # [B]
    weight: torch.Tensor  # [B, T] bool, answer tokens
    hidden: torch.Tensor  # [B, T, D] float32: the target's final-norm features
    inputs_embeds: torch.Tensor  # [B, T, D]: the decoder's input embeddings, image features merged in
    image_mask: torch.Tensor  # [B, T] bool
    multimodal: torch.Tensor  # [B] bool: the row kept its image
    image_layout: object = None  # an `ImageLayout`: each row's images by length (targets whose images differ in size)


def text_only_row(ids, prompt_length, is_image):
    """A row `ids [L]` with the image placeholder tokens (`is_image [L]`) of its prompt removed -> `(ids [L'],
    prompt length)`."""
    drop = is_image.clone()
    drop[prompt_length:] = False
    return ids[~drop], prompt_length - int(drop.sum())


@torch.no_grad()
def teacher_batch(model, processor, data, idx, multimodal, pad_id=0):
    """Run the frozen target on rows `idx` of a `vlm-answers` file `data` (`multimodal [B]` bool: with the row's
    canvas as the image; else text-only, `text_only_row`, no pixel values) -> `TeacherBatch`. The target gets what
    the pipeline gives it (`mmspec.train.vlm_eagle.target_inputs`: the image processor's outputs, M-RoPE positions),
    and the batch's `image_layout` is built from the same processor outputs."""
    from mmspec.models.hf.inputs import capture_decoder_inputs, image_token_mask

    rows, prompts = [], []
    for r, mm in zip(idx.tolist(), multimodal.tolist()):
        length, prompt = int(data["lengths"][r]), int(data["prompt_lengths"][r])
        row = data["input_ids"][r, :length]
        if not mm:
            row, prompt = text_only_row(row, prompt, image_token_mask(model, row[None])[0])
        rows.append(row.tolist())
        prompts.append(prompt)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    prompt_lengths = torch.tensor(prompts)
    inputs, layout = target_inputs(model, processor, ids, lengths, row_images(data, idx[multimodal].tolist()))
    with capture_decoder_inputs(model) as seen:
        out = model.model(input_ids=ids, **inputs)
    return TeacherBatch(ids=ids, lengths=lengths, prompt_lengths=prompt_lengths,
                        weight=answer_mask(lengths, prompt_lengths, width), hidden=out.last_hidden_state.float(),
                        inputs_embeds=seen["inputs_embeds"], image_mask=image_token_mask(model, ids),
                        multimodal=multimodal.clone(), image_layout=layout)  # fmt: skip


def held_out_rows(data, eval_items):
    """`{workload: row indices}`: the first `eval_items` rows of the templated part and of the free-form part (the
    merged file holds the templated rows first), at most a quarter of each part."""
    kinds = list(data.get("kinds") or ["templated"] * len(data["input_ids"]))
    parts = {"templated": [i for i, k in enumerate(kinds) if k == "templated"],
             "free_form": [i for i, k in enumerate(kinds) if k != "templated"]}  # fmt: skip
    return {name: torch.tensor(rows[: min(eval_items, len(rows) // 4)], dtype=torch.long)
            for name, rows in parts.items() if len(rows) >= 4}  # fmt: skip


def vision_kwargs(batch, generator=None):
    """`VisionEagleHead.forward_unrolled`'s keyword arguments for a `TeacherBatch` (its image layout included)."""
    return {"inputs_embeds": batch.inputs_embeds, "image_mask": batch.image_mask,
            "prompt_lengths": batch.prompt_lengths, "generator": generator, "image_layout": batch.image_layout}  # fmt: skip


@torch.no_grad()
def agreement_counts(heads, model, processor, data, rows, pad_id=0):
    """Held-out greedy agreement per draft depth (`evaluate_text_head`) of each head of `heads` (`{name: (head,
    vision)}`, `vision`: whether it takes the vision keyword arguments) over `rows` (with their images), in chunks ->
    `({name: [(agreeing positions, positions) per depth]}, {name: policy_draws(...) of the vision heads}`)."""
    tally = {name: [[0.0, 0.0] for _ in range(EVAL_STEPS)] for name in heads}
    draws = {name: {"image_tokens": [], "choice": []} for name, (_, vision) in heads.items() if vision}
    for lo in range(0, len(rows), EVAL_CHUNK):
        idx = rows[lo : lo + EVAL_CHUNK]
        batch = teacher_batch(model, processor, data, idx, torch.ones(len(idx), dtype=torch.bool), pad_id)
        for name, (head, vision) in heads.items():
            metrics = evaluate_text_head(head, model, batch.hidden, batch.ids, batch.weight, steps=EVAL_STEPS,
                                         forward_kwargs=vision_kwargs(batch) if vision else None)  # fmt: skip
            for j in range(EVAL_STEPS):
                n = float(batch.weight[:, j + 2 :].sum())  # the positions evaluate_text_head counts at depth j
                tally[name][j][0] += metrics[f"top1_step{j}"] * n
                tally[name][j][1] += n
            if vision:
                for key, values in policy_draws(head, model, batch).items():
                    draws[name][key] += values
    return tally, draws


@torch.no_grad()
def policy_draws(head, model, batch):
    """What the vision policy of `head` (in its current mode) keeps for each row of a `TeacherBatch`, as the
    unrolled training forward sees it: `{"image_tokens": [per row], "choice": [expert name per row] (SpecVLM's gate;
    [] otherwise)}`."""
    valid = torch.ones(batch.ids.shape[0], batch.ids.shape[1] - 1, dtype=torch.bool)
    seq = head.draft_sequence(batch.hidden[:, :-1], batch.ids[:, 1:], model, valid, batch.inputs_embeds,
                              batch.image_mask, batch.prompt_lengths, image_layout=batch.image_layout)  # fmt: skip
    names = getattr(head.vision, "names", None)
    choice = [] if seq.choice is None else [names[int(c)] if c >= 0 else "no image" for c in seq.choice.tolist()]
    return {"image_tokens": seq.image_tokens.tolist(), "choice": choice}


def held_out_metrics(heads, model, processor, data, held, pad_id=0):
    """`{[workload_][name_]top1_step{j}}` over the held-out rows `held` (`held_out_rows`): per workload and pooled
    over all their answer positions (`name` "" for the trained head); for the trained head also the mean draft-side
    image tokens per image and, for SpecVLM, the gate's choices (`{expert: rows}`) per workload."""
    metrics, pooled = {}, {}
    for workload, rows in held.items():
        tally, draws = agreement_counts(heads, model, processor, data, rows, pad_id)
        for name, per_step in tally.items():
            for j, (hits, n) in enumerate(per_step):
                metrics[f"{workload}_{name}top1_step{j}"] = hits / max(n, 1.0)
                total = pooled.setdefault(f"{name}top1_step{j}", [0.0, 0.0])
                total[0], total[1] = total[0] + hits, total[1] + n
        if "" in draws:
            tokens = draws[""]["image_tokens"]
            metrics[f"{workload}_draft_image_tokens"] = sum(tokens) / max(len(tokens), 1)
            if draws[""]["choice"]:
                names = sorted(set(draws[""]["choice"]))
                metrics[f"{workload}_gate_choice"] = {k: draws[""]["choice"].count(k) for k in names}
    return {**{k: hits / max(n, 1.0) for k, (hits, n) in pooled.items()}, **metrics}


def build_head(args, model, processor, data, train_rows, generator=None):
    """The `VisionEagleHead` of `args.policy` (`"eagle"`: a `TextEagleHead`), from `--init` (a text EAGLE head) or
    fresh (its draft vocabulary built from the training answers as `vlm-eagle` does) -> `(head, text head or None,
    draft vocabulary coverage)`."""
    from mmspec.drafters.vision_eagle import VisionEagleHead
    from mmspec.models import load
    from mmspec.models.hf.eagle import TextEagleHead

    kwargs = policy_kwargs(args)
    if args.init is not None:
        text_head = load(args.init)
        if not isinstance(text_head, TextEagleHead):
            raise ValueError(f"--init {str(args.init)!r} holds a {type(text_head).__name__}, not a TextEagleHead")
        text_head.check_target(model)
        if args.policy == "eagle":
            head = TextEagleHead.from_target(model, draft_vocab_size=text_head.config.draft_vocab_size)
            head.load_state_dict(text_head.state_dict())
        else:
            head = VisionEagleHead.from_target(model, vision_policy=args.policy,
                                               draft_vocab_size=text_head.config.draft_vocab_size, **kwargs)  # fmt: skip
            head.load_text_head(text_head)
        return head, text_head.eval(), None
    size = min(args.draft_vocab, model.get_output_embeddings().weight.shape[0])
    if args.policy == "eagle":
        head = TextEagleHead.from_target(model, draft_vocab_size=size)
    else:
        head = VisionEagleHead.from_target(model, vision_policy=args.policy, draft_vocab_size=size, **kwargs)
    head.init_weights(generator=generator)
    covered = None
    if size:
        weight = answer_mask(data["lengths"], torch.as_tensor(data["prompt_lengths"]), data["input_ids"].shape[1])
        vocab, covered = draft_vocabulary(data["input_ids"][train_rows], weight[train_rows], size,
                                          processor.tokenizer.eos_token_id)  # fmt: skip
        head.set_draft_vocab(vocab)
        logger.info("draft vocabulary: %d tokens covering %.4f of the training answer tokens", size, covered)
    return head, None, covered


def run(args):
    from mmspec.models.hf.vlm_folder import load_target_vlm

    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    data = load_answer_data(args.data)
    if (not isinstance(data, dict) or not {"input_ids", "lengths", "prompt_lengths"} <= set(data)
            or not ("canvases" in data or "image_files" in data)):  # fmt: skip
        raise ValueError(f"--data {str(args.data)!r} is not a finished vlm-answers file")
    model, processor = load_target_vlm(args.target)
    for p in model.parameters():
        p.requires_grad_(False)
    pad_id = processor.tokenizer.pad_token_id or 0
    held = held_out_rows(data, args.eval_items)
    eval_rows = torch.cat(list(held.values())) if held else torch.zeros(0, dtype=torch.long)
    is_eval = torch.zeros(len(data["input_ids"]), dtype=torch.bool)
    is_eval[eval_rows] = True
    train_rows = torch.nonzero(~is_eval).flatten()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    head, text_head, covered = build_head(args, model, processor, data, train_rows, generator)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)  # fmt: skip
    text_steps, ramp_steps = curriculum(args)
    vision = args.policy != "eagle"  # the control takes no vision inputs
    logger.info("%s head: %d training rows, %d held out; curriculum %d text-only steps, ramp %d",
                args.policy, len(train_rows), len(eval_rows), text_steps, ramp_steps)  # fmt: skip

    def step_fn(step):
        idx = train_rows[torch.randint(len(train_rows), (args.batch_size,), generator=generator)]
        share = multimodal_probability(step, text_steps, ramp_steps)
        multimodal = torch.rand(args.batch_size, generator=generator) < share
        batch = teacher_batch(model, processor, data, idx, multimodal, pad_id)
        vloss, ploss = eagle_text_losses(head, model, batch.hidden, batch.ids, batch.weight, unroll=args.unroll,
                                         step_decay=args.step_decay, noise=args.noise,
                                         ce_positions=args.ce_positions, generator=generator,
                                         forward_kwargs=vision_kwargs(batch, generator) if vision else None)  # fmt: skip
        return {"loss": args.feat_weight * vloss + args.logit_weight * ploss, "vloss": vloss.detach(),
                "ploss": ploss.detach(), "multimodal": float(multimodal.float().mean())}  # fmt: skip

    result = train_with_args(head, optimizer, step_fn, args, generator)
    head.eval()
    save_model(head, args.out, storage=args.storage)  # loaded in the target's dtype
    heads = {"": (head, vision)}
    if text_head is not None:  # the stage-1 text head on the same rows, for comparison
        heads["init_"] = (text_head, False)
    metrics = held_out_metrics(heads, model, processor, data, held, pad_id)
    logger.info("held-out metrics: %s", metrics)
    write_model_card(
        args.out,
        title=f"Vision-aware EAGLE head ({args.policy}) for {args.target} (SmolLM2-135M-Instruct LLaVA)",
        description=__doc__.split("\n\n", 1)[1],
        model=head,
        data=f"{args.data}: {len(data['input_ids'])} target answers, online teacher; held back for the metrics: "
        + ", ".join(f"{len(rows)} {name.replace('_', '-')}" for name, rows in held.items()),
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(result, metrics, {} if covered is None else {"draft_vocab_coverage": covered}),
        extra={
            "policy": args.policy,
            "policy_kwargs": policy_kwargs(args),
            "init": args.init,
            "curriculum": {"text_steps": text_steps, "ramp_steps": ramp_steps},
            **({} if text_head is None else {"init_metrics": INIT_NOTE}),
        },  # fmt: skip
        history=result.history,
    )
    return head
