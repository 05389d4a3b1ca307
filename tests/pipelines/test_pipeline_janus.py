"""`SpeculativeJanusPipeline`: the shared pipeline tests (`SpeculativePipelineTesterMixin`), prompts through the
chat template and the processor, outputs, loading (`from_pretrained`: pipeline folders, transformers folders, bad
paths, corrupt or foreign checkpoints) and every argument checked before any model runs."""

import json

import numpy as np
import PIL.Image
import pytest
import torch
from janus_fixtures import BOI_ID, prompt_ids, prompts, tiny_janus, tiny_processor
from pipeline_mixin import SpeculativePipelineTesterMixin

from mmspec.models.storage import read_weights
from mmspec.pipelines import SpeculativeJanusPipeline


def make_pipe(**kw):
    pipe = SpeculativeJanusPipeline(tiny_janus(**kw), tiny_processor())
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return make_pipe(spread=0.3)


class TestSpeculativeJanusPipeline(SpeculativePipelineTesterMixin):
    pipeline_class = SpeculativeJanusPipeline
    lossless_methods = [dict(acceptance="jacobi"), dict(acceptance="jacobi", coupling=False),
                        dict(acceptance="exact", drafter="jacobi")]  # fmt: skip
    bad_inputs = [
        (dict(acceptance="fast"), ValueError, "acceptance"),
        (dict(acceptance="exact", drafter="eagle"), ValueError, "eagle_head"),
        (dict(prompt=[3]), TypeError, "prompt"),
        (dict(guidance_scale=float("nan")), ValueError, "guidance_scale"),
        (dict(jacobi_window=0), ValueError, "jacobi_window"),
    ]

    def get_pipeline(self):
        return make_pipe(head_scale=0.5, spread=0.1)

    def get_lossless_pipeline(self):
        return make_pipe(spread=0.1)

    def get_inputs(self, batch_size):
        return dict(prompt=prompts(batch_size, seed=5), guidance_scale=3.0, output_type="tokens")

    def output_tokens(self, out):
        return out.images

    def scored_model(self, pipe):
        return pipe.model.model.generation_head  # called on the hidden states of every scored row


def test_prompt_goes_through_the_chat_template_and_the_image_mode_processor(pipe):
    """`prompt` = the chat template's user turn + the processor's image mode (BOI appended), exactly as a user of
    transformers' `generate` builds `input_ids`."""
    texts = prompts(3, seed=6)
    chats = [pipe.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": t}]}],
                                                add_generation_prompt=True, tokenize=False) for t in texts]  # fmt: skip
    enc = pipe.processor(text=chats, generation_mode="image", padding=True, return_tensors="pt")
    assert bool((enc["input_ids"][:, -1] == BOI_ID).all())
    expected = pipe.model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], generation_mode="image",
                                   do_sample=False, guidance_scale=4.0)  # fmt: skip
    out = pipe(prompt=texts, guidance_scale=4.0, do_sample=False, output_type="tokens")
    assert torch.equal(out.images, expected)
    raw = pipe(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], guidance_scale=4.0, do_sample=False,
               output_type="tokens")  # fmt: skip
    assert torch.equal(raw.images, expected)


def test_num_images_per_prompt_and_generator_lists(pipe):
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)]
    out = pipe(prompt=["w1 w2", "w3"], num_images_per_prompt=2, generator=gens, output_type="tokens")
    assert out.images.shape == (4, 16)
    alone = pipe(prompt="w3", generator=[torch.Generator().manual_seed(4)], output_type="tokens")
    assert torch.equal(alone.images[0], out.images[3])  # image 3 = prompt 2's second image, own generator


def test_output_types_decode_through_the_vq_and_the_processor(pipe):
    tokens = pipe(prompt="w1 w2", do_sample=False, output_type="tokens").images
    pixels = (
        pipe.model.decode_image_tokens(tokens)[0].detach().float()
    )  # [H, W, C], normalised by the processor's mean / std
    expected = ((pixels * 0.5 + 0.5) * 255).clamp(0, 255)
    pil = pipe(prompt="w1 w2", do_sample=False).images
    assert isinstance(pil[0], PIL.Image.Image) and pil[0].size == (8, 8)
    assert np.abs(np.asarray(pil[0]).astype(np.float64) - expected.numpy()).max() <= 1.0
    arr = pipe(prompt="w1 w2", do_sample=False, output_type="np").images
    assert arr.shape == (1, 8, 8, 3) and np.array_equal(arr[0], np.asarray(pil[0]) / np.float32(255))
    pt = pipe(prompt="w1 w2", do_sample=False, output_type="pt").images
    assert pt.shape == (1, 3, 8, 8) and torch.equal(pt[0].permute(1, 2, 0), torch.from_numpy(arr[0]))
    images, stats = pipe(prompt="w1 w2", do_sample=False, output_type="tokens", return_dict=False)
    assert torch.equal(images, tokens) and stats.generated_tokens == [16]


