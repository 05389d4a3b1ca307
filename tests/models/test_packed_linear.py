"""`mmspec.models.packed_linear`: the oneDNN-packed CPU linears -- the same products as `torch.nn.Linear` (within
float32 rounding; bit-identical where the packed kernel is not used), which calls take the packed kernel (counted
exactly), a weight changed after packing never used stale, the model's parameters, ties and `state_dict` untouched,
and the pipelines' `enable_packed_linear` (lossless greedy on the tiny LLaVA at batch 1 and ragged 4, transformers'
`generate` on the same packed model, the memory refusal, `disable_packed_linear`)."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from vlm_fixtures import hf_greedy, images, prompts, tiny_llava, tiny_processor

from mmspec.memory import MemoryBudgetError
from mmspec.models.hf.draft import truncated_draft
from mmspec.models.packed_linear import (
    MAX_ROWS,
    MIN_ROWS,
    PackedLinear,
    pack_linears,
    packed_bytes,
    packing_available,
    unpack_linears,
)
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN CPU kernels")


class CountKernels(TorchDispatchMode):
    """Counts the packed (`mkldnn._linear_pointwise`) and the MKL (`aten.mm` / `aten.addmm`) products run."""

    def __init__(self):
        super().__init__()
        self.packed = self.mkl = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.packed += name.startswith("mkldnn._linear_pointwise")
        self.mkl += name.startswith(("aten.mm.", "aten.addmm."))
        return func(*args, **(kwargs or {}))


def linear(bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(48, 80, bias=bias).eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (2, 48), (1, 9, 48), (3, 5, 48), (64, 48), (65, 48),
                                   (4, 50, 48)])  # fmt: skip
def test_packed_products_equal_the_linear(shape, bias):
    ref = linear(bias)
    packed = linear(bias)
    assert pack_linears(packed) == 1 and type(packed) is PackedLinear
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(x), packed(x)
    assert got.shape == want.shape
    rows = x.shape[:-1].numel()
    if MIN_ROWS <= rows <= MAX_ROWS:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the same MKL kernel: bit-identical
        assert torch.equal(got, want)


def test_which_calls_take_the_packed_kernel():
    """Exact counts: 2 to 64 rows packed, 1 and 65 rows MKL; autograd, float64 and a compiled trace keep MKL."""
    lin = linear()
    pack_linears(lin)

    def count(x, grad=False):
        with CountKernels() as c, torch.set_grad_enabled(grad):
            lin(x)
        return c.packed, c.mkl

    assert count(torch.randn(1, 48)) == (0, 1)
    assert count(torch.randn(1, 2, 48)) == (1, 0)
    assert count(torch.randn(8, 8, 48)) == (1, 0)
    assert count(torch.randn(65, 48)) == (0, 1)
    assert count(torch.randn(9, 48), grad=True) == (0, 1)  # training: the weight requires grad
    lin.requires_grad_(False)
    assert count(torch.randn(9, 48), grad=True) == (1, 0)  # nothing to record
    lin.double()
    with CountKernels() as c, torch.no_grad():
        lin(torch.randn(9, 48, dtype=torch.float64))
    assert (c.packed, c.mkl) == (0, 1)
    with torch.inference_mode():  # a weight without a version counter: never packed, so never stale
        made = linear()
        pack_linears(made)
        x = torch.randn(9, 48)
        assert torch.equal(made(x), nn.functional.linear(x, made.weight, made.bias)) and made._packed is None
    lin.float()
    with torch.inference_mode():
        x = torch.randn(9, 48)
    with CountKernels() as c, torch.no_grad():  # an input made there is fine
        lin(x)
    assert (c.packed, c.mkl) == (1, 0)


def test_a_weight_changed_after_packing_is_repacked():
    """In place (`load_state_dict`, a no-grad update), reassigned or cast: the next product uses the new weight."""
    lin = linear()
    pack_linears(lin)
    x = torch.randn(9, 48)
    with torch.no_grad():
        lin(x)  # packed now
        new = linear(seed=3)
        lin.load_state_dict(new.state_dict())
        torch.testing.assert_close(lin(x), new(x), rtol=1e-5, atol=1e-5)
        lin.weight.mul_(-1)
        torch.testing.assert_close(lin(x), nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight = nn.Parameter(torch.zeros(80, 48))
        torch.testing.assert_close(lin(x), lin.bias.expand(9, -1))
        lin(x)
        lin.double()  # a move or cast drops the packed copy (it would only hold memory: the key no longer matches)
        assert lin._packed is None
        lin.float()
        torch.testing.assert_close(lin(x), lin.bias.expand(9, -1))
        assert lin._packed is not None


def test_a_packed_module_copies():
    """After use (its packed copy made, an opaque oneDNN tensor that cannot be copied): `copy.deepcopy` (which
    pickling shares, `__getstate__`) works, and the copy packs its own weight again."""
    import copy

    lin = linear()
    pack_linears(lin)
    x = torch.randn(9, 48)
    with torch.no_grad():
        want = lin(x)
        twin = copy.deepcopy(lin)
        assert type(twin) is PackedLinear and twin._packed is None
        torch.testing.assert_close(twin(x), want)
        assert twin._packed is not None and lin._packed is not None


def test_parameters_ties_and_state_dict_untouched():
    model = tiny_llava(2, seed=1)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {k: id(p) for k, p in model.named_parameters()}
    n = sum(type(m) is nn.Linear for m in model.modules())
    assert packed_bytes(model) == sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    assert pack_linears(model, model) == n  # a module reached twice is swapped once
    assert packed_bytes(model) == 0  # nothing left to pack
    assert all(type(m) is not nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert {k: id(p) for k, p in model.named_parameters()} == params
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    x = torch.randn(1, 9, model.config.text_config.hidden_size)
    with torch.no_grad():
        model.lm_head(x)  # packs
    assert unpack_linears(model) == n
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert not any("_packed" in vars(m) for m in model.modules())


def packed_pipe():
    target = tiny_llava(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=truncated_draft(target, 3))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_pipeline_stays_lossless_and_equals_transformers():
    """With `enable_packed_linear`: plain greedy = transformers' `generate` on the same (packed) model, every draft-LM
    chain / tree = plain at batch 1 and on a ragged batch of 4, and the verification did run packed."""
    pipe = packed_pipe().enable_packed_linear()
    ims, texts = images(4, seed=2), prompts(4, seed=2)
    kw = dict(max_new_tokens=12, output_type="ids")
    for i in range(2):
        plain = pipe(images=[ims[i]], prompt=[texts[i]], acceptance="none", **kw).sequences[0].tolist()
        want = hf_greedy(pipe.model, pipe.processor, ims[i], texts[i], 12)
        assert [t for t in plain if t >= 0] == want[: len([t for t in plain if t >= 0])]
    plain = pipe(images=ims, prompt=texts, acceptance="none", **kw).sequences
    for knobs in ({"num_draft_tokens": 4}, {"num_draft_tokens": 6, "draft_length": "heuristic"},
                  {"tree_depth": 3, "tree_top_k": 2, "tree_nodes": 6}):  # fmt: skip
        with CountKernels() as c:
            out = pipe(images=ims, prompt=texts, acceptance="greedy", drafter="model", **knobs, **kw)
        assert torch.equal(out.sequences, plain), knobs
        assert c.packed > 0
        one = pipe(images=ims[:1], prompt=texts[:1], acceptance="greedy", drafter="model", **knobs, **kw)
        assert torch.equal(one.sequences, plain[:1]), knobs
    pipe.disable_packed_linear()
    assert not any(isinstance(m, PackedLinear) for m in pipe.model.modules())


def test_pipeline_refuses_packing_beyond_the_memory_budget():
    pipe = packed_pipe()
    need = packed_bytes(pipe.model, pipe.draft_model)
    with pytest.raises(MemoryBudgetError, match="packed linear weights"):
        pipe.enable_packed_linear(budget=need - 1)
    assert not any(isinstance(m, PackedLinear) for m in pipe.model.modules())
    pipe.enable_packed_linear(budget=need)
    assert all(isinstance(m, PackedLinear) for m in pipe.model.modules() if isinstance(m, nn.Linear))
