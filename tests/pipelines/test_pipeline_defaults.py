"""Every pipeline on its defaults, exactly as README.md calls it (`from_zoo()` with no dtype, no device, no root;
`from_pretrained(folder)` likewise), issue 31: the weights are float32 on the CPU whatever the zoo folder stores
(every zoo folder stores float16), an image / answer does not depend on the rest of its batch (a ragged batch of
prompts or a batch of labels against each one alone, greedy and sampled with per-row generators), and where the
project promises it, greedy equals transformers' (Janus' `generate(generation_mode="image")`, the VLM's
`generate`). No test here picks a dtype or any other loading setting: the call arguments are the README's.

The Janus tests guard a real failure: the zoo's `mnist-janus/config.json` says `"dtype": "float16"`, which
transformers used when `torch_dtype` was not given, and in float16 CFG amplifies rounding that depends on the batch's
padding layout (rows of a ragged batch differed from the same prompt alone; greedy matched transformers' for only 3
of 6 prompts)."""

import copy

import pytest
import torch

from mmspec.models import DEFAULT_ZOO
from mmspec.pipelines import (
    SpeculativeARImagePipeline,
    SpeculativeContinuousARPipeline,
    SpeculativeJanusPipeline,
    SpeculativeVLMPipeline,
)


# the README's own calls (grep -n "from_zoo\|from_pretrained" README.md); lambdas: loaded on first use only
README_LOADS = {
    "ar_image c2i": lambda: SpeculativeARImagePipeline.from_zoo(),
    "ar_image t2i": lambda: SpeculativeARImagePipeline.from_zoo(kind="t2i"),
    "continuous": lambda: SpeculativeContinuousARPipeline.from_zoo(),
    "janus": lambda: SpeculativeJanusPipeline.from_zoo(),
    "janus folder": lambda: SpeculativeJanusPipeline.from_pretrained(str(DEFAULT_ZOO / "mnist-janus")),
    "vlm": lambda: SpeculativeVLMPipeline.from_zoo(),
}
SLOW_LOADS = {"vlm"}  # SmolLM2-135M: seconds to load, a 0.5 GB save
JANUS_PROMPTS = ["a thick handwritten seven", "the digit 3, slanted to the right", "the number zero",
                 "a thin, left-leaning 0", "an upright zero with regular strokes", "a picture of the digit zero"]  # fmt: skip

_loaded = {}


def loaded(name):
    """The README's pipeline `name`, loaded once per test session (progress bars off)."""
    if name not in _loaded:
        torch.set_num_threads(1)
        pipe = README_LOADS[name]()
        pipe.set_progress_bar_config(disable=True)
        _loaded[name] = pipe
    return _loaded[name]


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def weights(pipe):
    """Every floating parameter and buffer of every model component: `{(component, dtype, device type)}`."""
    found = set()
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            for t in [*component.parameters(), *component.buffers()]:
                if t.is_floating_point():
                    found.add((name, t.dtype, t.device.type))
    return found


def _param(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LOADS else n for n in names]


# ------------------------------------------------------------------ dtype
@pytest.mark.parametrize("name", _param(README_LOADS))
def test_readme_loads_are_float32_on_the_cpu(name):
    found = weights(loaded(name))
    assert found and {(dtype, device) for _, dtype, device in found} == {(torch.float32, "cpu")}, sorted(
        map(str, found)
    )


@pytest.mark.parametrize("name", _param(["ar_image c2i", "continuous", "janus", "vlm"]))
def test_from_pretrained_upcasts_a_float16_pipeline_folder(name, tmp_path):
    """A pipeline folder (`save_pretrained`) that stores float16 loads as float32 on the CPU by default."""
    pipe = copy.deepcopy(loaded(name))  # a copy: half() would round the session pipeline's non-persistent buffers
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.half()
            for param in component.parameters():  # the VLM's CPU layout (input-major linears) is not contiguous
                param.data = param.data.contiguous()  # and transformers' save refuses it (a separate bug)
    pipe.save_pretrained(tmp_path / "pipe")
    stored = type(pipe).from_pretrained(tmp_path / "pipe")
    found = weights(stored)
    assert found and {(dtype, device) for _, dtype, device in found} == {(torch.float32, "cpu")}, sorted(
        map(str, found)
    )


# ------------------------------------------------------------------ Janus
def _janus_greedy_transformers(pipe, prompt, guidance_scale):
    text = pipe.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                                              add_generation_prompt=True)  # fmt: skip
    enc = pipe.processor(text=text, generation_mode="image", return_tensors="pt")
    return pipe.model.generate(**enc, generation_mode="image", do_sample=False, guidance_scale=guidance_scale)


@pytest.mark.parametrize("acceptance", ["none", "jacobi"])
def test_janus_default_greedy_does_not_depend_on_the_batch(acceptance):
    pipe = loaded("janus")
    call = dict(acceptance=acceptance, do_sample=False, output_type="tokens")  # the default guidance_scale (5)
    batch = pipe(JANUS_PROMPTS, **call).images
    for i, prompt in enumerate(JANUS_PROMPTS):
        assert torch.equal(pipe(prompt, **call).images[0], batch[i]), (acceptance, prompt)


