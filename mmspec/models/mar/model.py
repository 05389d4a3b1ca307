"""MAR (Li et al., "Autoregressive Image Generation without Vector Quantization", arXiv 2406.11838): a bidirectional
MAE-style encoder/decoder over continuous tokens with class "buffer" tokens, and a per-token diffusion head.

Parameter names equal the official ``models/mar.py`` (``LTH14/mar``; timm ``Block`` names inside), so official
``mar_base/large/huge`` checkpoints load as they are (`mmspec.models.mar.checkpoints.load_official_mar`).

Masks: ``visible [B, L]`` bool, True = the token is known (upstream's ``mask`` is the complement). The encoder sees the
buffer and the visible tokens only (upstream drops the masked ones; rows with fewer visible tokens than others are
padded and masked out of attention, which gives the same outputs); the decoder sees every position, masked ones as
``mask_token``. ``features(...)`` returns the diffusion head's condition ``z [B, L, decoder_dim]`` for every position.
"""

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn

from mmspec.counting import host_checks_enabled
from mmspec.models.mar.diffloss import DiffLossHead


__all__ = ["MAR", "MAR_PRESETS", "mask_ratio_sample"]

# Official presets (models/mar.py): encoder = decoder sizes; the head's depth/width are training arguments.
MAR_PRESETS = {
    "mar_base": dict(encoder_embed_dim=768, encoder_depth=12, encoder_num_heads=12, decoder_embed_dim=768, decoder_depth=12, decoder_num_heads=12, diffloss_d=6, diffloss_w=1024),
    "mar_large": dict(encoder_embed_dim=1024, encoder_depth=16, encoder_num_heads=16, decoder_embed_dim=1024, decoder_depth=16, decoder_num_heads=16, diffloss_d=8, diffloss_w=1280),
    "mar_huge": dict(encoder_embed_dim=1280, encoder_depth=20, encoder_num_heads=16, decoder_embed_dim=1280, decoder_depth=20, decoder_num_heads=16, diffloss_d=12, diffloss_w=1536),
}  # fmt: skip


class Attention(nn.Module):
    """timm's ``Attention`` (fused qkv, no q/k norm) with an optional key mask."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:  # x [B, T, C], key_mask [B, T] bool
        b, t, c = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, hd]
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """timm's ViT ``Block`` (pre-norm attention + GELU MLP; dropout is a training-only detail of upstream)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.mlp(self.norm2(x))


def mask_ratio_sample(generator: torch.Generator, mask_ratio_min: float = 0.7, device=None) -> float:
    """Upstream's training mask ratio: a normal at 1.0 (std 0.25) truncated to ``[mask_ratio_min, 1]``, drawn by
    inverse CDF from ``generator``."""
    lo = torch.special.ndtr(torch.tensor((mask_ratio_min - 1.0) / 0.25, dtype=torch.float64))
    u = torch.rand((), generator=generator, device=device, dtype=torch.float64).cpu()
    x = torch.special.ndtri(lo + u * (0.5 - lo))
    return float(1.0 + 0.25 * x)


