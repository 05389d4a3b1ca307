"""`SpeculativeVLMPipeline` reliability: prompts past the model's context and out-of-range or ill-typed arguments are
refused before any model forward, naming the argument; attention reads only the cache slots in use (cost follows
the tokens generated, not `max_new_tokens`) with answers unchanged."""

import pytest
import torch
from test_pipeline_vlm import DRAFTERS, make_pipe
from vlm_fixtures import hf_greedy, images, prompts

import mmspec.models.hf.target as hf
from mmspec.cache import StaticKVCache
from mmspec.methods import VLM_LIMITS
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


@pytest.fixture(scope="module")
def lm_pipe():
    return make_pipe("lm")


@pytest.fixture
def no_work(lm_pipe, monkeypatch):
    """Fail the test if a call gets as far as the target's prefill."""

    def prefill(*args, **kwargs):
        raise AssertionError("the call started work: the target's prefill ran")

    monkeypatch.setattr(hf.HFTarget, "prefill", prefill)
    return lm_pipe


# the tiny Llama's context is 512 positions (vlm_fixtures.text_config); its chat template adds 5 tokens
def test_prompt_longer_than_the_context_is_refused(no_work):
    with pytest.raises(ValueError, match=r"prompt is 605 tokens long.*context of 512"):
        no_work(prompt=" ".join(["w1"] * 600), max_new_tokens=4, acceptance="none")


def test_max_new_tokens_past_the_context_is_refused(no_work):
    with pytest.raises(ValueError, match=r"max_new_tokens=450 does not fit.*prompt is 105 tokens.*<= 407"):
        no_work(prompt=" ".join(["w1"] * 100), max_new_tokens=450, acceptance="none")


