"""The vision-aware EAGLE heads (`VisionEagleHead`: ViSpec, SpecVLM, MSD) on the deployed VLM classes of
`test_deployed_vlms` (Qwen2.5-VL / Qwen3-VL: dynamic grids; LLaVA-Next / LLaVA-OneVision: any-resolution tiles),
whose images differ in size: the draft side splits each row's image tokens by the images' actual lengths
(`mmspec.models.hf.image_layout`), compresses each image on its own and packs them back.

Greedy decoding with each head equals plain greedy on a ragged batch of four different grids and at batch 1, and (Qwen)
with several images in one prompt; the draft-side image tokens of every row are what the policy keeps of that row's
images, counted here from the images' sizes (pool / conv: `s x s` blocks of each Qwen image's merged grid, runs of
`ratio` tokens on any-resolution tiles); the first sampled tokens follow the target's law (ViSpec on Qwen2.5-VL).
The heads are `test_vision_drafters`' (random policy weights, `fc` and layer of the class's fitted EAGLE head)."""

import math

import pytest
import torch
from factories import assert_first_tokens_follow
from qwen_vl_fixtures import images
from test_deployed_vlms import KINDS, QWEN, _pipe, _sizes, plain_ragged, sampled_first_tokens
from vision_seam_fixtures import check_positions, record_head_positions
from vlm_fixtures import prompts, random_vision_head

from mmspec.compressors import VisionPolicy
from mmspec.counting import HostReads
from mmspec.drafters.vision_eagle import VISION_POLICIES, VisionEagleHead
from mmspec.models.hf.image_layout import image_layout
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


NUM_QUERIES, RATIO = 3, 4  # ViSpec: 2 tokens + a global vector per image; pool / conv: 2 x 2 blocks
EXPERTS = ("prune", "pool", "conv", "resampler")  # SpecVLM's experts that keep image tokens


def vision_head(text_head, target, policy, seed=0):
    return random_vision_head(text_head, target, policy, seed, num_queries=NUM_QUERIES, ratio=RATIO, img_scale=0.02)


@pytest.fixture(scope="module", params=KINDS)
def base(request):
    """(kind, the class's pipeline with its fitted EAGLE head, plain greedy on the ragged batch)."""
    return _pipe(request.param), plain_ragged(request.param)


def with_head(pipe, policy):
    p = SpeculativeVLMPipeline(pipe.model, pipe.processor, eagle_head=vision_head(pipe.eagle_head, pipe.model, policy))
    p.set_progress_bar_config(disable=True)
    return p


def merged_grid(size):
    """A Qwen image's merged-token grid from its pixel size (the fixtures' processor: 4 px patches, 2 x 2 merge)."""
    return size[0] // 8, size[1] // 8


def expected_tokens(policy, kind, sizes, counts):
    """What `policy` keeps of each image (`sizes`: pixels, `counts`: its image tokens), counted from the sizes."""
    out = []
    for size, n in zip(sizes, counts, strict=True):
        h, w = merged_grid(size) if kind in QWEN else (None, None)
        out.append(
            {
                "msd": n,
                "vispec": NUM_QUERIES - 1,
                "resampler": min(NUM_QUERIES, n),
                "prune": math.ceil(n / RATIO),
                "pool": math.ceil(h / 2) * math.ceil(w / 2) if h else math.ceil(n / RATIO),
            }[policy if policy != "conv" else "pool"]
        )
    return out


def image_counts(pipe, ims, texts=None, messages=None):
    ids, _, _ = pipe.encode(ims, texts, messages, "cpu")
    return (ids == pipe.model.config.image_token_id).sum(1).tolist()


