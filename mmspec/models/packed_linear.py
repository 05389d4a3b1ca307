"""Prepacked oneDNN weights for the linear layers of a model on CPU: a K-token verification at about the cost of a
one-token step.

Why: speculative decoding verifies `K + 1` tokens in one forward, and on a memory-bound device that costs about one
token's step. On CPU, float32 `torch.nn.functional.linear` goes to MKL's GEMM, whose small-M kernels are not
memory-bound: measured on this project's 2-core Intel Xeon host (1 thread), a 9-row product with SmolLM2-135M's
output head ([49152, 576]) takes 2-3x a 1-row one, and the whole target's 9-token verification ~2.5x a 1-token step.
oneDNN's inner product on a weight reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
what inductor's CPU freezing pass uses) stays near the one-row cost up to ~16 rows. Only `MIN_ROWS` to `MAX_ROWS`
input rows take the packed kernel: one row (plain decoding at batch 1, a chain's draft step) is faster on MKL, and
a long prefill's rows gain nothing; so a batch-1 decoding step runs exactly the kernels it runs without packing, and a
verification gets the flat one.

`pack_linears(*models)` turns every `torch.nn.Linear` of the models into a `PackedLinear` in place (the same module
object, its class swapped: parameters, `state_dict` keys, tied weights and hooks are untouched; transformers'
`generate` on the same model uses the same kernels) and keeps one packed copy of each float32 CPU weight (memory:
`packed_bytes`, as much again as those weights). `unpack_linears` undoes it. A `PackedLinear` falls back to
`torch.nn.functional.linear` outside that row range, for inputs off the CPU or not float32, when autograd records,
inside `torch.compile` (its own kernels), and for a weight made under `torch.inference_mode` (it has no version
counter). A weight changed after packing through autograd's view of it (`load_state_dict`, an in-place update under
`no_grad`, a reassigned or moved parameter) is repacked before its next use; a write through `.data` bypasses the
version counter, so unpack and pack again around one.

The packed product rounds differently from MKL's (float32, ~1e-7 relative): a verification is the target's
distribution computed by another kernel, as the row count already changes the kernel without packing.
"""

import torch
from torch import nn
from torch.nn import functional as F


__all__ = [
    "MAX_ROWS",
    "MIN_ROWS",
    "PackedLinear",
    "pack_linears",
    "packed_bytes",
    "packing_available",
    "unpack_linears",
]

MIN_ROWS = 2  # input rows (tokens x batch) from which the packed kernel runs; one row stays on MKL (faster there)
MAX_ROWS = 64  # ... and up to which (a verification's width x batch); a prefill's rows stay on MKL (no gain there)
_HINT = 16  # the row count the weight is reordered for (a verification's width; any row count runs)


def packing_available() -> bool:
    """Whether this torch build can reorder and run a packed float32 linear (oneDNN on CPU); tried once."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4), _HINT)
            y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), w, None, "none", [], "")
            _AVAILABLE = bool(torch.backends.mkldnn.is_available() and torch.equal(y, torch.full((2, 4), 4.0)))
        except (AttributeError, RuntimeError, NotImplementedError):
            _AVAILABLE = False
    return _AVAILABLE


_AVAILABLE = None


def _packable(weight) -> bool:  # an inference tensor has no version counter to see a change by: never packed
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not weight.is_inference()
    )


def _key(weight):
    return weight.data_ptr(), weight._version, weight.shape, weight.stride()


class PackedLinear(nn.Linear):
    """`torch.nn.Linear` with a oneDNN-packed copy of its weight for multi-row CPU inputs (module docstring).
    Made by `pack_linears` (class swap in place), never constructed directly."""

    _packed = None
    _packed_key = None

    def __getstate__(self):  # copies and pickles leave the packed copy (opaque to both) to be made again on use
        state = dict(super().__getstate__())
        state.pop("_packed", None)
        state.pop("_packed_key", None)
        return state

    def _apply(self, fn, *args, **kwargs):  # `.to()`, `.half()`, ...: the old weight's packed copy goes
        self.__dict__.pop("_packed", None)
        self.__dict__.pop("_packed_key", None)
        return super()._apply(fn, *args, **kwargs)

    def _pack(self):
        weight = self.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _HINT)
        self._packed_key = _key(weight)

    def forward(self, input):
        weight = self.weight
        if (input.dim() < 2 or not MIN_ROWS <= input.shape[:-1].numel() <= MAX_ROWS or input.device.type != "cpu"
                or input.dtype != torch.float32 or not _packable(weight) or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad))):  # fmt: skip
            return F.linear(input, weight, self.bias)
        if self._packed_key != _key(weight):  # first use, or the weight changed since it was packed
            self._pack()
        bias = self.bias
        if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
            return F.linear(input, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(input, self._packed, bias, "none", [], "")


def _linears(models):
    seen = set()
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if isinstance(module, nn.Linear) and id(module) not in seen:
                seen.add(id(module))
                yield module


def packed_bytes(*models) -> int:
    """Bytes `pack_linears(*models)` adds: one packed copy of every float32 CPU linear weight (shared ones once)."""
    return sum(m.weight.numel() * 4 for m in _linears(models) if type(m) is nn.Linear and _packable(m.weight))


def pack_linears(*models) -> int:
    """Swap every plain `torch.nn.Linear` of `models` (None skipped) to `PackedLinear` in place; returns how many
    changed. Weights are packed at their first multi-row use. ValueError when this torch build has no packed
    kernel (`packing_available`)."""
    if not packing_available():
        raise ValueError("packed linears need torch's oneDNN (mkldnn) CPU kernels, which this torch build lacks")
    changed = 0
    for module in _linears(models):
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
            changed += 1
    return changed


def unpack_linears(*models) -> int:
    """Undo `pack_linears`: every `PackedLinear` of `models` back to `torch.nn.Linear`, its packed copy dropped;
    returns how many changed."""
    changed = 0
    for module in _linears(models):
        if type(module) is PackedLinear:
            module.__dict__.pop("_packed", None)
            module.__dict__.pop("_packed_key", None)
            module.__class__ = nn.Linear
            changed += 1
    return changed
