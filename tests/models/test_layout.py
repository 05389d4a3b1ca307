"""`input_major_linears`: same values and outputs, weights input-major, tied parameters stay tied."""

import torch
import torch.nn as nn
from vlm_fixtures import tiny_lm

from mmspec.models.layout import input_major_linears, is_input_major


def test_relaid_model_computes_the_same_and_keeps_ties():
    model = tiny_lm()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    before = model(input_ids=ids).logits
    n = input_major_linears(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert n == len({id(m.weight) for m in linears})
    assert all(is_input_major(m.weight) for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=1e-5)
    assert input_major_linears(model) == 0  # idempotent


def test_zoo_target_is_input_major_on_cpu():
    from mmspec.models.hf.zoo import load_vlm

    model, _ = load_vlm("mnist-vlm")
    assert is_input_major(model.model.language_model.layers[0].mlp.up_proj.weight)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
