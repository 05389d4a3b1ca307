"""Issue 20, non-finite maths on the continuous (MAR + CSpD) path: every knob of
`SpeculativeContinuousARPipeline.__call__` is refused up front (finite, in range, right type) before any model runs,
and a model whose outputs turn NaN / inf (huge weights) is named in a `ValueError` -- the transformer, the draft
(also in ``verify_mode="exact"``, where its canvas feeds the target) or the vae -- instead of NaN / black images."""

import copy

import pytest
import torch
from test_pipeline_continuous import perturbed, toy_mar, toy_vae

from mmspec.pipelines import SpeculativeContinuousARPipeline
from mmspec.pipelines.continuous import LIMITS


@pytest.fixture(scope="module")
def parts():
    target = toy_mar(0)
    return dict(transformer=target, vae=toy_vae(), draft_transformer=perturbed(target, 0.04, 1))


def make(parts, **replace):
    pipe = SpeculativeContinuousARPipeline(**(parts | replace))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def blown_up(module, scale=1e30, only=None):
    """A copy of ``module`` with every weight (or those of the submodule named ``only``) times ``scale``."""
    module = copy.deepcopy(module)
    target = module if only is None else module.get_submodule(only)
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(scale)
    return module


def call(pipe, **kw):
    kw = {"class_labels": [0, 1], "num_ar_steps": 4, "output_type": "pt", **kw}
    return pipe(generator=torch.Generator().manual_seed(0), **kw)


SPEC = dict(acceptance="continuous", num_draft_tokens=2, prefill_ratio=0.25)

BAD_KNOBS = [
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=1e30), ValueError, "temperature"),
    (dict(temperature=LIMITS["temperature"] * 1.01), ValueError, "temperature"),
    (dict(temperature="1.0"), TypeError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(guidance_scale=float("inf")), ValueError, "guidance_scale"),
    (dict(guidance_scale=1e30), ValueError, "guidance_scale"),
    (dict(guidance_scale=LIMITS["guidance_scale"] * 1.01), ValueError, "guidance_scale"),
    (dict(guidance_scale="3"), TypeError, "guidance_scale"),
    (dict(num_ar_steps=2.5), TypeError, "num_ar_steps"),
    (dict(num_ar_steps=True), TypeError, "num_ar_steps"),
    (SPEC | dict(num_draft_tokens=10**9), ValueError, "num_draft_tokens"),
    (dict(num_draft_tokens=2.0, acceptance="continuous"), TypeError, "num_draft_tokens"),
    (dict(prefill_ratio="0.5", acceptance="continuous"), TypeError, "prefill_ratio"),
    (dict(max_residual_tries=10**9, **SPEC), ValueError, "max_residual_tries"),
    (dict(max_residual_tries=2.5, **SPEC), TypeError, "max_residual_tries"),
    (dict(num_inference_steps=10**6), ValueError, "num_inference_steps"),
    (dict(num_inference_steps=4.5), TypeError, "num_inference_steps"),
    (dict(num_inference_steps=True), TypeError, "num_inference_steps"),
    (dict(num_inference_steps="abc"), ValueError, "num_inference_steps"),
    (dict(trajectory_alignment="no", **SPEC), TypeError, "trajectory_alignment"),
    (dict(return_dict="yes"), TypeError, "return_dict"),
    (dict(callback_on_step_end=5), TypeError, "callback_on_step_end"),
    (dict(cfg_schedule_type="cosine"), ValueError, "cfg_schedule_type"),
    (dict(class_labels="3"), TypeError, "class_labels"),
    (dict(class_labels=[None]), TypeError, "class_labels"),
    (dict(class_labels=[[0, 1]]), ValueError, "class_labels"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_KNOBS, ids=[repr(k) for k, _, _ in BAD_KNOBS])
def test_bad_knobs_are_refused_before_any_model_runs(parts, kwargs, error, match):
    pipe = make(parts)
    forwards = []
    for name in ("transformer", "draft_transformer"):
        model = getattr(pipe, name)
        original = model.features
        model.features = lambda *a, _o=original, _n=name, **k: forwards.append(_n) or _o(*a, **k)
    try:
        with pytest.raises(error, match=match):
            call(pipe, **kwargs)
    finally:
        for name in ("transformer", "draft_transformer"):
            del getattr(pipe, name).features
    assert forwards == [], kwargs  # refused up front, not after sampling


