"""The law of a MAR token *after* the head's noise-free final step, for verifying emitted values exactly.

A head's token is ``x = f(y)``: ``y ~ N(mean, std^2)`` is the last stochastic step (given the earlier, shared noise)
and ``f(y) = c1 y - c2 eps_hat(y, z)`` is the deterministic ``i = 0`` step (the posterior mean at ``i = 0`` is the
predicted ``x_start``; ``c2 = sqrt(1/abar_0 - 1)`` is small, ~0.006 on MAR's cosine schedule, so ``f`` is a
near-identity bijection). By change of variables

    log density_x(x) = log N(f^{-1}(x); mean, std^2) - log |det J_f(f^{-1}(x))|

with ``J_f = c1 I - c2 d eps_hat / d y`` (``D x D`` per token: ``D`` forward-mode JVPs, batched into one call) and
``f^{-1}`` by Newton's method
(``y <- y - J_f^{-1} (f(y) - x)``, started at a nearby ``y``). `FinalStep` gives both for one model, its conditions and
its CFG scales; ``converged`` flags tokens whose inverse did not reach the tolerance or whose Jacobian is singular
(where a head's ``clip_denoised`` clamp is active ``f`` is flat: no density); the caller treats them as rejected.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mmspec.counting import host_checks_enabled


__all__ = ["FinalStep", "gaussian_logpdf"]


def gaussian_logpdf(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Diagonal Gaussian log-density summed over the last dim ``[...]``."""
    z = (x - mean) / std
    return (-0.5 * z.pow(2) - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)


@dataclass
class FinalStep:
    """``f(y)`` of one head for ``N`` tokens: conditions ``z [N, Z]`` (and ``z_uncond``), CFG scales ``cfg [N]``."""

    head: object  # DiffLossHead
    z: Tensor
    z_uncond: Tensor | None
    cfg: Tensor

    def select(self, index: Tensor) -> "FinalStep":
        zu = None if self.z_uncond is None else self.z_uncond[index]
        return FinalStep(self.head, self.z[index], zu, self.cfg[index])

    def repeat(self, times: int) -> "FinalStep":
        zu = None if self.z_uncond is None else self.z_uncond.repeat(times, 1)
        return FinalStep(self.head, self.z.repeat(times, 1), zu, self.cfg.repeat(times))

    def __call__(self, y: Tensor) -> Tensor:
        return self.head.finish(self.z, y, z_uncond=self.z_uncond, cfg=self.cfg)

    def jacobian(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """``f(y) [N, D]`` and ``J_f(y) [N, D, D]`` (``J[n, i, j] = d f_i / d y_j``).

        One forward-mode JVP over ``D`` stacked copies of the tokens, copy ``j`` pushed along the ``j``-th axis: the
        head treats every token on its own, so this is ``D`` JVPs in one call (a ``D``-times larger batch instead of
        ``D`` calls; each call's ops are small, so their count is the cost)."""
        n, d = y.shape
        tangent = torch.eye(d, dtype=y.dtype, device=y.device).repeat_interleave(n, dim=0)  # copy j: e_j per token
        out, cols = torch.func.jvp(self.repeat(d), (y.repeat(d, 1),), (tangent,))
        return out[:n], cols.view(d, n, d).permute(1, 2, 0)

    def forward_logdet(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """``x = f(y)`` and ``log |det J_f(y)|`` ``[N]``."""
        x, jac = self.jacobian(y)
        return x, torch.linalg.slogdet(jac.double())[1].to(y.dtype)

    def inverse_logdet(self, x: Tensor, y0: Tensor, iters: int = 8, tol: float = 1e-5):
        """``y = f^{-1}(x)`` by Newton from ``y0``, ``log |det J_f(y)|`` and ``converged [N]`` bool.

        Newton stops once every token converged: on a CPU by a read per step (free there); elsewhere without a read,
        running all ``iters + 1`` steps with ``y`` frozen from the first converged one, which gives the same result.
        """
        y = y0.clone()
        read = host_checks_enabled(y.device)
        done = torch.zeros((), dtype=torch.bool, device=y.device)
        for _ in range(iters + 1):
            fx, jac = self.jacobian(y)
            converged = ((fx - x).abs() <= tol * (1 + x.abs())).all(-1) & torch.isfinite(y).all(-1)
            if read and bool(converged.all()):  # a CPU: the read is free
                break
            done = done | converged.all()
            step, info = torch.linalg.solve_ex(jac.double(), (fx - x).double()[..., None])
            new = y - torch.where(info[:, None] == 0, step[..., 0], 0.0).to(y.dtype)  # singular J: stays put
            y = new if read else torch.where(done, y, new)
        logdet = torch.linalg.slogdet(jac.double())[1].to(y.dtype)
        return y, logdet, converged & torch.isfinite(logdet)

    def log_density(self, x: Tensor, mean: Tensor, std: Tensor, y0: Tensor) -> tuple[Tensor, Tensor]:
        """``log density_x(x) [N]`` of ``x = f(y), y ~ N(mean, std^2)``, and ``converged [N]``."""
        y, logdet, converged = self.inverse_logdet(x, y0)
        return gaussian_logpdf(y, mean, std) - logdet, converged
