"""The demo's work, as plain functions: values in (what the widgets hold), images / dicts / HTML out. No Gradio here:
`app.py` lays these out and turns their `ValueError` / `TypeError` into a message on the page; the tests call them
directly.

Every generating handler runs plain decoding (`acceptance="none"`) and the chosen speculative method on the same
input and seed, batch 1, and reports both side by side. The latencies and the speedup are timed fairly
(`mmspec.timing.time_interleaved`): one untimed warm-up run of each side, then `timing_repeats` interleaved runs,
the median of each side; the summary says so in one line.
"""

import functools
import logging
import re

import numpy as np
import torch

from mmspec.demo.acceptance_map import origin_legend_html, origin_map, round_legend_html, round_map, upscale
from mmspec.demo.answer import answer_html
from mmspec.demo.canvas import canvas_warning
from mmspec.demo.inputs import load_image, parse_int, parse_knobs, parse_seed
from mmspec.demo.plots import accepted_per_round, histogram_figure
from mmspec.methods import (
    ACCEPTANCES,
    CONTINUOUS_DEFAULTS,
    DRAFT_LENGTH_KNOBS,
    DRAFTERS,
    KNOBS,
    PRESETS,
    acceptance_names,
)
from mmspec.timing import time_interleaved


logger = logging.getLogger(__name__)

__all__ = [
    "AUTO_DRAFTER",
    "IMAGE_ACCEPTANCES",
    "VLM_ACCEPTANCES",
    "VLM_DRAFTERS",
    "answer_vlm",
    "comparison_note",
    "generate_continuous",
    "generate_image",
    "image_knob_names",
    "knob_visibility",
    "preset_values",
    "vlm_knob_names",
]

AUTO_DRAFTER = "auto"  # drafter=None: the acceptance's first loaded drafter
# the registry's speculative rules of each pipeline (plain always runs as the baseline)
IMAGE_ACCEPTANCES = [name for name in acceptance_names("image") if name != "none"]
VLM_ACCEPTANCES = [
    "greedy",
    "exact",
]  # SpeculativeVLMPipeline's speculative rules (greedy: greedy decoding), in this order
VLM_DRAFTERS = [AUTO_DRAFTER] + [name for name, spec in DRAFTERS.items() if spec.component is not None]
IMAGE_SIZE = 256  # samples and maps are shown upscaled to this many pixels
# pipeline argument -> the label of its field on the page (the start of the widget's label): a pipeline error that
# names the argument is shown with the label instead (`page_labels`); knobs are labelled by their registry names
FIELD_LABELS = {
    "class_labels": "class",
    "guidance_scale": "guidance scale",
    "num_ar_steps": "AR steps",
    "verify_mode": "verify mode",
    "prefill_ratio": "prefill ratio",
    "max_new_tokens": "max new tokens",
    "do_sample": "sample",
}
TIMING_REPEATS = 3  # timed runs of each side per click, after one warm-up run of each (`time_interleaved`)


# the draft-length policy's knobs (issue 32) are not on the demo's pages yet: the demo runs the fixed length
NOT_SHOWN = DRAFT_LENGTH_KNOBS


def image_knob_names():
    """Every registry knob the demo shows (the image pipeline reads them all), in registry order."""
    return [name for name in KNOBS if name not in NOT_SHOWN]


def vlm_knob_names():
    """The registry knobs of the drafters the VLM pipeline runs (EAGLE head, draft model) that the demo shows."""
    return [name for name, knob in KNOBS.items() if set(knob.used_by) & {"eagle", "model"} and name not in NOT_SHOWN]


def knob_visibility(acceptance, drafter, names):
    """`{knob: shown}`: a knob is shown when the method reads it (`Knob.used_by` names the acceptance or the
    drafter; empty = every method). `drafter` "auto" resolves to the acceptance's first drafter."""
    spec = ACCEPTANCES.get(acceptance)
    if drafter in (None, AUTO_DRAFTER):
        drafter = spec.drafters[0] if spec is not None and spec.drafters else None
    used = {acceptance, drafter}
    return {name: not KNOBS[name].used_by or bool(used & set(KNOBS[name].used_by)) for name in names}


