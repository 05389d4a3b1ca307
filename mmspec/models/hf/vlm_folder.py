"""A VLM target from a folder: the zoo's (`zoo.load_vlm`) or your own transformers VLM (Qwen2.5-VL, Qwen3-VL,
LLaVA, LLaVA-Next, LLaVA-OneVision, ... saved with `save_pretrained`), with its processor.

The trainers' `--target` (`python -m mmspec.train vlm-answers / vlm-eagle3 / vlm-eagle / vlm-vision`) reads it, so
that a drafter for your VLM trains with the same commands as the zoo's. A transformers folder loads with
transformers' own classes only (`mmspec.models.load`: local files, `trust_remote_code=False`, safetensors weights)
and its processor likewise (`AutoProcessor`). A processor whose video half needs a library that is not installed
(Qwen-VL's and LLaVA-OneVision's video processors need torchvision) is rebuilt for images only from the folder's
image processor, tokenizer, chat template and `processor_config.json` settings: the images and prompts it makes are
the full processor's. So is one for which `AutoProcessor` returns a bare tokenizer (an unknown processor class).

`check_vlm_folder` reads only `config.json` (no torch model built), so the CLIs call it before anything loads.
"""

from __future__ import annotations

import json
from pathlib import Path


__all__ = ["ZOO", "TRANSFORMERS", "check_vlm_folder", "load_processor", "load_target_vlm", "text_config"]

ZOO, TRANSFORMERS = "zoo", "transformers"


def check_vlm_folder(folder) -> str:
    """`ZOO` for an mmspec zoo VLM folder (its vision tower and projector in `zoo.WEIGHTS_NAME`), `TRANSFORMERS` for a
    transformers folder whose `config.json` names an image-text-to-text model type that transformers knows.

    Raises:
        ValueError: naming the folder: no readable `config.json`, an mmspec model folder of another kind, or a model
            type that is not a VLM (a plain causal LM has no images to draft for).
    """
    from mmspec.models.hf.zoo import WEIGHTS_NAME

    folder = _resolved(folder)
    if (folder / WEIGHTS_NAME).is_file():
        return ZOO
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{str(folder)!r}: no readable config.json ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r}: not a JSON object")
    if "_class_name" in config:
        raise ValueError(f"{str(folder)!r} is an mmspec {config['_class_name']} folder, not a VLM")
    from transformers.models.auto import modeling_auto

    model_type = config.get("model_type")
    if model_type not in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise ValueError(f"{str(folder)!r}: model_type {model_type!r} is not a vision-language model transformers "
                         "knows (an image-text-to-text model type, e.g. qwen2_5_vl, qwen3_vl, llava, "
                         "llava_onevision)")  # fmt: skip
    return TRANSFORMERS


def _resolved(folder) -> Path:
    """`folder` as a path; a zoo name (`mnist-vlm`, as `load_vlm` takes it) as its folder under the zoo."""
    from mmspec.models.hf.zoo import ZOO_ROOT

    folder = Path(folder)
    return ZOO_ROOT / str(folder) if not folder.is_dir() and (ZOO_ROOT / str(folder)).is_dir() else folder


def text_config(folder) -> dict:
    """The language model's config of a VLM folder checked by `check_vlm_folder` (its `config.json`'s `text_config`,
    or the config itself where it has none), read as JSON: no model loads."""
    config = json.loads((_resolved(folder) / "config.json").read_text())
    text = config.get("text_config") or config
    return text if isinstance(text, dict) else {}


def load_processor(folder, model_type: str):
    """The folder's processor (`AutoProcessor`, local files, no remote code); when its video processor cannot load
    for a missing library, the model type's processor class built for images only (the folder's image processor,
    tokenizer and chat template, no video processor). ValueError naming the folder when neither loads."""
    import inspect

    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    folder = str(folder)
    local = dict(local_files_only=True, trust_remote_code=False)
    try:
        processor = transformers.AutoProcessor.from_pretrained(folder, **local)
    except ImportError as err:  # a video processor whose library (torchvision) is not installed
        missing = err
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{folder!r}: cannot load its processor ({err})") from err
    else:
        if hasattr(processor, "image_processor"):
            return processor
        # AutoProcessor falls back to the bare tokenizer when it cannot tell the processor class: images would be
        # dropped without a word, so build the model type's processor instead
        missing = ValueError(f"AutoProcessor gave a {type(processor).__name__}, which takes no images")
    base = getattr(transformers, PROCESSOR_MAPPING_NAMES.get(model_type, ""), None)
    if base is None or "video_processor" not in inspect.signature(base.__init__).parameters:
        raise ValueError(f"{folder!r}: cannot load its processor ({missing})") from missing
    try:
        images = transformers.AutoImageProcessor.from_pretrained(folder, **local)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **local)
    except (OSError, ValueError, KeyError, ImportError) as err:
        raise ValueError(f"{folder!r}: cannot load its image processor / tokenizer ({err})") from err
    template = _chat_template(Path(folder)) or getattr(tokenizer, "chat_template", None)
    return _images_only(base)(image_processor=images, tokenizer=tokenizer, video_processor=None, chat_template=template,
                              **_processor_kwargs(Path(folder), base))  # fmt: skip


def _processor_kwargs(folder: Path, base) -> dict:
    """The processor's own settings saved in the folder's `processor_config.json` (e.g. LLaVA-OneVision's
    `vision_feature_select_strategy`, `image_token`, `num_image_tokens`) that `base` takes: without them the
    rebuilt processor would expand the image placeholders differently from the full one."""
    import inspect

    path = folder / "processor_config.json"
    if not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{str(path)!r}: not a JSON file ({err})") from err
    taken = set(inspect.signature(base.__init__).parameters) - {"self", "image_processor", "tokenizer",
                                                                  "video_processor", "chat_template"}  # fmt: skip
    return {k: v for k, v in saved.items() if k in taken and not isinstance(v, dict)}


def _chat_template(folder: Path):
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        try:
            return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{str(folder / 'chat_template.json')!r}: not a chat template file ({err})") from err
    return None


def _images_only(base):
    """`base` (a processor class with a video processor) accepting `video_processor=None`."""

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = f"{base.__name__}ImagesOnly"
    return ImagesOnly


def load_target_vlm(folder, dtype=None):
    """`(model in eval mode, processor)` of a VLM folder (`check_vlm_folder`): the zoo's through `zoo.load_vlm`, a
    transformers one through `mmspec.models.load` and `load_processor`. `dtype`: default float32."""
    import torch

    from mmspec.models.hf.zoo import load_vlm

    dtype = dtype or torch.float32
    if check_vlm_folder(folder) == ZOO:
        return load_vlm(folder, dtype=dtype)
    from mmspec.models.loading import load

    model = load(folder, dtype=dtype)
    return model, load_processor(folder, model.config.model_type)
