"""The texture zoo's data (`mmspec.data.textures`): crops, splits by image and classes, on a folder made here and on
the installed `conformal-clip-data` package."""

import numpy as np
import pytest
import torch
from PIL import Image

from mmspec.data import textures
from mmspec.data.datasets import load_images


def test_crops_are_the_centred_non_overlapping_tiles_in_raster_order():
    image = np.arange(250 * 250, dtype=np.int64).reshape(250, 250)
    crops = textures.crops_of(image)
    assert crops.shape == (9, 64, 64)
    top = left = (250 - 3 * 64) // 2
    for i in range(3):
        for j in range(3):
            r, c = top + 64 * i, left + 64 * j
            assert np.array_equal(crops[3 * i + j], image[r : r + 64, c : c + 64])
    with pytest.raises(ValueError, match="smaller than 192x192"):
        textures.crops_of(np.zeros((191, 250), dtype=np.uint8))


def _fake_package_folder(root, per_class=12):
    """`nominal/`, `local/` and `global/` folders of PNGs whose every pixel is (folder number * 50 + index) % 256."""
    for k, (folder, _) in enumerate(textures.FOLDERS):
        (root / folder).mkdir(parents=True)
        for i in range(per_class):
            value = (k * 50 + i) % 256
            Image.fromarray(np.full((200, 200), value, dtype=np.uint8)).save(root / folder / f"t_{i:04d}.png")
    return root


def test_splits_are_by_image_with_the_package_classes(tmp_path):
    root = _fake_package_folder(tmp_path / "simulated")
    parts = {split: textures.load_textures(split, root=root) for split in textures.SPLITS}
    # per class folder of 12 images: indices 0 and 10 -> test, 5 -> val, the other 9 -> train; 9 crops each
    assert {s: len(parts[s][0]) for s in parts} == {"train": 3 * 9 * 9, "val": 3 * 9, "test": 3 * 2 * 9}
    for split, (images, labels) in parts.items():
        assert images.shape[1:] == (1, 64, 64) and images.dtype == torch.float32
        values = ((images[:, 0, 0, 0] + 1) * 127.5).round().long()  # each crop is one flat value: its source image
        folders = values // 50  # folder k holds values k * 50 + index (index < 12)
        assert torch.equal(labels, torch.tensor([0, 0, 1])[folders])  # nominal and local -> 0, global -> 1
        indices = sorted(set((values % 50).tolist()))  # which images of each folder the split holds
        assert indices == {"test": [0, 10], "val": [5], "train": [1, 2, 3, 4, 6, 7, 8, 9, 11]}[split]
        assert images.min() >= -1 and images.max() <= 1
    joined, _ = textures.load_textures("val+test", root=root)
    assert torch.equal(joined, torch.cat([parts["val"][0], parts["test"][0]]))
    with pytest.raises(ValueError, match="unknown part 'dev'"):
        textures.load_textures("train+dev", root=root)


@pytest.mark.skipif(
    not textures.is_textures_available(), reason=f"conformal-clip-data missing ({textures.INSTALL_HINT})"
)
def test_the_installed_package_gives_1800_held_out_crops():
    images, labels = load_images("textures", "test")
    assert images.shape == (1800, 1, 64, 64)
    assert torch.bincount(labels).tolist() == [1350, 450]  # 100 nominal + 50 local images, 50 global; 9 crops each
    assert images.std() > 0.1  # textures, not flat backgrounds


def test_datasets_refuse_unknown_names():
    with pytest.raises(ValueError, match="dataset='cifar'"):
        load_images("cifar", "test")


def test_tokenize_encodes_the_texture_crops_into_256_token_grids(tmp_path, monkeypatch):
    """`python -m mmspec.train tokenize --dataset textures` (on a small folder standing in for the package): every
    held-out crop, 16x16 tokens with a downsample-4 VQ, the dataset recorded, the codes those of the VQ."""
    from factories import tiny_vq

    from mmspec.train.__main__ import main
    from mmspec.train.tokenize import load_codes

    root = _fake_package_folder(tmp_path / "simulated")
    monkeypatch.setattr(textures, "textures_root", lambda: root)
    vq = tiny_vq(codebook_size=32, ch_mult=(1, 2, 2))
    vq.save_pretrained(tmp_path / "vq")
    out = tmp_path / "codes.pt"
    main(["tokenize", "--dataset", "textures", "--vq", str(tmp_path / "vq"), "--splits", "val+test", "--out", str(out),
          "--threads", "1", "--quiet"])  # fmt: skip
    codes, labels = load_codes(out, split="test")
    images, expected_labels = load_images("textures", "test")
    assert codes.shape == (54, 256) and torch.equal(labels, expected_labels)
    assert torch.equal(codes, vq.encode(images))
    assert torch.load(out, weights_only=True)["dataset"] == "textures"
