"""Engine ops per round, counted (exact, not timed): what a launch-bound accelerator pays for the engine's own work
(verification, commit, tree bookkeeping) besides the target's and the drafter's forwards.

Counted as `mmspec bench profile` counts them (`mmspec.eval.bench_profile.profile_call`: `mmspec.counting.OpCount`
inside the decoding loop, the target's forward in phase ``target``, the drafter's ``propose`` / ``commit`` in phase
``drafter``, the rest ``engine``; the accelerator branches forced by `HostReads`). `ENGINE_OPS` is the single
source: per method, the engine's ops per round on a fixed tiny LlamaGen (the host-read test's, batch 1) and a fixed
tree layout, as measured (`docs/benchmarks.md`, Profile) plus a small slack. A per-level or per-node Python loop
put back into the tree round costs tens of ops per round and breaks its row. The zoo test checks issue 28's ratio,
engine <= 60 % of the target forward's ops, on the real zoo target (`assets/mnist-c2i`, ~800 ops per forward).
"""

import copy
from pathlib import Path

import factories
import pytest
import torch

from mmspec.eval.bench_profile import profile_call


V, GRID = 16, 4
METHODS = {
    "chain": dict(acceptance="exact", drafter="eagle", tree_depth=4),
    "tree": dict(acceptance="exact", drafter="eagle", tree_nodes=6, tree_depth=3, tree_top_k=2),
    "sjd": dict(acceptance="jacobi", jacobi_window=4, coupling=False),
    "gsd": dict(acceptance="grouped"),
    "sjd-pac": dict(acceptance="jacobi", jacobi_window=4, jacobi_tree_width=2, jacobi_tree_depth=3),
}
# method -> max engine ops per round (measured + slack); docs/benchmarks.md "Profile" has the before / after
ENGINE_OPS = {
    "chain": 104,  # 101.6 (13 rounds)
    "tree": 235,  # 227.9 (11 rounds); 560.6 with the per-level walk of verify_tree
    "sjd": 134,  # 131.9 (11 rounds)
    "gsd": 275,  # 269.5 (6 rounds)
    "sjd-pac": 415,  # 404.5 (10 rounds); 449.3 rebuilding the tree structure each round; 718.3 with the walk
}


class _Run:
    """The `ZooRun` interface `profile_call` needs: `call(method, batch, seed)`."""

    def __init__(self, pipe, methods):
        self.pipe, self.methods = pipe, methods

    def call(self, method, batch, seed=0):
        return self.pipe(class_labels=list(range(batch)), generator=torch.Generator().manual_seed(seed),
                         output_type="tokens", **self.methods[method])  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run():
    from mmspec.models.llamagen.eagle import EagleHead
    from mmspec.pipelines import SpeculativeARImagePipeline

    target = factories.tiny_gpt(0, vocab_size=V, num_classes=4, block_size=GRID**2, std=0.3)
    head = EagleHead.from_target(target, initializer_range=0.3).init_weights(torch.Generator().manual_seed(2)).eval()
    vq = factories.tiny_vq(V)
    pipe = SpeculativeARImagePipeline(target, vq, copy.deepcopy(target), head)
    pipe.set_progress_bar_config(disable=True)
    return _Run(pipe, METHODS)


@pytest.mark.parametrize("method", list(METHODS))
def test_engine_ops_per_round(tiny_run, method):
    with torch.no_grad():
        row = profile_call(tiny_run, method, 1)
    assert row["rounds"] >= 2
    engine = row["ops_per_round"]["engine"]
    assert engine <= ENGINE_OPS[method], f"{method}: {engine:.1f} engine ops per round > {ENGINE_OPS[method]}"


ZOO = Path(__file__).resolve().parents[2] / "assets"


@pytest.mark.skipif(not (ZOO / "mnist-c2i").is_dir(), reason="the zoo (assets/mnist-c2i) is not here")
def test_zoo_tree_and_sjd_pac_engine_within_60_percent_of_the_target():
    from mmspec.eval.zoo_runs import build

    run = build("ar-image", ZOO, "cpu", ["plain", "exact-eagle-tree", "sjd-pac"])
    for method in ("exact-eagle-tree", "sjd-pac"):
        with torch.no_grad():
            ops = profile_call(run, method, 1)["ops_per_round"]
        assert ops["engine"] <= 0.6 * ops["target"], (
            f"{method}: engine {ops['engine']:.0f} > 60 % of {ops['target']:.0f}"
        )
