"""MAR + CSpD: the schedule, the head's sampler, and the pipeline's laws on toy models.

Distribution tests draw thousands of images of a 4-token toy MAR in one batched call and compare laws by two-sample
Kolmogorov-Smirnov tests on every token coordinate and on a cross-token statistic (Bonferroni over the tests):
``"exact"`` against plain MAR (lossless), ``"block"`` against plain MAR on the merged schedule (its stated law).
"""

import copy
import math

import numpy as np
import pytest
import torch
from pipeline_mixin import SpeculativePipelineTesterMixin
from scipy import stats as sps

from mmspec.decoding import ACCEPTED, BONUS, PREFILL, RESAMPLED
from mmspec.decoding.masked import cfg_schedule, mar_schedule
from mmspec.models.mar.diffloss import DiffLossHead
from mmspec.models.mar.diffusion import GaussianDiffusion
from mmspec.models.mar.kl_vae import AutoencoderKL
from mmspec.models.mar.model import MAR
from mmspec.pipelines import SpeculativeContinuousARPipeline


class GaussianDenoiser(torch.nn.Module):
    """An analytic diffusion-head net: the exact epsilon of data ``N(m, s^2 I)`` with ``m = W z`` (so a token's law
    given its condition is ``N(W z, s^2)``, up to the sampler's discretisation), learned-range variance output 0.

    It plugs into `DiffLossHead` through the head's embedding interface: ``cond_embed(z) = [W z, 0]``,
    ``time_embed(t) = [0, t]`` and ``forward_embedded`` reads ``m`` and ``t`` back from their sum."""

    def __init__(self, z_channels, dim, std, seed, alphas_cumprod):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.in_channels = dim
        self.weight = torch.nn.Parameter(torch.randn(dim, z_channels, generator=g) / math.sqrt(z_channels))
        self.std = std
        self.register_buffer("abar", alphas_cumprod.float())

    def cond_embed(self, z):
        return torch.cat([z @ self.weight.T, torch.zeros_like(z[:, :1])], -1)

    def time_embed(self, t):
        return torch.cat([torch.zeros(t.shape[0], self.in_channels), t[:, None].float()], -1)

    def forward_embedded(self, x, y):
        m, t = y[:, : self.in_channels], y[:, self.in_channels].round().long()
        abar = self.abar[t][:, None]
        eps = (x - abar.sqrt() * m) * (1 - abar).sqrt() / (1 - abar + abar * self.std**2)
        return torch.cat([eps, torch.zeros_like(eps)], -1)


def toy_mar(seed, dim=32, depth=1, steps="8", grid=(2, 2), token_dim=2, head_seed=None, head_std=0.3):
    """A tiny random MAR whose head is a `GaussianDenoiser` (per-token law N(W z, head_std^2))."""
    torch.manual_seed(seed)
    model = MAR(seq_h=grid[0], seq_w=grid[1], token_embed_dim=token_dim, encoder_embed_dim=dim, encoder_depth=depth,
                encoder_num_heads=2, decoder_embed_dim=dim, decoder_depth=depth, decoder_num_heads=2,
                class_num=3, buffer_size=2, diffloss_d=1, diffloss_w=16, num_sampling_steps=steps)  # fmt: skip
    with torch.no_grad():  # a canvas-dependent, non-degenerate transformer
        for p in [model.mask_token, model.encoder_pos_embed_learned, model.decoder_pos_embed_learned,
                  model.diffusion_pos_embed_learned, model.class_emb.weight]:  # fmt: skip
            p.normal_(0, 1.0)
    abar = model.diffloss.train_diffusion._arrays["alphas_cumprod"]
    model.diffloss.net = GaussianDenoiser(dim, token_dim, head_std, seed if head_seed is None else head_seed, abar)
    return model.eval()


def toy_vae(token_dim=2, resolution=4):
    torch.manual_seed(0)
    return AutoencoderKL(in_channels=1, out_channels=1, ch=8, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(),
                         resolution=resolution, embed_dim=token_dim, num_groups=4).eval()  # fmt: skip


