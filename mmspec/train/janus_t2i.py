"""Train a small transformers Janus text-to-image model on MNIST: `python -m mmspec.train janus-t2i
--data runs/mnist-codes.pt --out assets/mnist-janus`.

Model: the real `transformers.JanusForConditionalGeneration` from a small `JanusConfig` -- text: Llama (`--n-layer`
x `--dim`, `--n-head` heads, SwiGLU width `--intermediate-size`), vocabulary = the word-level tokenizer of
`mmspec.models.janus.processor`; vision: the tiniest valid SigLIP tower (1 layer, width 16; unused for t2i, present
because the class builds it); VQ: the shipped LlamaGen VQ (`--vq`, default `assets/mnist-vq`) converted by
`mmspec.models.janus.vq` (frozen; 8x8 grid, 256 codes, `vision_config.num_image_tokens` = 64); generation
embeddings / aligner / head at the text width.

Data: the tokenized-MNIST file of `python -m mmspec.train tokenize` (codes [N, 64] from the same VQ) and its captions
file (`mmspec.train.captions`, shared with the `t2i` task; built on the first run when missing): per image
`--prompts-per-image` prompts such as "a thick handwritten seven".

Input per example exactly as `generate(generation_mode="image")` builds it: the processor's image-mode prompt (chat
template + `<begin_of_image>`, left-padded to the longest prompt with an attention mask) as token embeddings, then
the image tokens through `model.prepare_embeddings_for_image_generation`; loss = cross-entropy of
`model.model.generation_head` on the language model's last hidden states at the positions that predict image token i
from the prompt and tokens < i. Caption dropout `--class-dropout` (0.1): the prompt becomes the unconditional prompt
`generate` uses for CFG (every prompt token but BOS and BOI replaced by the pad token, same attention mask).
AdamW on the language model and the generation modules (the VQ, the vision tower, its aligner stay at their
values), warmup + cosine.

At the end: held-out NLL (first prompt of each `--eval-split` image, and the unconditional prompt), then
`--sample-size` held-out prompts (an equal number per digit) sampled with plain CFG
`model.generate(generation_mode="image", guidance_scale=--guidance-scale, do_sample=True)`, decoded by the model's
VQ and classified with the zoo classifier: `sample_accuracy` (fraction classified as the named digit);
`sample_eval.json` and `samples.png` (one row per digit). The folder is a plain transformers Janus folder
(`JanusForConditionalGeneration.from_pretrained`, `JanusProcessor.from_pretrained`), weights in float16.
"""

import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.cli.args import positive_float, probability
from mmspec.train.captions import add_caption_arguments, ensure_captions, split_rows
from mmspec.train.common import (
    add_common_arguments,
    card_metrics,
    configure_threads,
    count_int,
    count_parameters,
    declare_paths,
    not_run_defining,
    random_batch_indices,
    seed_everything,
    size_int,
    train_and_save,
    write_model_card,
    zoo_folder,
)
from mmspec.train.gpt import add_data_arguments, load_data
from mmspec.train.t2i import eval_prompts, save_grid


logger = logging.getLogger(__name__)


def add_arguments(parser):
    add_common_arguments(parser, steps=800, batch_size=64, lr=1e-3, warmup_steps=50, checkpoint_every=50, threads=1)
    parser.set_defaults(weight_decay=0.05)
    add_data_arguments(parser)
    add_caption_arguments(parser)
    parser.add_argument("--vq", default=zoo_folder("mnist-vq"), help="LlamaGen VQ folder of the codes (converted)")
    parser.add_argument("--dim", type=size_int, default=256, help="text (Llama) hidden size")
    parser.add_argument("--n-layer", type=size_int, default=4, help="Llama layers")
    parser.add_argument("--n-head", type=size_int, default=4, help="attention heads")
    parser.add_argument("--intermediate-size", type=size_int, default=512, help="Llama SwiGLU width")
    parser.add_argument("--class-dropout", type=probability, default=0.1, help="probability of the CFG null prompt")
    parser.add_argument("--classifier", default=zoo_folder("mnist-classifier"), help="classifier for the evaluation")
    declare_paths(parser, model_folders=("vq", "classifier"))
    parser.add_argument("--sample-size", type=count_int, default=100, help="images sampled at the end (0: none)")
    parser.add_argument("--guidance-scale", type=positive_float, default=2.0, help="CFG scale of the evaluation")
    parser.add_argument("--sample-batch-size", type=size_int, default=100)
    not_run_defining(parser, "classifier", "sample_size", "guidance_scale", "sample_batch_size")


