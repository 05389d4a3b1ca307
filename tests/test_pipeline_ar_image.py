"""SpeculativeARImagePipeline on tiny random components: losslessness, ragged batches, CFG, I/O, errors."""

import copy

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from mmspec.drafters.eagle import EagleHead
from mmspec.models.llamagen import LlamaGenGPT
from mmspec.models.vq import LlamaGenVQ
from mmspec.pipelines import SpeculativeARImagePipeline, SpeculativeImageOutput


V, GRID, CLASSES = 16, 4, 4


def tiny_gpt(seed, dim=32, n_layer=2, std=0.3):
    g = torch.Generator().manual_seed(seed)
    model = LlamaGenGPT(vocab_size=V, dim=dim, n_layer=n_layer, n_head=2, num_classes=CLASSES, block_size=GRID**2,
                        multiple_of=8, initializer_range=std)  # fmt: skip
    return model.init_weights(g, zero_output=False).eval()


@pytest.fixture(scope="module")
def parts():
    target = tiny_gpt(0)
    near = copy.deepcopy(target)  # a draft that mostly agrees with the target
    with torch.no_grad():
        for p in near.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    head = EagleHead.from_target(target, initializer_range=0.3).init_weights(torch.Generator().manual_seed(2)).eval()
    vq = LlamaGenVQ(codebook_size=V, codebook_embed_dim=4, ch=8, ch_mult=(1, 2, 2), z_channels=8, in_channels=1,
                    num_res_blocks=1, norm_num_groups=4).eval()  # fmt: skip
    return target, near, head, vq


@pytest.fixture(scope="module")
def pipe(parts):
    target, near, head, vq = parts
    return SpeculativeARImagePipeline(target, vq, near, head)


def run(pipe, seed=0, **kw):
    kw.setdefault("class_labels", [0, 1, 2])
    return pipe(generator=torch.Generator().manual_seed(seed), output_type="tokens", **kw)


LOSSLESS = [
    dict(acceptance="exact", drafter="model"),
    dict(acceptance="exact", drafter="eagle"),
    dict(acceptance="exact", drafter="eagle", num_draft_tokens=6, tree_depth=3, tree_top_k=2),
    dict(acceptance="exact", drafter="eagle", tree_depth=4, tree_top_k=1),
    dict(acceptance="exact", drafter="jacobi", jacobi_window=5),
    dict(acceptance="jacobi", jacobi_window=16, coupling=False),
    dict(acceptance="jacobi", jacobi_window=4, coupling=True),
    dict(acceptance="relaxed", drafter="model", relaxation_delta=0.0),
]


