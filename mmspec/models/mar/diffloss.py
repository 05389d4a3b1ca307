"""MAR's diffusion-loss head: an AdaLN residual MLP that denoises one continuous token given the transformer's
output ``z`` for it, and the sampler that speculative decoding needs (injected noise, the last stochastic step's
Gaussian, a separate deterministic final step).

Parameter names equal the official ``models/diffloss.py`` (``DiffLoss.net`` = ``SimpleMLPAdaLN``), so the official
MAR checkpoints load into `DiffLossHead` as they are.

Sampling with injected noise (trajectory alignment, CSpD §6.1): ``sample_last_step(z, x_T, eps, cfg, temperature)``
runs the stochastic steps ``S-1 .. 2`` with the given per-step noise and returns the law of the last stochastic step
(``i = 1``) -- ``N(mean, std^2)`` with ``std = sigma_1 * temperature`` -- together with its draw
``y = mean + std * eps[:, -1]``; ``finish(z, y, cfg)`` applies the noise-free ``i = 0`` step. ``sample`` = both, which
is exactly MAR's ``p_sample_loop`` given the same noise.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mmspec.models.mar.diffusion import GaussianDiffusion


__all__ = ["DiffLossHead", "HeadSample", "SimpleMLPAdaLN"]


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """Sinusoidal timestep features (cos first, as upstream) through a 2-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )
        self.frequency_embedding_size = frequency_embedding_size

    def forward(self, t: Tensor) -> Tensor:  # t [N] -> [N, hidden]
        half = self.frequency_embedding_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    """``x + gate * MLP(modulate(LN(x)))`` with shift/scale/gate from the condition ``y``."""

    def __init__(self, channels: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(channels, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(channels, channels), nn.SiLU(), nn.Linear(channels, channels))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 3 * channels))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(_modulate(self.in_ln(x), shift, scale))


