"""`mmspec.decoding.cudagraphs`: the "cudagraphs" backend hands CUDA graph trees every weight and every tensor marked
static as a static input (read in place at each replay, never copied), and only those. CUDA graph trees need a GPU, so
the capture itself is replaced by a recorder (`cudagraphify_impl`) and torch's CPU skip is lifted: everything up to
the capture is the backend's own code, on the CPU. On a GPU the copies this prevents showed as 556 device-to-device
memcpys per LlamaGen-XL step (`assets/bench/gpu-h200-captured.json`)."""

import pytest
import torch
from cudagraph_proxy import recording, skips

from mmspec.decoding.compiled import Compiler
from mmspec.decoding.cudagraphs import cudagraphs


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x, cache):  # the cache (an argument, as a pipeline's KV cache object is) is written in place
        cache[: x.shape[0]].copy_(x)
        return self.norm(self.proj(cache)) * self.scale


@pytest.fixture
def recorded(monkeypatch):
    torch._dynamo.reset()
    yield recording(monkeypatch)
    torch._dynamo.reset()


def test_weights_buffers_and_marked_cache_are_static_inputs_and_nothing_else(recorded):
    model, cache = _Model().eval(), torch.zeros(4, 8)
    torch._dynamo.mark_static_address(cache)
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = model(x, cache.clone())
        got = torch.compile(model, backend=cudagraphs, fullgraph=True, dynamic=False)(x, cache)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache[:2], x)
    (call,) = recorded
    assert call["is_inference"] is True and call["is_backward"] is False
    inputs, static = call["inputs"], set(call["static"])
    weights = [*model.parameters(), *model.buffers()]
    # every weight and buffer and the marked cache is read in place; the per-call input (x, [2, 8]) is not
    (per_call,) = [t for i, t in enumerate(inputs) if i not in static]
    assert per_call.shape == x.shape and len(static) == len(weights) + 1
    assert sorted(tuple(inputs[i].shape) for i in static) == sorted(
        [tuple(t.shape) for t in weights] + [tuple(cache.shape)]
    )
    # the cache's write stays in the graph (torch's backend moves it out as an eager copy after every replay)
    (written,) = call["mutated_input_idxs"]
    assert written in static and inputs[written].shape == cache.shape


def test_a_graph_writing_an_unmarked_tensor_is_not_captured(recorded):
    """Written in place but not static: CUDA graphs would write a copy, so the graph runs uncaptured (a counted skip)."""
    model, cache, x = _Model().eval(), torch.zeros(4, 8), torch.randn(2, 8)  # the cache is not marked static
    before = skips()
    with torch.no_grad():
        torch.compile(model, backend=cudagraphs, fullgraph=True, dynamic=False)(x, cache)
    assert recorded == [] and skips() == before + 1
    torch.testing.assert_close(cache[:2], x)  # run uncaptured, the write still lands


def test_the_pipelines_cudagraphs_backend_is_this_one(recorded):
    """`enable_compile(backend="cudagraphs")` goes through `Compiler`, which must pick mmspec's backend (torch's would
    hand only aot_autograd's lifted arguments as static: none, with modules inlined)."""
    model, cache = _Model().eval(), torch.zeros(4, 8)
    torch._dynamo.mark_static_address(cache)  # `Compiler.static` marks CUDA tensors only
    forward = Compiler(backend="cudagraphs").forward("target", model)
    with torch.no_grad():
        forward(torch.randn(3, 8), cache)
    (call,) = recorded
    assert len(call["static"]) == len([*model.parameters(), *model.buffers()]) + 1
