"""Strict loading of zoo folders (`mmspec.models.load`, `read_config`) and of pipelines built from them: a
`config.json` that disagrees with its weights, a field of the wrong type or range, a corrupt, missing or pickled weights
file, and components that do not fit together are all `ValueError`s naming the folder and the field or key, raised
before anything is generated; nothing is ever left randomly initialised."""

import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import mmspec.models
from mmspec.models import MODEL_CLASSES, load, read_config
from mmspec.models.classifier import MNISTClassifier
from mmspec.models.config_fields import CONFIG_FIELDS
from mmspec.models.llamagen.eagle import EagleHead
from mmspec.models.llamagen.gpt import LlamaGenGPT
from mmspec.models.llamagen.vq import LlamaGenVQ
from mmspec.models.storage import read_weights


ZOO = Path(__file__).resolve().parents[2] / "assets"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _where(folder):
    return re.escape(f"path={str(folder)!r}")


def _zoo_copy(tmp_path, name="mnist-c2i", dest=None, **changes):
    """`assets/<name>` in tmp_path (weights linked, not copied) with `changes` applied to its config.json."""
    folder = tmp_path / (dest or name)
    folder.mkdir()
    (folder / WEIGHTS).symlink_to(ZOO / name / WEIGHTS)
    config = json.loads((ZOO / name / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))
    return folder


def _rewrite_weights(folder, change):
    weights = read_weights(folder / WEIGHTS)
    change(weights)
    (folder / WEIGHTS).unlink()  # a link into assets/: never write through it
    save_file(weights, folder / WEIGHTS, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------- config vs weights


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(n_layer=4), r"unexpected keys 'layers\.4\..*\(28 in all\).*does config\.json match the weights"),
        (dict(n_layer=12), r"weights lack 'layers\.8\..*\(28 in all\)"),
        (dict(dim="abc"), r"LlamaGenGPT field dim must be an int >= 1, got 'abc' \(str\)"),
        (dict(dim=128), r"weight 'cls_embedding\.embedding_table\.weight' has shape \(11, 256\), the config gives"),
        (dict(num_classes=9), r"'cls_embedding\.embedding_table\.weight' has shape \(11, 256\)"),
        (dict(vocab_size=512), r"'tok_embeddings\.weight' has shape \(256, 256\)"),
        (dict(n_layers=8), r"field\(s\) \['n_layers'\] that LlamaGenGPT does not take"),
        (dict(n_layer=True), r"n_layer must be an int >= 1, got True \(bool\)"),
        (dict(n_layer=8.0), r"n_layer must be an int >= 1, got 8\.0"),
        (dict(norm_eps=-1e-5), r"norm_eps must be a finite number > 0"),
        (dict(resid_dropout_p=1.5), r"resid_dropout_p must be a finite number >= 0\.0 and <= 1\.0"),
        (dict(model_type="x2i"), r"model_type must be one of \('c2i', 't2i'\)"),
        (dict(block_size=15), r"block_size=15 must be a perfect square"),
        (dict(n_head=7), r"dim=256 must be divisible by n_head=7"),
    ],
)
def test_zoo_target_config_that_disagrees_with_its_weights_is_refused(tmp_path, changes, match):
    folder = _zoo_copy(tmp_path, **changes)
    with pytest.raises(ValueError, match=_where(folder) + ".*" + match):
        load(folder)


def test_config_fields_are_checked_without_loading_weights_or_torch(tmp_path):
    folder = _zoo_copy(tmp_path, dim="abc")
    (folder / WEIGHTS).unlink()  # read_config never looks at the weights
    with pytest.raises(ValueError, match=_where(folder) + ".*dim must be an int"):
        read_config(folder)
    code = (
        "import sys, mmspec.models as m\n"
        f"config = m.read_config({str(ZOO / 'mnist-c2i')!r})\n"
        "assert config['num_classes'] == 10\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", sorted(CONFIG_FIELDS))
