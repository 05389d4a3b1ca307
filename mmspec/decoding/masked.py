"""The masked-AR loop for continuous tokens (MAR), plain and with CSpD continuous speculative decoding.

    plain:  for each step: z = target(canvas); tokens = head(z[step's positions], noise)
    CSpD:   target-only pre-fill steps, then blocks of K steps:
              draft runs the K steps (its own canvas, its own head, the same noise)
              target verifies the block's tokens (`verify_mode`) at the last *stochastic* denoising step
              every emitted value gets the target's deterministic final step (one batched head call)

All randomness of an image is drawn once, up front, from its generator and indexed by token position
(`ImageNoise`), so draft and target follow aligned trajectories and an image does not depend on its batch. The rule,
why it is exact given the shared noise, and what ``verify_mode="block"`` / ``"exact"`` each guarantee are derived in
docs/methods.md ("CSpD: the masked loop").
"""

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from mmspec.decoding.final_step import FinalStep, gaussian_logpdf
from mmspec.decoding.masked_params import MaskedParams, cfg_schedule, mar_schedule
from mmspec.decoding.trace import ACCEPTED, BONUS, PREFILL, RESAMPLED, DecodeTrace
from mmspec.random import num_rows, rand, randn
from mmspec.sampling import finite_flag
from mmspec.verify.continuous import verify_continuous


__all__ = [
    "ImageNoise",
    "FiniteWatch",
    "MaskedParams",
    "MaskedTarget",
    "cfg_schedule",
    "decode_masked",
    "finished_accept_prob",
    "mar_schedule",
    "residual_finished",
    "residual_tries",
]


@dataclass
class ImageNoise:
    """Everything random about a batch of images, drawn once: generation ``order [B, L]``, the head's initial noise
    ``x_T [B, L, D]`` and per-step noise ``eps [B, L, S-1, D]`` (indexed by token position); ``draft``: the draft's
    own ``x_T`` / ``eps`` (same order) without trajectory alignment, None when the draft shares the target's."""

    order: Tensor
    x_T: Tensor
    eps: Tensor
    draft: "ImageNoise | None" = None

    @staticmethod
    def draw(batch, seq_len, dim, steps, generator, device, dtype=torch.float32, *, draft=False) -> "ImageNoise":
        """Draw in this order from ``generator``: order, ``x_T``, ``eps``; with ``draft`` then a second set for the
        draft (its order drawn too, and replaced by the target's)."""
        order = rand((batch, seq_len), generator, device=device).argsort(1)
        x_T = randn((batch, seq_len, dim), generator, device=device, dtype=dtype)
        eps = randn((batch, seq_len, steps - 1, dim), generator, device=device, dtype=dtype)
        noise = ImageNoise(order, x_T, eps)
        if draft:
            own = ImageNoise.draw(batch, seq_len, dim, steps, generator, device, dtype)
            noise.draft = ImageNoise(order, own.x_T, own.eps)
        return noise

    def for_draft(self) -> "ImageNoise":
        """The noise the draft's head uses: the target's (trajectory alignment) or its own."""
        return self if self.draft is None else self.draft


class FiniteWatch:
    """Which model first produced a non-finite value (NaN / inf), tracked on the device: no host sync per step.

    Every model output of the loop is passed to `see` under its model's name (``"transformer"``,
    ``"draft_transformer"``) and part (``"features"`` / ``"diffusion head"``); each call gets the next sequence
    number and, per (name, part), the device keeps the smallest number whose tensors were not all finite
    (`mmspec.sampling.finite_flag`). `check` reads them in one host sync at the end and blames the first: a NaN
    spreads downstream (a target fed a broken draft's canvas), so the first model in data-flow order is the culprit.
    """

    _NEVER = 2**62

    def __init__(self):
        self.seq = 0
        self.first: dict[tuple[str, str], Tensor] = {}

    def see(self, name: str, part: str, *tensors: Tensor | None) -> None:
        ok = None
        for t in tensors:
            if t is not None and t.numel():
                flag = finite_flag(t)
                ok = flag if ok is None else ok & flag
        self.seq += 1
        if ok is None:
            return
        bad_at = torch.where(ok, self._NEVER, self.seq)
        key = (name, part)
        self.first[key] = bad_at if key not in self.first else torch.minimum(self.first[key], bad_at)

    def check(self, guidance_scale: float, temperature: float) -> None:
        """Raise ``ValueError`` naming the model whose output was first non-finite (one host sync)."""
        if not self.first:
            return
        keys = list(self.first)
        at = torch.stack([self.first[k] for k in keys]).tolist()
        first = min(at)
        if first >= self._NEVER:
            return
        name, part = keys[at.index(first)]
        knobs = ""
        if part == "diffusion head":
            knobs = f" (or guidance_scale={guidance_scale:g} / temperature={temperature:g} overflow its float dtype)"
        raise ValueError(
            f"{name} produced non-finite values (NaN / inf) in its {part}: its weights or activations hold NaN / inf "
            f"or overflow{knobs}; the images would be NaN / garbage"
        )