def hidden_knobs(name, names):
    """The knobs registry preset `name` sets that a page showing knobs `names` does not (sorted; empty: the page
    can run it as set)."""
    return sorted(set(PRESETS[name]) - {"acceptance", "drafter", *names})


def preset_values(name, names):
    """A registry preset (`mmspec.methods.PRESETS`) as widget values: `(acceptance, drafter, {knob: value})`, knobs
    the preset does not set at their registry defaults."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    preset = dict(PRESETS[name])
    acceptance = preset.pop("acceptance")
    drafter = preset.pop("drafter", AUTO_DRAFTER)
    hidden = hidden_knobs(name, names)
    if hidden:  # the page would run it without them: never silently
        raise ValueError(f"preset {name!r} sets {hidden}, which this page does not show")
    return acceptance, drafter, {knob: preset.get(knob, KNOBS[knob].default) for knob in names}


def _generator(pipe, seed):
    return torch.Generator(pipe.device).manual_seed(seed)


def page_labels(message):
    """`message` with every pipeline argument of `FIELD_LABELS` named by its page label."""
    pattern = r"\b(" + "|".join(map(re.escape, FIELD_LABELS)) + r")\b"
    return re.sub(pattern, lambda m: FIELD_LABELS[m.group(1)], message)


def _timed(pipe, seed, plain_kwargs, spec_kwargs, repeats):
    """Plain and speculative calls of `pipe` (each from a fresh generator seeded `seed`), timed fairly: returns
    `(plain output, speculative output, FairTiming)`. A pipeline's input error is re-raised with page labels."""
    repeats = parse_int("timing repeats", repeats, 1, 100)
    try:
        return _time_both(pipe, seed, plain_kwargs, spec_kwargs, repeats)
    except (ValueError, TypeError) as err:  # the pipelines check their inputs before the first forward
        raise (TypeError if isinstance(err, TypeError) else ValueError)(page_labels(str(err))) from None


def _time_both(pipe, seed, plain_kwargs, spec_kwargs, repeats):
    # the speculative call warms up first: a knob only it takes is refused by its input checks before any forward,
    # not after a whole plain generation (timed rounds alternate the order, so the timing is the same)
    timing = time_interleaved(
        {
            "speculative": lambda: pipe(generator=_generator(pipe, seed), **spec_kwargs),
            "plain": lambda: pipe(generator=_generator(pipe, seed), **plain_kwargs),
        },
        repeats=repeats,
        warmup=1,
    )
    return timing.results["plain"], timing.results["speculative"], timing


def _run_stats(stats, seconds):
    return {
        "latency_s": round(seconds, 4),
        "target_forwards": int(stats.target_forwards),
        "mean_accepted_length": round(stats.mean_accepted_length, 3),
        "step_compression": round(stats.step_compression, 3),
    }


def comparison_note(lossless, sampled=True):
    """The one line shown under a plain-vs-speculative comparison, saying what lossless does (and does not) mean;
    None for a lossless method under greedy decoding (the outputs are the same)."""
    if lossless and sampled:
        return ("Lossless means the speculative output has the same distribution as plain decoding, not that it is "
                "the same sample: sampled outputs differ even on the same input and seed.")  # fmt: skip
    if not lossless:
        return ("This setting is lossy: its outputs follow a distribution close to plain decoding's, not equal to it "
                "(faster, at some cost in fidelity).")  # fmt: skip
    return None


def _compare(plain, spec):
    speedup = plain["latency_s"] / spec["latency_s"] if spec["latency_s"] > 0 else float("nan")
    return {"plain": plain, "speculative": spec, "speedup": round(speedup, 3)}


