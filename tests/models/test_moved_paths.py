"""Module paths from before the family folders still import (as the modules that now hold the code), and a
pipeline saved with them in its `model_index.json` still loads; every package is in the wheel's package list."""

import importlib
import json
from pathlib import Path

import pytest
import tomllib


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("old", sorted(__import__("mmspec.models", fromlist=["MOVED"]).MOVED))
def test_an_old_module_path_is_the_new_module(old):
    from mmspec.models import MOVED

    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


@pytest.mark.parametrize("family, main, name", [("llamagen", "gpt", "LlamaGenGPT"), ("mar", "model", "MAR"),
                                                ("janus", "target", "JanusTarget"), ("hf", "target", "HFTarget")])  # fmt: skip
def test_a_family_package_answers_as_the_module_it_was(family, main, name):
    package = importlib.import_module(f"mmspec.models.{family}")
    module = importlib.import_module(f"mmspec.models.{family}.{main}")
    assert getattr(package, name) is getattr(module, name)


@pytest.mark.zoo
def test_a_pipeline_saved_with_the_old_paths_loads(tmp_path):
    """The zoo's image pipeline saved, its index rewritten to the module paths mmspec wrote before the family folders
    (`mmspec.models.llamagen`, `mmspec.models.vq`, `mmspec.models.eagle`), loads in a fresh process: same classes,
    same weights."""
    import subprocess
    import sys

    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_zoo()
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    old = {
        "LlamaGenGPT": "mmspec.models.llamagen",
        "LlamaGenVQ": "mmspec.models.vq",
        "EagleHead": "mmspec.models.eagle",
    }
    for value in index.values():
        if isinstance(value, list) and value[1] in old:
            value[0] = old[value[1]]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    code = (
        "import sys, torch; from mmspec.pipelines import SpeculativeARImagePipeline as P\n"
        f"p = P.from_pretrained({str(tmp_path)!r})\n"
        "print(type(p.transformer).__module__, type(p.vqvae).__module__, type(p.eagle_head).__module__)\n"
        "print(float(sum(t.double().sum() for t in p.eagle_head.state_dict().values())))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    modules, total = done.stdout.strip().splitlines()[-2:]
    assert modules == "mmspec.models.llamagen.gpt mmspec.models.llamagen.vq mmspec.models.llamagen.eagle"
    expected = float(sum(t.double().sum() for t in pipe.eagle_head.state_dict().values()))
    assert float(total) == expected


def test_every_package_is_in_the_package_list():
    """A wheel holds only the packages `pyproject.toml` lists: every folder with an `__init__.py` is there."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(["mmspec", *p.parent.relative_to(ROOT / "mmspec").parts])
        for p in (ROOT / "mmspec").rglob("__init__.py")
    }
    assert found - listed == set()
