"""Loading official MAR checkpoints (`mmspec.models.mar.checkpoints`): the official file layout on tiny synthetic
weights, safe unpickling, every refusal, the pipeline built from them, and the official presets' key names / shapes
(on the meta device, so no weights are allocated)."""

import argparse

import pytest
import torch

from mmspec.models.mar.checkpoints import build_official_mar, load_official_mar
from mmspec.models.mar.kl_vae import AutoencoderKL
from mmspec.pipelines import SpeculativeContinuousARPipeline


# A tiny MAR in the official layout: 8x8 images, VAE stride 2 -> a 4x4 grid of 4-d tokens.
TINY = dict(img_size=8, vae_stride=2, vae_embed_dim=4, class_num=10, buffer_size=2, diffloss_d=1, diffloss_w=32,
            num_sampling_steps="4", encoder_embed_dim=32, encoder_depth=1, encoder_num_heads=2, decoder_embed_dim=32,
            decoder_depth=1, decoder_num_heads=2)  # fmt: skip
TINY_VAE = dict(ch=8, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(), num_groups=4)


def _official_checkpoint(path, seed=0, **tiny):
    """Write ``checkpoint-last.pth`` as upstream's ``save_model`` does (raw weights, EMA weights, epoch, args)."""
    torch.manual_seed(seed)
    model = build_official_mar("mar_base", **{**TINY, **tiny})
    raw = model.state_dict()
    g = torch.Generator().manual_seed(seed)
    ema = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in raw.items()}  # EMA != raw
    args = argparse.Namespace(model="mar_base", img_size=8, diffloss_d=1)
    torch.save({"model": raw, "model_ema": ema, "epoch": 799, "args": args}, path)
    return raw, ema


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "checkpoint-last.pth"
    raw, ema = _official_checkpoint(path)
    return path, raw, ema


@pytest.mark.parametrize("use_ema", [True, False])
def test_picks_ema_or_raw_weights(ckpt, use_ema):
    path, raw, ema = ckpt
    model = load_official_mar(path, "mar_base", use_ema=use_ema, **TINY)
    want = ema if use_ema else raw
    got = model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not model.training and model.seq_len == 16 and model.token_embed_dim == 4


def test_dtype_and_preset_head_defaults(ckpt):
    path, _, _ = ckpt
    model = load_official_mar(path, "mar_base", torch_dtype=torch.float64, **TINY)
    assert model.class_emb.weight.dtype == torch.float64
    with torch.device("meta"):  # the README's head sizes per preset when diffloss_d / diffloss_w are not given
        for name, (depth, width) in {"mar_base": (6, 1024), "mar_large": (8, 1280), "mar_huge": (12, 1536)}.items():
            config = build_official_mar(name).config
            assert (config.diffloss_d, config.diffloss_w) == (depth, width)


calls = []


def _record(*args):
    calls.append(args)


class Payload:
    """Unpickling this object would call `_record`: `weights_only=True` must refuse it without running it."""

    def __reduce__(self):
        return _record, ("unpickled",)


def test_weights_only_refuses_pickled_objects(tmp_path, ckpt):
    _, raw, ema = ckpt
    path = tmp_path / "evil.pth"
    torch.save({"model": raw, "model_ema": ema, "extra": Payload()}, path)
    with pytest.raises(ValueError, match=r"holds a pickled .*_record.*refusing to unpickle"):
        load_official_mar(path, "mar_base", **TINY)
    assert calls == []


def _save(path, obj):
    torch.save(obj, path)
    return path


