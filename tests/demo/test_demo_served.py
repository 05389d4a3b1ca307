"""The demo served on loopback: driven with `gradio_client` (one call per tab, bad inputs answered with a message
while the server keeps serving) and by a real browser (Debian's chromium through Playwright: it generates in every
tab and checks that the images, maps and stats appear; screenshots go to a tmp dir).

The browser test skips when chromium or playwright is missing, except in CI (`CI` set), where it fails instead.
`MMSPEC_DEMO_SCREENSHOT=1` also writes the README's screenshot, `assets/demo/screenshot.png`.
"""

import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image


try:
    import gradio  # noqa: F401 -- the app needs it (imported below through mmspec.demo.app)
    import gradio_client
except ImportError as err:  # the `demo` extra; CI installs it, so there a missing one is a failure
    if os.environ.get("CI"):
        raise
    pytest.skip(f"the demo needs gradio and gradio_client ({err})", allow_module_level=True)

from mmspec.demo.app import CSS, TAB_TITLES, build_app  # noqa: E402


pytestmark = pytest.mark.zoo
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
SCREENSHOT = Path(__file__).resolve().parents[2] / "assets" / "demo" / "screenshot.png"
KNOBS_DEFAULT = (None, 24, None, 1, 16, 0.2, None, 25, 0.15, 1.0, 16, "repeat", True, 1, 3, "optimal")  # fmt: skip


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(demo_cache):
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    torch.set_num_threads(1)
    cache = demo_cache  # one load per tab, shared with test_demo.py (tests/demo/conftest.py)
    demo = build_app(cache)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, css=CSS)
    try:
        yield f"http://127.0.0.1:{port}/", cache
    finally:
        demo.close()


def _is_image(path, varied=True):
    """A 256 x 256 image; `varied`: not a blank (a sample shows a digit; a map may be one colour)."""
    with Image.open(path) as image:
        return image.size == (256, 256) and (not varied or np.asarray(image.convert("L")).std() > 5)


def test_gradio_client_every_tab(served):
    url, cache = served
    from mmspec.demo.handlers import image_knob_names

    assert len(KNOBS_DEFAULT) == len(image_knob_names())
    client = gradio_client.Client(url, verbose=False)
    # c2i as an API client that does not send the quick-timing checkbox (the default timing); the others tick it
    cases = (("c2i", 3, ("exact", "eagle"), ()), ("t2i", "a thin four", ("jacobi", "auto"), (True,)))
    for tab, condition, method, quick in cases:
        plain, spec, amap, legend, summary, _plot = client.predict(
            condition, *method, "0", 2.0, *KNOBS_DEFAULT, *quick, api_name=f"/generate_{tab}"
        )
        assert _is_image(plain) and _is_image(spec) and _is_image(amap, varied=False), tab
        assert "speedup" in summary and "target forwards" in summary and "round 0" in legend
        runs = "1 timed run, after 1 warm-up" if quick else "median of 3 interleaved runs, after 1 warm-up"
        assert runs in summary, tab
    plain, spec, amap, legend, summary, _plot = client.predict(3, "0", 4.0, 4, "block", 4, 0.15, True,
                                                               api_name="/generate_continuous")  # fmt: skip
    assert _is_image(spec) and _is_image(amap, varied=False) and "acceptance rate" in summary and "resampled" in legend
    image, answer, plain_text, summary = client.predict(
        None, 0, "Describe the image.", "greedy", "eagle", 6, "0", False, 1.0, None,  24, None, 1, True,
        api_name="/ask_vlm"
    )  # fmt: skip
    assert _is_image(image) and "tok-accepted" in answer and plain_text and "τ" in summary
    assert cache.loads == 4  # one load per tab, not per call


def test_gradio_client_bad_inputs_get_a_message_and_the_server_keeps_serving(served, tmp_path):
    url, cache = served
    client = gradio_client.Client(url, verbose=False)
    with pytest.raises(Exception, match="seed must be a whole number, got 'abc'"):
        client.predict(3, "exact", "auto", "abc", 2.0, *KNOBS_DEFAULT, api_name="/generate_c2i")
    from mmspec.demo.handlers import image_knob_names

    knobs = list(KNOBS_DEFAULT)
    knobs[image_knob_names().index("tree_depth")] = 0
    with pytest.raises(Exception, match=r"tree_depth must be in \[1, 32\]"):
        client.predict(3, "exact", "auto", "0", 2.0, *knobs, api_name="/generate_c2i")
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    with pytest.raises(Exception, match="is not an image"):
        client.predict(gradio_client.handle_file(str(text)), 0, "hi", "greedy", "auto", 4, "0", False, 1.0, None,
                        24, None, 1, api_name="/ask_vlm")  # fmt: skip
    cache.get("c2i")  # loaded (by every_tab, or now)
    loads = cache.loads
    _, spec, amap, _, summary, _ = client.predict(
        3, "exact", "auto", "1", 2.0, *KNOBS_DEFAULT, True, api_name="/generate_c2i"
    )  # quick timing
    assert _is_image(spec) and _is_image(amap, varied=False) and "speedup" in summary
    assert cache.loads == loads  # a served call reuses the loaded pipeline


