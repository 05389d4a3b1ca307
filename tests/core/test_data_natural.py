"""The natural-image zoo's data (`mmspec.data.natural`): blocks, crops, the split by block and the scale classes, on
images made here and on scikit-image's installed samples."""

import numpy as np
import pytest
import torch

from mmspec.data import natural
from mmspec.data.datasets import availability, load_images


def test_grey_and_box_downscaling():
    rgb = np.zeros((4, 6, 3), dtype=np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 100, 200, 50
    assert np.allclose(natural.grey(rgb), 0.299 * 100 + 0.587 * 200 + 0.114 * 50)
    image = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    half = natural.downscale(image, 2)  # the odd last row and column are dropped
    assert half.shape == (2, 3)
    assert half[1, 2] == image[2:4, 4:6].mean()
    assert natural.downscale(image, 1) is image


def test_blocks_are_raster_order_and_crops_stay_inside_their_block():
    image = np.arange(130 * 200, dtype=np.float32).reshape(130, 200)
    blocks = natural.blocks_of(image)
    assert len(blocks) == 2 * 3  # 130 // 64 rows, 200 // 64 columns; remainders dropped
    assert np.array_equal(blocks[4], image[64:128, 64:128])
    train = natural.crops_of_block(blocks[4], "train")
    held = natural.crops_of_block(blocks[4], "test")
    assert train.shape == (81, 32, 32) and held.shape == (4, 32, 32)
    assert np.array_equal(train[1], image[64:96, 68:100])  # the second window: one stride to the right
    assert np.array_equal(held[3], image[96:128, 96:128])  # the 4 tiles in raster order


def _fake_images(monkeypatch):
    """Two flat-by-block images whose every 64-pixel block has its own value (image * 100 + block index)."""
    images = {}
    for i, (rows, cols) in enumerate(((4, 5), (2, 4))):
        blocks = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 100 * i
        images[f"img{i}"] = np.kron(blocks, np.ones((64, 64), dtype=np.float32))
    monkeypatch.setattr(natural, "_sample_images", lambda: images)
    natural._load_split.cache_clear()
    return images


def test_splits_are_by_block_with_scale_classes(monkeypatch):
    _fake_images(monkeypatch)
    try:
        parts = {split: natural.load_natural(split) for split in natural.SPLITS}
    finally:
        natural._load_split.cache_clear()
    # full resolution: 20 + 8 blocks; half: 2 * 2 = 4 and 1 * 2 = 2 blocks
    # per image and scale, blocks 0 (and 10) go to test, 5 (and 15) to val
    full_test, full_val = 2 + 1, 2 + 1
    half_test, half_val = 1 + 1, 0
    assert len(parts["test"][0]) == 4 * (full_test + half_test)
    assert len(parts["val"][0]) == 4 * (full_val + half_val)
    assert len(parts["train"][0]) == 81 * (20 + 8 + 4 + 2 - full_test - full_val - half_test - half_val)
    for split, (images, labels) in parts.items():
        assert images.shape[1:] == (1, 32, 32) and images.dtype == torch.float32
        flat = images.flatten(1)
        full = labels == 0
        # every full-resolution crop lies inside one block: one value, the block's
        assert torch.equal(flat[full].max(1).values, flat[full].min(1).values)
        values = ((flat[full, 0] + 1) * 127.5).round().long()
        blocks = values % 100  # block index within its image
        expected = {"test": {0, 10}, "val": {5, 15}}.get(split)
        seen = set(blocks.tolist())
        if expected is not None:
            assert seen <= expected and seen
        else:
            assert not seen & {0, 5, 10, 15}
    with pytest.raises(ValueError, match="unknown part 'dev'"):
        natural.load_natural("train+dev")


@pytest.mark.skipif(not natural.is_natural_available(), reason=f"scikit-image missing ({natural.INSTALL_HINT})")
def test_the_installed_samples_give_the_documented_splits():
    images, labels = load_images("natural", "test")
    assert images.shape == (364, 1, 32, 32) and set(labels.tolist()) == {0, 1}
    assert -1 <= images.min() < images.max() <= 1
    train, _ = load_images("natural", "train")
    assert len(train) == 50625
    assert availability("natural") == (True, natural.INSTALL_HINT)
