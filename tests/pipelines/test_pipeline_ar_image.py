"""SpeculativeARImagePipeline on tiny random components: losslessness, ragged batches, CFG, I/O, errors."""

import copy

import factories
import numpy as np
import pytest
import torch
from pipeline_mixin import SpeculativePipelineTesterMixin
from scipy import stats as scipy_stats

from mmspec.decoding import ACCEPTED, BONUS, PREFILL
from mmspec.models.llamagen.eagle import EagleHead
from mmspec.models.llamagen.gpt import LlamaGenGPT
from mmspec.pipelines import SpeculativeARImagePipeline, SpeculativeImageOutput


V, GRID, CLASSES = 16, 4, 4


def tiny_gpt(seed, dim=32, n_layer=2, std=0.3):
    return factories.tiny_gpt(
        seed, vocab_size=V, dim=dim, n_layer=n_layer, num_classes=CLASSES, block_size=GRID**2, std=std
    )


@pytest.fixture(scope="module")
def parts():
    target = tiny_gpt(0)
    near = factories.near_copy(target)  # a draft that mostly agrees with the target
    head = EagleHead.from_target(target, initializer_range=0.3).init_weights(torch.Generator().manual_seed(2)).eval()
    vq = factories.tiny_vq(V)
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
    dict(acceptance="exact", drafter="eagle", tree_nodes=6, tree_depth=3, tree_top_k=2),
    dict(acceptance="exact", drafter="eagle", tree_depth=4, tree_top_k=1),
    dict(acceptance="exact", drafter="jacobi", jacobi_window=5),
    dict(acceptance="jacobi", jacobi_window=16, coupling=False),
    dict(acceptance="jacobi", jacobi_window=4, coupling=True),
    dict(acceptance="relaxed", drafter="model", relaxation_delta=0.0),
]


def test_identical_draft_accepts_everything(parts):
    target, _, _, vq = parts
    pipe = SpeculativeARImagePipeline(target, vq, draft_model=target)
    plain = run(pipe, acceptance="none", do_sample=False)
    out = run(pipe, acceptance="exact", drafter="model", do_sample=False, num_draft_tokens=4)
    assert torch.equal(out.images, plain.images)
    # 1 token from the prefill, then rounds of 5 (4 drafts + bonus): ceil(15 / 5) = 3 rounds
    assert out.stats.target_forwards == 1 + 3
    assert out.stats.acceptance_rate == 1.0
    expected = [PREFILL] + ([ACCEPTED] * 4 + [BONUS]) * 3
    assert out.trace.origin.tolist() == [expected] * 3
    assert out.trace.round.tolist() == [[0] + [1] * 5 + [2] * 5 + [3] * 5] * 3


def _marginals(images, positions):
    return [np.bincount(images[:, j].numpy(), minlength=V) for j in positions]


SAMPLED = [
    dict(acceptance="exact", drafter="model", num_draft_tokens=3),
    dict(acceptance="exact", drafter="eagle", tree_nodes=8, tree_depth=3, tree_top_k=3),
    dict(acceptance="exact", drafter="eagle", tree_depth=3, tree_top_k=1),
    dict(acceptance="jacobi", jacobi_window=6, coupling=False),
    dict(acceptance="jacobi", jacobi_window=6, coupling=True, jacobi_init="random"),
]


@pytest.fixture(scope="module")
def plain_3000(pipe):
    """3000 plain samples (seed 1, label 1): the reference of every two-sample test below, drawn once."""
    return run(pipe, seed=1, class_labels=[1], num_images_per_prompt=3000, acceptance="none").images


