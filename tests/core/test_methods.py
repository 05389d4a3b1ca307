"""The method registry: knob types and ranges, drafter resolution."""

import numpy as np
import pytest
import torch

from mmspec.methods import ACCEPTANCES, KNOBS, check_knob, resolve_drafter


def test_knob_types():
    assert check_knob("jacobi_window", np.int64(4)) == 4 and type(check_knob("jacobi_window", np.int64(4))) is int
    assert check_knob("relaxation_delta", np.float32(0.5)) == 0.5
    for bad in (torch.tensor(4.5), torch.tensor(True), torch.tensor([4]), 4.5, "4", True):
        with pytest.raises(TypeError, match="jacobi_window"):
            check_knob("jacobi_window", bad)
    with pytest.raises(ValueError, match="relaxation_delta"):
        check_knob("relaxation_delta", float("nan"))
    with pytest.raises(ValueError, match="resample"):
        check_knob("resample", "foo")


def test_pipeline_uses_the_registry_defaults_of_unset_rule_knobs():
    """A rule knob left unset runs with the registry's default (`KNOBS`, read from the rule class): the same tokens
    and counters as passing that default explicitly, while another value of the knob changes the run."""
    import copy

    from mmspec.models.llamagen.gpt import LlamaGenGPT
    from mmspec.models.llamagen.vq import LlamaGenVQ
    from mmspec.pipelines import SpeculativeARImagePipeline

    target = LlamaGenGPT(vocab_size=16, dim=32, n_layer=2, n_head=2, num_classes=4, block_size=16, multiple_of=8,
                         initializer_range=0.3).init_weights(torch.Generator().manual_seed(0), zero_output=False)  # fmt: skip
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    vq = LlamaGenVQ(codebook_size=16, codebook_embed_dim=4, ch=8, ch_mult=(1, 2, 2), z_channels=8, in_channels=1,
                    num_res_blocks=1, norm_num_groups=4)  # fmt: skip
    pipe = SpeculativeARImagePipeline(target.eval(), vq.eval(), draft.eval())
    pipe.set_progress_bar_config(disable=True)

    def run(acceptance, **knobs):
        out = pipe(class_labels=[0, 1, 2, 3], acceptance=acceptance, drafter="model", output_type="tokens",
                   generator=torch.Generator().manual_seed(0), **knobs)  # fmt: skip
        return out.images, out.stats.accepted_tokens, out.stats.target_forwards

    def same(a, b):
        return torch.equal(a[0], b[0]) and a[1:] == b[1:]

    for acceptance, names, other in (
        ("relaxed", ("relaxation_top_k", "relaxation_delta"), dict(relaxation_delta=0.0)),
        ("grouped", ("group_size", "group_prob_threshold", "group_dist_threshold"), dict(group_size=1)),
    ):
        unset = run(acceptance)
        assert same(unset, run(acceptance, **{n: KNOBS[n].default for n in names})), acceptance
        assert not same(unset, run(acceptance, **other)), (acceptance, other)  # the knobs do reach the rule


def test_resolve_drafter():
    assert resolve_drafter("none", None, set()) is None
    assert resolve_drafter("exact", None, {"draft_model"}) == "model"
    assert resolve_drafter("exact", None, set()) == "jacobi"
    assert resolve_drafter("grouped", None, {"eagle_head"}) == "jacobi"
    with pytest.raises(ValueError, match="eagle_head"):
        resolve_drafter("exact", "eagle", set())
    with pytest.raises(ValueError, match="drafter"):
        resolve_drafter("jacobi", "model", {"draft_model"})
    assert set(ACCEPTANCES) == {"none", "exact", "relaxed", "grouped", "jacobi", "greedy", "continuous"}


