"""The LDM / MAR KL autoencoder (continuous latent tokens) as a diffusers model.

Architecture and parameter names follow `models/vae.py` of LTH14/mar (itself LDM's KL-VAE, CompVis/latent-diffusion),
so the official `kl16.ckpt` (`{"model": state_dict}`) loads strictly with `load_official_kl(path)`:

    encoder: conv_in -> down[i].{block[j], attn[j] (levels at attn_resolutions), downsample}
             -> mid.{block_1, attn_1, block_2} -> norm_out -> swish -> conv_out (2 * embed_dim: mean and log-variance)
    quant_conv (2 embed_dim -> 2 embed_dim) -> DiagonalGaussian(mean, logvar clamped to [-30, 20])
    post_quant_conv (embed_dim -> embed_dim) -> decoder: conv_in -> mid -> up[i].{block[j] (num_res_blocks + 1),
             attn[j], upsample} (levels run from the lowest resolution up) -> norm_out -> swish -> conv_out

As in MAR, the encoder has attention at `attn_resolutions` (kl16: the 16x16 level) and the decoder at
`decoder_attn_resolutions` (MAR builds its Decoder with the default `()`: attention in the middle block only).
The resnet / attention / resampling blocks are the ones of `mmspec.models.llamagen.vq` (same parameter names and maths).

Tokens (`encode_tokens` / `decode_tokens`) are the latents times `scale_factor`, flattened like MAR's `patchify` with
patch size 1: row-major over the (h, w) grid, channels last, [B, h*w, embed_dim]. MAR uses `scale_factor = 0.2325`
for kl16; the MNIST zoo model stores 1 / std of its training latents.

References:
    Rombach et al., "High-Resolution Image Synthesis with Latent Diffusion Models" (LDM), 2022.
    Li et al., "Autoregressive Image Generation without Vector Quantization" (MAR), 2024.

Examples:
    >>> vae = AutoencoderKL(in_channels=1, out_channels=1, ch=32, ch_mult=(1, 2, 2), num_res_blocks=1,
    ...                     attn_resolutions=(), resolution=32, embed_dim=4, num_groups=8)
    >>> tokens = vae.encode_tokens(images)  # [B, 64, 4]: posterior means x scale_factor, raster order over 8x8
    >>> recon = vae.decode_tokens(tokens)  # [B, 1, 32, 32]
"""

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput
from torch import nn

from mmspec.models.llamagen.vq import AttnBlock, Downsample, ResnetBlock, Upsample, _norm
from mmspec.random import Generators, randn


logger = logging.getLogger(__name__)

# `AutoencoderKL(embed_dim=16, ch_mult=(1, 1, 2, 2, 4))` of MAR (`kl16.ckpt`) with the LDM defaults it inherits.
KL16_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    ch=128,
    ch_mult=(1, 1, 2, 2, 4),
    num_res_blocks=2,
    attn_resolutions=(16,),
    decoder_attn_resolutions=(),
    resolution=256,
    embed_dim=16,
    num_groups=32,
    use_variational=True,
    scale_factor=0.2325,
)


# ----------------------------------------------------------------------------- posterior


@dataclass
class DiagonalGaussian:
    """The encoder's posterior N(mean, exp(logvar)) over latents [B, D, h, w]; `logvar` is clamped to [-30, 20]."""

    mean: torch.Tensor
    logvar: torch.Tensor

    def __post_init__(self):
        self.logvar = self.logvar.clamp(-30.0, 20.0)

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def sample(self, generator: Generators) -> torch.Tensor:
        """mean + std * eps, eps ~ N(0, I) drawn from `generator` (one, or one per row; on the latents' device)."""
        return self.mean + self.std * randn(self.mean.shape, generator, device=self.mean.device, dtype=self.mean.dtype)

    def mode(self) -> torch.Tensor:
        return self.mean

    def kl(self) -> torch.Tensor:
        """KL(posterior || N(0, I)) per image [B], summed over the latent elements (as the official `kl()`)."""
        return 0.5 * (self.mean.pow(2) + self.logvar.exp() - 1.0 - self.logvar).sum(dim=(1, 2, 3))