def perturbed(model, scale, seed):
    """A draft close to ``model``: its weights plus Gaussian noise (so acceptance is neither 0 nor 1)."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    return draft


@pytest.fixture(scope="module")
def pipe():
    target = toy_mar(0)
    draft = perturbed(target, 0.04, 1)
    p = SpeculativeContinuousARPipeline(target, toy_vae(), draft)
    p.set_progress_bar_config(disable=True)
    return p


def sample(pipe, n, seed, **kw):
    kw.setdefault("guidance_scale", 2.0)
    kw.setdefault("cfg_schedule_type", "constant")
    kw.setdefault("num_ar_steps", 4)
    out = pipe([1] * n, output_type="latent", generator=torch.Generator().manual_seed(seed), **kw)
    return out.images.reshape(n, -1).double().numpy(), out


def statistics(x):
    """Per-coordinate values plus cross-token products (the law's dependence between tokens)."""
    cross = [x[:, i] * x[:, j] for i in range(0, x.shape[1], 2) for j in range(i + 2, x.shape[1], 2)]
    return [x[:, k] for k in range(x.shape[1])] + cross


def min_ks_pvalue(a, b):
    """The smallest KS p-value over `statistics`, Bonferroni-corrected (times the number of tests)."""
    pvalues = [sps.ks_2samp(u, v).pvalue for u, v in zip(statistics(a), statistics(b), strict=True)]
    return min(pvalues) * len(pvalues)


# ----------------------------------------------------------------------------- schedule and head
def test_mar_schedule_matches_upstream_formula():
    counts, mask_lens = mar_schedule(256, 64)
    assert sum(counts) == 256 and len(counts) == 64 and min(counts) >= 1
    masked = 256
    for s in range(64):  # upstream sample_tokens, step by step
        mask_len = max(1, min(masked - 1, int(np.floor(256 * np.cos(math.pi / 2 * (s + 1) / 64)))))
        assert mask_lens[s] == mask_len
        masked -= counts[s]
    assert mar_schedule(16, 16)[0] == [1] * 16
    cfg = cfg_schedule(3.0, 256, mask_lens)
    assert cfg[0] == pytest.approx(1 + 2.0 * (256 - mask_lens[0]) / 256) and cfg[-1] == pytest.approx(
        1 + 2 * 255 / 256
    )
    with pytest.raises(ValueError, match="num_ar_steps"):
        mar_schedule(16, 17)


def test_head_sampler_is_upstream_p_sample_loop_with_injected_noise():
    """`DiffLossHead.sample` = the IDDPM reverse loop (written out here from MAR's gaussian_diffusion/respace)."""
    torch.manual_seed(3)
    head = DiffLossHead(2, 32, depth=2, width=16, num_sampling_steps="5")
    with torch.no_grad():  # the zero-initialised adaLN / output layers get small random weights
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    z, zu = torch.randn(7, 32, generator=g), torch.randn(7, 32, generator=g)
    x_T, eps = torch.randn(7, 2, generator=g), torch.randn(7, 4, 2, generator=g)
    cfg, temp = 2.5, 0.9
    diff = GaussianDiffusion(1000, "5")
    betas = diff._arrays["betas"].double()
    abar = torch.cumprod(1 - betas, 0)
    abar_prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
    post_var = betas * (1 - abar_prev) / (1 - abar)
    post_logvar = torch.log(torch.cat([post_var[1:2], post_var[1:]]))
    x = x_T.double()
    with torch.no_grad():
        for j, i in enumerate(range(4, -1, -1)):
            t = torch.full((14,), int(diff.timestep_map[i]))
            out = head.net(torch.cat([x, x]).float(), t, torch.cat([z, zu])).double()
            e = out[7:, :2] + cfg * (out[:7, :2] - out[7:, :2])  # forward_with_cfg
            frac = (out[:7, 2:] + 1) / 2
            logvar = frac * torch.log(betas[i]) + (1 - frac) * post_logvar[i]
            x0 = (1 / abar[i]).sqrt() * x - (1 / abar[i] - 1).sqrt() * e
            mean = (betas[i] * abar_prev[i].sqrt() / (1 - abar[i])) * x0 + (
                (1 - abar_prev[i]) * (1 - betas[i]).sqrt() / (1 - abar[i])
            ) * x
            x = mean + (i != 0) * (0.5 * logvar).exp() * (eps[:, j].double() if i else 0) * temp
        ours = head.sample(z, x_T, eps, z_uncond=zu, cfg=cfg, temperature=temp)
        last = head.sample_last_step(z, x_T, eps, z_uncond=zu, cfg=cfg, temperature=temp)
    torch.testing.assert_close(ours.double(), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last.value, last.mean + last.std * eps[:, -1])
    torch.testing.assert_close(head.finish(z, last.value, z_uncond=zu, cfg=cfg), ours)


# ----------------------------------------------------------------------------- laws
def test_finished_value_rule_gives_the_target_token_law():
    """One token, many draws given the same earlier denoising noise: accept x_q = f_q(y_q) with min(1, p_x/q_x)
    (densities of *finished* values), redraw rejections from the residual -> exactly the target's finished-token law
    given that noise (vs the target's own sampler, KS)."""
    from mmspec.decoding.final_step import FinalStep
    from mmspec.decoding.masked import finished_accept_prob, residual_finished

    n, d = 20000, 2
    target, draft = toy_mar(0).diffloss, toy_mar(0, head_seed=7, head_std=0.35).diffloss
    draft.net.weight.data = target.net.weight.data + 0.05 * draft.net.weight.data  # a shifted, wider draft
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 32, generator=g).expand(n, -1)
    cfg = torch.ones(n)
    steps = target.num_sampling_steps
    with torch.no_grad():
        # One earlier trajectory noise for every draw (the rule is exact given it), fresh last-step noise.
        x_T = torch.randn(1, d, generator=g).expand(n, -1)
        eps = torch.cat([torch.randn(1, steps - 2, d, generator=g).expand(n, -1, -1),
                         torch.randn(n, 1, d, generator=g)], 1)  # fmt: skip
        q = draft.sample_last_step(z, x_T, eps)
        p = target.sample_last_step(z, x_T, eps)  # aligned noise
        f_p, f_q = FinalStep(target, z, None, cfg), FinalStep(draft, z, None, cfg)
        x_q, logdet_q = f_q.forward_logdet(q.value)
        prob = finished_accept_prob(f_p, x_q, q.value, p.mean, p.std, q.mean, q.std, logdet_q)
        accepted = torch.rand(n, generator=g) < prob
        out = x_q.clone()
        idx = (~accepted).nonzero()[:, 0]
        out[idx], fallbacks = residual_finished(f_p.select(idx), f_q.select(idx), p.mean[idx], p.std[idx],
                                                q.mean[idx], q.std[idx], torch.zeros_like(idx), g, 1, 100)  # fmt: skip
        fresh = torch.cat([eps[:, :-1], torch.randn(n, 1, d, generator=g)], 1)
        ref = target.sample(z, x_T, fresh)
    assert 0.2 < accepted.float().mean() < 0.9 and fallbacks == 0
    pvalues = [sps.ks_2samp(out[:, k].numpy(), ref[:, k].numpy()).pvalue for k in range(d)]
    assert min(pvalues) > 1e-3 / 2, pvalues
    draft_law = [sps.ks_2samp(x_q[:, k].numpy(), ref[:, k].numpy()).pvalue for k in range(d)]
    assert min(draft_law) < 1e-6  # the draft alone is detectably off: the test can fail


