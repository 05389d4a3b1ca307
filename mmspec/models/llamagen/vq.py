"""LlamaGen's VQ image tokenizer (VQGAN-style conv encoder/decoder + l2-normalised codebook) as a diffusers model.

Architecture and parameter names follow `tokenizer/tokenizer_image/vq_model.py` of FoundationVision/LlamaGen
(itself derived from taming-transformers and MaskGIT), so official `vq_ds16_c2i.pt` / `vq_ds16_t2i.pt` state dicts
load with `load_official_vq(path)`:

    encoder: conv_in -> conv_blocks[i].{res[j], attn[j] (lowest resolution only), downsample} -> mid[res, attn, res]
             -> norm_out -> swish -> conv_out (z_channels)
    quant_conv (z_channels -> codebook_embed_dim) -> quantize.embedding [codebook_size, codebook_embed_dim]
    post_quant_conv (codebook_embed_dim -> z_channels) -> decoder (mirror image, num_res_blocks + 1 per level)

With `codebook_l2_norm=True` (LlamaGen's default) both the encoder output and the codebook rows are l2-normalised
before the nearest-neighbour search, so the vectors the decoder actually sees are `model.codebook`
(= `normalize(quantize.embedding.weight)`), not the raw embedding weights. Token grids are flattened in raster order
(row-major over [h, w]), exactly like the official `min_encoding_indices`.

References:
    Sun et al., "Autoregressive Model Beats Diffusion: Llama for Scalable Image Generation" (LlamaGen), 2024.
    Esser et al., "Taming Transformers for High-Resolution Image Synthesis" (VQGAN), 2021.

Examples:
    >>> vq = LlamaGenVQ(in_channels=1, ch=32, ch_mult=(1, 2, 2), z_channels=64, codebook_size=256,
    ...                 codebook_embed_dim=8, sample_size=32)
    >>> codes = vq.encode(images)  # [B, 64] LongTensor, raster order over the 8x8 grid
    >>> recon = vq.decode_codes(codes)  # [B, 1, 32, 32] in [-1, 1]
"""

import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput
from torch import nn

from mmspec.models.config_fields import check_fields


logger = logging.getLogger(__name__)

# Official LlamaGen presets (`VQ_models` in vq_model.py); `sample_size` is the training resolution of the release.
VQ_PRESETS = {
    "VQ-16": dict(
        in_channels=3,
        ch=128,
        ch_mult=(1, 1, 2, 2, 4),
        num_res_blocks=2,
        z_channels=256,
        codebook_size=16384,
        codebook_embed_dim=8,
        codebook_l2_norm=True,
        sample_size=256,
    ),
    "VQ-8": dict(
        in_channels=3,
        ch=128,
        ch_mult=(1, 2, 2, 4),
        num_res_blocks=2,
        z_channels=256,
        codebook_size=16384,
        codebook_embed_dim=8,
        codebook_l2_norm=True,
        sample_size=256,
    ),
}

# Training-only buffer of the official quantiser (a ring buffer of recent code ids); not part of the model.
_OFFICIAL_IGNORED_KEYS = ("quantize.codebook_used",)


# ----------------------------------------------------------------------------- building blocks


def _norm(channels: int, num_groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=num_groups, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """norm -> swish -> conv3x3 -> norm -> swish -> dropout -> conv3x3, plus a (1x1 `nin_shortcut`) residual."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0, num_groups: int = 32):
        super().__init__()
        self.norm1 = _norm(in_channels, num_groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _norm(out_channels, num_groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head spatial self-attention with 1x1-conv q/k/v/proj_out and a residual connection."""

    def __init__(self, channels: int, num_groups: int = 32):
        super().__init__()
        self.norm = _norm(channels, num_groups)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        hn = self.norm(x)
        q, k, v = (m(hn).reshape(b, 1, c, h * w).transpose(-1, -2) for m in (self.q, self.k, self.v))  # (B, 1, hw, C)
        out = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(C)) v
        return x + self.proj_out(out.transpose(-1, -2).reshape(b, c, h, w))