@pytest.mark.slow
@pytest.mark.parametrize("method", SAMPLED, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_sampling_marginals_match_plain(pipe, plain_3000, method):
    """Two-sample chi-square, per position, speculative vs plain sampling (CFG 2, T=1) over 3000 images."""
    n, positions, plain = 3000, (1, 2, 3, 7, 15), plain_3000
    spec = run(pipe, seed=2, class_labels=[1], num_images_per_prompt=n, **method).images
    for j, (a, b) in zip(positions, zip(_marginals(plain, positions), _marginals(spec, positions))):
        keep = (a + b) > 0
        p = scipy_stats.chi2_contingency(np.stack([a[keep], b[keep]]))[1]
        assert p > 1e-3, f"position {j}: p={p:.2e} plain={a.tolist()} spec={b.tolist()}"


@pytest.mark.slow
def test_marginal_test_has_power(pipe, plain_3000):
    """The same test rejects a lossy rule (LANTERN with a large budget), so passing it means something."""
    n, plain = 3000, plain_3000
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
        assert out.stats.step_compression > 1.0, kw  # 1.0 = nothing ever accepted


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


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(class_labels=[CLASSES]), ValueError, "class_labels"),
        (dict(class_labels=[-1]), ValueError, "class_labels"),
        (dict(class_labels=[0.5]), TypeError, "class_labels"),
        (dict(class_labels="3"), TypeError, "class_labels"),
        (dict(class_labels=[True]), TypeError, "class_labels"),
        (dict(acceptance="fast"), ValueError, "acceptance"),
        (dict(drafter="magic"), ValueError, "drafter"),
        (dict(num_draft_tokens=0), ValueError, "num_draft_tokens"),
        (dict(num_draft_tokens=2.5), TypeError, "num_draft_tokens"),
        (dict(num_draft_tokens="4"), TypeError, "num_draft_tokens"),
        (dict(num_draft_tokens=True), TypeError, "num_draft_tokens"),
        (dict(num_images_per_prompt=2.5), TypeError, "num_images_per_prompt"),
        (dict(num_images_per_prompt=0), ValueError, "num_images_per_prompt"),
        (dict(acceptance="jacobi", drafter="model"), ValueError, "drafter"),
        (dict(output_type="jpeg"), ValueError, "output_type"),
        (dict(acceptance="relaxed", relaxation_lambda=0.5), ValueError, "relaxation_lambda"),
        (dict(acceptance="relaxed", relaxation_top_k=-2), ValueError, "relaxation_top_k"),
        (dict(acceptance="grouped", group_size=2.5), TypeError, "group_size"),
        (dict(acceptance="exact", resample="foo"), ValueError, "resample"),
        (dict(acceptance="grouped", do_sample=False), ValueError, "grouped"),
        (dict(do_sample="yes"), TypeError, "do_sample"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=1e-40), ValueError, "temperature"),  # overflows float32: no silent NaN images
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(guidance_scale=float("inf")), ValueError, "guidance_scale"),
        (dict(guidance_scale=1e39), ValueError, "guidance_scale"),
        (dict(guidance_scale=-1.0), ValueError, "guidance_scale"),
        (dict(guidance_scale="2"), TypeError, "guidance_scale"),
        (dict(acceptance="exact", drafter="eagle", tree_depth=0), ValueError, "tree_depth"),
        (dict(acceptance="exact", drafter="eagle", tree_top_k=0), ValueError, "tree_top_k"),
        (dict(acceptance="jacobi", jacobi_window=0), ValueError, "jacobi_window"),
        (dict(acceptance="jacobi", jacobi_init="zeros"), ValueError, "jacobi_init"),
        (dict(callback_on_step_end="x"), TypeError, "callback_on_step_end"),
        (dict(callback_on_step_end_tensor_inputs=["latents"]), ValueError, "callback_on_step_end_tensor_inputs"),
        (dict(generator=0), TypeError, "generator"),
        (dict(generator=[torch.Generator()] * 2, num_images_per_prompt=2), ValueError, "generator"),
        (dict(generator=[torch.Generator()], num_images_per_prompt=2), ValueError, "generator"),
    ],
)
def test_bad_inputs(pipe, kwargs, error, match):
    kwargs.setdefault("class_labels", [0])
    with pytest.raises(error, match=match):
        pipe(**kwargs)


