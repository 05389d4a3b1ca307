"""`MaskedParams` (the masked loop's settings, one frozen value), the continuous defaults read from the registry, and
`ImageNoise.draw`'s draw order with the draft's own noise (issue 27: the knobs no longer travel positionally)."""

import argparse
import dataclasses
import inspect

import pytest
import torch

from mmspec.decoding.masked import ImageNoise
from mmspec.decoding.masked_params import MaskedParams, cfg_schedule, mar_schedule
from mmspec.methods import CONTINUOUS_DEFAULTS
from mmspec.pipelines import SpeculativeContinuousARPipeline


KNOBS = dict(num_ar_steps=8, guidance_scale=3.0, cfg_schedule_type="linear", temperature=0.9, speculative=True,
             num_draft_tokens=3, prefill_ratio=0.3, verify_mode="exact", max_residual_tries=7)  # fmt: skip


def test_from_knobs_is_the_schedule_and_the_knobs():
    params = MaskedParams.from_knobs(16, **KNOBS)
    counts, mask_lens = mar_schedule(16, 8)
    assert params.counts == tuple(counts) and params.num_steps == 8
    assert params.cfg_scales == tuple(cfg_schedule(3.0, 16, mask_lens, "linear"))
    assert params.starts == (0, *[sum(counts[: s + 1]) for s in range(8)])
    assert params.num_prefill_steps == 2  # max(1, round(0.3 * 8))
    assert (params.temperature, params.num_draft_steps, params.verify_mode, params.max_residual_tries) == (
        0.9, 3, "exact", 7)  # fmt: skip
    assert MaskedParams.from_knobs(16, **dict(KNOBS, prefill_ratio=0.0)).num_prefill_steps == 1  # at least one step
    assert MaskedParams.from_knobs(16, **dict(KNOBS, speculative=False)).num_prefill_steps == 8  # plain: all


def test_is_frozen_and_refuses_inconsistent_settings():
    params = MaskedParams.from_knobs(16, **KNOBS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 2.0
    with pytest.raises(ValueError, match="verify_mode"):
        MaskedParams(counts=(4, 4), cfg_scales=(1.0, 1.0), verify_mode="tree")
    with pytest.raises(ValueError, match="cfg_scales"):
        MaskedParams(counts=(4, 4), cfg_scales=(1.0,))


def test_defaults_are_the_registry():
    """The pipeline's keywords, `MaskedParams` and `mmspec bench continuous`'s flags default to
    `mmspec.methods.CONTINUOUS_DEFAULTS` (no second copy of a default)."""
    signature = inspect.signature(SpeculativeContinuousARPipeline.__call__).parameters
    for name, default in CONTINUOUS_DEFAULTS.items():
        assert signature[name].default == default, name
    fields = {f.name: f.default for f in dataclasses.fields(MaskedParams)}
    assert fields["temperature"] == CONTINUOUS_DEFAULTS["temperature"]
    assert fields["num_draft_steps"] == CONTINUOUS_DEFAULTS["num_draft_tokens"]
    assert fields["verify_mode"] == CONTINUOUS_DEFAULTS["verify_mode"]
    assert fields["max_residual_tries"] == CONTINUOUS_DEFAULTS["max_residual_tries"]
    from mmspec.eval.bench_continuous import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    for name in ("num_ar_steps", "num_draft_tokens", "prefill_ratio", "guidance_scale", "temperature"):
        assert getattr(args, name) == CONTINUOUS_DEFAULTS[name], name


def test_draft_noise_is_drawn_after_the_targets_in_the_same_order():
    """``draw(draft=True)``: the target's order, x_T, eps, then the draft's (order drawn and dropped, x_T, eps) --
    the draws the pipeline made before the draft noise moved into `ImageNoise` (same images for the same seeds)."""
    shape = dict(batch=2, seq_len=5, dim=3, steps=4, device="cpu")
    gen = torch.Generator().manual_seed(0)
    noise = ImageNoise.draw(generator=gen, draft=True, **shape)
    gen = torch.Generator().manual_seed(0)
    target, own = ImageNoise.draw(generator=gen, **shape), ImageNoise.draw(generator=gen, **shape)
    for a, b in ((noise.order, target.order), (noise.x_T, target.x_T), (noise.eps, target.eps),
                 (noise.draft.order, target.order), (noise.draft.x_T, own.x_T), (noise.draft.eps, own.eps)):  # fmt: skip
        assert torch.equal(a, b)
    assert noise.for_draft() is noise.draft
    aligned = ImageNoise.draw(generator=torch.Generator().manual_seed(0), **shape)
    assert aligned.draft is None and aligned.for_draft() is aligned
