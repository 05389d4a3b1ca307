"""mmspec.sampling: CFG, logits -> probs (temperature, top-k, top-p, greedy), sync-free sampling."""

import numpy as np
import pytest
import torch

from mmspec.sampling import (
    GUIDANCE_MAX,
    TEMPERATURE_RANGE,
    TOP_K_MAX,
    SamplingParams,
    cfg_combine,
    cfg_combine_stacked,
    check_probs_finite,
    finite_flag,
    logits_to_probs,
    sample,
)


def test_cfg_combine_llamagen_form():
    cond, uncond = torch.randn(3, 7), torch.randn(3, 7)
    out = cfg_combine(cond, uncond, 4.0)
    torch.testing.assert_close(out, uncond + 4.0 * (cond - uncond))
    torch.testing.assert_close(cfg_combine(cond, uncond, 1.0), cond)
    stacked = torch.cat([cond, uncond])
    torch.testing.assert_close(cfg_combine_stacked(stacked, 4.0), out)
    with pytest.raises(ValueError, match="even batch"):
        cfg_combine_stacked(torch.randn(3, 7), 2.0)
    with pytest.raises(ValueError, match="logits_uncond"):
        cfg_combine(cond, uncond[:, :5], 2.0)


def test_probs_float32_and_normalised():
    # distinct values (bfloat16 rounding of random normals can tie at the k-th, and top-k keeps ties, as transformers'
    # TopKLogitsWarper does); seeded: the test read the global RNG and failed in some test orders
    g = torch.Generator().manual_seed(0)
    logits = (torch.stack([torch.randperm(11, generator=g) for _ in range(10)]).view(2, 5, 11) / 2).bfloat16()
    probs = logits_to_probs(logits, temperature=0.7, top_k=4, top_p=0.9)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 5))
    assert (probs > 0).sum(-1).max() <= 4


def test_temperature_top_k_top_p_match_reference():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    torch.testing.assert_close(logits_to_probs(logits, temperature=0.5), (logits / 0.5).softmax(-1))
    top2 = logits_to_probs(logits, top_k=2)
    ref = torch.tensor([[2.0, 1.0]]).softmax(-1)
    torch.testing.assert_close(top2[:, :2], ref)
    assert (top2[:, 2:] == 0).all()
    # top-p: smallest prefix whose mass reaches top_p
    full = logits.softmax(-1)
    mass2 = float(full[0, :2].sum())
    nuc = logits_to_probs(logits, top_p=mass2 - 1e-4)
    assert (nuc[0, 2:] == 0).all() and (nuc[0, :2] > 0).all()
    nuc = logits_to_probs(logits, top_p=mass2 + 1e-4)
    assert (nuc[0, :3] > 0).all() and (nuc[0, 3:] == 0).all()
    torch.testing.assert_close(logits_to_probs(logits, top_p=1.0), full)
    assert (logits_to_probs(logits, top_p=1e-6) == torch.tensor([[1.0, 0, 0, 0, 0]])).all()


def test_greedy_is_one_hot_at_cfg_argmax():
    cond, uncond = torch.randn(4, 9), torch.randn(4, 9)
    params = SamplingParams(guidance_scale=3.0, do_sample=False)
    probs = params.probs(cond, uncond)
    expected = (uncond + 3.0 * (cond - uncond)).argmax(-1)
    assert (probs.argmax(-1) == expected).all() and (probs.sum(-1) == 1).all() and (probs.max(-1).values == 1).all()
    assert SamplingParams(temperature=0.0).greedy
    torch.testing.assert_close(
        SamplingParams(temperature=0.0).probs(cond), SamplingParams(do_sample=False).probs(cond)
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.2}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),  # must be finite (not read as "uniform")
        ({"temperature": float("nan")}, "temperature"),
        ({"guidance_scale": float("inf")}, "guidance_scale"),
        ({"guidance_scale": float("-inf")}, "guidance_scale"),
        ({"guidance_scale": float("nan")}, "guidance_scale"),
        ({"guidance_scale": 1e39}, "guidance_scale"),  # finite in Python, inf in float32 CFG
        ({"guidance_scale": -0.5}, "guidance_scale"),  # anti-guidance is rejected
    ],
)
def test_invalid_params_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=name):
        logits_to_probs(torch.randn(2, 4), **kwargs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"guidance_scale": "2"}, "guidance_scale"),
        ({"guidance_scale": True}, "guidance_scale"),
        ({"guidance_scale": None}, "guidance_scale"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": False}, "temperature"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": "4"}, "top_k"),
        ({"top_p": "0.9"}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"do_sample": "no"}, "do_sample"),
        ({"do_sample": 0}, "do_sample"),
    ],
)
def test_wrongly_typed_params_are_type_errors_naming_the_argument(kwargs, name):
    with pytest.raises(TypeError, match=name):
        SamplingParams(**kwargs)
    with pytest.raises(TypeError, match=name):
        logits_to_probs(torch.randn(2, 4), **kwargs)


