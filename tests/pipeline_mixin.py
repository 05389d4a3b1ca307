"""`SpeculativePipelineTesterMixin`: the tests every speculative pipeline must pass (diffusers' PipelineTesterMixin
idea, for speculative decoding). A pipeline's test class sets the hooks below and inherits the tests:

    class TestMyPipeline(SpeculativePipelineTesterMixin):
        pipeline_class = MyPipeline
        lossless_methods = [dict(acceptance="exact", drafter="model"), ...]
        plain_method = dict(acceptance="none")
        bad_inputs = [(dict(acceptance="fast"), ValueError, "acceptance"), ...]
        def get_pipeline(self): ...        # tiny seeded components
        def get_inputs(self, batch_size): ...  # call kwargs for `batch_size` samples (no generator)
        def output_tokens(self, out): ...  # [B, N] token ids of an output
        def scored_model(self, pipe): ...  # the target nn.Module whose forward counts rows

Pipelines that differ in kind override the optional hooks (defaults: discrete tokens, ``-1`` = not generated,
greedy via ``do_sample=False``, LlamaGen-style rounds): `deterministic_kwargs` / `get_lossless_pipeline` (a setting
where every lossless method must equal the plain one sample for sample), `assert_same_tokens`, `written_mask`,
`scored_call` and `check_rounds` (see `tests/pipelines/test_pipeline_continuous.py` for continuous tokens).

Every test compares the pipeline against itself (plain vs speculative, one batch vs another), so it can fail: a lossy
verifier, a drafter that leaks state between rows, a trace that disagrees with the stats, compaction that never
happens.
"""

import torch

from mmspec.decoding import ACCEPTED, BONUS, PREFILL, RESAMPLED


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


