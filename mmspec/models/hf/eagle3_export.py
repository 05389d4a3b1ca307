"""Export an EAGLE-3 head (`mmspec.models.hf.eagle3.Eagle3Head`) as the draft-model folder vLLM or SGLang loads
(`mmspec export eagle3 HEAD --target TARGET --format vllm|sglang OUT/`, `mmspec.cli.export`), and read one back.

The folder is `config.json` (a Llama config: `model_type` "llama", one hidden layer) + `model.safetensors` (bf16):

| tensor | shape | read by |
|---|---|---|
| `midlayer.self_attn.{q,k,v}_proj.weight` | [heads * head_dim or kv_heads * head_dim, 2 * hidden] | both (fused to `qkv_proj`) |
| `midlayer.self_attn.o_proj.weight` | [hidden, heads * head_dim] | both |
| `midlayer.mlp.{gate,up}_proj.weight`, `midlayer.mlp.down_proj.weight` | [inter, hidden], [hidden, inter] | both |
| `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight` | [hidden] | both |
| `fc.weight` | [hidden, 3 * target_hidden] | both (no bias) |
| `norm.weight` | [hidden] | both |
| `lm_head.weight` | [draft_vocab, hidden] | both |
| `d2t` (int64) | [draft_vocab]: target id = draft id + d2t | both (vLLM `draft_id_to_target_id`, SGLang `hot_token_id`) |
| `t2d` (bool) | [vocab] | neither (skipped; EAGLE-3's reference checkpoints carry it) |
| `embed_tokens.weight` | [vocab, hidden] | optional (`embed_tokens=True`; both engines otherwise share the target's) |

Config: `architectures` (vLLM `Eagle3LlamaForCausalLM`, or `Eagle3Qwen2_5vlForCausalLM` / `Eagle3Qwen3vlForCausalLM`
for those targets; SGLang `LlamaForCausalLMEagle3`), `hidden_size`, `intermediate_size`, `num_attention_heads`,
`num_key_value_heads`, `head_dim`, `num_hidden_layers` (1), `rms_norm_eps`, `rope_theta`, `max_position_embeddings`,
`hidden_act`, `vocab_size`, `draft_vocab_size`, `target_hidden_size`, `tie_word_embeddings` (false: SGLang would tie
the output head to the embedding), `torch_dtype` bfloat16, `eagle_config` (`use_aux_hidden_state`,
`eagle_aux_hidden_state_layer_ids`) and, for a head at M-RoPE positions (`positions="mrope"`,
`mmspec.models.hf.eagle3`), `rope_scaling.mrope_section` (+ `mrope_interleaved`, Qwen3-VL). Both engines give the
draft of an M-RoPE target that target's 3-D positions (vLLM: `target_positions` when the target `uses_mrope`; SGLang:
`forward_batch.mrope_positions` when the draft's `rope_scaling` has `mrope_section`), so a head trained at 1-D slot
positions on such a target is refused.

The aux layer ids are written in each engine's own convention: vLLM's id `i` is the *input* of target layer `i`
(`vllm/model_executor/models/llama.py`: `aux_hidden_states.append(hidden_states + residual)` before layer `i`), which
is mmspec's `aux_layers`; SGLang adds 1 to the ids it reads (`set_eagle3_layers_to_capture`: "for the ith layer, it
takes the output of the (i-1)th layer"), so its ids are `aux_layers - 1`. Both engines build `fc` over exactly three
aux states (`target_hidden_size * 3`): a head with another count is refused, as is an aux layer 0 for SGLang.

Heads with no EAGLE-3 layout are refused naming what would be lost: `TextEagleHead` (EAGLE-1/2: `fc` over
[embedding ; final hidden state], the target's own output head) and the vision-aware `VisionEagleHead` (ViSpec's
adaptor and global image vector, SpecVLM's compressors and gate, MSD's decoupled image inputs: no slot in
`Eagle3LlamaForCausalLM` / `LlamaForCausalLMEagle3`, and their text part is EAGLE-1/2 too).
"""

