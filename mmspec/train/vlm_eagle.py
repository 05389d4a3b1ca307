"""EAGLE head for the VLM zoo: `python -m mmspec.train vlm-eagle --target assets/mnist-vlm
--data runs/vlm-answers.pt --out runs/vlm-eagle`.

EAGLE-1/2 recipe (Li et al. 2024) on the target's own answers (`mmspec.train vlm-answers`): the frozen target's
final-norm features `h` over prompt (image tokens included) + answer are computed once and cached
(`<out>/features.pt`, resumable by chunks); the head (`mmspec.models.hf.eagle.TextEagleHead`) sees pairs
`(h[i], x[i+1])` and regresses `h[i+1]`:

    loss = sum_j decay^j [ SmoothL1(f_j[i], h[i+1]) + p_weight * soft-CE(p_target(x[i+2]), q_draft(f_j[i])) ]

over answer positions, with `--unroll` training-time-test steps `j` (the head fed its own features, attending as
at inference; EAGLE-3 / HASS) and uniform input-feature noise. The soft cross-entropy goes through the target's
49,152-way output head, so it is taken at `--ce-positions` random answer positions per row.
"""

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.cli.args import int_in_range, non_negative_float
from mmspec.train.common import (
    add_common_arguments,
    card_metrics,
    check_run_flags,
    configure_threads,
    declare_paths,
    load_checkpoint,
    run_flags,
    save_model,
    seed_everything,
    size_int,
    train_with_args,
    write_model_card,
    zoo_folder,
)


logger = logging.getLogger(__name__)


def add_arguments(parser):
    add_common_arguments(parser, steps=600, batch_size=4, lr=5e-4, warmup_steps=50, checkpoint_every=100, threads=2)
    add_vlm_data_arguments(parser)
    parser.add_argument("--eval-items", type=size_int, default=32, help="held-back answers for the metrics")
    parser.add_argument("--p-weight", type=non_negative_float, default=0.5)
    add_head_loss_arguments(parser, "tokens the head scores (most frequent in the answers; 0 = the full vocabulary)")


def add_vlm_data_arguments(parser, data_help="`vlm-answers` output"):
    """--target (the VLM zoo folder) and --data (the `vlm-answers` file) of the vlm-draft / vlm-eagle / vlm-vision
    tasks, both checked before any work."""
    parser.add_argument("--target", default=zoo_folder("mnist-vlm"),
                        help="the VLM: a zoo folder (default: the shipped) or your own transformers VLM folder "
                             "(mmspec.models.hf.vlm_folder)")  # fmt: skip
    parser.add_argument("--data", default="runs/vlm-answers.pt", help=data_help)
    declare_paths(parser, model_folders=("target",), input_files=("data",))


def check_vlm_target(parser, args, zoo_only=None):
    """Usage error (before any model loads) unless `--target` is a VLM folder (`vlm_folder.check_vlm_folder`: the
    zoo's or a transformers VLM); `zoo_only`: the reason a task takes the zoo's VLMs only, or None."""
    from mmspec.models.hf.vlm_folder import ZOO, check_vlm_folder

    try:
        kind = check_vlm_folder(args.target)
    except ValueError as err:
        parser.error(f"argument --target: {err}")
    if zoo_only and kind != ZOO:
        parser.error(f"argument --target: {str(args.target)!r} is not a zoo VLM folder; {zoo_only}")


def check_args(parser, args):
    """Usage errors before any model loads: a `--target` that is not a VLM folder (`check_vlm_target`)."""
    check_vlm_target(parser, args)


def add_head_loss_arguments(parser, draft_vocab_help):
    """The EAGLE-head training flags vlm-eagle and vlm-vision share: --noise, --unroll, --step-decay, --ce-positions
    (`eagle_text_losses`) and --draft-vocab (`draft_vocabulary`)."""
    parser.add_argument("--noise", type=non_negative_float, default=0.05, help="uniform input-feature noise")
    parser.add_argument("--unroll", type=size_int, default=3, help="training-time-test steps")
    parser.add_argument("--step-decay", type=non_negative_float, default=0.8)
    parser.add_argument("--ce-positions", type=size_int, default=24, help="soft-CE positions per row and step")
    parser.add_argument("--draft-vocab", type=int_in_range(0, 1 << 20), default=2048, help=draft_vocab_help)