class FinalLayer(nn.Module):
    def __init__(self, model_channels: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(model_channels, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(model_channels, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(model_channels, 2 * model_channels))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(_modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """The denoiser: ``(x [N, D], t [N], c [N, z_channels]) -> [N, 2D]`` (epsilon, variance interpolation)."""

    def __init__(self, in_channels: int, model_channels: int, out_channels: int, z_channels: int, num_res_blocks: int):
        super().__init__()
        self.in_channels = in_channels
        self.time_embed = TimestepEmbedder(model_channels)
        self.cond_embed = nn.Linear(z_channels, model_channels)
        self.input_proj = nn.Linear(in_channels, model_channels)
        self.res_blocks = nn.ModuleList([ResBlock(model_channels) for _ in range(num_res_blocks)])
        self.final_layer = FinalLayer(model_channels, out_channels)
        self.initialize_weights()

    def initialize_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.time_embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.time_embed.mlp[2].weight, std=0.02)
        for block in self.res_blocks:  # adaLN-zero: every block starts as the identity
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        for p in [*self.final_layer.adaLN_modulation[-1].parameters(), *self.final_layer.linear.parameters()]:
            nn.init.zeros_(p)

    def forward(self, x: Tensor, t: Tensor, c: Tensor) -> Tensor:
        return self.forward_embedded(x, self.time_embed(t) + self.cond_embed(c))

    def forward_embedded(self, x: Tensor, y: Tensor) -> Tensor:
        """`forward` given the summed time + condition embedding ``y [N, W]`` (samplers embed each once)."""
        x = self.input_proj(x)
        for block in self.res_blocks:
            x = block(x, y)
        return self.final_layer(x, y)


@dataclass
class HeadSample:
    """The last stochastic step of a token's reverse chain (``[N, D]`` each; ``log_std_sum [N]``).

    Attributes:
        value: ``y = mean + std * eps_1``, the input of the deterministic final step.
        mean, std: the step's Gaussian ``N(mean, std^2)`` given the earlier (aligned) noise; ``std`` includes the
            sampling temperature.
        log_std_sum: ``sum_d sum_{i >= 2} log(sigma_i * temperature)`` over the earlier stochastic steps (only for
            reproducing the CSpD release's correction term; the exact rule does not use it).
    """

    value: Tensor
    mean: Tensor
    std: Tensor
    log_std_sum: Tensor


class DiffLossHead(nn.Module):
    """MAR's ``DiffLoss``: the denoiser ``net`` plus its training chain and respaced sampling chain.

    Args:
        target_channels: token dim ``D``.
        z_channels: the transformer output dim.
        depth, width: residual blocks and width of the MLP.
        num_sampling_steps: respaced sampling steps ``S`` (MAR: ``"100"``); must keep at least 2 (one stochastic
            step and the final one).
        clip_denoised: clamp the predicted ``x_start`` to ``[-c, c]`` while sampling (None, upstream's
            ``clip_denoised=False``). The cosine schedule's last step has ``abar ~ 2e-9``: the first reverse step
            multiplies an epsilon error by ``sqrt(1/abar) ~ 2e4`` into ``x_start``, which a briefly trained head cannot
            afford (the MNIST zoo's head: RMS epsilon error 0.06 at t = 999 -> samples diverge); tokens normalised
            to unit std fit in a clamp at a few std.
    """

    def __init__(self, target_channels: int, z_channels: int, depth: int, width: int, num_sampling_steps="100",
                 clip_denoised: float | None = None):  # fmt: skip
        super().__init__()
        self.in_channels = target_channels
        self.clip_denoised = clip_denoised
        self.net = SimpleMLPAdaLN(target_channels, width, 2 * target_channels, z_channels, depth)
        self.train_diffusion = GaussianDiffusion(1000)
        self.set_sampling_steps(num_sampling_steps)

    def set_sampling_steps(self, num_sampling_steps) -> None:
        diffusion = GaussianDiffusion(1000, num_sampling_steps)
        if diffusion.num_steps < 2:
            raise ValueError(f"num_inference_steps must keep >= 2 diffusion steps, got {num_sampling_steps!r}")
        self.gen_diffusion = diffusion

    @property
    def num_sampling_steps(self) -> int:
        return self.gen_diffusion.num_steps

    def loss(self, target: Tensor, z: Tensor, generator: torch.Generator, mask: Tensor | None = None) -> Tensor:
        """Training loss of tokens ``target [N, D]`` given ``z [N, z_channels]`` at random steps (``mask [N]``: rows
        that count)."""
        t = torch.randint(
            0, self.train_diffusion.num_steps, (target.shape[0],), generator=generator, device=target.device
        )
        noise = torch.randn(target.shape, generator=generator, device=target.device, dtype=target.dtype)
        x_t = self.train_diffusion.q_sample(target, t, noise)
        loss = self.train_diffusion.training_losses(self.net(x_t, t, z), target, x_t, t, noise)
        if mask is None:
            return loss.mean()
        return (loss * mask).sum() / mask.sum().clamp_min(1)

    def _embed(self, z: Tensor, z_uncond: Tensor | None) -> Tensor:
        """Condition embeddings of both CFG branches ``[N or 2N, W]`` (computed once per sampling call)."""
        return self.net.cond_embed(z if z_uncond is None else torch.cat([z, z_uncond]))

    def _time_embeddings(self, device) -> Tensor:
        """``[S, W]``: the time embedding of every respaced step, one batched call per sampling call."""
        steps = torch.arange(self.gen_diffusion.num_steps, device=device)
        return self.net.time_embed(self.gen_diffusion.model_timesteps(steps))

    def _eps_var(self, x: Tensor, y: Tensor, cfg: Tensor | None) -> tuple[Tensor, Tensor]:
        """Guided epsilon and the conditional branch's variance output (``[N, D]`` each) given the summed
        embedding ``y`` of both branches.

        CFG as MAR's ``forward_with_cfg``: both branches see the same ``x``; ``eps = eps_u + cfg (eps_c - eps_u)``;
        the variance interpolation comes from the conditional branch."""
        n, d = x.shape
        if cfg is None:
            out = self.net.forward_embedded(x, y)
            return out[:, :d], out[:, d:]
        out = self.net.forward_embedded(torch.cat([x, x]), y)
        cond, uncond = out[:n], out[n:]
        eps = uncond[:, :d] + cfg[:, None] * (cond[:, :d] - uncond[:, :d])
        return eps, cond[:, d:]

    def _step(self, x, i, c_emb, t_emb, cfg):
        """Mean and log-variance of respaced step ``i`` (scalar coefficients: no per-step gathers)."""
        eps, var_values = self._eps_var(x, c_emb + t_emb[i], cfg)
        c = self.gen_diffusion.step_coefficients(i)
        x_start = c["sqrt_recip_alphas_cumprod"] * x - c["sqrt_recipm1_alphas_cumprod"] * eps
        if self.clip_denoised is not None:
            x_start = x_start.clamp(-self.clip_denoised, self.clip_denoised)
        mean = c["posterior_mean_coef1"] * x_start + c["posterior_mean_coef2"] * x
        frac = (var_values + 1) / 2
        logvar = frac * c["log_betas"] + (1 - frac) * c["posterior_log_variance_clipped"]
        return mean, logvar

    @staticmethod
    def _cfg(cfg, n: int, like: Tensor) -> Tensor:
        return torch.as_tensor(cfg, dtype=like.dtype, device=like.device).expand(n)

    def sample_last_step(
        self,
        z: Tensor,
        x_T: Tensor,
        noise: Tensor,
        *,
        z_uncond: Tensor | None = None,
        cfg: float | Tensor = 1.0,
        temperature: float = 1.0,
    ) -> HeadSample:
        """Run the stochastic steps with injected noise; return the last one's Gaussian and draw (`HeadSample`).

        Args:
            z: ``[N, z_channels]`` conditions (the conditional CFG branch when ``z_uncond`` is given).
            x_T: ``[N, D]`` initial noise.
            noise: ``[N, S-1, D]`` the per-step noise of steps ``S-1 .. 1`` (in the order they are applied).
            z_uncond: ``[N, z_channels]`` the unconditional branch (None = no guidance).
            cfg: guidance scale, a float or ``[N]`` (one per token).
            temperature: scales every stochastic step's noise (MAR's diffusion temperature).
        """
        steps = self.gen_diffusion.num_steps
        if noise.shape != (*x_T.shape[:1], steps - 1, x_T.shape[1]):
            raise ValueError(f"noise must be [N, {steps - 1}, D] for {steps} sampling steps, got {tuple(noise.shape)}")
        cfg = None if z_uncond is None else self._cfg(cfg, x_T.shape[0], x_T)
        c_emb, t_emb = self._embed(z, z_uncond), self._time_embeddings(x_T.device)
        x, log_std_sum = x_T, torch.zeros(x_T.shape[0], dtype=x_T.dtype, device=x_T.device)
        for j, i in enumerate(range(steps - 1, 0, -1)):
            mean, logvar = self._step(x, i, c_emb, t_emb, cfg)
            std = (0.5 * logvar).exp() * temperature
            if i == 1:
                return HeadSample(mean + std * noise[:, j], mean, std.expand_as(mean), log_std_sum)
            x = mean + std * noise[:, j]
            log_std_sum = log_std_sum + std.log().expand_as(mean).sum(-1)
        raise AssertionError("unreachable: at least one stochastic step")

    def finish(self, z: Tensor, y: Tensor, *, z_uncond: Tensor | None = None, cfg: float | Tensor = 1.0) -> Tensor:
        """The noise-free final step ``x_0 = mean_0(y)`` (``[N, D]``)."""
        cfg = None if z_uncond is None else self._cfg(cfg, y.shape[0], y)
        t_emb = self.net.time_embed(
            self.gen_diffusion.model_timesteps(torch.zeros(1, dtype=torch.long, device=y.device))
        )
        mean, _ = self._step(y, 0, self._embed(z, z_uncond), t_emb, cfg)
        return mean

    def sample(self, z, x_T, noise, *, z_uncond=None, cfg=1.0, temperature=1.0) -> Tensor:
        """A full reverse chain with injected noise (= MAR's ``p_sample_loop`` given the same ``x_T`` and noise)."""
        last = self.sample_last_step(z, x_T, noise, z_uncond=z_uncond, cfg=cfg, temperature=temperature)
        return self.finish(z, last.value, z_uncond=z_uncond, cfg=cfg)


def _pad_rows(width: int, *tensors: Tensor | None) -> list[Tensor | None]:
    """Pad dim 0 of every tensor with zeros to `width` rows (None and 0-d stay as they are)."""
    out = []
    for t in tensors:
        if t is None or t.dim() == 0 or t.shape[0] == width:
            out.append(t)
        else:
            out.append(torch.cat([t, t.new_zeros(width - t.shape[0], *t.shape[1:])]))
    return out


class CapturedSampler:
    """A `DiffLossHead` whose sampler runs captured (`mmspec.decoding.compiled`, `pipe.enable_compile`): the whole
    reverse chain of `sample_last_step` (every stochastic step, the noise injected) is one graph, and so is `finish`.
    The head treats every token on its own, so the `N` tokens of a step are padded with zero rows to the next power of
    two (a few shapes over a whole generation) and the outputs cut back: the real rows are those of the eager head.
    Every other attribute is the head's."""

    def __init__(self, head: DiffLossHead, compiler, role: str = "head"):
        self.head, self.compiler, self.role = head, compiler, role
        head.gen_diffusion.step_coefficients(0)  # the schedule's Python floats, read on the host before tracing

    def __getattr__(self, name):
        return getattr(self.head, name)

    @staticmethod
    def bucket(n: int) -> int:
        return 1 << max(0, int(n) - 1).bit_length()

    def _last(self, z, x_T, noise, z_uncond, cfg, temperature):
        out = self.head.sample_last_step(z, x_T, noise, z_uncond=z_uncond, cfg=cfg, temperature=temperature)
        return out.value, out.mean, out.std, out.log_std_sum

    def _finish(self, z, y, z_uncond, cfg):
        return self.head.finish(z, y, z_uncond=z_uncond, cfg=cfg)

    def sample_last_step(self, z, x_T, noise, *, z_uncond=None, cfg=1.0, temperature=1.0) -> HeadSample:
        n = x_T.shape[0]
        self.head.gen_diffusion.place(x_T.device)
        cfg = torch.as_tensor(cfg, dtype=x_T.dtype, device=x_T.device).expand(n)
        padded = _pad_rows(self.bucket(n), z, x_T, noise, z_uncond, cfg)
        run = self.compiler.forward(self.role + "_sampler", self.head, self._last)
        return HeadSample(*(t[:n] for t in run(*padded, float(temperature))))

    def finish(self, z, y, *, z_uncond=None, cfg=1.0) -> Tensor:
        n = y.shape[0]
        self.head.gen_diffusion.place(y.device)
        cfg = torch.as_tensor(cfg, dtype=y.dtype, device=y.device).expand(n)
        run = self.compiler.forward(self.role + "_finish", self.head, self._finish)
        return run(*_pad_rows(self.bucket(n), z, y, z_uncond, cfg))[:n]