def check_args(parser, args):
    """Usage errors before any data loads."""
    if args.dim % args.n_head:
        parser.error(f"argument --n-head: --dim {args.dim} is not divisible by --n-head {args.n_head}")
    if (args.dim // args.n_head) % 2:
        parser.error(
            f"argument --n-head: the head width --dim/--n-head = {args.dim // args.n_head} must be even (RoPE)"
        )


# ----------------------------------------------------------------------------- model
def build_janus(processor, vq, *, dim=256, n_layer=4, n_head=4, intermediate_size=512, max_positions=128):
    """A `JanusForConditionalGeneration` with a small Llama, the tiniest SigLIP tower and `vq` (a `LlamaGenVQ`)
    converted and loaded (frozen). Its `generation_config` carries BOS / pad / BOI for `generate`."""
    from transformers import (
        GenerationConfig,
        JanusConfig,
        JanusForConditionalGeneration,
        JanusVisionConfig,
        LlamaConfig,
    )

    from mmspec.models.janus.vq import janus_vq_from_llamagen

    tok = processor.tokenizer
    vq_config, vq_state = janus_vq_from_llamagen(vq, projection_dim=dim, image_token_embed_dim=dim,
                                                 num_hidden_layers=2, hidden_act="gelu")  # fmt: skip
    size = vq.config["sample_size"]
    patch = size // vq_config.num_patches
    text = LlamaConfig(vocab_size=len(tok), hidden_size=dim, intermediate_size=intermediate_size,
                       num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
                       max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    vision = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=1, mlp_ratio=1.0,
                               num_channels=vq.config["in_channels"], image_size=size, patch_size=patch,
                               projection_dim=dim, depth=1,
                               num_image_tokens=vq_config.num_patches**2)  # fmt: skip
    config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq_config,
                         image_token_id=tok.convert_tokens_to_ids(tok.image_token))  # fmt: skip
    model = JanusForConditionalGeneration(config)
    model.model.vqmodel.load_state_dict(vq_state)
    model.model.vqmodel.requires_grad_(False)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        generation_kwargs={"boi_token_id": tok.convert_tokens_to_ids(tok.boi_token)},
        guidance_scale=2.0,
        do_sample=True,
    )
    return model


def trainable_parameters(model):
    """The language model and the generation modules (embeddings, aligner, head)."""
    inner = model.model
    modules = (inner.language_model, inner.generation_embeddings, inner.generation_aligner, inner.generation_head)
    return [p for m in modules for p in m.parameters()]


def encode_prompts(processor, prompts):
    """(input ids `[P, L]`, attention mask `[P, L]`) of the image-mode inputs of `prompts` (left-padded)."""
    from mmspec.models.janus.processor import image_prompts

    out = processor(text=image_prompts(processor, prompts), generation_mode="image", padding=True,
                    return_tensors="pt")  # fmt: skip
    unknown = (out["input_ids"] == processor.tokenizer.unk_token_id).any(1)
    if bool(unknown.any()):
        raise ValueError(f"prompt {prompts[int(unknown.nonzero()[0, 0])]!r} has words the tokenizer does not know")
    return out["input_ids"], out["attention_mask"]


def unconditional(ids, bos_id, boi_id, pad_id):
    """The CFG null prompt of `generate(generation_mode="image")`: every token but BOS and BOI -> pad."""
    keep = (ids == bos_id) | (ids == boi_id)
    return torch.where(keep, ids, torch.full_like(ids, pad_id))


def image_logits(model, prompt_ids, prompt_mask, codes):
    """Generation-head logits `[B, N, V]`: position i predicts image token i from the prompt and tokens < i."""
    text = model.get_input_embeddings()(prompt_ids)
    image = model.prepare_embeddings_for_image_generation(codes[:, :-1])
    embeds = torch.cat([text, image.to(text.dtype)], 1)
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(codes.shape[0], codes.shape[1] - 1)], 1)
    position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
    hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids,
                                        use_cache=False).last_hidden_state  # fmt: skip
    start = prompt_ids.shape[1] - 1
    return model.model.generation_head(hidden[:, start : start + codes.shape[1]])


