"""Host reads per call, counted for every method as an accelerator would pay them (`mmspec.counting.HostReads`:
scalar reads, data-dependent shapes, host copies; the accelerator branches forced, so CPU-only checks are skipped as
on a GPU).

The budget: at most ONE host read per round (the loop's compaction read) and a fixed number per call outside the
rounds (input checks, the prefill's finite check, the end-of-call checks, stats, the output copy). `BUDGETS` is the
single source: method -> (reads per round, reads per call outside the rounds); a run must satisfy
`reads <= per_round * rounds + per_call`, with `rounds` the call's loop rounds from its stats. A read added to a
round breaks every method's budget after a few rounds; one added per call breaks the exact per-call numbers.
Each run is short (a few rounds) at batch 1 and on a ragged batch (CFG on, where the pipeline has it).
"""

import factories
import pytest
import torch

from mmspec.counting import HostReads


# method -> (reads per round, reads per call outside the rounds); measured, see docs/architecture.md
BUDGETS = {
    # LlamaGen class-to-image (CFG), PIL output. Outside the rounds: the target's condition check (the labels, given
    # as Python ints, are range-checked on the host; a tensor of labels costs one more read), the prefill's finite
    # check, the loop's last compaction read, the finite flags, the codes' range, the stats, the image copy (the draft
    # model does not re-read the condition the target checked)
    "ar/plain": (1, 7),
    "ar/draft-chain": (1, 7),
    "ar/eagle-chain": (1, 7),
    "ar/eagle2-tree": (1, 7),
    "ar/lantern": (1, 7),
    "ar/gsd": (1, 7),
    "ar/sjd": (1, 7),
    "ar/scd": (1, 7),
    "ar/sjd-pac": (1, 7),
    # Janus (transformers), tokens out. Outside the rounds: the prompt-length check, one host copy of ids + mask (the
    # processor's output, read on the host under `mmspec.counting.on_host`), the prefill's finite check, the loop's
    # last compaction read, the finite flags, the stats
    "janus/plain": (1, 6),
    "janus/sjd": (1, 6),
    # VLMs (the prompt's bookkeeping from its host copy, `mmspec.counting.on_host`; the vision drafters' policies
    # split / pack images with host-known counts). Outside the rounds: transformers' LLaVA image-token check (2),
    # the prefill's finite check, the loop's last compaction read, the finite flags, the stats; + the draft LM's
    # image-token check (2, its own vision tower); + SpecVLM's gate choice and its image-token stats
    "vlm/plain": (1, 6),
    "vlm/draft-chain": (1, 8),
    "vlm/draft-tree": (1, 8),
    "vlm/eagle-chain": (1, 6),
    "vlm/eagle2-tree": (1, 6),
    "vlm/vispec": (1, 6),
    "vlm/specvlm": (1, 8),
    "vlm/msd": (1, 6),
    # adaptive draft lengths: the next round's widest chain rides on the loop's read (no read of its own)
    "vlm/draft-chain+heuristic": (1, 8),
    "vlm/eagle-chain+cost": (1, 6),
    # the in-round stops (confidence, calibrated) read once after each draft but the last, to end the chain early
    # (`sample_chain`; exact counts in `test_in_round_stops_read_once_per_draft_but_the_last`): with K_max 3, up to
    # two stop reads a round beside the loop's one
    "vlm/draft-chain+confidence": (3, 8),
    "vlm/draft-chain+calibrated": (3, 8),
    "vlm/eagle-chain+batch-calibrated": (3, 6),
    "ar/draft-chain+cost": (1, 7),
    "ar/eagle-chain+heuristic": (1, 7),
    # a list of per-row generators (batch 3, ragged), plain decoding: the compaction reindexes the list with the
    # active flags of the loop's one read (no read of its own). Every method above keeps its budget with per-row
    # generators too (`per_row` cases): each row draws a fixed count a round (a drafter's longest chain, a whole
    # Jacobi window, the verification's `uniform_count` through `CapturedVerify` run eagerly), never per-row counts
    "ar/plain+generators": (1, 5),
    "vlm/plain+generators": (1, 6),
    # MAR: the schedule tells the model its visible counts, no read per step. Outside the rounds: the finite flags,
    # the stats (one read), the labels' range. CSpD (a round verifies up to K AR steps): the exact mode reads the
    # round's decision once (accepted steps, and the rejected tokens that the first chunk of residual tries, drawn
    # for every drafted token before the read, left without a value: one more read per further chunk); the block
    # mode reads nothing in a round (every image advances K steps; the default 100 residual tries of every token
    # are drawn before any read, and the per-image draw counts are the block's, known on the host)
    "mar/plain": (0, 3),
    "mar/cspd-exact": (1, 3),
    "mar/cspd-block": (0, 3),
}


