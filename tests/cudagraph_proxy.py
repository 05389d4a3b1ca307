"""A CPU proxy of CUDA-graph capture for `mmspec.decoding.cudagraphs` (the "cudagraphs" backend): `recording(mp)`
replaces CUDA graph trees' `cudagraphify_impl` by a recorder that runs the graph as it is, lifts torch's CPU-only
skips, and lets `Compiler.static` mark CPU tensors as it marks CUDA ones. Everything up to the capture itself is the
backend's own code: which inputs a replay would read in place (static), which it would copy, which it writes."""

import torch
from torch._dynamo.backends import cudagraphs as torch_backend
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

from mmspec.decoding.compiled import Compiler


def skips() -> int:
    """CUDA-graph skips so far (torch's counter, which the backend bumps for a graph it will not capture)."""
    return int(counters["inductor"]["cudagraph_skips"])


def recording(monkeypatch, mark_cpu=False):
    """The list the recorder appends each captured graph to: its example `inputs`, `static` indices and the
    `cudagraphify_impl` keywords (`mutated_input_idxs`, `placeholders`, ...). `mark_cpu`: `Compiler.static` marks CPU
    tensors too (it marks CUDA tensors only)."""
    calls = []

    def record(model, inputs, static_input_idxs, **kwargs):
        calls.append({"inputs": list(inputs), "static": list(static_input_idxs), **kwargs})
        return model  # the boxed graph, run uncaptured

    monkeypatch.setattr(cudagraph_trees, "cudagraphify_impl", record)
    monkeypatch.setattr(torch_backend, "check_for_skip", lambda model, fixed: None)  # CPU: torch would skip
    monkeypatch.setattr(torch_backend, "get_device_index", lambda model: 0)  # CPU: torch asserts a CUDA graph
    if mark_cpu:

        def static(*items):
            for item in items:
                for t in [item] if torch.is_tensor(item) else [v for v in vars(item).values() if torch.is_tensor(v)]:
                    torch._dynamo.mark_static_address(t)

        monkeypatch.setattr(Compiler, "static", staticmethod(static))
    return calls