import json
import logging
from pathlib import Path

import torch

from mmspec.models.hf.mrope import mrope_params


logger = logging.getLogger(__name__)

__all__ = ["ENGINES", "check_export", "export_config", "export_eagle3", "export_tensors", "exported_positions",
           "load_exported"]  # fmt: skip

ENGINES = ("vllm", "sglang")
ARCHITECTURES = {"vllm": "Eagle3LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle3"}
# vLLM's registry maps these to the same `Eagle3LlamaForCausalLM` (`vllm/model_executor/models/registry.py`)
VLLM_VL_ARCHITECTURES = {"qwen2_5_vl": "Eagle3Qwen2_5vlForCausalLM", "qwen3_vl": "Eagle3Qwen3vlForCausalLM"}
NUM_AUX = 3  # both engines: fc = Linear(target_hidden_size * 3, hidden_size)
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
)
LOST = {
    "TextEagleHead": "an EAGLE-1/2 head: its fc reads [token embedding ; the target's final hidden state] and it drafts "
    "through the target's own output head, where EAGLE-3 reads three aux hidden states and owns its output head; "
    "nothing of it maps onto the engines' layer",
    "VisionEagleHead": "a vision-aware head: its image policy (ViSpec's learned-query adaptor and global image vector, "
    "SpecVLM's compressors and gate, MSD's decoupled image inputs) has no slot in Eagle3LlamaForCausalLM / "
    "LlamaForCausalLMEagle3, and its text part is an EAGLE-1/2 head",
}


def _engine(engine):
    if engine not in ENGINES:
        raise ValueError(f"format must be one of {ENGINES}, got {engine!r}")
    return engine


def _check_head(head):
    from mmspec.models.hf.eagle3 import Eagle3Head

    if not isinstance(head, Eagle3Head):
        name = type(head).__name__
        lost = LOST.get(name, "not an EAGLE-3 head")
        raise ValueError(f"cannot export a {name} for vLLM / SGLang: {lost}. Train an EAGLE-3 head for the same "
                         "target (`python -m mmspec.train vlm-eagle3`) and export that")  # fmt: skip


def export_config(head, target_config, engine):
    """The engine's `config.json` (a dict) for `head` trained on a target with `target_config` (module docstring).
    ValueError naming the field when the head has a shape the engine refuses."""
    _check_head(head)
    engine = _engine(engine)
    c = head.config
    aux = list(c.aux_layers)
    if len(aux) != NUM_AUX:
        raise ValueError(f"{engine} builds the EAGLE-3 fc over exactly {NUM_AUX} aux hidden states "
                         f"(Linear(target_hidden_size * 3, hidden_size)); this head fuses {len(aux)} "
                         f"(aux_layers={aux})")  # fmt: skip
    if engine == "sglang" and aux[0] < 1:
        raise ValueError(f"sglang reads eagle_aux_hidden_state_layer_ids as layer outputs (it captures the input of "
                         f"layer id + 1), so aux layer 0 (the input embeddings) cannot be named; this head's "
                         f"aux_layers={aux}")  # fmt: skip
    head.check_positions(target_config)
    if mrope_params(target_config) is not None and c.positions != "mrope":
        raise ValueError(f"{engine} gives the EAGLE-3 draft of an M-RoPE target the target's 3-D M-RoPE positions, "
                         f"but this head was trained at 1-D slot positions (positions={c.positions!r}): it would "
                         "draft at positions it never saw. Retrain it with `python -m mmspec.train vlm-eagle3` "
                         "(positions='mrope' is the default on this target)")  # fmt: skip
    model_type = getattr(target_config, "model_type", None)
    architecture = ARCHITECTURES[engine]
    if engine == "vllm":
        architecture = VLLM_VL_ARCHITECTURES.get(model_type, architecture)
    config = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": aux if engine == "vllm" else [i - 1 for i in aux],
        },
        "mmspec": {"head": type(head).__name__, "aux_layers": aux, "image_inputs": c.image_inputs,
                   "positions": c.positions, "format": engine},
    }  # fmt: skip
    if c.positions == "mrope":  # both engines: M-RoPE when rope_scaling has mrope_section (rope_type "default")
        config["rope_scaling"] = {"rope_type": "default", "type": "default", "mrope_section": list(c.mrope_section)}
        if c.mrope_interleaved:  # Qwen3-VL (the engines' rotary factory reads this key)
            config["rope_scaling"]["mrope_interleaved"] = True
    return config