def draft_vocabulary(ids, weight, size, eos):
    """The `size` most frequent answer tokens (`ids [N, T]` where `weight`), EOS always in, the remainder by
    ascending id. Returns `(sorted ids [size], share of the answer tokens they cover)`."""
    counts = torch.bincount(ids[weight], minlength=int(ids.max()) + 1).double()
    rank = counts.clone()
    rank[eos] = counts.max() + 1
    order = torch.sort(-rank, stable=True).indices[:size]
    return order.sort().values, float(counts[order].sum() / counts.sum().clamp(min=1))


def set_draft_vocabulary(head, ids, weight, size, eos):
    """Give `head` the FR-Spec draft vocabulary of `size` tokens (`draft_vocabulary` of the training answers `ids`,
    `weight`); returns the share of answer tokens it covers, None when `size` is 0 (the full vocabulary)."""
    if not size:
        return None
    vocab, covered = draft_vocabulary(ids, weight, size, eos)
    head.set_draft_vocab(vocab)
    logger.info("draft vocabulary: %d tokens covering %.4f of the training answer tokens", size, covered)
    return covered


def frozen_target(args):
    """The common start of a head's training run: threads, seed, the `--data` record, the `--target` VLM with its
    parameters frozen, the `--out` folder. Returns `(generator, data, model, processor)`."""
    from mmspec.models.hf.vlm_folder import load_target_vlm

    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    data = load_answer_data(args.data)
    model, processor = load_target_vlm(args.target)
    for p in model.parameters():
        p.requires_grad_(False)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return generator, data, model, processor


def load_answer_data(path):
    """A `vlm-answers` file (`load_checkpoint`), with a `--prompts` run's image files checked once against their
    recorded sha256 (`prompt_file.check_images`: a ValueError naming a moved or changed image before training
    starts, not at the step that first draws its row)."""
    data = load_checkpoint(path)
    if isinstance(data, dict) and "image_files" in data:
        from mmspec.data.prompt_file import check_images

        for files, digests in zip(data["image_files"], data["image_sha256"], strict=True):
            check_images(files, digests)
    return data


def row_images(data, rows):
    """The images of `vlm-answers` rows `rows` (indices) as PIL images, in row order: a drawn workload's canvas per
    row, or a `--prompts` run's image files of each row (none for a text-only row; checked when the file was loaded,
    `load_answer_data`)."""
    if "canvases" not in data:
        from mmspec.data.prompt_file import open_images

        return [im for r in rows for im in open_images(data["image_files"][r])]
    from mmspec.data.canvases import to_pil

    return [to_pil(data["canvases"][r].float() / 255) for r in rows]


def target_inputs(model, processor, ids, lengths, images=None):
    """What the frozen target's base model (`model.model`) takes besides `input_ids` over whole right-padded rows
    `ids [B, T]` (prompt + answer, `lengths [B]`) whose images are `images` (PIL, one per row whose prompt holds one,
    in row order; None: text-only rows), as the pipeline prepares a prompt. Returns `(inputs, layout)`:

    * `inputs`: the attention mask, the image processor's outputs (`pixel_values` in the model's dtype and, by
      class, `image_grid_thw` (Qwen-VL) / `image_sizes` (any-resolution LLaVA)) and, for an M-RoPE target, its own
      3-D `position_ids` over the rows (`mmspec.models.hf.mrope.sequence_inputs`; `[3, B, T]`);
    * `layout`: each row's images by length (`mmspec.models.hf.image_layout.processor_image_layout`, None for a
      fixed-size target), for a vision-aware head's policy."""
    from mmspec.models.hf.image_layout import processor_image_layout
    from mmspec.models.hf.mrope import sequence_inputs

    extra = {}
    if images:
        extra = dict(processor.image_processor(images, return_tensors="pt"))
        extra["pixel_values"] = extra["pixel_values"].to(model.dtype)
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    layout = processor_image_layout(model, processor, ids, extra)
    return {"attention_mask": mask, **sequence_inputs(model, ids, mask, extra)}, layout