class MaskedTarget(Protocol):
    """What the masked loop needs of a model (`mmspec.models.mar.runner.MARRunner` is the MAR one): features of
    canvases under its condition and CFG, and its diffusion head on selected tokens.

    Attributes:
        name: the pipeline component (``"transformer"``), named in errors.
        guided: CFG on (``features`` also returns the unconditional ``z``).
        forwards: feature passes so far (the loop's statistics).
        watch: the `FiniteWatch` the loop sets; ``saw`` records into it.
        head: the diffusion head (`mmspec.models.mar.diffloss.DiffLossHead`: ``sample_last`` / ``final_step``).
    """

    name: str
    guided: bool
    forwards: int
    watch: FiniteWatch | None
    head: Any

    def features(
        self, tokens: Tensor, visible: Tensor, rows: Tensor, visible_range=None
    ) -> tuple[Tensor, Tensor | None]:
        """Canvases ``[R, L, D]`` with ``visible [R, L]`` of images ``rows [R]`` -> conditional and unconditional
        ``z`` (the latter None without guidance). ``visible_range``: ``(fewest, most)`` visible tokens of a canvas,
        known on the host from the schedule (saves the model a host read)."""

    def saw(self, part: str, *tensors: Tensor | None) -> None:
        """Record the finiteness of outputs of ``part`` (``"features"`` / ``"diffusion head"``)."""


def _gather(t: Tensor, rows: Tensor, pos: Tensor) -> Tensor:
    """``t[rows, pos]`` for flat index lists (``[N, ...]``)."""
    return t[rows, pos]


@dataclass
class MaskedState:
    """The canvas of every image and what produced each token."""

    tokens: Tensor  # [B, L, D]
    visible: Tensor  # [B, L] bool
    trace: DecodeTrace  # [B, L] by token position
    num_fallbacks: Tensor | int = 0  # residual fallbacks (a device scalar in the loop: read once, with the stats)
    drafted: Tensor | None = None  # [B] draft tokens verified (exact mode: also those of discarded steps)

    def emit(self, rows: Tensor, pos: Tensor, values: Tensor, origin, round_index: int, keep=None) -> None:
        """Commit ``values`` at ``(rows, pos)`` (distinct positions), recording the round and origin (an int or one
        per token) of each token; with ``keep [N]`` bool only the kept ones (fixed shapes: no host read)."""
        origin = torch.as_tensor(origin, dtype=self.trace.origin.dtype, device=rows.device)
        if keep is None:
            self.tokens[rows, pos] = values.to(self.tokens.dtype)
            self.visible[rows, pos] = True
            self.trace.round[rows, pos] = round_index
            self.trace.origin[rows, pos] = origin
            return
        self.tokens[rows, pos] = torch.where(keep[:, None], values.to(self.tokens.dtype), self.tokens[rows, pos])
        self.visible[rows, pos] = self.visible[rows, pos] | keep
        self.trace.round[rows, pos] = torch.where(keep, round_index, self.trace.round[rows, pos])
        self.trace.origin[rows, pos] = torch.where(keep, origin, self.trace.origin[rows, pos])


def _positions(noise: ImageNoise, params: MaskedParams, step: int):
    """Flat ``(rows, positions)`` of step ``step``'s tokens for every image (all images share the schedule)."""
    b = noise.order.shape[0]
    pos = noise.order[:, params.starts[step] : params.starts[step + 1]]  # [B, n]
    rows = torch.arange(b, device=pos.device)[:, None].expand_as(pos)
    return rows.reshape(-1), pos.reshape(-1)


