"""The shipped LlamaGen VQ (`mmspec.models.llamagen.vq.LlamaGenVQ`) as a transformers `JanusVQVAE`: config + state dict.

Janus' VQ-VAE (transformers `models/janus/modeling_janus.py`) is the same VQGAN-style network as LlamaGen's VQ
(both descend from taming-transformers): per level `num_res_blocks` resnet blocks in the encoder and one more in
the decoder, attention blocks only at the lowest resolution, a `[res, attn, res]` middle, GroupNorm(32, eps 1e-6),
swish, asymmetric-padding stride-2 downsampling, nearest x2 + conv upsampling, `quant_conv` / `post_quant_conv`
1x1 convs. Only the parameter names differ:

    LlamaGen                                Janus
    encoder.conv_blocks.{i}.res.{j}         encoder.down.{i}.block.{j}
    encoder.conv_blocks.{i}.attn.{j}        encoder.down.{i}.attn.{j}
    encoder.conv_blocks.{i}.downsample      encoder.down.{i}.downsample
    {en,de}coder.mid.{0,1,2}                {en,de}coder.mid.{block_1,attn_1,block_2}
    decoder.conv_blocks.{i}.res.{j}         decoder.up.{i}.block.{j}      (same order: lowest resolution first)
    decoder.conv_blocks.{i}.upsample        decoder.up.{i}.upsample

The quantiser differs in one respect: LlamaGen (`codebook_l2_norm=True`) l2-normalises both the encoder vectors and
the codebook rows before the nearest-neighbour search, Janus' `JanusVQVAEVectorQuantizer.forward` normalises
neither (its `get_codebook_entry`, the decoding path, normalises the codebook rows). The converted codebook is
therefore stored already l2-normalised: decoding is unchanged (normalising a unit vector is the identity), and the
encoder's argmin over `|z|^2 + 1 - 2 z.e` picks the same code as LlamaGen's argmin over `2 - 2 (z/|z|).e` (both
maximise `z.e`; `|z| > 0`). Janus' decoder output is not clamped (LlamaGen's `decode_codes` clamps to [-1, 1]).

Janus hard-codes GroupNorm(32 groups), so a LlamaGen VQ with `norm_num_groups != 32`, without `codebook_l2_norm`, or
with a non-square grid cannot be converted (ValueError naming the field).

Examples:
    >>> from mmspec.models import load
    >>> config, state = janus_vq_from_llamagen(load("assets/mnist-vq"))
    >>> vq = JanusVQVAE(config); vq.load_state_dict(state)
"""

import re

import torch
import torch.nn.functional as F


def janus_vq_config(llamagen_config, **extra):
    """A transformers `JanusVQVAEConfig` with the architecture of a LlamaGen VQ config (`LlamaGenVQ.config`).

    `extra`: the generation-side fields (`projection_dim`, `image_token_embed_dim`, `num_hidden_layers`, ...).

    Raises:
        ValueError: the LlamaGen VQ does not map onto Janus' VQ-VAE (field named).
    """
    from transformers import JanusVQVAEConfig

    cfg = llamagen_config
    if cfg["norm_num_groups"] != 32:
        raise ValueError(f"LlamaGen VQ norm_num_groups={cfg['norm_num_groups']}: Janus' VQ-VAE hard-codes 32 groups")
    if not cfg["codebook_l2_norm"]:
        raise ValueError("LlamaGen VQ codebook_l2_norm=False: Janus' decoder always l2-normalises the codebook")
    if cfg["sample_size"] is None:
        raise ValueError("LlamaGen VQ sample_size is None: the Janus VQ-VAE needs the (square) token grid side")
    factor = 2 ** (len(cfg["ch_mult"]) - 1)
    return JanusVQVAEConfig(
        embed_dim=cfg["codebook_embed_dim"],
        num_embeddings=cfg["codebook_size"],
        double_latent=False,
        latent_channels=cfg["z_channels"],
        in_channels=cfg["in_channels"],
        out_channels=cfg["in_channels"],
        base_channels=cfg["ch"],
        channel_multiplier=list(cfg["ch_mult"]),
        num_res_blocks=cfg["num_res_blocks"],
        dropout=cfg["dropout"],
        num_patches=cfg["sample_size"] // factor,
        **extra,
    )


_RULES = (
    (r"^(encoder)\.conv_blocks\.(\d+)\.res\.", r"\1.down.\2.block."),
    (r"^(encoder)\.conv_blocks\.(\d+)\.", r"\1.down.\2."),
    (r"^(decoder)\.conv_blocks\.(\d+)\.res\.", r"\1.up.\2.block."),
    (r"^(decoder)\.conv_blocks\.(\d+)\.", r"\1.up.\2."),
    (r"^(encoder|decoder)\.mid\.0\.", r"\1.mid.block_1."),
    (r"^(encoder|decoder)\.mid\.1\.", r"\1.mid.attn_1."),
    (r"^(encoder|decoder)\.mid\.2\.", r"\1.mid.block_2."),
)


def janus_vq_key(name: str) -> str:
    """The Janus VQ-VAE parameter name of a LlamaGen VQ parameter name."""
    for pattern, repl in _RULES:
        name = re.sub(pattern, repl, name)
    return name


def janus_vq_state_dict(llamagen_vq) -> dict[str, torch.Tensor]:
    """The state dict of a `JanusVQVAE` equivalent to `llamagen_vq` (codebook rows l2-normalised; float32 copies)."""
    state = {}
    for name, value in llamagen_vq.state_dict().items():
        value = value.detach().float().clone()
        if name == "quantize.embedding.weight":
            value = F.normalize(value, dim=-1)
        state[janus_vq_key(name)] = value
    return state


def janus_vq_from_llamagen(llamagen_vq, **extra):
    """(`JanusVQVAEConfig`, state dict) of a LlamaGen VQ; `extra` as in `janus_vq_config`.

    Raises:
        ValueError: the architectures do not map (field named), or a converted name is not a Janus parameter.
    """
    from transformers import JanusVQVAE

    config = janus_vq_config(llamagen_vq.config, **extra)
    state = janus_vq_state_dict(llamagen_vq)
    with torch.device("meta"):
        expected = JanusVQVAE(config).state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"LlamaGen VQ does not map onto JanusVQVAE: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    bad = [k for k in state if tuple(state[k].shape) != tuple(expected[k].shape)]
    if bad:
        raise ValueError(f"LlamaGen VQ does not map onto JanusVQVAE: shape of {bad[0]} differs")
    return config, state
