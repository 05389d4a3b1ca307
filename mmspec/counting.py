"""Counting what a round would cost on an accelerator, on any device: host reads and dispatched ops.

A *host read* is anything that makes the host wait for the device: a scalar read (`item`, `int(t)`, `bool(t)`,
`if t:`), an op whose output shape depends on the data (`nonzero`, boolean-mask indexing, `unique`, `masked_select`,
`repeat_interleave` without `output_size`), and copies to host memory (`tolist`, `numpy`, `.cpu()`). On a CPU none of
these stalls anything, which is why they creep in unnoticed; `HostReads` counts them all the same, so a test on a CPU
can hold the engine to an accelerator's budget.

`HostReads` also *forces the accelerator branches*: inside it `host_checks_enabled(device)` is False even for a CPU
device, so validation that the code runs only where a read is free (on a CPU) is skipped as it would be on a GPU, and
the count is the one a GPU would pay.

`on_host()` marks code that works on host memory only (a processor's inputs and outputs before they are moved to the
device): reads inside it cost an accelerator nothing and are not counted.

`OpCount` counts dispatched aten ops (each one a kernel launch on an accelerator, unless captured), split by the
phase names that `phase()` pushes (for example "target", "drafter"; ops outside any phase count as "engine").
"""

import contextlib
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


# aten ops (overload packet names) that read the device from the host, whatever their arguments
_READ_OPS = frozenset(
    {
        "_local_scalar_dense",  # item / int / float / bool / `if t:`
        "nonzero",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "bincount",  # output length = max + 1
        "_assert_async",  # `torch._assert_async` syncs on CUDA
        "equal",  # returns a Python bool
        "is_nonzero",
        "allclose",
    }
)
# host copies that do not dispatch when the tensor is already on the host: patched on the tensor class while counting
_COPY_METHODS = ("tolist", "numpy", "cpu")

_state = threading.local()


def _forcing():
    return getattr(_state, "force_accelerator", 0) > 0


def host_checks_enabled(device) -> bool:
    """True where a host read is free: on a CPU device, unless a `HostReads` block forces the accelerator branches.

    Library code guards checks that read the device (NaN guards, range checks of device tensors) with this, so they run
    on every CPU call (tests, the CPU path) and never cost a GPU round a synchronisation.
    """
    device = torch.device(device) if not isinstance(device, torch.device) else device
    return device.type == "cpu" and not _forcing()


@contextlib.contextmanager
def _raised(flag):
    """Raise the thread's counter `flag` for the block (nested blocks stack)."""
    setattr(_state, flag, getattr(_state, flag, 0) + 1)
    try:
        yield
    finally:
        setattr(_state, flag, getattr(_state, flag) - 1)


def on_host():
    """Mark a block that touches host memory only (the tokenizer's / processor's tensors before they move to the
    device, host-side bookkeeping built from them): `HostReads` does not count what it reads there, since on an
    accelerator nothing waits for the device. Never wrap code that reads a device tensor."""
    return _raised("on_host")


def _is_read(func, args, kwargs):
    name = func.overloadpacket.__name__
    if name in _READ_OPS:
        return True
    if name == "repeat_interleave":  # output size is data dependent unless given
        return (kwargs or {}).get("output_size") is None and not (len(args) > 3 and args[3] is not None)
    if name in ("index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else (kwargs or {}).get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


def forced_accelerator():
    """Inside the block `host_checks_enabled` is False on every device (as inside `HostReads`), without counting:
    for tracing the accelerator path on a CPU (e.g. `torch._dynamo.explain` of what a GPU would run)."""
    return _raised("force_accelerator")


class HostReads(TorchDispatchMode):
    """Count host reads inside the block (see the module docstring) and force the accelerator branches.

    Attributes:
        count: number of reads so far.
        where: `Counter` of op name -> reads, for the failure message of a budget test.
    """

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where = Counter()
        self._saved = {}

    def _record(self, name):
        if getattr(_state, "on_host", 0):  # host memory only (`on_host`)
            return
        self.count += 1
        self.where[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_read(func, args, kwargs):
            self._record(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def _patched(self, name):
        original = self._saved[name]
        counter = self

        def method(tensor, *a, **k):
            counter._record(name)
            return original(tensor, *a, **k)

        method.__name__ = name
        return method

    def __enter__(self):
        for name in _COPY_METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._patched(name))
        self._forced = forced_accelerator()
        self._forced.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._forced.__exit__(None, None, None)
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            self._saved = {}


class OpCount(TorchDispatchMode):
    """Count dispatched aten ops inside the block, split by phase (`phase("target")`; default "engine").

    Attributes:
        by_phase: `Counter` of phase -> ops.
        total: all ops counted.
    """

    def __init__(self):
        super().__init__()
        self.by_phase = Counter()
        self._phases = ["engine"]

    @property
    def total(self) -> int:
        return sum(self.by_phase.values())

    @contextlib.contextmanager
    def phase(self, name):
        """Count the ops inside the `with` block under `name` (nested phases count under the innermost)."""
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in ("detach", "lift_fresh", "alias"):  # metadata-only ops that launch nothing
            self.by_phase[self._phases[-1]] += 1
        return func(*args, **(kwargs or {}))
