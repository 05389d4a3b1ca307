"""`PackedLinears`: the pipelines' `enable_packed_linear` / `disable_packed_linear` (oneDNN-packed CPU linears,
`mmspec.models.packed_linear`; `docs/pipelines.md`, "Packed CPU linears")."""

import torch

from mmspec.memory import Term, check_memory
from mmspec.models.packed_linear import pack_linears, packed_bytes, unpack_linears


__all__ = ["PackedLinears"]


class PackedLinears:
    """Mixin of the pipelines: `pipe.enable_packed_linear()` runs the multi-row linears of every model component
    (target, draft model, heads, tokenizer models) on CPU through oneDNN-packed weights, so a K-token verification
    costs about a one-token step there; one-row products (plain decoding, a chain's draft steps) keep
    `torch.nn.functional.linear`. Off by default (it holds a second copy of the float32 linear weights)."""

    def _modules_to_pack(self):
        return [m for m in self.components.values() if isinstance(m, torch.nn.Module)]

    def enable_packed_linear(self, budget=None):
        """Swap the components' linears to `mmspec.models.packed_linear.PackedLinear` in place (transformers'
        `generate` on the same model then uses them too); returns the pipeline.

        Args:
            budget: bytes the packed copies may take (default: `mmspec.memory`'s budget of the machine, or
                `$MMSPEC_MEMORY_BUDGET`): refused with a `MemoryBudgetError` naming the estimate when they need
                more. ValueError when torch has no oneDNN CPU kernels."""
        models = self._modules_to_pack()
        extra = packed_bytes(*models)
        check_memory([Term("packed linear weights (a float32 copy of every CPU linear weight)", extra)],
                     torch.device("cpu"), settings={}, budget=budget)  # fmt: skip
        pack_linears(*models)
        return self

    def disable_packed_linear(self):
        """Back to `torch.nn.Linear` (the packed copies dropped); returns the pipeline."""
        unpack_linears(*self._modules_to_pack())
        return self
