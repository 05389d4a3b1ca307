"""The method registry: which acceptance rules, drafters and knobs exist, defined once.

Read by the pipelines' input checks, the CLI (`--acceptance` / `--drafter` choices, knob flags), the benchmarks
(named presets) and the demo. A new rule or drafter is one entry here plus its own file.

* `ACCEPTANCES`: name -> `Acceptance` (paper, lossless or not, which drafters it runs on, its default drafter order,
  which pipelines accept it: `PIPELINES`); `acceptance_names(pipeline)` lists one pipeline's.
* `DRAFTERS`: name -> `DrafterSpec` (the pipeline component it needs, if any).
* `KNOBS`: pipeline keyword -> `Knob` (type, default, range check, which methods read it). Rule knobs take their
  defaults from the rule classes of `mmspec.verify` (the one place they are defined); a knob whose default depends on
  the method (`tree_depth`) holds it in `Knob.auto` / `Knob.auto_for`.
* `MethodSettings`: one call's method (acceptance, drafter and every knob), checked and defaulted once by
  `resolve_method`; the pipelines hand it to the drafter and the rule, which read it as it is.
* `VLM_LIMITS`: upper bounds of the VLM pipeline's size knobs (checked by the pipeline and by every CLI flag); the
  shared knobs (`num_draft_tokens`, `tree_nodes`, `tree_depth`, `tree_top_k`) have the same bounds in `KNOBS`, `IMAGE_LIMITS`
  bound the image-only ones (`jacobi_window`, `relaxation_top_k`, `group_size`).
* `SAMPLING_LIMITS`: the bounds of the sampling knobs: `top_k`'s upper bound (the pipelines also refuse `top_k` above the
  loaded model's vocabulary; the CLI reads the zoo's vocabulary from its config.json before anything loads), the
  temperature range (0 = greedy) and the largest guidance scale (defined with the rules, in `mmspec.sampling`).
* `CONTINUOUS_LIMITS`: the bounds of the MAR pipeline's real-valued knobs (`pipelines.continuous.LIMITS`).
* `DRAFT_LENGTHS`: the draft-length policies (`draft_length=`, `mmspec.drafters.lengths`), with
  `DEFAULT_DRAFT_CONFIDENCE` (the `"confidence"` policy's stop) and `DRAFT_STEP_COSTS` (the `"cost"` policy's draft
  step cost per drafter, when `draft_step_cost` is unset).
* `PRESETS`: the named method settings the benchmarks and the demo offer (`plain`, `exact-eagle`, ...).
* `CONTINUOUS_DEFAULTS`: the defaults of the MAR pipeline's knobs (`pipelines.continuous.DEFAULTS`).
"""

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mmspec.sampling import GUIDANCE_MAX, TEMPERATURE_RANGE, TOP_K_MAX
from mmspec.verify import RESAMPLES, RULE_CLASSES, Exact, Grouped, Lantern


__all__ = [
    "CostTable",
    "ACCEPTANCES",
    "DRAFTERS",
    "EAGLE_HEADS",
    "VISION_POLICIES",
    "KNOBS",
    "PIPELINES",
    "PRESETS",
    "TREE_DRAFTERS",
    "COMPILE_BACKENDS",
    "COMPILE_RNG",
    "COMPILE_RNGS",
    "COMPILE_VERIFY",
    "DEFAULT_DRAFT_CONFIDENCE",
    "DRAFT_LENGTHS",
    "DRAFT_LENGTH_KNOBS",
    "DRAFT_STEP_COSTS",
    "COMPILE_MODES",
    "CONTINUOUS_DEFAULTS",
    "CONTINUOUS_LIMITS",
    "IMAGE_LIMITS",
    "SAMPLING_LIMITS",
    "VLM_LIMITS",
    "Acceptance",
    "DrafterSpec",
    "Knob",
    "MethodSettings",
    "acceptance_names",
    "check_compile",
    "check_knob",
    "check_knobs",
    "resolve_drafter",
    "resolve_method",
]


@dataclass(frozen=True)
class Acceptance:
    """An `acceptance=` choice of the pipelines."""

    name: str
    summary: str
    lossless: bool
    drafters: tuple[str, ...]  # drafters it can verify; the first loaded one is the default
    sampling_only: bool = False  # undefined under greedy decoding
    pipelines: tuple[str, ...] = ("image",)  # the `PIPELINES` that accept it


@dataclass(frozen=True)
class DrafterSpec:
    """A `drafter=` choice: `component` is the pipeline component it needs (None: the target drafts itself);
    `pipelines` the pipeline kinds (`PIPELINES`) that run it."""

    name: str
    summary: str
    component: str | None
    pipelines: tuple[str, ...] = ("image", "vlm", "continuous")


