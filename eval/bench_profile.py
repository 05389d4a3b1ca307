"""`mmspec bench profile`: a CPU proxy of what a round would cost on an accelerator, counted, not timed.

For every pipeline of ``--pipeline`` (default all of `mmspec.eval.zoo_runs.ZOO_PIPELINES`) and every method of
``--methods`` (default: every main method the zoo has drafters for), at every ``--batch-size``: one warm-up call,
then one counted call (same seed) under `mmspec.counting.HostReads` (which forces the accelerator branches) and
`mmspec.counting.OpCount`. Inside the decoding loop (`mmspec.decoding.decode`; MAR: `decode_masked`) the target's
forward runs in phase ``target`` and the drafter's ``propose`` / ``commit`` in phase ``drafter`` (MAR: the draft
runner's features and diffusion head); everything else is ``engine``. The objects' methods are wrapped for the call
only and restored after it.

Per row (``rows[pipeline][method][batch]``):
``rounds`` (target forwards inside the loop, prefill excluded), ``tau`` (the call's tokens per target forward,
prefill included: `SpecStats.step_compression`), ``host_reads_per_call`` (the whole call: prefill, loop, output),
``host_reads_per_round`` (inside the loop / rounds), ``host_reads_where`` (op -> reads in the call),
``ops_per_call``, ``ops_per_round`` (``target`` / ``drafter`` / ``engine`` / ``total``: dispatched aten ops inside
the loop / rounds; each is a kernel launch on a GPU unless captured in a graph), ``launch_bound_speedup``
(``tau / tau(plain) * ops_per_round.total(plain) / ops_per_round.total``: the speedup if every op cost the same
launch time and nothing else, against plain at the same batch), ``captured_ops_per_round`` (the same split with
everything captured, ``enable_compile(backend="eager", verify=True)``: a graph's replay counts as one launch in the
phase that calls it; null with ``captured_reason`` where the pipeline has no ``enable_compile`` or the capture
failed), and ``compile`` (batch 1 only:
``torch._dynamo.explain`` of the target forward after ``pipe.enable_compile()``: ``graph_count``,
``graph_break_count``, ``break_reasons``; null with ``compile_reason`` where the pipeline has no
``enable_compile``).
"""

import contextlib
import logging
import platform

import torch

from mmspec.cli.args import DEFAULT_ZOO, MAX_BATCH, int_in_range, int_list_in_range, names_of
from mmspec.counting import forced_accelerator
from mmspec.eval.zoo_runs import METHODS, ZOO_PIPELINES


logger = logging.getLogger(__name__)

ALL_METHODS = tuple(dict.fromkeys(m for p in ZOO_PIPELINES for m in METHODS[p]))
MAX_NEW_TOKENS = 4096
MAX_AR_STEPS = 256


def add_arguments(parser):
    parser.add_argument("--zoo", default=DEFAULT_ZOO, help="the zoo folder (mnist-c2i, mnist-vlm, ...)")
    parser.add_argument("--pipeline", type=names_of(ZOO_PIPELINES), default=list(ZOO_PIPELINES),
                        help="comma list of " + ",".join(ZOO_PIPELINES))  # fmt: skip
    parser.add_argument("--methods", type=names_of(ALL_METHODS), default=None,
                        help="comma list (default: every main method of each pipeline the zoo has drafters for); a "
                             "method no chosen pipeline has is refused")  # fmt: skip
    parser.add_argument("--batch-size", type=int_list_in_range(1, MAX_BATCH), default=[1, 4],
                        help="items per call (comma list)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int_in_range(1, MAX_NEW_TOKENS), default=16,
                        help="VLM answer length")  # fmt: skip
    parser.add_argument("--num-ar-steps", type=int_in_range(1, MAX_AR_STEPS), default=16, help="MAR's AR steps")
    parser.add_argument("--no-compile", action="store_true", help="skip the compile columns (null, with the reason)")
    parser.add_argument("--quiet", action="store_true", help="no progress log")