def test_exact_mode_is_lossless(pipe):
    """verify_mode="exact" reproduces plain MAR's law (fine schedule), rejections and residual draws included."""
    n = 3000
    plain, _ = sample(pipe, n, 0)
    exact, out = sample(pipe, n, 1, acceptance="continuous", verify_mode="exact", num_draft_tokens=3,
                        prefill_ratio=0.25)  # fmt: skip
    rate = out.stats.extra["acceptance_rate"]
    assert 0.05 < rate < 0.95  # both accept and reject paths run
    assert (out.trace.counts()["resampled"] > 0).any()
    p_exact = min_ks_pvalue(plain, exact)
    # on a failure, the message adds plain against plain (another seed) for scale: drawn only then
    assert p_exact > 1e-3, (p_exact, min_ks_pvalue(plain, sample(pipe, n, 2)[0]))


def test_exact_mode_is_lossless_with_several_tokens_per_step():
    """3x3 tokens in 4 AR steps (1, 2, 3, 3 tokens): a step is kept only if all its tokens are accepted."""
    target = toy_mar(0, grid=(3, 3))
    pipe = SpeculativeContinuousARPipeline(target, toy_vae(resolution=6), perturbed(target, 0.03, 1))
    pipe.set_progress_bar_config(disable=True)
    n = 2000
    plain, _ = sample(pipe, n, 0)
    exact, out = sample(pipe, n, 1, acceptance="continuous", verify_mode="exact", num_draft_tokens=3,
                        prefill_ratio=0.25)  # fmt: skip
    assert 0.05 < out.stats.extra["acceptance_rate"] < 0.95
    assert min_ks_pvalue(plain, exact) > 1e-3


