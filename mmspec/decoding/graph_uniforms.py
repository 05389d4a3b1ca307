"""The randomness of a captured graph (`mmspec.decoding.captured_verify`, `mmspec.decoding.captured_draft`).

A `torch.Generator` (or a per-row list of them, `mmspec.random`) cannot be traced, so a captured round's uniforms
come from one of two places (`enable_compile(rng=...)`, `mmspec.methods.COMPILE_RNGS`):

* ``"generator"``: drawn eagerly before the graph, one draw of a fixed shape ``[rows, count]`` (float64) per graph
  call: a single generator's one `rand`, or ``count`` uniforms from each row's own generator (a row's draws depend on
  its generator only, and every row draws the same amount each call whatever the rest of the batch does: no per-row
  counts, no host read);
* ``"philox"``: made inside the graph (`mmspec.philox.philox_uniforms`): each row of the call gets one Philox key from
  its generator (a per-row list: from its own) at the first sampled call, and call ``t`` reads the blocks ``(t, j)``
  under its row's key. Nothing is drawn outside the graph.

Each kind of graph of a call (the verification, a drafter's chain) keeps its own `GraphUniforms`: its own keys and
counter, so the two never read the same blocks.
"""

import torch

from mmspec.decoding.compiled import pad_rows
from mmspec.philox import philox_uniforms, row_keys
from mmspec.random import rand


__all__ = ["GraphUniforms", "resolve_uniforms"]


def resolve_uniforms(uniforms, keys, round_index, count: int):
    """Inside a graph: the call's ``[rows, count]`` uniforms, `uniforms` as drawn eagerly, or Philox blocks of
    `keys [rows, 2]` at `round_index` (0-d) when `keys` is given; None (greedy) when neither is."""
    return uniforms if keys is None else philox_uniforms(keys, round_index, count)


class GraphUniforms:
    """One call's source of uniforms for one kind of captured graph (see the module docstring).

    Args:
        rng: "generator" or "philox" (`mmspec.methods.COMPILE_RNGS`).
        rows: the call's batch items (Philox keys are kept per item of the call, indexed by `state.ids`).
        device: where the call runs.
    """

    def __init__(self, rng: str, rows: int, device):
        self.philox = rng == "philox"
        self.rows, self.device = int(rows), torch.device(device)
        self.keys = None  # philox: [rows, 2] one key per row of the call, made at the first sampled call
        # philox: the call counter (a 0-d device tensor, an input of the graph); none with generators
        self.round = torch.zeros((), dtype=torch.long, device=self.device) if self.philox else None

    def draw(self, generator, live: int, rows: int, count: int):
        """``[rows, count]`` float64 uniforms drawn eagerly: one draw of a single generator, or `count` from each of
        the `live` rows' own generators (padding rows copy row 0's)."""
        if generator is None or isinstance(generator, torch.Generator):
            return rand((rows, count), generator, device=self.device, dtype=torch.float64)
        return pad_rows(rand((live, count), generator, device=self.device, dtype=torch.float64), rows)

    def inputs(self, state, rows: int, count: int):
        """A sampled graph call's randomness as its inputs ``(uniforms, keys, round_index)`` for `state`'s live rows
        padded to `rows`: eager uniforms (and no keys), or the rows' Philox keys and the counter (no uniforms; the
        counter moves on). `resolve_uniforms` turns them into the uniforms inside the graph."""
        live = state.ids.shape[0]
        if not self.philox:
            return self.draw(state.generator, live, rows, count), None, None
        if self.keys is None:  # the rows still live draw their keys once (their ids index the call's rows)
            self.keys = torch.zeros(self.rows, 2, dtype=torch.long, device=self.device)
            self.keys[state.ids] = row_keys(state.generator, live, self.device)
        round_index = self.round
        self.round = self.round + 1
        return None, pad_rows(self.keys[state.ids], rows), round_index