@pytest.mark.parametrize("policy", VISION_POLICIES)
def test_vision_heads_equal_plain_greedy_ragged_and_batch1(base, policy):
    """Chain on the ragged batch (four grids), EAGLE-2 tree at batch 1: both equal plain greedy; drafts accepted."""
    pipe, plain = base
    p = with_head(pipe, policy)
    ims, texts = images(_sizes(pipe.kind)), prompts(4)
    out = p(images=ims, prompt=texts, max_new_tokens=24, acceptance="exact", drafter="eagle", tree_depth=4,
            output_type="ids")  # fmt: skip
    assert torch.equal(out.sequences, plain)
    assert out.stats.mean_accepted_length > 1.0
    if policy != "specvlm":  # the gate's choice per row is random here; the experts: the next test
        per_row = expected_tokens(policy, pipe.kind, _sizes(pipe.kind), image_counts(pipe, ims, texts))
        assert out.stats.extra["draft_image_tokens_per_answer"] == per_row
    one = p(images=ims[1:2], prompt=texts[1:2], max_new_tokens=24, acceptance="exact", drafter="eagle", tree_depth=3,
            tree_top_k=3, tree_nodes=8, output_type="ids")  # fmt: skip
    assert torch.equal(one.sequences[0], plain[1])


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "llava_onevision"])
def test_specvlm_experts_keep_each_rows_share_of_its_grid(kind):
    """SpecVLM forced to each expert on the ragged batch: lossless, and each row keeps what that expert keeps of its
    own image (Qwen: 2 x 2 blocks of its merged grid, partial at odd edges; any-res: runs of 4 tiles' tokens)."""
    pipe = _pipe(kind)
    ims, texts = images(_sizes(kind)), prompts(4)
    plain = pipe(images=ims, prompt=texts, max_new_tokens=12, acceptance="none", output_type="ids").sequences
    p = with_head(pipe, "specvlm")
    counts = image_counts(pipe, ims, texts)
    assert len(set(counts)) == 4, counts
    for name in EXPERTS:
        p.eagle_head.vision.force(name)
        out = p(images=ims, prompt=texts, max_new_tokens=12, acceptance="exact", drafter="eagle", tree_depth=3,
                output_type="ids")  # fmt: skip
        assert torch.equal(out.sequences, plain), name
        assert out.stats.extra["gate_choice"] == [name] * 4
        assert out.stats.extra["draft_image_tokens_per_answer"] == expected_tokens(name, kind, _sizes(kind), counts)


MULTI = [[(24, 32), (32, 16)], [(16, 16), (8, 40), (24, 32)]]  # two rows: two and three images, five grids


def multi_image_inputs():
    ims = [im for row in MULTI for im in images(row, seed=3)]
    chats = [[{"role": "user", "content": [{"type": "image"}] * len(row) + [{"type": "text", "text": text}]}]
             for row, text in zip(MULTI, ["w3 w9", "w5 w1 w7"], strict=True)]  # fmt: skip
    return ims, chats