def check_args(parser, args):
    """Before any model loads: every chosen pipeline's target folder exists in the zoo, every method asked for is a
    method of some chosen pipeline, and every pipeline has at least one of them with its drafter in the zoo."""
    from pathlib import Path

    from mmspec.eval.zoo_runs import TARGET_FOLDERS, available_methods

    for p in args.pipeline:
        folder = Path(args.zoo) / TARGET_FOLDERS[p]
        if not folder.is_dir():
            parser.error(f"argument --zoo: {str(folder)!r} ({p}'s target) does not exist")
    if args.methods is not None:
        known = {m for p in args.pipeline for m in METHODS[p]}
        bad = [m for m in args.methods if m not in known]
        if bad:
            parser.error(
                f"argument --methods: {','.join(bad)} is not a method of --pipeline {','.join(args.pipeline)}"
            )
    for p in args.pipeline:
        have = available_methods(p, args.zoo)
        if args.methods is not None and not set(args.methods) & set(have):
            parser.error(f"argument --methods: none of {','.join(args.methods)} runs on {p} with the zoo "
                         f"{args.zoo!r} (it has {','.join(have)})")  # fmt: skip


@contextlib.contextmanager
def _patched(obj, name, wrapper_of):
    """Replace `obj.name` by `wrapper_of(original)` for the block (an instance attribute, removed after)."""
    had = name in vars(obj) if hasattr(obj, "__dict__") else False
    original = getattr(obj, name)
    setattr(obj, name, wrapper_of(original))
    try:
        yield original
    finally:
        if had:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def _in_phase(counter, phase):
    def wrap(fn):
        def inner(*a, **k):
            with counter.phase(phase):
                return fn(*a, **k)

        return inner

    return wrap


class _Probe:
    """Wraps the decoding loop of the pipeline modules for one counted call: per-phase ops and host reads inside
    the loop, target forwards (rounds), and the first target forward's arguments (for `torch._dynamo.explain`)."""

    def __init__(self, ops, reads):
        self.ops, self.reads = ops, reads
        self.rounds = 0
        self.loop_ops = {"target": 0, "drafter": 0, "engine": 0}
        self.loop_reads = 0
        self.first_forward = None

    def _count_forward(self, fn):
        def inner(*a, **k):
            self.rounds += 1
            if self.first_forward is None:
                self.first_forward = (fn, a, k)
            with self.ops.phase("target"):
                return fn(*a, **k)

        return inner

    def _measure(self, run):
        before_ops, before_reads = dict(self.ops.by_phase), self.reads.count
        out = run()
        for phase in self.loop_ops:
            self.loop_ops[phase] += self.ops.by_phase[phase] - before_ops.get(phase, 0)
        self.loop_reads += self.reads.count - before_reads
        return out

    def loop(self, decode, forward, drafter_methods):
        """`decode(target, drafter, ...)` counted: the target's `forward` method as phase "target" (one round each),
        the drafter's `drafter_methods` as phase "drafter"."""

        def wrapped(target, drafter, *a, **k):
            with contextlib.ExitStack() as stack:
                stack.enter_context(_patched(target, forward, self._count_forward))
                if drafter is not None:
                    for name in drafter_methods:
                        stack.enter_context(_patched(drafter, name, _in_phase(self.ops, "drafter")))
                return self._measure(lambda: decode(target, drafter, *a, **k))

        return wrapped

    def token_loop(self, decode):
        """The token loop (`mmspec.decoding.loop.decode`): target `forward`, drafter `propose` / `commit`."""
        return self.loop(decode, "forward", ("propose", "commit"))

    def masked_loop(self, decode_masked):
        """MAR's masked loop: the target's and the draft runner's `features`."""
        return self.loop(decode_masked, "features", ("features",))

    def head_last(self, head_last, target_of):
        """MAR: the diffusion head's sampling counts under the runner's phase (target / drafter)."""

        def wrapped(runner, *a, **k):
            phase = "target" if runner is target_of() else "drafter"
            with self.ops.phase(phase):
                return head_last(runner, *a, **k)

        return wrapped