# the pipeline kinds: "image" (the token-image pipelines: LlamaGen, Janus), "vlm", "continuous" (MAR)
PIPELINES = ("image", "vlm", "continuous")

ACCEPTANCES = {
    a.name: a
    for a in (
        Acceptance("none", "plain AR sampling (the baseline)", True, (), pipelines=PIPELINES),
        Acceptance(
            Exact.name,
            "speculative sampling (Leviathan et al. 2023; EAGLE-2 trees)",
            True,
            ("eagle", "model", "jacobi"),
            pipelines=("image", "vlm"),
        ),  # fmt: skip
        Acceptance(
            Lantern.name,
            "LANTERN latent-proximity acceptance (Jang et al. 2024; LANTERN++)",
            False,
            ("eagle", "model", "jacobi"),
        ),  # fmt: skip
        Acceptance(
            Grouped.name,
            "GSD grouped acceptance (So et al. 2025)",
            False,
            ("jacobi", "eagle", "model"),
            sampling_only=True,
        ),  # fmt: skip
        Acceptance("jacobi", "SJD (Teng et al. 2024), optional SCD coupling", True, ("jacobi",)),
        Acceptance(
            "greedy",
            "argmax matching of greedy decoding (do_sample=False)",
            True,
            ("eagle", "model"),
            pipelines=("vlm",),
        ),  # fmt: skip
        Acceptance(
            "continuous",
            "CSpD continuous speculative decoding (Wang et al. 2024)",
            True,
            (),
            pipelines=("continuous",),
        ),  # fmt: skip
    )
}