@torch.no_grad()
def evaluate_nll(model, prompt_ids, prompt_mask, codes, special, batch_size=250):
    """Held-out per-token NLL (nats) with the prompts and with the CFG null prompt, and bits per image."""
    model.eval()
    out = {}
    for name, null in (("nll", False), ("nll_uncond", True)):
        total = 0.0
        for i in range(0, len(codes), batch_size):
            ids, m, x = prompt_ids[i : i + batch_size], prompt_mask[i : i + batch_size], codes[i : i + batch_size]
            if null:
                ids = unconditional(ids, *special)
            logits = image_logits(model, ids, m, x)
            total += float(
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x.reshape(-1), reduction="sum")
            )
        out[name] = total / max(codes.numel(), 1)
    out["bits_per_image"] = out["nll"] * codes.shape[1] / math.log(2)
    return out


@torch.no_grad()
def generate_images(model, processor, prompts, guidance_scale, seed, batch_size=100):
    """Plain CFG sampling with `model.generate(generation_mode="image")` -> (tokens `[B, N]`, images `[B, C, H, W]`
    in [-1, 1]). `generate` samples with the global RNG: it is seeded with `seed` first (`torch.manual_seed`)."""
    from mmspec.models.janus.processor import image_prompts

    model.eval()
    torch.manual_seed(seed)
    tokens, images = [], []
    for i in range(0, len(prompts), batch_size):
        batch = processor(text=image_prompts(processor, prompts[i : i + batch_size]), generation_mode="image",
                          padding=True, return_tensors="pt")  # fmt: skip
        out = model.generate(**batch, generation_mode="image", guidance_scale=guidance_scale, do_sample=True)
        tokens.append(out)
        images.append(model.decode_image_tokens(out).permute(0, 3, 1, 2).float().clamp(-1, 1))
    return torch.cat(tokens), torch.cat(images)