class MAR(ModelMixin, ConfigMixin):
    """Class-conditional MAR over a ``seq_h x seq_w`` grid of ``token_embed_dim``-d tokens (``patch_size`` 1).

    Args:
        seq_h, seq_w: the token grid (upstream: ``img_size // vae_stride // patch_size``).
        token_embed_dim: token dim (the VAE's embed_dim * patch_size^2).
        class_num: classes; ``fake_latent`` is the unconditional (CFG) embedding.
        buffer_size: class "buffer" tokens prepended to the sequence (upstream 64).
        diffloss_d, diffloss_w: the head's residual blocks and width; num_sampling_steps: its respaced steps.
        label_drop_prob, mask_ratio_min, diffusion_batch_mul: training (class dropout for CFG, mask ratio range,
            head repeats per token).
        clip_denoised: the head's ``x_start`` clamp while sampling (None = upstream; `DiffLossHead`).
    """

    @register_to_config
    def __init__(
        self,
        seq_h: int = 16,
        seq_w: int = 16,
        token_embed_dim: int = 16,
        encoder_embed_dim: int = 1024,
        encoder_depth: int = 16,
        encoder_num_heads: int = 16,
        decoder_embed_dim: int = 1024,
        decoder_depth: int = 16,
        decoder_num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_num: int = 1000,
        buffer_size: int = 64,
        diffloss_d: int = 3,
        diffloss_w: int = 1024,
        num_sampling_steps: str = "100",
        label_drop_prob: float = 0.1,
        mask_ratio_min: float = 0.7,
        diffusion_batch_mul: int = 4,
        clip_denoised: float | None = None,
    ):
        super().__init__()
        self.seq_len = seq_h * seq_w
        self.token_embed_dim = token_embed_dim
        self.buffer_size = buffer_size
        self.class_emb = nn.Embedding(class_num, encoder_embed_dim)
        self.fake_latent = nn.Parameter(torch.zeros(1, encoder_embed_dim))
        self.z_proj = nn.Linear(token_embed_dim, encoder_embed_dim)
        self.z_proj_ln = nn.LayerNorm(encoder_embed_dim, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + buffer_size, encoder_embed_dim))
        self.encoder_blocks = nn.ModuleList(
            [Block(encoder_embed_dim, encoder_num_heads, mlp_ratio) for _ in range(encoder_depth)]
        )
        self.encoder_norm = nn.LayerNorm(encoder_embed_dim, eps=1e-6)
        self.decoder_embed = nn.Linear(encoder_embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + buffer_size, decoder_embed_dim))
        self.decoder_blocks = nn.ModuleList(
            [Block(decoder_embed_dim, decoder_num_heads, mlp_ratio) for _ in range(decoder_depth)]
        )
        self.decoder_norm = nn.LayerNorm(decoder_embed_dim, eps=1e-6)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len, decoder_embed_dim))
        self._init_weights()
        self.diffloss = DiffLossHead(
            token_embed_dim, decoder_embed_dim, diffloss_d, diffloss_w, num_sampling_steps, clip_denoised
        )

    def _init_weights(self):
        for p in [self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned]:  # fmt: skip
            nn.init.normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "MAR":
        if name not in MAR_PRESETS:
            raise ValueError(f"model={name!r}: unknown MAR preset, expected one of {sorted(MAR_PRESETS)}")
        return cls(**{**MAR_PRESETS[name], **overrides})

    @property
    def grid(self) -> tuple[int, int]:
        return self.config.seq_h, self.config.seq_w

    def class_embedding(self, labels: Tensor | None, batch: int | None = None) -> Tensor:
        """``[B, E]``: the class embeddings, or the unconditional ``fake_latent`` for ``labels=None``."""
        if labels is None:
            return self.fake_latent.expand(batch, -1)
        return self.class_emb(labels)

    def features(self, tokens: Tensor, visible: Tensor, class_embedding: Tensor, visible_range=None) -> Tensor:
        """The head's conditions ``z [B, L, decoder_dim]`` for every position.

        Args:
            tokens: ``[B, L, D]`` token values (masked positions are ignored).
            visible: ``[B, L]`` bool, known tokens.
            class_embedding: ``[B, E]`` (`class_embedding`).
            visible_range: ``(fewest, most)`` visible tokens of a row, when the caller knows them on the host (the
                masked loop does, from its schedule): no host read then (checked where a read is free, on a CPU).
        """
        b, length, _ = tokens.shape
        buf = self.buffer_size
        x = self.z_proj(tokens)  # [B, L, E]
        x = torch.cat([class_embedding[:, None, :].expand(b, buf, -1).to(x.dtype), x], dim=1)
        x = self.z_proj_ln(x + self.encoder_pos_embed_learned)  # [B, buf + L, E]
        keep = torch.cat([torch.ones(b, buf, dtype=torch.bool, device=x.device), visible], dim=1)  # [B, buf + L]
        # Gather the buffer + visible positions of each row first (stable), padded to the longest row.
        # One host read for both the padded length and whether any row is padded (no key mask needed then).
        kept = keep.sum(1)
        if visible_range is None:
            num_keep, fewest = torch.stack([kept.max(), kept.min()]).tolist()
        else:
            fewest, num_keep = buf + visible_range[0], buf + visible_range[1]
            if host_checks_enabled(x.device) and [num_keep, fewest] != torch.stack([kept.max(), kept.min()]).tolist():
                raise ValueError(f"visible_range={visible_range} does not match the canvas's visible tokens")
        index = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :num_keep]  # [B, T]
        key_mask = keep.gather(1, index)  # [B, T]
        h = x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))
        full = fewest == num_keep  # every row keeps num_keep positions: key_mask is all True
        for block in self.encoder_blocks:
            h = block(h, None if full else key_mask)
        h = self.decoder_embed(self.encoder_norm(h))  # [B, T, Dd]
        dec = self.mask_token.to(h.dtype).expand(b, buf + length, -1).clone()
        h = torch.where(key_mask[..., None], h, dec.gather(1, index[..., None].expand(-1, -1, h.shape[-1])))
        dec = dec.scatter(1, index[..., None].expand(-1, -1, h.shape[-1]), h)
        x = dec + self.decoder_pos_embed_learned
        for block in self.decoder_blocks:
            x = block(x)
        x = self.decoder_norm(x)[:, buf:]
        return x + self.diffusion_pos_embed_learned  # [B, L, Dd]

    def loss(self, tokens: Tensor, labels: Tensor, generator: torch.Generator) -> Tensor:
        """MAR's training loss: random order, a truncated-normal mask ratio (one per batch), class dropout, the
        diffusion loss on the masked tokens (each repeated ``diffusion_batch_mul`` times)."""
        b, length, d = tokens.shape
        dev = tokens.device
        orders = torch.rand(b, length, generator=generator, device=dev).argsort(1)
        num_masked = math.ceil(length * mask_ratio_sample(generator, self.config.mask_ratio_min, dev))
        masked = torch.zeros(b, length, dtype=torch.bool, device=dev).scatter(1, orders[:, :num_masked], True)
        emb = self.class_emb(labels)
        drop = torch.rand(b, generator=generator, device=dev) < self.config.label_drop_prob
        emb = torch.where(drop[:, None], self.fake_latent.to(emb.dtype), emb)
        z = self.features(tokens, ~masked, emb)
        mul = self.config.diffusion_batch_mul
        # Upstream runs the head on every token and zero-weights the visible ones; only the masked ones here.
        return self.diffloss.loss(tokens[masked].repeat(mul, 1), z[masked].repeat(mul, 1), generator)
