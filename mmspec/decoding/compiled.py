"""Captured forwards: a model's cached forward as one `torch.compile(fullgraph=True, dynamic=False)` graph per input
shape, with exact counts of the graphs it compiled (`pipe.enable_compile(...)`, `docs/pipelines.md`).

* `Compiler(mode, backend)`: a pipeline's compile settings and its `CompiledForward`s, one per (role, model) --
  "target", "drafter", "head" -- kept across calls, so a shape compiled in one call is reused by the next.
  `report()` gives, per forward, `graphs` (graphs compiled), `shapes` (distinct input shapes seen), `recompiles`
  (`graphs - shapes`: compiles beyond the first per shape; 0 is the contract) and `calls`.
* `CompiledForward(fn, name, ...)`: `fn` behind a fresh code object (dynamo's cache and recompile limit are per code
  object, so two wrappers of the same model class never share or exhaust each other's entries), compiled with
  `fullgraph=True` (a graph break is an error, never a silent split) and `dynamic=False` (one graph per shape:
  what CUDA graphs need). A backend wrapper counts the graphs dynamo hands it.
* `pad_block(width, ...)`: a scored block (chain or tree) padded to a fixed width, so the target's forward sees a
  fixed set of shapes (buckets) over a whole call: a chain's tail or a shrinking Jacobi window is padded to the
  widest block. Padded tokens attend only to themselves (and the committed prefix), sit in scratch slots after the
  block, and nothing attends to them: the block's outputs are those of the unpadded forward.

Mode None is "reduce-overhead" (inductor + CUDA graphs) on CUDA and plain inductor elsewhere; backend None is
inductor. "cudagraphs" captures the traced graph's own kernels in CUDA graphs without generating code (seconds to
compile where inductor takes minutes; the launches go, the kernels stay eager's), with the weights and the KV cache
read in place (`mmspec.decoding.cudagraphs`). "eager" / "aot_eager" trace
without generating code: the fast way to count graphs and breaks in tests.
Sampling and verification stay eager by default (a per-row `torch.Generator` is not traceable). With
`enable_compile(verify=True)` a round's verification (chains, Jacobi windows, EAGLE-2 trees, SJD-PAC's Jacobi tree;
plain AR's one-token draw) and its emit are one more graph (role "verify"): its uniforms are drawn eagerly first, one draw per generator
(`mmspec.decoding.captured_verify`), and so are a drafter's or SJD-PAC's whole round (role "draft",
`mmspec.decoding.captured_draft`) and a tree's path commit (role "commit").
"""

import dataclasses
import logging
import types

import torch

from mmspec.methods import COMPILE_RNG


logger = logging.getLogger(__name__)

__all__ = ["CompiledForward", "Compiler", "bucket_width", "dense", "owned", "pad_block", "pad_rows", "row_bucket"]

# per wrapper's code object, set for the calls that bring a new input shape (the ones that compile); far above the
# shapes of one method. A recompile of a seen shape runs under dynamo's own settings and still counts (`recompiles`)
RECOMPILE_LIMIT = 64
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # the inductor modes that capture CUDA graphs


def _inner_backend(mode, backend):
    """The backend dynamo's graphs go to: inductor with `mode` (torch.compile's own wrapper), or a named one."""
    if backend in (None, "inductor"):
        return torch._TorchCompileInductorWrapper(mode, None, False)
    if (
        backend == "cudagraphs"
    ):  # torch's, with the weights and the KV cache read in place (`mmspec.decoding.cudagraphs`)
        from mmspec.decoding.cudagraphs import cudagraphs

        return cudagraphs
    return torch._dynamo.lookup_backend(backend)