def test_knob_limits_are_inclusive_and_give_finite_images(parts):
    """The largest guidance_scale / temperature accepted still gives finite images; just past them is refused."""
    pipe = make(parts)
    images = call(pipe, guidance_scale=LIMITS["guidance_scale"], temperature=LIMITS["temperature"], **SPEC).images
    assert torch.isfinite(images).all()
    for knob in ("guidance_scale", "temperature"):
        with pytest.raises(ValueError, match=knob):
            call(pipe, **{knob: LIMITS[knob] + 0.5})


@pytest.mark.parametrize("method", [dict(), dict(SPEC, verify_mode="block"), dict(SPEC, verify_mode="exact")],
                         ids=["plain", "block", "exact"])  # fmt: skip
@pytest.mark.parametrize("output_type", ["pt", "latent"])
def test_a_broken_transformer_is_named(parts, method, output_type):
    pipe = make(parts, transformer=blown_up(parts["transformer"]))
    with pytest.raises(ValueError, match=r"^transformer produced non-finite"):
        call(pipe, output_type=output_type, **method)


@pytest.mark.parametrize("mode", ["block", "exact"])
@pytest.mark.parametrize("only", [None, "diffloss"], ids=["all weights", "its head"])
def test_a_broken_draft_is_named_not_the_target_it_fed(parts, mode, only):
    """A draft with huge weights (all, or only its diffusion head) raises naming draft_transformer: in exact mode
    its NaN canvas also turns the target's features NaN, but the draft came first; in block mode it would silently
    get every token rejected."""
    pipe = make(parts, draft_transformer=blown_up(parts["draft_transformer"], only=only))
    with pytest.raises(ValueError, match=r"^draft_transformer produced non-finite"):
        call(pipe, verify_mode=mode, **SPEC)


def test_a_broken_transformer_head_names_the_transformer_and_the_knobs(parts):
    pipe = make(parts, transformer=blown_up(parts["transformer"], float("inf"), only="diffloss"))
    with pytest.raises(ValueError, match=r"^transformer .*diffusion head.*guidance_scale=3"):
        call(pipe, guidance_scale=3.0, cfg_schedule_type="constant")


@pytest.mark.parametrize("output_type", ["pt", "np", "pil"])
def test_a_broken_vae_is_named(parts, output_type):
    pipe = make(parts, vae=blown_up(parts["vae"]))
    with pytest.raises(ValueError, match=r"^vae produced non-finite"):
        call(pipe, output_type=output_type, **SPEC)
    assert torch.isfinite(call(pipe, output_type="latent").images).all()  # the tokens themselves were fine


def test_the_finiteness_check_reads_the_device_once_per_call_not_per_step(parts, monkeypatch):
    """Host reads (syncs on a GPU) of a plain call: the non-finite flags are kept on the device (`FiniteWatch.see`
    reads nothing) and read once per call (`FiniteWatch.check`), and MAR's forward reads one number pair per step
    (its gather length), so two more AR steps cost exactly two more reads -- and a broken transformer is still
    caught."""
    from mmspec.decoding import masked

    reads, inside_see = [], []
    for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name):
            reads.append(_name)
            inside_see.extend([_name] if see_depth else [])
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, read)
    see, see_depth = masked.FiniteWatch.see, []

    def watched_see(self, *args):
        see_depth.append(1)
        try:
            return see(self, *args)
        finally:
            see_depth.pop()

    monkeypatch.setattr(masked.FiniteWatch, "see", watched_see)

    def count(pipe, steps):
        reads.clear()
        call(pipe, num_ar_steps=steps, output_type="latent")
        return len(reads)

    pipe = make(parts)
    count(pipe, 4)  # warm-up (first-call reads of torch / diffusers)
    assert count(pipe, 4) - count(pipe, 2) == 2
    assert inside_see == []
    broken = make(parts, transformer=blown_up(parts["transformer"]))
    with pytest.raises(ValueError, match=r"^transformer produced non-finite"):
        count(broken, 4)
