"""README.md and every page of docs/ as a user pastes them: every ```python block runs on a fresh checkout (its own Python process, the working
directory outside the repository, so relative paths are caught; the process is forked from one that has imported
the third-party libraries only, see `ZYGOTE`), and every `mmspec ...` / `python -m mmspec...`
command of README.md and docs/*.md parses with the real argument parsers (a renamed or removed flag fails here);
README.md stays a front page (at most 200 lines) that links every docs page.

Blocks marked `<!-- readme-test: official files -->` load official LlamaGen / MAR checkpoints by file name: they run
after `tests/readme_official_files.install()` has written tiny stand-ins of those files, in the official formats,
under the README's names in the working directory (see that module). Blocks marked `<!-- readme-test: online -->`
load a hub model on a GPU (e.g. `deepseek-ai/Janus-Pro-1B` in bfloat16 on "cuda"): they run as pasted except that
`"cuda"` becomes `"cpu"` and the pipeline's `from_pretrained` of a hub id reads a tiny random model of the same class
(`tests/readme_online_models.py`), after the hub id went through the pipeline's own id checks."""

import argparse
import importlib
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
OFFICIAL = "<!-- readme-test: official files -->"
ONLINE = "<!-- readme-test: online -->"
TIMEOUT_S = 240  # per block (the VLM block's first run on a machine dequantizes SmolLM2, ~25 s)