@dataclass
class KLOutput(BaseOutput):
    """Training forward output of `AutoencoderKL`.

    Attributes:
        reconstruction: decoded images [B, C, H, W] (not clamped).
        posterior: the encoder's `DiagonalGaussian` over latents [B, D, h, w].
        latents: what was decoded: a posterior sample (with a generator) or its mean [B, D, h, w] (unscaled).
    """

    reconstruction: torch.Tensor
    posterior: DiagonalGaussian
    latents: torch.Tensor


# ----------------------------------------------------------------------------- encoder / decoder


def _level(blocks, attns, h):
    """A resolution level's residual blocks, each followed by its attention block when the level has them."""
    for i, block in enumerate(blocks):
        h = block(h)
        if len(attns) > 0:
            h = attns[i](h)
    return h


def _mid(in_channels: int, num_groups: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = ResnetBlock(in_channels, in_channels, num_groups=num_groups)
    mid.attn_1 = AttnBlock(in_channels, num_groups)
    mid.block_2 = ResnetBlock(in_channels, in_channels, num_groups=num_groups)
    return mid


class Encoder(nn.Module):
    """Images [B, in_channels, H, W] -> moments [B, 2 z_channels, H / 2^(L-1), W / 2^(L-1)], L = len(ch_mult)."""

    def __init__(self, in_channels, ch, ch_mult, num_res_blocks, attn_resolutions, resolution, z_channels, num_groups):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.down = nn.ModuleList()
        block_in, res = ch, resolution
        for level, mult in enumerate(ch_mult):
            down = nn.Module()
            down.block, down.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks):
                down.block.append(ResnetBlock(block_in, ch * mult, num_groups=num_groups))
                block_in = ch * mult
                if res in attn_resolutions:
                    down.attn.append(AttnBlock(block_in, num_groups))
            if level != len(ch_mult) - 1:
                down.downsample = Downsample(block_in)
                res //= 2
            self.down.append(down)
        self.mid = _mid(block_in, num_groups)
        self.norm_out = _norm(block_in, num_groups)
        self.conv_out = nn.Conv2d(block_in, 2 * z_channels, 3, padding=1)  # double_z: mean and log-variance

    def forward(self, x):
        h = self.conv_in(x)
        for down in self.down:
            h = _level(down.block, down.attn, h)
            if hasattr(down, "downsample"):
                h = down.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Latents [B, z_channels, h, w] -> images [B, out_channels, h 2^(L-1), w 2^(L-1)].

    `up[i]` is level i (`up[0]` the full resolution), built and run from the lowest resolution up, with
    `num_res_blocks + 1` resnet blocks per level as in the official code.
    """

    def __init__(
        self, out_channels, ch, ch_mult, num_res_blocks, attn_resolutions, resolution, z_channels, num_groups
    ):
        super().__init__()
        block_in = ch * ch_mult[-1]
        res = resolution // 2 ** (len(ch_mult) - 1)
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = _mid(block_in, num_groups)
        self.up = nn.ModuleList()
        for level in reversed(range(len(ch_mult))):
            up = nn.Module()
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                up.block.append(ResnetBlock(block_in, ch * ch_mult[level], num_groups=num_groups))
                block_in = ch * ch_mult[level]
                if res in attn_resolutions:
                    up.attn.append(AttnBlock(block_in, num_groups))
            if level != 0:
                up.upsample = Upsample(block_in)
                res *= 2
            self.up.insert(0, up)  # up[level], as the official checkpoint names them
        self.norm_out = _norm(block_in, num_groups)
        self.conv_out = nn.Conv2d(block_in, out_channels, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for up in reversed(self.up):
            h = _level(up.block, up.attn, h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


# ----------------------------------------------------------------------------- the model


def _int_tuple(name, value, allow_empty=False):
    """`value` as a tuple of ints >= 1 (a ValueError naming `name` otherwise)."""
    ok = isinstance(value, (list, tuple)) and (allow_empty or len(value) > 0)
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    if not ok:
        empty = "" if allow_empty else "non-empty "
        raise ValueError(f"AutoencoderKL field {name} must be a {empty}list of ints >= 1, got {value!r}")
    return tuple(value)


class AutoencoderKL(ModelMixin, ConfigMixin):
    """LDM / MAR KL autoencoder (encoder, diagonal Gaussian posterior, decoder) with the official parameter names.

    Defaults are MAR's kl16 (`KL16_CONFIG`): 256x256 RGB -> 16x16 latents of 16 channels.

    Args:
        in_channels: image channels the encoder takes (3 for RGB, 1 for MNIST).
        out_channels: image channels the decoder returns.
        ch: base channel width.
        ch_mult: channel multiplier per resolution level; the downsampling factor is 2^(len(ch_mult) - 1).
        num_res_blocks: resnet blocks per encoder level (the decoder uses one more, as in the official code).
        attn_resolutions: feature-map sides at which the encoder's levels have attention blocks (kl16: (16,)).
        decoder_attn_resolutions: the same for the decoder (MAR: (), attention in the middle block only).
        resolution: image side; fixes the token grid (resolution / 2^(len(ch_mult) - 1) per side).
        embed_dim: latent channels D (= the token dimension).
        num_groups: GroupNorm groups (official: 32; every channel width must be divisible by it).
        use_variational: predict a log-variance (True, as MAR); False: the moments are the mean only and the log-
            variance is set to 1, as the official code does (so sampling still adds noise of std e^0.5).
        scale_factor: tokens = latents * scale_factor (MAR's kl16: 0.2325).
    """

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 3,
        ch: int = 128,
        ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4),
        num_res_blocks: int = 2,
        attn_resolutions: tuple[int, ...] = (16,),
        decoder_attn_resolutions: tuple[int, ...] = (),
        resolution: int = 256,
        embed_dim: int = 16,
        num_groups: int = 32,
        use_variational: bool = True,
        scale_factor: float = 0.2325,
    ):
        super().__init__()
        for name in ("in_channels", "out_channels", "ch", "num_res_blocks", "resolution", "embed_dim", "num_groups"):
            value = locals()[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AutoencoderKL field {name} must be an int >= 1, got {value!r}")
        ch_mult = _int_tuple("ch_mult", ch_mult)
        attn_resolutions = _int_tuple("attn_resolutions", attn_resolutions, allow_empty=True)
        decoder_attn_resolutions = _int_tuple("decoder_attn_resolutions", decoder_attn_resolutions, allow_empty=True)
        if not isinstance(use_variational, bool):
            raise ValueError(f"AutoencoderKL field use_variational must be true or false, got {use_variational!r}")
        if isinstance(scale_factor, bool) or not isinstance(scale_factor, (int, float)) or not scale_factor > 0:
            raise ValueError(f"AutoencoderKL field scale_factor must be a number > 0, got {scale_factor!r}")
        factor = 2 ** (len(ch_mult) - 1)
        if resolution % factor:
            raise ValueError(f"resolution={resolution} must be a multiple of the downsampling factor {factor}")
        for width in {ch} | {ch * m for m in ch_mult}:
            if width % num_groups:
                raise ValueError(f"channel width {width} (ch={ch}, ch_mult={ch_mult}) not divisible by {num_groups}")
        common = dict(ch=ch, ch_mult=ch_mult, num_res_blocks=num_res_blocks, resolution=resolution)
        common.update(z_channels=embed_dim, num_groups=num_groups)
        self.encoder = Encoder(in_channels, attn_resolutions=attn_resolutions, **common)
        self.decoder = Decoder(out_channels, attn_resolutions=decoder_attn_resolutions, **common)
        self.quant_conv = nn.Conv2d(2 * embed_dim, (2 if use_variational else 1) * embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(embed_dim, embed_dim, 1)

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.config.ch_mult) - 1)

    @property
    def token_grid(self) -> tuple[int, int]:
        """(h, w) of the latent grid of a `resolution` x `resolution` image."""
        side = self.config.resolution // self.downsample_factor
        return side, side

    @property
    def tokens_per_image(self) -> int:
        h, w = self.token_grid
        return h * w

    @property
    def token_dim(self) -> int:
        return self.config.embed_dim

    def _check_images(self, images, name="images", exact=False):
        c, res, f = self.config.in_channels, self.config.resolution, self.downsample_factor
        shape = tuple(images.shape)
        ok = images.dim() == 4 and shape[1] == c
        ok = ok and ((shape[2], shape[3]) == (res, res) if exact else shape[2] % f == 0 and shape[3] % f == 0)
        if not ok:
            want = f"[B, {c}, {res}, {res}]" if exact else f"[B, {c}, H, W] with H and W multiples of {f}"
            raise ValueError(f"{name} must be {want}, got shape {shape}")

    def encode(self, images: torch.Tensor) -> DiagonalGaussian:
        """Images [B, C, H, W] in [-1, 1] -> posterior over latents [B, D, H / f, W / f] (f: downsampling factor)."""
        self._check_images(images)
        moments = self.quant_conv(self.encoder(images))
        if not self.config.use_variational:
            moments = torch.cat([moments, torch.ones_like(moments)], dim=1)  # logvar = 1, as the official code
        mean, logvar = moments.chunk(2, dim=1)
        return DiagonalGaussian(mean, logvar)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, D, h, w] (unscaled) -> images [B, C, h f, w f] (not clamped)."""
        if latents.dim() != 4 or latents.shape[1] != self.config.embed_dim:
            raise ValueError(f"latents must be [B, {self.config.embed_dim}, h, w], got shape {tuple(latents.shape)}")
        return self.decoder(self.post_quant_conv(latents))

    def encode_tokens(self, images: torch.Tensor, generator: Generators = None) -> torch.Tensor:
        """Images [B, C, resolution, resolution] in [-1, 1] -> tokens [B, h*w, D] = latents * scale_factor.

        The latents are the posterior mean when `generator` is None, else a posterior sample drawn from it.
        Flattened as MAR's `patchify` with patch size 1: row-major over (h, w), channels last.
        """
        self._check_images(images, exact=True)
        posterior = self.encode(images)
        latents = posterior.mode() if generator is None else posterior.sample(generator)
        b, d, h, w = latents.shape
        return (latents * self.config.scale_factor).permute(0, 2, 3, 1).reshape(b, h * w, d)

    def decode_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens [B, h*w, D] (as `encode_tokens` gives) -> images [B, C, resolution, resolution] (not clamped)."""
        (h, w), d = self.token_grid, self.token_dim
        if tokens.dim() != 3 or tokens.shape[1:] != (h * w, d):
            raise ValueError(f"tokens must be [B, {h * w}, {d}], got shape {tuple(tokens.shape)}")
        latents = tokens.reshape(-1, h, w, d).permute(0, 3, 1, 2) / self.config.scale_factor
        return self.decode(latents.contiguous())

    def forward(self, images: torch.Tensor, generator: Generators = None, return_dict: bool = True):
        """Training forward: encode, take a posterior sample (from `generator`; its mean when None), decode.

        Returns `KLOutput(reconstruction, posterior, latents)` (or a tuple).
        """
        posterior = self.encode(images)
        latents = posterior.mode() if generator is None else posterior.sample(generator)
        out = KLOutput(reconstruction=self.decode(latents), posterior=posterior, latents=latents)
        return out if return_dict else out.to_tuple()


# ----------------------------------------------------------------------------- official checkpoints


def load_official_kl(path: str | os.PathLike, **config) -> AutoencoderKL:
    """Load an official MAR KL-VAE checkpoint (`kl16.ckpt`: `{"model": state_dict}`) strictly.

    Reads with `torch.load(weights_only=True)`, checks every key and shape before loading.

    Args:
        path: the checkpoint file.
        **config: `AutoencoderKL` config overrides on top of `KL16_CONFIG`.

    Raises:
        ValueError: unreadable file, missing / unexpected key, wrong shape, or non-finite weights (names the key).
    """
    from mmspec.models.llamagen.checkpoints import load_checked, load_official_state_dict

    state = load_official_state_dict(path, wrapper_keys=("model", "state_dict"))
    model = AutoencoderKL(**{**KL16_CONFIG, **config})
    load_checked(model, state, path)
    logger.info("loaded official KL-VAE weights from %s (%d tensors)", path, len(state))
    return model.eval()
