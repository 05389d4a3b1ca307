"""CLIP score (`mmspec.eval.clip_score`): the offline CLIP tokenizer, the transformers-5 adapter and the metric on a
tiny random CLIP, checked against hand computations."""

import functools
import gzip
import importlib.util
import json
import math

import pytest
import torch
import torch.nn.functional as F


if importlib.util.find_spec("open_clip") is None:
    pytest.skip(
        "the CLIP tokenizer needs the BPE file of open-clip-torch: pip install --no-deps open-clip-torch==3.3.0",
        allow_module_level=True,
    )

import regex  # noqa: E402  (a dependency of transformers)

from mmspec.eval.clip_score import (  # noqa: E402
    CLIPFeatureAdapter,
    clip_tokenizer_from_open_clip,
    compute_clip_score,
    load_clip,
    open_clip_bpe_path,
    tiny_random_clip,
)


SOT, EOT = 49406, 49407
PROMPTS = ["a photo of a cat", "a dog", "red", "a blue circle on a white background", "x", "two birds"]
STRINGS = [
    "a photo of a cat",
    "Hello,  WORLD!! it's 2024 - isn't it?",
    "naïve café, Zürich; 3.14159",
    "emoji 🙂 and tabs\tand\nnewlines",
]


@pytest.fixture(scope="module")
def tokenizer():
    return clip_tokenizer_from_open_clip()


@pytest.fixture(scope="module")
def clip4():
    # seed 4 gives pair cosines of both signs with a positive mean (checked in the tests that rely on it)
    return tiny_random_clip(seed=4)


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (len(PROMPTS), 3, 32, 32), generator=g, dtype=torch.uint8)  # [N, 3, 32, 32]


def pair_cosines(clip, images, prompts, **text_kwargs) -> torch.Tensor:
    """cos(image_i, text_i) [N] from the plain CLIPModel forward (not through the adapter or torchmetrics)."""
    model, processor = clip
    text = processor.tokenizer(prompts, padding=True, return_tensors="pt", **text_kwargs)
    pixels = processor.image_processor(list(images), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels)
    return F.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)


# --- tokenizer ---------------------------------------------------------------------------------------------------


@functools.cache
def reference_bpe() -> tuple[list[tuple[str, str]], dict[int, str], dict[str, int]]:
    """(merges in rank order, byte -> symbol, token -> id) of OpenAI CLIP, read from the BPE file."""
    lines = gzip.open(open_clip_bpe_path(), "rt", encoding="utf-8").read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    rest = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(rest)}
    base = [char[b] for b in printable + rest]
    vocab = (
        base + [c + "</w>" for c in base] + ["".join(pair) for pair in merges] + ["<|startoftext|>", "<|endoftext|>"]
    )
    return merges, char, {token: i for i, token in enumerate(vocab)}