def run_counted(method, call):
    """Run `call()` inside `HostReads`; assert the method's budget; return (reads, rounds)."""
    per_round, per_call = BUDGETS[method]
    with torch.no_grad(), HostReads() as reads:
        out = call()
    stats = out.stats
    rounds = max(stats.rounds) if stats.rounds else 0
    assert rounds >= 2, f"{method}: {rounds} rounds: too short to tell a per-round read"
    budget = per_round * rounds + per_call
    assert reads.count <= budget, f"{method}: {reads.count} host reads in {rounds} rounds > {budget}: {reads.where}"
    return reads.count, rounds


# ---------------------------------------------------------------------- LlamaGen (AR image)
V, GRID = 16, 4
AR_METHODS = {
    "ar/plain": dict(acceptance="none"),
    "ar/draft-chain": dict(acceptance="exact", drafter="model"),
    "ar/eagle-chain": dict(acceptance="exact", drafter="eagle", tree_depth=4),
    "ar/eagle2-tree": dict(acceptance="exact", drafter="eagle", tree_nodes=6, tree_depth=3, tree_top_k=2),
    "ar/lantern": dict(acceptance="relaxed", drafter="model"),
    "ar/gsd": dict(acceptance="grouped"),
    "ar/sjd": dict(acceptance="jacobi", jacobi_window=4, coupling=False),
    "ar/scd": dict(acceptance="jacobi", jacobi_window=4, coupling=True),
    "ar/sjd-pac": dict(acceptance="jacobi", jacobi_window=4, jacobi_tree_width=2, jacobi_tree_depth=3),
    "ar/draft-chain+cost": dict(acceptance="exact", drafter="model", draft_length="cost"),
    "ar/eagle-chain+heuristic": dict(acceptance="exact", drafter="eagle", tree_depth=4, draft_length="heuristic"),
}


@pytest.fixture(scope="module")
def ar_pipe():
    from mmspec.models.llamagen.eagle import EagleHead
    from mmspec.pipelines import SpeculativeARImagePipeline

    target = factories.tiny_gpt(0, vocab_size=V, num_classes=4, block_size=GRID**2, std=0.3)
    near = factories.near_copy(target)
    head = EagleHead.from_target(target, initializer_range=0.3).init_weights(torch.Generator().manual_seed(2)).eval()
    vq = factories.tiny_vq(V)
    pipe = SpeculativeARImagePipeline(target, vq, near, head)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generator(kind, rows):
    """One generator, or one per row (`per_row`: every draw of a fixed count per row, no per-row count read)."""
    if kind == "per_row":
        return [torch.Generator().manual_seed(i) for i in range(rows)]
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("generators", ["one", "per_row"])
@pytest.mark.parametrize("labels", [[1], [0, 1, 2]], ids=["batch1", "batch3"])
@pytest.mark.parametrize("method", list(AR_METHODS))
def test_ar_image_reads_at_most_one_per_round(ar_pipe, method, labels, generators):
    run_counted(method, lambda: ar_pipe(class_labels=labels, generator=_generator(generators, len(labels)),
                                        output_type="pil", **AR_METHODS[method]))  # fmt: skip