@pytest.mark.parametrize(
    "case, kwargs, match",
    [
        ("missing", {}, r"mar_ckpt=.*no such file"),
        ("corrupt", {}, r"mar_ckpt=.*corrupt or not a torch checkpoint"),
        ("truncated", {}, r"mar_ckpt=.*corrupt or not a torch checkpoint"),
        ("tensor", {}, r"holds a Tensor, expected the official checkpoint dict"),
        ("no_ema", {}, r"entry 'model_ema' is missing.*use_ema=False would load its 'model' weights"),
        ("ema_none", {}, r"entry 'model_ema' is None"),
        ("no_model", {"use_ema": False}, r"entry 'model' is missing.*use_ema=True would load"),
        ("not_tensor", {}, r"model_ema\['mask_token'\] is a str, not a tensor"),
        ("drop_key", {}, r"lacks 'diffloss.net.final_layer.linear.bias'; check model='mar_base'"),
        ("extra_key", {}, r"has unexpected 'decoder_blocks.1.norm1.weight'; check model='mar_base'"),
    ],
)
def test_file_errors(tmp_path, ckpt, case, kwargs, match):
    good, raw, ema = ckpt
    path = tmp_path / f"{case}.pth"
    if case == "corrupt":
        path.write_bytes(b"\x00not a checkpoint" * 10)
    elif case == "truncated":
        path.write_bytes(good.read_bytes()[:1000])
    elif case == "tensor":
        _save(path, torch.zeros(3))
    elif case == "no_ema":
        _save(path, {"model": raw})
    elif case == "ema_none":
        _save(path, {"model": raw, "model_ema": None})
    elif case == "no_model":
        _save(path, {"model_ema": ema})
    elif case == "not_tensor":
        _save(path, {"model": raw, "model_ema": {**ema, "mask_token": "x"}})
    elif case == "drop_key":
        _save(path, {"model": raw, "model_ema": {k: v for k, v in ema.items() if not k.endswith("linear.bias")}})
    elif case == "extra_key":
        _save(path, {"model": raw, "model_ema": {**ema, "decoder_blocks.1.norm1.weight": torch.ones(32)}})
    with pytest.raises(ValueError, match=match):
        load_official_mar(path, "mar_base", **{**TINY, **kwargs})


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            {"img_size": 16},
            r"'encoder_pos_embed_learned' has shape \(1, 18, 32\) in the checkpoint but \(1, 66, 32\) "
            r"in the model.*check img_size / vae_stride \(the token grid\) and buffer_size",
        ),
        (
            {"vae_stride": 4},
            r"'encoder_pos_embed_learned' has shape \(1, 18, 32\).*\(1, 6, 32\).*img_size / vae_stride",
        ),
        ({"buffer_size": 4}, r"'encoder_pos_embed_learned'.*\(1, 20, 32\).*buffer_size"),
        (
            {"class_num": 1000},
            r"'class_emb.weight' has shape \(10, 32\) in the checkpoint but \(1000, 32\).*"
            r"check class_num \(the checkpoint has 10 classes\)",
        ),
        ({"vae_embed_dim": 16}, r"'z_proj.weight' has shape \(32, 4\).*\(32, 16\).*check vae_embed_dim"),
        (
            {"diffloss_w": 64},
            r"'diffloss.net.time_embed.mlp.0.weight' has shape \(32, 256\) in the checkpoint but "
            r"\(64, 256\).*keys differ\); check diffloss_w",
        ),
        ({"diffloss_d": 2}, r"lacks 'diffloss.net.res_blocks.1.in_ln.weight'.*check diffloss_d"),
        ({"encoder_depth": 2}, r"lacks 'encoder_blocks.1.norm1.weight'.*check model='mar_base'"),
        ({"encoder_embed_dim": 64}, r"'fake_latent' has shape \(1, 32\).*\(1, 64\).*check model='mar_base'"),
    ],
)
def test_mismatch_errors_name_key_shapes_and_knob(ckpt, overrides, match):
    path, _, _ = ckpt
    with pytest.raises(ValueError, match=match):
        load_official_mar(path, "mar_base", **{**TINY, **overrides})