def test_swapped_components_name_the_argument(parts):
    target, _, head, vq = parts
    with pytest.raises(TypeError, match="transformer"):
        SpeculativeARImagePipeline(vq, target)
    with pytest.raises(TypeError, match="draft_model"):
        SpeculativeARImagePipeline(target, vq, draft_model=head)


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

    target, near, head, vq = (copy.deepcopy(m) for m in parts)
    with torch.no_grad():
        for p in {"target": target, "eagle": head, "draft": near}[broken].parameters():
            p.fill_(float("nan"))
    pipe = SpeculativeARImagePipeline(target, vq, near, head)
    with pytest.raises(ValueError, match="NaN"):
        run(pipe, **method)


class TestSpeculativeARImagePipeline(SpeculativePipelineTesterMixin):
    """The shared speculative-pipeline tests (tests/pipeline_mixin.py) on tiny random LlamaGen components."""

    pipeline_class = SpeculativeARImagePipeline
    lossless_methods = LOSSLESS
    bad_inputs = [
        (dict(acceptance="fast"), ValueError, "acceptance"),
        (dict(class_labels="3"), TypeError, "class_labels"),
    ]

    @pytest.fixture(autouse=True)
    def _parts(self, parts):
        self.parts = parts

    def get_pipeline(self):
        target, near, head, vq = self.parts
        pipe = SpeculativeARImagePipeline(target, vq, near, head)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def get_inputs(self, batch_size):
        return dict(class_labels=[c % CLASSES for c in range(batch_size)], output_type="tokens")

    def output_tokens(self, out):
        return out.images

    def scored_model(self, pipe):
        return pipe.transformer


def test_single_stream_when_guidance_is_off(parts):
    """guidance_scale=1 scores the conditional rows only (B rows, not 2B), for the target and every drafter, and greedy
    decoding equals a cache-free greedy reference computed from the conditional stream alone."""
    target, near, head, vq = parts
    pipe = SpeculativeARImagePipeline(target, vq, near, head)
    labels = torch.tensor([0, 1, 2])
    x = torch.zeros(3, 0, dtype=torch.long)
    with torch.no_grad():  # reference: teacher-forced forward over the whole prefix, argmax of the last position
        for _ in range(GRID**2):
            logits = target.forward_train(torch.cat([x, x.new_zeros(3, 1)], 1), labels).logits[:, -1]
            x = torch.cat([x, logits.argmax(-1, keepdim=True)], 1)
    models = {"target": target, "draft": near, "eagle": head}
    originals = {name: m.forward for name, m in models.items()}

    def counting(name, rows):
        def forward(*args, **kwargs):
            rows.setdefault(name, set()).add(args[0].shape[0])  # input_ids (GPT) or hidden (EAGLE): [rows, M, ...]
            return originals[name](*args, **kwargs)

        return forward

    for method in (dict(acceptance="none"), *LOSSLESS[:2], LOSSLESS[4]):
        rows = {}
        for name, m in models.items():
            m.forward = counting(name, rows)
        try:
            out = run(pipe, class_labels=[0, 1, 2], guidance_scale=1.0, do_sample=False, **method)
        finally:
            for m in models.values():
                del m.forward
        assert torch.equal(out.images, x), method
        assert all(max(r) == 3 for r in rows.values()), (method, rows)


def test_callback_may_not_change_tokens(pipe):
    def cb(p, rnd, n, kwargs):
        kwargs["tokens"][:, 0] = 0 if int(kwargs["tokens"][0, 0]) else 1
        return kwargs

    with pytest.raises(ValueError, match="callback_on_step_end"):
        run(pipe, acceptance="exact", drafter="model", callback_on_step_end=cb)


def test_callback_gets_the_trace(pipe):
    seen = []

    def cb(p, rnd, n, kwargs):
        seen.append((n, kwargs["trace"].origin.clone()))

    out = run(pipe, acceptance="exact", drafter="model", callback_on_step_end=cb,
              callback_on_step_end_tensor_inputs=["trace"])  # fmt: skip
    assert torch.equal(seen[-1][1], out.trace.origin)
    assert [n for n, _ in seen] == [int((o >= 0).sum()) for _, o in seen]


class _Stop(Exception):
    pass