@pytest.mark.parametrize("method", LOSSLESS, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_greedy_equals_plain_greedy(pipe, method):
    plain = run(pipe, acceptance="none", do_sample=False, guidance_scale=2.0)
    out = run(pipe, do_sample=False, guidance_scale=2.0, **method)
    assert torch.equal(out.images, plain.images)
    assert len(set(map(tuple, plain.images.tolist()))) > 1  # the rows really differ
    s = out.stats
    assert s.generated_tokens == [GRID**2] * 3
    assert s.target_forwards <= plain.stats.target_forwards


def test_identical_draft_accepts_everything(parts):
    target, _, _, vq = parts
    pipe = SpeculativeARImagePipeline(target, vq, draft_model=target)
    plain = run(pipe, acceptance="none", do_sample=False)
    out = run(pipe, acceptance="exact", drafter="model", do_sample=False, num_draft_tokens=4)
    assert torch.equal(out.images, plain.images)
    # 1 token from the prefill, then rounds of 5 (4 drafts + bonus): ceil(15 / 5) = 3 rounds
    assert out.stats.target_forwards == 1 + 3
    assert out.stats.acceptance_rate == 1.0


def _marginals(images, positions):
    return [np.bincount(images[:, j].numpy(), minlength=V) for j in positions]


SAMPLED = [
    dict(acceptance="exact", drafter="model", num_draft_tokens=3),
    dict(acceptance="exact", drafter="eagle", num_draft_tokens=8, tree_depth=3, tree_top_k=3),
    dict(acceptance="exact", drafter="eagle", tree_depth=3, tree_top_k=1),
    dict(acceptance="jacobi", jacobi_window=6, coupling=False),
    dict(acceptance="jacobi", jacobi_window=6, coupling=True, jacobi_init="random"),
]


@pytest.mark.slow
@pytest.mark.parametrize("method", SAMPLED, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_sampling_marginals_match_plain(pipe, method):
    """Two-sample chi-square, per position, speculative vs plain sampling (CFG 2, T=1) over 3000 images."""
    n, positions = 3000, (1, 2, 3, 7, 15)
    plain = run(pipe, seed=1, class_labels=[1], num_images_per_prompt=n, acceptance="none").images
    spec = run(pipe, seed=2, class_labels=[1], num_images_per_prompt=n, **method).images
    for j, (a, b) in zip(positions, zip(_marginals(plain, positions), _marginals(spec, positions))):
        keep = (a + b) > 0
        p = scipy_stats.chi2_contingency(np.stack([a[keep], b[keep]]))[1]
        assert p > 1e-3, f"position {j}: p={p:.2e} plain={a.tolist()} spec={b.tolist()}"


@pytest.mark.slow
def test_marginal_test_has_power(pipe):
    """The same test rejects a lossy rule (LANTERN with a large budget), so passing it means something."""
    n = 3000
    plain = run(pipe, seed=1, class_labels=[1], num_images_per_prompt=n, acceptance="none").images
    lossy = run(pipe, seed=2, class_labels=[1], num_images_per_prompt=n, acceptance="relaxed", drafter="jacobi",
                relaxation_top_k=8, relaxation_delta=0.9).images  # fmt: skip
    pvals = []
    for a, b in zip(_marginals(plain, (1, 2, 3)), _marginals(lossy, (1, 2, 3))):
        keep = (a + b) > 0
        pvals.append(scipy_stats.chi2_contingency(np.stack([a[keep], b[keep]]))[1])
    assert min(pvals) < 1e-3


def test_relaxed_and_grouped_run_and_compress(pipe):
    for kw in (dict(acceptance="relaxed"), dict(acceptance="relaxed", drafter="jacobi", relaxation_lambda=5.0),
               dict(acceptance="grouped"), dict(acceptance="grouped", drafter="eagle", resample="released"),
               dict(acceptance="relaxed", drafter="eagle", tree_top_k=1), dict(acceptance="grouped", drafter="eagle",
               tree_top_k=1)):  # fmt: skip
        out = run(pipe, **kw)
        assert out.images.shape == (3, GRID**2) and int(out.images.min()) >= 0
        assert out.stats.step_compression >= 1.0


def test_deterministic_given_generator(pipe):
    a = run(pipe, seed=5, acceptance="exact", drafter="eagle")
    b = run(pipe, seed=5, acceptance="exact", drafter="eagle")
    assert torch.equal(a.images, b.images)


def test_stats_invariants(pipe):
    out = run(pipe, acceptance="exact", drafter="model", num_draft_tokens=3)
    s = out.stats
    assert s.generated_tokens == [GRID**2] * 3
    assert sum(s.accept_histogram) == sum(s.rounds)
    assert s.prefill_tokens == [1, 1, 1] and s.target_forwards == 1 + max(s.rounds)
    assert 1.0 <= s.mean_accepted_length <= 4.0
    # every round emits accepted + 1 tokens, except a row's last round, which may be cut at the image end
    assert s.mean_accepted_drafts + 1 - 3 / sum(s.rounds) * 4 <= s.mean_accepted_length <= s.mean_accepted_drafts + 1
    assert s.step_compression == pytest.approx(GRID**2 / s.target_forwards)
    d = s.to_dict()
    assert {"step_compression", "mean_accepted_length", "time_draft_s", "time_verify_s"} <= set(d)


def test_output_types_and_tuple(pipe):
    out = pipe(class_labels=2, num_images_per_prompt=2, generator=torch.Generator().manual_seed(0))
    assert isinstance(out, SpeculativeImageOutput) and len(out.images) == 2
    assert out.images[0].size == (16, 16)
    arr = pipe(class_labels=[1], output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert arr.shape == (1, 16, 16, 1) and 0 <= arr.min() and arr.max() <= 1
    pt, stats = pipe(class_labels=[1], output_type="pt", return_dict=False, generator=torch.Generator().manual_seed(0))
    assert pt.shape == (1, 1, 16, 16) and stats.target_forwards >= 1


def test_callback_sees_tokens(pipe):
    seen = []

    def cb(p, rnd, n, kwargs):
        seen.append((rnd, kwargs["tokens"].clone()))
        return {}

    run(pipe, acceptance="exact", drafter="model", callback_on_step_end=cb)
    assert seen and seen[-1][1].min() >= 0 and seen[0][0] == 1


@pytest.mark.parametrize("method", [dict(acceptance="exact", drafter="model"), dict(acceptance="exact", drafter="eagle"),
                                    dict(acceptance="grouped")])  # fmt: skip
def test_finished_rows_leave_the_batch(parts, method):
    """Rows that finish are compacted out of later forwards (fewer rows scored), while the callback still sees the
    whole [B, N] grid, finished rows keep their tokens and per-row stats stay per original row."""
    target, near, head, vq = parts
    rows_scored, grids = [], []
    original_forward = target.forward

    def counting_forward(input_ids, *args, **kwargs):
        rows_scored.append(input_ids.shape[0])
        return original_forward(input_ids, *args, **kwargs)

    def cb(p, rnd, n, kwargs):
        grids.append(kwargs["tokens"].clone())
        return {}

    pipe = SpeculativeARImagePipeline(target, vq, near, head)
    target.forward = counting_forward
    try:
        out = run(pipe, class_labels=[0, 1, 2, 3], callback_on_step_end=cb, **method)
    finally:
        del target.forward
    s = out.stats
    assert s.generated_tokens == [GRID**2] * 4 and len(set(s.rounds)) > 1  # ragged: rows finish apart
    assert rows_scored[0] == 8 and min(rows_scored) < 8  # CFG rows [cond; uncond] of the live rows only
    assert all(g.shape == (4, GRID**2) for g in grids)
    assert torch.equal(grids[-1], out.images)
    for a, b in zip(grids, grids[1:]):  # tokens, once written, never change
        assert torch.equal(b[a >= 0], a[a >= 0])


def test_save_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = SpeculativeARImagePipeline.from_pretrained(tmp_path / "pipe")
    a = run(pipe, seed=3, acceptance="exact", drafter="eagle")
    b = run(loaded, seed=3, acceptance="exact", drafter="eagle")
    assert torch.equal(a.images, b.images)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(class_labels=[CLASSES]), "class_labels"),
        (dict(class_labels=[-1]), "class_labels"),
        (dict(class_labels=[0.5]), "class_labels"),
        (dict(acceptance="fast"), "acceptance"),
        (dict(drafter="magic"), "drafter"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(acceptance="jacobi", drafter="model"), "drafter"),
        (dict(output_type="jpeg"), "output_type"),
        (dict(acceptance="relaxed", relaxation_lambda=0.5), "relaxation_lambda"),
        (dict(acceptance="grouped", do_sample=False), "grouped"),
        (dict(temperature=-1.0), "temperature"),
        (dict(acceptance="exact", drafter="eagle", tree_depth=0), "tree_depth"),
        (dict(acceptance="exact", drafter="eagle", tree_top_k=0), "tree_top_k"),
        (dict(acceptance="jacobi", jacobi_window=0), "jacobi_window"),
    ],
)
def test_bad_inputs(pipe, kwargs, match):
    kwargs.setdefault("class_labels", [0])
    with pytest.raises(ValueError, match=match):
        pipe(**kwargs)