def stats_markdown(stats, fields, timing=None, note=None):
    """A markdown table: one row per field, plain and speculative columns, then the speedup; below it, what the
    timing is (`timing.describe`) and an optional `note`."""
    lines = ["| | plain | speculative |", "|---|---|---|"]
    for key, label in fields:
        lines.append(f"| {label} | {stats['plain'][key]} | {stats['speculative'][key]} |")
    lines.append(f"| **speedup** | 1.0× | **{stats['speedup']}×** |")
    if timing is not None:
        lines.append("\n" + timing.describe(threads=torch.get_num_threads()))
    if note:
        lines.append("\n" + note)
    return "\n".join(lines)


IMAGE_FIELDS = [("latency_s", "latency (s)"), ("target_forwards", "target forwards"),
                ("mean_accepted_length", "mean accepted length"), ("step_compression", "step compression")]  # fmt: skip


def _condition(pipe, tab, condition):
    if tab == "t2i":
        if not isinstance(condition, str) or not condition.strip():
            raise ValueError("prompt: type a prompt, e.g. 'a thick handwritten seven'")
        return {"prompt": [condition.strip()]}
    num_classes = pipe.transformer.config.num_classes
    return {"class_labels": [parse_int("class", condition, 0, num_classes - 1)]}


def generate_image(cache, tab, condition, acceptance, drafter, knobs, seed, guidance_scale=2.0,
                   timing_repeats=TIMING_REPEATS):  # fmt: skip
    """Discrete image tab (`tab` "c2i": `condition` a class id; "t2i": a prompt): plain and `acceptance` /
    `drafter` (+ `knobs`, `{name: value}` of registry knobs) from the same seed.

    Returns:
        dict: `plain_image`, `speculative_image` (upscaled PIL), `map` (`round_map` of the speculative trace,
        upscaled), `legend` (HTML), `histogram` (`[K+1]` rounds with k accepted drafts), `figure` (its plot),
        `stats` (`{"plain": {...}, "speculative": {...}, "speedup"}`), `summary` (markdown), `trace`.
    """
    if tab not in ("c2i", "t2i"):
        raise ValueError(f"tab must be 'c2i' or 't2i', got {tab!r}")
    if acceptance not in IMAGE_ACCEPTANCES:
        raise ValueError(f"method: acceptance must be one of {IMAGE_ACCEPTANCES}, got {acceptance!r}")
    seed = parse_seed(seed)
    knobs = parse_knobs(knobs)
    guidance_scale = _finite("guidance scale", guidance_scale)
    pipe = cache.get(tab)
    cond = _condition(pipe, tab, condition)
    common = dict(guidance_scale=guidance_scale, **cond)
    spec_kwargs = dict(acceptance=acceptance, drafter=None if drafter in (None, AUTO_DRAFTER) else drafter, **common,
                       **knobs)  # fmt: skip
    plain, spec, timing = _timed(pipe, seed, dict(acceptance="none", **common), spec_kwargs, timing_repeats)
    stats = _compare(_run_stats(plain.stats, timing.median("plain")),
                     _run_stats(spec.stats, timing.median("speculative")))  # fmt: skip
    per_round = accepted_per_round(spec.trace)
    histogram = np.bincount(per_round, minlength=spec.stats.num_draft_tokens + 1)
    num_rounds = int(spec.trace.round.max()) + 1
    logger.info("%s %s: speedup %.2f", tab, acceptance, stats["speedup"])
    return {
        "plain_image": upscale(plain.images[0], IMAGE_SIZE),
        "speculative_image": upscale(spec.images[0], IMAGE_SIZE),
        "map": upscale(round_map(spec.trace), IMAGE_SIZE),
        "legend": round_legend_html(num_rounds),
        "histogram": histogram,
        "figure": histogram_figure(histogram, f"{acceptance}: {len(per_round)} rounds"),
        "stats": stats,
        "summary": stats_markdown(stats, IMAGE_FIELDS, timing, comparison_note(ACCEPTANCES[acceptance].lossless)),
        "trace": spec.trace,
    }


