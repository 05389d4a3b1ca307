"""`mmspec.eval.draft_calibration`: the draft's agreement with the target along the target's greedy answers, by bin
of the draft's confidence -- checked against the draft stepped one token at a time on each answer's prefixes."""

import pytest
import torch
from vlm_fixtures import images, tiny_llava, tiny_processor

from mmspec.eval.draft_calibration import draft_calibration
from mmspec.models.hf.draft import truncated_draft
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


@torch.no_grad()
def test_agreement_and_bins_match_the_draft_stepped_token_by_token():
    target = tiny_llava(4, seed=1)
    pipe = SpeculativeVLMPipeline(target, tiny_processor(), draft_model=truncated_draft(target, 2))
    pipe.set_progress_bar_config(disable=True)
    canvases, prompt, vocab = images(2, seed=3), "w1 w2", list(range(0, 40))
    for draft_vocab in (None, vocab):
        report = draft_calibration(pipe, canvases, prompt, max_new_tokens=8, draft_vocab=draft_vocab, bins=4)
        drafts, hits, rows = [0] * 4, [0] * 4, 0
        for image in canvases:  # the reference: the draft on every prefix of the answer, one forward each
            out = pipe(images=[image], prompt=[prompt], max_new_tokens=8, acceptance="none", output_type="ids")
            answer = [t for t in out.sequences[0].tolist() if t >= 0]
            ids, lengths, extra = pipe.encode([image], [prompt], None, "cpu")
            prefix = ids[0, : int(lengths[0])].tolist()
            for t, token in enumerate(answer):
                seq = torch.tensor([prefix + answer[:t]])
                logits = pipe.draft_model(input_ids=seq, attention_mask=torch.ones_like(seq), **extra).logits[0, -1]
                if draft_vocab is not None:
                    p, i = logits[vocab].softmax(-1).max(-1)
                    guess = vocab[int(i)]
                else:
                    p, guess = logits.softmax(-1).max(-1)
                b = min(int(float(p) * 4), 3)
                drafts[b] += 1
                hits[b] += int(int(guess) == token)
                rows += 1
        assert report["tokens"] == rows > 0
        assert [b["drafts"] for b in report["bins"]] == drafts
        assert [b["accepted"] for b in report["bins"]] == hits
        assert report["agreement"] == pytest.approx(sum(hits) / rows)
    with pytest.raises(ValueError, match="bins"):
        draft_calibration(pipe, canvases, prompt, bins=0)