def _head_last(runner, noise, params, zc, zu, rows, pos, cfg):
    """The head's last stochastic step for tokens ``(rows, pos)`` with their image's ``noise`` (the runner's own:
    the draft's is ``noise.for_draft()``), at ``cfg`` (per token or one scale) and ``params.temperature``."""
    last = runner.head.sample_last_step(
        zc, _gather(noise.x_T, rows, pos), _gather(noise.eps, rows, pos), z_uncond=zu, cfg=cfg,
        temperature=params.temperature,
    )  # fmt: skip
    runner.saw("diffusion head", last.value, last.mean, last.std)
    return last


def decode_masked(
    target: MaskedTarget,
    draft: MaskedTarget | None,
    noise: ImageNoise,
    params: MaskedParams,
    *,
    generator=None,
    stats=None,
    progress=None,
    callback=None,
) -> MaskedState:
    """Run MAR's schedule for every image: plain (``draft=None``) or CSpD (module docstring).

    Args:
        target, draft: `MaskedTarget` s (`mmspec.models.mar.runner.MARRunner`) (same token grid and dim).
        noise: the images' `ImageNoise` (the target's; the draft's too unless it holds the draft's own,
            ``noise.draft``, i.e. without trajectory alignment).
        params: the call's `MaskedParams` (schedule, CFG scales, temperature, K, pre-fill steps, verify mode, ...).
        generator: verification / residual randomness (one generator or one per image).
        stats: a `mmspec.stats.SpecStats` to fill (target/draft forwards, drafted/accepted tokens, fallbacks).
        progress: a tqdm-like bar updated by tokens revealed; callback: ``fn(step, state)`` after every step/block.

    Raises:
        ValueError: naming the model (``target.name`` / ``draft.name``) whose output was first non-finite (checked
            once, at the end: a `FiniteWatch` keeps device-side flags, no host sync per step).
    """
    watch = FiniteWatch()
    for runner in (target, draft):
        if runner is not None:
            runner.watch = watch
    try:
        state = _decode(target, draft, noise, params, generator, stats, progress, callback)
    finally:
        for runner in (target, draft):
            if runner is not None:
                runner.watch = None
    watch.check(max(params.cfg_scales, default=1.0), params.temperature)
    return state


def _decode(target, draft, noise, params, generator, stats, progress, callback) -> MaskedState:
    b, length, dim = noise.x_T.shape
    dev = noise.x_T.device
    state = MaskedState(
        torch.zeros(b, length, dim, device=dev, dtype=noise.x_T.dtype),
        torch.zeros(b, length, dtype=torch.bool, device=dev),
        DecodeTrace.empty(b, length, dev),
        drafted=torch.zeros(b, dtype=torch.long, device=dev),
        num_fallbacks=torch.zeros((), dtype=torch.long, device=dev),
    )
    starts = params.starts
    all_rows = torch.arange(b, device=dev)
    step, round_index = 0, 0
    num_steps = params.num_steps
    num_prefill_steps = num_steps if draft is None else params.num_prefill_steps

    while step < num_steps:
        if step >= num_prefill_steps and params.verify_mode == "exact":
            _exact_rounds(target, draft, noise, state, params, step, round_index, generator, stats, progress,
                          callback)  # fmt: skip
            break
        if step < num_prefill_steps:  # the target alone: one step
            rows, pos = _positions(noise, params, step)
            z_c, z_u = target.features(state.tokens, state.visible, all_rows, (starts[step], starts[step]))
            zc, zu = z_c[rows, pos], None if z_u is None else z_u[rows, pos]
            cfg = params.cfg_scales[step]
            last = _head_last(target, noise, params, zc, zu, rows, pos, cfg)
            values = target.head.finish(zc, last.value, z_uncond=zu, cfg=cfg)
            target.saw("diffusion head", values)
            state.emit(rows, pos, values, PREFILL if draft is not None else BONUS, round_index)
            if stats is not None:
                stats.target_forwards += 1
            done = 1
        else:  # verify_mode "block" (MaskedParams admits only VERIFY_MODES)
            done = min(params.num_draft_steps, num_steps - step)
            _block_round(target, draft, noise, state, params, step, done, round_index, generator, stats)
        if progress is not None:
            progress.update(b * (starts[step + done] - starts[step]))
        step += done
        round_index += 1
        if callback is not None:
            callback(step, state)
    return state