def _finite(name, value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


CONTINUOUS_FIELDS = [("latency_s", "latency (s)"), ("target_forwards", "target forwards"),
                     ("mean_accepted_length", "mean accepted length"), ("acceptance_rate", "acceptance rate")]  # fmt: skip


def generate_continuous(cache, class_label, seed, guidance_scale=4.0, num_ar_steps=64,
                        verify_mode=CONTINUOUS_DEFAULTS["verify_mode"],
                        num_draft_tokens=CONTINUOUS_DEFAULTS["num_draft_tokens"],
                        prefill_ratio=CONTINUOUS_DEFAULTS["prefill_ratio"], timing_repeats=TIMING_REPEATS):  # fmt: skip
    """Continuous tab: plain MAR and CSpD (`acceptance="continuous"`) from the same seed.

    Returns:
        dict: `plain_image`, `speculative_image`, `map` (`origin_map`: proposed-and-accepted / resampled / target
        alone), `legend`, `histogram`, `figure`, `stats`, `summary`, `trace`.
    """
    seed = parse_seed(seed)
    pipe = cache.get("continuous")
    label = parse_int("class", class_label, 0, pipe.transformer.config.class_num - 1)
    common = dict(guidance_scale=_finite("guidance scale", guidance_scale),
                  num_ar_steps=parse_int("AR steps", num_ar_steps, 1, pipe.transformer.seq_len))  # fmt: skip
    k = parse_int("num_draft_tokens", num_draft_tokens, 1, pipe.transformer.seq_len)
    ratio = _finite("prefill ratio", prefill_ratio)
    spec_kwargs = dict(class_labels=[label], acceptance="continuous", verify_mode=verify_mode, num_draft_tokens=k,
                       prefill_ratio=ratio, **common)  # fmt: skip
    plain, spec, timing = _timed(pipe, seed, dict(class_labels=[label], acceptance="none", **common), spec_kwargs,
                                 timing_repeats)  # fmt: skip
    runs = []
    for out, name in ((plain, "plain"), (spec, "speculative")):
        row = _run_stats(out.stats, timing.median(name))
        row["acceptance_rate"] = round(out.stats.acceptance_rate, 3)
        runs.append(row)
    stats = _compare(*runs)
    per_round = accepted_per_round(spec.trace)
    histogram = np.bincount(per_round, minlength=k + 1)
    return {
        "plain_image": upscale(plain.images[0], IMAGE_SIZE),
        "speculative_image": upscale(spec.images[0], IMAGE_SIZE),
        "map": upscale(origin_map(spec.trace), IMAGE_SIZE),
        "legend": origin_legend_html(),
        "histogram": histogram,
        "figure": histogram_figure(
            histogram, f"CSpD ({verify_mode}): {len(per_round)} blocks", "draft tokens accepted in a block"
        ),
        "stats": stats,
        "summary": stats_markdown(stats, CONTINUOUS_FIELDS, timing, comparison_note(verify_mode == "exact")),
        "trace": spec.trace,
    }


@functools.lru_cache(maxsize=32)
def held_out_canvas(index):
    """Held-out canvas `index`: 1-4 MNIST test digits (`mmspec.data.canvases.held_out_canvases`)."""
    from mmspec.data.canvases import held_out_canvases

    return held_out_canvases(1, index, min_digits=1)[0]


VLM_FIELDS = [("latency_s", "latency (s)"), ("tau", "τ (tokens per round)"), ("tokens_per_s", "tokens/s"),
              ("new_tokens", "new tokens")]  # fmt: skip


def answer_vlm(cache, upload, canvas, prompt, acceptance, drafter, knobs, max_new_tokens=32, seed=0, do_sample=False,
               temperature=1.0, timing_repeats=TIMING_REPEATS):  # fmt: skip
    """VLM tab: `upload` (a file path or PIL image; None: held-out canvas number `canvas`) and `prompt`, answered by
    plain decoding and by `acceptance` / `drafter` (+ `knobs`).

    Returns:
        dict: `image` (the image asked about, upscaled), `answer_html` (speculative answer, drafted tokens
        highlighted), `plain_text`, `speculative_text`, `same_answer`, `stats` (`latency_s`, `tau`, `tokens_per_s`,
        `new_tokens` per run, `speedup`), `summary`, `trace`, `warning` (None, or why an uploaded image is unlike
        the zoo's training canvases, when the demo serves the zoo: `mmspec.demo.canvas.canvas_warning`).
    """
    from mmspec.methods import VLM_LIMITS

    warning = None
    if upload is not None and not (isinstance(upload, str) and not upload):
        image = load_image(upload)
        if getattr(cache, "zoo", None) is not None:
            warning = canvas_warning(image)
    else:
        image = held_out_canvas(parse_int("held-out canvas", canvas, 0, 10_000))
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("question: type a question, e.g. 'Describe the image.'")
    if acceptance not in VLM_ACCEPTANCES:
        raise ValueError(f"method: acceptance must be one of {VLM_ACCEPTANCES}, got {acceptance!r}")
    max_new_tokens = parse_int("max new tokens", max_new_tokens, 1, VLM_LIMITS["max_new_tokens"])
    seed = parse_seed(seed)
    knobs = parse_knobs(knobs)
    for name, value in knobs.items():
        if value is not None and name in VLM_LIMITS and value > VLM_LIMITS[name]:
            raise ValueError(f"{name} must be <= {VLM_LIMITS[name]}, got {value}")
    if not isinstance(do_sample, bool):
        raise ValueError(f"sample must be a bool, got {do_sample!r}")
    if acceptance == "greedy" and do_sample:
        raise ValueError(
            "sample: acceptance greedy verifies greedy decoding; untick sample, or choose acceptance exact"
        )
    pipe = cache.get("vlm")
    common = dict(images=image, prompt=prompt.strip(), max_new_tokens=max_new_tokens, do_sample=do_sample,
                  temperature=_finite("temperature", temperature))  # fmt: skip
    spec_kwargs = dict(acceptance=acceptance, drafter=None if drafter in (None, AUTO_DRAFTER) else drafter, **common,
                       **knobs)  # fmt: skip
    plain, spec, timing = _timed(pipe, seed, dict(acceptance="none", **common), spec_kwargs, timing_repeats)
    runs = []
    for out, name in ((plain, "plain"), (spec, "speculative")):
        seconds, new_tokens = timing.median(name), int((out.sequences >= 0).sum())
        runs.append({
            "latency_s": round(seconds, 4),
            "tau": round(out.stats.mean_accepted_length, 3),
            "tokens_per_s": round(new_tokens / seconds if seconds > 0 else 0.0, 2),  # over the median wall-clock
            "new_tokens": new_tokens,
        })  # fmt: skip
    stats = _compare(*runs)
    same = plain.text[0] == spec.text[0]
    note = comparison_note(True, do_sample)  # both VLM methods are lossless
    if not same and not do_sample:
        note = ("The answers differ under greedy decoding: verifying several tokens in one forward rounds slightly "
                "differently from one at a time, so near-tied logits can pick different tokens (not a lossy method).")  # fmt: skip
    return {
        "image": upscale(image, IMAGE_SIZE),
        "answer_html": answer_html(pipe.tokenizer, spec.sequences[0], spec.trace),
        "plain_text": plain.text[0],
        "speculative_text": spec.text[0],
        "same_answer": same,
        "stats": stats,
        "summary": stats_markdown(stats, VLM_FIELDS, timing, note),
        "trace": spec.trace,
        "warning": warning,
    }
