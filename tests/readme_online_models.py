"""Stand-ins for the README's online blocks (`<!-- readme-test: online -->`, see test_readme.py): the pipeline's
`from_pretrained` of a hub id reads a tiny random model of the same class, saved in the working directory, after the
id went through the pipeline's own checks and aliases (only the download is replaced)."""

from pathlib import Path

import transformers
from janus_fixtures import tiny_janus, tiny_processor
from qwen_vl_fixtures import processor as tiny_qwen_processor
from qwen_vl_fixtures import tiny_qwen_vl

from mmspec.pipelines import SpeculativeJanusPipeline
from mmspec.pipelines.janus import HUB_ALIASES


def install(folder="tiny-janus"):
    folder = Path(folder).resolve()
    tiny_janus(spread=0.1).save_pretrained(folder)
    tiny_processor().save_pretrained(folder)
    load_parts = SpeculativeJanusPipeline._load_parts

    def from_hub(name, source, torch_dtype, kwargs, **options):
        if not Path(source).exists():  # a hub id: it must be one transformers can read (an alias target)
            if "/" not in source or source in HUB_ALIASES:
                raise AssertionError(f"the pipeline would download {source!r}, not a transformers Janus conversion")
            source = str(folder)
        return load_parts(name, source, torch_dtype, kwargs, **options)

    SpeculativeJanusPipeline._load_parts = staticmethod(from_hub)
    _install_qwen()


QWEN_ID = "Qwen/Qwen2.5-VL-3B-Instruct"  # the hub id of docs/pipelines.md's Qwen block


def _install_qwen():
    """transformers' own `from_pretrained` of `QWEN_ID` (model and `AutoProcessor`) gives a tiny random Qwen2.5-VL
    (6 decoder layers) and its processor; any other id is refused (it would download)."""
    model_cls = transformers.Qwen2_5_VLForConditionalGeneration

    def model_from_hub(source, *args, dtype=None, torch_dtype=None, **kwargs):
        if source != QWEN_ID:
            raise AssertionError(f"the docs would download {source!r}")
        return tiny_qwen_vl("qwen2_5_vl", seed=1, layers=6).to(dtype or torch_dtype or None)

    def processor_from_hub(source, *args, **kwargs):
        if source != QWEN_ID:
            raise AssertionError(f"the docs would download {source!r}")
        return tiny_qwen_processor("qwen2_5_vl")

    model_cls.from_pretrained = staticmethod(model_from_hub)
    transformers.AutoProcessor.from_pretrained = staticmethod(processor_from_hub)