def test_forced_accelerator_branches_give_the_same_greedy_tokens(ar_pipe):
    """The branches `HostReads` forces (loop bounds from the drafter, no CPU fast paths) change no greedy token."""
    for method in ("ar/eagle2-tree", "ar/sjd-pac", "ar/draft-chain"):
        kw = dict(class_labels=[0, 1, 2], do_sample=False, output_type="tokens", **AR_METHODS[method])
        if kw["acceptance"] == "jacobi":
            kw.update(do_sample=True, generator=[torch.Generator().manual_seed(i) for i in range(3)])
        cpu = ar_pipe(**kw).images
        if "generator" in kw:
            kw["generator"] = [torch.Generator().manual_seed(i) for i in range(3)]
        with HostReads():
            forced = ar_pipe(**kw).images
        assert torch.equal(cpu, forced), method


# ---------------------------------------------------------------------- Janus (AR image from text, CFG)
@pytest.fixture(scope="module")
def janus_pipe():
    from janus_fixtures import tiny_janus, tiny_processor

    from mmspec.pipelines import SpeculativeJanusPipeline

    pipe = SpeculativeJanusPipeline(tiny_janus(spread=0.3), tiny_processor())
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("generators", ["one", "per_row"])
@pytest.mark.parametrize("prompt", [["w1 w2"], ["w1", "w2 w3 w4"]], ids=["batch1", "batch2"])
@pytest.mark.parametrize("method", ["janus/sjd", "janus/plain"])
def test_janus_reads_at_most_one_per_round(janus_pipe, method, prompt, generators):
    kw = dict(acceptance="jacobi", jacobi_window=4) if method == "janus/sjd" else dict(acceptance="none")
    run_counted(method, lambda: janus_pipe(prompt=prompt, generator=_generator(generators, len(prompt)),
                                           output_type="tokens", **kw))  # fmt: skip


# ---------------------------------------------------------------------- VLM (transformers LLaVA)
VLM_METHODS = {
    "vlm/plain": (None, {}),
    "vlm/draft-chain": ("model", dict(num_draft_tokens=3)),
    "vlm/draft-tree": ("model", dict(tree_depth=3, tree_top_k=3, tree_nodes=8)),
    "vlm/eagle-chain": ("eagle", dict(tree_depth=4)),
    "vlm/eagle2-tree": ("eagle", dict(tree_depth=3, tree_top_k=3, tree_nodes=8)),
    "vlm/vispec": ("eagle", dict(tree_depth=4)),
    "vlm/specvlm": ("eagle", dict(tree_depth=4)),
    "vlm/msd": ("eagle", dict(tree_depth=4)),
    "vlm/draft-chain+heuristic": ("model", dict(num_draft_tokens=3, draft_length="heuristic")),
    "vlm/eagle-chain+cost": ("eagle", dict(tree_depth=4, draft_length="cost")),
    "vlm/draft-chain+confidence": ("model", dict(num_draft_tokens=3, draft_length="confidence")),
    "vlm/draft-chain+calibrated": ("model", dict(num_draft_tokens=3, draft_length="calibrated")),
    "vlm/eagle-chain+batch-calibrated": ("eagle", dict(tree_depth=3, draft_length="batch-calibrated")),
}