def _first_pairs(pipe, n, seed, **method):
    """(x0, x1) of `n` images decoded by the pipeline (stopped after the first round through the callback)."""
    got = {}

    def cb(p, rnd, generated, kwargs):
        got["tokens"] = kwargs["tokens"][:, :2].clone()
        raise _Stop

    with pytest.raises(_Stop):
        pipe(class_labels=[1], num_images_per_prompt=n, guidance_scale=1.0, generator=torch.Generator().manual_seed(seed),
             output_type="tokens", callback_on_step_end=cb, **method)  # fmt: skip
    return got["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["jacobi", "model"])
def test_relaxed_tv_bound_through_the_pipeline(parts, drafter):
    """LANTERN's documented per-token bound, per drafter, checked on the law of the first two tokens (x0, x1) decoded
    by the pipeline: TV(pipeline, plain) <= E_x0[bound(x0)] + noise, where the plain law p(x0) p(x1 | x0) and the
    bound are computed exactly from the models (point-mass Jacobi drafts: delta; drafts sampled from the draft model's
    q: sum_v min(q(v | x0), delta)). (Measured here: 0.038 for Jacobi, bound 0.05; 0.069 for the draft model, above
    delta but within its bound 0.42.)"""
    target, near, head, vq = parts
    pipe = SpeculativeARImagePipeline(target, vq, near, head)
    pipe.set_progress_bar_config(disable=True)
    delta, n = 0.05, 100_000
    label = torch.tensor([1])
    with torch.no_grad():
        cache = target.setup_cache(1, 8)
        p0 = target.prefill(label, cache).logits[0, -1].softmax(-1)  # [V]
        x0 = torch.arange(V)[:, None]
        p1 = target.forward_train(torch.cat([x0, x0], 1), label.expand(V)).logits[:, -1].softmax(-1)  # [V, V]
        q1 = near.forward_train(torch.cat([x0, x0], 1), label.expand(V)).logits[:, -1].softmax(-1)
    plain_law = (p0[:, None] * p1).double()  # [x0, x1]
    bound = delta if drafter == "jacobi" else float((p0 * q1.clamp(max=delta).sum(-1)).sum())
    pairs = _first_pairs(pipe, n, 0, acceptance="relaxed", drafter=drafter, relaxation_top_k=V - 1,
                         relaxation_delta=delta, **({"jacobi_window": 1} if drafter == "jacobi" else {"num_draft_tokens": 1}))  # fmt: skip
    law = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double().view(V, V) / n
    tv = 0.5 * float((law - plain_law).abs().sum())
    # noise: E|p_hat - p| ~ sqrt(2 p (1 - p) / (pi n)) per cell; the margin is ~2x the expected TV of two equal laws
    noise = 0.8 * float((plain_law * (1 - plain_law) / n).sqrt().sum())
    assert tv <= bound + noise, (tv, bound, noise)


@pytest.mark.parametrize("method", LOSSLESS[:5], ids=["draft", "eagle-chain", "eagle-tree", "eagle-chain-4", "jacobi"])
def test_engine_forwards_skip_the_syncing_range_checks(pipe, method, monkeypatch):
    """The per-round forwards of target, draft model and EAGLE head run with validate=False (no host syncs for the
    id / slot range checks); only the tree path commit checks its slots."""
    from mmspec.cache import StaticKVCache
    from mmspec.models.llamagen.eagle import EagleHead

    calls = []
    for cls, name in ((LlamaGenGPT, "check_inputs"), (StaticKVCache, "check_slots"), (EagleHead, "_inputs")):
        original = getattr(cls, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            flag = kwargs.get("values", kwargs.get("validate", True))
            position = {"check_inputs": 7, "check_slots": 2, "_inputs": 4}[_name]  # the flag's positional index
            if len(args) > position:
                flag = args[position]
            calls.append((_name, flag))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    run(pipe, **method)
    checked = [c for c in calls if c[1] is not False]
    assert calls and all(name == "check_slots" for name, _ in checked), checked
    if method.get("tree_top_k", 1) == 1:
        assert not checked  # chains and Jacobi windows: no value check at all