def test_hand_made_file_paths_are_refused_without_naming_a_path(served, tmp_path, monkeypatch):
    """A client sends `FileData` payloads naming server paths instead of uploading: each is refused with a message
    that names no path (nor the exception, which would tell a folder from a missing file), and the server keeps
    serving."""
    from gradio.utils import get_upload_folder
    from gradio_client.client import Endpoint

    from mmspec.demo.handlers import held_out_canvas

    url, _ = served
    upload_folder = str(get_upload_folder())
    outside = tmp_path / "outside.png"  # a real image, outside every upload folder
    held_out_canvas(1).save(outside)
    paths = {
        "outside": str(outside),
        "traversal": f"{upload_folder}/../../../etc/passwd",
        "folder": upload_folder,  # inside the upload folder: passes Gradio's own check
        "missing": f"{upload_folder}/no-such-upload.png",
        "environ": "/proc/self/environ",
    }
    upload_client = gradio_client.Client(url, verbose=False)
    with monkeypatch.context() as patch:  # send the payload as it is, instead of uploading the client's file
        patch.setattr(Endpoint, "_upload_file", lambda self, f, data_index: f)
        client = gradio_client.Client(url, verbose=False)
        for case, path in paths.items():
            payload = {"path": path, "meta": {"_type": "gradio.FileData"}}
            with pytest.raises(Exception) as err:
                client.predict(payload, 0, "hi", "greedy", "auto", 2, "0", False, 1.0, None, 24, None, 1,
                               api_name="/ask_vlm")  # fmt: skip
            message = str(err.value)
            for leak in ("/", "\\", "passwd", "environ", "no-such-upload", "outside", "Error:", "IsADirectory",
                         "FileNotFound"):  # fmt: skip
                assert leak not in message, f"{case}: the message names {leak!r}: {message}"
    import httpx

    for path in (str(outside), "/etc/passwd", "/proc/self/environ"):  # nor does Gradio's file route serve them
        assert httpx.get(f"{url}gradio_api/file={path}").status_code == 403, path
    answer = upload_client.predict(gradio_client.handle_file(str(outside)), 0, "How many digits are there?", "greedy",
                                   "auto", 4, "0", False, 1.0, None,  24, None, 1, True,
                                   api_name="/ask_vlm")  # fmt: skip
    assert _is_image(answer[0]) and answer[2]  # an uploaded file is served as before


def test_progress_is_reported_and_users_are_queued(served):
    url, _ = served
    client = gradio_client.Client(url, verbose=False)
    job = client.submit(3, "0", 4.0, 4, "block", 4, 0.15, True, api_name="/generate_continuous")  # quick timing
    seen = []
    while not job.done():
        status = job.status()
        seen += [(p.index, p.length) for p in status.progress_data or []]
        time.sleep(0.01)  # a busy poll holds the GIL the server's threads (in this process) need to generate
    assert _is_image(job.result()[1]) and "1 timed run, after 1 warm-up run of each" in job.result()[4]
    assert seen and all(length == 64 for _, length in seen)  # the pipeline's tqdm bar, in tokens
    # two users at once: both are served (one after the other: concurrency 1 on the shared models)
    jobs = [
        client.submit(d, "jacobi", "auto", "0", 2.0, *KNOBS_DEFAULT, True, api_name="/generate_c2i") for d in (1, 2)
    ]  # quick timing: the queue is the point here, the default repeats run in every_tab
    results = [job.result() for job in jobs]
    assert all(_is_image(r[1]) and "speedup" in r[4] and "1 timed run" in r[4] for r in results)