class SpeculativePipelineTesterMixin:
    pipeline_class = None
    lossless_methods: list = []
    plain_method: dict = {"acceptance": "none"}
    bad_inputs: list = []
    deterministic_kwargs: dict = {"do_sample": False}  # call kwargs under which sampling has no randomness

    # ------------------------------------------------------------------ hooks
    def get_pipeline(self):
        raise NotImplementedError

    def get_inputs(self, batch_size):
        raise NotImplementedError

    def output_tokens(self, out):
        raise NotImplementedError

    def scored_model(self, pipe):
        raise NotImplementedError

    def get_lossless_pipeline(self):
        """A pipeline on which every lossless method, under `deterministic_kwargs`, equals the plain method sample
        for sample (default: `get_pipeline`, with greedy decoding)."""
        return self.get_pipeline()

    def assert_same_tokens(self, a, b, msg=None):
        """The outputs of one sample computed in two batches agree (default: exactly)."""
        assert torch.equal(a, b), msg

    def written_mask(self, tokens):
        """``[B, N]`` bool: which positions of an output / callback grid hold a generated token."""
        return tokens >= 0

    def scored_call(self, pipe):
        """``(module, method name)`` of the target call whose first argument's rows are the rows scored."""
        return self.scored_model(pipe), "forward"

    def check_rounds(self, out, method):
        """The round structure of one output (LlamaGen-style: prefill round 0 emits one token; round r >= 1 emits
        its accepted drafts, then one resampled / bonus token)."""
        s, trace, tokens = out.stats, out.trace, self.output_tokens(out)
        counts = {name: c.tolist() for name, c in trace.counts().items()}
        assert counts["prefill"] == [1] * tokens.shape[0], method
        assert trace.round.amax(1).tolist() == s.rounds, method
        # every round emits exactly one correction or bonus, except a round cut at the sequence end
        closing = [r + b for r, b in zip(counts["resampled"], counts["bonus"])]
        assert all(r - 1 <= c <= r for c, r in zip(closing, s.rounds)), method
        # the acceptance histogram, counted independently from the trace: rounds by accepted drafts
        per_round = [int(((trace.round[b] == r) & (trace.origin[b] == ACCEPTED)).sum())
                     for b in range(tokens.shape[0]) for r in range(1, s.rounds[b] + 1)]  # fmt: skip
        k_max = len(s.accept_histogram) - 1
        assert s.accept_histogram == [sum(min(a, k_max) == k for a in per_round) for k in range(k_max + 1)], method
        assert s.target_forwards == 1 + max(s.rounds), method
        if method is self.plain_method:
            assert set(trace.origin.unique().tolist()) == {PREFILL, BONUS}
        # within a round: accepted drafts first, then the one resampled / bonus token
        for b in range(tokens.shape[0]):
            for r in range(1, s.rounds[b] + 1):
                origins = trace.origin[b][trace.round[b] == r].tolist()
                assert all(o == ACCEPTED for o in origins[:-1]), (method, b, r, origins)
                assert origins[-1] in (ACCEPTED, RESAMPLED, BONUS), (method, b, r, origins)

    def call(self, pipe, batch_size=3, seed=0, generator=None, **kwargs):
        inputs = self.get_inputs(batch_size) | kwargs
        if generator is None:
            generator = torch.Generator().manual_seed(seed)
        return pipe(generator=generator, **inputs)

    # ------------------------------------------------------------------ tests
    def test_greedy_equals_plain_greedy(self):
        pipe = self.get_lossless_pipeline()
        plain = self.output_tokens(self.call(pipe, **self.deterministic_kwargs, **self.plain_method))
        assert len(set(map(tuple, plain.reshape(plain.shape[0], -1).tolist()))) > 1  # the rows really differ
        speculated = []
        for method in self.lossless_methods:
            out = self.call(pipe, **self.deterministic_kwargs, **method)
            assert torch.equal(self.output_tokens(out), plain), method
            speculated.append(out.stats.target_forwards < max(out.stats.generated_tokens))
        assert any(speculated)  # some drafter got drafts accepted (equality above is not vacuous)

    def test_deterministic_given_generator(self):
        pipe = self.get_pipeline()
        for method in [self.plain_method, *self.lossless_methods[:2]]:
            a = self.output_tokens(self.call(pipe, seed=5, **method))
            b = self.output_tokens(self.call(pipe, seed=5, **method))
            c = self.output_tokens(self.call(pipe, seed=6, **method))
            assert torch.equal(a, b) and not torch.equal(a, c), method

    def test_per_sample_generators_do_not_depend_on_the_batch(self):
        """Sample i with its own generator is the same alone, in a batch, and in a batch of other composition."""
        pipe = self.get_pipeline()
        inputs = self.get_inputs(3)
        for method in [self.plain_method, *self.lossless_methods]:
            batch = self.output_tokens(pipe(generator=_gens([10, 11, 12]), **inputs, **method))
            for i in range(3):
                one = {k: (v[i : i + 1] if isinstance(v, (list, torch.Tensor)) else v) for k, v in inputs.items()}
                alone = self.output_tokens(pipe(generator=_gens([10 + i]), **one, **method))
                self.assert_same_tokens(alone[0], batch[i], (method, i))
            # reversed order: row i of the batch is sample 2 - i
            rev = {k: (v.flip(0) if isinstance(v, torch.Tensor) else v[::-1] if isinstance(v, list) else v)
                   for k, v in inputs.items()}  # fmt: skip
            flipped = self.output_tokens(pipe(generator=_gens([12, 11, 10]), **rev, **method))
            self.assert_same_tokens(flipped.flip(0), batch, method)

    def test_stats_and_trace_agree(self):
        pipe = self.get_pipeline()
        for method in [self.plain_method, *self.lossless_methods]:
            out = self.call(pipe, **method)
            s, trace, tokens = out.stats, out.trace, self.output_tokens(out)
            counts = {name: c.tolist() for name, c in trace.counts().items()}
            generated = (trace.origin >= 0).sum(1).tolist()
            assert generated == s.generated_tokens == self.written_mask(tokens).sum(1).tolist(), method
            assert counts["prefill"] == s.prefill_tokens, method
            assert counts["accepted"] == s.accepted_tokens, method
            self.check_rounds(out, method)

    def test_save_load_round_trip(self, tmp_path):
        pipe = self.get_pipeline()
        pipe.save_pretrained(tmp_path / "pipe")
        loaded = self.pipeline_class.from_pretrained(tmp_path / "pipe")
        method = self.lossless_methods[0]
        assert torch.equal(self.output_tokens(self.call(pipe, seed=3, **method)),
                           self.output_tokens(self.call(loaded, seed=3, **method)))  # fmt: skip

    def test_bad_inputs_name_the_argument(self):
        import pytest

        pipe = self.get_pipeline()
        for kwargs, error, match in self.bad_inputs:
            with pytest.raises(error, match=match):
                self.call(pipe, batch_size=1, **kwargs)

    def test_finished_rows_leave_the_batch(self):
        """Rows that finish are compacted out of later forwards, while the callback still sees the whole grid and
        tokens, once written, never change."""
        pipe = self.get_pipeline()
        model, name = self.scored_call(pipe)
        rows_scored, grids = [], []
        original = getattr(model, name)

        def counting_forward(input_ids, *args, **kwargs):  # the first argument (by keyword for transformers LMs)
            rows_scored.append(input_ids.shape[0])
            return original(input_ids, *args, **kwargs)

        def cb(p, rnd, n, kwargs):
            grids.append(kwargs["tokens"].clone())
            return kwargs

        setattr(model, name, counting_forward)
        try:
            out = self.call(pipe, batch_size=4, callback_on_step_end=cb, **self.lossless_methods[0])
        finally:
            delattr(model, name)
        assert len(set(out.stats.rounds)) > 1  # ragged: rows finish apart
        assert max(rows_scored) > min(rows_scored)
        assert torch.equal(grids[-1], self.output_tokens(out))
        for a, b in zip(grids, grids[1:]):
            written = self.written_mask(a)
            assert torch.equal(b[written], a[written])

    def test_progress_bar_counts_tokens_and_can_be_disabled(self, capsys):
        pipe = self.get_pipeline()
        pipe.set_progress_bar_config(disable=False)
        self.call(pipe, batch_size=2, **self.lossless_methods[0])
        err = capsys.readouterr().err
        total = 2 * self.output_tokens(self.call(pipe, batch_size=1, **self.plain_method)).shape[1]
        assert f"{total}/{total}" in err
        pipe.set_progress_bar_config(disable=True)
        capsys.readouterr()
        self.call(pipe, batch_size=2, **self.lossless_methods[0])
        assert f"/{total}" not in capsys.readouterr().err
