"""Tiny transformers models for the VLM pipeline tests: a word-level tokenizer with a ChatML template, a random
Llama causal LM, a random LLaVA (CLIP vision tower) with its processor, and drafters for them."""

import numpy as np
import PIL.Image
import torch
from factories import digest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)


SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<image>"]
WORDS = [f"w{i}" for i in range(57)] + ["user", "assistant", "system"]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_TOKENS = 16  # 32 x 32 image, 8 x 8 patches


def tiny_tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>", "<image>"])  # fmt: skip
    fast.chat_template = CHAT
    return fast


def text_config(layers=2, vocab=64):
    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True, initializer_range=0.3, eos_token_id=2, pad_token_id=0, bos_token_id=1)  # fmt: skip


def tiny_lm(layers=2, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(text_config(layers)).eval()


def tiny_llava(layers=2, seed=0):
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8, num_channels=3)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text_config(layers), image_token_id=3,
                         vision_feature_select_strategy="default", vision_feature_layer=-1)  # fmt: skip
    return ready(LlavaForConditionalGeneration(config))


def ready(model):
    """`model` in eval mode with the fixtures' EOS (2) and pad (0) ids in its generation config."""
    model.eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model


def tiny_processor():
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tiny_tokenizer(), patch_size=8,
                          vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1, chat_template=CHAT)  # fmt: skip


def images(n, seed=0):
    rng = np.random.default_rng(seed)
    return [PIL.Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(n)]


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{i}" for i in rng.integers(0, 56, int(rng.integers(2, 9)))) for _ in range(n)]


def chat(prompt, image=True):
    content = [{"type": "image"}, {"type": "text", "text": prompt}] if image else prompt
    return [{"role": "user", "content": content}]


def hf_greedy(model, processor, image, prompt, max_new_tokens):
    """transformers' own greedy `generate` for one prompt (stops at EOS; the EOS is kept)."""
    is_vlm = image is not None
    text = processor.apply_chat_template(chat(prompt, is_vlm), add_generation_prompt=True, tokenize=False)
    enc = (
        processor(images=[image], text=[text], return_tensors="pt")
        if is_vlm
        else processor([text], return_tensors="pt")
    )
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, enc["input_ids"].shape[1] :].tolist()


_FITTED_HEADS = {}  # train_tiny_head's key -> (head state, global RNG state after fitting): once per process


def train_tiny_head(pipe, ims, texts, steps=150, max_new_tokens=24, seed=0):
    """A `TextEagleHead` fitted in a few seconds on the target's own greedy continuations (so EAGLE drafts get
    accepted and multi-token commits are exercised).

    Fitted once per process for each (target weights, config and EOS ids, encoded inputs, steps, max_new_tokens,
    seed): later calls get a new head with the fitted weights, and the global RNG left as fitting leaves it (fitting
    seeds it), so a caller sees what a fresh fit gives."""
    from mmspec.models.hf.eagle import TextEagleHead

    model = pipe.model
    ids, lengths, extra = pipe.encode(ims, texts, None, "cpu")
    generation = getattr(model, "generation_config", None)
    key = digest(type(model).__name__, model.config.to_json_string(), generation and generation.to_json_string(),
                 model.state_dict(), pipe.eos_token_ids(), ids, lengths, extra, steps, max_new_tokens, seed)  # fmt: skip
    if key not in _FITTED_HEADS:
        head = _fit_tiny_head(pipe, ims, texts, steps, max_new_tokens, seed)
        _FITTED_HEADS[key] = {k: v.clone() for k, v in head.state_dict().items()}, torch.get_rng_state()
        return head
    state, rng = _FITTED_HEADS[key]
    with torch.random.fork_rng():
        head = TextEagleHead.from_target(model, initializer_range=0.05)
    head.load_state_dict(state)
    torch.set_rng_state(rng)
    return head.eval()


def _fit_tiny_head(pipe, ims, texts, steps, max_new_tokens, seed):
    from mmspec.models.hf.eagle import TextEagleHead
    from mmspec.models.hf.mrope import sequence_inputs
    from mmspec.train.vlm_eagle import eagle_text_losses

    model = pipe.model
    out = pipe(images=ims, prompt=texts, max_new_tokens=max_new_tokens, acceptance="none", output_type="ids")
    ids, lengths, extra = pipe.encode(ims, texts, None, "cpu")
    rows, weights = [], []
    for r in range(len(texts)):
        placeholders = {getattr(model.config, n, None) for n in ("image_token_id", "video_token_id")} - {None}
        answer = [0 if t in placeholders else t for t in out.sequences[r].tolist() if t >= 0]  # a generated
        # image / video placeholder would be taken for an image slot by the model's forward
        rows.append(ids[r, : lengths[r]].tolist() + answer)
        weights.append([False] * int(lengths[r]) + [True] * len(answer))
    width = max(len(r) for r in rows)
    seq = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    weight = torch.tensor([w + [False] * (width - len(w)) for w in weights])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    extra = sequence_inputs(model, seq, mask, extra)  # Qwen-VL: 3-D positions over prompt + answer
    with torch.no_grad():
        hidden = model.model(input_ids=seq, attention_mask=mask, **extra).last_hidden_state
    torch.manual_seed(seed)
    head = TextEagleHead.from_target(model, initializer_range=0.05)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        v, p = eagle_text_losses(head, model, hidden, seq, weight, unroll=2, generator=g)
        (v + p).backward()
        opt.step()
    return head.eval()


def llava_pipe_with_heads(with_draft=True):
    """The 4-layer tiny LLaVA in a pipeline with (optionally) its 3-layer truncated draft LM and an EAGLE head fitted
    on 9 canvases (`images(8) + images(1, seed=5)`)."""
    from mmspec.models.hf.draft import truncated_draft
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    target = tiny_llava(4, seed=1)
    draft = truncated_draft(target, 3) if with_draft else None
    pipe = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=draft)
    pipe.set_progress_bar_config(disable=True)
    ims, texts = images(8) + images(1, seed=5), prompts(8) + prompts(1, seed=5)
    pipe.register_modules(eagle_head=train_tiny_head(pipe, ims, texts))
    return pipe


def quick_eagle_pipe():
    """(pipe, canvases): the 4-layer tiny LLaVA with an EAGLE head fitted in 30 steps on 4 canvases (`images(4,
    seed=7)`, prompt "w1 w2") -- enough for the bench's rows, which need a head, not a good one."""
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    pipe = SpeculativeVLMPipeline(tiny_llava(4, seed=1), tiny_processor())
    pipe.set_progress_bar_config(disable=True)
    canvases = images(4, seed=7)
    pipe.register_modules(eagle_head=train_tiny_head(pipe, canvases, ["w1 w2"] * 4, steps=30))
    return pipe, canvases


def random_vision_head(text_head, target, policy, seed=0, num_queries=3, ratio=4, img_scale=0.05):
    """A `VisionEagleHead` for `target` with `text_head`'s fc / layer and random policy weights (ViSpec: `img_fc`
    random, `img_scale`, on the image vector too, so the global vector changes the drafts)."""
    from mmspec.drafters.vision_eagle import VisionEagleHead

    g = torch.Generator().manual_seed(seed)
    head = VisionEagleHead.from_target(target, vision_policy=policy, num_queries=num_queries, ratio=ratio)
    with torch.no_grad():
        for p in head.vision.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        head.load_text_head(text_head)
        if hasattr(head, "img_fc"):
            dim = head.config.hidden_size
            head.img_fc.weight[:, dim:] = torch.randn(dim, dim, generator=g) * img_scale
    return head.eval()