@pytest.mark.parametrize(
    "model, overrides, match",
    [
        ("mar_tiny", {}, r"model='mar_tiny': unknown MAR preset"),
        ("mar_base", {"patch_size": 2}, r"patch_size=2: only patch_size=1"),
        ("mar_base", {"img_size": 9}, r"img_size=9 must be a multiple of vae_stride=2"),
        ("mar_base", {"depth": 3}, r"overrides \['depth'\] are not MAR fields"),
        ("mar_base", {"seq_h": 3}, r"overrides \['seq_h'\] are derived here"),
    ],
)
def test_argument_errors(ckpt, model, overrides, match):
    path, _, _ = ckpt
    with pytest.raises(ValueError, match=match):
        load_official_mar(path, model, **{**TINY, **overrides})


# ----------------------------------------------------------------------------- pipeline


@pytest.fixture
def files(tmp_path):
    target, draft, vae = tmp_path / "target.pth", tmp_path / "draft.pth", tmp_path / "kl.ckpt"
    _official_checkpoint(target, seed=0)
    _official_checkpoint(draft, seed=1, encoder_depth=2)
    torch.manual_seed(2)
    torch.save({"model": AutoencoderKL(**TINY_VAE, resolution=8, embed_dim=4).state_dict()}, vae)
    return target, draft, vae