def profile_call(run, method, batch, seed=0):
    """Count one call of `run` (a `ZooRun`): returns the row dict of the module docstring (without the projection)."""
    import mmspec.decoding.masked as masked
    import mmspec.pipelines.continuous as continuous
    import mmspec.pipelines.token_image as token_image
    import mmspec.pipelines.vlm as vlm
    from mmspec.counting import HostReads, OpCount

    run.call(method, batch, seed)  # warm-up: lazy initialisation is not a round's cost
    reads, ops = HostReads(), OpCount()
    probe = _Probe(ops, reads)
    targets = []

    def record_target(decode_masked):
        def inner(target, *a, **k):
            targets.append(target)
            return decode_masked(target, *a, **k)

        return inner

    with contextlib.ExitStack() as stack:
        for module in (token_image, vlm):
            stack.enter_context(_patched_module(module, "decode", probe.token_loop))
        stack.enter_context(_patched_module(continuous, "decode_masked",
                                            lambda f: record_target(probe.masked_loop(f))))  # fmt: skip
        stack.enter_context(_patched_module(masked, "_head_last",
                                            lambda f: probe.head_last(f, lambda: targets[-1] if targets else None)))  # fmt: skip
        with reads, ops:
            out = run.call(method, batch, seed)
    rounds = max(probe.rounds, 1)
    per_round = {phase: n / rounds for phase, n in probe.loop_ops.items()}
    per_round["total"] = sum(per_round.values())
    return {
        "rounds": probe.rounds,
        "tau": float(out.stats.step_compression),
        "host_reads_per_call": reads.count,
        "host_reads_per_round": probe.loop_reads / rounds,
        "host_reads_where": dict(sorted(reads.where.items())),
        "ops_per_call": ops.total,
        "ops_per_round": per_round,
        "_first_forward": probe.first_forward,
    }


@contextlib.contextmanager
def _patched_module(module, name, wrapper_of):
    original = getattr(module, name)
    setattr(module, name, wrapper_of(original))
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def _compiled(pipe, **knobs):
    """`pipe.enable_compile(**knobs)` for the block; eager again after it, dynamo's caches reset."""
    try:
        pipe.enable_compile(**knobs)
        yield
    finally:
        if hasattr(pipe, "disable_compile"):
            pipe.disable_compile()
        torch._dynamo.reset()


def _failure(err) -> str:
    """A compile failure as the report records it (type and the message's first 300 characters)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def explain_compile(run, method, first_forward):
    """Graphs and breaks under compile: (fields, None) or (None, reason). `torch._dynamo.explain` of the eager
    target forward of the counted call (its first round), then one call under `enable_compile(backend="eager")`
    (dynamo traces, no code generation) for the pipeline's own `compile_report()`."""
    pipe = run.pipes[method]
    if not hasattr(pipe, "enable_compile"):
        return None, f"{type(pipe).__name__} has no enable_compile (the compile work is not merged here)"
    if first_forward is None:
        return None, "the call ran no target forward inside the decoding loop"
    try:
        fn, a, k = first_forward
        with forced_accelerator():  # the accelerator path: the CPU-only checks' reads would break the graph
            explained = torch._dynamo.explain(fn)(*a, **k)
        torch._dynamo.reset()
        with _compiled(pipe, backend="eager"):
            run.call(method, 1)
            report = pipe.compile_report() if hasattr(pipe, "compile_report") else None
    except Exception as err:  # a compile failure is a finding to record, not a crash of the profile
        return None, _failure(err)
    reasons = [str(getattr(b, "reason", b)) for b in explained.break_reasons][:10]
    return {"graph_count": explained.graph_count, "graph_break_count": explained.graph_break_count,
            "break_reasons": reasons, "compile_report": report}, None  # fmt: skip


