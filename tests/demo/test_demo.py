"""The demo's handlers (`mmspec.demo.handlers`), called directly on the shipped zoo, and its command line."""

import numpy as np
import pytest
import torch
from factories import usage_error_line

from mmspec.decoding.trace import ACCEPTED, BONUS, PREFILL, RESAMPLED
from mmspec.demo import handlers
from mmspec.demo.acceptance_map import MARK_COLOURS, ORIGIN_COLOURS, round_colours
from mmspec.demo.models import PipelineCache
from mmspec.methods import KNOBS, PRESETS


pytestmark = pytest.mark.zoo
CELL = 32  # acceptance-map cell size: 8 x 8 tokens -> the 256-pixel image, no resampling


@pytest.fixture(scope="module")
def cache(demo_cache):
    return demo_cache  # shared with test_demo_served.py (tests/demo/conftest.py)


def _cell(image, index, y, x):
    row, col = divmod(index, 8)
    return tuple(int(v) for v in np.asarray(image)[row * CELL + y, col * CELL + x])


def _check_round_map(image, trace):
    """Every cell has its round's colour (top edge, away from marks) and its origin's mark (centre)."""
    rounds, origins = trace.round[0].tolist(), trace.origin[0].tolist()
    palette = round_colours(max(rounds) + 1)
    assert image.size == (8 * CELL, 8 * CELL)
    for i, (rnd, origin) in enumerate(zip(rounds, origins)):
        assert _cell(image, i, 2, CELL // 2) == tuple(palette[rnd]), f"token {i}: round {rnd}"
        centre = _cell(image, i, CELL // 2, CELL // 2)
        if origin == ACCEPTED:
            assert centre == tuple(palette[rnd]), f"token {i} is an accepted draft: unmarked"
        else:
            assert centre == MARK_COLOURS[origin], f"token {i}: origin {origin}"


def test_c2i_handler_plain_vs_speculative(cache):
    result = handlers.generate_image(cache, "c2i", 3, "exact", "eagle", {"tree_depth": 5.0}, "0", timing_repeats=1)
    pipe = cache.get("c2i")
    ref = pipe(class_labels=[3], acceptance="exact", drafter="eagle", tree_depth=5,
               generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert torch.equal(result["trace"].round, ref.trace.round)  # the seed reaches the pipeline
    assert list(result["histogram"]) == ref.stats.accept_histogram
    stats = result["stats"]
    assert stats["plain"]["target_forwards"] == 64 and stats["plain"]["mean_accepted_length"] == 1.0
    assert stats["speculative"]["target_forwards"] == ref.stats.target_forwards < 64
    assert stats["speculative"]["mean_accepted_length"] == round(ref.stats.mean_accepted_length, 3) > 1
    assert stats["speedup"] == round(stats["plain"]["latency_s"] / stats["speculative"]["latency_s"], 3)
    for key in ("plain_image", "speculative_image"):
        assert result[key].size == (256, 256) and np.asarray(result[key]).std() > 10  # a digit, not a blank
    _check_round_map(result["map"], result["trace"])
    origins = set(result["trace"].origin[0].tolist())
    assert {PREFILL, ACCEPTED} <= origins and origins & {RESAMPLED, BONUS}  # every kind of mark is exercised
    assert "speedup" in result["summary"] and "target forwards" in result["summary"]
    bars = [p.get_height() for p in result["figure"].axes[0].patches]
    assert bars == list(result["histogram"])


def test_t2i_handler_jacobi(cache):
    result = handlers.generate_image(cache, "t2i", "a thick handwritten seven", "jacobi", "auto", {}, 1,
                                     timing_repeats=1)  # fmt: skip
    assert result["stats"]["speculative"]["target_forwards"] < result["stats"]["plain"]["target_forwards"] == 64
    _check_round_map(result["map"], result["trace"])
    counts = result["trace"].counts()
    assert int(result["histogram"].sum()) == int(result["trace"].round.max())  # one entry per verification round
    assert int((result["histogram"] * np.arange(result["histogram"].size)).sum()) == int(counts["accepted"][0])


def test_continuous_handler_map_shows_origins(cache):
    result = handlers.generate_continuous(cache, 7, 0, num_ar_steps=16, verify_mode="block", num_draft_tokens=4,
                                          timing_repeats=1)  # fmt: skip
    origins = result["trace"].origin[0].tolist()
    assert PREFILL in origins and RESAMPLED in origins  # target-only steps and draft proposals
    for i, origin in enumerate(origins):
        assert _cell(result["map"], i, CELL // 2, CELL // 2) == ORIGIN_COLOURS[origin][0], f"token {i}"
    assert result["stats"]["plain"]["target_forwards"] == 16
    assert int(result["histogram"].sum()) > 0 and result["speculative_image"].size == (256, 256)


def test_vlm_handler_highlights_drafts(cache):
    result = handlers.answer_vlm(cache, None, 0, "Describe the image.", "greedy", "eagle", {}, max_new_tokens=8,
                                 timing_repeats=1)  # fmt: skip
    assert result["same_answer"]  # greedy speculative decoding is lossless
    trace = result["trace"]
    html = result["answer_html"]
    assert html.count("tok-accepted") == int((trace.origin == ACCEPTED).sum()) > 0
    assert html.count("tok-rejected") == int((trace.origin == RESAMPLED).sum())
    assert result["stats"]["speculative"]["tau"] > 1 and result["stats"]["plain"]["tau"] == 1.0
    assert result["stats"]["speculative"]["new_tokens"] == result["stats"]["plain"]["new_tokens"]
    assert result["image"].size == (256, 256)


def test_vlm_handler_takes_an_uploaded_image(cache, tmp_path):
    path = tmp_path / "canvas.png"
    handlers.held_out_canvas(3).save(path)
    result = handlers.answer_vlm(cache, str(path), 0, "How many digits are there?", "greedy", "model", {},
                                 max_new_tokens=4, timing_repeats=1)  # fmt: skip
    assert result["same_answer"] and result["plain_text"] and result["warning"] is None  # a canvas: no warning


def test_an_image_unlike_the_zoo_canvases_gets_a_warning(cache, tmp_path):
    """A lone MNIST digit (the issue's upload) gets a warning next to the answer; the zoo's canvases never do."""
    from PIL import Image

    from mmspec.data.canvases import held_out_canvases, mnist_digits
    from mmspec.demo.canvas import canvas_warning

    images, _ = mnist_digits("test")
    lone = [Image.fromarray((images[i].numpy() * 255).round().astype(np.uint8), "L") for i in range(200)]
    canvases = held_out_canvases(200, 123, min_digits=1)
    assert all(canvas_warning(c) is None for c in canvases)
    assert all(canvas_warning(c.convert("RGB").resize((256, 256))) is None for c in canvases[:20])  # upscaled: fine
    assert all("cell borders" in canvas_warning(d) for d in lone)
    assert "not square" in canvas_warning(canvases[0].resize((128, 64)))
    assert "mostly light" in canvas_warning(Image.eval(canvases[0], lambda v: 255 - v))
    path = tmp_path / "digit.png"
    lone[0].save(path)
    result = handlers.answer_vlm(cache, str(path), 0, "How many digits are there?", "greedy", "auto", {},
                                 max_new_tokens=2, timing_repeats=1)  # fmt: skip
    assert "unlike the zoo model's training canvases" in result["warning"]


def test_lossless_sampled_comparisons_say_what_lossless_means(cache):
    result = handlers.generate_image(cache, "c2i", 3, "exact", "auto", {}, 0, timing_repeats=1)
    assert "same distribution as plain decoding, not that it is the same sample" in result["summary"]
    result = handlers.generate_image(cache, "c2i", 3, "relaxed", "auto", {}, 0, timing_repeats=1)
    assert "lossy" in result["summary"]
    result = handlers.answer_vlm(cache, None, 0, "hi", "exact", "auto", {}, 4, 0, True, timing_repeats=1)
    assert "not that it is the same sample" in result["summary"]
    result = handlers.answer_vlm(cache, None, 0, "hi", "greedy", "auto", {}, 4, 0, False, timing_repeats=1)
    assert "same sample" not in result["summary"] and result["same_answer"]


class _CountingCache:
    """A `PipelineCache` stand-in whose pipeline logs the acceptance of every call."""

    def __init__(self, cache, tab):
        self.zoo, self.calls, pipe = cache.zoo, [], cache.get(tab)

        class Logged:
            def __getattr__(_, name):
                return getattr(pipe, name)

            def __call__(_, *args, **kwargs):
                self.calls.append(kwargs["acceptance"])
                return pipe(*args, **kwargs)

        self.pipe = Logged()

    def get(self, tab):
        return self.pipe


@pytest.mark.parametrize("tab", ["c2i", "continuous", "vlm"])
def test_every_speedup_is_timed_warm_and_interleaved(cache, tab):
    """One warm-up run of each side, then interleaved timed runs (ABBA); the summary says what the number is."""
    counting = _CountingCache(cache, tab)
    if tab == "c2i":
        result = handlers.generate_image(counting, "c2i", 3, "jacobi", "auto", {}, 0)
    elif tab == "continuous":
        # quick: the slow tab (block: exact verification costs ~5x more; tests/pipelines check it)
        result = handlers.generate_continuous(counting, 3, 0, num_ar_steps=4, verify_mode="block", timing_repeats=1)
    else:
        result = handlers.answer_vlm(counting, None, 0, "hi", "greedy", "auto", {}, 4)
    if tab == "continuous":
        assert counting.calls == ["continuous", "none"] * 2  # warm-up (speculative first), then one timed run
        assert "1 timed run, after 1 warm-up run of each" in result["summary"]
    else:
        spec = "jacobi" if tab == "c2i" else "greedy"
        # warm-up (the speculative side first: its input checks run before any forward), then B A, A B, B A
        assert counting.calls == [spec, "none", spec, "none", "none", spec, spec, "none"]
        assert "median of 3 interleaved runs, after 1 warm-up run of each" in result["summary"]
    assert "host load and torch threads" in result["summary"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: handlers.generate_image(c, "c2i", 3, "exact", "auto", {}, "abc"), "seed must be a whole number"),
        (lambda c: handlers.generate_image(c, "c2i", 3, "exact", "auto", {}, -1), "seed must be in"),
        (lambda c: handlers.generate_image(c, "c2i", 3, "exact", "auto", {"tree_depth": 0.0}, 0), "tree_depth must be in [1, 32], got 0"),
        (lambda c: handlers.generate_image(c, "c2i", 3, "exact", "auto", {"tree_depth": 2.5}, 0), "tree_depth must be int"),
        (lambda c: handlers.generate_image(c, "c2i", 3, "relaxed", "auto", {"relaxation_delta": 1.5}, 0), "relaxation_delta must be in [0, 1]"),
        (lambda c: handlers.generate_image(c, "c2i", 3, "exact", "auto", {"group_size": None}, 0), "group_size needs a value"),
        (lambda c: handlers.generate_image(c, "c2i", 12, "exact", "auto", {}, 0), "class must be in [0, 9]"),
        (lambda c: handlers.generate_image(c, "c2i", 3, "exact", "auto", {}, 0, "x"), "guidance scale must be a number"),
        (lambda c: handlers.generate_image(c, "t2i", "  ", "jacobi", "auto", {}, 0), "prompt"),
        (lambda c: handlers.generate_continuous(c, 3, "1.5"), "seed must be a whole number"),
        (lambda c: handlers.answer_vlm(c, None, 0, "hi", "greedy", "auto", {"tree_top_k": 99}), "tree_top_k must be in [1, 32], got 99"),
        (lambda c: handlers.answer_vlm(c, None, "x", "hi", "greedy", "auto", {}), "held-out canvas must be a whole number"),
        (lambda c: handlers.answer_vlm(c, None, 0, "hi", "greedy", "auto", {}, 4, 0, True), "sample: acceptance greedy verifies greedy decoding"),
        (lambda c: handlers.generate_continuous(c, 3, 0, prefill_ratio=1.5), "prefill ratio must be finite and in [0, 1]"),
        (lambda c: handlers.generate_continuous(c, 3, 0, guidance_scale=1e4), "guidance scale must be finite and in [1, 100]"),
        (lambda c: handlers.generate_image(c, "c2i", 3, "exact", "auto", {}, 0, -1.0), "guidance scale must be in [0, 10000]"),
    ],
)  # fmt: skip
def test_bad_inputs_name_the_field(cache, call, message):
    """Every message names the page's field by its label, never by the pipeline's argument name."""
    with pytest.raises((ValueError, TypeError)) as err:
        call(cache)
    assert message in str(err.value)
    assert not any(name in str(err.value) for name in handlers.FIELD_LABELS), str(err.value)


def test_upload_that_is_not_an_image(cache, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not an image")
    with pytest.raises(ValueError, match="image upload: 'notes.txt' is not an image"):
        handlers.answer_vlm(cache, str(path), 0, "hi", "greedy", "auto", {})


def test_unreadable_images_get_one_message_that_names_no_path(tmp_path):
    """A folder, a missing file and a non-image are answered alike (nothing tells them apart), by base name."""
    from mmspec.demo.inputs import load_image

    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "folder.png").mkdir()
    messages = []
    for name in ("notes.txt", "folder.png", "missing.png"):
        with pytest.raises(ValueError) as err:
            load_image(str(tmp_path / name))
        messages.append(str(err.value))
        assert str(tmp_path) not in messages[-1] and "/" not in messages[-1] and "Error" not in messages[-1]
    assert messages == [
        f"image upload: {n!r} is not an image file" for n in ("notes.txt", "folder.png", "missing.png")
    ]


def test_page_messages_mask_paths():
    from mmspec.demo.inputs import page_message

    assert page_message("the 'vlm' tab is not served from '/srv/my zoo/x' (available: [])") == (
        "the 'vlm' tab is not served from '<path>' (available: [])"
    )
    assert (
        page_message("[Errno 2] No such file or directory: /etc/passwd")
        == "[Errno 2] No such file or directory: <path>"
    )
    assert page_message("see ../../etc/passwd or ~/.ssh/id") == "see <path> or <path>"
    kept = "tree_depth must be in [1, 32], got 0; tokens/s; 1/2"
    assert page_message(kept) == kept


def test_models_load_once_per_process(cache):
    first = cache.get("c2i")
    loads = cache.loads
    assert cache.get("c2i") is first and cache.loads == loads
    with pytest.raises(ValueError, match="not served"):
        PipelineCache(pipeline_folder=None, zoo=cache.zoo).get("unknown")


def test_a_saved_pipeline_folder_serves_its_tab(cache, tmp_path):
    folder = tmp_path / "pipe"
    cache.get("c2i").save_pretrained(folder)
    served = PipelineCache(pipeline_folder=folder)
    assert served.tabs == ["c2i"] and served.zoo is None
    result = handlers.generate_image(served, "c2i", 5, "jacobi", "auto", {}, 0, timing_repeats=1)
    reference = cache.get("c2i")(
        class_labels=[5], acceptance="jacobi", guidance_scale=2.0, generator=torch.Generator().manual_seed(0)
    )  # the handler's call, on the zoo's model
    assert torch.equal(result["trace"].origin, reference.trace.origin)  # the same model, from the folder
    with pytest.raises(ValueError, match="not served"):
        handlers.generate_continuous(served, 3, 0)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    with pytest.raises(ValueError, match="names 'StableDiffusionPipeline'"):
        PipelineCache(pipeline_folder=tmp_path / "other")


def test_fresh_page_values_are_consistent():
    """Optional knobs show empty (None + a placeholder; a gr.Number shows None as 0 without one), the VLM tab's
    acceptance is its preset's, and every field label of `FIELD_LABELS` is the start of a widget's label."""
    pytest.importorskip("gradio")
    from mmspec.demo.app import build_app

    config = build_app(PipelineCache()).config
    props = [c["props"] for c in config["components"]]
    for name, knob in KNOBS.items():
        if name in handlers.NOT_SHOWN:
            continue
        widgets = [
            p for p in props if str(p.get("label", "")).startswith(name) and str(p.get("info")).startswith(knob.help)
        ]
        assert widgets, name
        for p in widgets:
            if knob.optional:
                assert p.get("value") is None and p.get("placeholder"), (
                    f"{name}: a fresh page shows {p.get('value')!r}"
                )
    by_id = {p.get("elem_id"): p for p in props if p.get("elem_id")}
    for tab in ("c2i", "t2i", "vlm"):
        preset = by_id[f"{tab}-preset"]["value"]
        assert by_id[f"{tab}-acceptance"]["value"] == PRESETS[preset]["acceptance"], tab
    labels = [str(p.get("label", "")) for p in props]
    for name, label in handlers.FIELD_LABELS.items():
        assert any(text.startswith(label) for text in labels), f"{name}: no widget labelled {label!r}"


def test_method_widgets_come_from_the_registry():
    assert handlers.image_knob_names() == [name for name in KNOBS if name not in handlers.NOT_SHOWN]
    assert set(handlers.vlm_knob_names()) == {"num_draft_tokens", "tree_nodes", "tree_depth", "tree_top_k"}
    with pytest.raises(ValueError, match="does not show"):  # an adaptive preset is never run without its policy
        handlers.preset_values("exact-eagle-heuristic", handlers.image_knob_names())
    acceptance, drafter, values = handlers.preset_values("exact-eagle-tree", list(KNOBS))
    assert (acceptance, drafter) == ("exact", "eagle")
    assert values["tree_top_k"] == PRESETS["exact-eagle-tree"]["tree_top_k"] and values["jacobi_window"] == 16
    shown = handlers.knob_visibility("relaxed", "auto", list(KNOBS))
    assert shown["relaxation_delta"] and shown["tree_depth"] and not shown["jacobi_window"]
    shown = handlers.knob_visibility("jacobi", "auto", list(KNOBS))
    assert shown["jacobi_window"] and shown["coupling"] and not shown["relaxation_delta"] and not shown["tree_depth"]


@pytest.mark.parametrize(
    "argv, flag",
    [(["--port", "abc"], "--port"), (["--port", "70000"], "--port"), (["--zoo", "/no/such/zoo"], "--zoo"),
     (["--pipeline-folder", "."], "--pipeline-folder"), (["--device", "nope"], "--device"),
     (["--zoo", ".", "--pipeline-folder", "."], "--pipeline-folder"), (["--threads", "-1"], "--threads")],
)  # fmt: skip
def test_cli_usage_errors_before_any_model_loads(argv, flag, capsys, monkeypatch):
    from mmspec.demo import __main__ as cli

    err = usage_error_line(cli.main, argv, PipelineCache, "_load", capsys, monkeypatch)
    assert err.startswith("mmspec demo: error: argument " + flag)


def test_cli_defaults():
    from mmspec.demo import __main__ as cli
    from mmspec.models import DEFAULT_ZOO

    parser = cli.make_parser()
    args = parser.parse_args([])
    cli.check_args(parser, args)
    assert (args.host, args.port, args.share, args.zoo) == ("127.0.0.1", 7860, False, str(DEFAULT_ZOO))
    assert args.tabs == ["c2i", "t2i", "continuous", "vlm"]


def test_cli_serves_loopback_without_gradio_error_texts(monkeypatch):
    """`mmspec demo` binds 127.0.0.1 by default and launches with show_error=False (Gradio's own exception texts,
    which name server paths, never reach a client)."""
    gradio = pytest.importorskip("gradio")
    from mmspec.demo import __main__ as cli

    launched = {}
    monkeypatch.setattr(gradio.Blocks, "launch", lambda self, **kwargs: launched.update(kwargs))
    monkeypatch.setattr(PipelineCache, "_load", lambda *a, **k: pytest.fail("a model loaded at start-up"))
    assert cli.main([]) == 0
    assert launched["server_name"] == "127.0.0.1" and launched["show_error"] is False and not launched["share"]


def test_the_cli_table_line_dispatches_to_the_demo(capsys):
    """The line the merger adds to `mmspec.cli.COMMANDS` reaches `mmspec.demo.__main__.main`."""
    from mmspec.cli.args import dispatch

    line = {"demo": ("mmspec.demo.__main__:main", "serve the Gradio demo")}
    with pytest.raises(SystemExit) as exit_info:
        dispatch(line, ["demo", "--port", "0"], "mmspec", "")
    assert exit_info.value.code == 2
    assert "mmspec demo: error: argument --port" in capsys.readouterr().err


def test_cli_port_in_use_is_a_usage_error_before_any_model_loads(capsys, monkeypatch):
    pytest.importorskip("gradio")
    import socket

    from mmspec.demo import __main__ as cli

    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before the server could listen")

    monkeypatch.setattr(PipelineCache, "_load", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["--port", str(port)])
    assert exit_info.value.code == 2
    assert f"argument --port: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_knob_only_the_speculative_call_takes_is_refused_before_any_forward(cache, monkeypatch):
    """The plain and speculative calls are timed side by side; a knob only the speculative call takes (the prefill
    ratio) must be refused by the pipeline's input checks before any model runs, not after a whole plain generation
    (the user waited ~10 s for the error)."""
    pipe = cache.get("continuous")
    forwards = []
    original = pipe.transformer.features  # MAR's one encoder-decoder pass per AR step
    monkeypatch.setattr(pipe.transformer, "features", lambda *a, **k: forwards.append(1) or original(*a, **k))
    with pytest.raises(ValueError, match="prefill ratio"):
        handlers.generate_continuous(cache, 3, 0, prefill_ratio=1.5, timing_repeats=1)
    assert forwards == []