def test_acceptances_name_the_pipelines_that_accept_them():
    """One table for every pipeline: the VLM's and the MAR pipeline's acceptances are registry entries too."""
    from mmspec.methods import acceptance_names
    from mmspec.pipelines import continuous, vlm

    assert acceptance_names("image") == ("none", "exact", "relaxed", "grouped", "jacobi")
    assert vlm.ACCEPTANCES == acceptance_names("vlm") == ("none", "exact", "greedy")
    assert continuous.ACCEPTANCES == acceptance_names("continuous") == ("none", "continuous")
    for name, pipeline in (("greedy", "image"), ("continuous", "image"), ("relaxed", "vlm"), ("jacobi", "vlm")):
        with pytest.raises(ValueError, match="acceptance must be one of"):
            resolve_drafter(name, None, {"draft_model", "eagle_head"}, pipeline)
    with pytest.raises(ValueError, match="pipeline"):
        acceptance_names("audio")


def test_resolve_method_defaults_once_and_names_tree_nodes():
    """`resolve_method` applies the registry's defaults (no `or 4` / `or 24` / `7 if relaxed` in the pipelines) and
    refuses `num_draft_tokens` where it used to mean an EAGLE-2 tree's node count, naming `tree_nodes`."""
    from mmspec.methods import MethodSettings, resolve_method

    chain = resolve_method("exact", "model", {"draft_model"})
    assert isinstance(chain, MethodSettings) and chain.drafter == "model"
    assert (chain.num_draft_tokens, chain.tree_nodes, chain.tree_depth) == (4, 24, 5)
    assert resolve_method("relaxed", "eagle", {"eagle_head"}).tree_depth == 7
    assert resolve_method("grouped", "eagle", {"eagle_head"}).tree_depth == 7
    assert resolve_method("exact", "eagle", {"eagle_head"}, tree_depth=3).tree_depth == 3
    assert dict(chain)["jacobi_window"] == KNOBS["jacobi_window"].default and set(dict(chain)) == set(KNOBS)
    tree = resolve_method("exact", "eagle", {"eagle_head"}, tree_top_k=3, tree_nodes=8)
    assert tree.tree and tree.tree_nodes == 8
    with pytest.raises(ValueError, match="tree_nodes"):
        resolve_method("exact", "eagle", {"eagle_head"}, tree_top_k=3, num_draft_tokens=8)
    with pytest.raises(ValueError, match="tree_nodes"):
        resolve_method("exact", "model", None, "vlm", tree_top_k=2, num_draft_tokens=8)
    # unambiguous: the image pipelines' draft model always drafts a chain of num_draft_tokens
    assert resolve_method("exact", "model", {"draft_model"}, tree_top_k=3, num_draft_tokens=6).num_draft_tokens == 6
    with pytest.raises(ValueError, match="tree_nodes"):
        resolve_method("exact", "eagle", {"eagle_head"}, tree_top_k=2, tree_nodes=0)
    with pytest.raises(TypeError, match="unknown method knob"):
        resolve_method("exact", "eagle", {"eagle_head"}, tree_node=8)


def test_one_definition_of_the_bounds_and_the_zoo():
    """The SJD-PAC bounds live in the registry only, and the zoo folder has one definition (torch-free)."""
    import mmspec.cli.args
    import mmspec.drafters.jacobi_pac as pac
    from mmspec.data.zoo import DEFAULT_ZOO
    from mmspec.models import DEFAULT_ZOO as models_zoo

    assert not hasattr(pac, "MAX_TREE_WIDTH") and not hasattr(pac, "MAX_TREE_DEPTH")
    assert models_zoo is DEFAULT_ZOO and mmspec.cli.args.DEFAULT_ZOO == str(DEFAULT_ZOO)


def test_a_drafter_resolves_only_in_the_pipelines_that_run_it():
    """`jacobi` drafts for image targets only: a VLM with no drafter loaded is refused by name (it used to resolve to
    `jacobi` and fail later in an AttributeError), an explicit `jacobi` too; image pipelines still fall back to it."""
    with pytest.raises(ValueError, match=r"none is loaded .*acceptance='none'"):
        resolve_drafter("exact", None, set(), "vlm")
    with pytest.raises(ValueError, match="drafter='jacobi' runs in the \\('image',\\) pipelines, not 'vlm'"):
        resolve_drafter("exact", "jacobi", set(), "vlm")
    assert resolve_drafter("exact", None, {"draft_model"}, "vlm") == "model"
    assert resolve_drafter("exact", None, set(), "image") == "jacobi"
