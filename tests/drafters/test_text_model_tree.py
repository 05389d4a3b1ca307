"""The draft LM's EAGLE-2 tree (`TextModelDrafter(top_k > 1)`): every node's score is the draft's cumulative
log-probability of its path, as a no-cache forward of prompt + pending + path computes it -- this checks the scratch
slots, positions and ancestor masks of the level-by-level tree forwards (greedy equality alone would not: a wrong
draft is still verified losslessly), and the tree's shape invariants."""

from types import SimpleNamespace

import pytest
import torch
from vlm_fixtures import tiny_lm

from mmspec.decoding.guidance import Guidance
from mmspec.drafters.text_model import TextModelDrafter
from mmspec.models.hf.target import HFTarget
from mmspec.sampling import SamplingParams


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_scores_are_path_log_probs_of_no_cache_forwards(attn):
    model = tiny_lm(2, seed=3)
    model.config._attn_implementation = attn
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 4, 9])
    ids = torch.randint(3, 64, (3, 9), generator=gen) * (torch.arange(9) < lengths[:, None])
    draft = HFTarget(model, Guidance(SamplingParams(do_sample=False)), source="draft")
    drafter = TextModelDrafter(draft, 10, ids, lengths, top_k=3, depth=4)
    state = SimpleNamespace(max_length=16, pending=torch.tensor([5, 9, 11]), count=torch.ones(3, dtype=torch.long))
    drafter.prefill(state, None)
    for first_round in (True, False):  # the second round re-feeds [last committed, pending]
        if not first_round:
            state.last_committed, state.pending = torch.tensor([21, 22, 23]), torch.tensor([30, 31, 32])
            drafter.draft.cache.rollback(lengths + 1)  # as after one committed token (count = 3)
            history = torch.stack([torch.tensor([5, 9, 11]), state.last_committed, state.pending], 1)
        else:
            history = state.pending[:, None]
        proposal = drafter.propose(state)
        tokens, parents = proposal.tokens, proposal.parents
        assert tokens.shape == parents.shape == (3, 10)
        assert bool((parents < torch.arange(10)).all()) and bool((parents >= -1).all())
        for r in range(3):
            prefix = torch.cat([ids[r, : lengths[r]], history[r]])
            for i in range(10):
                path, j = [], i
                while j >= 0:
                    path.append(int(tokens[r, j]))
                    j = int(parents[r, j])
                path = path[::-1]
                seq = torch.cat([prefix, torch.tensor(path)])[None]
                with torch.no_grad():
                    lp = torch.log_softmax(model(seq).logits[0].float(), -1)
                start = len(prefix) - 1
                expected = sum(float(lp[start + n, t]) for n, t in enumerate(path))
                assert abs(float(drafter.last_tree.scores[r, i]) - expected) < 1e-4
                # every node is among the top-k children of its parent under the no-cache forward
                assert path[-1] in lp[start + len(path) - 1].topk(3).indices.tolist()