def reference_clip_ids(text: str) -> list[int]:
    """OpenAI CLIP tokenization written out: clean, split, byte-encode, apply merges by rank, look up ids."""
    merges, char, ids = reference_bpe()
    rank = {pair: i for i, pair in enumerate(merges)}
    text = regex.sub(r"\s+", " ", text).strip().lower()
    pattern = r"'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"
    out = [SOT]
    for word in regex.findall(pattern, text):
        symbols = [char[b] for b in word.encode("utf-8")]
        symbols[-1] += "</w>"
        while len(symbols) > 1:
            best, i = min((rank.get(pair, math.inf), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
            if best == math.inf:
                break
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        out += [ids[s] for s in symbols]
    return out + [EOT]


def test_tokenizer_gives_the_openai_clip_ids(tokenizer):
    assert len(tokenizer) == 49408 and tokenizer.model_max_length == 77
    assert tokenizer("a photo of a cat")["input_ids"] == [SOT, 320, 1125, 539, 320, 2368, EOT]
    assert tokenizer.pad_token_id == EOT and tokenizer.bos_token_id == SOT
    merges, _, ids = reference_bpe()
    assert tokenizer.get_vocab() == ids
    if hasattr(tokenizer, "backend_tokenizer"):  # a `tokenizers` BPE (transformers 5): its merges, in rank order
        assert [tuple(m) for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]] == merges
    for text in STRINGS:
        assert tokenizer(text)["input_ids"] == reference_clip_ids(text), text


def test_tokenizer_matches_open_clip_simple_tokenizer(tokenizer):
    # open_clip's SimpleTokenizer imports ftfy (in the test extra): a missing ftfy fails here, loudly
    path = open_clip_bpe_path().parent / "tokenizer.py"  # loaded alone: `import open_clip` needs torchvision
    spec = importlib.util.spec_from_file_location("open_clip_tokenizer_alone", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference = module.SimpleTokenizer()
    for text in STRINGS:
        assert tokenizer(text)["input_ids"] == [SOT, *reference.encode(text), EOT], text


def test_tokenizer_cache_dir_is_written_then_reused(tmp_path, tokenizer):
    first = clip_tokenizer_from_open_clip(tmp_path)
    assert (tmp_path / "vocab.json").is_file() and (tmp_path / "merges.txt").is_file()
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")  # a reused cache: no merges -> bytes only
    reused = clip_tokenizer_from_open_clip(tmp_path)
    assert first("a photo")["input_ids"] == tokenizer("a photo")["input_ids"]
    assert reused("a photo")["input_ids"] != tokenizer("a photo")["input_ids"]


# --- adapter -----------------------------------------------------------------------------------------------------


def test_adapter_returns_projected_embedding_tensors(clip4, images):
    model, processor = clip4
    text = processor.tokenizer(PROMPTS[:2], padding=True, return_tensors="pt")
    pixels = processor.image_processor(list(images[:2]), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        image_emb = model.get_image_features(pixels)
        text_emb = model.get_text_features(text["input_ids"], text["attention_mask"])
        out = model.model(**text, pixel_values=pixels)  # its image_embeds / text_embeds are L2-normalised
        vision = model.model.visual_projection(model.model.vision_model(pixel_values=pixels).pooler_output)
    assert type(image_emb) is torch.Tensor and image_emb.shape == (2, 16)
    assert type(text_emb) is torch.Tensor and text_emb.shape == (2, 16)
    torch.testing.assert_close(image_emb, vision)
    torch.testing.assert_close(F.normalize(image_emb, dim=-1), out.image_embeds)
    torch.testing.assert_close(F.normalize(text_emb, dim=-1), out.text_embeds)
    assert model.config is model.model.config and not model.train().training


def test_adapter_passes_tensors_through_and_rejects_other_outputs():
    class Old(torch.nn.Module):  # transformers < 5: the methods return tensors
        def get_image_features(self, pixel_values):
            return pixel_values.flatten(1)

        def get_text_features(self, input_ids, attention_mask=None):
            return (input_ids,)

    adapter = CLIPFeatureAdapter(Old())
    x = torch.ones(2, 3)
    assert adapter.get_image_features(x) is not None and torch.equal(adapter.get_image_features(x), x)
    with pytest.raises(TypeError, match="get_text_features returned tuple"):
        adapter.get_text_features(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="get_image_features"):
        CLIPFeatureAdapter(torch.nn.Linear(2, 2))


# --- the metric --------------------------------------------------------------------------------------------------


def test_tiny_random_clip_is_deterministic_and_leaves_the_global_rng_alone(clip4):
    state = torch.get_rng_state()
    again, _ = tiny_random_clip(seed=4)
    other, _ = tiny_random_clip(seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    params = dict(clip4[0].named_parameters())
    assert all(torch.equal(p, params[name]) for name, p in again.named_parameters())
    assert not torch.equal(other.model.text_projection.weight, again.model.text_projection.weight)


def test_clip_score_equals_the_clamped_mean_of_pair_cosines(clip4, images):
    cos = pair_cosines(clip4, images, PROMPTS)
    assert (cos < 0).any() and cos.mean() > 0  # so "clamp the mean" and "clamp each pair" differ
    result = compute_clip_score(images, PROMPTS, clip4, batch_size=4)
    assert result["clip_score"] == pytest.approx(100 * cos.mean().item(), abs=1e-4)
    assert result["num_samples"] == len(PROMPTS)
    protocol = result["protocol"]
    assert protocol["model"].startswith("tiny-random-clip (seed 4") and protocol["image_size"] == 32
    assert protocol["input"] == "uint8 [0, 255]" and protocol["channels"] == "3"
    assert "center crop 32x32" in protocol["resize"] and "clamp on the mean" in protocol["score"]


def test_negative_mean_is_clamped_to_zero(images):
    clip = tiny_random_clip(seed=1)
    assert pair_cosines(clip, images, PROMPTS).mean() < 0
    assert compute_clip_score(images, PROMPTS, clip)["clip_score"] == 0.0


def test_float_grayscale_and_batching_give_the_same_score(clip4, images):
    reference = compute_clip_score(images, PROMPTS, clip4)["clip_score"]
    as_float = compute_clip_score(images.double() / 255, PROMPTS, clip4, batch_size=1)
    assert as_float["clip_score"] == pytest.approx(reference, abs=1e-4)
    assert as_float["protocol"]["input"].startswith("float [0, 1] -> round(x * 255)")
    gray = images[:, :1]
    result = compute_clip_score(gray, PROMPTS, clip4)
    assert result["clip_score"] == pytest.approx(compute_clip_score(gray.expand(-1, 3, -1, -1), PROMPTS, clip4)
                                                 ["clip_score"], abs=1e-5)  # fmt: skip
    assert result["protocol"]["channels"].startswith("1 (grayscale)")


def test_processor_takes_uint8_pixels_and_normalizes_once(clip4, images):
    pixels = clip4[1].image_processor(list(images[:2]), return_tensors="pt")["pixel_values"]
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
    torch.testing.assert_close(pixels, (images[:2].float() / 255 - mean) / std, atol=1e-5, rtol=0)


def test_long_prompts_are_truncated_with_the_end_token_kept(clip4, images, recwarn):
    prompts = [" ".join(["word"] * 100 + [str(i)]) for i in range(2)] + PROMPTS[2:4]
    ids = clip4[1].tokenizer(prompts[:1], truncation=True, max_length=77)["input_ids"][0]
    assert len(ids) == 77 and ids[-1] == EOT
    cos = pair_cosines(clip4, images[:4], prompts, truncation=True, max_length=77)
    result = compute_clip_score(images[:4], prompts, clip4)
    assert result["clip_score"] == pytest.approx(max(100 * cos.mean().item(), 0.0), abs=1e-4)
    assert not [w for w in recwarn if "longer than" in str(w.message)]


def test_a_saved_clip_folder_loads_and_scores_the_same(tmp_path, clip4, images):
    clip4[0].model.save_pretrained(tmp_path)
    clip4[1].save_pretrained(tmp_path)
    result = compute_clip_score(images, PROMPTS, tmp_path)
    assert result["clip_score"] == pytest.approx(compute_clip_score(images, PROMPTS, clip4)["clip_score"], abs=1e-6)
    assert result["protocol"]["model"] == str(tmp_path) and result["protocol"]["image_size"] == 32
    with pytest.raises(OSError, match="could not load CLIP .*\n.*local folder"):
        load_clip(tmp_path / "missing")


def test_bad_inputs_raise(clip4, images):
    with pytest.raises(ValueError, match="prompts has 5 entries but images has 6"):
        compute_clip_score(images, PROMPTS[:5], clip4)
    with pytest.raises(TypeError, match="prompts must be a list"):
        compute_clip_score(images[:1], "a cat", clip4)
    with pytest.raises(TypeError, match=r"prompts\[1\] is int"):
        compute_clip_score(images[:2], ["a cat", 3], clip4)
    with pytest.raises(ValueError, match="float images must lie in"):
        compute_clip_score(images.float(), PROMPTS, clip4)
    with pytest.raises(TypeError, match="images must be uint8"):
        compute_clip_score(images.long(), PROMPTS, clip4)
    with pytest.raises(TypeError, match="images must be a torch.Tensor"):
        compute_clip_score(images.numpy(), PROMPTS, clip4)
    with pytest.raises(ValueError, match="images must have shape"):
        compute_clip_score(images[0], PROMPTS[:1], clip4)
    with pytest.raises(ValueError, match="batch_size"):
        compute_clip_score(images, PROMPTS, clip4, batch_size=0)
    with pytest.raises(TypeError, match="model_and_processor"):
        compute_clip_score(images, PROMPTS, 3)
    with pytest.raises(TypeError, match=r"model_and_processor\[0\]"):
        compute_clip_score(images, PROMPTS, ("model", clip4[1]))
