"""MAR's diffusion-head sampler captured (`pipe.enable_compile`, `mmspec.models.mar.diffloss.CapturedSampler`): the
whole reverse chain is one graph with no break, no recompile over whole generations, seeded outputs as eager's."""

import pytest
import torch

from mmspec.models.mar.diffloss import CapturedSampler, DiffLossHead
from mmspec.models.mar.kl_vae import AutoencoderKL
from mmspec.models.mar.model import MAR
from mmspec.pipelines import SpeculativeContinuousARPipeline


def toy_mar(seed):
    torch.manual_seed(seed)
    model = MAR(seq_h=2, seq_w=2, token_embed_dim=2, encoder_embed_dim=16, encoder_depth=1, encoder_num_heads=2,
                decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, class_num=3, buffer_size=2,
                diffloss_d=1, diffloss_w=16, num_sampling_steps="8")  # fmt: skip
    with torch.no_grad():
        for p in model.diffloss.parameters():
            p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=1, out_channels=1, ch=8, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(),
                        resolution=4, embed_dim=2, num_groups=4).eval()  # fmt: skip
    return toy_mar(0), toy_mar(1), vae


def sample(pipe, seed=0, labels=(1, 2, 0), steps=3, **kw):
    out = pipe(list(labels), output_type="latent", generator=torch.Generator().manual_seed(seed), num_ar_steps=steps,
               guidance_scale=2.0, **kw)  # fmt: skip
    return out.images


def test_sampler_is_one_graph():
    """`_dynamo.explain` of the head's whole stochastic chain (7 steps, CFG, injected noise) and of its final step:
    1 graph, 0 breaks each."""
    head = DiffLossHead(target_channels=2, z_channels=8, depth=1, width=16, num_sampling_steps="8").eval()
    sampler = CapturedSampler(head, compiler=None)
    z, zu, x_T, noise = torch.randn(5, 8), torch.randn(5, 8), torch.randn(5, 2), torch.randn(5, 7, 2)
    cfg = torch.full((5,), 2.0)
    with torch.no_grad():
        for fn, args in ((sampler._last, (z, x_T, noise, zu, cfg, 1.0)), (sampler._finish, (z, x_T, zu, cfg))):
            explained = torch._dynamo.explain(fn)(*args)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("speculative", [False, True])
def test_no_recompile_and_eager_outputs(parts, speculative):
    """Whole generations (plain, speculative): a few padded sampler shapes, each compiled once; a second call
    compiles nothing; the seeded latents are eager's."""
    target, draft, vae = parts
    kw = dict(acceptance="continuous", num_draft_tokens=2) if speculative else {}
    eager = SpeculativeContinuousARPipeline(target, vae, draft)
    pipe = SpeculativeContinuousARPipeline(target, vae, draft).enable_compile(backend="aot_eager")
    first = sample(pipe, **kw)
    report = pipe.compile_report()
    torch.testing.assert_close(first, sample(eager, **kw), rtol=0, atol=0)
    torch.testing.assert_close(sample(pipe, seed=1, **kw), sample(eager, seed=1, **kw), rtol=0, atol=0)
    again = pipe.compile_report()
    assert set(again) >= {"head_sampler", "head_finish"}
    for role, counts in again.items():
        assert counts["recompiles"] == 0 and counts["graphs"] == counts["shapes"] == report[role]["graphs"], role


@pytest.fixture(scope="module")
def inductor(parts):
    target, draft, vae = parts
    return SpeculativeContinuousARPipeline(target, vae, draft).enable_compile()


def test_inductor_outputs_equal_eager(parts, inductor):
    """Under CPU inductor (one image, 2 AR steps of 2 tokens: one sampler shape) the seeded latents are eager's (to
    float rounding: inductor fuses the head's arithmetic differently), with no recompile."""
    target, draft, vae = parts
    eager = SpeculativeContinuousARPipeline(target, vae, draft)
    kw = dict(labels=(1,), steps=2)
    torch.testing.assert_close(sample(inductor, **kw), sample(eager, **kw), rtol=1e-4, atol=1e-5)
    assert all(counts["recompiles"] == 0 for counts in inductor.compile_report().values())


def test_captured_sampler_graphs_take_no_host_tensors():
    """A CUDA graph skips any graph with a host tensor among its inputs: seen on an H200, where the respaced step map
    (`timestep_map`, kept on the CPU) was one, so MAR's captured sampler ran uncaptured. The sampler puts the
    schedule on the inputs' device before its graphs run. The device here is `meta` (no accelerator needed): every
    input of both graphs dynamo hands its backend must be on it."""
    head = DiffLossHead(target_channels=2, z_channels=8, depth=1, width=16, num_sampling_steps="8").eval()
    head.to("meta")
    seen = []

    def backend(gm, example_inputs):
        seen.extend(x.device.type for x in example_inputs if isinstance(x, torch.Tensor))
        return gm.forward

    class Record:
        def forward(self, role, module, fn):
            return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)

    sampler = CapturedSampler(head, compiler=Record())
    z, zu, x_T, noise = (torch.empty(shape, device="meta") for shape in ((5, 8), (5, 8), (5, 2), (5, 7, 2)))
    with torch.no_grad():
        sampler.sample_last_step(z, x_T, noise, z_uncond=zu, cfg=2.0)
        sampler.finish(z, x_T, z_uncond=zu, cfg=2.0)
    assert seen and set(seen) == {"meta"}, seen


def test_eager_head_calls_copy_the_schedule_to_the_device_once():
    """The eager sampler's schedule lookups (`model_timesteps`, `coef`) index tensors kept on the inputs' device: the
    first call copies the schedule there, later calls copy nothing (before: a host-to-device copy of the step map
    and of a coefficient array on every head call). Counted on the `meta` device (no accelerator needed): copies
    dispatched by the second round of lookups."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mmspec.models.mar.diffusion import GaussianDiffusion

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
                Copies.count += 1
            return func(*args, **(kwargs or {}))

    diffusion = GaussianDiffusion(1000, "8")
    t, like = torch.zeros(5, dtype=torch.long, device="meta"), torch.empty(5, 2, device="meta", dtype=torch.float64)

    def lookups():
        diffusion.model_timesteps(t)
        diffusion.coef("sqrt_alphas_cumprod", t, like)

    lookups()
    with Copies():
        lookups()
    assert Copies.count == 0
    assert diffusion.model_timesteps(torch.tensor([0, 7])).tolist() == diffusion.timestep_map[[0, 7]].tolist()
