"""Type and range rules for the config fields of every zoo model class, in one place and without torch.

Each zoo class checks its constructor arguments against `CONFIG_FIELDS[class_name]` (`check_fields`) before it
builds anything, and `mmspec.models.read_config` applies the same rules to a folder's `config.json` without loading
weights (the CLI reads the zoo's configs this way). A failure is a `ValueError` naming the class and the field:

    >>> check_fields("LlamaGenGPT", {"dim": "abc"})
    ValueError: LlamaGenGPT field dim must be an int >= 1, got 'abc' (str)

Cross-field rules (`dim` divisible by `n_head`, `block_size` a perfect square, ...) stay in the constructors; how a
field must agree with the weights is checked by `mmspec.models.load` (every weight present with the config's shape).
"""

import math
import numbers


__all__ = ["CONFIG_FIELDS", "check_fields"]


def _show(value):
    return f"{value!r} ({type(value).__name__})"


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Int:
    """An int (not a bool) `>= low`."""

    def __init__(self, low=None):
        self.low = low

    def describe(self):
        return "an int" + ("" if self.low is None else f" >= {self.low}")

    def ok(self, value):
        return _is_int(value) and (self.low is None or value >= self.low)


class Float:
    """A finite real number (ints allowed, not bools) in `[low, high]` (`low_open`: `> low`)."""

    def __init__(self, low=None, high=None, low_open=False):
        self.low, self.high, self.low_open = low, high, low_open

    def describe(self):
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {self.low}")
        if self.high is not None:
            bounds.append(f"<= {self.high}")
        return "a finite number" + (" " + " and ".join(bounds) if bounds else "")

    def ok(self, value):
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high


class Bool:
    def describe(self):
        return "true or false"

    def ok(self, value):
        return isinstance(value, bool)


class Choice:
    def __init__(self, *values):
        self.values = values

    def describe(self):
        return f"one of {self.values}"

    def ok(self, value):
        return isinstance(value, str) and value in self.values


class IntList:
    """A list/tuple of ints `>= low` with `length` entries (or at least one when `length` is None)."""

    def __init__(self, low=1, length=None, allow_empty=False):
        self.low, self.length, self.allow_empty = low, length, allow_empty

    def describe(self):
        if self.length is None:
            return f"a {'' if self.allow_empty else 'non-empty '}list of ints >= {self.low}"
        return f"a list of {self.length} ints >= {self.low}"

    def ok(self, value):
        if not isinstance(value, (list, tuple)) or not (value or self.allow_empty):
            return False
        if self.length is not None and len(value) != self.length:
            return False
        return all(_is_int(v) and v >= self.low for v in value)


class Optional:
    """`rule` or None."""

    def __init__(self, rule):
        self.rule = rule

    def describe(self):
        return self.rule.describe() + " or null"

    def ok(self, value):
        return value is None or self.rule.ok(value)


class Sections:
    """Diffusion respacing: a positive int or IDDPM's comma-separated section counts (``"100"``, ``"10,20"``)."""

    def ok(self, value):
        if _is_int(value):
            return value >= 1
        return isinstance(value, str) and all(p.strip().isdigit() and int(p) >= 1 for p in value.split(","))

    def describe(self):
        return "a positive int or comma-separated positive ints (e.g. '100')"


_PROB = Float(0.0, 1.0)
_POS_INT = Int(1)
_GPT_COMMON = {
    "vocab_size": _POS_INT,
    "dim": _POS_INT,
    "n_head": _POS_INT,
    "n_kv_head": Optional(_POS_INT),
    "multiple_of": _POS_INT,
    "ffn_dim_multiplier": Optional(Float(0.0, low_open=True)),
    "rope_base": Float(0.0, low_open=True),
    "norm_eps": Float(0.0, low_open=True),
    "initializer_range": Float(0.0),
    "attn_dropout_p": _PROB,
    "resid_dropout_p": _PROB,
    "ffn_dropout_p": _PROB,
    "cls_token_num": _POS_INT,
    "block_size": _POS_INT,
}

