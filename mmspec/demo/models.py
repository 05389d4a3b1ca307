"""The demo's pipelines: loaded lazily (on the first request that needs one), once per process, shared by every
user (`PipelineCache`).

A tab is one of `TABS`: `"c2i"` / `"t2i"` (`SpeculativeARImagePipeline.from_zoo(kind=...)`), `"continuous"`
(`SpeculativeContinuousARPipeline.from_zoo`) and `"vlm"` (`SpeculativeVLMPipeline.from_zoo`), all from one zoo
folder (default: the shipped zoo); or a single saved pipeline folder (`model_index.json`), which serves the one tab
of its class.
"""

import json
import logging
import threading
from pathlib import Path

from mmspec.models import DEFAULT_ZOO


logger = logging.getLogger(__name__)

__all__ = ["TABS", "PipelineCache", "folder_tab", "zoo_tabs"]

TABS = ("c2i", "t2i", "continuous", "vlm")
# tab -> zoo folders it needs (drafters are optional)
ZOO_NEEDS = {"c2i": ("mnist-c2i", "mnist-vq"), "t2i": ("mnist-t2i", "mnist-vq"),
             "continuous": ("mnist-mar", "mnist-kl"), "vlm": ("mnist-vlm",)}  # fmt: skip
PIPELINE_CLASSES = {"SpeculativeARImagePipeline": None, "SpeculativeContinuousARPipeline": "continuous",
                    "SpeculativeVLMPipeline": "vlm"}  # fmt: skip


def zoo_tabs(zoo):
    """The tabs a zoo folder can serve (those whose folders exist with a `config.json`), in `TABS` order."""
    return [tab for tab in TABS if all((Path(zoo) / name / "config.json").is_file() for name in ZOO_NEEDS[tab])]


def folder_tab(folder):
    """The tab a saved pipeline folder serves, from its `model_index.json` (no weights read). ValueError naming the
    folder if it is not a pipeline folder of one of the three pipelines."""
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        raise ValueError(f"{str(folder)!r} is not a saved pipeline folder (no model_index.json)")
    try:
        name = json.loads(index.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(index)!r} is not valid JSON ({err})") from None
    if name not in PIPELINE_CLASSES:
        raise ValueError(f"{str(index)!r} names {name!r}; the demo serves {sorted(PIPELINE_CLASSES)}")
    if PIPELINE_CLASSES[name] is not None:
        return PIPELINE_CLASSES[name]
    config = Path(folder) / "transformer" / "config.json"
    try:
        kind = json.loads(config.read_text()).get("model_type", "c2i")
    except (OSError, json.JSONDecodeError, AttributeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(config)!r}: cannot read the transformer's config ({err})") from None
    if kind not in ("c2i", "t2i"):
        raise ValueError(f"{str(config)!r}: model_type must be 'c2i' or 't2i', got {kind!r}")
    return kind


class PipelineCache:
    """Pipelines by tab, each built on first use and kept for the life of the process (thread-safe).

    Args:
        zoo: zoo folder (default `mmspec.models.DEFAULT_ZOO`), or
        pipeline_folder: a saved pipeline folder (then only its tab is served).
        device: torch device of every pipeline.
    """

    def __init__(self, zoo=None, pipeline_folder=None, device="cpu"):
        if zoo is not None and pipeline_folder is not None:
            raise ValueError("pass zoo or pipeline_folder, not both")
        self.zoo = None if pipeline_folder is not None else str(DEFAULT_ZOO if zoo is None else zoo)
        self.pipeline_folder = None if pipeline_folder is None else str(pipeline_folder)
        self.device = device
        self.tabs = [folder_tab(pipeline_folder)] if pipeline_folder is not None else zoo_tabs(self.zoo)
        self._pipes = {}
        self._lock = threading.Lock()
        self.loads = 0  # pipelines built so far (each tab at most once)

    def get(self, tab):
        """The pipeline of `tab` (loaded now if this is the first request)."""
        if tab not in self.tabs:
            source = self.pipeline_folder or self.zoo
            raise ValueError(f"the {tab!r} tab is not served from {source!r} (available: {self.tabs})")
        with self._lock:
            if tab not in self._pipes:
                logger.info("loading the %s pipeline from %s", tab, self.pipeline_folder or self.zoo)
                pipe = self._load(tab).to(self.device)
                self._warm_up(tab, pipe)
                self._pipes[tab] = pipe
                self.loads += 1
            return self._pipes[tab]

    def _warm_up(self, tab, pipe):
        """One tiny plain call, so the first user's plain-vs-speculative timing does not pay one-off start-up costs
        (kernel selection, lazy allocations) on the plain side only."""
        import torch

        generator = torch.Generator(pipe.device).manual_seed(0)
        if tab == "c2i":
            pipe(class_labels=[0], acceptance="none", generator=generator)
        elif tab == "t2i":
            pipe(prompt=["a one"], acceptance="none", generator=generator)
        elif tab == "continuous":
            pipe([0], acceptance="none", num_ar_steps=4, generator=generator)
        else:
            from PIL import Image

            pipe(images=Image.new("RGB", (64, 64)), prompt="Hi", max_new_tokens=2, acceptance="none")

    def _load(self, tab):
        from mmspec.pipelines import (
            SpeculativeARImagePipeline,
            SpeculativeContinuousARPipeline,
            SpeculativeVLMPipeline,
        )

        classes = {"c2i": SpeculativeARImagePipeline, "t2i": SpeculativeARImagePipeline,
                   "continuous": SpeculativeContinuousARPipeline, "vlm": SpeculativeVLMPipeline}  # fmt: skip
        if self.pipeline_folder is not None:
            return classes[tab].from_pretrained(self.pipeline_folder)
        if tab in ("c2i", "t2i"):
            return classes[tab].from_zoo(self.zoo, kind=tab)
        return classes[tab].from_zoo(self.zoo)
