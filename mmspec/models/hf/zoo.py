"""The offline VLM target of the zoo (`assets/mnist-vlm`): a transformers `LlavaForConditionalGeneration` whose
language model is the frozen SmolLM2-135M-Instruct (`mmspec.models.hf.smollm2`, never copied into assets/) with a small
trained CLIP vision tower (64x64 images, 8x8 patches) and LLaVA's projector: 64 image tokens per image.

The image placeholder is SmolLM2's existing special token `<empty_output>` (id 16), so the vocabulary stays 49,152
tokens and drafters share it. A model folder holds `config.json` (the `LlavaConfig`, text_config = SmolLM2's),
`vision_projector.safetensors` (vision tower + projector, keys `vision_tower.*` / `multi_modal_projector.*`, float16
by default) and the `LlavaProcessor` files (tokenizer, CLIP image processor, chat template).

Examples:
    >>> model, processor = load_vlm("mnist-vlm")
    >>> messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    >>> prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    >>> inputs = processor(images=[image], text=[prompt], return_tensors="pt")  # 64 x id 16 in input_ids
    >>> out = model.generate(**inputs, max_new_tokens=64, do_sample=False)
"""

import logging
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

__all__ = ["IMAGE_TOKEN", "IMAGE_TOKEN_ID", "WEIGHTS_NAME", "build_vlm", "load_vlm", "save_vlm_parts", "vlm_config"]

IMAGE_TOKEN = "<empty_output>"
IMAGE_TOKEN_ID = 16
WEIGHTS_NAME = "vision_projector.safetensors"
PATCH = 8  # the vision tower's patch side (a 32x32 canvas cell is 4x4 patches)
PARTS = ("vision_tower", "multi_modal_projector")
ZOO_ROOT = Path(__file__).resolve().parents[3] / "assets"

# SmolLM2's ChatML template (same default system prompt) with list contents: {"type": "image"} -> the placeholder
# (expanded to 64 tokens by the processor) followed by a newline, {"type": "text"} -> its text.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '" + IMAGE_TOKEN + "\\n' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def vlm_config(text_config, hidden_size: int = 192, layers: int = 4, heads: int = 6, image_size: int = 64):
    """`LlavaConfig`: CLIP vision tower (`image_size` square, patch 8, 3 channels) + gelu projector into `text_config`
    (SmolLM2): (image_size / 8)^2 image tokens (64 for the 2x2 canvases, 256 for the 128x128 readout grids)."""
    if image_size % PATCH:
        raise ValueError(f"image_size={image_size}: must be a multiple of the patch size {PATCH}")
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(
        image_size=image_size,
        patch_size=PATCH,
        num_channels=3,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        projection_dim=hidden_size,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_id=IMAGE_TOKEN_ID,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=(image_size // PATCH) ** 2,
        tie_word_embeddings=text_config.tie_word_embeddings,
    )


def build_processor(tokenizer, image_size: int = 64):
    """`LlavaProcessor`: `image_size` square CLIP preprocessing (grayscale -> RGB, [0, 1] -> [-1, 1], no crop effect)
    + tokenizer."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def build_vlm(config, language_model, init: bool = True):
    """`LlavaForConditionalGeneration(config)` with `language_model`'s (a `LlamaForCausalLM`) weights, frozen.

    `init=False` skips the random initialisation (for loaders that overwrite every weight afterwards).
    """
    import contextlib

    from transformers import LlavaForConditionalGeneration
    from transformers.initialization import no_init_weights

    with contextlib.nullcontext() if init else no_init_weights():
        model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(language_model.model.state_dict(), strict=True)
    if config.text_config.tie_word_embeddings:
        model.lm_head.weight = model.model.language_model.embed_tokens.weight
    else:
        model.lm_head.load_state_dict(language_model.lm_head.state_dict(), strict=True)
    model.model.language_model.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    return model


def parts_state_dict(model) -> dict[str, torch.Tensor]:
    """The trained parts' weights, keys `vision_tower.*` and `multi_modal_projector.*`."""
    return {f"{part}.{k}": v for part in PARTS for k, v in getattr(model.model, part).state_dict().items()}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_vlm_parts(model, processor, folder, storage: str = "float16", tokenizer: bool = True) -> Path:
    """Write `config.json`, `WEIGHTS_NAME` (vision tower + projector, stored as `storage`: float32, float16, int8
    or int4, see `mmspec.models.storage`; the LM's low-rank factors, if it has them (`mmspec.models.hf.low_rank`),
    int8 in an int4 file) and the processor files; `tokenizer=False` leaves out the tokenizer files (1.6 MB):
    `load_vlm` then uses SmolLM2's own tokenizer, which the frozen LM comes with."""
    from mmspec.models.hf.low_rank import CONFIG_KEY, low_rank_state
    from mmspec.models.storage import write_weights

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach() for k, v in parts_state_dict(model).items()}
    factors = low_rank_state(model.model.language_model)
    if bool(factors) != (getattr(model.config, CONFIG_KEY, None) is not None):
        raise ValueError(f"the model's config.{CONFIG_KEY} and its language model's low-rank factors disagree "
                         f"({len(factors)} factors): set it to the settings `add_low_rank` was given")  # fmt: skip
    model.config.save_pretrained(folder)
    write_weights(state | factors, folder / WEIGHTS_NAME, storage, int8_prefixes=("language_model.",))
    processor.save_pretrained(folder)
    if not tokenizer:
        for name in TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
    return folder