# `_class_name` -> {constructor argument: rule}; every constructor argument of a zoo class has a rule
CONFIG_FIELDS = {
    "LlamaGenGPT": {
        **_GPT_COMMON,
        "n_layer": _POS_INT,
        "token_dropout_p": _PROB,
        "num_classes": _POS_INT,
        "caption_dim": _POS_INT,
        "class_dropout_prob": _PROB,
        "model_type": Choice("c2i", "t2i"),
    },
    "EagleHead": {**_GPT_COMMON, "fc_bias": Bool()},
    "Eagle3Head": {
        **{
            k: _POS_INT
            for k in (
                "vocab_size",
                "hidden_size",
                "target_hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
            )
        },
        "rope_theta": Float(0.0, low_open=True),
        "rms_norm_eps": Float(0.0, low_open=True),
        "initializer_range": Float(0.0),
        "draft_vocab_size": Int(0),
        "aux_layers": IntList(0),
        "image_inputs": Choice("placeholder", "embeds"),
        "positions": Choice("slot", "mrope"),
        "mrope_section": IntList(1, allow_empty=True),
        "mrope_interleaved": Bool(),
    },
    "LlamaGenVQ": {
        "in_channels": _POS_INT,
        "ch": _POS_INT,
        "ch_mult": IntList(1),
        "num_res_blocks": _POS_INT,
        "z_channels": _POS_INT,
        "codebook_size": _POS_INT,
        "codebook_embed_dim": _POS_INT,
        "codebook_l2_norm": Bool(),
        "commit_loss_beta": Float(0.0),
        "entropy_loss_ratio": Float(0.0),
        "dropout": _PROB,
        "norm_num_groups": _POS_INT,
        "sample_size": Optional(_POS_INT),
    },
    "MNISTClassifier": {
        "in_channels": _POS_INT,
        "num_classes": _POS_INT,
        "channels": IntList(1, length=2),
        "feature_dim": _POS_INT,
        "dropout": _PROB,
        "image_size": Int(4),
    },
    "AutoencoderKL": {
        **{
            k: _POS_INT
            for k in ("in_channels", "out_channels", "ch", "num_res_blocks", "resolution", "embed_dim", "num_groups")
        },  # fmt: skip
        "ch_mult": IntList(1),
        "attn_resolutions": IntList(1, allow_empty=True),
        "decoder_attn_resolutions": IntList(1, allow_empty=True),
        "use_variational": Bool(),
        "scale_factor": Float(0.0, low_open=True),
    },
    "MAR": {
        **{
            k: _POS_INT
            for k in (
                "seq_h",
                "seq_w",
                "token_embed_dim",
                "encoder_embed_dim",
                "encoder_depth",
                "encoder_num_heads",
                "decoder_embed_dim",
                "decoder_depth",
                "decoder_num_heads",
                "class_num",
                "diffloss_d",
                "diffloss_w",
                "diffusion_batch_mul",
            )
        },  # fmt: skip
        "buffer_size": Int(0),
        "mlp_ratio": Float(0.0, low_open=True),
        "num_sampling_steps": Sections(),
        "label_drop_prob": _PROB,
        "mask_ratio_min": _PROB,
        "clip_denoised": Optional(Float(0.0, low_open=True)),
    },
}


def check_fields(class_name, values):
    """Raise `ValueError` naming the first field of `values` (a dict, or a constructor's `locals()`) that breaks its
    rule in `CONFIG_FIELDS[class_name]`; keys without a rule are ignored here (`read_config` refuses them)."""
    rules = CONFIG_FIELDS[class_name]
    for name, rule in rules.items():
        if name in values and not rule.ok(values[name]):
            raise ValueError(f"{class_name} field {name} must be {rule.describe()}, got {_show(values[name])}")