BAD = [  # (call kwargs, error, message)
    (dict(tree_top_k=100_000, drafter="eagle"), ValueError, r"tree_top_k must be in \[1, 32\]"),
    (
        dict(tree_top_k=VLM_LIMITS["tree_top_k"] + 1, drafter="model"),
        ValueError,
        rf"tree_top_k must be in \[1, {VLM_LIMITS['tree_top_k']}\]",
    ),
    (
        dict(tree_depth=VLM_LIMITS["tree_depth"] + 1),
        ValueError,
        rf"tree_depth must be in \[1, {VLM_LIMITS['tree_depth']}\]",
    ),
    (
        dict(num_draft_tokens=VLM_LIMITS["num_draft_tokens"] + 1),
        ValueError,
        rf"num_draft_tokens must be in \[1, {VLM_LIMITS['num_draft_tokens']}\]",
    ),
    (dict(max_new_tokens=VLM_LIMITS["max_new_tokens"] + 1), ValueError, "max_new_tokens must be in"),
    (dict(max_new_tokens=8.0), TypeError, "max_new_tokens must be an int"),
    (dict(draft_confidence="0.5", drafter="model"), TypeError, "draft_confidence"),
    (dict(draft_confidence=1.0, drafter="model"), ValueError, "draft_confidence"),
    (dict(draft_length="adaptive", drafter="model"), ValueError, "draft_length"),
    (dict(draft_length="cost", drafter="model", verify_token_cost=-1.0), ValueError, "verify_token_cost"),
    (dict(draft_length="heuristic", drafter="model", draft_step_cost=0.5), ValueError, "draft_step_cost"),
    (dict(draft_length="heuristic", acceptance="none"), ValueError, "draft_length"),
    (dict(draft_vocab=torch.tensor([1.5, 2.0]), drafter="model"), TypeError, "draft_vocab"),
    (dict(draft_vocab="w1 w2", drafter="model"), TypeError, "draft_vocab"),
    (dict(return_dict="no"), TypeError, "return_dict"),
    (dict(prompt=""), ValueError, "prompt must not be empty"),
    (dict(prompt=["w1 w2", "  "]), ValueError, "prompt must not be empty"),
    (dict(images="no/such.png"), TypeError, r"images\[0\] must be a PIL.Image"),
    (dict(images=[]), ValueError, "images must be an image or a non-empty list"),
    (dict(top_k=65, do_sample=True, acceptance="exact"), ValueError, "top_k must be at most the vocabulary"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD, ids=[str(b[0])[:60] for b in BAD])
def test_bad_arguments_are_refused_before_work(no_work, kwargs, error, message):
    call = dict(prompt="w1 w2 w3", max_new_tokens=8, acceptance="greedy") | kwargs
    with pytest.raises(error, match=message):
        no_work(**call)


@pytest.fixture
def windows(monkeypatch):
    """Record (slots handed to attention, slots allocated) of every target / draft-LM forward."""
    seen = []
    update = StaticKVCache.update

    def recording(self, layer, write_slots, k_new, v_new):
        k, v = update(self, layer, write_slots, k_new, v_new)
        if layer == 0:
            seen.append((k.shape[2], int(self.lengths.max()), int(write_slots.max()) + 1))
        return k, v

    monkeypatch.setattr(StaticKVCache, "update", recording)
    return seen


def test_attention_reads_only_the_slots_in_use(lm_pipe, windows, monkeypatch):
    allocated = []
    init = StaticKVCache.__init__

    def recording(self, n_layer, rows, n_kv_head, max_seq, head_dim, **kwargs):
        allocated.append(max_seq)
        init(self, n_layer, rows, n_kv_head, max_seq, head_dim, **kwargs)

    monkeypatch.setattr(StaticKVCache, "__init__", recording)
    out = lm_pipe(prompt=prompts(1)[0], max_new_tokens=400, acceptance="none")
    assert allocated == [2 * hf.WINDOW_BUCKET]  # the prompt + a bucket, grown in chunks (not prompt + 400 at once)
    assert int((out.sequences >= 0).sum()) > 130  # the answer crosses a window bucket
    for read, committed, written in windows:  # on the CPU exactly the slots in use, not the 400-token allocation
        assert read == max(committed, written)


@pytest.mark.parametrize("drafter,knobs", DRAFTERS)
def test_windowed_answers_equal_plain_and_transformers(lm_pipe, drafter, knobs, monkeypatch, windows):
    monkeypatch.setattr(hf, "WINDOW_BUCKET", 8)  # many window sizes within one short answer
    texts = prompts(2, seed=3)
    for text in texts:
        reference = hf_greedy(lm_pipe.model, lm_pipe.processor, None, text, 40)
        out = lm_pipe(prompt=text, max_new_tokens=40, acceptance="greedy", drafter=drafter, **knobs)
        assert [t for t in out.sequences[0].tolist() if t >= 0] == reference
    plain = lm_pipe(prompt=texts, max_new_tokens=40, acceptance="none").sequences  # ragged batch
    batch = lm_pipe(prompt=texts, max_new_tokens=40, acceptance="greedy", drafter=drafter, **knobs).sequences
    assert torch.equal(plain, batch)
    assert len({read for read, _, _ in windows}) >= 3


def test_llava_images_must_match_the_image_items_of_messages(monkeypatch):
    from vlm_fixtures import tiny_llava, tiny_processor

    pipe = SpeculativeVLMPipeline(tiny_llava(1), tiny_processor())
    monkeypatch.setattr(hf.HFTarget, "prefill", lambda *a, **k: pytest.fail("the target's prefill ran"))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w1 w2"}]}]
    with pytest.raises(ValueError, match=r"got 2 images for 1 \{'type': 'image'\} items in messages"):
        pipe(images=images(2), messages=chat, max_new_tokens=2, acceptance="none")


def test_llava_prompt_with_image_past_the_context_is_refused(monkeypatch):
    from vlm_fixtures import tiny_llava, tiny_processor

    pipe = SpeculativeVLMPipeline(tiny_llava(1), tiny_processor())
    monkeypatch.setattr(hf.HFTarget, "prefill", lambda *a, **k: pytest.fail("the target's prefill ran"))
    with pytest.raises(ValueError, match=r"prompt is \d+ tokens long \(chat template and image tokens"):
        pipe(images=images(1), prompt=" ".join(["w2"] * 500), max_new_tokens=2, acceptance="none")


@pytest.mark.parametrize("drafter,knobs", [("eagle", {"tree_depth": 4}), ("eagle", {"tree_top_k": 3}),
                                           ("model", {"num_draft_tokens": 3})])  # fmt: skip
def test_drafters_read_only_the_slots_in_use(lm_pipe, windows, drafter, knobs):
    """The target, the draft LM and the EAGLE head's one-layer cache all attend over a window, not the allocation."""
    lm_pipe(prompt=prompts(1)[0], max_new_tokens=480, acceptance="greedy", drafter=drafter, **knobs)
    for read, committed, written in windows:
        assert max(committed, written) <= read < max(committed, written) + hf.WINDOW_BUCKET


@pytest.mark.parametrize("drafter,knobs", DRAFTERS)
def test_accelerator_windows_need_no_read_per_forward(lm_pipe, drafter, knobs, monkeypatch):
    """Where a host read costs a device sync, the window comes from a host-side bound (the touched span grows by at
    most a forward's new slots), read back only when it outgrows the last read's window: same answers, and far
    fewer reads than forwards."""
    monkeypatch.setattr(hf, "WINDOW_BUCKET", 16)
    reads, forwards = [], []  # forwards of the target, the draft LM and the EAGLE head: each asks for its window
    read, needed = hf._read_slots_in_use, hf.slots_needed
    monkeypatch.setattr(hf, "_read_slots_in_use", lambda *a: reads.append(1) or read(*a))
    monkeypatch.setattr(hf, "slots_needed", lambda *a, **k: forwards.append(1) or needed(*a, **k))
    texts = prompts(2, seed=3)
    exact = lm_pipe(prompt=texts, max_new_tokens=40, acceptance="greedy", drafter=drafter, **knobs).sequences
    monkeypatch.setattr(hf, "_free_reads", lambda t: False)  # as on a GPU
    reads.clear(), forwards.clear()
    bounded = lm_pipe(prompt=texts, max_new_tokens=40, acceptance="greedy", drafter=drafter, **knobs).sequences
    assert torch.equal(exact, bounded)
    assert len(forwards) >= 10 and len(reads) <= len(forwards) // 2, (len(reads), len(forwards))