def test_block_mode_law_is_the_merged_schedule(pipe, monkeypatch):
    """verify_mode="block": each block's tokens ~ the target given the block-start canvas (merged schedule), and
    that law differs from the fine schedule on this toy (so the test above can fail)."""
    from mmspec.decoding import masked_params

    n = 3000
    block, out = sample(pipe, n, 3, acceptance="continuous", verify_mode="block", num_draft_tokens=3,
                        prefill_ratio=0.25)  # fmt: skip
    assert 0.05 < out.stats.extra["acceptance_rate"] < 0.95
    # plain MAR on the merged schedule: step 0 alone, then the 3 remaining steps as one step (the schedule
    # `MaskedParams.from_knobs` builds)
    with monkeypatch.context() as patch:
        patch.setattr(masked_params, "mar_schedule", lambda length, steps: ([1, 3], [3, 1]))
        merged, _ = sample(pipe, n, 4)
    fine, _ = sample(pipe, n, 5)
    assert min_ks_pvalue(block, merged) > 1e-3
    assert min_ks_pvalue(block, fine) < 1e-6


# ----------------------------------------------------------------------------- behaviour
@pytest.mark.parametrize("mode", ["block", "exact"])
def test_per_image_generators_make_images_batch_independent(pipe, mode):
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    kw = dict(num_ar_steps=4, acceptance="continuous", verify_mode=mode, num_draft_tokens=2, output_type="latent")
    a = pipe([0, 1, 2], generator=gens([5, 6, 7]), **kw).images
    b = pipe([1], generator=gens([6]), **kw).images
    torch.testing.assert_close(a[1], b[0])
    c = pipe([0, 1, 2], generator=gens([5, 6, 7]), **kw).images
    torch.testing.assert_close(a, c)


def test_residual_fallback_never_emits_zero(pipe):
    """With one residual try, rejected tokens fall back to a plain target draw (the release leaves zeros)."""
    _, out = sample(pipe, 400, 9, acceptance="continuous", verify_mode="block", num_draft_tokens=3,
                    prefill_ratio=0.25, max_residual_tries=1)  # fmt: skip
    assert out.stats.extra["residual_fallbacks"] > 0
    assert (out.images.abs().sum(-1) > 0).all()
    counts = out.trace.counts()
    assert (counts["accepted"] + counts["resampled"] + counts["prefill"] == 4).all()


