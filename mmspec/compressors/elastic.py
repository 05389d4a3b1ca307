"""`Elastic(experts, dim)`: SpecVLM's elastic visual compressor in its default mode, dynamic selection (arXiv
2509.11815): a question-conditioned gate `Linear(dim, n_experts)` picks ONE expert per input (prune, pool, conv,
resampler, text-only: `mmspec.compressors.default_experts`). At inference (`not self.training`) the gate's argmax;
in training a Gumbel-softmax draw (temperature `tau`) with the hard straight-through one-hot: the chosen expert's
tokens are multiplied by the straight-through weight (1 in value), so the gate gets gradients through them.

Rows may choose different experts: every expert runs on every row (fixed shapes: no host read of the gate's choice)
and each row keeps its chosen expert's tokens, padded to the widest expert (on a CPU trimmed to the longest row). `choice` records the expert per row (-1: a row without image, which gets no tokens).

Images of different sizes (`VisionTokens.layout`) go to every expert with their layout (each expert's ragged path).
"""

import math

import torch
from torch import Tensor, nn

from mmspec.compressors.base import VisionPolicy, VisionTokens, check_question, check_vision_tokens, is_ragged
from mmspec.counting import host_checks_enabled


__all__ = ["Elastic"]


class Elastic(VisionPolicy):
    """One expert per row, chosen by a gate on the question embedding.

    Args:
        experts: name -> `VisionPolicy`, all with the same `tokens_per_image` (the gate's order is the dict's).
        dim: the question / token width.
        tau: the Gumbel-softmax temperature (training).
        generator: draws the gate's initial weights (no global RNG).
    """

    def __init__(
        self,
        experts: dict[str, VisionPolicy],
        dim: int,
        tau: float = 1.0,
        generator: torch.Generator | None = None,
    ):
        if not isinstance(experts, dict) or not experts:
            raise ValueError(f"experts must be a non-empty dict name -> VisionPolicy, got {experts!r}")
        for name, expert in experts.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"experts: bad expert name {name!r} (a non-empty string without '.')")
            if not isinstance(expert, VisionPolicy) or isinstance(expert, Elastic):
                raise TypeError(f"experts[{name!r}] must be a VisionPolicy (not Elastic), got {type(expert).__name__}")
        sizes = {expert.tokens_per_image for expert in experts.values()}
        if len(sizes) != 1:
            raise ValueError(f"experts disagree on tokens_per_image: {sorted(sizes)}")
        if dim is None:
            raise ValueError("dim is required for Elastic (the gate is dim wide)")
        super().__init__(sizes.pop(), dim)
        for name, expert in experts.items():
            if expert.dim is not None and expert.dim != dim:
                raise ValueError(f"experts[{name!r}] was built for dim {expert.dim}, Elastic for dim {dim}")
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
        self.tau = float(tau)
        self.names = list(experts)
        self.experts = nn.ModuleDict(experts)
        self.has_global = any(expert.has_global for expert in experts.values())
        self.keep = max(expert.keep for expert in experts.values())  # tokens_out: the most any expert keeps
        self.forced: str | None = None  # an ablation: every input to this expert (`force`), inference only
        self.gate = nn.Linear(dim, len(experts), device="meta")
        self.gate.to_empty(device="cpu")
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Gate weights ~ N(0, dim^-0.5), zero bias."""
        nn.init.normal_(self.gate.weight, 0.0, self.dim**-0.5, generator=generator)
        nn.init.zeros_(self.gate.bias)

    def force(self, name: str | None):
        """Send every input to expert `name` at inference (the per-compressor ablation of SpecVLM); None: the gate
        decides again. Training always uses the gate."""
        if name is not None and name not in self.names:
            raise ValueError(f"name: unknown expert {name!r}; this gate has {self.names}")
        self.forced = name
        return self

    def kept(self, length: int, grid=None) -> int:
        """The most any expert keeps of such an image (a bound: the gate's choice is not known on the host)."""
        return max(expert.kept(length, grid) for expert in self.experts.values())

    def gate_weights(self, question: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """`question [rows, dim]` -> (`choice [rows]` long, `weight [rows]`: 1 in value; in training the
        straight-through Gumbel-softmax weight of the chosen expert, which carries the gate's gradient)."""
        logits = self.gate(question.to(self.gate.weight.dtype)).float()  # [rows, E]
        if not self.training:
            choice = logits.argmax(dim=1)
            if self.forced is not None:
                choice = torch.full_like(choice, self.names.index(self.forced))
            return choice, torch.ones_like(logits[:, 0])
        if not isinstance(generator, torch.Generator):
            raise ValueError("generator: Elastic in training mode draws Gumbel noise and needs a torch.Generator")
        uniform = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float32)
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-10, 1.0 - 1e-7)))  # [rows, E]
        soft = torch.softmax((logits + gumbel) / self.tau, dim=1)  # [rows, E]
        choice = soft.argmax(dim=1)
        hard = torch.nn.functional.one_hot(choice, soft.shape[1]).to(soft.dtype)
        straight = hard - soft.detach() + soft  # value: one-hot; gradient: the softmax's
        return choice, straight.gather(1, choice[:, None])[:, 0]

    def forward(self, image: VisionTokens, question: Tensor | None = None, generator=None) -> VisionTokens:
        """`question [rows, dim]` is required (the gate reads it)."""
        if question is None:
            raise ValueError("question is required by Elastic: its gate chooses an expert from the question")
        if is_ragged(getattr(image, "layout", None), self.tokens_per_image):  # images of different sizes
            check_vision_tokens(image, self.tokens_per_image, self.dim)
            check_question(question, image.tokens.shape[0], image.tokens.shape[2])
            has_image = torch.tensor([len(row) > 0 for row in image.layout.lengths], dtype=torch.bool,
                                     device=image.tokens.device)  # fmt: skip  # [rows]
            sub = VisionTokens(image.tokens, image.positions, image.valid, host_counts=image.layout.counts,
                               layout=image.layout)  # fmt: skip
        else:
            batch = self.split(image, question)  # checks image and question
            has_image = batch.present.any(dim=1)  # [rows]
            sub = VisionTokens(image.tokens, image.positions, image.valid,
                               host_counts=[n * self.tokens_per_image for n in batch.host_images])  # fmt: skip
        rows, _, dim = image.tokens.shape
        choice, weight = self.gate_weights(question, generator)
        choice = torch.where(has_image, choice, torch.full_like(choice, -1))  # [rows]
        # every expert runs on every row (fixed shapes, no read of the gate's choice; once per call, at the draft's
        # prefill) and each row keeps its chosen expert's tokens; an expert's output on a row does not depend on the
        # other rows
        outputs = [self.experts[name](sub, question, generator=generator) for name in self.names]
        most = max(out.tokens.shape[1] for out in outputs)
        tokens = image.tokens.new_zeros(rows, most, dim)  # [rows, M, dim]
        positions = torch.zeros(rows, most, dtype=torch.long, device=tokens.device)  # [rows, M]
        valid = torch.zeros(rows, most, dtype=torch.bool, device=tokens.device)  # [rows, M]
        global_vec = image.tokens.new_zeros(rows, dim) if self.has_global else None  # [rows, dim]
        scale = weight.to(tokens.dtype)  # [rows]
        for index, out in enumerate(outputs):
            m = out.tokens.shape[1]
            mine = choice == index  # [rows]
            pad = most - m
            tokens = torch.where(mine[:, None, None], nn.functional.pad(out.tokens * scale[:, None, None], (0, 0, 0, pad)),
                                 tokens)  # fmt: skip
            positions = torch.where(mine[:, None], nn.functional.pad(out.positions, (0, pad)), positions)
            valid = torch.where(mine[:, None], nn.functional.pad(out.valid, (0, pad)), valid)
            if global_vec is not None and out.global_vec is not None:
                global_vec = torch.where(mine[:, None], out.global_vec * scale[:, None], global_vec)
        if host_checks_enabled(valid.device):  # on a CPU (a free read): trimmed to the longest row, as the rows chose
            most = int(valid.sum(1).max()) if rows else 0
            tokens, positions, valid = tokens[:, :most], positions[:, :most], valid[:, :most]
        return VisionTokens(tokens, positions, valid, global_vec=global_vec, choice=choice)