def export_tensors(head, embed_tokens=None):
    """`{name: tensor}` of the engines' checkpoint (module docstring): floats in bfloat16, `d2t` int64, `t2d` bool;
    `embed_tokens` (optional `[vocab, hidden]`, the target's input embedding) is written as `embed_tokens.weight`."""
    _check_head(head)
    c = head.config
    state = {k: v.detach().to("cpu") for k, v in head.state_dict().items()}
    tensors = {f"midlayer.{k}": state[f"midlayer.{k}"] for k in LAYER_KEYS}
    tensors.update({k: state[k] for k in ("fc.weight", "norm.weight", "lm_head.weight")})
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    ids = state["draft_vocab"] if c.draft_vocab_size else torch.arange(c.vocab_size)
    tensors["d2t"] = (ids - torch.arange(len(ids))).to(torch.int64)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embed_tokens is not None:
        tensors["embed_tokens.weight"] = embed_tokens.detach().to("cpu", torch.bfloat16).contiguous()
    return tensors


def check_export(config, tensors, engine):
    """Raise ValueError naming the field or tensor unless `config` / `tensors` are what `engine` loads: every config
    field it reads, every weight with its shape, `d2t` whenever the draft vocabulary is smaller than the target's
    (without it both engines would read draft id `i` as target id `i`)."""
    engine = _engine(engine)
    for name in ("architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "num_hidden_layers", "rms_norm_eps", "vocab_size", "draft_vocab_size", "target_hidden_size",
                 "eagle_config"):  # fmt: skip
        if name not in config:
            raise ValueError(f"config.json lacks {name!r}, which {engine} reads")
    h, t, v, n = config["hidden_size"], config["target_hidden_size"], config["vocab_size"], config["draft_vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter = config.get("head_dim") or h // heads, config["intermediate_size"]
    aux = config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or len(aux) != NUM_AUX:
        raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids must list {NUM_AUX} layer ids for {engine}, "
                         f"got {aux!r}")  # fmt: skip
    if config["num_hidden_layers"] != 1:
        raise ValueError(f"num_hidden_layers must be 1 (one midlayer), got {config['num_hidden_layers']}")
    if engine == "sglang" and config.get("tie_word_embeddings", True):
        raise ValueError("tie_word_embeddings must be false: SGLang ties lm_head to embed_tokens otherwise")
    shapes = {
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "fc.weight": (h, NUM_AUX * t),
        "norm.weight": (h,),
        "lm_head.weight": (n, h),
    }
    if n != v:
        shapes["d2t"] = (n,)
    for name, shape in shapes.items():
        if name not in tensors:
            why = " (the draft vocabulary is smaller than the target's: d2t maps it)" if name == "d2t" else ""
            raise ValueError(f"model.safetensors lacks {name!r}{why}, which {engine} loads")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name!r} has shape {tuple(tensors[name].shape)}, {engine} expects {shape}")
    if "d2t" in tensors:
        d2t = tensors["d2t"]
        if d2t.dtype != torch.int64 or d2t.shape != (n,):
            raise ValueError(f"'d2t' must be int64 [{n}], got {d2t.dtype} {tuple(d2t.shape)}")
        ids = d2t + torch.arange(n)
        if int(ids.min()) < 0 or int(ids.max()) >= v or len(torch.unique(ids)) != n:
            raise ValueError(f"'d2t' must map the {n} draft ids to distinct target ids in [0, {v})")
    if "embed_tokens.weight" in tensors and tuple(tensors["embed_tokens.weight"].shape) != (v, h):
        raise ValueError(f"'embed_tokens.weight' has shape {tuple(tensors['embed_tokens.weight'].shape)}, "
                         f"{engine} expects {(v, h)}")  # fmt: skip