def _block_round(target, draft, noise, state, params, step, k, round_index, generator, stats):
    """One CSpD block in ``"block"`` mode: the draft runs steps ``step .. step+k-1``; the target verifies all of them
    against the canvas at the block's start in one pass (module docstring)."""
    b, length, _ = state.tokens.shape
    all_rows = torch.arange(b, device=state.tokens.device)
    canvas, visible = state.tokens.clone(), state.visible.clone()
    d_noise = noise.for_draft()
    rows_list, pos_list, cfg_list, y_q, mu_q, sd_q = [], [], [], [], [], []
    starts = params.starts
    for j in range(k):
        rows, pos = _positions(noise, params, step + j)
        z_c, z_u = draft.features(canvas, visible, all_rows, (starts[step + j], starts[step + j]))
        zc, zu = z_c[rows, pos], None if z_u is None else z_u[rows, pos]
        cfg = params.cfg_scales[step + j]
        last = _head_last(draft, d_noise, params, zc, zu, rows, pos, cfg)
        finished = draft.head.finish(zc, last.value, z_uncond=zu, cfg=cfg)
        draft.saw("diffusion head", finished)
        canvas[rows, pos] = finished.to(canvas.dtype)
        visible[rows, pos] = True
        rows_list.append(rows)
        pos_list.append(pos)
        cfg_list.append(torch.full((rows.numel(),), cfg, device=rows.device))
        y_q.append(last.value)
        mu_q.append(last.mean)
        sd_q.append(last.std)
    rows, pos, cfg = torch.cat(rows_list), torch.cat(pos_list), torch.cat(cfg_list)
    # One target pass on the committed canvas; the block's tokens with the same (aligned) noise.
    # nothing is emitted before this pass
    z_c, z_u = target.features(state.tokens, state.visible, all_rows, (starts[step], starts[step]))
    zc, zu = z_c[rows, pos], None if z_u is None else z_u[rows, pos]
    last_p = _head_last(target, noise, params, zc, zu, rows, pos, cfg)
    # Per image: its block tokens in order (every image has the same count n).
    n = rows.numel() // b
    order = torch.argsort(rows, stable=True)

    def per_image(t):
        return t[order].reshape(b, n, -1)

    result = verify_continuous(
        per_image(torch.cat(y_q)), per_image(last_p.mean), per_image(last_p.std), per_image(torch.cat(mu_q)),
        per_image(torch.cat(sd_q)), generator=generator, prefix=False, validate=False,
        max_residual_tries=params.max_residual_tries,
    )  # fmt: skip
    y = result.values.reshape(b * n, -1)  # emitted last-step values, image-major
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    y = y[inv]  # back to (step, image) order
    values = target.head.finish(zc, y, z_uncond=zu, cfg=cfg)
    target.saw("diffusion head", values)
    accepted = result.accept_mask.reshape(-1)[inv]
    state.emit(rows, pos, values, torch.where(accepted, ACCEPTED, RESAMPLED), round_index)
    state.num_fallbacks = state.num_fallbacks + result.num_fallbacks.sum()
    state.drafted += n  # every image verifies n tokens
    if stats is not None:
        stats.target_forwards += 1
        stats.draft_forwards += k


def _flat_steps(noise, params, row_steps: dict[int, int], device):
    """Flat ``(rows, pos, cfg)`` of the given step of each row (rows: image ids)."""
    rows, pos, cfg = [], [], []
    for b, s in row_steps.items():
        p = noise.order[b, params.starts[s] : params.starts[s + 1]]
        rows.append(torch.full((p.numel(),), b, device=device))
        pos.append(p)
        cfg.append(torch.full((p.numel(),), params.cfg_scales[s], device=device))
    return torch.cat(rows), torch.cat(pos), torch.cat(cfg)


