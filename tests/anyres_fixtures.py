"""Tiny any-resolution LLaVA models for the tiling tests: a random `LlavaNextForConditionalGeneration` and
`LlavaOnevisionForConditionalGeneration` (CLIP / SigLIP towers, 32 px base tiles, grid pinpoints up to 64 x 64) with
their processors, on `vlm_fixtures`' word-level tokenizer. An image becomes the base tile's tokens plus its
high-resolution tiles' (unpadded, with a newline token per row): the count depends on the image's size."""

import torch
from qwen_vl_fixtures import images_only
from transformers import CLIPVisionConfig, SiglipVisionConfig
from vlm_fixtures import CHAT, ready, text_config, tiny_tokenizer


KINDS = ("llava_next", "llava_onevision")
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]
VIDEO_TOKEN, VIDEO_TOKEN_ID = "w56", 60  # OneVision's video placeholder: a word no test prompt uses


def tiny_anyres(kind="llava_next", layers=2, seed=0):
    """A random any-res LLaVA of `kind` (`KINDS`), eval mode, EOS 2."""
    import transformers

    torch.manual_seed(seed)
    # CLIP drops its CLS token ("default"); SigLIP has none ("full")
    strategy = "default" if kind == "llava_next" else "full"
    common = dict(text_config=text_config(layers), image_token_id=3, vision_feature_select_strategy=strategy,
                  vision_feature_layer=-1, image_grid_pinpoints=PINPOINTS)  # fmt: skip
    if kind == "llava_next":
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=32, patch_size=8, num_channels=3)  # fmt: skip
        model = transformers.LlavaNextForConditionalGeneration(transformers.LlavaNextConfig(vision_config=vision,
                                                                                            **common))  # fmt: skip
    elif kind == "llava_onevision":
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=32, patch_size=8, num_channels=3)  # fmt: skip
        config = transformers.LlavaOnevisionConfig(vision_config=vision, video_token_id=VIDEO_TOKEN_ID, **common)
        model = transformers.LlavaOnevisionForConditionalGeneration(config)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return ready(model)


def processor(kind="llava_next"):
    """The model's processor (images only: OneVision's video processor needs torchvision, not installed here)."""
    import transformers

    if kind == "llava_next":
        images = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size=32,
                                                         image_grid_pinpoints=PINPOINTS)  # fmt: skip
        return transformers.LlavaNextProcessor(image_processor=images, tokenizer=tiny_tokenizer(), patch_size=8,
                                               vision_feature_select_strategy="default", image_token="<image>",
                                               num_additional_image_tokens=1, chat_template=CHAT)  # fmt: skip

    images = transformers.LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32},
                                                          image_grid_pinpoints=PINPOINTS)  # fmt: skip
    return images_only(transformers.LlavaOnevisionProcessor)(image_processor=images, tokenizer=tiny_tokenizer(), video_processor=None, patch_size=8,
                      vision_feature_select_strategy="full", image_token="<image>", video_token=VIDEO_TOKEN,
                      num_image_tokens=16, chat_template=CHAT)  # fmt: skip
