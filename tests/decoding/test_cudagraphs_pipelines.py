"""The zoo's pipeline kinds under `enable_compile(backend="cudagraphs", verify=True)`, through the CPU proxy of CUDA
graph capture (`cudagraph_proxy`): every graph a generation compiles is captured (no skip), reads every weight and KV
cache in place (only per-call data is copied in), writes only static inputs, and the tokens are eager's. On a GPU the
copies this rules out were 60 % of a captured LlamaGen-XL step (`assets/bench/gpu-h200-captured.json`). The VLM runs
with an FR-Spec draft vocabulary on its EAGLE head and its draft LM (the text head's whole round and the target's, and
the draft LM's: the head without a vocabulary traces the same round with its full output layer, a parameter)."""

import factories
import pytest
import torch
from cudagraph_proxy import recording, skips
from test_compiled_mar import parts as mar_parts  # noqa: F401 (a fixture)
from test_compiled_mar import sample
from vlm_fixtures import images, prompts, quick_eagle_pipe

from mmspec.models.llamagen.eagle import EagleHead
from mmspec.models.llamagen.vq import LlamaGenVQ
from mmspec.pipelines import SpeculativeARImagePipeline, SpeculativeContinuousARPipeline
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


MAX_PER_CALL_INPUTS = 8  # tokens, positions, slots, masks, uniforms, counts: what changes from call to call


@pytest.fixture
def recorded(monkeypatch):
    torch._dynamo.reset()
    yield recording(monkeypatch, mark_cpu=True)
    torch._dynamo.reset()


def _check(calls, pipe, before):
    assert skips() == before, "a graph was left uncaptured"
    assert len(calls) == sum(r["graphs"] for r in pipe.compile_report().values()) > 0, pipe.compile_report()
    for call in calls:
        static = set(call["static"])
        copied = [tuple(t.shape) for i, t in enumerate(call["inputs"]) if i not in static]
        assert len(copied) <= MAX_PER_CALL_INPUTS, copied  # a weight or a cache among them: copied every replay
        assert set(call["mutated_input_idxs"]) <= static, "a write into a copy"


def test_llamagen_eagle_chain(recorded):
    target = factories.tiny_gpt(0, vocab_size=16, num_classes=4, block_size=16, std=0.3)
    head = EagleHead.from_target(target, initializer_range=0.3).init_weights(torch.Generator().manual_seed(3)).eval()
    vq = LlamaGenVQ(codebook_size=16, codebook_embed_dim=4, ch=8, ch_mult=(1, 2, 2), z_channels=8, in_channels=1,
                    num_res_blocks=1, norm_num_groups=4).eval()  # fmt: skip
    pipes = [SpeculativeARImagePipeline(target, vq, eagle_head=head) for _ in range(2)]
    pipes[1].enable_compile(backend="cudagraphs", verify=True)
    before = skips()
    kw = dict(
        output_type="tokens", class_labels=[1, 3], acceptance="exact", drafter="eagle", tree_depth=3, do_sample=False
    )  # captured verification draws its uniforms its own way: sampled tokens differ
    eager, captured = (p(generator=torch.Generator().manual_seed(0), **kw).images for p in pipes)
    assert torch.equal(captured, eager)
    _check(recorded, pipes[1], before)
    assert {"target", "draft", "verify"} <= set(pipes[1].compile_report())  # the head's round: one graph


def test_mar_sampler(recorded, mar_parts):  # noqa: F811 (the fixture)
    target, draft, vae = mar_parts
    eager = SpeculativeContinuousARPipeline(target, vae, draft)
    pipe = SpeculativeContinuousARPipeline(target, vae, draft).enable_compile(backend="cudagraphs")
    before = skips()
    torch.testing.assert_close(sample(pipe), sample(eager), rtol=0, atol=0)
    _check(recorded, pipe, before)


@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_vlm_frspec_round_reads_the_draft_vocabulary_in_place(recorded, drafter):
    """A VLM drafter's whole round with an FR-Spec draft vocabulary (the draft LM's `vocab_weight`, a text EAGLE
    head's gathered output rows, `prepare_round`): a replay reads those `[dim, N]` rows in place instead of copying
    them in (a weight copied every round otherwise). The draft LM's are marked static (unmarked: fails); the head's
    are its module's attribute, which the backend reads in place as it does the head's parameters."""
    from mmspec.models.hf.draft import truncated_draft
    from mmspec.models.hf.eagle import TextEagleHead

    base, _ = quick_eagle_pipe()
    text = base.eagle_head
    head = TextEagleHead(**{**{k: v for k, v in text.config.items() if not k.startswith("_")}, "draft_vocab_size": 40})
    head.load_state_dict({k: v for k, v in text.state_dict().items() if k != "draft_vocab"}, strict=False)
    head.set_draft_vocab(torch.arange(4, 44)).eval()
    vocab = torch.arange(4, 44)
    pipes = [SpeculativeVLMPipeline(base.model, base.processor, eagle_head=head,
                                    draft_model=truncated_draft(base.model, 2)) for _ in range(2)]  # fmt: skip
    for p in pipes:
        p.set_progress_bar_config(disable=True)
    pipes[1].enable_compile(backend="cudagraphs", verify=True)
    before = skips()
    kw = dict(images=images(1), prompt=prompts(1), max_new_tokens=8, output_type="ids", do_sample=False,
              drafter=drafter, **({"draft_vocab": vocab} if drafter == "model" else {"tree_depth": 3}))  # fmt: skip
    eager, captured = (p(**kw).sequences for p in pipes)
    assert torch.equal(captured, eager)
    _check(recorded, pipes[1], before)
    rows = (64, 40)  # [dim, N]: the draft vocabulary's output rows
    assert any(tuple(t.shape) == rows for call in recorded for t in call["inputs"]), "no round read the rows"
    for call in recorded:
        static = set(call["static"])
        assert all(tuple(t.shape) != rows for i, t in enumerate(call["inputs"]) if i not in static), "rows copied in"