def acceptance_names(pipeline: str = "image") -> tuple[str, ...]:
    """The `acceptance=` choices of one pipeline kind (`PIPELINES`), in registry order."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    return tuple(name for name, spec in ACCEPTANCES.items() if pipeline in spec.pipelines)


DRAFTERS = {
    d.name: d
    for d in (
        DrafterSpec("model", "a small AR model of the same family drafts a chain", "draft_model"),
        DrafterSpec("eagle", "an EAGLE head drafts a sampled chain or an EAGLE-2 tree", "eagle_head"),
        DrafterSpec("jacobi", "the target drafts for itself (Jacobi window)", None, pipelines=("image",)),
    )
}


class CostTable(tuple):
    """A knob kind: verification costs by width, `(c(1), c(2), ..., c(n))` (`c(m)`: a target forward over `m` tokens
    of one row, in one-token forwards; `c(1)` is 1), from a sequence of reals or a comma list ("1,1.54,1.73")."""

    def __new__(cls, value):
        if isinstance(value, str):
            try:
                value = [float(x) for x in value.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"a comma list of numbers, got {value!r}") from None
        if isinstance(value, (str, bytes)) or not all(
            isinstance(x, numbers.Real) and not isinstance(x, bool) for x in value
        ):
            raise TypeError(f"a sequence of numbers, got {value!r}")
        return super().__new__(cls, (float(x) for x in value))


@dataclass(frozen=True)
class Knob:
    """A method keyword of the pipelines: `kind` is int, float, bool or a tuple of allowed strings."""

    name: str
    kind: Any
    default: Any
    help: str
    check: Callable[[Any], bool] | None = None  # range check on a well-typed value
    bound: str = ""  # the range, for messages
    optional: bool = False  # None allowed: "auto", the value `resolve_method` gives it
    used_by: tuple[str, ...] = ()  # acceptances or drafters that read it (empty: all)
    auto: Any = None  # an optional knob's value when unset (None: stays None)
    auto_for: dict = field(default_factory=dict)  # acceptance -> its own `auto`


# Upper bounds of the VLM pipeline's size knobs: each costs memory and time linearly (a tree's target forward scores
# every node), far past any useful setting (EAGLE-2: depth 6, top-k 10, 60 nodes), so a typo is refused instead of
# allocating gigabytes. `max_new_tokens` is also bounded by the model's context (prompt + new tokens).
# the VLM's EAGLE-head kinds: "eagle" (text features only), "eagle3" (an EAGLE-3 head on the target's low / middle /
# high hidden states, `mmspec.models.hf.eagle3`, the format vLLM and SGLang serve) and the vision-aware policies of
# `mmspec.drafters.vision_eagle.VisionEagleHead`; the zoo's head of kind `k` is the folder `mnist-vlm-<k>`
# (`SpeculativeVLMPipeline.from_zoo(eagle=k)`, `mmspec vlm --eagle-head k`, `bench vlm` rows, `train vlm-vision`)
VISION_POLICIES = ("vispec", "specvlm", "msd")
EAGLE_HEADS = ("eagle", "eagle3", *VISION_POLICIES)

# Captured forwards (`pipe.enable_compile(mode=None, backend=None)`, `mmspec.decoding.compiled`): the
# `torch.compile` modes and backends it accepts. mode None: "reduce-overhead" (CUDA graphs) on CUDA, plain inductor
# elsewhere; backend None: inductor. "eager" / "aot_eager" trace and count graphs without generating code (tests).
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = (None, "inductor", "cudagraphs", "eager", "aot_eager")
# `enable_compile(verify=...)`'s default: off, the loop's verification and sampling stay eager (bitwise the eager
# random stream). On: a round's verification (chains under exact / relaxed / grouped, sampled or greedy; Jacobi windows;
# EAGLE-2 trees; SJD-PAC's Jacobi tree) or plain AR's draw, and its emit, run as one captured graph on uniforms drawn
# eagerly first, one draw per generator (`mmspec.decoding.captured_verify`): the same law, another random stream; and
# a drafter's (LlamaGen's, a VLM's) or SJD-PAC's whole round of drafting and a tree's path commit, each one graph
# (`mmspec.decoding.captured_draft`).
COMPILE_VERIFY = False
# `enable_compile(rng=...)`: where a captured verification's uniforms come from. "generator" (the default): drawn
# eagerly before the graph from the call's generator(s), one draw per generator a round; "philox": inside the graph,
# Philox4x32-10 counters (`mmspec.philox`) under one key per row drawn from the row's generator once per call, the
# round's index the counter: no draw outside the graph (a per-row generator list costs no launch per row), the same
# law, another random stream.
COMPILE_RNGS = ("generator", "philox")
COMPILE_RNG = "generator"


def check_compile(mode=None, backend=None, verify=COMPILE_VERIFY, rng=COMPILE_RNG):
    """Raise ValueError naming the argument unless `mode` is one of `COMPILE_MODES` and `backend` one of
    `COMPILE_BACKENDS` (a mode other than None/"default" needs the inductor backend) and `rng` one of
    `COMPILE_RNGS` (only with `verify`: eager verification draws from the generators); TypeError unless `verify` is
    a bool."""
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, got {verify!r} ({type(verify).__name__})")
    if rng not in COMPILE_RNGS:
        raise ValueError(f"rng must be one of {COMPILE_RNGS}, got {rng!r}")
    if rng != COMPILE_RNG and not verify:
        raise ValueError(f"rng={rng!r} draws a captured verification's uniforms; it needs verify=True")
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}")
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
    if mode not in (None, "default") and backend not in (None, "inductor"):
        raise ValueError(f"mode={mode!r} is an inductor mode; it needs backend=None or 'inductor', got {backend!r}")


VLM_LIMITS = {"num_draft_tokens": 256, "tree_nodes": 256, "tree_depth": 32, "tree_top_k": 32, "max_new_tokens": 32768}

# the drafters that grow an EAGLE-2 tree (of `tree_nodes`) at `tree_top_k > 1`, per pipeline kind (the image
# pipelines' draft model always drafts a chain)
TREE_DRAFTERS = {"image": ("eagle",), "vlm": ("eagle", "model")}

# Upper bounds of the image-side knobs that cost memory or time: the Jacobi window scores window x vocabulary
# logits per forward (1024 = every token of a 512 px LlamaGen image), LANTERN's neighbourhood holds k neighbours of
# every codebook entry, GSD's group is a rank window over the vocabulary.
IMAGE_LIMITS = {
    "jacobi_window": 1024,
    "relaxation_top_k": 4096,
    "group_size": 1024,
    "jacobi_tree_width": 16,  # the SJD-PAC tree has width ** (depth - 1) nodes at its last branching level
    "jacobi_tree_depth": 8,
    "num_images_per_prompt": 4096,  # Janus: one batch, memory grows linearly
}


# `top_k` keeps the k most likely tokens: past the largest vocabulary in use (Gemma: 262k tokens) it is a typo; the
# pipelines refuse a `top_k` above their model's vocabulary before the first forward, the CLI before loading.
SAMPLING_LIMITS = {"top_k": TOP_K_MAX, "temperature": TEMPERATURE_RANGE, "guidance_scale": GUIDANCE_MAX}

# Bounds of the continuous (MAR) pipeline's knobs, read by `pipelines.continuous` (as `LIMITS`) and by
# `mmspec bench continuous`: guidance_scale and temperature scale the diffusion head's epsilon and noise; far past
# any useful setting (MAR sweeps CFG 1-10 and temperature 0.9-1.2) a token is noise or overflows float32, so they
# are refused up front rather than returned as NaN / garbage images. max_residual_tries bounds a loop.
CONTINUOUS_LIMITS = {"guidance_scale": 100.0, "temperature": 10.0, "max_residual_tries": 10_000}
# Defaults of the continuous (MAR) pipeline's knobs, read by `pipelines.continuous` (its `__call__` keywords and
# `mmspec.decoding.masked_params.MaskedParams`) and by `mmspec bench continuous`'s flags.
CONTINUOUS_DEFAULTS = {
    "guidance_scale": 3.0,
    "temperature": 1.0,
    "num_ar_steps": 64,
    "num_draft_tokens": 4,  # CSpD block: AR steps per draft round (the release's num_draft)
    "prefill_ratio": 0.15,
    "trajectory_alignment": True,
    "verify_mode": "block",
    "cfg_schedule_type": "linear",
    "max_residual_tries": 100,
}


# Draft-length policies (`draft_length=`; `mmspec.drafters.lengths`, one file each): how many tokens each row of a
# draft-model or EAGLE chain drafts per round, within [1, K_max] (K_max = `num_draft_tokens` / `tree_depth`).
# "fixed": K_max every round (the default); "heuristic": transformers' schedule (+2 after a fully accepted round, -1
# otherwise); "confidence": a chain stops after a draft token below `draft_confidence`; "cost": the K maximising
# expected tokens per unit of cost from a running acceptance estimate (`draft_step_cost`, `verify_token_cost`);
# "batch-cost": one K for the batch, priced at the batch's cost (a padded chain costs every row the widest K);
# "calibrated": each row stops inside the round where its expected tokens per unit of cost peak, pricing every draft
# by its raw probability calibrated online against what the target accepted; "batch-calibrated": that stop decided
# once for the whole batch, priced at the batch's cost.
DRAFT_LENGTHS = ("fixed", "heuristic", "confidence", "cost", "batch-cost", "calibrated", "batch-calibrated")
COST_POLICIES = ("cost", "batch-cost", "calibrated", "batch-calibrated")  # the policies that read the cost knobs
TABLE_POLICIES = ("cost", "calibrated", "batch-calibrated")  # the policies that read `verify_costs`
DRAFT_LENGTH_KNOBS = ("draft_length", "draft_confidence", "draft_step_cost", "verify_token_cost", "verify_costs")
DEFAULT_DRAFT_CONFIDENCE = 0.4  # transformers' `assistant_confidence_threshold` default
# a draft forward's cost in one-token target forwards, per drafter, when `draft_step_cost` is unset (measured on the
# zoo's VLM at batch 1, 1 thread, `bench vlm --time-phases`: the 4-layer draft LM with SmolLM2's output head 0.24,
# 0.17 with FR-Spec's vocabulary; the one-layer EAGLE head 0.08)
DRAFT_STEP_COSTS = {"model": 0.25, "eagle": 0.08}
# each further token of a verification forward, likewise: 5 tokens cost 2.5x one on the AMD EPYC host (0.37 per
# token), 7 tokens 2.85x (0.31); 4 tokens 1.2-1.8x on the Intel hosts (0.07-0.27)
DEFAULT_VERIFY_TOKEN_COST = 0.3
MAX_COST = 100.0  # the cost knobs' upper bound: past it a draft or a verified token costs more than any use
# `verify_costs`: a measured cost per verification width instead of the straight line `1 + v (m - 1)` (a CPU's
# small-matrix kernels make it anything but straight: 1 / 1.54 / 1.73 / 2.64 / 2.38 at widths 1-5 for the zoo's VLM
# target, AMD EPYC, 1 thread). At least widths 1 and 2, at most `MAX_COST_WIDTHS`; wider chains extend its last step.
MAX_COST_WIDTHS = 64


# The branching part of an SJD-PAC tree (width + width**2 + ... + width**(depth-1) nodes) is bounded like the
# other size knobs: every node is a token of the target forward.
MAX_JACOBI_TREE_NODES = 1024


def _rule_default(rule, name):
    return RULE_CLASSES[rule].__dataclass_fields__[name].default


def _int_range(low, high):
    """(check, bound) of a Knob: an int in [low, high]."""
    return (lambda v: low <= v <= high), f"in [{low}, {high}]"


def _knobs():
    return {
        k.name: k
        for k in (
            Knob(
                "num_draft_tokens",
                int,
                None,
                "the draft model's chain length K: draft tokens per round (default 4)",
                *_int_range(1, VLM_LIMITS["num_draft_tokens"]),
                optional=True,
                used_by=("model",),
                auto=4,
            ),
            Knob(
                "tree_nodes",
                int,
                24,
                "EAGLE-2 tree (tree_top_k > 1): draft nodes kept per round",
                *_int_range(1, VLM_LIMITS["tree_nodes"]),
                used_by=("eagle",),
            ),
            Knob(
                "tree_depth",
                int,
                None,
                "EAGLE chain length / tree depth (default 5; 7 for relaxed, grouped)",
                *_int_range(1, VLM_LIMITS["tree_depth"]),
                optional=True,
                used_by=("eagle",),
                auto=5,
                auto_for={Lantern.name: 7, Grouped.name: 7},  # looser acceptance keeps longer chains
            ),
            Knob(
                "tree_top_k",
                int,
                1,
                "EAGLE: 1 = sampled chain, > 1 = EAGLE-2 tree with top-k children",
                *_int_range(1, VLM_LIMITS["tree_top_k"]),
                used_by=("eagle",),
            ),
            Knob(
                "relaxation_top_k",
                int,
                16,
                "LANTERN neighbourhood size k (capped at V - 1)",
                *_int_range(0, IMAGE_LIMITS["relaxation_top_k"]),
                used_by=("relaxed",),
            ),
            Knob(
                "relaxation_delta",
                float,
                _rule_default("relaxed", "delta"),
                "LANTERN total-variation budget delta",
                lambda v: 0 <= v <= 1,
                "in [0, 1]",
                used_by=("relaxed",),
            ),
            Knob(
                "relaxation_lambda",
                float,
                None,
                "LANTERN++ multiplicative lambda (> 1; replaces delta)",
                lambda v: v > 1,
                "> 1",
                optional=True,
                used_by=("relaxed",),
            ),
            Knob(
                "group_size",
                int,
                _rule_default("grouped", "group_size"),
                "GSD group (rank window) size",
                *_int_range(1, IMAGE_LIMITS["group_size"]),
                used_by=("grouped",),
            ),
            Knob(
                "group_prob_threshold",
                float,
                _rule_default("grouped", "prob_threshold"),
                "GSD probability filter",
                lambda v: 0 <= v <= 1,
                "in [0, 1]",
                used_by=("grouped",),
            ),
            Knob(
                "group_dist_threshold",
                float,
                _rule_default("grouped", "dist_threshold"),
                "GSD squared codebook-distance filter",
                lambda v: v >= 0,
                ">= 0",
                used_by=("grouped",),
            ),
            Knob(
                "jacobi_window",
                int,
                16,
                "SJD window: draft tokens per forward",
                *_int_range(1, IMAGE_LIMITS["jacobi_window"]),
                used_by=("jacobi",),
            ),
            Knob("jacobi_init", ("repeat", "random"), "repeat", "SJD fresh-token initialisation", used_by=("jacobi",)),
            Knob("coupling", bool, True, "SCD maximal-coupling re-drafts (lossless)", used_by=("jacobi",)),
            Knob(
                "jacobi_tree_width",
                int,
                1,
                "SJD-PAC proactive drafting: children per node of the Jacobi tree (1 = a chain: SJD / SCD)",
                *_int_range(1, IMAGE_LIMITS["jacobi_tree_width"]),
                used_by=("jacobi",),
            ),
            Knob(
                "jacobi_tree_depth",
                int,
                3,
                "SJD-PAC tree depth, the pending token counted (<= jacobi_window + 1)",
                *_int_range(2, IMAGE_LIMITS["jacobi_tree_depth"]),
                used_by=("jacobi",),
            ),
            Knob(
                "draft_length",
                DRAFT_LENGTHS,
                "fixed",
                "draft-length policy of draft-model / EAGLE chains: fixed K, transformers' heuristic schedule, "
                "a confidence stop, the per-row cost model, one K per batch by the batch's cost, or a per-row stop "
                "priced by the draft's calibrated confidence (per row, or once for the batch)",
                used_by=("model", "eagle"),
            ),
            Knob(
                "draft_confidence",
                float,
                None,
                f"a chain stops after a draft token with a raw draft probability below this (default "
                f"{DEFAULT_DRAFT_CONFIDENCE} with draft_length='confidence'; given alone: that policy)",
                lambda v: 0 < v < 1,
                "in (0, 1)",
                optional=True,
                used_by=("model", "eagle"),
            ),
            Knob(
                "draft_step_cost",
                float,
                None,
                "the cost policies (cost, batch-cost, calibrated, batch-calibrated): one draft forward's cost in "
                "one-token target forwards (default "
                + ", ".join(f"{k} {v}" for k, v in DRAFT_STEP_COSTS.items())
                + ")",
                lambda v: 0 <= v <= MAX_COST,
                f"in [0, {MAX_COST:g}]",
                optional=True,
                used_by=("model", "eagle"),
            ),
            Knob(
                "verify_costs",
                CostTable,
                None,
                "draft_length='cost' / 'calibrated' / 'batch-calibrated': the measured cost of a verification forward "
                "by width, c(1)..c(n) in one-token target forwards (c(1) = 1; a comma list on the command line), "
                "instead of verify_token_cost's line; chains wider than the table extend its last step",
                lambda v: 2 <= len(v) <= MAX_COST_WIDTHS and v[0] == 1 and all(0 < x <= MAX_COST for x in v),
                f"2 to {MAX_COST_WIDTHS} widths, c(1) = 1, each in (0, {MAX_COST:g}]",
                optional=True,
                used_by=("model", "eagle"),
            ),
            Knob(
                "verify_token_cost",
                float,
                None,
                f"the cost policies: each further token of a verification forward (one row), in "
                f"one-token target forwards "
                f"(default {DEFAULT_VERIFY_TOKEN_COST})",
                lambda v: 0 <= v <= MAX_COST,
                f"in [0, {MAX_COST:g}]",
                optional=True,
                used_by=("model", "eagle"),
            ),
            Knob(
                "resample",
                tuple(RESAMPLES),
                "optimal",
                "residual after a rejection under relaxed rules",
                used_by=("relaxed", "grouped"),
            ),
        )
    }


KNOBS: dict[str, Knob] = _knobs()

PRESETS = {
    "plain": dict(acceptance="none"),
    "exact-draft": dict(acceptance="exact", drafter="model"),
    "exact-eagle": dict(acceptance="exact", drafter="eagle"),
    "exact-eagle-tree": dict(acceptance="exact", drafter="eagle", tree_nodes=24, tree_depth=5, tree_top_k=4),
    "relaxed": dict(acceptance="relaxed", drafter="eagle"),
    "grouped": dict(acceptance="grouped", drafter="jacobi"),
    "jacobi": dict(acceptance="jacobi"),
    "sjd": dict(acceptance="jacobi", coupling=False),  # plain SJD (Teng et al. 2024): drafts re-drawn independently
    "sjd-pac": dict(acceptance="jacobi", coupling=True, jacobi_tree_width=3, jacobi_tree_depth=2, jacobi_window=16),
    # SJD-PAC with its paper's defaults (Kang et al. 2026: branching K = 4, depth D = 3, window L = 64)
    "sjd-pac-wide": dict(
        acceptance="jacobi", coupling=True, jacobi_tree_width=4, jacobi_tree_depth=3, jacobi_window=64
    ),
    # adaptive draft lengths (`draft_length`): chains of at most 8, each row's K set per round
    "exact-draft-heuristic": dict(acceptance="exact", drafter="model", num_draft_tokens=8, draft_length="heuristic"),
    "exact-draft-cost": dict(acceptance="exact", drafter="model", num_draft_tokens=8, draft_length="cost"),
    "exact-eagle-heuristic": dict(acceptance="exact", drafter="eagle", tree_depth=8, draft_length="heuristic"),
    "exact-eagle-cost": dict(acceptance="exact", drafter="eagle", tree_depth=8, draft_length="cost"),
    "exact-draft-calibrated": dict(acceptance="exact", drafter="model", num_draft_tokens=8, draft_length="calibrated"),
    "exact-eagle-calibrated": dict(acceptance="exact", drafter="eagle", tree_depth=8, draft_length="calibrated"),
    "exact-draft-batch-calibrated": dict(
        acceptance="exact", drafter="model", num_draft_tokens=8, draft_length="batch-calibrated"
    ),
    "exact-eagle-batch-calibrated": dict(
        acceptance="exact", drafter="eagle", tree_depth=8, draft_length="batch-calibrated"
    ),
}


def _type_ok(kind, value):
    if isinstance(kind, tuple):
        return isinstance(value, str)
    if kind is CostTable:
        return isinstance(value, (tuple, list)) and all(
            isinstance(x, numbers.Real) and not isinstance(x, bool) for x in value
        )
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)  # Python and NumPy ints; not floats, bools or tensors
    return isinstance(value, numbers.Real)


def check_knob(name, value):
    """Validate one knob: `TypeError` for a wrong type (2.5 or "4" for an int, a bool for a number), `ValueError`
    out of range; both name the argument. Returns the value as its kind (int / float / bool / str)."""
    knob = KNOBS[name]
    if value is None and knob.optional:
        return None
    if not _type_ok(knob.kind, value):
        kind = "one of " + str(knob.kind) if isinstance(knob.kind, tuple) else knob.kind.__name__
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if isinstance(knob.kind, tuple):
        if value not in knob.kind:
            raise ValueError(f"{name} must be one of {knob.kind}, got {value!r}")
        return value
    value = knob.kind(value)
    if knob.kind is float and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if knob.kind is CostTable and not all(math.isfinite(x) for x in value):
        raise ValueError(f"{name} must be finite, got {value}")
    if knob.check is not None and not knob.check(value):
        raise ValueError(f"{name} must be {knob.bound}, got {value!r}")
    return value


def check_knobs(**values):
    """`check_knob` for each keyword, then the cross-knob bounds (the SJD-PAC tree must fit in the Jacobi window,
    and its size is bounded); returns the validated dict."""
    checked = {name: check_knob(name, value) for name, value in values.items()}
    width, depth = checked.get("jacobi_tree_width", 1), checked.get("jacobi_tree_depth")
    if width > 1 and depth is not None:
        window = checked.get("jacobi_window", KNOBS["jacobi_window"].default)
        if depth - 1 > window:
            raise ValueError(
                f"jacobi_tree_depth={depth} needs jacobi_window >= {depth - 1} (the tree's positions), got {window}"
            )
        nodes = sum(width**i for i in range(1, depth))
        if nodes > MAX_JACOBI_TREE_NODES:
            raise ValueError(
                f"jacobi_tree_width={width}, jacobi_tree_depth={depth}: a tree of {nodes} nodes, more than "
                f"{MAX_JACOBI_TREE_NODES} (every node is scored by the target forward)"
            )
    return checked


def resolve_drafter(acceptance, drafter, available, pipeline="image"):
    """Check an (acceptance, drafter) pair against the registry and the loaded components.

    Args:
        acceptance: an `ACCEPTANCES` key accepted by `pipeline`.
        drafter: a `DRAFTERS` key or None (the acceptance's first drafter whose component is loaded).
        available: names of the pipeline components that are loaded (e.g. `{"draft_model", "eagle_head"}`).
        pipeline: the pipeline kind (`PIPELINES`).

    Returns:
        the drafter name (None for `acceptance="none"`).
    """
    names = acceptance_names(pipeline)
    if not isinstance(acceptance, str) or acceptance not in names:
        raise ValueError(f"acceptance must be one of {names}, got {acceptance!r}")
    if drafter is not None and (not isinstance(drafter, str) or drafter not in DRAFTERS):
        raise ValueError(f"drafter must be one of {tuple(DRAFTERS)} or None, got {drafter!r}")
    spec = ACCEPTANCES[acceptance]
    if not spec.drafters:
        return None
    runs_here = [name for name in spec.drafters if pipeline in DRAFTERS[name].pipelines]
    if drafter is None:
        for name in runs_here:
            component = DRAFTERS[name].component
            if component is None or component in available:
                return name
        needs = [DRAFTERS[name].component for name in runs_here]
        raise ValueError(f"acceptance={acceptance!r} needs one of the drafters {tuple(runs_here)} (components "
                         f"{needs}); none is loaded (acceptance='none' decodes without one)")  # fmt: skip
    if pipeline not in DRAFTERS[drafter].pipelines:
        raise ValueError(f"drafter={drafter!r} runs in the {DRAFTERS[drafter].pipelines} pipelines, not {pipeline!r}")
    if drafter not in spec.drafters:
        raise ValueError(f"acceptance={acceptance!r} runs with drafter in {spec.drafters}, got drafter={drafter!r}")
    component = DRAFTERS[drafter].component
    if component is not None and component not in available:
        raise ValueError(f"drafter={drafter!r} needs a {component} component")
    return drafter


@dataclass(frozen=True)
class MethodSettings(Mapping):
    """One call's method, resolved once (`resolve_method`): the acceptance, the drafter and every knob of `KNOBS`
    checked and defaulted (no None left where the registry has an `auto` value). It travels to the drafter and the
    rule, which read it as it is; it is also a read-only mapping knob name -> value (`settings["jacobi_window"]`,
    `dict(settings)`: the knobs only)."""

    acceptance: str
    drafter: str | None
    num_draft_tokens: int
    tree_nodes: int
    tree_depth: int
    tree_top_k: int
    relaxation_top_k: int
    relaxation_delta: float
    relaxation_lambda: float | None
    group_size: int
    group_prob_threshold: float
    group_dist_threshold: float
    jacobi_window: int
    jacobi_init: str
    coupling: bool
    jacobi_tree_width: int
    jacobi_tree_depth: int
    draft_length: str
    draft_confidence: float | None
    draft_step_cost: float | None
    verify_token_cost: float | None
    verify_costs: tuple | None
    resample: str

    def __getitem__(self, name):
        if name not in KNOBS:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self):
        return iter(KNOBS)

    def __len__(self):
        return len(KNOBS)

    @property
    def tree(self) -> bool:
        """An EAGLE-2 tree of `tree_nodes` (else a chain)."""
        return self.tree_top_k > 1


def _tree_drafter(pipeline, drafter):
    return drafter in TREE_DRAFTERS.get(pipeline, ())


def resolve_method(acceptance, drafter, available, pipeline="image", **knobs) -> MethodSettings:
    """A call's method, checked and defaulted once: `resolve_drafter`, then `check_knobs` on the knobs given (the
    others at their `KNOBS` defaults), then each unset optional knob at its registry `auto` value (per acceptance
    where `auto_for` says so).

    `num_draft_tokens` is the draft model's chain length only: given together with an EAGLE-2 tree (a tree drafter
    of `TREE_DRAFTERS` at `tree_top_k > 1`), where it once meant the tree's node count, it is refused naming
    `tree_nodes`.

    `available`: the loaded components (`resolve_drafter`); None when `drafter` is already the resolved one.
    """
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise TypeError(f"unknown method knob(s) {unknown}; the registry has {sorted(KNOBS)}")
    if available is not None:
        drafter = resolve_drafter(acceptance, drafter, available, pipeline)
    values = check_knobs(**{name: knobs.get(name, knob.default) for name, knob in KNOBS.items()})
    if values["num_draft_tokens"] is not None and values["tree_top_k"] > 1 and _tree_drafter(pipeline, drafter):
        raise ValueError(
            f"num_draft_tokens is the draft model's chain length; drafter={drafter!r} with tree_top_k="
            f"{values['tree_top_k']} grows an EAGLE-2 tree whose node count is tree_nodes (got num_draft_tokens="
            f"{values['num_draft_tokens']}: pass tree_nodes={values['num_draft_tokens']} instead)"
        )
    for name, knob in KNOBS.items():
        if values[name] is None and knob.auto is not None:
            values[name] = knob.auto_for.get(acceptance, knob.auto)
    _resolve_draft_length(values, pipeline, drafter)
    return MethodSettings(acceptance=acceptance, drafter=drafter, **values)


def _resolve_draft_length(values, pipeline, drafter):
    """The draft-length knobs together (in place): `draft_confidence` alone with `draft_length="fixed"` is the
    `"confidence"` policy (the knob's meaning before the policies); `"confidence"` without a threshold takes
    `DEFAULT_DRAFT_CONFIDENCE`; the cost knobs belong to `COST_POLICIES`, which fill them from `DRAFT_STEP_COSTS` /
    `DEFAULT_VERIFY_TOKEN_COST`; a policy other than `"fixed"` needs a chain drafter (`"model"` / `"eagle"` at
    `tree_top_k=1`: a tree's size is its node budget, a Jacobi window is the target's own)."""
    if values["draft_length"] == "fixed" and values["draft_confidence"] is not None:
        values["draft_length"] = "confidence"
    policy = values["draft_length"]
    if policy not in COST_POLICIES:
        given = [name for name in ("draft_step_cost", "verify_token_cost", "verify_costs") if values[name] is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: read by the cost policies {COST_POLICIES} only, "
                             f"got draft_length={policy!r}")  # fmt: skip
    if policy in ("calibrated", "batch-calibrated") and values["draft_confidence"] is not None:
        raise ValueError(f"draft_confidence: draft_length={policy!r} sets its own stop from the calibrated "
                         "confidence; drop draft_confidence or use draft_length='confidence' / 'cost'")  # fmt: skip
    if values["verify_costs"] is not None:
        if policy not in TABLE_POLICIES:
            raise ValueError(f"verify_costs: read by draft_length in {TABLE_POLICIES} only, got "
                             f"draft_length={policy!r}")  # fmt: skip
        if values["verify_token_cost"] is not None:
            raise ValueError("verify_costs and verify_token_cost: give one verification cost model, not both")
    if policy == "fixed":
        return
    if drafter not in ("model", "eagle") or (values["tree_top_k"] > 1 and _tree_drafter(pipeline, drafter)):
        what = f"drafter={drafter!r}" + (f" with tree_top_k={values['tree_top_k']}" if drafter else "")
        raise ValueError(f"draft_length={policy!r} and draft_confidence set the length of draft-model / EAGLE "
                         f"chains (tree_top_k=1); {what} drafts no such chain")  # fmt: skip
    if policy == "confidence" and values["draft_confidence"] is None:
        values["draft_confidence"] = DEFAULT_DRAFT_CONFIDENCE
    if policy in COST_POLICIES:
        if values["draft_step_cost"] is None:
            values["draft_step_cost"] = DRAFT_STEP_COSTS[drafter]
        if values["verify_token_cost"] is None:
            values["verify_token_cost"] = DEFAULT_VERIFY_TOKEN_COST
