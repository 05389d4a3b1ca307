"""The shipped zoo's pipelines and their main methods, as one call each: what `mmspec bench gpu` (section
``zoo``) times and `mmspec bench profile` counts.

Pipelines (`ZOO_PIPELINES`): ``ar-image`` (LlamaGen c2i, `mnist-c2i`), ``t2i`` (LlamaGen t2i, `mnist-t2i`), both
through `SpeculativeARImagePipeline`; ``janus`` (`SpeculativeJanusPipeline`, `mnist-janus`); ``vlm``
(`SpeculativeVLMPipeline`, `mnist-vlm` and its drafter folders); ``mar`` (`SpeculativeContinuousARPipeline`,
`mnist-mar` with `mnist-mar-draft`). Methods per pipeline (`METHODS`): the image presets of `mmspec.methods.PRESETS`
(those whose drafter the zoo has: `available_methods`), the VLM rows of `mmspec bench vlm` (plain, draft-model, eagle
and the vision-aware heads), MAR's plain and CSpD (block mode).

Every call is one pipeline call on `batch` items with the item-i condition ``i % 10`` (a digit class, a digit
prompt, a held-out canvas) and per-call seeded generators; image pipelines return tokens / latents (no VQ decode).
The pipelines need diffusers: `build` raises ImportError where it is missing (`mmspec bench gpu` records the rows
as skipped).
"""

from pathlib import Path

import torch

from mmspec.methods import PRESETS


__all__ = ["METHODS", "ZOO_PIPELINES", "ZooRun", "available_methods", "build"]

ZOO_PIPELINES = ("ar-image", "t2i", "janus", "vlm", "mar")
VLM_METHODS = ("plain", "draft-model", "eagle", "vispec", "specvlm", "msd")
MAR_METHODS = ("plain", "cspd")
METHODS = {"ar-image": tuple(PRESETS), "t2i": tuple(PRESETS), "janus": tuple(PRESETS), "vlm": VLM_METHODS,
           "mar": MAR_METHODS}  # fmt: skip
# the zoo folder(s) each pipeline's target needs
TARGET_FOLDERS = {"ar-image": "mnist-c2i", "t2i": "mnist-t2i", "janus": "mnist-janus", "vlm": "mnist-vlm",
                  "mar": "mnist-mar"}  # fmt: skip
VLM_FOLDERS = {"draft-model": "mnist-vlm-draft", "eagle": "mnist-vlm-eagle", "vispec": "mnist-vlm-vispec",
               "specvlm": "mnist-vlm-specvlm", "msd": "mnist-vlm-msd"}  # fmt: skip
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def available_methods(pipeline: str, zoo) -> tuple[str, ...]:
    """The methods of `pipeline` whose drafter folders exist in `zoo` (no model loads; no diffusers needed)."""
    from mmspec.methods import resolve_drafter

    zoo = Path(zoo)
    if pipeline == "vlm":
        return tuple(m for m in VLM_METHODS if m == "plain" or (zoo / VLM_FOLDERS[m]).is_dir())
    if pipeline == "mar":
        return MAR_METHODS if (zoo / "mnist-mar-draft").is_dir() else ("plain",)
    if pipeline == "janus":
        have = set()  # Janus drafts for itself: the training-free presets only
    else:
        from mmspec.models import zoo_folders

        have = set(zoo_folders(zoo, kind="c2i" if pipeline == "ar-image" else "t2i"))
    out = []
    for name, preset in PRESETS.items():
        try:
            resolve_drafter(preset["acceptance"], preset.get("drafter"), have)
        except ValueError:
            continue
        out.append(name)
    return tuple(out)


class ZooRun:
    """One pipeline of the zoo, ready to call: `call(method, batch, seed) -> output` (its `.stats` a `SpecStats`).

    Attributes:
        pipeline: the `ZOO_PIPELINES` name; methods: the methods it runs; pipes: method -> pipeline object (the VLM's
        vision-aware heads each have their own, sharing the target); device: where it runs.
    """

    def __init__(self, pipeline, methods, pipes, device, call):
        self.pipeline, self.methods, self.pipes, self.device, self._call = (
            pipeline,
            tuple(methods),
            pipes,
            device,
            call,
        )

    def call(self, method, batch, seed=0):
        if method not in self.methods:
            raise ValueError(f"method {method!r} is not one of {self.pipeline}'s {self.methods}")
        return self._call(method, batch, seed)

    def target_module(self, method):
        """The target's main `nn.Module` (what compile captures)."""
        pipe = self.pipes[method]
        for name in ("transformer", "model"):
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                return module
        return None


def _image_kwargs(method):
    return dict(PRESETS[method])


