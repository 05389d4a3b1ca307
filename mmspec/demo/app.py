"""The Gradio layout of the demo: one tab per pipeline, over the plain functions of `handlers.py`.

Method widgets come from the registry (`mmspec.methods`: acceptances, drafters, presets, one widget per knob of
`KNOBS` with its default and help); every generate button runs in the queue (one generation at a time, concurrent
users wait their turn) with the pipelines' tqdm bars shown through `gr.Progress(track_tqdm=True)`. A handler's
`ValueError` / `TypeError` (a seed that is not a number, a knob out of range, an upload that is not an image) is
shown as an error message on the page; any other failure is logged and shown as a message too, and the server keeps
serving.
"""

import html
import inspect
import logging
from pathlib import Path

import gradio as gr

from mmspec.demo import handlers
from mmspec.demo.answer import answer_legend_html
from mmspec.demo.inputs import page_message, upload_refusal
from mmspec.methods import ACCEPTANCES, KNOBS, PRESETS


logger = logging.getLogger(__name__)

__all__ = ["CSS", "build_app"]

TAB_TITLES = {"c2i": "Image: class", "t2i": "Image: prompt", "continuous": "Continuous (MAR + CSpD)", "vlm": "VLM"}
CSS = (".mmspec-legend{font-size:0.85em;margin:4px 0} .tok{border-radius:3px} "
       ".mmspec-warning{background:#fff3cd;color:#664d03;border-radius:4px;padding:4px 8px;margin-bottom:6px}")  # fmt: skip