def evaluate_samples(model, processor, captions, args):
    """Sample `args.sample_size` held-out prompts; classifier accuracy on the named digit; writes `sample_eval.json`
    and `samples.png` into `args.out`. Returns the metrics."""
    from mmspec.models import load

    generator = torch.Generator().manual_seed(args.seed + 12345)
    pids, _ = eval_prompts(captions, args.eval_split, args.sample_size, generator)
    prompts = [captions["prompts"][int(p)] for p in pids]
    classifier = load(args.classifier).eval()
    start = time.perf_counter()
    _, images = generate_images(model, processor, prompts, args.guidance_scale, args.seed + 12345,
                                args.sample_batch_size)  # fmt: skip
    wall = time.perf_counter() - start
    preds = classifier.predict(images)
    digits = captions["prompt_digit"][pids]
    correct = preds == digits
    accuracy = float(correct.float().mean())
    per_digit = [float(correct[digits == d].float().mean()) if bool((digits == d).any()) else None for d in range(10)]
    logger.info("samples: accuracy %.3f (per digit %s, %.0f s)", accuracy, per_digit, wall)
    show = min(10, -(-args.sample_size // 10))
    rows = torch.cat([(digits == d).nonzero()[:show, 0] for d in range(10)])
    out = Path(args.out)
    save_grid(images[rows], out / "samples.png", show)
    record = {
        "method": 'plain CFG sampling: JanusForConditionalGeneration.generate(generation_mode="image", do_sample=True)',
        "guidance_scale": args.guidance_scale,
        "num_images": len(prompts),
        "prompts_from": f"{args.captions} ({args.eval_split} split images' prompts, {-(-args.sample_size // 10)} "
        "per digit)",
        "sample_accuracy": accuracy,
        "per_digit_accuracy": per_digit,
        "seed": args.seed + 12345,
        "wall_s": wall,
        "grid": "samples.png",
        "grid_prompts": [prompts[int(r)] for r in rows],
        "prompts": prompts,
        "predictions": preds.tolist(),
    }
    (out / "sample_eval.json").write_text(json.dumps(record, indent=2) + "\n")
    return {"sample_accuracy": accuracy, "sample_wall_s": wall}


# ----------------------------------------------------------------------------- task
def run(args):
    from mmspec.models import load
    from mmspec.models.janus.processor import build_janus_processor

    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    codes, labels, eval_codes, _, meta = load_data(args)
    captions = ensure_captions(args)
    vq = load(args.vq)
    if meta.get("codebook_size", vq.config["codebook_size"]) != vq.config["codebook_size"]:
        raise ValueError(f"--data {args.data!r} was not tokenized with --vq {args.vq!r} (codebook sizes differ)")
    train_prompts = captions["prompt_index"][split_rows(captions, args.train_split)]  # [N, K]
    eval_prompt_ids = captions["prompt_index"][split_rows(captions, args.eval_split)][: len(eval_codes), 0]
    if not torch.equal(captions["prompt_digit"][train_prompts[:, 0]], labels):
        raise ValueError(f"captions {args.captions!r} do not match the rows of {args.data!r}")
    processor = build_janus_processor(num_image_tokens=codes.shape[1], image_size=vq.config["sample_size"],
                                      channels=vq.config["in_channels"], templates=captions["templates"])  # fmt: skip
    all_ids, all_mask = encode_prompts(processor, captions["prompts"])
    tok = processor.tokenizer
    special = (tok.bos_token_id, tok.convert_tokens_to_ids(tok.boi_token), tok.pad_token_id)
    model = build_janus(processor, vq, dim=args.dim, n_layer=args.n_layer, n_head=args.n_head,
                        intermediate_size=args.intermediate_size,
                        max_positions=all_ids.shape[1] + codes.shape[1])  # fmt: skip
    params = trainable_parameters(model)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))  # fmt: skip
    per_image = train_prompts.shape[1]

    def step_fn(step):
        model.train()
        idx = random_batch_indices(len(codes), args.batch_size, generator)
        col = torch.randint(per_image, (args.batch_size,), generator=generator)
        drop = torch.rand(args.batch_size, generator=generator) < args.class_dropout
        pids = train_prompts[idx, col]
        ids, mask = all_ids[pids], all_mask[pids]
        ids = torch.where(drop[:, None], unconditional(ids, *special), ids)
        x = codes[idx]
        logits = image_logits(model, ids, mask, x)
        return {"loss": F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))}

    result, saved = train_and_save(model, optimizer, step_fn, args, generator)
    processor.save_pretrained(args.out)
    metrics = evaluate_nll(saved, all_ids[eval_prompt_ids], all_mask[eval_prompt_ids], eval_codes, special)
    logger.info("%s metrics: %s", args.eval_split, metrics)
    sample_metrics = evaluate_samples(saved, processor, captions, args) if args.sample_size else {}
    write_model_card(
        args.out,
        title=f"MNIST text-to-image Janus (transformers JanusForConditionalGeneration, Llama {args.n_layer}L/"
        f"{args.dim}, {codes.shape[1]} image tokens)",
        description=(
            "The real `transformers.JanusForConditionalGeneration` (small `JanusConfig`: Llama text model with the "
            f"word-level prompt tokenizer of `mmspec.models.janus.processor` ({len(tok)} tokens), the tiniest SigLIP "
            "vision tower (unused for text-to-image), the shipped LlamaGen VQ `assets/mnist-vq` converted to "
            "`JanusVQVAE` by `mmspec.models.janus.vq` (frozen)) trained from scratch on VQ token grids of MNIST "
            f"conditioned on prompts such as {captions['prompts'][0]!r} (chat template + `<begin_of_image>`, exactly "
            'the input of `generate(generation_mode="image")`). Caption dropout '
            f"{args.class_dropout} to the CFG null prompt of `generate` (every prompt token but BOS and BOI -> pad). "
            f"Held-out NLL: per-token (nats) on the first {len(eval_codes)} `{args.eval_split}` items with their "
            "first prompt and with the null prompt. Sample metrics: see `sample_eval.json`. Load with "
            "`JanusForConditionalGeneration.from_pretrained` / `JanusProcessor.from_pretrained` (offline)."
        ),
        model=None,  # the card's config dump reads diffusers configs; the transformers config is config.json
        data=(
            f"{args.data} ({args.train_split}: {len(codes)} items; VQ {meta.get('vq', '?')}) + {args.captions} "
            f"({len(captions['prompts'])} unique prompts, {per_image} per image)"
        ),
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(result, (f"{args.eval_split}_", metrics), sample_metrics),
        extra={
            "parameters": count_parameters(saved),
            "model_class": type(saved).__name__,
            "trainable_parameters": sum(p.numel() for p in params),
            "tokenizer_size": len(tok),
            "prompt_tokens": int(all_ids.shape[1]),
            "num_prompts": len(captions["prompts"]),
            "captions_sha256": captions["sha256"],
            "vq_sha256": meta.get("vq_sha256", ""),
            "sample_guidance_scale": args.guidance_scale if args.sample_size else None,
        },
        images={"samples.png": "samples for held-out prompts, one row per digit"} if args.sample_size else None,
        history=result.history,
    )
    return saved