class CompiledForward:
    """`fn(*args, **kwargs)` compiled to one graph per input shape; counts `graphs`, `calls` and `shapes`.

    Args:
        fn: the callable to capture (a model's bound `__call__` / `forward`).
        name: a label for reports and the code object.
        mode: inductor mode (None: "reduce-overhead" on CUDA, default elsewhere; see `device`).
        backend: None / "inductor", or "eager" / "aot_eager".
        device: the model's device (decides mode None).
    """

    def __init__(self, fn, name, mode=None, backend=None, device=None):
        device = torch.device("cpu" if device is None else device)
        if mode is None and backend in (None, "inductor"):
            mode = "reduce-overhead" if device.type == "cuda" else None
        self.name, self.mode, self.backend = name, mode, backend
        # CUDA graphs (inductor's "reduce-overhead" / "max-autotune") replay into memory they own: each call starts a
        # new step and hands back its own copies, so an output kept across calls (a hidden state for the drafter)
        # is never overwritten by the next replay
        self.cudagraphs = device.type == "cuda" and (
            backend == "cudagraphs" or (backend in (None, "inductor") and mode in CUDAGRAPH_MODES)
        )
        self.graphs = self.calls = 0
        self.shapes = set()
        self._inner = _inner_backend(mode, backend)

        def captured(*args, **kwargs):
            return fn(*args, **kwargs)

        code = captured.__code__.replace(co_name=f"captured_{name}", co_qualname=f"captured_{name}")
        fresh = types.FunctionType(code, captured.__globals__, code.co_name, None, captured.__closure__)
        self._compiled = torch.compile(fresh, fullgraph=True, dynamic=False, backend=self._count)

    def _count(self, gm, example_inputs):
        self.graphs += 1
        logger.debug("compiled %s: graph %d", self.name, self.graphs)
        return self._inner(gm, example_inputs)

    @staticmethod
    def signature(args, kwargs):
        """The shapes (and dtypes) of the tensor arguments, plus the non-tensor ones: one compiled graph each. An
        object argument (a KV cache, a transformers `Cache` over one) counts with the shapes of the tensors it holds,
        two levels deep: a cache allocated for another method (more scratch slots) is another shape, not a
        recompile. Modules count by type (their parameters are the same tensors every call)."""

        def key(value, depth=0):
            if torch.is_tensor(value):
                return (tuple(value.shape), value.dtype)
            if isinstance(value, (tuple, list)):
                return tuple(key(v, depth) for v in value)
            if value is None or isinstance(value, (bool, int, float, str)):
                return value
            name = type(value).__name__
            if depth >= 2 or isinstance(value, torch.nn.Module) or not hasattr(value, "__dict__"):
                return name
            held = [(k, key(v, depth + 1)) for k, v in sorted(vars(value).items())
                    if torch.is_tensor(v) or (hasattr(v, "__dict__") and not isinstance(v, torch.nn.Module))]  # fmt: skip
            return (name, *held)

        return tuple(key(a) for a in args) + tuple((k, key(v)) for k, v in sorted(kwargs.items()))

    def __call__(self, *args, **kwargs):
        """Run the graph of this input shape (compiled on first sight). Tensor arguments go in with standard strides
        (`dense`: a copy of a strided view), so a shape is one graph whatever view it came as; a captured function
        must not write into its tensor arguments (caches, passed as objects, are written in place)."""
        self.calls += 1
        args, kwargs = tuple(dense(a) for a in args), {k: dense(v) for k, v in kwargs.items()}
        shape = self.signature(args, kwargs)
        if shape in self.shapes:  # compiled before: no scoped settings (a config patch costs tens of microseconds of
            try:  # host time, in every call of every round)
                return self._run(args, kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                # dynamo's caches were reset since (`torch._dynamo.reset`, `_dynamo.explain`), and this wrapper had
                # more shapes than dynamo's default limit: compile it again under this call's limit (a recompile)
                pass
        self.shapes.add(shape)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            return self._run(args, kwargs)

    def _run(self, args, kwargs):
        if not self.cudagraphs:
            return self._compiled(*args, **kwargs)
        torch.compiler.cudagraph_mark_step_begin()
        return owned(self._compiled(*args, **kwargs))

    @property
    def recompiles(self) -> int:
        """Graphs compiled beyond the first per distinct input shape (0: every shape compiled exactly once)."""
        return self.graphs - len(self.shapes)

    def report(self) -> dict:
        return {"graphs": self.graphs, "shapes": len(self.shapes), "recompiles": self.recompiles, "calls": self.calls}


class Compiler:
    """A pipeline's captured forwards (`pipe.enable_compile(mode, backend, verify)`): one `CompiledForward` per
    (role, model), created on first use and kept across calls. `mode` / `backend` / `verify` are checked by the
    pipeline (`mmspec.methods.check_compile`); `verify`: the loop's chain verification runs captured too (role
    "verify", `mmspec.decoding.captured_verify`); `rng`: where that verification's uniforms come from
    (`mmspec.methods.COMPILE_RNGS`)."""

    def __init__(self, mode=None, backend=None, verify=False, rng=COMPILE_RNG):
        self.mode, self.backend, self.verify, self.rng = mode, backend, verify, rng
        self.forwards: dict[tuple[str, int], CompiledForward] = {}

    def forward(self, role, model, fn=None, device=None):
        """The compiled forward of `model` in `role` (`fn`: the callable to capture, default `model` itself; a plain
        function as `model` is its own key). `device`: where it runs, default the model's parameters' (CPU when
        it has none)."""
        key = (role, id(model))
        if key not in self.forwards:
            if device is None and hasattr(model, "parameters"):
                device = next(iter(model.parameters()), torch.empty(0)).device
            self.forwards[key] = CompiledForward(model if fn is None else fn, role, self.mode, self.backend, device)
        return self.forwards[key]

    @staticmethod
    def static(*items):
        """Mark CUDA tensors that a captured forward mutates in place as static addresses, so CUDA graphs write them
        where they are instead of copying them in and out (or skipping the capture for a mutated input); nothing
        elsewhere. An item is a tensor or an object holding them (a KV cache: every tensor attribute)."""
        for item in items:
            for t in [item] if torch.is_tensor(item) else [v for v in vars(item).values() if torch.is_tensor(v)]:
                if t.device.type == "cuda":
                    torch._dynamo.mark_static_address(t)

    def report(self) -> dict:
        """`{role: {"graphs", "shapes", "recompiles", "calls"}}` summed over the models of each role."""
        out = {}
        for (role, _), wrapper in self.forwards.items():
            row = out.setdefault(role, {"graphs": 0, "shapes": 0, "recompiles": 0, "calls": 0})
            for name, value in wrapper.report().items():
                row[name] += value
        return out


def owned(value):
    """`value` with every tensor in it cloned (tuples, lists, dicts, transformers `ModelOutput`s and dataclasses are
    rebuilt around the clones; other objects, such as a cache, pass as they are): a CUDA graph's outputs live in
    memory its next replay overwrites."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(owned(v) for v in value)
    if isinstance(value, tuple):  # a named tuple
        return type(value)(*(owned(v) for v in value))
    if isinstance(value, dict):  # a transformers ModelOutput too (a dict and a dataclass)
        items = {k: owned(v) for k, v in value.items()}
        return items if type(value) is dict else type(value)(**items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: owned(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})  # fmt: skip
    return value


def dense(value):
    """`value` with the standard (row-major) strides of its shape: a copy only where they differ -- an expanded or
    sliced view (a tree level's slots, a broadcast position), whose strides change from call to call even when its
    shape does not. dynamo traces for given strides (a change recompiles), and `Tensor.contiguous` keeps the strides
    of size-1 dimensions. Non-tensors as they are."""
    if not torch.is_tensor(value):
        return value
    want, step = [], 1
    for size in reversed(value.shape):
        want.append(step)
        step *= size
    if tuple(reversed(want)) == value.stride():
        return value
    return value.clone(memory_format=torch.contiguous_format).as_strided(value.shape, tuple(reversed(want)))


def row_bucket(rows, limit):
    """The row count a captured call keeps for `rows` live rows: the next power of two, at most `limit` (the rows it
    started with), so compacting finished rows away gives a few shapes over a whole generation, not one per count."""
    return min(int(limit), 1 << max(0, int(rows) - 1).bit_length())


def pad_rows(x, rows, fill=None):
    """`x [n, ...]` padded to `rows >= n` rows: copies of row 0 (a valid input of every kind: tokens, a tree's
    parents), or the constant `fill` (a count that must stay 0). None stays None."""
    if x is None or x.shape[0] >= rows:
        return x
    extra = rows - x.shape[0]
    pad = x[:1].expand(extra, *x.shape[1:]) if fill is None else x.new_full((extra, *x.shape[1:]), fill)
    return torch.cat([x, pad])


def bucket_width(width, buckets):
    """The smallest of `buckets` that holds `width` (the block is padded to it); `width` itself above them all."""
    fits = [b for b in buckets if b >= width]
    return min(fits) if fits else width


def pad_block(width, input_ids, input_pos=None, write_slots=None, attention_mask=None):
    """Pad a scored block `input_ids [rows, M]` to `width >= M` columns.

    A chain (no `input_pos`) is padded with token 0: the model's default causal chain covers the padding, which comes
    after every real token. A block with explicit inputs (a tree) gets padded nodes at slots `write_slots[:, -1] + 1,
    ...` (the block's own scratch slots continue there), at the last real position, attending only to themselves.
    Returns the padded `(input_ids, input_pos, write_slots, attention_mask)` (None where not given)."""
    rows, m = input_ids.shape
    pad = width - m
    if pad <= 0:
        return input_ids, input_pos, write_slots, attention_mask
    input_ids = torch.cat([input_ids, input_ids.new_zeros(rows, pad)], dim=1)
    if input_pos is None:
        return input_ids, None, write_slots, attention_mask
    step = torch.arange(1, pad + 1, device=write_slots.device, dtype=write_slots.dtype)
    write_slots = torch.cat([write_slots, write_slots[:, -1:] + step[None, :]], dim=1)
    input_pos = torch.cat([input_pos, input_pos[:, -1:].expand(rows, pad)], dim=1)
    mask = torch.eye(width, dtype=torch.bool, device=attention_mask.device).expand(rows, width, width).clone()
    mask[:, :m, :m] = attention_mask
    return input_ids, input_pos, write_slots, mask
