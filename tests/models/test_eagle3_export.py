"""`mmspec export eagle3` (`mmspec.models.hf.eagle3_export`): the folder holds every tensor and config field vLLM and
SGLang read, with the shapes their code builds (the reference table below, read from the engines' sources), a round
trip drafts token-identical proposals, and heads an engine would refuse are clear errors before anything is written.

Sources read (the table's `source` column):
    vLLM   vllm-project/vllm @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 vllm/model_executor/models/llama_eagle3.py
           (`LlamaDecoderLayer.__init__`: qkv_proj input 2 * hidden; `LlamaModel`: fc = ReplicatedLinear(
           target_hidden_size * 3, hidden_size, bias=False), norm; `Eagle3LlamaForCausalLM`: lm_head
           [draft_vocab_size, hidden_size], draft_id_to_target_id <- d2t, t2d skipped, embed_tokens optional,
           midlayer. -> layers.0.); vllm/v1/worker/gpu_model_runner.py @ 4e1790651fc758c06c7a903dd4cd82364ac91b27
           (`_get_eagle3_aux_layers_from_config`: eagle_aux_hidden_state_layer_ids, top level or in eagle_config,
           used as the target's layer indices whose *inputs* are captured, vllm/model_executor/models/llama.py).
    SGLang sgl-project/sglang @ 03d5a7771f6082e7737a5f19cae7d1e863087013 python/sglang/srt/models/llama_eagle3.py
           (`LlamaDecoderLayer`: qkv_proj input 2 * hidden, hidden_norm; `LlamaModel`: fc = Linear(
           target_hidden_size * 3, hidden_size, bias=config.bias or False), midlayer, norm, M-RoPE when
           rope_scaling has mrope_section; `LlamaForCausalLMEagle3`: lm_head [draft_vocab_size, hidden] unless
           tie_word_embeddings, d2t -> hot_token_id = d2t + arange, t2d skipped);
           python/sglang/srt/model_executor/model_runner.py @ 01cc04e2b5b01ce379698a3fee1bd17706e1d0ec
           (eagle_config["eagle_aux_hidden_state_layer_ids"] -> `set_eagle3_layers_to_capture`, which adds 1).
"""

import json

import pytest
import torch
from eagle3_fixtures import AUX, eagle3_pipe
from vlm_fixtures import images, prompts, tiny_llava

from mmspec.drafters.eagle import EagleDrafter
from mmspec.models.hf.eagle import TextEagleHead
from mmspec.models.hf.eagle3 import Eagle3Head
from mmspec.models.hf.eagle3_export import check_export, export_config, export_eagle3, export_tensors, load_exported
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


# every tensor either engine reads: name -> (shape from the config `c`, dtype, engines that load it, source)
L, SGL = "vllm", "sglang"
TENSORS = {
    "midlayer.self_attn.q_proj.weight": (lambda c: (c["num_attention_heads"] * c["head_dim"], 2 * c["hidden_size"]),
                                         torch.bfloat16, (L, SGL), "qkv_proj = QKVParallelLinear(2 * hidden, ...)"),
    "midlayer.self_attn.k_proj.weight": (lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
                                         torch.bfloat16, (L, SGL), "qkv_proj (k shard)"),
    "midlayer.self_attn.v_proj.weight": (lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
                                         torch.bfloat16, (L, SGL), "qkv_proj (v shard)"),
    "midlayer.self_attn.o_proj.weight": (lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
                                         torch.bfloat16, (L, SGL), "LlamaAttention o_proj"),
    "midlayer.mlp.gate_proj.weight": (lambda c: (c["intermediate_size"], c["hidden_size"]), torch.bfloat16, (L, SGL),
                                      "LlamaMLP gate_up_proj (gate shard)"),
    "midlayer.mlp.up_proj.weight": (lambda c: (c["intermediate_size"], c["hidden_size"]), torch.bfloat16, (L, SGL),
                                    "LlamaMLP gate_up_proj (up shard)"),
    "midlayer.mlp.down_proj.weight": (lambda c: (c["hidden_size"], c["intermediate_size"]), torch.bfloat16, (L, SGL),
                                      "LlamaMLP down_proj"),
    "midlayer.input_layernorm.weight": (lambda c: (c["hidden_size"],), torch.bfloat16, (L, SGL), "RMSNorm(hidden)"),
    "midlayer.hidden_norm.weight": (lambda c: (c["hidden_size"],), torch.bfloat16, (L, SGL), "RMSNorm(hidden)"),
    "midlayer.post_attention_layernorm.weight": (lambda c: (c["hidden_size"],), torch.bfloat16, (L, SGL),
                                                 "RMSNorm(hidden)"),
    "fc.weight": (lambda c: (c["hidden_size"], 3 * c["target_hidden_size"]), torch.bfloat16, (L, SGL),
                  "Linear(target_hidden_size * 3, hidden_size), no bias"),
    "norm.weight": (lambda c: (c["hidden_size"],), torch.bfloat16, (L, SGL), "LlamaModel.norm"),
    "lm_head.weight": (lambda c: (c["draft_vocab_size"], c["hidden_size"]), torch.bfloat16, (L, SGL),
                       "ParallelLMHead(draft_vocab_size, hidden_size)"),
    "d2t": (lambda c: (c["draft_vocab_size"],), torch.int64, (L, SGL),
            "vLLM draft_id_to_target_id (target = draft + d2t); SGLang hot_token_id = d2t + arange"),
}  # fmt: skip
# every config field either engine reads (required ones; the optional ones they default are left at the default)
CONFIG = {
    "architectures": {L: ["Eagle3LlamaForCausalLM"], SGL: ["LlamaForCausalLMEagle3"]},  # registry / EntryClass
    "model_type": {L: "llama", SGL: "llama"},  # a LlamaConfig (SGLang: not llama4_text)
    "num_hidden_layers": {L: 1, SGL: 1},  # one midlayer
    "tie_word_embeddings": {L: False, SGL: False},  # SGLang: lm_head = embed_tokens when true
    "hidden_act": {L: "silu", SGL: "silu"},
    "attention_bias": {L: False, SGL: False},
    "torch_dtype": {L: "bfloat16", SGL: "bfloat16"},
}
FROM_HEAD = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "target_hidden_size")  # fmt: skip