def answer_mask(lengths, prompt_lengths, width):
    """`[N, width]` True at answer tokens (`prompt_len <= t < length`)."""
    t = torch.arange(width)[None, :]
    return (t >= prompt_lengths[:, None]) & (t < lengths[:, None])


@torch.no_grad()
def target_features(model, processor, data, path, batch_size=8, quiet=False, inputs=None):
    """Final-norm hidden states `[N, T, dim]` (float16) of the target over every answer sequence, cached at `path`
    (chunks appended; re-running resumes). `inputs`: what the features depend on (the run flags of the target and
    the data, with their hashes), stored in the cache; a cache made from other inputs is refused."""
    from tqdm.auto import tqdm

    path = Path(path)
    done = {"features": [], "inputs": inputs}
    if path.is_file():
        done = load_checkpoint(path)
        if not isinstance(done, dict) or "features" not in done:
            raise ValueError(f"{str(path)!r} is not a target-features cache: delete it (it is rebuilt)")
        if inputs is not None:
            check_run_flags(done.get("inputs"), inputs, path, "--out")
    ids, lengths = data["input_ids"], data["lengths"]
    n = len(ids)
    start = sum(len(f) for f in done["features"])
    for lo in tqdm(range(start, n, batch_size), disable=quiet, desc="target features"):
        hi = min(lo + batch_size, n)
        inputs, _ = target_inputs(model, processor, ids[lo:hi], lengths[lo:hi], row_images(data, range(lo, hi)))
        out = model.model(input_ids=ids[lo:hi], **inputs)
        done["features"].append(out.last_hidden_state.to(torch.float16))
        tmp = path.with_suffix(".partial")
        torch.save(done, tmp)
        tmp.replace(path)
    return torch.cat(done["features"])


def eagle_text_losses(head, target, hidden, ids, weight, *, unroll=1, step_decay=1.0, noise=0.0, ce_positions=None,
                      generator=None, forward_kwargs=None):  # fmt: skip
    """Regression and soft-CE losses of `head` on sequences `ids [B, T]` with target features `hidden [B, T, D]`.

    `weight [B, T]` (bool) marks the tokens whose prediction is trained (answer tokens); output `i` of step `j` (pair
    `(h[i], x[i+1])`) predicts `x[i+2]` from `h[i+1]`, counted where `weight[:, i + 2]` and `i >= j`.
    `forward_kwargs` (a dict) go to `head.forward_unrolled` as keyword arguments (a vision-aware head's
    `inputs_embeds`, `image_mask`, `prompt_lengths`, its own `generator`: `mmspec.train.vlm_vision`).
    Returns `(vloss, ploss)`."""
    hidden = hidden.float()
    b, t, _ = hidden.shape
    inp = hidden[:, :-1]
    if noise:
        inp = inp + (torch.rand(inp.shape, generator=generator) * 2 - 1) * noise
    outs = head.forward_unrolled(inp, ids[:, 1:], target, unroll, **(forward_kwargs or {}))
    goal = hidden[:, 1:]  # [B, T-1, D]
    w = torch.cat([weight[:, 2:], weight.new_zeros(b, 1)], dim=1).float()  # [B, T-1]
    vloss = ploss = 0.0
    norm = 0.0
    for j, f in enumerate(outs):
        wj = w.clone()
        wj[:, :j] = 0
        denom = wj.sum().clamp(min=1)
        vloss = vloss + step_decay**j * (F.smooth_l1_loss(f, goal, reduction="none").mean(-1) * wj).sum() / denom
        # soft CE at a few weighted positions per row (the 49k-way head is the expensive part)
        scores = torch.rand(wj.shape, generator=generator) + wj * 2  # weighted positions first, random order
        k = min(ce_positions or t, t - 1)
        pick = scores.topk(k, dim=1).indices  # [B, k]
        keep = wj.gather(1, pick)  # [B, k]
        gather = pick[:, :, None].expand(b, k, f.shape[-1])
        with torch.no_grad():  # the target's law renormalised on the head's draft vocabulary
            p = torch.softmax(head.draft_logits(target, goal.gather(1, gather)), -1)
        logq = torch.log_softmax(head.draft_logits(target, f.gather(1, gather)), -1)
        ploss = ploss + step_decay**j * (-(p * logq).sum(-1) * keep).sum() / keep.sum().clamp(min=1)
        norm += step_decay**j
    return vloss / norm, ploss / norm


