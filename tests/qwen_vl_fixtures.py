"""Tiny Qwen-VL models for the M-RoPE tests: a word-level tokenizer with Qwen's vision tokens and chat template, a
random `Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration` (vision tower, M-RoPE sections,
Qwen3-VL's deepstack), and the matching processor (dynamic resolution: an image of h x w pixels becomes
(h / 8) x (w / 8) merged tokens)."""

import numpy as np
import PIL.Image
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil
from vlm_fixtures import ready


SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
            "<|video_pad|>"]  # fmt: skip
WORDS = [f"w{i}" for i in range(54)] + ["user", "assistant", "system"]
VOCAB = {t: i for i, t in enumerate(SPECIALS + WORDS)}  # 64 tokens
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
KINDS = ("qwen2_5_vl", "qwen3_vl")


def tokenizer():
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=SPECIALS[1:])  # fmt: skip
    fast.chat_template = CHAT
    return fast


def _text(kind, layers=2):
    text = dict(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
                tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, bos_token_id=1)  # fmt: skip
    # head_dim 16: 8 rotary frequency pairs split over (temporal, height, width)
    mrope = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    if kind == "qwen3_vl":
        mrope["mrope_interleaved"] = True
        text.update(head_dim=16)
    text["rope_scaling"] = mrope
    return text


def tiny_qwen_vl(kind="qwen2_5_vl", seed=0, layers=2):
    """A random Qwen-VL of `kind` (`KINDS`) with `layers` decoder layers, eval mode, EOS = `<|im_end|>`."""
    import transformers

    ids = dict(image_token_id=VOCAB["<|image_pad|>"], video_token_id=VOCAB["<|video_pad|>"],
               vision_start_token_id=VOCAB["<|vision_start|>"], vision_end_token_id=VOCAB["<|vision_end|>"])  # fmt: skip
    torch.manual_seed(seed)
    if kind == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, fullatt_block_indexes=[1], window_size=16)  # fmt: skip
        config = transformers.Qwen2_5_VLConfig(text_config=_text(kind, layers), vision_config=vision, tie_word_embeddings=True,
                                               **ids)  # fmt: skip
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    elif kind == "qwen3_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])  # fmt: skip
        config = transformers.Qwen3VLConfig(text_config=_text(kind, layers), vision_config=vision, tie_word_embeddings=True,
                                            **ids)  # fmt: skip
        model = transformers.Qwen3VLForConditionalGeneration(config)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return ready(model)


def processor(kind="qwen2_5_vl"):
    """The model's processor with a tiny image processor (4 px patches, 2 x 2 merge). No video processor: it
    needs torchvision, which this project does not install; images only."""
    import transformers

    base = transformers.Qwen2_5_VLProcessor if kind == "qwen2_5_vl" else transformers.Qwen3VLProcessor
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                   max_pixels=48 * 48)  # fmt: skip
    return images_only(base)(image_processor=images, tokenizer=tokenizer(), video_processor=None, chat_template=CHAT)


def images_only(base):
    """`base` (a transformers processor class with a video processor) accepting `video_processor=None`: the video
    processors need torchvision, which this project does not install."""

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    return ImagesOnly


def images(sizes, seed=0):
    """Random RGB images of the given `(height, width)` sizes (multiples of 8: each is its own grid)."""
    rng = np.random.default_rng(seed)
    return [PIL.Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
