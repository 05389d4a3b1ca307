"""Janus loading is strict and its inputs are checked before the first forward (issue 31): every file the zoo's
`mnist-janus` needs is present and consistent or the error names it (tested on a copy in tmp_path with one file
deleted or altered); prompts with special tokens or lone surrogates, `input_ids` without the begin-of-image token
and a bogus `device` are refused with errors naming the argument."""

import json
import logging
import shutil

import pytest
import torch
from vlm_fixtures import tiny_llava
from vlm_fixtures import tiny_processor as tiny_vlm_processor

from mmspec.checks import check_device, check_prompts
from mmspec.models import DEFAULT_ZOO
from mmspec.pipelines import SpeculativeJanusPipeline, SpeculativeVLMPipeline


ZOO_JANUS = DEFAULT_ZOO / "mnist-janus"


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(1)
    pipe = SpeculativeJanusPipeline.from_zoo()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def folder(tmp_path):
    """A copy of the zoo's Janus folder to damage."""
    return shutil.copytree(ZOO_JANUS, tmp_path / "mnist-janus")


def _edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


# ------------------------------------------------------------------ loading
def test_the_intact_copy_loads(folder):
    assert isinstance(SpeculativeJanusPipeline.from_pretrained(folder), SpeculativeJanusPipeline)


def test_missing_processor_config_is_named_not_the_hub(folder):
    (folder / "processor_config.json").unlink()
    with pytest.raises(ValueError, match="no processor_config.json") as err:
        SpeculativeJanusPipeline.from_pretrained(folder)
    assert "huggingface.co" not in str(err.value)


def test_missing_chat_template_is_an_error(folder):
    (folder / "chat_template.jinja").unlink()  # transformers loads the processor without it, silently
    with pytest.raises(ValueError, match="no chat template \\(chat_template.jinja\\)"):
        SpeculativeJanusPipeline.from_pretrained(folder)


def test_generation_config_boi_that_is_not_the_tokenizers_is_an_error(folder):
    _edit_json(folder / "generation_config.json", lambda g: g["generation_kwargs"].update(boi_token_id=8))
    with pytest.raises(ValueError, match="generation_config.json.*boi_token_id=8 \\(the tokenizer's: 7\\)"):
        SpeculativeJanusPipeline.from_pretrained(folder)


@pytest.mark.parametrize("layers, kind", [(3, "unexpected_keys"), (5, "missing_keys")])
def test_num_hidden_layers_that_does_not_fit_the_weights_is_an_error(folder, layers, kind):
    _edit_json(folder / "config.json", lambda c: c["text_config"].update(num_hidden_layers=layers))
    with pytest.raises(ValueError, match=f"the weights do not fit config.json \\({kind}: 9, .*layers\\.[34]\\."):
        SpeculativeJanusPipeline.from_pretrained(folder)


def test_a_save_pretrained_folder_loads_strictly(tmp_path, pipe):
    saved = tmp_path / "pipe"
    pipe.save_pretrained(saved)
    loaded = SpeculativeJanusPipeline.from_pretrained(saved)
    assert all(torch.equal(a, b) for a, b in zip(pipe.model.state_dict().values(), loaded.model.state_dict().values()))
    _edit_json(saved / "model" / "config.json", lambda c: c["text_config"].update(num_hidden_layers=3))
    with pytest.raises(ValueError, match="unexpected_keys"):
        SpeculativeJanusPipeline.from_pretrained(saved)
    _edit_json(saved / "model" / "config.json", lambda c: c["text_config"].update(num_hidden_layers=4))
    (saved / "processor" / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="chat_template.jinja"):
        SpeculativeJanusPipeline.from_pretrained(saved)


def test_mismatched_special_ids_are_refused_by_the_constructor(pipe):
    model = pipe.model
    saved = model.generation_config.generation_kwargs
    model.generation_config.generation_kwargs = {"boi_token_id": 8}
    try:
        with pytest.raises(ValueError, match="boi_token_id=8"):
            SpeculativeJanusPipeline(model, pipe.processor)
    finally:
        model.generation_config.generation_kwargs = saved


@pytest.mark.parametrize("device", ["bogus", "cuda:99", 3])
def test_a_bogus_device_is_named_before_anything_loads(device, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("loaded before device was checked")

    monkeypatch.setattr(SpeculativeJanusPipeline, "_load_parts", never)
    with pytest.raises(ValueError, match="device"):
        SpeculativeJanusPipeline.from_zoo(device=device)


def test_check_device_accepts_real_devices():
    assert check_device(None) is None and check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")


def test_the_default_dtype_is_said_in_a_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="mmspec.pipelines.janus"):
        SpeculativeJanusPipeline.from_zoo()
    assert any("float32" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


# ------------------------------------------------------------------ prompts and ids
@pytest.fixture
def no_forward(pipe, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model ran before the arguments were checked")

    monkeypatch.setattr(pipe.model.model.language_model, "forward", never)
    return pipe


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("a thick <image_placeholder> 7", "prompt 0 contains the special token '<image_placeholder>'"),
        (["a 7", "a <begin_of_image> 3"], "prompt 1 contains the special token '<begin_of_image>'"),
        (["a 7", "<|User|>: a 3"], "prompt 1 contains the special token '<|User|>'"),
        ("\ud800", "prompt 0 is not valid Unicode text"),
        (["a 7", "a \udfff 3"], "prompt 1 is not valid Unicode text"),
    ],
)
def test_bad_prompts_are_named_before_the_first_forward(no_forward, prompt, match):
    with pytest.raises(ValueError, match=match.replace("|", "\\|")):
        no_forward(prompt, output_type="tokens")


def test_input_ids_without_the_begin_of_image_token_are_refused(no_forward):
    enc = no_forward.processor(text=["<|User|>: a 7", "<|User|>: the digit 3"], generation_mode="image",
                               padding=True, return_tensors="pt")  # fmt: skip
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert bool((mask == 0).any())  # left padding: the row's last kept token is the last column
    bad = ids.clone()
    bad[1, -1] = 5
    with pytest.raises(ValueError, match="input_ids: row 1 ends with token 5, not the begin-of-image token 7"):
        no_forward(input_ids=bad, attention_mask=mask, output_type="tokens")
    with pytest.raises(ValueError, match="input_ids: row 0 .*begin-of-image"):
        no_forward(input_ids=ids[:, :-1], output_type="tokens")  # processor ids with the BOI cut off
    right = torch.cat([ids[1:, 1:], torch.zeros(1, 1, dtype=ids.dtype)], 1)  # right padding: BOI before the pad
    right_mask = torch.cat([mask[1:, 1:], torch.zeros(1, 1, dtype=mask.dtype)], 1)
    no_forward.check_ids(right, right_mask)  # accepted: the last token the mask keeps is BOI


def test_the_vlm_pipeline_shares_the_prompt_checks():
    pipe = SpeculativeVLMPipeline(tiny_llava(2), tiny_vlm_processor())
    with pytest.raises(ValueError, match="prompt 0 is not valid Unicode text"):
        pipe(prompt="w1 \ud800", max_new_tokens=2, acceptance="none")
    with pytest.raises(ValueError, match="prompt must not be empty \\(prompt 1 is ' '\\)"):
        check_prompts(["w1", " "])
