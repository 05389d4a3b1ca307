"""An EAGLE-3 head on an M-RoPE target (tiny Qwen2.5-VL / Qwen3-VL of `qwen_vl_fixtures`) drafts at the positions
the serving engines give it: pair `(a[t], x[t+1])` at the target's own M-RoPE position of token `t` (the prompt's
3-D ids, `t + rope_delta` after it; vLLM `v1/spec_decode/eagle.py`, SGLang `models/llama_eagle3.py`, see
`mmspec.models.hf.eagle3`). Its rotary is the target's multimodal one; greedy decoding with it equals plain greedy;
the export writes the sections the head was trained with and refuses a 1-D head for an M-RoPE target."""

import functools

import pytest
import qwen_vl_fixtures
import torch
from eagle3_fixtures import fit_eagle3_head
from qwen_vl_fixtures import images
from vlm_fixtures import prompts

from mmspec.models.hf.eagle3 import Eagle3Head
from mmspec.models.hf.eagle3_export import export_config, export_eagle3, load_exported
from mmspec.models.hf.mrope import MRopePositions, mrope_cos_sin
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


SIZES = [(24, 32), (8, 40), (32, 16)]  # 3 x 4, 1 x 5, 4 x 2 merged grids: each image's 3-D ids are its own


@functools.cache
def qwen_pipe(kind="qwen2_5_vl"):
    """`(pipe, plain greedy on the ragged batch)`: the 4-layer tiny Qwen-VL with an EAGLE-3 head fitted on it (at
    its M-RoPE positions: `from_target`'s default there)."""
    pipe = SpeculativeVLMPipeline(
        qwen_vl_fixtures.tiny_qwen_vl(kind, seed=1, layers=4), qwen_vl_fixtures.processor(kind)
    )
    pipe.set_progress_bar_config(disable=True)
    ims, texts = images(SIZES), prompts(3)
    plain = pipe(images=ims, prompt=texts, max_new_tokens=16, acceptance="none", output_type="ids").sequences
    pipe.register_modules(eagle_head=fit_eagle3_head(pipe, ims, texts, steps=60))
    return pipe, plain


@pytest.mark.parametrize("kind", qwen_vl_fixtures.KINDS)
def test_head_rotary_is_the_targets_multimodal_rotary(kind):
    """The head's `mrope_section` / `mrope_interleaved` come from the target and rotate exactly as the target's own
    rotary embedding does at the same 3-D positions (Qwen2.5-VL's chunks, Qwen3-VL's interleaving)."""
    target = qwen_vl_fixtures.tiny_qwen_vl(kind, seed=1)
    head = Eagle3Head.from_target(target, aux_layers=(0, 1))
    assert (head.config.positions, list(head.config.mrope_section)) == ("mrope", [2, 3, 3])
    assert head.config.mrope_interleaved == (kind == "qwen3_vl")
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 40, (3, 2, 7), generator=g)
    x = torch.randn(2, 7, 64, generator=g)
    want = target.model.language_model.rotary_emb(x, positions)
    got = mrope_cos_sin(head.rotary, x, positions, head.mrope_axes(x.device))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(got[0], head.rotary(x, positions[0])[0])  # the sections matter here


@pytest.mark.parametrize("knobs", [{"tree_depth": 4}, {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}])
def test_greedy_with_the_head_equals_plain_greedy(knobs):
    pipe, plain = qwen_pipe()
    out = pipe(images=images(SIZES), prompt=prompts(3), max_new_tokens=16, acceptance="exact", drafter="eagle",
               output_type="ids", **knobs)  # fmt: skip
    assert torch.equal(out.sequences, plain)
    assert out.stats.mean_accepted_length > 1.5  # trained and drafting at the same positions: drafts accepted