def test_numpy_knobs_are_accepted_as_plain_numbers():
    params = SamplingParams(guidance_scale=np.float32(2.0), temperature=np.float64(0.5), top_k=np.int64(3))
    assert type(params.guidance_scale) is float and type(params.temperature) is float and type(params.top_k) is int
    assert params == SamplingParams(guidance_scale=2.0, temperature=0.5, top_k=3)


def test_guidance_scale_zero_is_the_unconditional_distribution():
    cond, uncond = torch.randn(3, 7), torch.randn(3, 7)
    cond[:, 2] = float("-inf")  # a token masked in the conditional stream only: 0 * -inf must not give NaN
    torch.testing.assert_close(SamplingParams(guidance_scale=0.0).probs(cond, uncond), uncond.softmax(-1))
    torch.testing.assert_close(cfg_combine(cond, uncond, 0.0), uncond)


def test_nan_logits_raise():
    logits = torch.randn(2, 4)
    logits[1, 2] = float("nan")
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(logits)
    with pytest.raises(ValueError, match="logits_uncond"):
        logits_to_probs(torch.randn(2, 4), logits_uncond=logits, guidance_scale=2.0)
    for kwargs in ({"do_sample": False}, {"top_k": 2}, {"top_p": 0.5}, {"temperature": 0.0}):
        with pytest.raises(ValueError, match="logits contain NaN"):
            logits_to_probs(logits, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=1e-40), r"temperature must be 0 \(greedy\) or in \[0.0001, 10000\], got 1e-40"),
    (dict(temperature=1e30), r"temperature must be 0 \(greedy\) or in \[0.0001, 10000\], got 1e\+30"),
    (dict(guidance_scale=1e30), r"guidance_scale must be in \[0, 10000\]"),
])  # fmt: skip
def test_knobs_that_only_overflow_are_refused_up_front(kwargs, message):
    """A temperature or guidance scale that turns ordinary logits into inf is refused by the rules the CLI shares."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=message):
        logits_to_probs(torch.tensor([[1.0, 2.0, 3.0]]), **kwargs)
    low, high = TEMPERATURE_RANGE
    for ok in (dict(temperature=low), dict(temperature=high), dict(guidance_scale=GUIDANCE_MAX)):
        assert torch.isfinite(SamplingParams(**ok).probs(torch.tensor([[1.0, 2.0, 3.0]]))).all()


def test_temperature_overflow_raises_naming_it():
    logits = torch.tensor([[1.0, 2.0, 3e38]])  # extreme logits: 3e38 / 0.5 overflows float32
    assert torch.isnan(logits_to_probs(logits, temperature=0.5, validate=False)).all()  # what the check catches
    with pytest.raises(ValueError, match=r"temperature=0.5 overflow float32"):
        logits_to_probs(logits, temperature=0.5)
    with pytest.raises(ValueError, match=r"temperature=0.5"):
        SamplingParams(temperature=0.5).probs(logits)
    assert logits_to_probs(torch.tensor([[1.0, 2.0, 3.0]]), temperature=1e-4).argmax(-1).item() == 2


def test_guidance_overflow_raises_naming_the_knobs():
    cond = torch.tensor([[0.0, 1e36, 3.0]])
    uncond = torch.tensor([[1e36, 0.0, 3.0]])  # logit gaps of 1e36: 1e4 * 1e36 overflows float32
    assert not torch.isfinite(logits_to_probs(cond, logits_uncond=uncond, guidance_scale=1e4, validate=False)).all()
    with pytest.raises(ValueError, match=r"guidance_scale=10000 overflow float32"):
        logits_to_probs(cond, logits_uncond=uncond, guidance_scale=1e4)
    with pytest.raises(ValueError, match=r"guidance_scale=10000, temperature=0.5 overflow"):
        SamplingParams(guidance_scale=1e4, temperature=0.5).probs(cond, uncond)
    with pytest.raises(ValueError, match=r"guidance_scale=10000"):  # greedy rows are checked too
        SamplingParams(guidance_scale=1e4, do_sample=False).probs(cond, uncond)
    ok = SamplingParams(guidance_scale=10).probs(cond, uncond)  # 1e37: large but finite
    assert torch.equal(ok, torch.tensor([[0.0, 1.0, 0.0]]))


def test_all_minus_inf_row_raises():
    logits = torch.randn(2, 5)
    logits[1] = float("-inf")
    with pytest.raises(ValueError, match="entirely -inf"):
        logits_to_probs(logits)
    with pytest.raises(ValueError, match="entirely -inf"):
        logits_to_probs(logits, do_sample=False)


def test_validate_costs_one_host_sync(monkeypatch):
    syncs = []
    original = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: syncs.append(1) or original(t))
    cond, uncond = torch.randn(2, 3, 9), torch.randn(2, 3, 9)
    SamplingParams(guidance_scale=3.0, temperature=0.7, top_k=5, top_p=0.9).probs(cond, uncond)
    assert len(syncs) == 1
    SamplingParams(guidance_scale=3.0, do_sample=False).probs(cond, uncond)
    assert len(syncs) == 2
    SamplingParams(guidance_scale=3.0).probs(cond, uncond, validate=False)
    assert len(syncs) == 2


def test_greedy_rows_carry_nan_when_their_maximum_is_not_finite():
    logits = torch.randn(3, 6)
    logits[1, 4] = float("nan")
    logits[2] = float("-inf")
    probs = logits_to_probs(logits, do_sample=False, validate=False)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 6).float())
    assert torch.isnan(probs[1]).any() and torch.isnan(probs[2]).any()


def test_check_probs_finite_on_probs_and_on_device_flags():
    params = SamplingParams(guidance_scale=1e4, temperature=0.5)
    cond, uncond = torch.tensor([[0.0, 1e36, 3.0]]), torch.tensor([[1e36, 0.0, 3.0]])
    good = SamplingParams().probs(torch.randn(2, 3))
    check_probs_finite(good, params)  # finite: no error
    bad = params.probs(cond, uncond, validate=False)
    with pytest.raises(ValueError, match=r"target probabilities .*guidance_scale=10000, temperature=0.5 overflow"):
        check_probs_finite(bad, params, "target")
    flag = finite_flag(good)  # the engine ANDs one flag per distribution on the device and checks once at the end
    check_probs_finite(flag, params)
    flag = flag & finite_flag(bad)
    assert flag.dtype == torch.bool and flag.dim() == 0
    with pytest.raises(ValueError, match=r"guidance_scale=10000"):
        check_probs_finite(flag, params)
    with pytest.raises(ValueError, match="NaN"):
        check_probs_finite(torch.tensor([[float("nan"), 1.0]]), SamplingParams())


@pytest.mark.parametrize("method", ["inverse_cdf", "exponential", "multinomial"])
def test_sample_matches_probs(method, make_generator, chi2_pvalue):
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    draws = sample(probs.expand(100_000, 5), make_generator(1), method=method)
    assert draws.shape == (100_000,)
    assert chi2_pvalue(draws, probs) > 1e-4
    again = sample(probs.expand(100_000, 5), make_generator(1), method=method)
    assert torch.equal(draws, again)
    with pytest.raises(ValueError, match="method"):
        sample(probs, make_generator(0), method="gumbel")


@pytest.mark.parametrize("method", ["inverse_cdf", "exponential"])
def test_sample_never_picks_zero_probability_tokens(method, make_generator):
    probs = torch.zeros(50_000, 64)
    probs[:, 3] = 1e-30  # tiny but positive, zeros on both sides
    assert (sample(probs, make_generator(2), method) == 3).all()
    probs = torch.zeros(50_000, 8)
    probs[:, 0], probs[:, 5] = 0.5, 0.5  # zero-probability tail and interior
    draws = sample(probs, make_generator(3), method)
    assert ((draws == 0) | (draws == 5)).all() and 0.48 < float((draws == 0).float().mean()) < 0.52


def test_top_k_past_any_vocabulary_is_refused_by_the_rule_the_cli_shares():
    """`top_k` above `TOP_K_MAX` is refused by `SamplingParams` itself (the pipelines' check, which the CLI runs)."""
    assert SamplingParams(top_k=TOP_K_MAX).top_k == TOP_K_MAX
    with pytest.raises(ValueError, match=rf"top_k must be at most {TOP_K_MAX}"):
        SamplingParams(top_k=TOP_K_MAX + 1)
