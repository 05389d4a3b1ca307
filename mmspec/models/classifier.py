"""Small MNIST CNN: digit classifier and in-domain feature extractor (the "Inception" of MNIST FID-like metrics).

Input: images [B, 1, H, W] in [-1, 1] (the toolkit's MNIST format is 32x32 = 28x28 padded by 2 px of background);
any input larger than 28x28 is center-cropped to 28x28 first, so 28x28 MNIST and 32x32 generations both work.

    conv3x3(32) -> ReLU -> conv3x3(32) -> ReLU -> maxpool2       28 -> 14
    conv3x3(64) -> ReLU -> conv3x3(64) -> ReLU -> maxpool2       14 -> 7
    flatten -> linear(feature_dim) -> ReLU   == features(x)  [B, feature_dim]
    dropout -> linear(num_classes)           == forward(x)   [B, num_classes] logits

Examples:
    >>> clf = mmspec.models.load("assets/mnist-classifier")
    >>> logits = clf(images)  # [B, 10]
    >>> feats = clf.features(images)  # [B, 128], for Frechet distances
"""

import logging

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from mmspec.models.config_fields import check_fields


logger = logging.getLogger(__name__)


def center_crop(images: torch.Tensor, size: int) -> torch.Tensor:
    """Center-crop [B, C, H, W] to [B, C, size, size] (no-op when already that size)."""
    h, w = images.shape[-2:]
    if h < size or w < size:
        raise ValueError(f"images of size {h}x{w} are smaller than {size}x{size}")
    top, left = (h - size) // 2, (w - size) // 2
    return images[..., top : top + size, left : left + size]


class MNISTClassifier(ModelMixin, ConfigMixin):
    """Two conv stages + an MLP head; `features` is the penultimate (post-ReLU) layer.

    Args:
        in_channels: image channels.
        num_classes: number of classes (10 digits).
        channels: widths of the two conv stages.
        feature_dim: width of the penultimate layer (the feature vector).
        dropout: dropout before the last layer (training only).
        image_size: side the network works at; larger inputs are center-cropped to it.
    """

    @register_to_config
    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        channels: tuple[int, int] = (32, 64),
        feature_dim: int = 128,
        dropout: float = 0.3,
        image_size: int = 28,
    ):
        check_fields("MNISTClassifier", locals())
        super().__init__()
        c1, c2 = channels
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c1, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c2, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(c2 * (image_size // 4) ** 2, feature_dim)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] in [-1, 1] (H, W >= image_size) -> penultimate features [B, feature_dim]."""
        x = center_crop(images, self.config.image_size)
        return F.relu(self.fc(self.conv(x).flatten(1)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] in [-1, 1] -> logits [B, num_classes]."""
        return self.head(self.drop(self.features(images)))

    @torch.no_grad()
    def predict(self, images: torch.Tensor, batch_size: int = 500) -> torch.Tensor:
        """Predicted labels LongTensor [B] (batched, no grad)."""
        return torch.cat([self(images[i : i + batch_size]).argmax(-1) for i in range(0, len(images), batch_size)])