def small_head(aux=(1, 2, 3), draft_vocab=40):
    target = tiny_llava(4, seed=1)
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, aux_layers=aux, draft_vocab_size=draft_vocab, intermediate_size=96)
    if draft_vocab:
        head.set_draft_vocab(torch.arange(64 - draft_vocab, 64))
    return head.eval(), target


@pytest.mark.parametrize("engine", [L, SGL])
def test_export_holds_every_key_shape_and_field_the_engine_reads(engine, tmp_path):
    head, target = small_head()
    out = export_eagle3(head, target, tmp_path / engine, engine)
    config = json.loads((out / "config.json").read_text())
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    for name, (shape, dtype, engines, source) in TENSORS.items():
        assert engine in engines
        assert tuple(tensors[name].shape) == shape(config), (name, source)
        assert tensors[name].dtype == dtype, name
    assert set(tensors) == set(TENSORS) | {"t2d"}  # t2d: skipped by both, kept as EAGLE-3's checkpoints do
    for field, want in CONFIG.items():
        assert config[field] == want[engine], field
    for field in FROM_HEAD:
        assert config[field] == head.config[field], field
    assert config["draft_vocab_size"] == 40
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    assert ids == ([1, 2, 3] if engine == L else [0, 1, 2])  # SGLang adds 1; vLLM reads the layer inputs
    assert torch.equal(tensors["d2t"] + torch.arange(40), head.draft_vocab)
    assert "rope_scaling" not in config  # the tiny LLaVA has no M-RoPE
    torch.testing.assert_close(tensors["fc.weight"].float(), head.fc.weight, atol=1e-2, rtol=1e-2)