def _guarded(fn, num_inputs):
    """`fn(*values)` as a Gradio event function of `num_inputs` inputs plus a tracked `gr.Progress`; handler errors
    become `gr.Error` messages (no stack trace reaches the page, and no server path: `page_message` masks any). The
    last input is the "quick timing" checkbox: default False, so API clients that do not send it keep working."""

    def run(*args):
        values = args[:num_inputs]
        try:
            return fn(*values)
        except (ValueError, TypeError) as err:
            raise gr.Error(page_message(str(err)), print_exception=False) from None
        except gr.Error:
            raise
        except Exception as err:  # noqa: BLE001 -- shown as a message; the server keeps serving
            logger.exception("demo handler %s failed", getattr(fn, "__name__", fn))
            raise gr.Error(
                f"generation failed ({type(err).__name__}); the server's log has the details", print_exception=False
            ) from None

    params = [inspect.Parameter(f"value_{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD) for i in range(num_inputs - 1)]
    params.append(inspect.Parameter("quick_timing", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=False))
    params.append(inspect.Parameter("progress", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=gr.Progress(track_tqdm=True)))  # fmt: skip
    run.__signature__ = inspect.Signature(params)
    run.__name__ = getattr(fn, "__name__", "run")
    return run


def _image_upload(**kwargs):
    """A `gr.Image(type="pil")` upload: the handler gets pixels, never a path.

    A client can send a hand-made `FileData` naming any server path instead of uploading a file. Gradio refuses a
    path outside its upload folder before this component sees it (over the wire: a generic error that names no
    path, as long as `launch(show_error=False)`, the demo's setting). A path inside the upload folder that PIL
    cannot open (the folder itself, a missing file, a file that is not an image) gets one message naming only the
    client's own file name, never the path nor the exception: the same answer for every case, so nothing tells a
    client which server files exist. The instance's `preprocess` is wrapped: a subclass of a Gradio component
    would make Gradio write a `.pyi` stub next to this module."""
    component = gr.Image(type="pil", **kwargs)
    preprocess = component.preprocess

    def checked(payload):
        try:
            return preprocess(payload)
        except gr.Error:
            raise
        except Exception:  # noqa: BLE001 -- OSError, PIL's errors, DecompressionBombError: one answer for all
            raise gr.Error(upload_refusal(getattr(payload, "orig_name", None)), print_exception=False) from None

    component.preprocess = checked
    return component


def _knob_widget(name, value, visible):
    knob = KNOBS[name]
    label = name + ("" if not knob.bound else f" ({knob.bound})")
    info = knob.help + (f"; read by {', '.join(knob.used_by)}" if knob.used_by else "")
    if knob.kind is bool:
        return gr.Checkbox(value=value, label=label, info=info, visible=visible, elem_id=f"knob-{name}")
    if isinstance(knob.kind, tuple):
        return gr.Dropdown(choices=list(knob.kind), value=value, label=label, info=info, visible=visible)
    # an optional knob's None must show empty: a gr.Number without a placeholder shows None as 0
    return gr.Number(value=value, label=label + (" (empty: auto)" if knob.optional else ""), info=info,
                     visible=visible, placeholder="auto" if knob.optional else None)  # fmt: skip


def _method_widgets(tab, acceptances, drafters, default_preset, knob_names):
    """Preset, acceptance, drafter and knob widgets (registry-driven); wires the preset and the visibility."""
    # a preset that sets a knob the page does not show would run without it: not offered
    presets = [name for name, p in PRESETS.items()
               if p["acceptance"] in acceptances and not handlers.hidden_knobs(name, knob_names)]  # fmt: skip
    with gr.Row():
        preset = gr.Dropdown(choices=presets, value=default_preset, label="preset", elem_id=f"{tab}-preset")
        acceptance0, drafter0, values0 = handlers.preset_values(default_preset, knob_names)
        acceptance = gr.Dropdown(choices=acceptances, value=acceptance0, label="acceptance", elem_id=f"{tab}-acceptance",
                                 info="; ".join(f"{a}: {ACCEPTANCES[a].summary}" for a in acceptances if a in ACCEPTANCES))  # fmt: skip
        drafter = gr.Dropdown(choices=drafters, value=drafter0, label="drafter", elem_id=f"{tab}-drafter")
    with gr.Accordion("method knobs (mmspec.methods.KNOBS)", open=False):
        visible = handlers.knob_visibility(acceptance0, drafter0, knob_names)
        knobs = []
        with gr.Row():
            for name in knob_names:
                knobs.append(_knob_widget(name, values0[name], visible[name]))

    def apply_preset(name):
        acc, dra, values = handlers.preset_values(name, knob_names)
        shown = handlers.knob_visibility(acc, dra, knob_names)
        return [acc, dra] + [gr.update(value=values[n], visible=shown[n]) for n in knob_names]

    def show_knobs(acc, dra):
        shown = handlers.knob_visibility(acc, dra, knob_names)
        return [gr.update(visible=shown[n]) for n in knob_names]

    preset.input(apply_preset, preset, [acceptance, drafter, *knobs], queue=False)
    for widget in (acceptance, drafter):
        widget.input(show_knobs, [acceptance, drafter], knobs, queue=False)
    return acceptance, drafter, knobs


def _generate_row(tab, text="Generate"):
    """The generate button and, next to it, the quick-timing checkbox."""
    with gr.Row():
        button = gr.Button(text, variant="primary", elem_id=f"{tab}-generate", scale=3)
        quick = gr.Checkbox(value=False, label="quick timing", elem_id=f"{tab}-quick", scale=1,
                            info=f"1 warm-up + 1 timed run of each side (default: {handlers.TIMING_REPEATS} "
                                 "interleaved timed runs after the warm-up)")  # fmt: skip
    return button, quick


def _repeats(quick):
    if not isinstance(quick, bool):
        raise ValueError(f"quick timing must be a bool, got {quick!r}")
    return 1 if quick else handlers.TIMING_REPEATS


def _result_row(tab):
    with gr.Row():
        plain = gr.Image(label="plain decoding", type="pil", elem_id=f"{tab}-plain", interactive=False)
        spec = gr.Image(label="speculative", type="pil", elem_id=f"{tab}-speculative", interactive=False)
        amap = gr.Image(label="acceptance map", type="pil", elem_id=f"{tab}-map", interactive=False)
    legend = gr.HTML(elem_id=f"{tab}-legend")
    with gr.Row():
        summary = gr.Markdown(elem_id=f"{tab}-stats")
        plot = gr.Plot(label="acceptance histogram", elem_id=f"{tab}-histogram")
    return [plain, spec, amap, legend, summary, plot]


def _image_outputs(result):
    return [result["plain_image"], result["speculative_image"], result["map"], result["legend"], result["summary"],
            result["figure"]]  # fmt: skip


def _image_tab(cache, tab):
    names = handlers.image_knob_names()
    with gr.Row():
        if tab == "t2i":
            condition = gr.Textbox(value="a thick handwritten seven", label="prompt", elem_id=f"{tab}-condition")
        else:
            condition = gr.Number(value=3, label="class (digit)", elem_id=f"{tab}-condition")
        seed = gr.Textbox(value="0", label="seed", elem_id=f"{tab}-seed")
        guidance = gr.Number(value=2.0, label="guidance scale (CFG)", elem_id=f"{tab}-guidance")
    acceptance, drafter, knobs = _method_widgets(tab, handlers.IMAGE_ACCEPTANCES,
                                                 [handlers.AUTO_DRAFTER, "eagle", "model", "jacobi"],
                                                 "exact-eagle" if tab == "c2i" else "jacobi", names)  # fmt: skip
    button, quick = _generate_row(tab)
    outputs = _result_row(tab)

    def generate(condition, acceptance, drafter, seed, guidance, *knob_values_and_quick):
        *knob_values, quick = knob_values_and_quick
        result = handlers.generate_image(cache, tab, condition, acceptance, drafter, dict(zip(names, knob_values)),
                                         seed, guidance, _repeats(quick))  # fmt: skip
        return _image_outputs(result)

    inputs = [condition, acceptance, drafter, seed, guidance, *knobs, quick]
    button.click(_guarded(generate, len(inputs)), inputs, outputs, api_name=f"generate_{tab}",
                 concurrency_id="generate", concurrency_limit=1)  # fmt: skip


def _continuous_tab(cache):
    tab = "continuous"
    from mmspec.methods import CONTINUOUS_DEFAULTS
    from mmspec.pipelines.continuous import VERIFY_MODES

    with gr.Row():
        label = gr.Number(value=3, label="class (digit)", elem_id=f"{tab}-condition")
        seed = gr.Textbox(value="0", label="seed", elem_id=f"{tab}-seed")
        guidance = gr.Number(value=4.0, label="guidance scale (CFG)")
        steps = gr.Number(value=64, label="AR steps", elem_id=f"{tab}-steps")
    with gr.Row():
        mode = gr.Dropdown(choices=list(VERIFY_MODES), value=CONTINUOUS_DEFAULTS["verify_mode"], label="verify mode",
                           info="block: one target pass per block (CSpD release); exact: lossless, slower")  # fmt: skip
        k = gr.Number(value=CONTINUOUS_DEFAULTS["num_draft_tokens"], label="num_draft_tokens (AR steps per block)")
        ratio = gr.Number(value=CONTINUOUS_DEFAULTS["prefill_ratio"], label="prefill ratio (target-only steps)")
    button, quick = _generate_row(tab)
    outputs = _result_row(tab)

    def generate(label, seed, guidance, steps, mode, k, ratio, quick):
        return _image_outputs(handlers.generate_continuous(cache, label, seed, guidance, steps, mode, k, ratio,
                                                           _repeats(quick)))  # fmt: skip

    inputs = [label, seed, guidance, steps, mode, k, ratio, quick]
    button.click(_guarded(generate, len(inputs)), inputs, outputs, api_name="generate_continuous",
                 concurrency_id="generate", concurrency_limit=1)  # fmt: skip


def _vlm_tab(cache):
    tab = "vlm"
    names = handlers.vlm_knob_names()
    with gr.Row():
        with gr.Column():
            upload = _image_upload(label="upload an image (empty: the held-out canvas)", sources=["upload"],
                                   elem_id=f"{tab}-upload")  # fmt: skip
            canvas = gr.Number(value=0, label="held-out canvas (MNIST test digits) number", elem_id=f"{tab}-canvas")
        with gr.Column():
            prompt = gr.Textbox(value="Describe the image.", label="question", elem_id=f"{tab}-prompt")
            max_new = gr.Number(value=32, label="max new tokens", elem_id=f"{tab}-max-new")
            seed = gr.Textbox(value="0", label="seed", elem_id=f"{tab}-seed")
            sample = gr.Checkbox(value=False, label="sample (do_sample; needs acceptance exact)")
            temperature = gr.Number(value=1.0, label="temperature")
    # the preset's own acceptance (exact, which verifies greedy and sampled decoding alike), not an override
    acceptance, drafter, knobs = _method_widgets(tab, handlers.VLM_ACCEPTANCES, handlers.VLM_DRAFTERS,
                                                 "exact-eagle", names)  # fmt: skip
    button, quick = _generate_row(tab, "Ask")
    with gr.Row():
        shown = gr.Image(label="image asked about", type="pil", interactive=False, elem_id=f"{tab}-image")
        with gr.Column():
            gr.HTML(answer_legend_html())
            answer = gr.HTML(elem_id=f"{tab}-answer", label="speculative answer")
            plain_text = gr.Textbox(label="plain decoding's answer", elem_id=f"{tab}-plain-text", interactive=False)
            summary = gr.Markdown(elem_id=f"{tab}-stats")

    def ask(upload, canvas, prompt, acceptance, drafter, max_new, seed, sample, temperature, *knob_values_and_quick):
        *knob_values, quick = knob_values_and_quick
        r = handlers.answer_vlm(cache, upload, canvas, prompt, acceptance, drafter, dict(zip(names, knob_values)),
                                max_new, seed, sample, temperature, _repeats(quick))  # fmt: skip
        warning = (
            ""
            if r["warning"] is None
            else f'<div class="mmspec-warning" role="alert">⚠ {html.escape(r["warning"])}</div>'
        )
        return [r["image"], warning + r["answer_html"], r["plain_text"], r["summary"]]

    inputs = [upload, canvas, prompt, acceptance, drafter, max_new, seed, sample, temperature, *knobs, quick]
    button.click(_guarded(ask, len(inputs)), inputs, [shown, answer, plain_text, summary], api_name="ask_vlm",
                 concurrency_id="generate", concurrency_limit=1)  # fmt: skip


def build_app(cache):
    """The demo's `gr.Blocks` over a `mmspec.demo.models.PipelineCache` (one tab per pipeline it serves), queued."""
    with gr.Blocks(title="mmspec: speculative decoding, side by side") as demo:
        source = Path(cache.pipeline_folder or cache.zoo).name
        gr.Markdown(
            "# mmspec: speculative decoding, side by side\n"
            f"Plain decoding and a speculative method on the same input and seed (models from `{source}`, loaded "
            "on first use). Image tabs: the acceptance map is the sample's 8×8 token grid, each token coloured by "
            "the verification round that emitted it (discrete) or by what the draft and the target did with it "
            "(continuous); the histogram counts rounds by accepted drafts. VLM: the answer's drafted tokens "
            "are highlighted."
        )
        with gr.Tabs():
            for tab in cache.tabs:
                with gr.Tab(TAB_TITLES[tab], id=tab, elem_id=f"tab-{tab}"):
                    if tab in ("c2i", "t2i"):
                        _image_tab(cache, tab)
                    elif tab == "continuous":
                        _continuous_tab(cache)
                    else:
                        _vlm_tab(cache)
    demo.queue(default_concurrency_limit=1)
    return demo