@pytest.mark.parametrize("acceptance", ["none", "jacobi"])
def test_janus_default_sampling_with_per_row_generators_does_not_depend_on_the_batch(acceptance):
    pipe = loaded("janus")
    call = dict(guidance_scale=2.0, acceptance=acceptance, output_type="tokens")
    batch = pipe(JANUS_PROMPTS, generator=gens(range(6)), **call).images
    for i, prompt in enumerate(JANUS_PROMPTS):
        assert torch.equal(pipe(prompt, generator=gens([i]), **call).images[0], batch[i]), (acceptance, prompt)


def test_janus_default_images_per_prompt_with_per_image_generators_are_the_single_runs():
    pipe = loaded("janus")
    call = dict(guidance_scale=2.0, acceptance="jacobi", output_type="tokens")
    batch = pipe(JANUS_PROMPTS[:3], num_images_per_prompt=2, generator=gens(range(6)), **call).images
    for i in range(6):
        assert torch.equal(pipe(JANUS_PROMPTS[i // 2], generator=gens([i]), **call).images[0], batch[i]), i


def test_janus_default_greedy_is_transformers_greedy():
    pipe = loaded("janus")
    for prompt in JANUS_PROMPTS:
        ours = pipe(prompt, guidance_scale=2.0, acceptance="none", do_sample=False, output_type="tokens").images
        assert torch.equal(ours, _janus_greedy_transformers(pipe, prompt, 2.0)), prompt


# ------------------------------------------------------------------ LlamaGen (c2i, t2i)
def test_ar_image_c2i_default_does_not_depend_on_the_batch():
    pipe = loaded("ar_image c2i")
    labels = [3, 7, 1]
    greedy = dict(guidance_scale=2.0, acceptance="none", do_sample=False, output_type="tokens")
    batch = pipe(class_labels=labels, **greedy).images
    for i, label in enumerate(labels):
        assert torch.equal(pipe(class_labels=[label], **greedy).images[0], batch[i]), label
    # the README's call: two images per label, EAGLE + exact acceptance; here one generator per image
    readme = dict(guidance_scale=2.0, acceptance="exact", drafter="eagle", output_type="tokens")
    batch = pipe(class_labels=labels, num_images_per_prompt=2, generator=gens(range(6)), **readme).images
    for i in range(6):
        alone = pipe(class_labels=[labels[i // 2]], generator=gens([i]), **readme).images[0]
        assert torch.equal(alone, batch[i]), i


def test_ar_image_t2i_default_does_not_depend_on_the_batch():
    pipe = loaded("ar_image t2i")
    prompts = JANUS_PROMPTS[:3]  # ragged: 5, 7 and 3 words
    for call, seeds in ((dict(acceptance="jacobi", do_sample=False), None), (dict(acceptance="jacobi"), [0, 1, 2])):
        batch = pipe(prompt=prompts, generator=seeds and gens(seeds), output_type="tokens", **call).images
        for i, prompt in enumerate(prompts):
            alone = pipe(prompt=[prompt], generator=seeds and gens([seeds[i]]), output_type="tokens", **call).images
            assert torch.equal(alone[0], batch[i]), (call, prompt)


# ------------------------------------------------------------------ MAR
@pytest.mark.slow  # the README's call: about 12 s per run on one CPU thread
def test_continuous_default_does_not_depend_on_the_batch():
    pipe = loaded("continuous")
    labels = [3, 7]
    readme = dict(guidance_scale=4.0, num_ar_steps=16, acceptance="continuous", verify_mode="exact",
                  num_draft_tokens=4, prefill_ratio=0.15, output_type="latent")  # fmt: skip
    batch = pipe(labels, generator=gens([0, 1]), **readme).images
    for i, label in enumerate(labels):
        torch.testing.assert_close(pipe([label], generator=gens([i]), **readme).images[0], batch[i])


# ------------------------------------------------------------------ VLM
@pytest.mark.slow
def test_vlm_default_does_not_depend_on_the_batch_and_greedy_is_transformers():
    from mmspec.data.canvases import held_out_canvases

    pipe = loaded("vlm")
    images = held_out_canvases(3, seed=0)
    prompts = ["Describe the image.", "Which digit is at the top left?", "How many digits are in the image?"]

    def answers(out):
        return [[t for t in row if t >= 0] for row in out.sequences.tolist()]

    greedy = dict(max_new_tokens=8, acceptance="greedy", drafter="eagle", tree_depth=6, output_type="ids")
    sampled = dict(max_new_tokens=8, acceptance="exact", drafter="eagle", do_sample=True, output_type="ids")
    for call, seeds in ((greedy, None), (sampled, [0, 1, 2])):
        batch = answers(pipe(images=images, prompt=prompts, generator=seeds and gens(seeds), **call))
        for i in range(3):
            alone = answers(pipe(images=images[i : i + 1], prompt=prompts[i : i + 1],
                                 generator=seeds and gens([seeds[i]]), **call))  # fmt: skip
            assert alone[0] == batch[i], (call["acceptance"], i)
    ids, _, extra = pipe.encode(images[:1], prompts[:1], None, "cpu")
    ref = pipe.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=pipe.eos_token_ids(), **extra)  # fmt: skip
    ours = answers(pipe(images=images[:1], prompt=prompts[:1], **greedy))
    assert ours[0] == ref[0, ids.shape[1] :].tolist()
