"""Gaussian diffusion for MAR's per-token diffusion head: cosine schedule, respacing, epsilon prediction with a
learned-range variance (IDDPM / ADM conventions, as MAR's ``diffusion/`` package).

Notation (respaced chain of ``S`` steps, index ``i = S-1 .. 0``; ``i`` maps to the original step ``timestep_map[i]``):

    x_T ~ N(0, I)
    x_{i-1} = mean_i(x_i) + std_i * temperature * eps_i         for i = S-1 .. 1   (stochastic steps)
    x_0     = mean_0(x_1)                                         (i = 0: no noise, the mean is the sample)

``mean_i`` is the posterior mean at the predicted ``x_start = (x - sqrt(1 - abar) eps_hat) / sqrt(abar)``; the
learned variance interpolates ``log beta`` and the clipped posterior log-variance with the model's second output
``v in [-1, 1]``: ``log var = (v + 1)/2 log beta + (1 - v)/2 log posterior_var``. Everything is float64 on the host
at construction and cast per call.
"""

import math

import numpy as np
import torch
from torch import Tensor


__all__ = ["GaussianDiffusion", "cosine_betas", "space_timesteps"]


def cosine_betas(num_steps: int, max_beta: float = 0.999) -> np.ndarray:
    """IDDPM's cosine schedule: ``abar(t) = cos^2((t + 0.008) / 1.008 * pi / 2)``, betas from consecutive ratios."""

    def abar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return np.array([min(1 - abar((i + 1) / num_steps) / abar(i / num_steps), max_beta) for i in range(num_steps)])


def space_timesteps(num_steps: int, sections: int | str | list[int]) -> list[int]:
    """The original steps kept by respacing into ``sections`` (an int, ``"100"``, ``"10,15,20"``, or a list): each
    equal part of ``range(num_steps)`` contributes evenly strided steps (rounded), as IDDPM's ``space_timesteps``."""
    if isinstance(sections, str):
        if sections.startswith("ddim"):
            raise ValueError(f"num_sampling_steps={sections!r}: DDIM striding is not supported")
        sections = [int(s) for s in sections.split(",")]
    elif isinstance(sections, int):
        sections = [sections]
    size_per, extra = divmod(num_steps, len(sections))
    start, steps = 0, []
    for i, count in enumerate(sections):
        size = size_per + (1 if i < extra else 0)
        if not 1 <= count <= size:
            raise ValueError(f"num_sampling_steps: cannot divide {size} steps into {count}")
        stride = 1 if count <= 1 else (size - 1) / (count - 1)
        steps += [start + round(stride * j) for j in range(count)]
        start += size
    return sorted(set(steps))