@torch.no_grad()
def evaluate_text_head(head, target, hidden, ids, weight, steps=3, forward_kwargs=None):
    """Held-out greedy agreement: `top1_step{j}` = how often the head's argmax after `j` own steps equals the
    target's argmax (the token greedy decoding emits), over answer positions (`forward_kwargs`: as
    `eagle_text_losses`)."""
    outs = head.forward_unrolled(hidden[:, :-1].float(), ids[:, 1:], target, steps, **(forward_kwargs or {}))
    goal = target.get_output_embeddings()(hidden[:, 1:].float()).argmax(-1)
    w = torch.cat([weight[:, 2:], weight.new_zeros(hidden.shape[0], 1)], dim=1)
    metrics = {}
    for j, f in enumerate(outs):
        wj = w.clone()
        wj[:, :j] = False
        pred = head.compute_logits(target, f).argmax(-1)
        metrics[f"top1_step{j}"] = float(((pred == goal) & wj).sum() / wj.sum().clamp(min=1))
    return metrics


def run(args):
    from mmspec.models.hf.eagle import TextEagleHead

    generator, data, model, processor = frozen_target(args)
    flags = run_flags(args)
    features = target_features(model, processor, data, Path(args.out) / "features.pt", quiet=args.quiet,
                               inputs={k: flags[k] for k in ("target", "data")})  # fmt: skip
    ids, lengths, prompt_lengths = data["input_ids"], data["lengths"], torch.tensor(data["prompt_lengths"])
    weight = answer_mask(lengths, prompt_lengths, ids.shape[1])
    n_eval = min(args.eval_items, len(ids) // 4)
    train_idx = torch.arange(n_eval, len(ids))
    size = min(args.draft_vocab, model.get_output_embeddings().weight.shape[0])
    head = TextEagleHead.from_target(model, draft_vocab_size=size)
    head.init_weights(generator=generator)
    covered = set_draft_vocabulary(head, ids[n_eval:], weight[n_eval:], size, processor.tokenizer.eos_token_id)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def step_fn(step):
        idx = train_idx[torch.randint(len(train_idx), (args.batch_size,), generator=generator)]
        width = int(lengths[idx].max())
        vloss, ploss = eagle_text_losses(head, model, features[idx, :width], ids[idx, :width], weight[idx, :width],
                                         unroll=args.unroll, step_decay=args.step_decay, noise=args.noise,
                                         ce_positions=args.ce_positions, generator=generator)  # fmt: skip
        return {"loss": vloss + args.p_weight * ploss, "vloss": vloss.detach(), "ploss": ploss.detach()}

    result = train_with_args(head, optimizer, step_fn, args, generator)
    head.eval()
    save_model(head, args.out, storage=args.storage)  # loaded in the target's dtype
    width = int(lengths[:n_eval].max())
    metrics = evaluate_text_head(head, model, features[:n_eval, :width], ids[:n_eval, :width], weight[:n_eval, :width])
    logger.info("held-out metrics: %s", metrics)
    write_model_card(
        args.out,
        title=f"EAGLE head for {args.target} (SmolLM2-135M-Instruct LLaVA)",
        description=__doc__.split("\n\n", 1)[1],
        model=head,
        data=f"{args.data}: {len(ids)} target answers ({n_eval} held back for the metrics)",
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(result, metrics, {"draft_vocab_coverage": covered}),
        history=result.history,
    )
    return head
