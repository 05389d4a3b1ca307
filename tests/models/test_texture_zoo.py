"""The shipped texture zoo (`assets/texture-vq`, `assets/texture-c2i`): it loads as a pipeline whose 16x16 token grid
fits the VQ, decodes 64x64 crops, and a lossless method on it keeps plain's greedy output."""

import torch

from mmspec.pipelines import SpeculativeARImagePipeline


def test_texture_zoo_generates_256_token_crops_and_sjd_keeps_plain_greedy():
    pipe = SpeculativeARImagePipeline.from_zoo(prefix="texture", kind="c2i")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.config.block_size == 256 and pipe.vqvae.config.sample_size == 64
    kw = dict(class_labels=[0, 1], guidance_scale=2.0, do_sample=False)
    plain = pipe(acceptance="none", output_type="tokens", **kw)
    sjd = pipe(acceptance="jacobi", output_type="tokens", **kw)
    assert plain.images.shape == (2, 256) and torch.equal(plain.images, sjd.images)
    image = pipe(acceptance="none", output_type="pt", class_labels=[1], generator=torch.Generator().manual_seed(0))
    assert image.images.shape == (1, 1, 64, 64) and image.images.std() > 0.02  # a texture, not a flat crop
    assert sjd.stats.target_forwards < plain.stats.target_forwards