def test_stats_and_trace(pipe):
    _, out = sample(pipe, 8, 0, acceptance="continuous", num_draft_tokens=3, prefill_ratio=0.25)
    s = out.stats
    assert s.target_forwards == 2 and s.draft_forwards == 3  # 1 pre-fill step + 1 verify; 3 drafted steps
    assert sum(s.generated_tokens) == 32 and sum(s.prefill_tokens) == 8
    assert (out.trace.origin >= 0).all()
    _, plain = sample(pipe, 8, 0)
    assert plain.stats.target_forwards == 4 and plain.trace.counts()["bonus"].sum() == 32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(acceptance="typical"), "acceptance"),
        (dict(acceptance="continuous", verify_mode="fast"), "verify_mode"),
        (dict(class_labels=[5]), "class_labels"),
        (dict(class_labels=[0.5]), "class_labels"),
        (dict(num_ar_steps=9), "num_ar_steps"),
        (dict(num_draft_tokens=0, acceptance="continuous"), "num_draft_tokens"),
        (dict(prefill_ratio=1.5, acceptance="continuous"), "prefill_ratio"),
        (dict(output_type="tokens"), "output_type"),
        (dict(guidance_scale=0.5), "guidance_scale"),
        (dict(num_inference_steps=1), "num_inference_steps"),
    ],
)
def test_bad_inputs_name_the_argument(pipe, kwargs, match):
    kwargs = {"class_labels": [0], "num_ar_steps": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        pipe(**kwargs, generator=torch.Generator().manual_seed(0))


def test_continuous_needs_a_draft():
    p = SpeculativeContinuousARPipeline(toy_mar(0), toy_vae())
    with pytest.raises(ValueError, match="draft_transformer"):
        p([0], acceptance="continuous")


def test_trajectory_alignment_raises_acceptance(pipe):
    kw = dict(acceptance="continuous", verify_mode="exact", num_draft_tokens=3, prefill_ratio=0.25)
    _, aligned = sample(pipe, 600, 11, **kw)
    _, free = sample(pipe, 600, 11, trajectory_alignment=False, **kw)
    assert aligned.stats.extra["acceptance_rate"] > free.stats.extra["acceptance_rate"] + 0.05


def test_exact_mode_is_ragged_and_traced(pipe, monkeypatch):
    """Images advance by their own accepted steps: rounds differ across images; every token is emitted once; the
    drafted / accepted counts and the acceptance rate match an independent count: tokens through the draft's head
    (every verified draft, those of discarded steps too) and emitted values equal to a draft's finished value."""
    from mmspec.decoding import masked

    draft_head, drafted_rows, draft_values = pipe.draft_transformer.diffloss, [], set()
    sample_last_step, forward_logdet = draft_head.sample_last_step, masked.FinalStep.forward_logdet

    def counting_sample_last_step(z, *args, **kwargs):
        drafted_rows.append(z.shape[0])
        return sample_last_step(z, *args, **kwargs)

    def recording_forward_logdet(self, y):
        x, logdet = forward_logdet(self, y)
        if self.head is draft_head:
            draft_values.update(map(tuple, x.tolist()))
        return x, logdet

    monkeypatch.setattr(draft_head, "sample_last_step", counting_sample_last_step)
    monkeypatch.setattr(masked.FinalStep, "forward_logdet", recording_forward_logdet)
    _, out = sample(pipe, 64, 12, acceptance="continuous", verify_mode="exact", num_draft_tokens=3, prefill_ratio=0.25)
    rounds = out.trace.round.max(1).values
    assert rounds.min() < rounds.max()  # ragged
    counts = out.trace.counts()
    assert (counts["prefill"] == 1).all() and (counts["prefill"] + counts["accepted"] + counts["resampled"] == 4).all()
    drafted = sum(drafted_rows)
    assert sum(out.stats.drafted_tokens) == drafted > (counts["accepted"] + counts["resampled"]).sum().item()
    accepted = [tuple(t) in draft_values for t in out.images.reshape(-1, out.images.shape[-1]).tolist()]
    assert sum(accepted) == counts["accepted"].sum().item() > 0
    assert out.stats.extra["acceptance_rate"] == pytest.approx(sum(accepted) / drafted)


def test_save_and_load_round_trip_and_callback(tmp_path):
    """A pipeline of real (tiny) models saves, loads strictly through from_pretrained / from_zoo, and calls back."""
    torch.manual_seed(0)
    kw = dict(seq_h=2, seq_w=2, token_embed_dim=2, encoder_depth=1, encoder_num_heads=2, decoder_depth=1,
              decoder_num_heads=2, class_num=3, buffer_size=2, diffloss_d=1, diffloss_w=8, num_sampling_steps="3")  # fmt: skip
    target = MAR(encoder_embed_dim=16, decoder_embed_dim=16, **kw).eval()
    draft = MAR(encoder_embed_dim=8, decoder_embed_dim=8, **kw).eval()
    pipe = SpeculativeContinuousARPipeline(target, toy_vae(), draft)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = SpeculativeContinuousARPipeline.from_pretrained(tmp_path / "pipe")
    loaded.set_progress_bar_config(disable=True)
    seen = []

    def callback(p, step, num_steps, tensors):
        seen.append((step, int(tensors["visible"].sum())))

    args = dict(num_ar_steps=4, acceptance="continuous", num_draft_tokens=2, prefill_ratio=0.25, output_type="latent")
    a = pipe([0, 2], generator=torch.Generator().manual_seed(0), **args).images
    b = loaded([0, 2], generator=torch.Generator().manual_seed(0), callback_on_step_end=callback, **args).images
    torch.testing.assert_close(a, b)
    assert seen == [(1, 2), (3, 6), (4, 8)]  # pre-fill step, then blocks of 2 steps and 1 step
    for name, folder in (("mar", "transformer"), ("kl", "vae"), ("mar-draft", "draft_transformer")):
        (tmp_path / "pipe" / folder).rename(tmp_path / f"mnist-{name}")
    zoo = SpeculativeContinuousARPipeline.from_zoo(tmp_path)
    zoo.set_progress_bar_config(disable=True)
    torch.testing.assert_close(zoo([0, 2], generator=torch.Generator().manual_seed(0), **args).images, a)
    (tmp_path / "mnist-mar" / "config.json").write_text('{"_class_name": "MAR", "seq_h": "x"}')
    with pytest.raises(ValueError, match="seq_h"):
        SpeculativeContinuousARPipeline.from_zoo(tmp_path)


def test_clip_denoised_bounds_samples_of_an_inaccurate_head():
    """The cosine schedule's first reverse step amplifies epsilon errors ~2e4x; `clip_denoised` clamps x_start."""
    torch.manual_seed(0)
    head = DiffLossHead(2, 8, depth=1, width=16, num_sampling_steps="10")
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
        g = torch.Generator().manual_seed(0)
        z, x_T, eps = (
            torch.randn(64, 8, generator=g),
            torch.randn(64, 2, generator=g),
            torch.randn(64, 9, 2, generator=g),
        )
        free = head.sample(z, x_T, eps)
        head.clip_denoised = 3.0
        clipped = head.sample(z, x_T, eps)
    assert free.abs().max() > 30 and clipped.abs().max() <= 3.0 + 1e-6


def test_final_step_inverse_survives_a_flat_clamped_head():
    """Where `clip_denoised` clamps, the final step is flat (singular Jacobian): no density, no crash, not converged."""
    from mmspec.decoding.final_step import FinalStep

    torch.manual_seed(0)
    head = DiffLossHead(2, 8, depth=1, width=16, num_sampling_steps="5", clip_denoised=1.0)
    z = torch.randn(6, 8)
    y = torch.tensor([[0.1, -0.2], [5.0, 0.3], [-4.0, -6.0], [0.0, 0.0], [9.0, 9.0], [0.5, 0.4]])
    with torch.no_grad():
        f = FinalStep(head, z, None, torch.ones(6))
        x = f(y)
        _, logdet, converged = f.inverse_logdet(x, y + 0.01)
    assert converged.tolist() == [True, False, False, True, False, True]
    assert torch.isfinite(logdet[converged]).all() and not torch.isfinite(logdet[~converged]).any()


# ----------------------------------------------------------------------------- the shared pipeline tests
def savable_mar(seed, clip=3.0):
    """A tiny MAR of registered classes only (so the pipeline saves and loads), canvas-dependent, with a non-zero
    diffusion head."""
    torch.manual_seed(seed)
    model = MAR(seq_h=2, seq_w=2, token_embed_dim=2, encoder_embed_dim=16, encoder_depth=1, encoder_num_heads=2,
                decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, class_num=3, buffer_size=2, diffloss_d=1,
                diffloss_w=8, num_sampling_steps="3", clip_denoised=clip)  # fmt: skip
    with torch.no_grad():
        for p in [model.mask_token, model.encoder_pos_embed_learned, model.decoder_pos_embed_learned,
                  model.diffusion_pos_embed_learned, model.class_emb.weight]:  # fmt: skip
            p.normal_(0, 1.0)
        for p in model.diffloss.parameters():  # the zero-initialised adaLN / output layers get small weights
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


EXACT = dict(acceptance="continuous", verify_mode="exact", prefill_ratio=0.25)


class TestSpeculativeContinuousARPipeline(SpeculativePipelineTesterMixin):
    """The shared speculative-pipeline tests (tests/pipeline_mixin.py) on a tiny MAR: continuous tokens ``[B, L, D]``
    (unwritten = 0), no greedy mode (lossless = ``verify_mode="exact"``, which with a draft identical to the target
    must reproduce plain MAR sample for sample), rounds counted from the pre-fill steps (round 0)."""

    pipeline_class = SpeculativeContinuousARPipeline
    lossless_methods = [dict(EXACT, num_draft_tokens=3), dict(EXACT, num_draft_tokens=2)]
    deterministic_kwargs = {}
    bad_inputs = [
        (dict(acceptance="fast"), ValueError, "acceptance"),
        (dict(class_labels=[0.5]), ValueError, "class_labels"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(guidance_scale=float("inf")), ValueError, "guidance_scale"),
    ]

    def _pipeline(self, draft_of, clip=3.0):
        target = savable_mar(0, clip)
        pipe = SpeculativeContinuousARPipeline(target, toy_vae(), draft_of(target))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def get_pipeline(self):
        return self._pipeline(lambda target: perturbed(target, 0.1, 1))

    def get_lossless_pipeline(self):
        # a perfect draft (and no clamp, where the final step is flat and has no density): every token accepted,
        # so exact == plain sample for sample
        return self._pipeline(copy.deepcopy, clip=None)

    def get_inputs(self, batch_size):
        return dict(class_labels=[c % 3 for c in range(batch_size)], num_ar_steps=4, output_type="latent")

    def output_tokens(self, out):
        return out.images

    def assert_same_tokens(self, a, b, msg=None):
        torch.testing.assert_close(a, b, msg=str(msg))

    def written_mask(self, tokens):
        return (tokens != 0).any(-1)

    def scored_call(self, pipe):
        return pipe.transformer, "features"

    def check_rounds(self, out, method):
        """Rounds 0 .. P-1 are the target-only steps (one token each on this 2x2 grid with 4 AR steps), later rounds
        CSpD blocks of at most ``num_draft_tokens`` steps, of which only the last kept step can hold a rejection."""
        s, trace = out.stats, out.trace
        batch, num_steps = trace.origin.shape[0], self.get_inputs(1)["num_ar_steps"]
        for b in range(batch):  # rounds are numbered 0 .. R-1 without gaps
            assert sorted(set(trace.round[b].tolist())) == list(range(s.rounds[b])), (method, b)
        if method is self.plain_method:
            assert s.rounds == [num_steps] * batch and s.target_forwards == num_steps and s.draft_forwards == 0
            assert set(trace.origin.unique().tolist()) == {BONUS}
            return
        k, prefill = method["num_draft_tokens"], max(1, round(method["prefill_ratio"] * num_steps))
        assert s.prefill_tokens == [prefill] * batch, method
        assert s.target_forwards == max(s.rounds), method  # pre-fill steps + verification passes
        for b in range(batch):
            assert (trace.origin[b][trace.round[b] < prefill] == PREFILL).all(), (method, b)
            for r in range(prefill, s.rounds[b]):
                origins = trace.origin[b][trace.round[b] == r].tolist()
                assert 1 <= len(origins) <= k and set(origins) <= {ACCEPTED, RESAMPLED}, (method, b, r, origins)
                assert origins.count(RESAMPLED) <= 1, (method, b, r, origins)  # one token per step here


class _BentHead:
    """A head whose noise-free final step is a near-identity bijection bent by its condition:
    ``f(y) = 1.5 y - 0.6 tanh(y + z)``, slope in [0.9, 1.5] (what `FinalStep` calls)."""

    def finish(self, z, y, z_uncond=None, cfg=None):
        return 1.5 * y - 0.6 * torch.tanh(y + z)


def test_exact_final_step_rule_emits_the_targets_law():
    """CSpD's exact rule on one token law, where a draft far from the target gives the residual real weight (the
    whole-pipeline tests above barely see it: there the final step's std is small next to the marginals' spread).
    Draft tokens ``x_q = f_q(y_q)``, kept with ``min(1, p_x / q_x)`` (`finished_accept_prob`), the rest redrawn from
    ``norm([p_x - q_x]_+)`` (`residual_finished`), all through the code's own sampling: the emitted values must have
    the target's law ``x = f_p(y), y ~ N(mu_p, sd_p^2)``. A residual drawn from ``p_x`` itself (no rejection) gives
    ``min(p, q) + (1 - a) p`` instead, which this test rejects (KS p ~ 1e-173), as it rejects a square-rooted
    acceptance ratio (~1e-186) and a draft density without its log-determinant (~1e-16)."""
    from mmspec.decoding.final_step import FinalStep
    from mmspec.decoding.masked import finished_accept_prob, residual_finished

    n, d = 20_000, 2
    g = torch.Generator().manual_seed(0)
    mu_p, sd_p = torch.tensor([[0.0, 0.5]]).expand(n, d), torch.tensor([[1.0, 0.8]]).expand(n, d)
    mu_q, sd_q = torch.tensor([[0.9, 0.0]]).expand(n, d), torch.tensor([[1.2, 0.8]]).expand(n, d)
    head, cfg = _BentHead(), torch.ones(n)
    f_p, f_q = (
        FinalStep(head, torch.full((n, d), 0.3), None, cfg),
        FinalStep(head, torch.full((n, d), -0.4), None, cfg),
    )
    rows = torch.zeros(n, dtype=torch.long)
    with torch.no_grad():
        y_q = mu_q + sd_q * torch.randn(n, d, generator=g)
        x_q, logdet_q = f_q.forward_logdet(y_q)
        accept = torch.rand(n, generator=g) < finished_accept_prob(f_p, x_q, y_q, mu_p, sd_p, mu_q, sd_q, logdet_q)
        idx = (~accept).nonzero()[:, 0]
        residual, fallbacks = residual_finished(f_p.select(idx), f_q.select(idx), mu_p[idx], sd_p[idx], mu_q[idx],
                                                sd_q[idx], rows[idx], g, 1, 1000)  # fmt: skip
        emitted = x_q.clone()
        emitted[idx] = residual
        plain = f_p(mu_p + sd_p * torch.randn(n, d, generator=g))
    assert 0.3 < accept.float().mean() < 0.8 and fallbacks == 0  # both paths carry weight
    for k in range(d):
        p = sps.ks_2samp(emitted[:, k].numpy(), plain[:, k].numpy()).pvalue
        assert p > 1e-3, (k, p)
