"""Captured drafting: a drafter's whole round of drafting -- an EAGLE head's chain or EAGLE-2 tree (LlamaGen's, or a
transformers target's: text, vision-aware, EAGLE-3), a draft model's chain (LlamaGen's, or a transformers draft
LM's), SJD-PAC's proposal -- as one `torch.compile(fullgraph=True, dynamic=False)` graph (role "draft"), with
`pipe.enable_compile(verify=True)` (`docs/pipelines.md`, "Captured forwards"). A transformers drafter's forwards
attend over a window of its cache kept on the host: the drafter makes the whole round's window before the graph
(`mmspec.models.hf.target.round_window`), one of the graph's shapes.

Per-step capture (the head's or the draft model's forward as a graph) leaves the loop around it eager: the feature
gather, the processing of each draft distribution, the draw, the cache bookkeeping -- 100-320 launches a round on the
zoo (`mmspec bench profile`), more than the captured target and verification together. Here the drafter hands a
pure function of its round to `CapturedDraft`, which runs it as one graph per shape (rows, chain length):

* a sampled chain draws on uniforms (`mmspec.drafters.chain.draw_chain`): the drafter's longest chain's worth per
  row every round (whatever this round's length: a row's draws never depend on the rest of its batch), drawn eagerly
  in one draw per generator, or made in the graph from Philox keys (`rng="philox"`), as the captured verification's
  (`mmspec.decoding.graph_uniforms`; the draft keeps its own keys and counter). The law is `sample_chain`'s -- each
  draft is drawn from the `q_draft` it reports -- on another random stream; greedy decoding draws nothing and drafts
  eager's tokens;
* a tree's children are deterministic (top-k): nothing is drawn; SJD-PAC's sibling sets draw `V` uniforms per
  parent of each branching level, every round;
* the function returns the cache's new committed lengths, which are set after the graph (a graph's outputs are owned
  by the caller; the K/V it wrote are the cache's own storage, marked static), and the sum of its distributions,
  which goes to `Guidance.record` (the NaN check at the end of the call).

A round with an in-round stop (the confidence stop, a `calibrated` draft length: a host read after each draft) drafts
eagerly, as does every round without `verify`.
"""

import torch

from mmspec.decoding.graph_uniforms import GraphUniforms


__all__ = ["CapturedDraft", "captures_rounds"]


def captures_rounds(compiler) -> bool:
    """A drafter under `compiler` drafts its rounds as one graph (`enable_compile(verify=True)`)."""
    return compiler is not None and bool(getattr(compiler, "verify", False))


class CapturedDraft:
    """One decoding call's captured drafting (a drafter makes it at `prefill` when `captures_rounds`).

    Args:
        compiler: the pipeline's `mmspec.decoding.compiled.Compiler` (role ``"draft"``; its graphs are kept across
            calls).
        rows: the call's batch items.
        device: where the call runs.
    """

    def __init__(self, compiler, rows: int, device):
        self.compiler, self.device = compiler, torch.device(device)
        self.random = GraphUniforms(compiler.rng, rows, device)

    def __call__(self, fn, state, count: int, *args, **kwargs):
        """`fn(*args, uniforms, keys, round_index, **kwargs)` as one graph (compiled on first sight of a shape):
        `uniforms` / `keys` / `round_index` are the round's `count` uniforms per live row of `state` (the same
        `count` every sampled round of a call, so that a row's draws do not depend on its batch;
        `mmspec.decoding.graph_uniforms.GraphUniforms.inputs`; `resolve_uniforms` inside `fn`), all None when
        `count` is 0 (greedy decoding, a tree's deterministic children)."""
        uniforms = keys = round_index = None
        if count:
            uniforms, keys, round_index = self.random.inputs(state, state.ids.shape[0], count)
        run = self.compiler.forward("draft", fn, device=self.device)
        return run(*args, uniforms, keys, round_index, **kwargs)