def test_relaxed_and_grouped_use_the_normalised_vq_codebook(pipe):
    weight = pipe.model.model.vqmodel.quantize.embedding.weight
    book = pipe.codebook()
    assert torch.allclose(book.norm(dim=-1), torch.ones(book.shape[0]))
    assert torch.allclose(book * weight.norm(dim=-1, keepdim=True), weight.detach())
    rule = pipe.make_rule("grouped", {"group_size": 3, "group_prob_threshold": 0.0, "group_dist_threshold": 4.0,
                                      "resample": "optimal"})  # fmt: skip
    assert torch.equal(rule.embeddings, book)
    for acceptance in ("relaxed", "grouped"):
        out = pipe(prompt=["w1", "w2 w3"], acceptance=acceptance, output_type="tokens",
                   generator=torch.Generator().manual_seed(0))  # fmt: skip
        assert out.images.shape == (2, 16) and bool((out.images >= 0).all()) and bool((out.images < 32).all())


BAD_CALLS = [
    (dict(prompt=None), ValueError, "exactly one of prompt and input_ids"),
    (dict(prompt=""), ValueError, "prompt must not be empty"),
    (dict(prompt=[]), TypeError, "prompt"),
    (
        dict(input_ids=torch.tensor([[1, 5, 3]]), prompt=None, attention_mask=torch.ones(1, 2)),
        ValueError,
        "attention_mask",
    ),
    (
        dict(input_ids=torch.tensor([[1, 5, 3]]), prompt=None, attention_mask=torch.tensor([[0, 0, 0]])),
        ValueError,
        "attention_mask",
    ),
    (
        dict(input_ids=torch.tensor([[1, 5, 3]]), prompt=None, attention_mask=torch.tensor([[2, 1, 1]])),
        ValueError,
        "attention_mask",
    ),
    (dict(input_ids=torch.tensor([[1, 500, 3]]), prompt=None), ValueError, "input_ids"),
    (dict(input_ids=torch.tensor([1.0, 5.0]), prompt=None), ValueError, "input_ids"),
    (dict(input_ids=torch.tensor([[1.0, 5.0]]), prompt=None), TypeError, "input_ids"),
    (dict(attention_mask=torch.ones(1, 3)), ValueError, "attention_mask goes with input_ids"),
    (dict(input_ids=torch.tensor([[1, 5, 3]]), prompt=None, attention_mask=[[1, 1, 1]]), TypeError, "attention_mask"),
    (dict(num_images_per_prompt=0), ValueError, "num_images_per_prompt"),
    (dict(num_images_per_prompt=2.0), TypeError, "num_images_per_prompt"),
    (dict(num_images_per_prompt=10**6), ValueError, "num_images_per_prompt"),
    (dict(do_sample="yes"), TypeError, "do_sample"),
    (dict(return_dict=1), TypeError, "return_dict"),
    (dict(time_phases=None), TypeError, "time_phases"),
    (dict(output_type="jpeg"), ValueError, "output_type"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(guidance_scale=-1.0), ValueError, "guidance_scale"),
    (dict(acceptance="grouped", do_sample=False), ValueError, "sampling rule"),
    (dict(acceptance="relaxed", drafter="model"), ValueError, "draft_model"),
    (dict(drafter="model"), ValueError, "drafter"),
    (dict(relaxation_delta=float("nan")), ValueError, "relaxation_delta"),
    (dict(coupling="on"), TypeError, "coupling"),
    (dict(jacobi_init="zeros"), ValueError, "jacobi_init"),
    (dict(generator=[torch.Generator()] * 1, num_images_per_prompt=2), ValueError, "generator"),
    (dict(generator=3), TypeError, "generator"),
    (dict(callback_on_step_end=3), TypeError, "callback_on_step_end"),
    (dict(callback_on_step_end_tensor_inputs=["logits"]), ValueError, "callback_on_step_end_tensor_inputs"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_CALLS)
def test_bad_arguments_are_refused_before_the_model_runs(pipe, kwargs, error, match, monkeypatch):
    def never(*args, **kw):
        raise AssertionError("the model ran before the arguments were checked")

    monkeypatch.setattr(pipe.model.model.language_model, "forward", never)
    with pytest.raises(error, match=match):
        pipe(**({"prompt": "w1"} | kwargs))


def test_prompts_that_do_not_fit_the_context_are_refused(pipe):
    # positions fed: the prompt's and the image tokens' but the last; draft slots are not positions
    ids = torch.ones(1, 242, dtype=torch.long)  # 242 + 16 - 1 = 257 > max_position_embeddings 256
    ids[:, -2:] = BOI_ID  # image-mode prompts end with the begin-of-image token (also the 241-token one)
    with pytest.raises(ValueError, match="context of 256"):
        pipe(input_ids=ids)
    out = pipe(input_ids=ids[:, :241], output_type="tokens", acceptance="jacobi", jacobi_window=16)  # 256: fits
    assert out.images.shape == (1, 16)


def test_callback_sees_the_grid_and_may_not_change_it(pipe):
    grids = []

    def cb(p, rnd, n, kw):
        grids.append(kw["tokens"].clone())
        return kw

    out = pipe(prompt="w1", callback_on_step_end=cb, output_type="tokens", generator=torch.Generator().manual_seed(1))
    assert torch.equal(grids[-1], out.images) and bool((grids[0] == -1).any())

    def tamper(p, rnd, n, kw):
        return {"tokens": torch.zeros_like(kw["tokens"])}

    with pytest.raises(ValueError, match="may not change tokens"):
        pipe(prompt="w1", callback_on_step_end=tamper)


# ------------------------------------------------------------------ loading
def _hf_folder(tmp_path, pipe):
    folder = tmp_path / "janus"
    pipe.model.save_pretrained(folder)
    pipe.processor.save_pretrained(folder)
    return folder


def test_from_pretrained_loads_a_transformers_folder(tmp_path, pipe):
    loaded = SpeculativeJanusPipeline.from_pretrained(_hf_folder(tmp_path, pipe), torch_dtype=torch.float32)
    loaded.set_progress_bar_config(disable=True)
    ids, mask = prompt_ids(2, seed=8)
    a = pipe(input_ids=ids, attention_mask=mask, do_sample=False, output_type="tokens").images
    b = loaded(input_ids=ids, attention_mask=mask, do_sample=False, output_type="tokens").images
    assert torch.equal(a, b)
    assert torch.equal(loaded(prompt="w1 w2", do_sample=False, output_type="tokens").images,
                       pipe(prompt="w1 w2", do_sample=False, output_type="tokens").images)  # fmt: skip


def test_from_pretrained_refuses_bad_folders(tmp_path, pipe):
    with pytest.raises(ValueError, match="no such folder"):
        SpeculativeJanusPipeline.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        SpeculativeJanusPipeline.from_pretrained(tmp_path / "empty")
    folder = _hf_folder(tmp_path, pipe)
    with pytest.raises(ValueError, match="trust_remote_code=True is refused"):
        SpeculativeJanusPipeline.from_pretrained(folder, trust_remote_code=True)
    with pytest.raises(TypeError, match="torch_dtype"):
        SpeculativeJanusPipeline.from_pretrained(folder, torch_dtype="float16")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated download
    with pytest.raises(ValueError, match="cannot load the Janus model"):
        SpeculativeJanusPipeline.from_pretrained(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read a Janus config"):
        SpeculativeJanusPipeline.from_pretrained(folder)


def test_deepseek_hub_ids_read_their_transformers_conversion(tmp_path, monkeypatch):
    """DeepSeek's repositories are remote code; the id maps to transformers' conversion, and a failure (here: an
    empty offline cache) is a ValueError naming both."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="deepseek-ai/Janus-Pro-1B.*deepseek-community/Janus-Pro-1B"):
        SpeculativeJanusPipeline.from_pretrained("deepseek-ai/Janus-Pro-1B", local_files_only=True)


def test_from_pretrained_refuses_missing_weights_and_foreign_configs(tmp_path, pipe):
    from safetensors.torch import save_file

    folder = _hf_folder(tmp_path, pipe)
    state = read_weights(folder / "model.safetensors")
    key = next(k for k in state if "generation_head" in k)
    save_file({k: v for k, v in state.items() if k != key}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing_keys"):
        SpeculativeJanusPipeline.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not a transformers Janus checkpoint"):
        SpeculativeJanusPipeline.from_pretrained(folder)


def test_components_are_checked():
    with pytest.raises(TypeError, match="JanusForConditionalGeneration"):
        SpeculativeJanusPipeline(torch.nn.Linear(2, 2), tiny_processor())
    with pytest.raises(TypeError, match="JanusProcessor"):
        SpeculativeJanusPipeline(tiny_janus(), None)
