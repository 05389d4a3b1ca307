"""mmspec.sampling: CFG, logits -> probs (temperature, top-k, top-p, greedy), sync-free sampling."""

import pytest
import torch

from mmspec.sampling import SamplingParams, cfg_combine, cfg_combine_stacked, logits_to_probs, sample


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
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
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
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.2}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
    ],
)
def test_invalid_params_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=name):
        logits_to_probs(torch.randn(2, 4), **kwargs)


def test_nan_logits_raise():
    logits = torch.randn(2, 4)
    logits[1, 2] = float("nan")
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(logits)
    with pytest.raises(ValueError, match="logits_uncond"):
        logits_to_probs(torch.randn(2, 4), logits_uncond=logits, guidance_scale=2.0)


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