def test_incompatible_components(parts):
    target, _, _, vq = parts
    other_vocab = LlamaGenGPT(vocab_size=V * 2, dim=16, n_layer=1, n_head=2, num_classes=CLASSES, block_size=16)
    with pytest.raises(ValueError, match="vocab_size"):
        SpeculativeARImagePipeline(target, vq, draft_model=other_vocab)
    with pytest.raises(ValueError, match="codebook_size"):
        SpeculativeARImagePipeline(other_vocab, vq)
    pipe = SpeculativeARImagePipeline(target, vq)
    with pytest.raises(ValueError, match="draft_model"):
        pipe(class_labels=[0], drafter="model")


@pytest.mark.parametrize(
    "method, broken",
    [
        (dict(acceptance="none"), "target"),
        (dict(acceptance="grouped"), "target"),
        (dict(acceptance="exact", drafter="eagle"), "target"),
        (dict(acceptance="exact", drafter="eagle"), "eagle"),
        (dict(acceptance="exact", drafter="model"), "draft"),
    ],
)
def test_nan_logits_raise(parts, method, broken):
    """NaN weights (target or drafter) give a clear ValueError, never silent tokens: the pipeline's distributions
    are validated where they are made (`SamplingParams.probs`), so its verifier calls skip re-validation."""
    import copy

    target, near, head, vq = (copy.deepcopy(m) for m in parts)
    with torch.no_grad():
        for p in {"target": target, "eagle": head, "draft": near}[broken].parameters():
            p.fill_(float("nan"))
    pipe = SpeculativeARImagePipeline(target, vq, near, head)
    with pytest.raises(ValueError, match="NaN"):
        run(pipe, **method)