@pytest.fixture(scope="module")
def vlm_pipes():
    from vlm_fixtures import tiny_llava, tiny_processor

    from mmspec.drafters.vision_eagle import VisionEagleHead
    from mmspec.models.hf.draft import truncated_draft
    from mmspec.models.hf.eagle import TextEagleHead
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    target = tiny_llava(4, seed=1)
    torch.manual_seed(0)
    text_head = TextEagleHead.from_target(target, initializer_range=0.05).eval()
    base = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=truncated_draft(target, 3),
                                  eagle_head=text_head)  # fmt: skip
    pipes = {name: base for name in VLM_METHODS}
    for policy in ("vispec", "specvlm", "msd"):
        head = VisionEagleHead.from_target(target, vision_policy=policy, num_queries=3, ratio=4)
        with torch.no_grad():
            head.load_text_head(text_head)
        pipes[f"vlm/{policy}"] = SpeculativeVLMPipeline(target, base.processor, eagle_head=head.eval())
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return pipes


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", list(VLM_METHODS))
def test_vlm_reads_at_most_one_per_round(vlm_pipes, method, batch):
    from vlm_fixtures import images, prompts

    drafter, knobs = VLM_METHODS[method]
    acceptance = "none" if drafter is None else "exact"
    run_counted(method, lambda: vlm_pipes[method](images=images(batch), prompt=prompts(batch), max_new_tokens=12,
                                                  acceptance=acceptance, drafter=drafter, output_type="ids",
                                                  generator=torch.Generator().manual_seed(0), **knobs))  # fmt: skip


@pytest.mark.parametrize("method", [m for m in VLM_METHODS if m != "vlm/plain"])
def test_vlm_sampled_with_per_row_generators_reads_at_most_one_per_round(vlm_pipes, method):
    """Sampled, on a batch of 3 with one generator per row: every draw takes a fixed count per row (no read)."""
    from vlm_fixtures import images, prompts

    drafter, knobs = VLM_METHODS[method]
    run_counted(method, lambda: vlm_pipes[method](images=images(3), prompt=prompts(3), max_new_tokens=12,
                                                  acceptance="exact", drafter=drafter, output_type="ids",
                                                  do_sample=True, generator=_generator("per_row", 3),
                                                  **knobs))  # fmt: skip


# ---------------------------------------------------------------------- MAR (continuous tokens) and CSpD
@pytest.fixture(scope="module")
def mar_pipe():
    from mmspec.pipelines import SpeculativeContinuousARPipeline

    pipe = SpeculativeContinuousARPipeline.from_zoo("assets")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("generators", [False, True], ids=["one_generator", "per_image_generators"])
@pytest.mark.parametrize("labels", [[1], [0, 1, 2]], ids=["batch1", "batch3"])
@pytest.mark.parametrize("method", ["mar/plain", "mar/cspd-exact", "mar/cspd-block"])
def test_mar_reads_at_most_one_per_round(mar_pipe, method, labels, generators):
    kw = dict(acceptance="continuous", verify_mode=method.split("-")[1]) if "cspd" in method else {}
    gen = [torch.Generator().manual_seed(i) for i in range(len(labels))] if generators else torch.Generator()
    if not generators:
        gen.manual_seed(0)
    run_counted(method, lambda: mar_pipe(labels, num_ar_steps=4, num_inference_steps=4, output_type="latent",
                                         generator=gen, **kw))  # fmt: skip


@pytest.mark.parametrize(
    "method", ["vlm/plain", "vlm/draft-chain", "vlm/eagle-chain", "vlm/eagle2-tree", "vlm/specvlm"]
)
def test_vlm_window_crosses_buckets_without_reads(vlm_pipes, method, monkeypatch):
    """The transformers adapter's attention window across many buckets (8 slots each here): its host-side bound is
    re-synced from the loop's one read per round (`HFTarget.sync_host`), so crossing a bucket edge reads nothing;
    the per-call budget is the method's own. The tokens are those of the CPU path (exact windows)."""
    from vlm_fixtures import images, prompts

    import mmspec.models.hf.target as hf_target

    monkeypatch.setattr(hf_target, "WINDOW_BUCKET", 8)
    drafter, knobs = VLM_METHODS[method]
    kw = dict(images=images(3), prompt=prompts(3), max_new_tokens=40, acceptance="none" if drafter is None else "exact",
              drafter=drafter, output_type="ids", do_sample=False, **knobs)  # fmt: skip
    reads, rounds = run_counted(method, lambda: vlm_pipes[method](**kw))
    assert rounds >= 10, rounds
    assert torch.equal(vlm_pipes[method](**kw).sequences, _ids_of(vlm_pipes[method], kw))


