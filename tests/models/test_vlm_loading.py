"""Every component of a saved `SpeculativeVLMPipeline` (target, draft LM, EAGLE head) loads strictly, and broken zoo
drafter / head files are refused with a ValueError naming the file and the key."""

import json
import shutil

import pytest
from safetensors.torch import save_file
from vlm_fixtures import tiny_lm, tiny_tokenizer

from mmspec.models import DEFAULT_ZOO, load
from mmspec.models.hf.draft import load_vlm_draft, save_draft_delta, truncated_draft
from mmspec.models.hf.eagle import TextEagleHead
from mmspec.models.storage import read_weights
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


WEIGHTS = {"model": "model.safetensors", "draft_model": "model.safetensors",
           "eagle_head": "diffusion_pytorch_model.safetensors"}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    target = tiny_lm(3, seed=1)
    head = TextEagleHead.from_target(target)
    head.init_weights()
    pipe = SpeculativeVLMPipeline(target, tiny_tokenizer(), draft_model=truncated_draft(target, 1), eagle_head=head)
    folder = tmp_path_factory.mktemp("vlm") / "pipe"
    pipe.save_pretrained(folder)
    return pipe, folder


def _copy(saved, tmp_path):
    folder = tmp_path / "pipe"
    shutil.copytree(saved[1], folder)
    return folder


def _rewrite(file, change):
    state = read_weights(file)
    change(state)
    save_file(state, file, metadata={"format": "pt"})


@pytest.mark.parametrize("component", sorted(WEIGHTS))
def test_missing_weight_is_refused_naming_folder_and_key(saved, tmp_path, component):
    folder = _copy(saved, tmp_path)
    file = folder / component / WEIGHTS[component]
    key = sorted(k for k in read_weights(file) if "layers.0.mlp.down_proj" in k or "layer.mlp.down_proj" in k)[0]
    _rewrite(file, lambda state: state.pop(key))
    with pytest.raises(ValueError, match=rf"{component}'.*(weights lack|missing).*{key.split('.')[-3]}"):
        SpeculativeVLMPipeline.from_pretrained(folder)


@pytest.mark.parametrize("component,field,value", [
    ("model", "num_hidden_layers", 4),
    ("model", "num_hidden_layers", 2),
    ("draft_model", "num_hidden_layers", 2),
    ("eagle_head", "intermediate_size", 64),
    ("eagle_head", "num_key_value_heads", 4),
])  # fmt: skip
def test_config_that_disagrees_with_the_weights_is_refused(saved, tmp_path, component, field, value):
    folder = _copy(saved, tmp_path)
    config = json.loads((folder / component / "config.json").read_text())
    config[field] = value
    (folder / component / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{component}'"):
        SpeculativeVLMPipeline.from_pretrained(folder)


@pytest.mark.parametrize("component", sorted(WEIGHTS))
def test_garbage_weights_file_is_refused_naming_it(saved, tmp_path, component):
    folder = _copy(saved, tmp_path)
    file = folder / component / WEIGHTS[component]
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # truncated
    with pytest.raises(ValueError, match=rf"{component}"):
        SpeculativeVLMPipeline.from_pretrained(folder)


# ------------------------------------------------------------------ zoo drafter / head folders
@pytest.fixture
def draft_folder(tmp_path):
    target = tiny_lm(3, seed=1)
    draft = truncated_draft(target, 1)
    folder = tmp_path / "draft"
    save_draft_delta(draft, folder, ["model.norm.weight"], 1)
    return target, folder


@pytest.mark.parametrize(
    "damage,file,needle",
    [
        (lambda f: f.write_bytes(f.read_bytes()[:40]), "model.safetensors", "corrupt"),
        (lambda f: f.write_bytes(b"\x00" * 64), "model.safetensors", "corrupt"),
        (lambda f: f.write_text("{}"), "draft.json", "trained"),
        (lambda f: f.write_text('{"num_layers": 7, "trained": []}'), "draft.json", "num_layers"),
        (lambda f: f.write_text('{"num_layers": "x", "trained": []}'), "draft.json", "num_layers"),
    ],
)
def test_broken_zoo_draft_folder_names_the_file(draft_folder, damage, file, needle):
    target, folder = draft_folder
    damage(folder / file)
    with pytest.raises(ValueError, match=rf"{folder / file}.*{needle}|{needle}.*{folder / file}"):
        load_vlm_draft(folder, target)


def test_non_finite_draft_weights_are_refused(draft_folder):
    target, folder = draft_folder
    _rewrite(folder / "model.safetensors", lambda s: s["model.norm.weight"].fill_(float("nan")))
    with pytest.raises(ValueError, match=r"model.safetensors: model.norm.weight is not a finite"):
        load_vlm_draft(folder, target)


def test_shipped_eagle_head_loads_strictly_and_a_broken_copy_is_named(tmp_path):
    head = load(DEFAULT_ZOO / "mnist-vlm-eagle")
    assert isinstance(head, TextEagleHead) and head.draft_vocab.shape == (2048,)
    folder = tmp_path / "eagle"
    shutil.copytree(DEFAULT_ZOO / "mnist-vlm-eagle", folder)
    _rewrite(folder / "diffusion_pytorch_model.safetensors", lambda s: s.pop("fc.bias"))
    with pytest.raises(ValueError, match=r"eagle'.*weights lack 'fc.bias'"):
        load(folder)
