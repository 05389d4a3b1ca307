"""Stand-ins for the README's online blocks (`<!-- readme-test: online -->`, see test_readme.py): the pipeline's
`from_pretrained` of a hub id reads a tiny random model of the same class, saved in the working directory, after the
id went through the pipeline's own checks and aliases (only the download is replaced)."""

from pathlib import Path

from janus_fixtures import tiny_janus, tiny_processor

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
