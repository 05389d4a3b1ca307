"""Draft-side vision-token policies (`mmspec.compressors`): gathering image tokens with the target's positions, every
policy's positions / counts, the pooling and pruning rules, the resampler's layout, the elastic gate, bad arguments.

Random tensors only: dim 32, tokens_per_image 16 (a 4 x 4 grid)."""

import pytest
import torch

from mmspec.compressors import (
    POLICIES,
    Conv,
    Elastic,
    Passthrough,
    Pool,
    Prune,
    Resampler,
    TextOnly,
    VisionTokens,
    build_policy,
    default_experts,
    gather_images,
)


DIM, T = 32, 16
# row 0: no image; row 1: one image at 5..20; row 2: two images at 2..17 and 20..35 (text between them)
SPANS = [[], [range(5, 21)], [range(2, 18), range(20, 36)]]
LENGTH = 40


def ragged_batch(seed=0, dtype=torch.float32):
    """`embeds [3, 40, 32]`, `image_mask [3, 40]`, `question [3, 32]` for the rows of SPANS."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(len(SPANS), LENGTH, DIM, generator=g).to(dtype)
    mask = torch.zeros(len(SPANS), LENGTH, dtype=torch.bool)
    for row, spans in enumerate(SPANS):
        for span in spans:
            mask[row, list(span)] = True
    question = torch.randn(len(SPANS), DIM, generator=g).to(dtype)
    return embeds, mask, question


def eval_policy(name, **kwargs):
    return build_policy(name, DIM, T, **kwargs).eval()


POLICY_CASES = {
    "passthrough": {},
    "text-only": {},
    "prune": {"ratio": 4},
    "pool": {"ratio": 4},
    "conv": {"ratio": 4},
    "resampler": {"num_queries": 3, "num_heads": 4},
    "resampler-global": {"num_queries": 3, "num_heads": 4, "global_vector": True},
    "elastic": {},
}


def make_case(case):
    name = "resampler" if case == "resampler-global" else case
    return eval_policy(name, **POLICY_CASES[case])


def test_gather_images_ragged_positions_valid_tokens():
    embeds, mask, _ = ragged_batch()
    image = gather_images(embeds, mask, tokens_per_image=T)
    assert image.tokens.shape == (3, 32, DIM)
    expected_pos = torch.zeros(3, 32, dtype=torch.long)
    expected_valid = torch.zeros(3, 32, dtype=torch.bool)
    for row, spans in enumerate(SPANS):
        flat = [p for span in spans for p in span]
        expected_pos[row, : len(flat)] = torch.tensor(flat, dtype=torch.long)
        expected_valid[row, : len(flat)] = True
        torch.testing.assert_close(image.tokens[row, : len(flat)], embeds[row, flat], rtol=0, atol=0)
    assert torch.equal(image.positions, expected_pos)
    assert torch.equal(image.valid, expected_valid)
    assert not image.tokens[~image.valid].any()  # padding is zeros


def test_gather_images_bad_multiple_names_image_mask():
    embeds, mask, _ = ragged_batch()
    mask[1, 30] = True  # row 1: 17 image tokens
    with pytest.raises(ValueError, match="image_mask"):
        gather_images(embeds, mask, tokens_per_image=T)
    gather_images(embeds, mask)  # without tokens_per_image there is no rule to break


@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_policy_positions_counts(case):
    embeds, mask, question = ragged_batch()
    policy = make_case(case)
    out = policy(gather_images(embeds, mask, T), question)
    assert out.tokens.shape[:2] == out.positions.shape == out.valid.shape
    for row, spans in enumerate(SPANS):
        n = int(out.valid[row].sum())
        assert torch.equal(out.valid[row, :n], torch.ones(n, dtype=torch.bool)) and not out.valid[row, n:].any()
        pos = out.positions[row, :n]
        assert bool((pos[1:] > pos[:-1]).all()), f"row {row}: positions not strictly increasing: {pos.tolist()}"
        if case == "elastic":
            expert = policy.names[int(out.choice[row])] if spans else None
            assert (int(out.choice[row]) == -1) == (not spans)
            keep = policy.experts[expert].keep if spans else 0
        else:
            keep = policy.keep
            assert policy.tokens_out(len(spans)) == n
        assert n == keep * len(spans)
        for i, span in enumerate(spans):  # the i-th image's tokens take the i-th image's positions
            chunk = pos[i * keep : (i + 1) * keep].tolist()
            assert set(chunk) <= set(span), f"row {row} image {i}: {chunk} outside {list(span)}"


@pytest.mark.parametrize("name", ["pool", "prune", "conv"])
def test_ratio_4_keeps_4x_fewer(name):
    embeds, mask, question = ragged_batch()
    policy = eval_policy(name, ratio=4)
    out = policy(gather_images(embeds, mask, T), question)
    assert policy.tokens_out(3) == 3 * T // 4
    assert out.valid.sum(dim=1).tolist() == [0, T // 4, 2 * T // 4]


def test_pool_is_the_2x2_mean_at_the_blocks_last_position():
    embeds, mask, _ = ragged_batch()
    out = Pool(4, tokens_per_image=T, dim=DIM)(gather_images(embeds, mask, T))
    for row, spans in enumerate(SPANS):
        for i, span in enumerate(spans):
            grid = embeds[row, list(span)].reshape(4, 4, DIM)  # row-major 4 x 4 patch grid
            pos = torch.tensor(list(span)).reshape(4, 4)
            for b, (r, c) in enumerate([(0, 0), (0, 2), (2, 0), (2, 2)]):
                mean = (grid[r, c] + grid[r, c + 1] + grid[r + 1, c] + grid[r + 1, c + 1]) / 4
                torch.testing.assert_close(out.tokens[row, 4 * i + b], mean)
                assert int(out.positions[row, 4 * i + b]) == int(pos[r + 1, c + 1])
    assert out.positions[2].tolist() == [7, 9, 15, 17, 25, 27, 33, 35]


def test_conv_at_init_equals_pool():
    embeds, mask, _ = ragged_batch()
    image = gather_images(embeds, mask, T)
    pooled = Pool(4, tokens_per_image=T, dim=DIM)(image)
    conv = Conv(4, tokens_per_image=T, dim=DIM)
    out = conv(image)
    torch.testing.assert_close(out.tokens, pooled.tokens, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.positions, pooled.positions) and torch.equal(out.valid, pooled.valid)
    assert sum(p.numel() for p in conv.parameters()) == DIM * 4 + DIM + DIM * DIM + DIM
    out.tokens.sum().backward()
    assert conv.depthwise.weight.grad.abs().sum() > 0 and conv.pointwise.weight.grad.abs().sum() > 0


def test_prune_keeps_the_tokens_most_like_the_question():
    g = torch.Generator().manual_seed(1)
    embeds, mask, _ = ragged_batch()
    question = torch.randn(3, DIM, generator=g)
    planted = [1, 6, 11, 12]  # indices in each image
    for row, spans in enumerate(SPANS):
        for span in spans:
            for j, idx in enumerate(planted):
                embeds[row, span[idx]] = question[row] * (0.5 + j)  # cosine 1 with the question
    out = Prune(4, tokens_per_image=T, dim=DIM)(gather_images(embeds, mask, T), question)
    for row, spans in enumerate(SPANS):
        expected = [span[idx] for span in spans for idx in planted]
        assert out.positions[row, : len(expected)].tolist() == expected
        assert torch.equal(out.tokens[row, : len(expected)], embeds[row, expected])
    # without a question: the largest L2 norms
    embeds, mask, _ = ragged_batch()
    for span in SPANS[2]:
        embeds[2, [span[i] for i in (0, 3, 9, 15)]] *= 100
    out = Prune(4, tokens_per_image=T, dim=DIM)(gather_images(embeds, mask, T))
    assert out.positions[2].tolist() == [2, 5, 11, 17, 20, 23, 29, 35]


def test_resampler_global_vector_layout():
    embeds, mask, question = ragged_batch()
    image = gather_images(embeds, mask, T)
    policy = Resampler(
        3, 4, global_vector=True, tokens_per_image=T, dim=DIM, generator=torch.Generator().manual_seed(0)
    )
    out = policy(image, question)
    assert policy.tokens_out(1) == 2 and out.global_vec.shape == (3, DIM)
    assert out.positions[1, :2].tolist() == [19, 20] and out.positions[2].tolist() == [16, 17, 34, 35]
    assert out.valid.sum(dim=1).tolist() == [0, 2, 4]
    assert not out.global_vec[0].any()  # a row without image: zeros
    # the global vector and tokens are the last query's / the first Q-1 queries' outputs on that image alone
    for row, span in [(1, SPANS[1][0]), (2, SPANS[2][1])]:
        alone = torch.zeros(1, LENGTH, dtype=torch.bool)
        alone[0, list(span)] = True
        single = policy(gather_images(embeds[row : row + 1], alone, T))
        torch.testing.assert_close(out.global_vec[row], single.global_vec[0])
        torch.testing.assert_close(out.tokens[row, -2:] if row == 2 else out.tokens[row, :2], single.tokens[0])
    # without the global vector the 3 tokens take the last 3 positions
    flat = Resampler(3, 4, tokens_per_image=T, dim=DIM)(image)
    assert flat.global_vec is None and flat.positions[2].tolist() == [15, 16, 17, 33, 34, 35]


def test_resampler_invariant_to_padding():
    embeds, mask, question = ragged_batch()
    image = gather_images(embeds, mask, T)
    policy = Resampler(
        2, 4, global_vector=True, tokens_per_image=T, dim=DIM, generator=torch.Generator().manual_seed(3)
    )
    out = policy(image)
    # garbage in the padding slots and an extra padding row change nothing
    noisy = image.tokens.clone()
    noisy[~image.valid] = 1e3 * torch.randn(int((~image.valid).sum()), DIM, generator=torch.Generator().manual_seed(4))
    padded = VisionTokens(
        torch.cat([noisy, torch.randn(1, 32, DIM)]),
        torch.cat([image.positions, torch.zeros(1, 32, dtype=torch.long)]),
        torch.cat([image.valid, torch.zeros(1, 32, dtype=torch.bool)]),
    )
    again = policy(padded)
    torch.testing.assert_close(again.tokens[:3], out.tokens)
    torch.testing.assert_close(again.global_vec[:3], out.global_vec)
    assert not again.valid[3].any() and not again.global_vec[3].any()
    # row 1 alone (no padding columns) gives the same tokens
    alone = VisionTokens(image.tokens[1:2, :T], image.positions[1:2, :T], image.valid[1:2, :T])
    torch.testing.assert_close(policy(alone).tokens[0], out.tokens[1, :1])


def test_resampler_attends_over_its_whole_image_only():
    embeds, mask, _ = ragged_batch()
    policy = Resampler(3, 4, tokens_per_image=T, dim=DIM, generator=torch.Generator().manual_seed(2))
    out = policy(gather_images(embeds, mask, T))
    for index in (0, T - 1):  # non-causal: every query reads the first and the last token of its image
        changed = embeds.clone()
        changed[2, SPANS[2][0][index]] += 3.0
        again = policy(gather_images(changed, mask, T))
        assert (again.tokens[2, :3] - out.tokens[2, :3]).abs().amax(dim=1).min() > 1e-4
        torch.testing.assert_close(again.tokens[2, 3:], out.tokens[2, 3:], rtol=0, atol=0)  # the other image
        torch.testing.assert_close(again.tokens[:2], out.tokens[:2], rtol=0, atol=0)


def steered_elastic(experts, rows_choose):
    """An Elastic whose gate picks expert `rows_choose[r]` for row r: question r is a one-hot on coordinate r and
    the gate maps coordinate r to a large logit on that expert."""
    policy = Elastic(experts, DIM, generator=torch.Generator().manual_seed(0))
    question = torch.zeros(len(rows_choose), DIM)
    with torch.no_grad():
        policy.gate.weight.zero_()
        for row, expert in enumerate(rows_choose):
            question[row, row] = 1.0
            policy.gate.weight[expert, row] = 20.0
    return policy, question


def test_elastic_eval_is_the_chosen_expert():
    embeds, mask, _ = ragged_batch()
    image = gather_images(embeds, mask, T)
    experts = default_experts(DIM, T, ratio=4, num_queries=2)
    names = list(experts)
    for chosen in range(len(names)):
        policy, question = steered_elastic(experts, [chosen] * 3)
        policy.eval()
        out, again = policy(image, question), policy(image, question)
        assert torch.equal(out.tokens, again.tokens) and torch.equal(out.choice, again.choice)
        assert out.choice.tolist() == [-1, chosen, chosen]
        alone = experts[names[chosen]].eval()(image, question)
        n = alone.tokens.shape[1]
        assert out.tokens.shape[1] == n
        assert torch.equal(out.tokens, alone.tokens)
        assert torch.equal(out.positions[out.valid], alone.positions[alone.valid])
        assert torch.equal(out.valid, alone.valid)
    # the random gate: argmax of its logits
    policy = Elastic(default_experts(DIM, T), DIM, generator=torch.Generator().manual_seed(5)).eval()
    _, _, question = ragged_batch(seed=6)
    out = policy(image, question)
    assert out.choice[1:].tolist() == policy.gate(question).argmax(dim=1)[1:].tolist()


def test_elastic_rows_with_different_experts_are_padded():
    embeds, mask, _ = ragged_batch()
    image = gather_images(embeds, mask, T)
    experts = {
        "pool": Pool(4, tokens_per_image=T, dim=DIM),
        "resampler": Resampler(2, 4, tokens_per_image=T, dim=DIM),
        "text-only": TextOnly(tokens_per_image=T, dim=DIM),
        "passthrough": Passthrough(tokens_per_image=T, dim=DIM),
    }
    policy, question = steered_elastic(experts, [3, 3, 1])  # row 1: passthrough (16); row 2: resampler (2 x 2)
    out = policy.eval()(image, question)
    assert out.choice.tolist() == [-1, 3, 1]
    assert out.tokens.shape == (3, 16, DIM)
    assert out.valid.sum(dim=1).tolist() == [0, 16, 4]
    assert out.positions[1].tolist() == list(range(5, 21))
    assert out.positions[2, :4].tolist() == [16, 17, 34, 35]
    assert not out.tokens[2, 4:].any() and not out.positions[2, 4:].any() and not out.tokens[0].any()
    torch.testing.assert_close(out.tokens[1], embeds[1, 5:21])
    torch.testing.assert_close(out.tokens[2, :4], experts["resampler"](image, question).tokens[2])
    # a third row choosing pool: its 8 tokens sit under the longest row's 16
    policy, question = steered_elastic(experts, [3, 0, 0])
    out = policy.eval()(image, question)
    assert out.valid.sum(dim=1).tolist() == [0, 4, 8] and out.tokens.shape[1] == 8


def test_elastic_training_deterministic_and_gate_gets_gradient():
    embeds, mask, question = ragged_batch()
    image = gather_images(embeds, mask, T)
    experts = default_experts(DIM, T)
    policy = Elastic(experts, DIM, tau=0.5, generator=torch.Generator().manual_seed(0)).train()
    with torch.no_grad():
        policy.gate.bias[policy.names.index("text-only")] = -100.0  # tokens to differentiate through
    choices = set()
    for seed in range(8):
        a = policy(image, question, generator=torch.Generator().manual_seed(seed))
        b = policy(image, question, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(a.choice, b.choice) and torch.equal(a.tokens, b.tokens)
        choices.add(tuple(a.choice.tolist()))
    assert len(choices) > 1  # the Gumbel noise does move the choice
    policy.zero_grad()
    out = policy(image, question, generator=torch.Generator().manual_seed(0))
    (out.tokens.float() ** 2).sum().backward()
    assert policy.gate.weight.grad is not None and policy.gate.weight.grad.abs().sum() > 0
    # value of the straight-through weight is 1: tokens equal the chosen expert's
    names = policy.names
    for row in (1, 2):
        sub = VisionTokens(image.tokens[row : row + 1], image.positions[row : row + 1], image.valid[row : row + 1])
        alone = experts[names[int(out.choice[row])]](sub, question[row : row + 1])
        n = alone.tokens.shape[1]
        torch.testing.assert_close(out.tokens[row, :n], alone.tokens[0])


def test_elastic_training_uses_no_global_rng():
    embeds, mask, question = ragged_batch()
    image = gather_images(embeds, mask, T)
    policy = Elastic(default_experts(DIM, T), DIM, generator=torch.Generator().manual_seed(0)).train()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    policy(image, question, generator=torch.Generator().manual_seed(0))
    Resampler(2, 4, tokens_per_image=T, dim=DIM, generator=torch.Generator().manual_seed(0))
    built = build_policy("elastic", DIM, T, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.rand(3), expected)
    rebuilt = build_policy("elastic", DIM, T, generator=torch.Generator().manual_seed(7))
    for (name, p), q in zip(built.named_parameters(), rebuilt.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("case", ["passthrough", "prune", "pool", "conv", "resampler-global", "elastic"])
def test_float16(case):
    embeds, mask, question = ragged_batch()
    image = gather_images(embeds, mask, T)
    policy = make_case(case)
    reference = policy(image, question)
    half_image = VisionTokens(image.tokens.half(), image.positions, image.valid)
    out = policy.half()(half_image, question.half())
    assert out.tokens.dtype == torch.float16
    assert torch.equal(out.positions, reference.positions) and torch.equal(out.valid, reference.valid)
    torch.testing.assert_close(out.tokens.float(), reference.tokens, rtol=2e-2, atol=2e-2)


def test_registry_builds_every_policy_small():
    assert set(POLICIES) == {"passthrough", "text-only", "prune", "pool", "conv", "resampler", "elastic"}
    for name, cls in POLICIES.items():
        assert type(build_policy(name, DIM, T)) is cls
    assert set(default_experts(DIM, T)) == {"prune", "pool", "conv", "resampler", "text-only"}
    elastic = build_policy("elastic", 576, 64)  # the zoo's width: everything well under 1.5 M parameters
    assert sum(p.numel() for p in elastic.parameters()) < 1_500_000
    assert elastic.tokens_out(2) == 2 * 64 // 4


def _tokens(**change):
    embeds, mask, _ = ragged_batch()
    image = gather_images(embeds, mask, T)
    fields = {"tokens": image.tokens, "positions": image.positions, "valid": image.valid} | change
    return VisionTokens(**fields)


BAD = [
    (lambda: Pool(3, tokens_per_image=T), ValueError, "ratio"),
    (lambda: Pool(9, tokens_per_image=T), ValueError, "ratio"),  # 3 does not divide the side 4
    (lambda: Pool(4.0, tokens_per_image=T), TypeError, "ratio"),
    (lambda: Pool(4, tokens_per_image=15), ValueError, "tokens_per_image"),
    (lambda: Conv(2, tokens_per_image=T, dim=DIM), ValueError, "ratio"),
    (lambda: Prune(0.5, tokens_per_image=T), ValueError, "ratio"),
    (lambda: Prune(float("nan"), tokens_per_image=T), ValueError, "ratio"),
    (lambda: Passthrough(tokens_per_image=0), ValueError, "tokens_per_image"),
    (lambda: Resampler(0, 1, tokens_per_image=T, dim=DIM), ValueError, "num_queries"),
    (lambda: Resampler(1, 1, global_vector=True, tokens_per_image=T, dim=DIM), ValueError, "num_queries"),
    (lambda: Resampler(T + 1, 1, tokens_per_image=T, dim=DIM), ValueError, "num_queries"),
    (lambda: Resampler(2, 5, tokens_per_image=T, dim=DIM), ValueError, "num_heads"),
    (lambda: Elastic({}, DIM), ValueError, "experts"),
    (lambda: Elastic({"a": Pool(4, 16), "b": Pool(4, 64)}, DIM), ValueError, "tokens_per_image"),
    (lambda: Elastic({"a": Pool(4, T, dim=8)}, DIM), ValueError, "dim"),
    (lambda: Elastic({"a": Pool(4, T)}, DIM, tau=0), ValueError, "tau"),
    (lambda: build_policy("nope", DIM, T), ValueError, "nope"),
    (lambda: build_policy("pool", DIM, T, ratio=4, bogus=1), ValueError, "bogus"),
    (lambda: build_policy("prune", DIM, T, num_queries=2), ValueError, "num_queries"),
    (lambda: Pool(4, T, dim=DIM)("not tokens"), TypeError, "image"),
    (lambda: Pool(4, T, dim=DIM + 1)(_tokens()), ValueError, "dim"),
    (lambda: Pool(4, T)(_tokens(positions=_tokens().positions.int())), ValueError, "image.positions"),
    (lambda: Pool(4, T)(_tokens(positions=_tokens().positions.flip(1))), ValueError, "image.positions"),
    (lambda: Pool(4, T)(_tokens(valid=_tokens().valid.flip(1))), ValueError, "image.valid"),
    (lambda: Pool(4, 8)(_tokens()), ValueError, "tokens_per_image"),  # square check first
    (lambda: Prune(4, 12)(_tokens()), ValueError, "image_mask"),  # 16 and 32 tokens are not multiples of 12
    (lambda: Prune(4, T)(_tokens(), torch.zeros(3, DIM + 1)), ValueError, "question"),
    (lambda: Prune(4, T)(_tokens(), torch.zeros(2, DIM)), ValueError, "question"),
    (lambda: Elastic(default_experts(DIM, T), DIM).eval()(_tokens()), ValueError, "question"),
    (lambda: Elastic(default_experts(DIM, T), DIM).train()(_tokens(), torch.zeros(3, DIM)), ValueError, "generator"),
    (lambda: Conv(4, T, DIM)(_tokens(tokens=_tokens().tokens.double())), TypeError, "image.tokens"),
    (lambda: Passthrough(T).tokens_out(-1), ValueError, "n_images"),
    (lambda: gather_images(torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.bool)), ValueError, "embeds"),
    (lambda: gather_images(torch.zeros(2, 5, 4), torch.zeros(2, 5)), ValueError, "image_mask"),
]


@pytest.mark.parametrize("index", range(len(BAD)))
def test_bad_arguments_name_the_argument(index):
    make, error, name = BAD[index]
    with pytest.raises(error, match=name.replace(".", r"\.")):
        make()
