"""Tiny random Janus models for the Janus tests: a `JanusForConditionalGeneration` built from a small `JanusConfig`
(Llama text model, tiny SigLIP-style vision tower, small VQ with a 4 x 4 token grid) and an offline processor (a
word-level tokenizer with Janus' special tokens and a chat template, `JanusImageProcessor`, `JanusProcessor`)."""

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    JanusConfig,
    JanusForConditionalGeneration,
    JanusImageProcessorPil,
    JanusProcessor,
    LlamaConfig,
    PreTrainedTokenizerFast,
)


BOS, PAD, IMAGE, BOI, EOI = "<bos>", "<pad>", "<image>", "<boi>", "<eoi>"
SPECIALS = [PAD, BOS, IMAGE, BOI, EOI]  # ids 0..4
WORDS = [f"w{i}" for i in range(40)] + ["User:", "Assistant:"]
PAD_ID, BOS_ID, IMAGE_ID, BOI_ID = 0, 1, 2, 3
CHAT = (
    "{% for m in messages %}"
    "{% if m['content'] is string %}{{ m['role'] }}: {{ m['content'] }}"
    "{% else %}{{ m['role'] }}: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)
GRID = 4  # VQ token grid: 4 x 4 = 16 image tokens
CODEBOOK = 32  # image-token vocabulary


def tiny_tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    vocab.update({"user:": len(vocab), "assistant:": len(vocab) + 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, pad_token=PAD, padding_side="left",
                                   extra_special_tokens={"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI})  # fmt: skip


def tiny_config(layers=2, text_vocab=64):
    text = LlamaConfig(vocab_size=text_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       initializer_range=0.3, bos_token_id=BOS_ID, pad_token_id=PAD_ID, eos_token_id=4)  # fmt: skip
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=GRID,
                  projection_dim=64, depth=1, num_image_tokens=GRID * GRID, mlp_ratio=2.0)  # fmt: skip
    vq = dict(embed_dim=8, num_embeddings=CODEBOOK, latent_channels=32, base_channels=32, channel_multiplier=[1, 2],
              num_res_blocks=1, projection_dim=64, image_token_embed_dim=64, num_hidden_layers=1)  # fmt: skip
    return JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=IMAGE_ID)


def tiny_janus(layers=2, seed=0, head_scale=8.0, spread=1.0):
    """A random tiny Janus (eval, float32).

    `head_scale` multiplies the generation head (random heads are near-uniform: 8 makes greedy rows differ, about 1
    gives laws to sample from); `spread` sets how far the image-token input embeddings lie from one shared vector
    (small: the next token depends mostly on the prompt, so Jacobi drafts get accepted)."""
    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(tiny_config(layers)).eval()
    with torch.no_grad():
        model.model.generation_head.vision_head.weight.mul_(head_scale)
        embeddings = model.model.generation_embeddings.weight
        embeddings.normal_(0, 1.0).mul_(spread).add_(torch.randn(embeddings.shape[1]))
    g = model.generation_config
    g.bos_token_id, g.pad_token_id = BOS_ID, PAD_ID
    g.generation_kwargs = {"boi_token_id": BOI_ID}
    return model


def tiny_processor():
    image_processor = JanusImageProcessorPil(
        size={"height": 16, "width": 16}, min_size=4, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )  # as Janus-Pro
    return JanusProcessor(image_processor=image_processor, tokenizer=tiny_tokenizer(), chat_template=CHAT,
                          num_image_tokens=GRID * GRID)  # fmt: skip


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{i}" for i in rng.integers(0, 40, int(rng.integers(1, 7)))) for _ in range(n)]


def prompt_ids(n, seed=0):
    """Left-padded image-mode prompts as the processor makes them: `(input_ids [n, L], attention_mask [n, L])`."""
    enc = tiny_processor()(text=prompts(n, seed), generation_mode="image", padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]