def test_every_constructor_argument_has_a_field_rule(name):
    cls = mmspec.models.loading._zoo_class(name)
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert sorted(params) == sorted(CONFIG_FIELDS[name]) and name in MODEL_CLASSES


@pytest.mark.parametrize(
    "cls, field, value",
    [
        (LlamaGenGPT, "vocab_size", 0),
        (LlamaGenGPT, "caption_dim", "2048"),
        (LlamaGenGPT, "ffn_dim_multiplier", float("nan")),
        (LlamaGenGPT, "class_dropout_prob", -0.1),
        (LlamaGenGPT, "n_kv_head", 0),
        (EagleHead, "fc_bias", "yes"),
        (EagleHead, "rope_base", 0),
        (LlamaGenVQ, "ch_mult", []),
        (LlamaGenVQ, "ch_mult", [1, "2"]),
        (LlamaGenVQ, "codebook_l2_norm", 1),
        (LlamaGenVQ, "sample_size", 0),
        (MNISTClassifier, "channels", [32]),
        (MNISTClassifier, "image_size", 2),
        (MNISTClassifier, "dropout", float("inf")),
    ],
)
def test_constructors_check_field_types_and_ranges(cls, field, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__} field {field} must be"):
        cls(**{field: value})


def test_eagle_head_checks_kv_heads():
    with pytest.raises(ValueError, match="n_head=4 must be divisible by n_kv_head=3"):
        EagleHead(dim=32, n_head=4, n_kv_head=3, vocab_size=16, block_size=16)


def test_vq_sample_size_must_fit_the_downsampling():
    with pytest.raises(ValueError, match="sample_size=30 must be a multiple of the downsampling factor 4"):
        LlamaGenVQ(ch=8, ch_mult=(1, 2, 2), z_channels=8, norm_num_groups=4, sample_size=30)


# ---------------------------------------------------------------------------------------------- weights files


def test_missing_or_extra_or_bad_tensors_are_refused(tmp_path):
    missing = _zoo_copy(tmp_path, dest="missing")
    _rewrite_weights(missing, lambda w: w.pop("layers.3.feed_forward.w2.weight"))
    with pytest.raises(ValueError, match=_where(missing) + ".*weights lack 'layers.3.feed_forward.w2.weight'"):
        load(missing)
    extra = _zoo_copy(tmp_path, dest="extra")
    _rewrite_weights(extra, lambda w: w.update({"pos_embedding": torch.zeros(3)}))
    with pytest.raises(ValueError, match=_where(extra) + ".*unexpected keys 'pos_embedding'"):
        load(extra)
    nan = _zoo_copy(tmp_path, dest="nan")
    _rewrite_weights(nan, lambda w: w["norm.weight"].__setitem__(0, float("nan")))
    with pytest.raises(ValueError, match=_where(nan) + ".*'norm.weight' holds non-finite values"):
        load(nan)
    ints = _zoo_copy(tmp_path, dest="ints")
    _rewrite_weights(ints, lambda w: w.update({"norm.weight": w["norm.weight"].long()}))
    with pytest.raises(ValueError, match=_where(ints) + ".*'norm.weight' has dtype torch.int64"):
        load(ints)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda data: b"not a safetensors file" * 8, "cannot read diffusion_pytorch_model.safetensors: corrupt"),
        (lambda data: data[: len(data) // 2], "cannot read diffusion_pytorch_model.safetensors: corrupt"),
        (lambda data: b"", "cannot read diffusion_pytorch_model.safetensors: corrupt"),
        (None, "no weights file diffusion_pytorch_model.safetensors"),
    ],
    ids=["garbage", "truncated", "empty", "absent"],
)
def test_corrupt_or_missing_weights_file_names_the_folder(tmp_path, damage, match):
    folder = _zoo_copy(tmp_path, name="mnist-c2i-eagle")
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).unlink()
    if damage is not None:
        (folder / WEIGHTS).write_bytes(damage(data))
    with pytest.raises(ValueError, match=_where(folder) + ".*" + match):
        load(folder)