def _exact_rounds(target, draft, noise, state, params, first_step, first_round, generator, stats, progress,
                  callback):  # fmt: skip
    """``verify_mode="exact"``: rounds until every image is complete; each image keeps its own step (ragged).

    A round: the draft runs up to ``K = params.num_draft_steps`` steps of every unfinished image (canvas = committed
    + its drafts, finished by the draft's own final step); the target scores step ``j`` of image ``b`` on the nested
    canvas (committed + the drafts of steps ``< j``), all ``(b, j)`` in one batched pass; each drafted token ``x_q``
    is accepted with ``min(1, p(x_q) / q(x_q))`` where both are densities of the *emitted* (finished) value
    (`mmspec.decoding.final_step`); the image keeps its fully accepted leading steps, plus the first step with a
    rejection, whose rejected tokens are redrawn from ``norm([p - q]_+)`` by acceptance-rejection with proposal ``p``
    (a plain ``p`` draw after ``params.max_residual_tries``). Later steps are discarded (they saw a draft that was
    replaced). ``first_step`` / ``first_round``: the schedule step and trace round this call starts at (after the
    pre-fill).
    """
    b_total, length, dim = state.tokens.shape
    dev = state.tokens.device
    starts, num_steps, k_max = params.starts, params.num_steps, params.num_draft_steps
    row_step = {b: first_step for b in range(b_total)}
    all_rows = torch.arange(b_total, device=dev)
    d_noise = noise.for_draft()
    round_index = first_round - 1  # the trace's round of this call's first round (after the pre-fill rounds)
    while row_step:
        round_index += 1
        ks = {b: min(k_max, num_steps - s) for b, s in row_step.items()}
        canvas, visible = state.tokens.clone(), state.visible.clone()
        step_of = torch.full((b_total, length), k_max, dtype=torch.long, device=dev)
        # Host bookkeeping from the schedule (no host read): visible tokens of each row's draft canvas, the (image,
        # draft step) of every token chunk in flat order, and the tokens drafted per image.
        seen = [starts[row_step[b]] if b in row_step else length for b in range(b_total)]
        chunks, per_row = [], [0] * b_total
        items = []  # per draft step j: (rows, pos, cfg, y_q, mu_q, sd_q, x_q, logdet_q, zq_c, zq_u)
        for j in range(k_max):
            steps_j = {b: s + j for b, s in row_step.items() if j < ks[b]}
            if not steps_j:
                break
            rows, pos, cfg = _flat_steps(noise, params, steps_j, dev)
            z_c, z_u = draft.features(canvas, visible, all_rows, (min(seen), max(seen)))
            zc, zu = z_c[rows, pos], None if z_u is None else z_u[rows, pos]
            last = _head_last(draft, d_noise, params, zc, zu, rows, pos, cfg)
            x_q, logdet_q = FinalStep(draft.head, zc, zu, cfg).forward_logdet(last.value)
            draft.saw("diffusion head", x_q)
            canvas[rows, pos] = x_q.to(canvas.dtype)
            visible[rows, pos] = True
            step_of[rows, pos] = j
            items.append((rows, pos, cfg, last.value, last.mean, last.std, x_q, logdet_q, zc, zu))
            for b, s in steps_j.items():
                chunks.append((b, j, starts[s + 1] - starts[s]))
                per_row[b] += starts[s + 1] - starts[s]
                seen[b] = starts[s + 1]
        cat = [torch.cat(t) if t[0] is not None else None for t in zip(*items, strict=True)]
        rows, pos, cfg, y_q, mu_q, sd_q, x_q, logdet_q, zq_c, zq_u = cat
        jj = torch.tensor([j for _, j, n in chunks for _ in range(n)], dtype=torch.long, device=dev)
        # Nested canvases: one per (image, draft step); canvas (b, j) sees the drafts of steps < j.
        nest = sorted((b, j) for b, j, n in chunks if n)
        nest_id = {key: r for r, key in enumerate(nest)}
        nest_img = torch.tensor([b for b, _ in nest], device=dev)
        nest_j = torch.tensor([j for _, j in nest], device=dev)
        nest_visible = state.visible[nest_img] | (step_of[nest_img] < nest_j[:, None])
        nest_seen = [starts[row_step[b] + j] for b, j in nest]
        z_c, z_u = target.features(canvas[nest_img], nest_visible, nest_img, (min(nest_seen), max(nest_seen)))
        r = torch.tensor([nest_id[(b, j)] for b, j, n in chunks for _ in range(n)], dtype=torch.long, device=dev)
        zc, zu = z_c[r, pos], None if z_u is None else z_u[r, pos]
        last_p = _head_last(target, noise, params, zc, zu, rows, pos, cfg)
        f_p = FinalStep(target.head, zc, zu, cfg)
        accept_prob = finished_accept_prob(f_p, x_q, y_q, last_p.mean, last_p.std, mu_q, sd_q, logdet_q)
        u = _tries(torch.rand, generator, rows, 1, (), dev, per_row)[0]  # per image, in the image's own token order
        accepted = u < accept_prob
        # the first chunk of residual tries for every drafted token, drawn before the decision is read (a token
        # that turns out not to need one discards its tries): the round then reads once, unless a rejected
        # token's first chunk found no residual value (rare), which costs one read per further chunk
        f_q = FinalStep(draft.head, zq_c, zq_u, cfg)
        first = min(RESIDUAL_CHUNK, params.max_residual_tries)
        chosen, took = residual_tries(f_p, f_q, last_p.mean, last_p.std, mu_q, sd_q, rows, generator, first,
                                      per_row)  # fmt: skip
        # Leading fully accepted steps per image (a step not drafted stops the count); the first step with a
        # rejection is kept (residual draws). Fixed shapes on the device; the round's one host read: n_ok and the
        # rejected tokens per image still without a residual value.
        stop = torch.tensor([[int(j >= ks.get(b, 0)) for j in range(k_max)] for b in range(b_total)], device=dev)
        stop = stop.index_put((rows, jj), (~accepted).long(), accumulate=True)
        n_ok = (stop == 0).long().cumprod(1).sum(1)  # [B]
        keep = jj <= n_ok[rows]
        need = (jj == n_ok[rows]) & ~accepted
        unfilled = need & ~took
        n_left = torch.zeros(b_total, dtype=torch.long, device=dev).index_add_(0, rows, unfilled.long())
        n_ok_host, n_left_host = torch.stack([n_ok, n_left]).tolist()
        advance = {b: min(n_ok_host[b] + 1, ks[b]) for b in row_step}
        values = torch.where(need[:, None], chosen, x_q)
        if sum(n_left_host):  # further chunks (and the plain-p fallback) for the tokens still unfilled
            idx = torch.argsort((~unfilled).to(torch.int8), stable=True)[: sum(n_left_host)]  # in order
            values[idx], fallbacks = residual_finished(f_p.select(idx), f_q.select(idx), last_p.mean[idx],
                                                       last_p.std[idx], mu_q[idx], sd_q[idx], rows[idx], generator,
                                                       b_total, params.max_residual_tries - first,
                                                       counts=n_left_host)  # fmt: skip
            state.num_fallbacks = state.num_fallbacks + fallbacks
        target.saw("diffusion head", values)
        state.emit(rows, pos, values, torch.where(accepted, ACCEPTED, RESAMPLED), round_index, keep=keep)
        state.drafted += torch.tensor(per_row, dtype=state.drafted.dtype, device=dev)
        if stats is not None:
            stats.target_forwards += 1
            stats.draft_forwards += len(items)
        revealed = 0
        for b, a in advance.items():
            revealed += starts[row_step[b] + a] - starts[row_step[b]]
            row_step[b] += a
            if row_step[b] >= num_steps:
                del row_step[b]
        if progress is not None:
            progress.update(revealed)
        if callback is not None:
            callback(min(row_step.values(), default=num_steps), state)