def python_blocks(text):
    """[(first line number, code, marker or None)] of every ```python block."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            marked = lines[i - 1].strip() if i > 0 and lines[i - 1].strip() in (OFFICIAL, ONLINE) else None
            end = lines.index("```", i + 1)
            blocks.append((i + 2, "\n".join(lines[i + 1 : end]) + "\n", marked))
            i = end
        i += 1
    return blocks


def _commands_in(line):
    """`mmspec ...` / `python -m mmspec...` / `torchrun ... -m mmspec...` commands of one shell line, as
    (module or None for the `mmspec` entry point, argv)."""
    found = []
    for part in re.split(r"&&|;|\|\|", line):
        words = [w for w in shlex.split(part, comments=True) if w != "..."]
        words = [w.strip("[]") for w in words if w.strip("[]")]  # optional arguments: `[--batch-size 8]`
        if not words:
            continue
        if Path(words[0]).name == "mmspec":
            found.append((None, words[1:]))
        elif "-m" in words and words[words.index("-m") + 1].startswith("mmspec"):
            at = words.index("-m")
            found.append((words[at + 1], words[at + 2 :]))
    return found


def shell_commands(text):
    """Every mmspec command of the README, once: in ```bash blocks (continuation lines joined) and in inline code
    spans (those listing alternatives, `a | b` or `a / b`, are names, not commands). A command without any option
    names a command in prose: it gets `--help` (it must exist); the others must parse as written."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            commands += [(line.strip(), *c) for c in _commands_in(line)]
    for span in re.findall(r"`([^`\n]+)`", text):
        if re.match(r"((\.venv/bin/)?mmspec|python3? -m mmspec)\b", span) and not re.search(r" \| | / ", span):
            commands += [(span, *c) for c in _commands_in(span)]
    unique = {}
    for text_, module, argv in commands:
        if not any(word.startswith("-") for word in argv):  # a command named in prose: it exists, with its --help
            argv = [*argv, "--help"]
        unique.setdefault((module, tuple(argv)), (text_, module, argv))
    return list(unique.values())


BLOCKS = [(f"{page.relative_to(ROOT)}:{line}", line, code, marked) for page in PAGES
          for line, code, marked in python_blocks(page.read_text())]  # fmt: skip
COMMANDS = list({(module, tuple(argv)): (text, module, argv) for page in PAGES
                 for text, module, argv in shell_commands(page.read_text())}.values())  # fmt: skip


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert DOCS and all(f"(docs/{page.name})" in text for page in DOCS)


def test_the_readme_has_the_blocks_and_commands_this_test_runs():
    markers = [marked for *_, marked in BLOCKS]
    assert len(BLOCKS) >= 7 and markers.count(OFFICIAL) == 2 and markers.count(ONLINE) == 2
    assert len(COMMANDS) >= 20 and any(module for _, module, _ in COMMANDS)


# A block's process is forked from this one, started once per test process like `python -c` (outside the
# repository, with the blocks' environment): it has imported the heavy third-party libraries (~10 s per process on a
# loaded host, 14 blocks), never mmspec, which every block imports itself. The child runs the block as `python -c`
# would: its working directory, stdout / stderr to files, a fresh `__main__` module (no name of this script), then a
# normal interpreter exit with the block's status (atexit handlers, non-daemon threads joined).
ZYGOTE = """
import json, os, sys
import numpy, PIL.Image, safetensors.torch, scipy.stats, torch, torch._dynamo, transformers, diffusers
from diffusers import DiffusionPipeline
from transformers import AutoProcessor, JanusForConditionalGeneration, LlamaForCausalLM, LlavaForConditionalGeneration

def child(request):
    import builtins, traceback, types
    os.chdir(request["cwd"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                           (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        os.dup2(os.open(path, mode), fd)
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"], sys.argv = main, ["-c"]
    try:
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)
    raise SystemExit(0)

print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"status": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
"""


@pytest.fixture(scope="module")
def block_runner(tmp_path_factory):
    """`run(code, cwd)` -> (exit status, stderr) of `code` in its own process, forked from the zygote."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "TQDM_DISABLE": "1"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=tmp_path_factory.mktemp("zygote"), env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)  # fmt: skip
    pending = bytearray()

    def reply(timeout):
        """The zygote's next JSON line, or None after `timeout` s (unbuffered: a line never waits in a buffer)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in pending:
            ready, _, _ = select.select([zygote.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(zygote.stdout.fileno(), 4096) if ready else b""
            if not chunk:
                return None
            pending.extend(chunk)
        line, _, rest = bytes(pending).partition(b"\n")
        pending[:] = rest
        return json.loads(line)

    assert reply(TIMEOUT_S) is not None, "the zygote process did not start"

    def run(code, cwd, where):
        out, err = cwd.with_name(f"{cwd.name}.stdout"), cwd.with_name(f"{cwd.name}.stderr")  # beside it, not in it
        request = {"code": code, "cwd": str(cwd), "out": str(out), "err": str(err)}
        zygote.stdin.write((json.dumps(request) + "\n").encode())
        forked = reply(60)
        assert forked is not None, "the zygote process died"
        pid = forked["pid"]
        done = reply(TIMEOUT_S)
        if done is None:
            os.kill(pid, signal.SIGKILL)
            reply(60)
            pytest.fail(f"{where}: the block ran longer than {TIMEOUT_S} s")
        stderr = err.read_text()
        out.unlink(), err.unlink()
        return done["status"], stderr

    yield run
    zygote.stdin.close()
    zygote.wait(60)


@pytest.mark.zoo
@pytest.mark.parametrize("where, line, code, official", BLOCKS, ids=[where for where, *_ in BLOCKS])
def test_python_block_runs_as_pasted(where, line, code, official, tmp_path, block_runner):
    prelude = ""
    if official == OFFICIAL:
        prelude = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import readme_official_files; "
                   "readme_official_files.install(); del sys.path[0]\n")  # fmt: skip
    elif official == ONLINE:
        prelude = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import readme_online_models; "
                   "readme_online_models.install(); del sys.path[0]\n")  # fmt: skip
        code = code.replace('"cuda"', '"cpu"')
    status, stderr = block_runner(prelude + code, tmp_path, where)
    assert status == 0, f"{where} fails as pasted:\n{stderr[-3000:]}"


class _Parsed(BaseException):
    """Raised right after argparse accepted a command line: nothing is loaded or run."""


@pytest.mark.parametrize(
    "text, module, argv", COMMANDS, ids=[" ".join([c[1] or "mmspec", *c[2]])[:70] for c in COMMANDS]
)
def test_shell_command_parses(text, module, argv, monkeypatch, capsys):
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        namespace = real(self, args, namespace)
        raise _Parsed(namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    if module is None:
        main = importlib.import_module("mmspec.cli").main
    else:  # `python -m package` runs package.__main__
        found = importlib.import_module(module)
        main = (importlib.import_module(f"{module}.__main__") if hasattr(found, "__path__") else found).main
    try:
        main(argv)
    except _Parsed:
        return
    except SystemExit as exit_:
        # `--help` prints and exits 0; anything else (unknown flag, bad value, unknown command) is exit 2
        assert exit_.code == 0 and "--help" in argv, f"{text!r}: {capsys.readouterr().err.strip()}"
        return
    pytest.fail(f"{text!r} never reached an argument parser")
