"""Random draws from one `torch.Generator` or from one generator per sample (row).

Every random draw in the library goes through `rand` / `randn` here (and `mmspec.sampling.sample`, which uses
`rand`), so that `generator` can be:

* `None`: torch's default generator (library code never passes it; tests and users may);
* a `torch.Generator`: one stream for the whole batch (rows draw from it in row-major order);
* a list/tuple of `torch.Generator`, one per row (dim 0 of the draw): row `b` draws only from `generator[b]`.

With per-row generators a row's output can be made independent of what else is in its batch: that needs every row
to consume the same amount of randomness whatever the other rows do. Batched decoding pads rows to a common width
(a round drafts `max_b K_b` tokens), so a row's draw must not follow the padded width. The decoding engine draws a
fixed count per row instead (a drafter's longest chain, a whole Jacobi window, a verification's `uniform_count`:
`mmspec.decoding.loop`), which needs no per-row count on the host. Draws may also take `counts [B]`: row `b` draws
only its first `counts[b]` entries along dim 1 (all trailing dims of those entries) and the rest is filled with 0.5
without touching its generator. Host `counts` (a list) cost nothing; a device tensor is read once per draw, so the
engine's loop never passes one (MAR's schedule passes host counts). With a single generator `counts` is ignored
(the whole tensor is drawn, as before).

Generators must live on the device the draw is made on (CUDA generators for CUDA tensors).
"""

from collections.abc import Sequence

import torch
from torch import Tensor


__all__ = ["Generators", "check_generator", "num_rows", "rand", "randn", "select_generators"]

Generators = torch.Generator | Sequence[torch.Generator] | None


def check_generator(generator, batch: int | None = None, device=None, name: str = "generator") -> None:
    """Raise `TypeError` / `ValueError` naming `name` unless `generator` is None, a `torch.Generator`, or a list of
    `batch` of them, on `device`'s type."""
    if generator is None:
        return
    gens = [generator] if isinstance(generator, torch.Generator) else generator
    if not isinstance(gens, (list, tuple)) or not all(isinstance(g, torch.Generator) for g in gens):
        raise TypeError(f"{name} must be a torch.Generator or a list of them, got {type(generator).__name__}")
    if not isinstance(generator, torch.Generator):
        if batch is not None and len(gens) != batch:
            raise ValueError(f"{name}: a list needs one torch.Generator per sample ({batch}), got {len(gens)}")
        if len({id(g) for g in gens}) != len(gens):
            raise ValueError(f"{name}: a list must hold distinct torch.Generator objects (one per sample)")
    if device is not None:
        kind = torch.device(device).type
        for g in gens:
            if g.device.type != kind:
                raise ValueError(
                    f"{name} is on {g.device.type} but the model runs on {kind}: "
                    f"create it with torch.Generator(device={kind!r})"
                )


def num_rows(generator) -> int | None:
    """Rows of a per-row generator list, None for a single generator."""
    return None if generator is None or isinstance(generator, torch.Generator) else len(generator)


def select_generators(generator, index):
    """Keep the per-row generators of rows `index` (a host list: no read; a tensor is read once). A single generator
    is returned as is."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    return [generator[i] for i in (index if isinstance(index, list) else torch.as_tensor(index).tolist())]


def _draw(fn, shape, generator, device, dtype, counts):
    if generator is None or isinstance(generator, torch.Generator):
        return fn(shape, generator=generator, device=device, dtype=dtype)
    shape = tuple(shape)
    if len(generator) != shape[0]:
        raise ValueError(f"generator: {len(generator)} per-row generators for a draw over {shape[0]} rows")
    out = torch.full(shape, 0.5, device=device, dtype=dtype)
    flat = out.view(shape[0], -1)
    inner = 1
    for s in shape[2:]:
        inner *= s
    widths = (
        [flat.shape[1]] * shape[0]
        if counts is None
        else [int(c) * inner for c in (counts if isinstance(counts, list) else torch.as_tensor(counts).tolist())]
    )
    for b, g in enumerate(generator):
        n = min(widths[b], flat.shape[1])
        if n > 0:
            flat[b, :n] = fn((n,), generator=g, device=device, dtype=dtype)
    return out


def rand(shape, generator: Generators, *, device=None, dtype=torch.float32, counts: Tensor | None = None) -> Tensor:
    """Uniforms on [0, 1) of `shape` (see the module docstring for per-row generators and `counts`)."""
    return _draw(torch.rand, shape, generator, device, dtype, counts)


def randn(shape, generator: Generators, *, device=None, dtype=torch.float32, counts: Tensor | None = None) -> Tensor:
    """Standard normals of `shape` (see the module docstring for per-row generators and `counts`)."""
    return _draw(torch.randn, shape, generator, device, dtype, counts)