def build(pipeline, zoo, device="cpu", methods=None, max_new_tokens=16, num_ar_steps=16, num_inference_steps=None):
    """Load `pipeline` from `zoo` on `device` for `methods` (default: `available_methods`). `max_new_tokens`: the
    VLM's answer length; `num_ar_steps` / `num_inference_steps`: MAR's schedule (diffusion head steps: the
    pipeline's default when None). Raises ImportError without diffusers, ValueError for an unknown name."""
    if pipeline not in ZOO_PIPELINES:
        raise ValueError(f"pipeline {pipeline!r}: use one of {ZOO_PIPELINES}")
    methods = tuple(methods or available_methods(pipeline, zoo))
    unknown = sorted(set(methods) - set(METHODS[pipeline]))
    if unknown:
        raise ValueError(f"methods {unknown} are not methods of {pipeline} ({METHODS[pipeline]})")
    device = torch.device(device)
    zoo = Path(zoo)

    def gen(seed):
        return torch.Generator(device).manual_seed(seed)

    if pipeline in ("ar-image", "t2i"):
        from mmspec.pipelines import SpeculativeARImagePipeline

        pipe = SpeculativeARImagePipeline.from_zoo(zoo, kind="c2i" if pipeline == "ar-image" else "t2i").to(device)
        pipe.set_progress_bar_config(disable=True)

        def call(method, batch, seed):
            cond = (dict(class_labels=[i % 10 for i in range(batch)]) if pipeline == "ar-image"
                    else dict(prompt=[f"a handwritten {DIGITS[i % 10]}" for i in range(batch)]))  # fmt: skip
            return pipe(generator=gen(seed), output_type="tokens", **cond, **_image_kwargs(method))

        return ZooRun(pipeline, methods, dict.fromkeys(methods, pipe), device, call)
    if pipeline == "janus":
        from mmspec.pipelines import SpeculativeJanusPipeline

        pipe = SpeculativeJanusPipeline.from_pretrained(str(zoo / "mnist-janus")).to(device)
        pipe.set_progress_bar_config(disable=True)

        def call(method, batch, seed):
            prompts = [f"a handwritten {DIGITS[i % 10]}" for i in range(batch)]
            return pipe(prompt=prompts, generator=gen(seed), output_type="tokens", **_image_kwargs(method))

        return ZooRun(pipeline, methods, dict.fromkeys(methods, pipe), device, call)
    if pipeline == "mar":
        from mmspec.pipelines import SpeculativeContinuousARPipeline

        pipe = SpeculativeContinuousARPipeline.from_zoo(zoo).to(device)
        pipe.set_progress_bar_config(disable=True)
        common = dict(num_ar_steps=num_ar_steps, num_inference_steps=num_inference_steps, output_type="latent")
        kwargs = {"plain": {}, "cspd": dict(acceptance="continuous", verify_mode="block")}

        def call(method, batch, seed):
            gens = [gen(seed + i) for i in range(batch)]
            return pipe([i % 10 for i in range(batch)], generator=gens, **common, **kwargs[method])

        return ZooRun(pipeline, methods, dict.fromkeys(methods, pipe), device, call)
    # vlm
    from mmspec.data.canvases import held_out_canvases
    from mmspec.models import load
    from mmspec.pipelines import SpeculativeVLMPipeline

    pipe = SpeculativeVLMPipeline.from_zoo(zoo).to(device)
    pipe.set_progress_bar_config(disable=True)
    pipes = {m: pipe for m in methods if m in ("plain", "draft-model", "eagle")}
    for name in methods:
        if name not in pipes:  # a vision-aware head on the same target, processor and draft LM
            head = load(zoo / VLM_FOLDERS[name], dtype=pipe.model.dtype).to(device)
            pipes[name] = type(pipe)(pipe.model, pipe.processor, draft_model=pipe.draft_model, eagle_head=head)
            pipes[name].set_progress_bar_config(disable=True)
    greedy = dict(acceptance="greedy")
    kwargs = {"plain": dict(acceptance="none"), "draft-model": dict(greedy, drafter="model", num_draft_tokens=4)}
    kwargs |= {
        m: dict(greedy, drafter="eagle", tree_depth=6, tree_top_k=1) for m in ("eagle", "vispec", "specvlm", "msd")
    }
    canvases = []

    def call(method, batch, seed):
        while len(canvases) < batch:
            canvases[:] = held_out_canvases(max(batch, 8), 0, 4)
        return pipes[method](images=canvases[:batch], prompt=["Describe the image."] * batch, output_type="ids",
                             max_new_tokens=max_new_tokens, **kwargs[method])  # fmt: skip

    return ZooRun(pipeline, methods, pipes, device, call)