def test_m_rope_targets_get_their_sections_and_vllm_the_vl_architecture():
    """A head at the target's M-RoPE positions exports its sections (both engines then rotate the draft by
    M-RoPE); a head trained at 1-D slot positions is refused for an M-RoPE target (`test_eagle3_mrope`)."""
    from transformers import Qwen2_5_VLConfig

    flat, _ = small_head()
    head = Eagle3Head(**{**{k: v for k, v in flat.config.items() if not k.startswith("_")}, "positions": "mrope",
                         "mrope_section": [2, 3, 3]})  # fmt: skip
    qwen = Qwen2_5_VLConfig(text_config={"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}})
    for engine in (L, SGL):
        config = export_config(head, qwen, engine)
        assert config["rope_scaling"]["mrope_section"] == [2, 3, 3]
        with pytest.raises(ValueError, match="positions='slot'"):
            export_config(flat, qwen, engine)
    assert export_config(head, qwen, L)["architectures"] == ["Eagle3Qwen2_5vlForCausalLM"]
    assert export_config(head, qwen, SGL)["architectures"] == ["LlamaForCausalLMEagle3"]


@pytest.mark.parametrize("engine", [L, SGL])
def test_round_trip_drafts_token_identical_proposals(engine, tmp_path, monkeypatch):
    """The exported folder loads back (`load_exported`) as the head with bf16 weights: its proposals, chain and
    tree, on a ragged batch, are the head's own (the head's weights rounded to bf16, as the engines hold them)."""
    pipe = eagle3_pipe()
    head = pipe.eagle_head
    folder = export_eagle3(head, pipe.model, tmp_path / engine, engine)
    loaded = load_exported(folder)
    assert loaded.config.aux_layers == list(AUX) and loaded.config.image_inputs == "placeholder"
    rounded = Eagle3Head(**{k: v for k, v in head.config.items() if not k.startswith("_")})
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
                             for k, v in head.state_dict().items()})  # fmt: skip
    proposals = []
    real = EagleDrafter.propose

    def spy(self, state):
        proposal = real(self, state)
        proposals.append((proposal.tokens.clone(), None if proposal.parents is None else proposal.parents.clone()))
        return proposal

    monkeypatch.setattr(EagleDrafter, "propose", spy)
    runs = {}
    for name, h in (("exported", loaded), ("rounded", rounded.eval())):
        p = SpeculativeVLMPipeline(pipe.model, pipe.processor, eagle_head=h)
        p.set_progress_bar_config(disable=True)
        proposals.clear()
        for knobs in ({"tree_depth": 4}, {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}):
            p(images=images(4), prompt=prompts(4), max_new_tokens=24, acceptance="greedy", drafter="eagle", **knobs)
        runs[name] = list(proposals)
    assert len(runs["exported"]) == len(runs["rounded"]) > 4
    for (t1, p1), (t2, p2) in zip(runs["exported"], runs["rounded"]):
        assert torch.equal(t1, t2) and (p1 is None) == (p2 is None) and (p1 is None or torch.equal(p1, p2))


def test_heads_an_engine_would_refuse_are_clear_errors(tmp_path):
    head, target = small_head(aux=(1, 3))
    for engine in (L, SGL):
        with pytest.raises(ValueError, match=f"{engine} builds the EAGLE-3 fc over exactly 3 aux hidden states"):
            export_eagle3(head, target, tmp_path / "two", engine)
    head, target = small_head(aux=(0, 2, 3))
    export_eagle3(head, target, tmp_path / "zero-vllm", L)  # vLLM can name layer 0's input (the embeddings)
    with pytest.raises(ValueError, match="aux layer 0 \\(the input embeddings\\) cannot be named"):
        export_eagle3(head, target, tmp_path / "zero", SGL)
    with pytest.raises(ValueError, match="cannot export a TextEagleHead .* an EAGLE-1/2 head"):
        export_eagle3(TextEagleHead.from_target(target), target, tmp_path / "eagle", L)
    head, target = small_head()
    config, tensors = export_config(head, target.config, SGL), export_tensors(head)
    del tensors["d2t"]
    with pytest.raises(ValueError, match="lacks 'd2t' \\(the draft vocabulary is smaller than the target's"):
        check_export(config, tensors, SGL)
    full, target = small_head(draft_vocab=0)  # a full-vocabulary head: d2t is all zeros, optional
    config, tensors = export_config(full, target.config, L), export_tensors(full)
    del tensors["d2t"]
    check_export(config, tensors, L)
    assert not (tmp_path / "two").exists() and not (tmp_path / "zero").exists()


def test_cli_exports_and_refuses(tmp_path, capsys):
    from mmspec.cli import main

    head, target = small_head()
    head.save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    out = tmp_path / "out"
    assert main(["export", "eagle3", str(tmp_path / "head"), str(out), "--target", str(tmp_path / "target"),
                 "--format", "sglang", "--embed-tokens"]) == 0  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    from safetensors.torch import load_file

    assert load_file(out / "model.safetensors")["embed_tokens.weight"].shape == (64, 64)
    TextEagleHead.from_target(target).save_pretrained(tmp_path / "eagle1")
    with pytest.raises(SystemExit) as exit_:
        main(["export", "eagle3", str(tmp_path / "eagle1"), str(tmp_path / "x"), "--target", str(tmp_path / "target"),
              "--format", "vllm"])  # fmt: skip
    assert exit_.value.code == 1 and "cannot export a TextEagleHead" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["export", "eagle3", str(tmp_path / "missing"), str(tmp_path / "x"), "--format", "vllm"])
    assert exit_.value.code == 2 and "argument head:" in capsys.readouterr().err
