"""`mmspec.decoding.compiled`: what a CUDA-graph capture changes. Outputs of a replayed graph live in memory the
next replay overwrites, so a CUDA-graph forward hands back `owned` copies (every container kind the forwards
return), and only the inductor modes that capture graphs, on CUDA, take that path."""

import dataclasses

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from mmspec.decoding.compiled import CompiledForward, owned


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    note: str = "x"


def _fresh(a, b):
    return a is not b and a.data_ptr() != b.data_ptr() and torch.equal(a, b)


def test_owned_copies_every_tensor_in_every_container():
    t, u = torch.randn(2, 3), torch.randn(4)
    cache = object()
    out = owned({"a": [t, (u, 3)], "b": _Out(t, u), "c": CausalLMOutputWithPast(logits=t, past_key_values=cache)})
    assert _fresh(out["a"][0], t) and _fresh(out["a"][1][0], u) and out["a"][1][1] == 3
    assert isinstance(out["b"], _Out) and _fresh(out["b"].logits, t) and _fresh(out["b"].hidden, u)
    assert out["b"].note == "x"
    c = out["c"]
    assert isinstance(c, CausalLMOutputWithPast) and _fresh(c.logits, t) and c.past_key_values is cache


def test_only_graph_capturing_modes_on_cuda_take_the_owned_path():
    def fn(x):
        return x + 1

    cuda = torch.device("cuda")
    assert CompiledForward(fn, "t", None, None, cuda).cudagraphs  # mode None is "reduce-overhead" on CUDA
    assert CompiledForward(fn, "t", "max-autotune", None, cuda).cudagraphs
    assert not CompiledForward(fn, "t", "default", None, cuda).cudagraphs
    assert not CompiledForward(fn, "t", "max-autotune-no-cudagraphs", None, cuda).cudagraphs
    assert not CompiledForward(fn, "t", None, "eager", cuda).cudagraphs
    assert not CompiledForward(fn, "t", None, None, "cpu").cudagraphs


def test_a_dynamo_reset_recompiles_seen_shapes_instead_of_failing():
    """A `CompiledForward` with more shapes than dynamo's default recompile limit (8): after `torch._dynamo.reset()`
    (what `_dynamo.explain` does) its seen shapes compile again under its own limit, counted as recompiles, instead
    of failing fullgraph's hard recompile limit (was: `FailOnRecompileLimitHit` at the ninth seen shape)."""
    from mmspec.decoding.compiled import CompiledForward

    forward = CompiledForward(lambda x: x * 2 + 1, "reset", backend="eager")
    shapes = range(1, 11)
    for n in shapes:
        assert torch.equal(forward(torch.ones(n)), torch.full((n,), 3.0))
    torch._dynamo.reset()
    for n in shapes:
        assert torch.equal(forward(torch.ones(n)), torch.full((n,), 3.0))
    report = forward.report()
    assert report["shapes"] == 10 and report["recompiles"] > 0, report