def test_pickled_weights_are_named_and_refused(tmp_path):
    folder = _zoo_copy(tmp_path, name="mnist-classifier")
    model = load(folder)
    (folder / WEIGHTS).unlink()
    torch.save(model.state_dict(), folder / "diffusion_pytorch_model.bin")
    with pytest.raises(ValueError, match=r"found \['diffusion_pytorch_model.bin'\]: pickle weights are never loaded"):
        load(folder)


def test_sharded_weights_load_and_a_missing_shard_is_named(tmp_path):
    model = load(ZOO / "mnist-classifier")
    state = model.state_dict()
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(ZOO / "mnist-classifier" / "config.json", folder / "config.json")
    keys = list(state)
    shards = {"part-1.safetensors": keys[: len(keys) // 2], "part-2.safetensors": keys[len(keys) // 2 :]}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, folder / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, names in shards.items() for k in names}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load(folder)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    (folder / "part-2.safetensors").unlink()
    with pytest.raises(ValueError, match=_where(folder) + ".*shard 'part-2.safetensors'"):
        load(folder)


@pytest.mark.parametrize("name", ["mnist-c2i", "mnist-c2i-draft", "mnist-c2i-eagle", "mnist-vq", "mnist-classifier"])
def test_zoo_loads_exactly_its_stored_weights_as_trainable_float32(name):
    model = load(ZOO / name)
    stored = read_weights(ZOO / name / WEIGHTS)
    state = model.state_dict()
    assert state.keys() == stored.keys()
    assert all(torch.equal(state[k], v.float()) for k, v in stored.items())
    assert all(p.requires_grad and p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert model.config._name_or_path == str(ZOO / name) and not model.training


# ---------------------------------------------------------------------------------------------- pipelines


def test_pipeline_refuses_a_transformer_whose_block_size_is_not_the_vq_grid(tmp_path):
    from mmspec.pipelines import SpeculativeARImagePipeline

    target = _zoo_copy(tmp_path, block_size=16)
    assert load(target).config.block_size == 16  # a block size touches no weight: only the pipeline can tell
    for name in ("mnist-vq", "mnist-c2i-eagle"):
        _zoo_copy(tmp_path, name=name)
    grid = re.escape("transformer block_size=16 does not match the vqvae's 8x8 token grid")
    with pytest.raises(ValueError, match=re.escape(f"root={str(tmp_path)!r}") + ".*" + grid):
        SpeculativeARImagePipeline.from_zoo(tmp_path)
    with pytest.raises(ValueError, match=grid + ".*block_size must be 64"):
        SpeculativeARImagePipeline(load(target), load(ZOO / "mnist-vq"))


def test_pipeline_from_pretrained_loads_components_strictly(tmp_path):
    from mmspec.pipelines import SpeculativeARImagePipeline

    target = LlamaGenGPT(vocab_size=16, dim=32, n_layer=2, n_head=2, num_classes=4, block_size=16, multiple_of=8)
    target.init_weights(torch.Generator().manual_seed(0), zero_output=False)
    vq = LlamaGenVQ(codebook_size=16, codebook_embed_dim=4, ch=8, ch_mult=(1, 2, 2), z_channels=8, in_channels=1,
                    num_res_blocks=1, norm_num_groups=4, sample_size=16)  # fmt: skip
    folder = tmp_path / "pipe"
    SpeculativeARImagePipeline(target, vq).save_pretrained(folder)
    loaded = SpeculativeARImagePipeline.from_pretrained(folder)
    assert all(torch.equal(v, loaded.transformer.state_dict()[k]) for k, v in target.state_dict().items())
    _rewrite_weights(folder / "transformer", lambda w: w.pop("layers.1.attention.wo.weight"))
    with pytest.raises(ValueError, match=_where(folder / "transformer") + ".*weights lack 'layers.1.attention.wo"):
        SpeculativeARImagePipeline.from_pretrained(folder)