@contextlib.contextmanager
def _graphs_as_launches():
    """While counting: every captured graph (`mmspec.decoding.compiled.CompiledForward`) runs outside the dispatch
    modes (dynamo does not trace under one) and counts as one op, a launch, in the phase of its caller."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    from mmspec.counting import OpCount
    from mmspec.decoding.compiled import CompiledForward

    run = CompiledForward._run

    def launch(self, args, kwargs):
        counters = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, OpCount)]
        with _disable_current_modes():
            out = run(self, args, kwargs)
        for counter in counters:
            counter.by_phase[counter._phases[-1]] += 1
        return out

    CompiledForward._run = launch
    try:
        yield
    finally:
        CompiledForward._run = run


def profile_captured(run, method, batch):
    """Ops per round with everything captured (`enable_compile(backend="eager", verify=True)`: the target's and the
    drafter's forwards and, for chains, Jacobi windows and plain decoding, the verification with its emit, each
    graph one launch): (ops_per_round, None) or (None, reason). Dynamo traces (no code generation): the same graphs
    a GPU would launch."""
    pipe = run.pipes[method]
    if not hasattr(pipe, "enable_compile"):
        return None, f"{type(pipe).__name__} has no enable_compile"
    try:
        with _compiled(pipe, backend="eager", verify=True), _graphs_as_launches():
            run.call(method, batch)  # every shape of the counted call compiles here
            row = profile_call(run, method, batch)
    except Exception as err:  # a compile failure is a finding to record, not a crash of the profile
        return None, _failure(err)
    return {k: round(v, 2) for k, v in row["ops_per_round"].items()}, None


def profile(
    pipelines, methods, batch_sizes, zoo, max_new_tokens=16, num_ar_steps=16, device="cpu", quiet=False, compile=True
):
    """The report's `rows`: pipeline -> method -> str(batch) -> row (module docstring)."""
    from mmspec.eval.zoo_runs import available_methods, build

    rows = {}
    for p in pipelines:
        have = available_methods(p, zoo)
        chosen = [m for m in (methods or have) if m in have]
        if "plain" not in chosen:
            chosen.insert(0, "plain")  # the projection is against plain
        run = build(p, zoo, device, chosen, max_new_tokens=max_new_tokens, num_ar_steps=num_ar_steps)
        rows[p] = {}
        for m in chosen:
            rows[p][m] = {}
            for b in batch_sizes:
                row = profile_call(run, m, b)
                first = row.pop("_first_forward")
                if b == batch_sizes[0]:
                    row["compile"], row["compile_reason"] = (
                        explain_compile(run, m, first) if compile else (None, "--no-compile")
                    )
                row["captured_ops_per_round"], row["captured_reason"] = (
                    profile_captured(run, m, b) if compile else (None, "--no-compile")
                )
                rows[p][m][str(b)] = row
                if not quiet:
                    logger.info("%s %s b%d: %.1f reads/round, %.0f ops/round (target %.0f, drafter %.0f, engine "
                                "%.0f), tau %.2f", p, m, b, row["host_reads_per_round"], row["ops_per_round"]["total"],
                                row["ops_per_round"]["target"], row["ops_per_round"]["drafter"],
                                row["ops_per_round"]["engine"], row["tau"])  # fmt: skip
        for b in batch_sizes:
            plain = rows[p]["plain"][str(b)]
            for m in chosen:
                row = rows[p][m][str(b)]
                row["launch_bound_speedup"] = (row["tau"] / plain["tau"]) * (
                    plain["ops_per_round"]["total"] / row["ops_per_round"]["total"]
                )
    return rows


def run(args):
    return {
        "bench": "profile",
        "zoo": str(args.zoo),
        "pipelines": list(args.pipeline),
        "batch_sizes": list(args.batch_size),
        "max_new_tokens": args.max_new_tokens,
        "num_ar_steps": args.num_ar_steps,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "projection": "launch_bound_speedup = tau / tau(plain) * ops_per_round.total(plain) / ops_per_round.total",
        "rows": profile(
            args.pipeline,
            args.methods,
            args.batch_size,
            args.zoo,
            args.max_new_tokens,
            args.num_ar_steps,
            quiet=args.quiet,
            compile=not args.no_compile,
        ),  # fmt: skip
    }
