"""`CapturedForwards`: the pipelines' `enable_compile` / `disable_compile` / `compile_report` (captured forwards,
`mmspec.decoding.compiled`; `docs/pipelines.md`, "Captured forwards")."""

from mmspec.decoding.compiled import Compiler
from mmspec.methods import COMPILE_RNG, COMPILE_VERIFY, check_compile


__all__ = ["CapturedForwards"]


class CapturedForwards:
    """Mixin of the pipelines: `pipe.enable_compile(mode=None, backend=None)` captures the per-round forwards (the
    target's, the draft model's) as `torch.compile(fullgraph=True, dynamic=False)` graphs, one per shape bucket, kept
    across calls; eager is the default. `compile_report()` counts graphs, shapes and recompiles per role."""

    _compiler = None

    def enable_compile(self, mode=None, backend=None, verify=COMPILE_VERIFY, rng=COMPILE_RNG):
        """Capture the per-round forwards from the next call on; returns the pipeline.

        Args:
            mode: `torch.compile` mode (`mmspec.methods.COMPILE_MODES`); None: "reduce-overhead" (CUDA graphs) on
                CUDA, plain inductor elsewhere.
            backend: `mmspec.methods.COMPILE_BACKENDS`; None: inductor. "cudagraphs": CUDA graphs of the traced
                kernels without inductor's code generation (fast to compile). "eager" / "aot_eager" trace and count
                graphs without generating code.
            verify: also capture the loop's chain verification (exact / relaxed / grouped, sampled or greedy; plain
                AR's one-token draw) and its emit as one graph per row bucket, on uniforms drawn eagerly first
                (`mmspec.decoding.captured_verify`): the same law as eager, another random stream (greedy tokens
                are eager's); Jacobi windows, EAGLE-2 trees and SJD-PAC's Jacobi tree too. It also captures an
                EAGLE head's (LlamaGen's; the VLM's text, vision-aware and EAGLE-3 heads) or a draft model's
                (LlamaGen's, a draft LM's chain), or SJD-PAC's, whole round of drafting
                (`mmspec.decoding.captured_draft`) and a tree's path commit. Default `mmspec.methods.COMPILE_VERIFY`.
            rng: with `verify`, where its uniforms come from (`mmspec.methods.COMPILE_RNGS`): "generator" (the
                default: drawn eagerly before the graph, one draw per generator a round) or "philox" (inside the
                graph, `mmspec.philox`: one key per row from its generator once per call, so nothing is drawn
                outside the graph and a per-row generator list costs no launch per row; the same law, another
                stream, still reproducible from the generators and batch-independent with per-row ones).
        """
        check_compile(mode, backend, verify, rng)
        self._compiler = Compiler(mode, backend, verify, rng)
        return self

    def disable_compile(self):
        """Back to eager forwards (the compiled graphs are dropped); returns the pipeline."""
        self._compiler = None
        return self

    @property
    def compiler(self):
        """The `mmspec.decoding.compiled.Compiler` of `enable_compile`, or None (eager)."""
        return self._compiler

    def compile_report(self) -> dict:
        """`{role: {"graphs", "shapes", "recompiles", "calls"}}` of the captured forwards so far ({} when eager):
        `recompiles` counts graphs beyond the first per input shape (0 is the contract)."""
        return {} if self._compiler is None else self._compiler.report()

    def attach_compiler(self, *parts):
        """Hand the compiler to this call's target adapter and drafter (those that capture a forward read
        `.compiler`; None keeps them eager)."""
        for part in parts:
            if part is not None and hasattr(part, "compiler"):
                part.compiler = self._compiler