@pytest.mark.parametrize("policy", ["vispec", "msd", "pool"])
def test_several_images_per_prompt_qwen(policy):
    """Rows with two and three images of different grids: each image is compressed on its own (ViSpec: two tokens
    per image, pool: per-image blocks, not one run's) and greedy equals plain greedy."""
    pipe = _pipe("qwen3_vl")
    sizes = MULTI
    ims, chats = multi_image_inputs()
    plain = pipe(images=ims, messages=chats, max_new_tokens=16, acceptance="none", output_type="ids").sequences
    p = with_head(pipe, "specvlm" if policy == "pool" else policy)
    if policy == "pool":
        p.eagle_head.vision.force("pool")
    out = p(images=ims, messages=chats, max_new_tokens=16, acceptance="exact", drafter="eagle", tree_depth=3,
            output_type="ids")  # fmt: skip
    assert torch.equal(out.sequences, plain)
    per_row = [sum(expected_tokens(policy, "qwen3_vl", row, [h * w // 64 for h, w in row])) for row in sizes]
    assert out.stats.extra["draft_image_tokens_per_answer"] == per_row


def test_policy_tokens_sit_at_their_own_images_last_positions():
    """ViSpec on the multi-image rows: the head's prefill writes, at image positions, exactly the last two
    positions of every image (each run of image tokens between Qwen's vision start / end tokens), and every kept
    token is at the target's position through the rounds (`check_positions`)."""
    pipe = _pipe("qwen3_vl")
    p = with_head(pipe, "vispec")
    ims, chats = multi_image_inputs()
    run = lambda: p(images=ims, messages=chats, max_new_tokens=8, acceptance="greedy", drafter="eagle",  # noqa: E731
                    tree_depth=3, output_type="ids")  # fmt: skip
    _, calls = record_head_positions(p, p.eagle_head, run)
    check_positions(calls)
    ctx = [c for kind, _, c in calls if kind == "prefill"][-1]
    written = torch.cat([pos for kind, pos, _ in calls if kind == "prefill"], dim=1)
    for r, row in enumerate(MULTI):
        mask = ctx["image_mask"][r].tolist()
        ends = [q for q in range(len(mask)) if mask[q] and (q + 1 == len(mask) or not mask[q + 1])]
        assert len(ends) == len(row)
        got = [q for q in written[r, : int(ctx["kept"][r])].tolist() if mask[q]]
        assert got == sorted(q - d for q in ends for d in (1, 0)), (r, got, ends)


@pytest.mark.parametrize("policy", VISION_POLICIES)
def test_images_of_different_sizes_cost_no_host_read(policy):
    """Counted as an accelerator pays them (`HostReads`, CPU-only checks skipped): on the ragged Qwen batch a vision
    head reads no more outside its rounds than the text EAGLE head (SpecVLM: + its gate choice and image-token
    stats, as on LLaVA, `tests/decoding/test_host_reads.py`): splitting and packing the images is host-known."""
    pipe = _pipe("qwen2_5_vl")
    kw = dict(images=images(_sizes("qwen2_5_vl")), prompt=prompts(4), max_new_tokens=12, acceptance="exact",
              drafter="eagle", tree_depth=4, output_type="ids")  # fmt: skip

    def reads_outside_rounds(p):
        with torch.no_grad(), HostReads() as reads:
            out = p(**kw)
        return reads.count - max(out.stats.rounds), reads.where

    text, where = reads_outside_rounds(pipe)
    mine, mine_where = reads_outside_rounds(with_head(pipe, policy))
    assert mine <= text + (2 if policy == "specvlm" else 0), (mine_where, where)


def test_image_layout_from_the_processor():
    """Qwen: each image's length and grid from `image_grid_thw`; any-res: the processor's count per image (two
    adjacent images in one prompt are one run of image tokens, but two images)."""
    pipe = _pipe("qwen2_5_vl")
    ids, _, extra = pipe.encode_host(images(_sizes("qwen2_5_vl")), prompts(4), None)
    layout = image_layout(pipe.model, ids, extra)
    assert layout.grids == [[merged_grid(s)] for s in _sizes("qwen2_5_vl")]
    assert layout.lengths == [[h * w] for h, w in (merged_grid(s) for s in _sizes("qwen2_5_vl"))]
    with pytest.raises(ValueError, match="image_grid_thw"):
        image_layout(pipe.model, ids, {"image_grid_thw": extra["image_grid_thw"].flip(0)})
    pipe = _pipe("llava_next")
    ims = images(_sizes("llava_next")[1:3], seed=3)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "w3"}]}]
    ids, _, extra = pipe.encode_host(ims, None, [chat])
    layout = with_head(pipe, "msd").image_layout(ids, extra)
    assert layout.lengths == [[52, 72]] and layout.grids == [[None, None]]  # base tile + tiles + newlines each


def test_check_target_on_dynamic_grids():
    """`tokens_per_image` is nominal on a target with dynamic grids (any value passes), but a policy that only
    compresses fixed-size images is refused, naming `vision_policy`; a fixed-grid LLaVA still compares it."""
    from vlm_fixtures import tiny_llava

    target = _pipe("qwen2_5_vl").model
    VisionEagleHead.from_target(target, vision_policy="specvlm", tokens_per_image=16).check_target(target)
    head = VisionEagleHead.from_target(target, vision_policy="msd")

    class FixedOnly(VisionPolicy):
        def compress(self, images, generator=None):
            return images.tokens, images.positions, None

    head.vision = FixedOnly(head.config.tokens_per_image, head.config.hidden_size)
    with pytest.raises(ValueError, match="vision_policy"):
        head.check_target(target)
    llava = tiny_llava()
    with pytest.raises(ValueError, match="tokens_per_image=16"):
        VisionEagleHead.from_target(target, vision_policy="msd", tokens_per_image=9).check_target(llava)


@pytest.mark.slow
def test_vispec_first_sampled_tokens_follow_the_target_law():
    """ViSpec on Qwen2.5-VL at T = 1.5: tokens 2 and 3 (drafted from the compacted prefill of a 3 x 4 grid,
    verified, resampled) follow the exact law of transformers' forward over the image prompt."""
    out, law2, law3, n = sampled_first_tokens(with_head(_pipe("qwen2_5_vl"), "vispec"), 30_000)
    assert out.stats.mean_accepted_drafts > 0.05
    assert out.stats.extra["draft_image_tokens_per_answer"] == [NUM_QUERIES - 1] * n
    assert_first_tokens_follow(out.sequences, law2, law3, n, what="vispec: ")