def finished_accept_prob(f_p, x_q, y_q, mu_p, sd_p, mu_q, sd_q, logdet_q) -> Tensor:
    """CSpD's acceptance ``min(1, p_x(x_q) / q_x(x_q))`` on *finished* values ``x_q = f_q(y_q)`` ``[N]``: ``q_x`` by
    change of variables at the draft's own ``y_q`` (``logdet_q = log |det J_{f_q}(y_q)|``), ``p_x`` through the
    target's inverse final step (`FinalStep.log_density`); a token whose inverse did not converge gets 0 (rejected,
    then redrawn from the residual, whose proposal is ``p_x`` itself)."""
    log_p, ok = f_p.log_density(x_q, mu_p, sd_p, y0=y_q)
    log_q = gaussian_logpdf(y_q, mu_q, sd_q) - logdet_q
    ok = ok & torch.isfinite(logdet_q)  # a flat (clamped) draft final step has no density: reject
    return torch.where(ok, (log_p - log_q).clamp_max(0).exp(), 0.0)


RESIDUAL_CHUNK = 8  # residual tries drawn per token between two host reads


def residual_tries(f_p, f_q, mu_p, sd_p, mu_q, sd_q, rows, generator, tries, counts):
    """``tries`` acceptance-rejection tries for each token ``[T]`` of the residual ``norm([p_x - q_x]_+)`` with
    proposal ``p_x`` (``x = f_p(y), y ~ N(mu_p, sd_p^2)``, kept with probability ``[1 - q_x(x)/p_x(x)]_+``), no host
    read: ``(the first kept value per token [T, D] (arbitrary where none was kept: callers keep only kept ones),
    kept [T] bool)``. ``counts``: tokens per image of
    ``rows`` on the host (the per-image generators' draw counts)."""
    m, d = mu_p.shape
    dev = mu_p.device
    eps = _tries(torch.randn, generator, rows, tries, (d,), dev, counts)  # [c, T, D]
    u = _tries(torch.rand, generator, rows, tries, (), dev, counts)  # [c, T]
    y = (mu_p + sd_p * eps).reshape(-1, d)
    fp, fq = f_p.repeat(tries), f_q.repeat(tries)
    x, logdet_p = fp.forward_logdet(y)
    log_p = gaussian_logpdf(y, mu_p.repeat(tries, 1), sd_p.repeat(tries, 1)) - logdet_p
    log_q, ok = fq.log_density(x, mu_q.repeat(tries, 1), sd_q.repeat(tries, 1), y0=y)
    ratio = torch.where(ok, (log_q - log_p).clamp_max(0).exp(), 0.0).reshape(tries, -1)
    take = u < 1 - ratio  # [c, T]
    first, any_take = take.long().argmax(0), take.any(0)
    return x.reshape(tries, -1, d)[first, torch.arange(m, device=dev)], any_take