class Downsample(nn.Module):
    """Stride-2 3x3 conv after asymmetric (right/bottom) zero padding: H -> H / 2."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbour x2 then a 3x3 conv: H -> 2 H."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _res_attn(block, h):
    """A resolution level's residual blocks, each followed by its attention block when the level has them."""
    for i, res in enumerate(block.res):
        h = res(h)
        if len(block.attn) > 0:
            h = block.attn[i](h)
    return h


class Encoder(nn.Module):
    """Images [B, in_channels, H, W] -> latents [B, z_channels, H / 2^(L-1), W / 2^(L-1)], L = len(ch_mult)."""

    def __init__(self, in_channels, ch, ch_mult, num_res_blocks, z_channels, dropout=0.0, num_groups=32):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        block_in = ch
        for level, mult in enumerate(ch_mult):
            last = level == len(ch_mult) - 1
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks):
                block.res.append(ResnetBlock(block_in, ch * mult, dropout, num_groups))
                block_in = ch * mult
                if last:  # attention only at the lowest resolution
                    block.attn.append(AttnBlock(block_in, num_groups))
            if not last:
                block.downsample = Downsample(block_in)
            self.conv_blocks.append(block)
        self.mid = nn.ModuleList(
            [
                ResnetBlock(block_in, block_in, dropout, num_groups),
                AttnBlock(block_in, num_groups),
                ResnetBlock(block_in, block_in, dropout, num_groups),
            ]
        )
        self.norm_out = _norm(block_in, num_groups)
        self.conv_out = nn.Conv2d(block_in, z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for block in self.conv_blocks:
            h = _res_attn(block, h)
            if hasattr(block, "downsample"):
                h = block.downsample(h)
        for layer in self.mid:
            h = layer(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Latents [B, z_channels, h, w] -> images [B, out_channels, h 2^(L-1), w 2^(L-1)] (mirror of `Encoder`)."""

    def __init__(self, out_channels, ch, ch_mult, num_res_blocks, z_channels, dropout=0.0, num_groups=32):
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = nn.ModuleList(
            [
                ResnetBlock(block_in, block_in, dropout, num_groups),
                AttnBlock(block_in, num_groups),
                ResnetBlock(block_in, block_in, dropout, num_groups),
            ]
        )
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(len(ch_mult))):
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                block.res.append(ResnetBlock(block_in, ch * ch_mult[level], dropout, num_groups))
                block_in = ch * ch_mult[level]
                if level == len(ch_mult) - 1:
                    block.attn.append(AttnBlock(block_in, num_groups))
            if level != 0:
                block.upsample = Upsample(block_in)
            self.conv_blocks.append(block)
        self.norm_out = _norm(block_in, num_groups)
        self.conv_out = nn.Conv2d(block_in, out_channels, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for layer in self.mid:
            h = layer(h)
        for block in self.conv_blocks:
            h = _res_attn(block, h)
            if hasattr(block, "upsample"):
                h = block.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


def entropy_loss(affinity: torch.Tensor, temperature: float = 0.01) -> torch.Tensor:
    """MaskGIT-style codebook entropy loss: mean per-sample entropy minus entropy of the mean assignment.

    Minimising it makes each vector's soft assignment confident while spreading usage over the whole codebook.
    `affinity` [N, V] is a similarity (LlamaGen uses minus the squared distance).
    """
    logits = affinity.reshape(-1, affinity.shape[-1]).float() / temperature
    probs = logits.softmax(-1)
    sample_entropy = -(probs * logits.log_softmax(-1)).sum(-1).mean()
    avg_probs = probs.mean(0)
    avg_entropy = -(avg_probs * torch.log(avg_probs + 1e-5)).sum()
    return sample_entropy - avg_entropy


class VectorQuantizer(nn.Module):
    """Nearest-neighbour codebook lookup with an optional l2 normalisation of vectors and codebook (LlamaGen)."""

    def __init__(self, codebook_size, codebook_embed_dim, beta=0.25, entropy_loss_ratio=0.0, l2_norm=True):
        super().__init__()
        self.codebook_size, self.codebook_embed_dim = codebook_size, codebook_embed_dim
        self.beta, self.entropy_loss_ratio, self.l2_norm = beta, entropy_loss_ratio, l2_norm
        self.embedding = nn.Embedding(codebook_size, codebook_embed_dim)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / codebook_size, 1.0 / codebook_size)
            if l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, dim=-1))

    def codebook(self) -> torch.Tensor:
        """The code vectors the decoder uses, [V, d] (l2-normalised rows when `l2_norm`)."""
        weight = self.embedding.weight
        return F.normalize(weight, dim=-1) if self.l2_norm else weight

    def distances(self, z_flat: torch.Tensor) -> torch.Tensor:
        """Squared l2 distances [N, V] from (normalised) vectors [N, d] to every (normalised) code."""
        codebook = self.codebook()
        return z_flat.pow(2).sum(-1, keepdim=True) + codebook.pow(2).sum(-1) - 2 * z_flat @ codebook.t()

    def forward(self, z: torch.Tensor):
        """Quantise z [B, d, h, w] -> (z_q [B, d, h, w] straight-through, losses dict, indices [B, h*w]).

        losses: "codebook" = ||sg(z) - e||^2, "commitment" = beta ||z - sg(e)||^2, "entropy" = ratio * entropy_loss
        (all means; entropy only when entropy_loss_ratio > 0). Gradients reach the encoder through the
        straight-through estimator z + sg(z_q - z).
        """
        b, d, h, w = z.shape
        z = z.permute(0, 2, 3, 1).reshape(-1, d)  # (B h w, d), raster order
        if self.l2_norm:
            z = F.normalize(z, dim=-1)
        dist = self.distances(z)
        indices = dist.argmin(-1)
        z_q = self.codebook()[indices]
        losses = {
            "codebook": F.mse_loss(z_q, z.detach()),
            "commitment": self.beta * F.mse_loss(z, z_q.detach()),
        }
        if self.entropy_loss_ratio > 0:
            losses["entropy"] = self.entropy_loss_ratio * entropy_loss(-dist)
        z_q = z + (z_q - z).detach()  # straight-through
        z_q = z_q.reshape(b, h, w, d).permute(0, 3, 1, 2).contiguous()
        return z_q, losses, indices.reshape(b, h * w)

    def lookup(self, indices: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Code ids [B, h*w] -> code vectors [B, d, h, w]."""
        h, w = grid
        vectors = self.codebook()[indices.reshape(indices.shape[0], -1)]  # (B, hw, d)
        return vectors.reshape(indices.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous()


@dataclass
class VQOutput(BaseOutput):
    """Training forward output of `LlamaGenVQ`.

    Attributes:
        reconstruction: decoded images [B, C, H, W] (not clamped).
        codebook_loss: ||sg(z) - e||^2.
        commitment_loss: beta ||z - sg(e)||^2.
        entropy_loss: entropy_loss_ratio * entropy term (0 when disabled).
        codes: code ids [B, h*w], raster order.
        latents: the quantised (straight-through) latents [B, d, h, w].
    """

    reconstruction: torch.Tensor
    codebook_loss: torch.Tensor
    commitment_loss: torch.Tensor
    entropy_loss: torch.Tensor
    codes: torch.Tensor
    latents: torch.Tensor


# ----------------------------------------------------------------------------- the model


class LlamaGenVQ(ModelMixin, ConfigMixin):
    """LlamaGen VQ tokenizer (encoder, l2-normalised codebook, decoder) with the official parameter names.

    Args:
        in_channels: image channels (3 for RGB, 1 for MNIST); the decoder outputs the same number.
        ch: base channel width.
        ch_mult: channel multiplier per resolution level; the downsampling factor is 2^(len(ch_mult) - 1).
        num_res_blocks: resnet blocks per encoder level (the decoder uses one more, as in the official code).
        z_channels: encoder output / decoder input channels.
        codebook_size: number of codes V.
        codebook_embed_dim: code dimension d.
        codebook_l2_norm: l2-normalise encoder vectors and codes before the lookup (LlamaGen default).
        commit_loss_beta: commitment loss weight beta.
        entropy_loss_ratio: weight of the codebook entropy loss in training (0 disables).
        dropout: dropout inside resnet blocks.
        norm_num_groups: GroupNorm groups (official: 32; every channel count must be divisible by it).
        sample_size: image side used to infer the token grid in `decode_codes` for non-square code counts
            (optional: square grids are inferred from the number of codes).
    """

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        ch: int = 128,
        ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4),
        num_res_blocks: int = 2,
        z_channels: int = 256,
        codebook_size: int = 16384,
        codebook_embed_dim: int = 8,
        codebook_l2_norm: bool = True,
        commit_loss_beta: float = 0.25,
        entropy_loss_ratio: float = 0.0,
        dropout: float = 0.0,
        norm_num_groups: int = 32,
        sample_size: int | None = None,
    ):
        check_fields("LlamaGenVQ", locals())  # types and ranges; the cross-field rules follow
        super().__init__()
        ch_mult = tuple(ch_mult)
        factor = 2 ** (len(ch_mult) - 1)
        if sample_size is not None and sample_size % factor:
            raise ValueError(
                f"sample_size={sample_size} must be a multiple of the downsampling factor {factor} (ch_mult={ch_mult})"
            )
        for width in {ch} | {ch * m for m in ch_mult}:
            if width % norm_num_groups:
                raise ValueError(
                    f"channel width {width} (ch={ch}, ch_mult={ch_mult}) not divisible by {norm_num_groups}"
                )
        self.encoder = Encoder(in_channels, ch, ch_mult, num_res_blocks, z_channels, dropout, norm_num_groups)
        self.decoder = Decoder(in_channels, ch, ch_mult, num_res_blocks, z_channels, dropout, norm_num_groups)
        self.quantize = VectorQuantizer(
            codebook_size, codebook_embed_dim, commit_loss_beta, entropy_loss_ratio, codebook_l2_norm
        )
        self.quant_conv = nn.Conv2d(z_channels, codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(codebook_embed_dim, z_channels, 1)

    @classmethod
    def from_preset(cls, name: str = "VQ-16", **overrides) -> "LlamaGenVQ":
        """Build an official architecture ("VQ-16" or "VQ-8"), randomly initialised, with config overrides."""
        if name not in VQ_PRESETS:
            raise ValueError(f"preset={name!r} unknown; known: {sorted(VQ_PRESETS)}")
        return cls(**{**VQ_PRESETS[name], **overrides})

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.config.ch_mult) - 1)

    @property
    def codebook(self) -> torch.Tensor:
        """The code vectors the decoder actually uses, [codebook_size, codebook_embed_dim] (normalised if l2)."""
        return self.quantize.codebook()

    def token_grid(self, num_tokens: int | None = None) -> tuple[int, int]:
        """(h, w) of the token grid: sqrt(num_tokens) if square, else from `sample_size`."""
        if num_tokens is not None:
            side = math.isqrt(num_tokens)
            if side * side == num_tokens:
                return side, side
        if self.config.sample_size is None:
            raise ValueError(f"cannot infer the token grid of {num_tokens} codes: not square and no sample_size")
        side = self.config.sample_size // self.downsample_factor
        if num_tokens is not None and side * side != num_tokens:
            raise ValueError(f"{num_tokens} codes do not fit the {side}x{side} grid of sample_size")
        return side, side

    def encode_latents(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] in [-1, 1] -> pre-quantisation vectors [B, d, h, w] (before l2 normalisation)."""
        return self.quant_conv(self.encoder(images))

    def encode(self, images: torch.Tensor) -> torch.LongTensor:
        """Images [B, C, H, W] in [-1, 1] -> code ids LongTensor [B, h*w] (raster order)."""
        _, _, codes = self.quantize(self.encode_latents(images))
        return codes

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Quantised vectors [B, d, h, w] -> images [B, C, H, W] (not clamped)."""
        return self.decoder(self.post_quant_conv(latents))

    def decode_codes(self, codes: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """Code ids [B, h*w] (or [B, h, w]) -> images [B, C, H, W] clamped to [-1, 1].

        Args:
            codes: integer code ids in [0, codebook_size).
            grid: (h, w); default inferred (square, or from `sample_size`).
        """
        if codes.dim() == 3:
            grid = grid or (codes.shape[1], codes.shape[2])
            codes = codes.reshape(codes.shape[0], -1)
        grid = grid or self.token_grid(codes.shape[1])
        codes = codes.long()
        if codes.numel() and bool(((codes < 0) | (codes >= self.config.codebook_size)).any()):  # one host read
            lo, hi = int(codes.min()), int(codes.max())
            raise ValueError(f"codes must lie in [0, {self.config.codebook_size}); got [{lo}, {hi}]")
        return self.decode_latents(self.quantize.lookup(codes, grid)).clamp(-1.0, 1.0)

    def forward(self, images: torch.Tensor, return_dict: bool = True):
        """Training forward: encode, quantise (straight-through), decode. Returns `VQOutput` (or a tuple)."""
        latents, losses, codes = self.quantize(self.encode_latents(images))
        reconstruction = self.decode_latents(latents)
        zero = reconstruction.new_zeros(())
        out = VQOutput(
            reconstruction=reconstruction,
            codebook_loss=losses["codebook"],
            commitment_loss=losses["commitment"],
            entropy_loss=losses.get("entropy", zero),
            codes=codes,
            latents=latents,
        )
        return out if return_dict else out.to_tuple()


# ----------------------------------------------------------------------------- official checkpoints


def load_official_vq(path: str | os.PathLike, preset: str | None = "VQ-16", **config) -> LlamaGenVQ:
    """Load an official LlamaGen VQ checkpoint (`vq_ds16_c2i.pt`, `vq_ds16_t2i.pt`, a `vq_train.py` checkpoint).

    Reads with `torch.load(weights_only=True)` (training checkpoints pickle their `argparse.Namespace` args, which
    is allow-listed), takes the weights from "ema", else "model", else "state_dict" (or a bare state dict), drops
    the training-only `quantize.codebook_used` buffer, and checks every key and shape before loading.

    Args:
        path: the `.pt` file.
        preset: "VQ-16" (ch 128, ch_mult [1,1,2,2,4], z 256, codebook 16384x8), "VQ-8", or None.
        **config: `LlamaGenVQ` config overrides on top of the preset (e.g. `codebook_size=...`).

    Raises:
        ValueError: unreadable/corrupt file, missing weights entry, missing or unexpected key, shape mismatch,
            or non-finite weights; the message names the offending key.
    """
    from mmspec.models.llamagen.checkpoints import load_checked, load_official_state_dict

    state = load_official_state_dict(path, wrapper_keys=("ema", "model", "state_dict"))
    state = {k: v for k, v in state.items() if k not in _OFFICIAL_IGNORED_KEYS}
    if preset is not None and preset not in VQ_PRESETS:
        raise ValueError(f"preset={preset!r} unknown; known: {sorted(VQ_PRESETS)}")
    model = LlamaGenVQ(**{**(VQ_PRESETS[preset] if preset else {}), **config})
    load_checked(model, state, path)
    logger.info("loaded official LlamaGen VQ weights from %s (%d tensors)", path, len(state))
    return model.eval()