def processor_without_tokenizer(folder: Path, tokenizer):
    """The `LlavaProcessor` of a folder saved with `tokenizer=False`: `build_processor(tokenizer)` at the folder's
    image size, checked against the folder's own `processor_config.json` and chat template (a ValueError naming the
    file where they differ: the folder was not made by `save_vlm_parts`)."""
    import json

    path = folder / "processor_config.json"
    try:
        saved = json.loads(path.read_text())
        size = int(saved["image_processor"]["crop_size"]["height"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{str(path)!r}: not a zoo VLM processor config ({err})") from err
    processor = build_processor(tokenizer, image_size=size)
    built = json.loads(processor.to_json_string())
    for key, value in saved.items():
        if key != "image_processor" and built.get(key) != value:
            raise ValueError(f"{str(path)!r}: {key}={value!r}, but the zoo processor has {built.get(key)!r}")
    for key, value in saved["image_processor"].items():
        if built["image_processor"].get(key) != value:
            raise ValueError(f"{str(path)!r}: image_processor.{key}={value!r}, but the zoo processor has "
                             f"{built['image_processor'].get(key)!r}")  # fmt: skip
    template = folder / "chat_template.jinja"
    if template.is_file() and template.read_text() != CHAT_TEMPLATE:
        raise ValueError(f"{str(template)!r} differs from the zoo's chat template")
    return processor


def resolve_folder(folder) -> Path:
    """A model folder, or a zoo name (`mnist-vlm` -> `assets/mnist-vlm` of this repository)."""
    path = Path(folder)
    if path.is_dir():
        return path
    if (ZOO_ROOT / str(folder)).is_dir():
        return ZOO_ROOT / str(folder)
    raise FileNotFoundError(f"{str(folder)!r} is neither a folder nor a zoo name under {ZOO_ROOT}")


def read_parts(path: Path, model) -> dict[str, torch.Tensor]:
    """Read and check `path` against the model's vision tower + projector (+ the LM's low-rank factors its config
    names); ValueError naming the file if it does not fit."""
    from mmspec.models.hf.low_rank import CONFIG_KEY, low_rank_shapes
    from mmspec.models.storage import read_weights

    state = read_weights(path)  # ValueError naming the file if it is damaged; int8 / int4 storage dequantised
    expected = {k: tuple(v.shape) for k, v in parts_state_dict(model).items()}
    settings = getattr(model.config, CONFIG_KEY, None)
    if settings is not None:
        try:
            expected |= low_rank_shapes(model.model.language_model, settings)
        except ValueError as err:
            raise ValueError(f"{str(path.parent / 'config.json')!r}: {err}") from None
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{str(path)!r} does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{str(path)!r}: {key} has shape {tuple(state[key].shape)}, expected {shape}")
        if not state[key].is_floating_point() or not torch.isfinite(state[key]).all():
            raise ValueError(f"{str(path)!r}: {key} is not a finite floating-point tensor")
    return state


def load_vlm(folder="mnist-vlm", dtype: torch.dtype = torch.float32, device=None):
    """`(LlavaForConditionalGeneration in eval mode, LlavaProcessor)` from a model folder or zoo name.

    SmolLM2-135M-Instruct (`load_smollm2`) fills the language model and lm_head; `WEIGHTS_NAME` fills the vision
    tower and projector (strict: every key present, shapes checked; ValueError naming the file otherwise) and, for a
    config with `lm_low_rank`, the LM's low-rank factors, merged into its weights (`mmspec.models.hf.low_rank`).
    """
    from transformers import LlavaConfig, LlavaProcessor

    from mmspec.models.hf import low_rank
    from mmspec.models.hf.smollm2 import load_smollm2

    folder = resolve_folder(folder)
    config = LlavaConfig.from_pretrained(folder)
    language_model, tokenizer = load_smollm2()
    model = build_vlm(config, language_model, init=False)
    state = read_parts(folder / WEIGHTS_NAME, model)
    for part in PARTS:
        prefix = part + "."
        sub = {k[len(prefix) :]: v.float() for k, v in state.items() if k.startswith(prefix)}
        getattr(model.model, part).load_state_dict(sub, strict=True)
    if getattr(config, low_rank.CONFIG_KEY, None) is not None:  # an adapted LM: its factors merged once
        low_rank.merge_low_rank(model.model.language_model, getattr(config, low_rank.CONFIG_KEY), state,
                                str(folder / WEIGHTS_NAME))  # fmt: skip
    model.to(dtype).eval()
    if device is not None:
        model.to(device)
    if next(model.parameters()).device.type == "cpu":  # cheap multi-token forwards on CPU BLAS (`layout`)
        from mmspec.models.layout import input_major_linears

        input_major_linears(model)  # the tied embedding / output head stays one tensor
    if (folder / "tokenizer.json").is_file():
        processor = LlavaProcessor.from_pretrained(folder)
    else:  # saved with tokenizer=False: SmolLM2's own
        processor = processor_without_tokenizer(folder, tokenizer)
    return model, processor
