"""The shipped Janus (`assets/mnist-janus`, a real transformers `JanusForConditionalGeneration` trained here) through
`SpeculativeJanusPipeline`: greedy equals transformers' own image-mode `generate` token for token, the lossless
methods equal it, and images come out with the VQ's single channel."""

import numpy as np
import pytest
import torch

from mmspec.pipelines import SpeculativeJanusPipeline


PROMPTS = ["a thick handwritten seven", "the digit 3, slanted to the right"]


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(1)
    pipe = SpeculativeJanusPipeline.from_zoo(torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _transformers_greedy(pipe, prompt, guidance_scale):
    text = pipe.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                                              add_generation_prompt=True)  # fmt: skip
    enc = pipe.processor(text=text, generation_mode="image", return_tensors="pt")
    return pipe.model.generate(**enc, generation_mode="image", do_sample=False, guidance_scale=guidance_scale)


def test_greedy_equals_transformers_generate_on_the_trained_model(pipe):
    for prompt in PROMPTS:
        expected = _transformers_greedy(pipe, prompt, 2.0)  # [1, 64]
        for kw in (dict(acceptance="none"), dict(acceptance="jacobi"), dict(acceptance="jacobi", coupling=False),
                   dict(acceptance="exact", drafter="jacobi"),
                   dict(acceptance="jacobi", jacobi_tree_width=3, jacobi_tree_depth=2)):  # fmt: skip
            out = pipe(prompt, guidance_scale=2.0, do_sample=False, output_type="tokens", **kw)
            assert torch.equal(out.images, expected), (prompt, kw)
            if kw["acceptance"] != "none":
                assert out.stats.target_forwards < 64  # drafts were accepted: not plain decoding in disguise


def test_images_have_the_vqs_single_channel(pipe):
    out = pipe(PROMPTS, guidance_scale=2.0, generator=torch.Generator().manual_seed(0), output_type="pt")
    assert out.images.shape == (2, 1, 32, 32) and 0 <= float(out.images.min()) <= float(out.images.max()) <= 1
    pil = pipe(PROMPTS, guidance_scale=2.0, generator=torch.Generator().manual_seed(0)).images[0]
    assert pil.mode == "L" and pil.size == (32, 32)
    assert torch.equal(torch.from_numpy(np.array(pil)).float() / 255,
                       out.images[0, 0])  # fmt: skip


def test_from_zoo_names_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="root: no zoo folder"):
        SpeculativeJanusPipeline.from_zoo(tmp_path)