def test_the_head_drafts_at_the_targets_mrope_positions(monkeypatch):
    """Every position the head's layer sees while drafting: the prompt's pairs at the target's own 3-D ids (image
    tokens at their grid coordinates, not their slots), every later pair at `t + rope_delta` on all three axes."""
    pipe, _ = qwen_pipe()
    head = pipe.eagle_head
    seen = []
    layer = type(head)._layer

    def spy(self, x, positions, mask, cache):
        seen.append(positions.clone())
        return layer(self, x, positions, mask, cache)

    monkeypatch.setattr(type(head), "_layer", spy)
    ims, texts = images(SIZES), prompts(3)
    pipe(images=ims, prompt=texts, max_new_tokens=8, acceptance="exact", drafter="eagle", tree_depth=3,
         output_type="ids")  # fmt: skip
    ids, lengths, extra = pipe.encode_host(ims, texts, None)
    target = MRopePositions(pipe.model).prompt(ids, lengths, extra)  # [3, rows, L]: the model's get_rope_index
    delta = target.amax(dim=(0, 2)) + 1 - lengths  # per row, with no padding among the largest ids
    first, pending = seen[0], seen[1]  # prefill writes the prompt's pairs but the last; the first round feeds it
    assert first.dim() == 3 and first.shape[0] == 3, first.shape
    for r, n in enumerate(lengths.tolist()):
        assert torch.equal(first[:, r, : n - 1], target[:, r, : n - 1]), r
        assert torch.equal(pending[:, r, 0], target[:, r, n - 1]), r
        assert not torch.equal(first[1, r, : n - 1], torch.arange(n - 1) + int(delta[r]))  # an image row is not 1-D
    for later in seen[1:]:  # drafted and accepted pairs after the prompt: text positions, all axes equal
        assert later.dim() == 3 and torch.equal(later[0], later[1]) and torch.equal(later[0], later[2])
        assert bool((later[0] >= (lengths + delta)[:, None] - 1).all())


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_export_writes_the_heads_sections_and_refuses_a_1d_head(engine, tmp_path):
    pipe, plain = qwen_pipe()
    head, target = pipe.eagle_head, pipe.model
    config = export_config(head, target.config, engine)
    assert config["rope_scaling"] == {"rope_type": "default", "type": "default", "mrope_section": [2, 3, 3]}
    assert config["mmspec"]["positions"] == "mrope"
    if engine == "vllm":
        assert config["architectures"] == ["Eagle3Qwen2_5vlForCausalLM"]
    qwen3 = qwen_vl_fixtures.tiny_qwen_vl("qwen3_vl", seed=1, layers=4)
    twin = Eagle3Head.from_target(qwen3, aux_layers=(1, 2, 3))
    assert export_config(twin, qwen3.config, engine)["rope_scaling"]["mrope_interleaved"] is True
    with pytest.raises(ValueError, match="mrope_section"):  # trained on another target's sections
        export_config(twin, target.config, engine)
    flat = Eagle3Head.from_target(target, aux_layers=(1, 2, 3), positions="slot")
    assert flat.config.positions == "slot" and not flat.config.mrope_section
    with pytest.raises(ValueError, match="1-D slot positions"):
        export_config(flat, target.config, engine)
    loaded = load_exported(export_eagle3(head, target, tmp_path / engine, engine))
    assert (loaded.config.positions, list(loaded.config.mrope_section)) == ("mrope", [2, 3, 3])
    p = SpeculativeVLMPipeline(target, pipe.processor, eagle_head=loaded)
    p.set_progress_bar_config(disable=True)
    out = p(images=images(SIZES), prompt=prompts(3), max_new_tokens=16, acceptance="exact", drafter="eagle",
            tree_depth=4, output_type="ids")  # fmt: skip
    assert torch.equal(out.sequences, plain)


def test_a_head_at_mrope_positions_needs_them():
    """Training without the target's position ids, and a target without M-RoPE, are errors naming them."""
    from vlm_fixtures import tiny_llava

    pipe, _ = qwen_pipe()
    head = pipe.eagle_head
    aux = torch.zeros(1, 5, head.fused_size)
    with pytest.raises(ValueError, match="positions"):
        head.forward_unrolled(aux, torch.zeros(1, 5, dtype=torch.long), pipe.model, 1)
    with pytest.raises(ValueError, match="mrope_section"):
        head.check_target(tiny_llava(4))
