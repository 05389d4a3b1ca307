"""Images of different sizes through the draft-side policies (`mmspec.compressors.ragged`, `VisionTokens.layout`):
a layout of fixed-size images takes the fixed path bit for bit; pool / conv cut each image's own grid (partial edge
blocks) or, without a grid, runs of `ratio` tokens; the resampler's output for an image does not depend on the other
images of the batch (key mask); prune keeps `ceil(length / ratio)` of each image's own tokens; bad layouts are named.

Random tensors only: dim 32, nominal tokens_per_image 16."""

import math

import pytest
import torch
from test_compressors import POLICY_CASES, make_case, ragged_batch

from mmspec.compressors import build_policy, gather_images
from mmspec.models.hf.image_layout import ImageLayout


DIM, T = 32, 16
# row 0: no image; row 1: a 3 x 4 grid at 5..16; row 2: a 2 x 2 grid at 2..5, a 1 x 5 strip at 8..12 and an image
# without a grid (7 tokens) at 20..26
LAYOUT = ImageLayout([[], [12], [4, 5, 7]], [[], [(3, 4)], [(2, 2), (1, 5), None]])
SPANS = [[], [range(5, 17)], [range(2, 6), range(8, 13), range(20, 27)]]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(3, 30, DIM, generator=g)
    mask = torch.zeros(3, 30, dtype=torch.bool)
    for row, spans in enumerate(SPANS):
        for span in spans:
            mask[row, list(span)] = True
    return embeds, mask, torch.randn(3, DIM, generator=g)


def policy(name, **kwargs):
    return build_policy(name, DIM, T, **kwargs).eval()


@pytest.mark.parametrize("case", sorted(POLICY_CASES))
def test_a_layout_of_fixed_size_images_is_the_fixed_path_bitwise(case):
    embeds, mask, question = ragged_batch()  # `test_compressors`' rows: images of 16 tokens (4 x 4 grids)
    layout = ImageLayout([[], [16], [16, 16]], [[], [None], [(4, 4), None]])
    p = make_case(case)
    plain = p(gather_images(embeds, mask, T), question)
    laid = p(gather_images(embeds, mask, layout=layout), question)
    assert torch.equal(plain.tokens, laid.tokens) and torch.equal(plain.positions, laid.positions)
    assert torch.equal(plain.valid, laid.valid)
    assert (plain.global_vec is None) == (laid.global_vec is None)
    if plain.global_vec is not None:
        assert torch.equal(plain.global_vec, laid.global_vec)


def test_pool_and_conv_cut_each_images_own_grid():
    """Pool: the mean of each 2 x 2 block of the image's grid (edge blocks partial), at the block's last position;
    without a grid, runs of 4 tokens. Conv at its pooling init: the same on full blocks."""
    embeds, mask, question = batch()
    out = policy("pool", ratio=4)(gather_images(embeds, mask, layout=LAYOUT), question)
    blocks = {  # row -> [(positions of the block)]
        1: [[5, 6, 9, 10], [7, 8, 11, 12], [13, 14], [15, 16]],
        2: [[2, 3, 4, 5], [8, 9], [10, 11], [12], [20, 21, 22, 23], [24, 25, 26]],
    }
    assert out.valid.sum(1).tolist() == [0, 4, 6]
    for row, want in blocks.items():
        for k, positions in enumerate(want):
            torch.testing.assert_close(out.tokens[row, k], embeds[row, positions].mean(0))
            assert int(out.positions[row, k]) == max(positions)
    conv = policy("conv", ratio=4)(gather_images(embeds, mask, layout=LAYOUT), question)
    assert torch.equal(conv.positions, out.positions) and torch.equal(conv.valid, out.valid)
    for row, k in ((1, 0), (1, 1), (2, 0), (2, 4)):  # full blocks: 4 tokens
        torch.testing.assert_close(conv.tokens[row, k], out.tokens[row, k], rtol=1e-5, atol=1e-6)


def test_resampler_reads_only_its_own_image():
    """Each image alone or beside longer ones (padding): the same tokens, at the image's last positions."""
    embeds, mask, question = batch()
    p = policy("resampler", num_queries=3, num_heads=4, global_vector=True)
    out = p(gather_images(embeds, mask, layout=LAYOUT), question)
    assert out.valid.sum(1).tolist() == [0, 2, 6]
    for row, spans in enumerate(SPANS):
        for i, span in enumerate(spans):
            alone_mask = torch.zeros_like(mask[row : row + 1])
            alone_mask[0, list(span)] = True
            one = ImageLayout([[len(span)]], [[LAYOUT.grids[row][i]]])
            alone = p(gather_images(embeds[row : row + 1], alone_mask, layout=one), question[row : row + 1])
            torch.testing.assert_close(out.tokens[row, 2 * i : 2 * i + 2], alone.tokens[0], rtol=1e-5, atol=1e-6)
            assert out.positions[row, 2 * i : 2 * i + 2].tolist() == list(span)[-2:]
    torch.testing.assert_close(out.global_vec[2], alone.global_vec[0], rtol=1e-5, atol=1e-6)  # the row's last image
    assert torch.equal(out.global_vec[0], torch.zeros(DIM))


def test_prune_keeps_a_share_of_each_images_own_tokens():
    embeds, mask, question = batch()
    out = policy("prune", ratio=4)(gather_images(embeds, mask, layout=LAYOUT), question)
    counts = [sum(math.ceil(len(s) / 4) for s in spans) for spans in SPANS]
    assert out.valid.sum(1).tolist() == counts
    kept = out.positions[2, : counts[2]].tolist()
    assert [sum(q in s for q in kept) for s in SPANS[2]] == [1, 2, 2] and kept == sorted(kept)


def test_bad_layouts_are_named():
    embeds, mask, question = batch()
    with pytest.raises(ValueError, match="layout"):
        gather_images(embeds, mask, layout=ImageLayout([[], [12], [4, 5, 6]], [[], [None], [None, None, None]]))
    with pytest.raises(ValueError, match="grids"):
        ImageLayout([[12]], [[(3, 5)]])
    with pytest.raises(ValueError, match="lengths"):
        ImageLayout([[0]], [[None]])