def residual_finished(f_p, f_q, mu_p, sd_p, mu_q, sd_q, rows, generator, batch, max_tries, chunk=RESIDUAL_CHUNK,
                      counts=None):  # fmt: skip
    """Draw each token ``[M]`` from ``norm([p_x - q_x]_+)`` (densities of finished values) by acceptance-rejection
    (`residual_tries`), up to ``max_tries`` tries; tokens never kept get a plain ``p_x`` draw. ``counts``: tokens per
    image of ``rows``, when the caller knows them on the host. One host read per chunk of ``chunk`` tries (what is
    left per image). Returns ``(values [M, D], fallbacks)``."""
    m, d = mu_p.shape
    dev = mu_p.device
    out = torch.zeros_like(mu_p)
    filled = torch.zeros(m, dtype=torch.bool, device=dev)
    left = torch.bincount(rows, minlength=batch).tolist() if counts is None else list(counts)
    remaining, todo = m, torch.arange(m, device=dev)
    tries = 0
    while tries < max_tries and remaining:
        c = min(chunk, max_tries - tries)
        chosen, any_take = residual_tries(f_p.select(todo), f_q.select(todo), mu_p[todo], sd_p[todo], mu_q[todo],
                                          sd_q[todo], rows[todo], generator, c, left)  # fmt: skip
        out[todo] = torch.where(any_take[:, None], chosen, out[todo])
        filled[todo] = any_take
        tries += c
        # the chunk's one host read: tokens left per image; the unfilled tokens in order (fixed shapes)
        left = torch.zeros(batch, dtype=torch.long, device=dev).index_add_(0, rows, (~filled).long()).tolist()
        remaining = sum(left)
        todo = torch.argsort(filled.to(torch.int8), stable=True)[:remaining]
    if remaining:
        eps = _tries(torch.randn, generator, rows[todo], 1, (d,), dev, left)[0]
        out[todo] = f_p.select(todo)(mu_p[todo] + sd_p[todo] * eps)
    return out, remaining


def _tries(fn, generator, rows, c, trailing, device, counts=None):
    """``[c, T, *trailing]`` draws (``fn``: ``torch.rand`` / ``torch.randn``) for tokens of images ``rows [T]``: from
    the one generator, or each image's tokens from its own generator (token-major). ``counts``: tokens per image,
    when known on the host (else read once)."""
    if num_rows(generator) is None:
        return fn((c, rows.numel(), *trailing), generator=generator, device=device)
    if counts is None:
        counts = torch.bincount(rows, minlength=len(generator)).tolist()
    out = torch.empty((c, rows.numel(), *trailing), device=device)
    for b, n in enumerate(counts):
        if n:
            idx = torch.argsort((rows != b).to(torch.int8), stable=True)[:n]  # image b's tokens, in order
            out[:, idx] = fn((n, c, *trailing), generator=generator[b], device=device).transpose(0, 1)
    return out