def _browser():
    """(playwright's sync_playwright, chromium path), or skip / fail (CI) when either is missing."""
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        missing.append("playwright (pip install playwright)")
    if not Path(CHROMIUM).is_file():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"the browser test needs {' and '.join(missing)} in CI")
        pytest.skip(f"needs {' and '.join(missing)}")
    return sync_playwright


def _image_src(page, selector):
    """The `src` of the loaded `<img>` under `selector`, waiting until it differs from `old` (None: any) and has
    loaded; checks it is 256 pixels wide."""
    page.wait_for_function(
        """([s, old]) => { const i = document.querySelector(s + ' img');
                          return i && i.src !== old && i.complete && i.naturalWidth === 256; }""",
        arg=[selector, None],
        timeout=120_000,
    )
    return page.eval_on_selector(selector + " img", "i => i.src")


def _new_image(page, selector, old):
    page.wait_for_function(
        """([s, old]) => { const i = document.querySelector(s + ' img');
                          return i && i.src !== old && i.complete && i.naturalWidth === 256; }""",
        arg=[selector, old],
        timeout=120_000,
    )


def test_real_browser_every_tab(served, tmp_path):
    sync_playwright = _browser()
    from playwright.sync_api import expect

    url, _ = served
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(url, wait_until="networkidle")
            for tab in ("c2i", "t2i", "continuous"):
                page.get_by_role("tab", name=TAB_TITLES[tab]).click()
                if tab == "continuous":
                    page.locator("#continuous-steps input").fill("4")
                page.locator(f"#{tab}-quick input").check()  # 1 timed run: the page, not the timing, is the point
                page.locator(f"#{tab}-generate").click()
                for part in ("plain", "speculative", "map"):
                    _image_src(page, f"#{tab}-{part}")
                expect(page.locator(f"#{tab}-stats")).to_contain_text("speedup", timeout=60_000)
                expect(page.locator(f"#{tab}-stats")).to_contain_text("target forwards")
                expect(page.locator(f"#{tab}-stats")).to_contain_text("1 timed run, after 1 warm-up")  # quick ticked
                expect(page.locator(f"#{tab}-legend")).to_contain_text("resampled")
                expect(page.locator(f"#{tab}-histogram img, #{tab}-histogram svg").first).to_be_visible(timeout=60_000)
                page.screenshot(path=shots / f"{tab}.png", full_page=True)
                if tab == "c2i" and os.environ.get("MMSPEC_DEMO_SCREENSHOT"):
                    _save_readme_screenshot(shots / "c2i.png")
            page.get_by_role("tab", name=TAB_TITLES["vlm"]).click()
            page.locator("#vlm-max-new input").fill("8")
            page.locator("#vlm-quick input").check()
            page.locator("#vlm-generate").click()
            expect(page.locator("#vlm-answer .tok-accepted").first).to_be_visible(timeout=120_000)
            _image_src(page, "#vlm-image")
            expect(page.locator("#vlm-stats")).to_contain_text("tokens/s", timeout=30_000)
            expect(page.locator("#vlm-stats")).to_contain_text("1 timed run, after 1 warm-up")
            expect(page.locator("#vlm-plain-text textarea")).not_to_have_value("", timeout=30_000)
            page.screenshot(path=shots / "vlm.png", full_page=True)
            # a bad seed: a visible message; then a good one generates again (the server kept serving)
            page.get_by_role("tab", name=TAB_TITLES["c2i"]).click()
            old = page.eval_on_selector("#c2i-map img", "i => i.src")
            page.locator("#c2i-seed textarea, #c2i-seed input").first.fill("abc")
            page.locator("#c2i-generate").click()
            toast = page.locator('[data-testid="toast-text"]', has_text="seed must be a whole number, got 'abc'")
            expect(toast).to_be_visible(timeout=30_000)
            page.wait_for_timeout(500)  # the toast's fade-in
            page.screenshot(path=shots / "error.png")
            page.locator("#c2i-seed textarea, #c2i-seed input").first.fill("1")
            page.locator("#c2i-generate").click()
            _new_image(page, "#c2i-map", old)
            expect(page.locator("#c2i-stats")).to_contain_text("speedup", timeout=60_000)
        finally:
            browser.close()
    assert sorted(p.name for p in shots.iterdir()) == ["c2i.png", "continuous.png", "error.png", "t2i.png", "vlm.png"]


def _save_readme_screenshot(path):
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(path) as image:
        image = image.convert("RGB")
        image.thumbnail((1000, 1400))
        image.quantize(128).save(SCREENSHOT, optimize=True)
    shutil.copystat(path, SCREENSHOT)