def test_pipeline_generates_plain_and_speculative(files):
    target, draft, vae = files
    kw = dict(model="mar_base", vae_config=TINY_VAE, **TINY)
    pipe = SpeculativeContinuousARPipeline.from_official(target, vae, **kw)
    assert pipe.vae.config.scale_factor == 0.2325 and pipe.draft_transformer is None
    out = pipe([1, 7], num_ar_steps=3, output_type="pt", generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (2, 3, 8, 8) and torch.isfinite(out.images).all()

    pipe = SpeculativeContinuousARPipeline.from_official(target, vae, draft_ckpt=draft, draft_model="mar_base",
                                                         draft_kw={"encoder_depth": 2}, **kw)  # fmt: skip
    assert pipe.draft_transformer.config.encoder_depth == 2
    out = pipe([1, 7], num_ar_steps=4, acceptance="continuous", num_draft_tokens=2, prefill_ratio=0.25,
               guidance_scale=2.0, output_type="pt", generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert out.images.shape == (2, 3, 8, 8) and torch.isfinite(out.images).all()
    assert sum(out.stats.drafted_tokens) > 0


def test_pipeline_refuses_a_vae_of_another_stride(files):
    target, _, vae = files
    with pytest.raises(ValueError, match=r"vae_ckpt=.*downsamples by 2, but vae_stride=4"):
        SpeculativeContinuousARPipeline.from_official(target, vae, model="mar_base", vae_config=TINY_VAE,
                                                      **{**TINY, "img_size": 16, "vae_stride": 4})  # fmt: skip


# ----------------------------------------------------------------------------- official presets (meta device)

# Derived by reading LTH14/mar models/mar.py + models/diffloss.py (fe470ac) with timm's ViT `Block` (qkv_bias=True):
# 16 non-block tensors + 12 per encoder/decoder block + 12 head tensors + 8 per head residual block (no buffers).
# Head sizes: README evaluation commands (--diffloss_d/--diffloss_w); #params as the README table (208M/479M/943M).
OFFICIAL = {
    "mar_base": (364, 208e6, {
        "encoder_pos_embed_learned": (1, 256 + 64, 768),
        "decoder_pos_embed_learned": (1, 256 + 64, 768),
        "diffusion_pos_embed_learned": (1, 256, 768),
        "fake_latent": (1, 768),
        "mask_token": (1, 1, 768),
        "class_emb.weight": (1000, 768),
        "z_proj.weight": (768, 16),
        "encoder_blocks.11.attn.qkv.weight": (2304, 768),
        "decoder_blocks.11.mlp.fc1.weight": (3072, 768),
        "decoder_embed.weight": (768, 768),
        "diffloss.net.time_embed.mlp.0.weight": (1024, 256),
        "diffloss.net.cond_embed.weight": (1024, 768),
        "diffloss.net.input_proj.weight": (1024, 16),
        "diffloss.net.res_blocks.5.adaLN_modulation.1.weight": (3072, 1024),
        "diffloss.net.final_layer.adaLN_modulation.1.weight": (2048, 1024),
        "diffloss.net.final_layer.linear.weight": (32, 1024),
    }, ["encoder_blocks.12.norm1.weight", "diffloss.net.res_blocks.6.in_ln.weight",
        "diffloss.net.final_layer.norm_final.weight"]),
    "mar_large": (476, 479e6, {
        "encoder_pos_embed_learned": (1, 320, 1024),
        "encoder_blocks.15.attn.proj.weight": (1024, 1024),
        "decoder_blocks.15.mlp.fc2.weight": (1024, 4096),
        "diffloss.net.cond_embed.weight": (1280, 1024),
        "diffloss.net.res_blocks.7.mlp.2.weight": (1280, 1280),
        "diffloss.net.res_blocks.7.adaLN_modulation.1.bias": (3840,),
        "diffloss.net.final_layer.linear.weight": (32, 1280),
    }, ["encoder_blocks.16.norm1.weight", "diffloss.net.res_blocks.8.in_ln.weight"]),
    "mar_huge": (604, 943e6, {
        "encoder_pos_embed_learned": (1, 320, 1280),
        "encoder_blocks.19.attn.qkv.weight": (3840, 1280),
        "decoder_blocks.19.mlp.fc1.weight": (5120, 1280),
        "diffloss.net.cond_embed.weight": (1536, 1280),
        "diffloss.net.res_blocks.11.adaLN_modulation.1.weight": (4608, 1536),
        "diffloss.net.final_layer.linear.weight": (32, 1536),
    }, ["encoder_blocks.20.norm1.weight", "diffloss.net.res_blocks.12.in_ln.weight"]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_official_preset_key_names_and_shapes(name):
    count, params, shapes, absent = OFFICIAL[name]
    with torch.device("meta"):
        state = build_official_mar(name).state_dict()
    assert len(state) == count
    assert abs(sum(v.numel() for v in state.values()) - params) < 0.005 * params
    assert {k: tuple(state[k].shape) for k in shapes} == shapes
    assert not set(absent) & set(state)
    # every tensor under the official module names: timm Block children and DiffLoss.net children only
    blocks = {k.split(".", 2)[2] for k in state if k.startswith(("encoder_blocks.", "decoder_blocks."))}
    assert blocks == {f"{m}.{p}" for m in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
                      for p in ("weight", "bias")}  # fmt: skip


@pytest.mark.parametrize("argument", ["mar_ckpt", "vae_ckpt", "draft_ckpt"])
@pytest.mark.parametrize("bad", ["missing", "folder"])
def test_every_path_is_checked_before_any_model_is_built(files, tmp_path, monkeypatch, argument, bad):
    """Issue 31: a wrong path is refused, naming the argument, before MAR (4 GB for MAR-huge) is built."""
    import mmspec.models.mar.checkpoints as mc

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the paths were checked")

    monkeypatch.setattr(mc, "build_official_mar", built)
    monkeypatch.setattr(mc.MAR, "from_preset", built)
    target, draft, vae = files
    paths = dict(mar_ckpt=target, vae_ckpt=vae, draft_ckpt=draft)
    paths[argument] = tmp_path / "no-such.pth" if bad == "missing" else tmp_path
    match = "no such file" if bad == "missing" else "is a folder"
    with pytest.raises(ValueError, match=rf"^{argument}=.*{match}"):
        SpeculativeContinuousARPipeline.from_official(paths["mar_ckpt"], paths["vae_ckpt"], model="mar_base",
                                                      draft_ckpt=paths["draft_ckpt"], draft_model="mar_base", **TINY)  # fmt: skip


def test_load_official_mar_checks_the_path_before_building(tmp_path, monkeypatch):
    import mmspec.models.mar.checkpoints as mc

    monkeypatch.setattr(mc, "build_official_mar", lambda *a, **k: pytest.fail("built before the path check"))
    with pytest.raises(ValueError, match=r"mar_ckpt=.*no such file"):
        load_official_mar(tmp_path / "missing.pth", "mar_huge")
