"""A tiny EAGLE-3 head fitted in seconds on the tiny LLaVA / LM of `vlm_fixtures` (its own greedy continuations),
so its drafts get accepted and multi-token commits are exercised."""

import functools

import torch
from vlm_fixtures import images, prompts, tiny_llava, tiny_lm, tiny_processor, tiny_tokenizer

from mmspec.models.hf.eagle3 import Eagle3Head
from mmspec.models.hf.inputs import capture_decoder_inputs, capture_layer_inputs
from mmspec.models.hf.mrope import sequence_inputs
from mmspec.pipelines.vlm import SpeculativeVLMPipeline
from mmspec.train.vlm_eagle3 import eagle3_losses


AUX = (1, 2, 3)  # a 4-layer target: the engines' (2, L // 2, L - 3) would repeat layer 2


def rows_of(pipe, ims, texts, max_new_tokens):
    """Prompt + the target's own greedy answer per row: `(ids [B, T], answer mask [B, T], attention mask, extra)`."""
    out = pipe(images=ims, prompt=texts, max_new_tokens=max_new_tokens, acceptance="none", output_type="ids")
    ids, lengths, extra = pipe.encode(ims, texts, None, "cpu")
    placeholders = {getattr(pipe.model.config, n, None) for n in ("image_token_id", "video_token_id")} - {None}
    rows, weights = [], []
    for r in range(len(texts)):
        answer = [0 if t in placeholders else t for t in out.sequences[r].tolist() if t >= 0]
        rows.append(ids[r, : lengths[r]].tolist() + answer)
        weights.append([False] * int(lengths[r]) + [True] * len(answer))
    width = max(len(r) for r in rows)
    seq = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    weight = torch.tensor([w + [False] * (width - len(w)) for w in weights])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return seq, weight, mask, sequence_inputs(pipe.model, seq, mask, extra)  # Qwen-VL: 3-D positions


def fit_eagle3_head(
    pipe, ims, texts, *, image_inputs="placeholder", steps=120, draft_vocab=40, seed=0, aux_layers=AUX
):
    """An `Eagle3Head` (aux layers `aux_layers`, a `draft_vocab`-token draft vocabulary) trained `steps` Adam steps with a
    2-step training-time test on the target's answers to `texts` (and `ims`)."""
    model = pipe.model
    seq, weight, mask, extra = rows_of(pipe, ims, texts, 24)
    with torch.no_grad(), capture_layer_inputs(model, aux_layers) as seen, capture_decoder_inputs(model) as merged:
        hidden = model.model(input_ids=seq, attention_mask=mask, **extra).last_hidden_state
    aux = torch.cat([seen[i] for i in aux_layers], -1)
    embeds = merged["inputs_embeds"] if image_inputs == "embeds" else None
    torch.manual_seed(seed)
    head = Eagle3Head.from_target(model, aux_layers=aux_layers, draft_vocab_size=draft_vocab, image_inputs=image_inputs,
                                  initializer_range=0.05)  # fmt: skip
    counts = torch.bincount(seq[weight], minlength=model.config.get_text_config().vocab_size)
    head.set_draft_vocab(torch.sort(-counts.double(), stable=True).indices[:draft_vocab].sort().values)
    head.init_from_target(model)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        sum(eagle3_losses(head, model, aux, hidden, seq, weight, unroll=2, embeds=embeds,
                          positions=extra.get("position_ids"))).backward()  # fmt: skip
        opt.step()
    return head.eval()


@functools.cache
def eagle3_pipe(kind="llava", image_inputs="placeholder", steps=60, rows=4):
    """The 4-layer tiny LLaVA (or LM) in a pipeline with an EAGLE-3 head fitted on the answers to `images(rows)` /
    `prompts(rows)` (the prompts the tests ask: the point is exercising multi-token commits, not generalisation).
    Made once per process: callers must not change it (build another pipeline on `pipe.model` for other heads)."""
    target = tiny_llava(4, seed=1) if kind == "llava" else tiny_lm(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_processor() if kind == "llava" else tiny_tokenizer())
    pipe.set_progress_bar_config(disable=True)
    ims = images(rows) if kind == "llava" else None
    head = fit_eagle3_head(pipe, ims, prompts(rows), image_inputs=image_inputs, steps=steps)
    pipe.register_modules(eagle_head=head)
    return pipe


def with_image_inputs(head, image_inputs):
    """The same weights in a head whose config says `image_inputs`."""
    twin = Eagle3Head(**{**{k: v for k, v in head.config.items() if not k.startswith("_")},
                         "image_inputs": image_inputs})  # fmt: skip
    twin.load_state_dict(head.state_dict())
    return twin.eval()