class GaussianDiffusion:
    """A (respaced) Gaussian diffusion with epsilon prediction and learned-range variance.

    Args:
        num_train_steps: steps of the training chain (1000 in MAR).
        sampling_steps: kept steps (int or IDDPM section string); None keeps all (the training chain).
    """

    def __init__(self, num_train_steps: int = 1000, sampling_steps: int | str | None = None):
        base = cosine_betas(num_train_steps)
        keep = (
            list(range(num_train_steps))
            if sampling_steps is None
            else space_timesteps(num_train_steps, sampling_steps)
        )
        abar_base = np.cumprod(1.0 - base)
        betas, last = [], 1.0
        for i in keep:  # respaced betas keep the kept steps' alpha-bar
            betas.append(1 - abar_base[i] / last)
            last = abar_base[i]
        betas = np.array(betas, dtype=np.float64)
        self.num_steps = len(betas)
        self.timestep_map = torch.tensor(keep, dtype=torch.long, device="cpu")  # not the meta device of lazy init
        self._step_map = self.timestep_map  # the host copy every device's copy is made from (`_on`)
        abar = np.cumprod(1.0 - betas)
        abar_prev = np.append(1.0, abar[:-1])
        post_var = betas * (1.0 - abar_prev) / (1.0 - abar)
        post_logvar = np.log(np.append(post_var[1], post_var[1:])) if self.num_steps > 1 else np.log(betas)
        arrays = {
            "betas": betas,
            "alphas_cumprod": abar,
            "sqrt_alphas_cumprod": np.sqrt(abar),
            "sqrt_one_minus_alphas_cumprod": np.sqrt(1.0 - abar),
            "sqrt_recip_alphas_cumprod": np.sqrt(1.0 / abar),
            "sqrt_recipm1_alphas_cumprod": np.sqrt(1.0 / abar - 1),
            "posterior_variance": post_var,
            "posterior_log_variance_clipped": post_logvar,
            "posterior_mean_coef1": betas * np.sqrt(abar_prev) / (1.0 - abar),
            "posterior_mean_coef2": (1.0 - abar_prev) * np.sqrt(1.0 - betas) / (1.0 - abar),
            "log_betas": np.log(betas),
        }
        self._host_arrays = arrays  # numpy: `step_coefficients` reads these, not tensors
        self._arrays = {k: torch.from_numpy(v) for k, v in arrays.items()}
        self._placed = {}  # device -> the schedule's tensors there (`_on`)

    def step_coefficients(self, i: int) -> dict[str, float]:
        """Every schedule array at step ``i`` as Python floats (samplers at one step for all tokens)."""
        if not hasattr(self, "_floats"):
            self._floats = [{k: float(v[j]) for k, v in self._host_arrays.items()} for j in range(self.num_steps)]
        return self._floats[i]

    def _on(self, device) -> dict[str, Tensor]:
        """The schedule's tensors (every array and ``timestep_map``) on `device`, copied there once per device and
        kept: a head call on an accelerator then indexes tensors already there, with no host-to-device copy."""
        device = torch.device(device)
        # a plain attribute, read while a captured sampler traces: torch 2.11's dynamo cannot trace
        # `__dict__.setdefault` (an H200 run hit it)
        placed = self._placed
        if device not in placed:
            placed[device] = {k: v.to(device) for k, v in (*self._arrays.items(), ("steps", self._step_map))}
        return placed[device]

    def coef(self, name: str, t: Tensor, like: Tensor) -> Tensor:
        """``name[t]`` as ``like``'s dtype/device, broadcast over the last dim: ``[N, 1]`` for ``t [N]``."""
        return self._on(like.device)[name][t.to(like.device)].to(like.dtype)[:, None]

    def place(self, device) -> None:
        """Keep the step map on `device` (a captured sampler calls this before its graph runs, so the graph reads a
        tensor of its own device: a host-side input would keep CUDA graphs from capturing it)."""
        self.timestep_map = self._on(device)["steps"]

    def model_timesteps(self, t: Tensor) -> Tensor:
        """The original-chain step the network is conditioned on (respacing's wrapped model)."""
        return self._on(t.device)["steps"][t]

    def q_sample(self, x_start: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """``x_t = sqrt(abar_t) x_start + sqrt(1 - abar_t) noise``."""
        return (
            self.coef("sqrt_alphas_cumprod", t, x_start) * x_start
            + self.coef("sqrt_one_minus_alphas_cumprod", t, x_start) * noise
        )

    def q_posterior(self, x_start: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and clipped log-variance of ``q(x_{t-1} | x_t, x_start)``."""
        mean = self.coef("posterior_mean_coef1", t, x_t) * x_start + self.coef("posterior_mean_coef2", t, x_t) * x_t
        return mean, self.coef("posterior_log_variance_clipped", t, x_t).expand_as(x_t)

    def p_mean_logvar(self, eps: Tensor, var_values: Tensor, x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """``p(x_{t-1} | x_t)``: mean and log-variance from the network's ``eps [N, D]`` and ``var_values [N, D]``."""
        min_log = self.coef("posterior_log_variance_clipped", t, x)
        max_log = self.coef("log_betas", t, x)
        frac = (var_values + 1) / 2
        logvar = frac * max_log + (1 - frac) * min_log
        x_start = (
            self.coef("sqrt_recip_alphas_cumprod", t, x) * x - self.coef("sqrt_recipm1_alphas_cumprod", t, x) * eps
        )
        mean, _ = self.q_posterior(x_start, x, t)
        return mean, logvar

    def training_losses(self, model_out: Tensor, x_start: Tensor, x_t: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """IDDPM's hybrid loss per row ``[N]``: epsilon MSE + the variational term (bits/dim) with the mean frozen,
        so the variance is learned by the bound without pulling on the epsilon prediction. At ``t = 0`` the bound's
        term is the decoder NLL of a Gaussian discretised to 2/255 bins, as upstream."""
        dim = x_start.shape[-1]
        eps, var_values = model_out[:, :dim], model_out[:, dim:]
        mse = (noise - eps).pow(2).mean(-1)
        true_mean, true_logvar = self.q_posterior(x_start, x_t, t)
        mean, logvar = self.p_mean_logvar(eps.detach(), var_values, x_t, t)
        kl = 0.5 * (
            -1.0 + logvar - true_logvar + (true_logvar - logvar).exp() + (true_mean - mean).pow(2) * (-logvar).exp()
        )
        kl = kl.mean(-1) / math.log(2.0)
        nll = -_discretized_gaussian_loglik(x_start, mean, 0.5 * logvar).mean(-1) / math.log(2.0)
        return mse + torch.where(t == 0, nll, kl)


def _approx_normal_cdf(x: Tensor) -> Tensor:
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _discretized_gaussian_loglik(x: Tensor, mean: Tensor, log_scale: Tensor) -> Tensor:
    """Log-likelihood of ``x`` under a Gaussian discretised to bins of width 2/255 on [-1, 1] (ADM's decoder term)."""
    centered, inv_std = x - mean, torch.exp(-log_scale)
    cdf_plus = _approx_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = _approx_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = cdf_plus.clamp(min=1e-12).log()
    log_one_minus_cdf_min = (1.0 - cdf_min).clamp(min=1e-12).log()
    log_delta = (cdf_plus - cdf_min).clamp(min=1e-12).log()
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))
