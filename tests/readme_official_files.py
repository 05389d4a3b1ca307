"""Tiny stand-ins for the official checkpoints that README.md's `from_official` examples name, for the README test
(`tests/core/test_readme.py`), which runs each block marked `<!-- readme-test: official files -->` after `install()`.

No real LlamaGen / MAR checkpoint is available offline, so `install()`, in the block's own process:
- shrinks the upstream size presets the examples name (`GPT-L`, `GPT-XL`, `VQ-16`, `mar_base`, `mar_huge`, kl16) to
  tiny widths and depths, everything else (key names, file layout, vocabulary 16384, image size 256, the token
  grid) kept as upstream;
- writes, in the working directory, random weights of those shapes in the official file formats under the exact
  names the README uses (`c2i_L_256.pt`, `vq_ds16_c2i.pt`, `t2i_XL_stage1_256.pt`, `vq_ds16_t2i.pt`,
  `mar_huge.pth`, `mar_base.pth`, `kl16.ckpt`) and a tiny text encoder folder at `path/to/flan-t5-xl` (a
  one-layer BERT with the MiniLM tokenizer of the zoo, standing in for FLAN-T5-XL);
so the examples' calls, argument names and the real loaders (`torch.load(weights_only=True)`, strict key and shape
checks) are exercised exactly as written.
"""

import argparse
from pathlib import Path

import torch


def _shrink():
    from mmspec.models.llamagen.checkpoints import GPT_PRESETS
    from mmspec.models.llamagen.vq import VQ_PRESETS
    from mmspec.models.mar.kl_vae import KL16_CONFIG
    from mmspec.models.mar.model import MAR_PRESETS

    for name in ("GPT-L", "GPT-XL"):
        GPT_PRESETS[name].update(n_layer=1, n_head=2, dim=16)
    VQ_PRESETS["VQ-16"].update(ch=8, num_res_blocks=1, z_channels=8, norm_num_groups=4)
    for name in ("mar_base", "mar_huge"):
        MAR_PRESETS[name].update(encoder_embed_dim=16, encoder_depth=1, encoder_num_heads=2, decoder_embed_dim=16,
                                 decoder_depth=1, decoder_num_heads=2, diffloss_d=1, diffloss_w=16)  # fmt: skip
    KL16_CONFIG.update(ch=8, num_res_blocks=1, num_groups=4)


def _gpt_file(path, preset, model_type, seed, caption_dim=None):
    from mmspec.models.llamagen.checkpoints import official_gpt_config
    from mmspec.models.llamagen.gpt import LlamaGenGPT

    extra = {} if model_type == "c2i" else dict(caption_dim=caption_dim, cls_token_num=120)
    config = official_gpt_config(preset, model_type=model_type, image_size=256, **extra)
    torch.manual_seed(seed)
    model = LlamaGenGPT(**config).init_weights(torch.Generator().manual_seed(seed), zero_output=False)
    torch.save({"model": model.state_dict(), "steps": 1}, path)  # as upstream's train_c2i.py / train_t2i.py


def _vq_file(path, seed):
    from mmspec.models.llamagen.vq import LlamaGenVQ

    torch.manual_seed(seed)
    torch.save({"model": LlamaGenVQ.from_preset("VQ-16").state_dict()}, path)


def _mar_file(path, model, seed):
    from mmspec.models.mar.checkpoints import build_official_mar

    torch.manual_seed(seed)
    state = build_official_mar(model).state_dict()
    args = argparse.Namespace(model=model, img_size=256)
    torch.save({"model": state, "model_ema": state, "epoch": 1, "args": args}, path)  # upstream's save_model


def _kl_file(path, seed):
    from mmspec.models.mar.kl_vae import KL16_CONFIG, AutoencoderKL

    torch.manual_seed(seed)
    torch.save({"model": AutoencoderKL(**KL16_CONFIG).state_dict()}, path)


def _text_encoder_folder(folder, width):
    from transformers import BertConfig, BertModel

    from mmspec.models.llamagen.text import load_text_encoder, minilm_folder

    tokenizer, _ = load_text_encoder(minilm_folder())
    torch.manual_seed(0)
    encoder = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=width, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=16))  # fmt: skip
    encoder.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def install(folder="."):
    """Shrink the presets and write every file the README's official examples name into `folder`."""
    folder = Path(folder)
    _shrink()
    _gpt_file(folder / "c2i_L_256.pt", "GPT-L", "c2i", 0)
    _gpt_file(folder / "t2i_XL_stage1_256.pt", "GPT-XL", "t2i", 1, caption_dim=12)
    _vq_file(folder / "vq_ds16_c2i.pt", 2)
    _vq_file(folder / "vq_ds16_t2i.pt", 3)
    _mar_file(folder / "mar_huge.pth", "mar_huge", 4)
    _mar_file(folder / "mar_base.pth", "mar_base", 5)
    _kl_file(folder / "kl16.ckpt", 6)
    _text_encoder_folder(folder / "path" / "to" / "flan-t5-xl", 12)
