"""The layer rule, read from the source: every import of every module (top level and inside functions, relative
ones resolved) points to the same layer or a lower one, and no modules import each other in a cycle.

Layers, bottom up (`docs/architecture.md`):

    base         mmspec (the lazy facade), random, philox, stats, cache, sampling, checks, memory, timing, counting,
                 user_cache, data
    verify       mmspec.verify
    methods      mmspec.methods (the registry)
    decoding     mmspec.decoding (the engine, the Drafter protocol)
    models       mmspec.models (one folder per family)
    drafters     mmspec.drafters, mmspec.compressors
    pipelines    mmspec.pipelines
    applications mmspec.cli, mmspec.train, mmspec.eval, mmspec.demo

No allow-list: a module that needs something from above takes it as an argument or a protocol."""

import ast
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"mmspec": ROOT / "mmspec", "mmspec.pipelines": ROOT / "pipelines", "mmspec.eval": ROOT / "eval"}
LAYERS = (
    (
        "base",
        (
            "mmspec",
            "mmspec.random",
            "mmspec.philox",
            "mmspec.stats",
            "mmspec.cache",
            "mmspec.sampling",
            "mmspec.checks",
            "mmspec.memory",
            "mmspec.timing",
            "mmspec.counting",
            "mmspec.user_cache",
            "mmspec.data",
        ),
    ),
    ("verify", ("mmspec.verify",)),
    ("methods", ("mmspec.methods",)),
    ("decoding", ("mmspec.decoding",)),
    ("models", ("mmspec.models",)),
    ("drafters", ("mmspec.drafters", "mmspec.compressors")),
    ("pipelines", ("mmspec.pipelines",)),
    ("applications", ("mmspec.cli", "mmspec.train", "mmspec.eval", "mmspec.demo")),
)


def modules(sources=SOURCES):
    """{dotted name: file} of every module of the package (pipelines/ and eval/ as mmspec.pipelines / mmspec.eval)."""
    found = {}
    for prefix, folder in sources.items():
        for file in sorted(folder.rglob("*.py")):
            parts = [p for p in file.relative_to(folder).with_suffix("").parts if p != "__init__"]
            if prefix == "mmspec" and parts and parts[0] in ("pipelines", "eval"):
                continue
            found[".".join([prefix, *parts])] = file
    return found


def layer_of(name):
    """Index of the layer `name` belongs to (the longest matching prefix; the bare `mmspec` prefix is the package
    facade alone), None for a module outside every layer."""
    if name == "mmspec":
        return 0
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (
                prefix != "mmspec"
                and (name == prefix or name.startswith(prefix + ".") or name.startswith(prefix + "_"))
                and (best is None or len(prefix) > best[1])
            ):
                best = (index, len(prefix))
    return None if best is None else best[0]


def imports_of(name, file, known):
    """[(line, imported module)] of every import statement in `file`, top level or not; `from a import b` names
    `a.b` when that is a module, else `a`."""
    tree = ast.parse(file.read_text(), filename=str(file))
    package = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            subs = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in known]
            found += [(node.lineno, sub) for sub in subs] or [(node.lineno, module)]
    return [(line, target) for line, target in found if target == "mmspec" or target.startswith("mmspec.")]


def upward_imports(sources=SOURCES):
    known = modules(sources)
    bad = []
    for name, file in known.items():
        own = layer_of(name)
        for line, target in imports_of(name, file, known):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                bad.append(f"{file.relative_to(ROOT)}:{line}: {name} ({LAYERS[own][0]}) imports {target} "
                           f"({LAYERS[theirs][0]})")  # fmt: skip
    return bad


def import_cycles(sources=SOURCES):
    """Strongly connected components (size > 1) of the module import graph (Tarjan)."""
    known = modules(sources)
    graph = {}
    for name, file in known.items():
        targets = set()
        for _, target in imports_of(name, file, known):
            while target not in known and "." in target:  # `from a.b import name` of a module a.b
                target = target.rsplit(".", 1)[0]
            if target in known and target != name and not name.startswith(target + "."):
                targets.add(target)  # a package's own __init__ is not a cycle with its children
        graph[name] = targets
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    assert [name for name in modules() if layer_of(name) is None] == []


def test_imports_only_point_down():
    assert upward_imports() == []


def test_no_import_cycles():
    assert import_cycles() == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from mmspec.pipelines import SpeculativeVLMPipeline\n", "imports mmspec.pipelines"),
        ("def f():\n    from mmspec.cli import main\n", "imports mmspec.cli"),
    ],
)
def test_an_upward_import_is_caught(tmp_path, source, expected):
    """The scan on a copy of the layout with one upward import planted in the engine (at top level, in a function)."""
    for prefix in ("mmspec", "pipelines", "eval"):
        (tmp_path / prefix).mkdir()
        (tmp_path / prefix / "__init__.py").write_text("")
    (tmp_path / "mmspec" / "decoding").mkdir()
    (tmp_path / "mmspec" / "decoding" / "__init__.py").write_text("")
    (tmp_path / "mmspec" / "decoding" / "loop.py").write_text(source)
    (tmp_path / "mmspec" / "cli.py").write_text("")
    sources = {
        "mmspec": tmp_path / "mmspec",
        "mmspec.pipelines": tmp_path / "pipelines",
        "mmspec.eval": tmp_path / "eval",
    }
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert any(expected in line for line in upward_imports(sources))
    finally:
        ROOT = saved


def test_a_cycle_is_caught(tmp_path):
    (tmp_path / "mmspec").mkdir()
    (tmp_path / "mmspec" / "__init__.py").write_text("")
    (tmp_path / "mmspec" / "a.py").write_text("from mmspec import b\n")
    (tmp_path / "mmspec" / "b.py").write_text("def f():\n    import mmspec.a\n")
    assert import_cycles({"mmspec": tmp_path / "mmspec"}) == [["mmspec.a", "mmspec.b"]]


def test_the_engine_loads_no_model_family():
    """`import mmspec.decoding` loads no model family, and neither transformers nor diffusers (a fresh process)."""
    import subprocess
    import sys

    code = ("import mmspec.decoding, sys; print(sorted(m for m in sys.modules if m.startswith(('mmspec.models', "
            "'transformers', 'diffusers'))))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_import_mmspec_is_torch_free_and_offers_the_pipelines_and_load():
    """`import mmspec` loads no torch; the four pipelines and `load` are there on first use (a fresh process)."""
    import subprocess
    import sys

    code = ("import sys, mmspec; print('torch' in sys.modules); "
            "print(mmspec.SpeculativeARImagePipeline.__name__, mmspec.SpeculativeContinuousARPipeline.__name__, "
            "mmspec.SpeculativeJanusPipeline.__name__, mmspec.SpeculativeVLMPipeline.__name__, mmspec.load.__name__)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "SpeculativeARImagePipeline", "SpeculativeContinuousARPipeline",
                                   "SpeculativeJanusPipeline", "SpeculativeVLMPipeline", "load"]  # fmt: skip