def export_eagle3(head, target, out, engine, embed_tokens=False):
    """Write `out/config.json` and `out/model.safetensors` for `engine` ("vllm" or "sglang") from `head`, trained
    for the transformers `target` (checked: `head.check_target`). `embed_tokens`: also write the target's input
    embedding. Returns the folder. ValueError (naming the field) for a head the engine would refuse."""
    from safetensors.torch import save_file

    _check_head(head)
    head.check_target(target)
    config = export_config(head, target.config, engine)
    tensors = export_tensors(head, target.get_input_embeddings().weight if embed_tokens else None)
    check_export(config, tensors, engine)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS_NAME + ".partial")
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_NAME)
    (out / WEIGHTS_NAME).chmod(0o644)  # safetensors writes 0600; a serving container may run as another user
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    logger.info("wrote %s (%s: %s)", out, engine, config["architectures"][0])
    return out


def exported_positions(config):
    """The head's `positions` fields from an exported `config.json`: `"mrope"` with its sections where
    `rope_scaling.mrope_section` is set (what makes both engines rotate the draft by M-RoPE), else `"slot"`."""
    rope = config.get("rope_scaling") or {}
    if not rope.get("mrope_section"):
        return {"positions": "slot"}
    return {"positions": "mrope", "mrope_section": [int(n) for n in rope["mrope_section"]],
            "mrope_interleaved": bool(rope.get("mrope_interleaved", False))}  # fmt: skip


def load_exported(folder, dtype=torch.float32):
    """An `Eagle3Head` from an exported folder (the round trip): the weights as stored (bf16 values), the draft
    vocabulary from `d2t`, aux layers from the engine's ids. ValueError naming the field or tensor otherwise."""
    from safetensors.torch import load_file

    from mmspec.models.hf.eagle3 import Eagle3Head

    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
        tensors = load_file(folder / WEIGHTS_NAME)
    except (OSError, ValueError) as err:
        raise ValueError(f"{str(folder)!r} is not an exported EAGLE-3 folder ({err})") from err
    architecture = (config.get("architectures") or [None])[0]
    engine = "sglang" if architecture == ARCHITECTURES["sglang"] else "vllm"
    try:
        check_export(config, tensors, engine)
    except ValueError as err:
        raise ValueError(f"{str(folder)!r}: {err}") from err
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    aux = list(ids) if engine == "vllm" else [i + 1 for i in ids]
    vocab, draft = config["vocab_size"], config["draft_vocab_size"]
    head = Eagle3Head(
        vocab_size=vocab, hidden_size=config["hidden_size"], target_hidden_size=config["target_hidden_size"],
        intermediate_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        rope_theta=float(config.get("rope_theta", 10000.0)), rms_norm_eps=float(config["rms_norm_eps"]),
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        draft_vocab_size=draft if draft != vocab else 0, aux_layers=aux,
        image_inputs=(config.get("mmspec") or {}).get("image_inputs", "placeholder" if engine == "vllm" else "embeds"),
        **exported_positions(config),
    )  # fmt: skip
    state = {k: v.to(dtype) for k, v in tensors.items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    state["draft_vocab"] = tensors["d2t"] + torch.arange(draft) if head.config.draft_vocab_size else torch.arange(0)
    head.to(dtype).load_state_dict(state, strict=True)
    return head.eval()