def _ids_of(pipe, kw):
    with torch.no_grad(), HostReads():
        return pipe(**kw).sequences


def test_plain_with_per_row_generators_reads_at_most_one_per_round(ar_pipe, vlm_pipes, monkeypatch):
    """A list of generators (one per row; the VLM's rows stop at EOS in different rounds, so the loop compacts):
    compaction reindexes the list from the loop's one read per round; the tokens are those of the CPU path."""
    from vlm_fixtures import images, prompts

    def gens():
        return [torch.Generator().manual_seed(i) for i in range(3)]

    ar = dict(class_labels=[0, 1, 2], output_type="tokens", acceptance="none")
    run_counted("ar/plain+generators", lambda: ar_pipe(generator=gens(), **ar))
    pipe = vlm_pipes["vlm/plain"]
    vlm = dict(images=images(3), prompt=prompts(3), max_new_tokens=12, acceptance="none", output_type="ids",
               do_sample=True)  # fmt: skip
    first = pipe(generator=gens(), **vlm).sequences
    monkeypatch.setattr(pipe.model.generation_config, "eos_token_id", int(first[0, 2]))  # row 0 stops early
    out = pipe(generator=gens(), **vlm)
    assert len(set(out.stats.generated_tokens)) > 1, out.stats.generated_tokens  # ragged: the loop compacts
    run_counted("vlm/plain+generators", lambda: pipe(generator=gens(), **vlm))
    with torch.no_grad(), HostReads():
        forced = pipe(generator=gens(), **vlm).sequences
    assert torch.equal(out.sequences, forced)


# ---------------------------------------------------------------------- the in-round stops, counted exactly
SURE, UNSURE = 0.97, 0.05  # the drawn token's raw draft probability


def _chain_reads(policy, probs):
    """Run `sample_chain` (greedy, 2 rows, K_max 5) under `HostReads` with a draft whose drawn token has the raw
    probability `probs[d]` at draft `d` in both rows; returns (drafts drawn, host reads)."""
    from mmspec.decoding import Guidance
    from mmspec.drafters.chain import sample_chain
    from mmspec.drafters.lengths import make_draft_length
    from mmspec.sampling import SamplingParams

    vocab, rows = 32, 2
    knobs = dict(draft_length=policy, draft_confidence=None, draft_step_cost=0.1, verify_token_cost=0.1,
                 verify_costs=None)  # fmt: skip
    length = make_draft_length(knobs, 5)
    length.start(rows, "cpu")
    steps = iter(probs)

    def step(feed):  # logits whose argmax (token 0) has raw probability p
        p = next(steps)
        rest = torch.full((rows, vocab - 1), (1 - p) / (vocab - 1))
        return torch.cat([torch.full((rows, 1), p), rest], 1).log()

    with torch.no_grad(), HostReads() as reads:
        tokens, _, _ = sample_chain(step, None, 5, Guidance(SamplingParams()), torch.Generator(),
                                    torch.full((rows,), 5), confidence=length.confidence,
                                    stop=getattr(length, "stop", None))  # fmt: skip
    return tokens.shape[1], reads.count


@pytest.mark.parametrize("policy", ["confidence", "calibrated", "batch-calibrated"])
def test_in_round_stops_read_once_per_draft_but_the_last(policy):
    """A stop inside the round needs the host to know whether any row drafts on: exactly one read after each draft
    but the last. A chain of sure drafts runs to its length (5 drafts, 4 reads); an unsure second draft ends it
    there (2 drafts, 2 reads: the second read saw that no row drafts on). The fixed and per-round policies read
    nothing in the chain."""
    assert _chain_reads(policy, [SURE] * 5) == (5, 4)
    assert _chain_reads(policy, [SURE, UNSURE] + [SURE] * 3) == (2, 2)
    for per_round in ("fixed", "heuristic", "cost"):
        assert _chain_reads(per_round, [SURE, UNSURE] + [SURE] * 3) == (5, 0)
