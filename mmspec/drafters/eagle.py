"""EAGLE drafting (Li et al. 2024, EAGLE-1/2, arXiv 2401.15077 / 2406.16858) with an `mmspec.models.llamagen.eagle.EagleHead`:
sampled chains, the EAGLE-2 dynamic draft tree, and `EagleDrafter`, the engine's drafter that keeps the head's
state between rounds.

Head inputs are pairs `(h[t], x[t+1])` of a target hidden state and the token after it, in model rows (both CFG
streams `[cond; uncond]` when guidance is on):
    1. after the target's prefill: `hidden` = target hidden at the last prefix slot `[rows, 1, dim]`, `input_ids` =
       the first sampled token `[rows, 1]`;
    2. after each verification that accepted nodes a_1..a_k and emitted the next token b: `hidden` = target hiddens at
       [root, a_1, ..., a_k], `input_ids` = [a_1, ..., a_k, b] (`num_valid = k + 1`, ragged rows padded).
Every draft starts by committing those pairs to the head cache (`commit_accepted`); drafted pairs stay scratch.

Vision-aware heads (`mmspec.drafters.vision_eagle.VisionEagleHead`: ViSpec, SpecVLM, MSD) have `prefill_prompt`: they
read the target's merged input embeddings and image mask (`HFTarget.prefill(return_vision=True)`; the drafter's
`needs_vision`) and write the prompt's pairs with the image pairs replaced by their vision-token policy's tokens, at
the target's positions (the head keeps a per-row position offset, so a draft position is not its cache slot). Only
the last prompt pair `(h[L_r - 1], first token)` is left pending; from then on the rounds are EAGLE's.

A head with `set_prompt_positions` (an EAGLE-3 head at the target's M-RoPE positions,
`mmspec.models.hf.eagle3`) gets the prompt's position ids from the target's prefill (`TargetOutput.positions`).
"""

import logging
from inspect import signature
from types import SimpleNamespace

import torch

from mmspec.decoding.captured_draft import CapturedDraft, captures_rounds
from mmspec.decoding.compiled import dense
from mmspec.decoding.drafter import JointSync, Proposal
from mmspec.decoding.graph_uniforms import resolve_uniforms
from mmspec.drafters.chain import chain_lengths, draw_chain, sample_chain, stops_in_round
from mmspec.drafters.lengths import FixedLength
from mmspec.drafters.tree import DraftTree, grow_tree
from mmspec.models.hf.inputs import image_token_mask
from mmspec.models.hf.target import captured_cache_slots, round_window
from mmspec.models.llamagen.eagle import EagleHead


logger = logging.getLogger(__name__)

__all__ = [
    "AtWindow",
    "CapturedHead",
    "DraftTree",
    "EagleDrafter",
    "EagleHead",
    "cfg_combine",
    "chain_round",
    "commit_accepted",
    "draft_chain",
    "draft_tree",
    "tree_round",
]


def cfg_combine(logits, guidance_scale):
    """`uncond + s * (cond - uncond)` over rows `[cond; uncond]` -> `[rows // 2, ...]`; `guidance_scale=None` means
    the rows are not CFG pairs (returned as is). `guidance_scale` may be a float or a `[B]` tensor."""
    if guidance_scale is None:
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    s = torch.as_tensor(guidance_scale, dtype=logits.dtype, device=logits.device)
    if s.dim() == 1:
        s = s.view(-1, *([1] * (logits.dim() - 1)))
    return uncond + s * (cond - uncond)


def commit_accepted(head, target, cache, hidden, input_ids, num_valid=None, validate=True):
    """Step 1 of every EAGLE draft: feed the newly accepted pairs `(hidden, input_ids)` (`num_valid [rows]` valid per
    row, default all), commit them to the head cache, and return the last valid feature `[rows, 1, dim]`, which
    drafts the first token after the root. `validate=False` skips the value check of `num_valid` (a host sync; the
    engine's drafter makes `num_valid` itself)."""
    rows, m = input_ids.shape
    device = input_ids.device
    num_valid = torch.full((rows,), m, dtype=torch.long, device=device) if num_valid is None else num_valid
    num_valid = torch.as_tensor(num_valid, dtype=torch.long, device=device)
    if tuple(num_valid.shape) != (rows,) or (validate and bool(((num_valid < 1) | (num_valid > m)).any())):
        raise ValueError(f"num_valid must be [rows={rows}] with values in 1..{m}")
    feats = head(hidden, input_ids, target, cache, validate=validate)
    cache.commit(num_valid)
    return feats[torch.arange(rows, device=device), num_valid - 1][:, None]


@torch.no_grad()
def draft_chain(head, target, cache, hidden, input_ids, num_valid, *, length, guidance, generator, num_draft=None,
                validate=True, confidence=None, stop=None, draws=None):  # fmt: skip
    """EAGLE chain with *sampled* drafts: `length` tokens, each drawn from the head's processed distribution.

    Step 1 is `commit_accepted` (as in `draft_tree`). Each draft token is sampled from the head's `q_draft`, processed
    by `guidance` exactly as the target's distributions (CFG, temperature, top-k/p), so standard speculative sampling
    accepts it with probability `sum_v min(p_target, q_draft)`; a deterministic top-1 chain would be accepted with
    `p_target(argmax q_draft)` only, far less at temperature 1. Under greedy sampling `q_draft` is one-hot and the
    chain is the head's greedy chain. Drafted pairs are scratch: the head cache keeps only the committed pairs
    (lengths grow by `num_valid`).

    Args:
        hidden, input_ids, num_valid: the accepted pairs in model rows (see the module docstring).
        length: chain length K >= 1.
        guidance: the call's `mmspec.decoding.guidance.Guidance` (row layout + processing).
        generator: `torch.Generator` or one per batch item.
        num_draft: optional `[B]` drafts each item needs (`<= length`); with per-item generators an item draws only
            its own drafts, so its randomness does not depend on the rest of the batch.
        validate: check `num_valid` (one host sync; see `commit_accepted`).
        confidence: optional in (0, 1): an item stops drafting after a token the head gave a raw probability below
            this (`mmspec.drafters.chain.sample_chain`; the chain may then be shorter than `length`).
        stop: optional, a draft-length policy's in-round stop (`sample_chain`'s `stop`).
        draws: the drafter's longest chain, each item's fixed draw a round with per-item generators (`sample_chain`).

    Returns:
        `(draft_tokens [B, K], q_draft [B, K, V], num_draft [B] or None)`: `K <= length`, `num_draft` as given
        (capped by the confidence stop).
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    step = _chain_step(head, target, cache, guidance, hidden, input_ids, num_valid, validate)
    tokens, q_draft, num_draft = sample_chain(
        step, None, length, guidance, generator, num_draft, confidence, stop, draws
    )
    cache.rollback(cache.lengths - (tokens.shape[1] - 1))
    return tokens, q_draft, num_draft


def _chain_step(head, target, cache, guidance, hidden, input_ids, num_valid, validate):
    """A chain's `step` (`mmspec.drafters.chain`): commits the accepted pairs (`commit_accepted`), then returns the
    logits of the first draft from their last feature, and for each draft fed the logits after `(f_hat, x)` at the
    next slot (committed; the caller rolls the drafted pairs back)."""
    feat = [commit_accepted(head, target, cache, hidden, input_ids, num_valid, validate)]  # [rows, 1, dim]

    def step(tok):
        if tok is not None:
            feat[0] = head(feat[0], guidance.rows(tok), target, cache, validate=False)
            cache.commit(1)
        return head.compute_logits(target, feat[0][:, 0])

    return step


class AtWindow:
    """A transformers EAGLE head (`windowed_cache`) whose forwards all attend over one given window of its cache: a
    captured round's (`mmspec.models.hf.target.round_window`), made on the host before the graph, so that no forward
    in it computes one."""

    def __init__(self, head, window: int):
        self.head, self.window = head, window

    def __call__(self, *args, **kwargs):
        return self.head(*args, window=self.window, **kwargs)

    def compute_logits(self, target, features):
        return self.head.compute_logits(target, features)


def chain_round(head, target, cache, hidden, input_ids, num_valid, guidance, uniforms, keys, round_index, *, length,
                window=None):  # fmt: skip
    """`draft_chain` of `length` drafts (no stops) as a pure function of its inputs, for one captured graph
    (`mmspec.decoding.captured_draft`): the drafts are drawn on `uniforms` (or Philox blocks of `keys`; greedy:
    None) by `mmspec.drafters.chain.draw_chain`. `window`: a transformers head's attention window for the whole
    round (`AtWindow`). Returns `(draft_tokens, q_draft, sum of q_draft, the cache's committed lengths)`."""
    head = head if window is None else AtWindow(head, window)
    uniforms = resolve_uniforms(uniforms, keys, round_index, length)
    step = _chain_step(head, target, cache, guidance, hidden, input_ids, num_valid, False)
    tokens, q_draft, total = draw_chain(step, None, length, guidance, uniforms)
    cache.rollback(cache.lengths - (length - 1))
    return tokens, q_draft, total, cache.lengths


def tree_round(head, target, cache, hidden, input_ids, num_valid, uniforms, keys, round_index, *, depth, top_k, total,
               guidance_scale, window=None):  # fmt: skip
    """`draft_tree` as a pure function of its inputs, for one captured graph (`mmspec.decoding.captured_draft`; a
    tree draws nothing: the uniform inputs are None; `window` as `chain_round`'s). Returns `(tokens, parents, the
    cache's committed lengths)`."""
    head = head if window is None else AtWindow(head, window)
    tree = draft_tree(head, target, cache, hidden, input_ids, num_valid, depth=depth, top_k=top_k, total=total,
                      validate=False, guidance_scale=guidance_scale)  # fmt: skip
    return tree.tokens, tree.parents, cache.lengths


@torch.no_grad()
def draft_tree(
    head,
    target,
    cache,
    hidden,
    input_ids,
    num_valid=None,
    *,
    guidance_scale=None,
    depth=4,
    top_k=10,
    total=59,
    logits_processor=None,
    validate=True,
):
    """EAGLE-2 dynamic draft tree (Li et al. 2024, "EAGLE-2"), batched over rows, both CFG streams.

    1. Feed the newly accepted chain of pairs `(hidden, input_ids)` (`num_valid [rows]` valid per row) and commit it
       to the head cache; its last feature drafts depth 1 (the root is `input_ids[r, num_valid[r] - 1]`).
    2. For each depth: draft logits of the frontier are CFG-combined (`guidance_scale`), passed through
       `logits_processor` (optional callable on `[..., V]` logits), log-softmaxed; every frontier node proposes its
       `top_k` children, scored by cumulative log-prob; the best `top_k` of them form the next frontier and are fed
       to the head (attending to committed pairs + their ancestors). `depth` = levels of draft tokens.
    3. Rerank all candidates globally by cumulative log-prob (ties: shallower first) and keep `total` of them (an
       ancestor-closed set, since children never score above parents), returned in topological order.

    The head cache's committed length grows by `num_valid`; tree nodes stay scratch.

    Returns:
        `DraftTree` with `B = rows // 2` items under CFG (`guidance_scale` not None), else `B = rows`.
    """
    rows = input_ids.shape[0]
    device = input_ids.device
    if guidance_scale is not None and rows % 2:
        raise ValueError(f"with guidance_scale the rows must be [cond; uncond] (even), got {rows}")
    if depth < 1 or top_k < 1 or total < 1:
        raise ValueError(f"depth, top_k and total must be >= 1, got {depth}, {top_k}, {total}")

    def log_probs(features):  # [rows, K, dim] -> [B, K, V]
        logits = cfg_combine(head.compute_logits(target, features), guidance_scale)
        if logits_processor is not None:
            logits = logits_processor(logits)
        return torch.log_softmax(logits.float(), dim=-1)

    def per_row(x):  # [B, ...] -> [rows, ...] (same tree on both CFG streams)
        return torch.cat([x, x], dim=0) if guidance_scale is not None else x

    # 1. accepted chain -> committed head state
    root_feat = commit_accepted(head, target, cache, hidden, input_ids, num_valid, validate)  # [rows, 1, dim]
    dim = root_feat.shape[-1]  # the head's feature width (an EAGLE-3 head's is not its input's)
    base_len = cache.lengths
    fed = {"out": root_feat}  # the head outputs of the last fed frontier

    def expand(tokens, parent, ancestry, d):  # feed the depth d - 1 frontier to the head (scratch slots)
        k, n_all = tokens.shape[1], ancestry.shape[2]
        if parent is None:  # children of the root take its feature
            feat = root_feat.expand(rows, k, dim)
        else:  # a node's input feature is its parent's output f_hat
            feat = fed["out"].gather(1, per_row(parent)[:, :, None].expand(rows, k, dim))
        key_slots = base_len[:, None] + torch.arange(n_all, device=device)[None]
        input_pos = (base_len + d - 2)[:, None].expand(rows, k)
        cache_mask = cache.visibility(key_slots, per_row(ancestry))
        fed["out"] = head(feat, per_row(tokens), target, cache, input_pos, key_slots[:, n_all - k :],
                          cache_mask=cache_mask, validate=False)  # fmt: skip  # [rows, k, dim]
        return log_probs(fed["out"])

    return grow_tree(log_probs(root_feat)[:, 0], expand, depth=depth, top_k=top_k, total=total)


class CapturedHead:
    """An EAGLE head whose per-step forward runs captured (`head.capture(compiler)`: one graph per shape); every
    other attribute (`compute_logits`, `config`, ...) is the head's. Calls over more than `max_pairs` pairs (a text
    prompt's pairs, once per call) run eager, so a prompt's length never becomes a graph. Tensor arguments go in with
    standard strides (`mmspec.decoding.compiled.dense`): a tree's inputs are views whose strides change with the
    depth (an expanded root feature, a slice of the key slots), and a text head builds its cache view from them."""

    def __init__(self, head, compiler, max_pairs):
        self.head, self.run, self.max_pairs = head, head.capture(compiler), max_pairs

    def __call__(self, hidden, input_ids, *args, **kwargs):
        if input_ids.shape[1] > self.max_pairs:
            return self.head(hidden, input_ids, *args, **kwargs)
        return self.run(*map(dense, (hidden, input_ids, *args)), **{k: dense(v) for k, v in kwargs.items()})

    def __getattr__(self, name):
        return getattr(self.head, name)


def pad_pairs(hidden, input_ids, width):
    """Accepted pairs `hidden [rows, M, dim]`, `input_ids [rows, M]` padded with zero pairs to `width >= M` columns
    (`M` itself when wider): the padded pairs come after every valid one in the causal chain, are written to scratch
    slots and never committed (`commit_accepted` commits `num_valid`), so the valid features are unchanged."""
    pad = width - input_ids.shape[1]
    if pad <= 0:
        return hidden, input_ids
    return (torch.cat([hidden, hidden.new_zeros(hidden.shape[0], pad, hidden.shape[2])], dim=1),
            torch.cat([input_ids, input_ids.new_zeros(input_ids.shape[0], pad)], dim=1))  # fmt: skip


class EagleDrafter:
    """The engine's EAGLE drafter (`mmspec.decoding.drafter.Drafter`): owns the head cache and the accepted pairs.

    Args:
        head: the `EagleHead` trained on `target`.
        target: the target `LlamaGenGPT` (its token embedding and output head are shared with the head).
        guidance: the call's `Guidance`.
        depth: chain length (`top_k == 1`) or tree depth.
        top_k: 1 = a chain of `depth` tokens sampled from `q_draft` (accepted with `sum min(p, q)`); > 1 = the
            EAGLE-2 dynamic tree with `top_k` deterministic children per node and `total` nodes.
        total: tree nodes kept (trees only).
        length: chains only, optional: the draft-length policy (`mmspec.decoding.draft_length.DraftLength`) with
            `k_max = depth`: each row's chain length per round. Default: `depth` every round.
        host_prompt: optional `(prompt lengths, image tokens)` per row as host lists (the prompt's host copy).
        image_layout: optional, each row's images by length (`mmspec.models.hf.image_layout.ImageLayout`) for a
            vision-aware head on a target whose images differ in size (Qwen-VL, any-resolution LLaVA).

    Attributes (text targets, set at `prefill`, one entry per batch item):
        draft_image_tokens: `[B]` image tokens the head reads for the prompt: a `TextEagleHead` reads a pair at every
            image token; a vision-aware head the tokens its policy keeps.
        gate_choice: SpecVLM's gate, the compressor chosen per item (names; None for an item without image), else
            None.
    """

    needs_hidden = True

    def __init__(self, head, target, guidance, depth, top_k=1, total=24, host_prompt=None, length=None,
                 image_layout=None):  # fmt: skip
        for name, value in (("depth", depth), ("top_k", top_k), ("total", total)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        head.check_target(target)
        self.head, self.target, self.guidance = head, target, guidance
        self.depth, self.top_k, self.total = int(depth), int(top_k), int(total)
        self.chain = self.top_k == 1
        self.max_width = self.depth if self.chain else min(self.total, self.top_k + (self.depth - 1) * self.top_k**2)
        if length is not None and (not self.chain or length.k_max != self.depth):
            raise ValueError(f"length: a chain's policy (top_k=1) with k_max = depth = {self.depth}")
        self.length = FixedLength(self.depth) if length is None else length
        window = SimpleNamespace(sync_value=self._window_value, sync_host=self._window_host)  # the head cache's
        self._sync = JointSync(window, self.length)
        self.cache = None
        self.draft_forwards = 0
        self.compiler = None  # `mmspec.decoding.compiled.Compiler`: the head's per-step forward runs captured
        self.captured = None  # with `verify` on, the call's `CapturedDraft`: a whole round drafts as one graph
        self.needs_vision = callable(getattr(head, "prefill_prompt", None))  # the target's inputs_embeds + image mask
        self.draft_image_tokens, self.gate_choice = None, None
        # text targets: `(prompt lengths, image tokens)` per row as host lists, from the prompt's host copy (the
        # pipeline's): the prompt's shapes and the image-token stats need no device read; None: read
        self.host_prompt = host_prompt if guidance.streams == 1 else None
        # images of different sizes: each row's images by length (`mmspec.models.hf.image_layout.ImageLayout`, from
        # the processor's host outputs), for a vision-aware head's policy
        self.image_layout = image_layout if guidance.streams == 1 else None

    def prefill(self, state, target_out):
        """Start from the target's prefill. Image targets: one pair (hidden at the last prefix slot, first token).
        Text targets (`target_out.input_ids` set): the pairs `(h[t], x[t+1])` of the whole prompt, the last one
        `(h[L_r - 1], first token)` -- `num_valid = L_r` per row (right-padded prompts). A vision-aware head writes
        every prompt pair but the last through its policy here (`prefill_prompt`); the last one stays pending."""
        rows = target_out.hidden.shape[0]
        self.length.start(state.count.shape[0], state.count.device)
        # a whole round as one graph (a transformers head's forwards on one attention window, made before it)
        whole = captures_rounds(self.compiler)
        self.captured = CapturedDraft(self.compiler, state.batch_size, state.tokens.device) if whole else None
        scratch = self.depth * self.top_k + 2  # drafted pairs: the chain, or the tree's frontiers
        if target_out.input_ids is None:
            prefix = self.target.config.cls_token_num
            self.hidden, self.ids = target_out.hidden, self.guidance.rows(state.pending[:, None])
            self.num_valid = torch.ones(rows, dtype=torch.long, device=self.ids.device)
            self.cache = self.head.setup_cache(rows, prefix + state.max_length + scratch)
            return
        ids, lengths = target_out.input_ids, target_out.lengths
        prefix = ids.shape[1]
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # x[t+1] (the last column is overwritten or padding)
        nxt.scatter_(1, (lengths - 1)[:, None], self.guidance.rows(state.pending[:, None]))
        slots = prefix + state.max_length + scratch
        # captured: the cache's size on a bucket (one of the graphs' shapes: the next prompts reuse them)
        self.cache = self.head.setup_cache(rows, slots if self.compiler is None else captured_cache_slots(slots))
        set_positions = getattr(self.head, "set_prompt_positions", None)
        if callable(set_positions):  # a head at the target's own positions (M-RoPE) keeps the prompt's
            set_positions(self.cache, target_out.positions, lengths)
        if not self.needs_vision:
            # the prompt's pairs but the last written now, as a vision-aware head's `prefill_prompt` does: a round
            # then feeds at most `depth + 1` pairs (one graph shape when captured)
            if prefix > 1:  # a fresh cache's committed span (slot 0) is known on the host: this forward reads nothing
                self.cache.sync_window(1)
                self.head(target_out.hidden[:, :-1], nxt[:, :-1], self.target, self.cache, validate=False)
                self.cache.commit(lengths - 1)
            self._pending_pair(target_out.hidden, nxt, lengths)
            image_mask = target_out.image_mask
            if image_mask is None:
                valid = torch.arange(prefix, device=ids.device)[None, :] < lengths[:, None]
                image_mask = image_token_mask(self.target, ids) & valid
            # a pair at every image token
            self.draft_image_tokens = (self.guidance.items(image_mask.sum(1)) if self.host_prompt is None
                                       else list(self.host_prompt[1]))  # fmt: skip
            return
        if target_out.inputs_embeds is None or target_out.image_mask is None:
            raise ValueError(f"{type(self.head).__name__} reads the target's input embeddings and image mask: prefill "
                             "the target with return_vision=True (the drafter's needs_vision)")  # fmt: skip
        # a head that takes the host-side prompt / the image layout (`VisionEagleHead`) gets them; other heads keep
        # their signature
        takes = signature(self.head.prefill_prompt).parameters
        known = {"host_prompt": self.host_prompt} if "host_prompt" in takes else {}
        if self.image_layout is not None:
            if "image_layout" not in takes:
                raise ValueError(f"image_layout: {type(self.head).__name__}.prefill_prompt does not take the images' "
                                 "layout, but the prompt's images differ in size")  # fmt: skip
            known["image_layout"] = self.image_layout
        info = self.head.prefill_prompt(self.target, self.cache, target_out.hidden, nxt, lengths,
                                        target_out.inputs_embeds, target_out.image_mask, **known)  # fmt: skip
        self._pending_pair(target_out.hidden, nxt, lengths)
        tokens = info["draft_image_tokens"]
        self.draft_image_tokens = tokens if isinstance(tokens, list) else self.guidance.items(tokens)
        choice, names = info.get("choice"), info.get("choice_names")
        if choice is not None:  # -1: a row without an image (the gate was not asked)
            self.gate_choice = [names[i] if i >= 0 else None for i in self.guidance.items(choice).tolist()]

    def _pending_pair(self, hidden, nxt, lengths):
        """The prompt's last pair `(h[L_r - 1], first token)`, pending: the first round feeds it."""
        last = (lengths - 1)[:, None]
        self.hidden = hidden.gather(1, last[:, :, None].expand(-1, -1, hidden.shape[-1]))
        self.ids = nxt.gather(1, last)
        self.num_valid = torch.ones(hidden.shape[0], dtype=torch.long, device=nxt.device)

    def _head_and_pairs(self):
        """The head to draft with and the accepted pairs it starts from: eager, or captured with the pairs padded to
        `depth + 1` (the widest a round accepts), so every round's first forward has one shape."""
        if self.compiler is None:
            return self.head, self.hidden, self.ids
        self.compiler.static(self.cache)
        width = self.depth + 1
        return CapturedHead(self.head, self.compiler, width), *pad_pairs(self.hidden, self.ids, width)

    def propose(self, state):
        g = self.guidance
        if self.captured is not None and not (self.chain and stops_in_round(self.length)):
            return self._propose_captured(state)
        head, hidden, ids = self._head_and_pairs()
        if self.chain:
            num_draft, length = chain_lengths(self.length, state)
            drafts, q, num_draft = draft_chain(head, self.target, self.cache, hidden, ids, self.num_valid,
                                               length=length, guidance=g, generator=state.generator,
                                               num_draft=num_draft, validate=False,
                                               confidence=self.length.confidence,
                                               stop=getattr(self.length, "stop", None),
                                               draws=self.length.k_max)  # fmt: skip
            self.draft_forwards += drafts.shape[1]
            self._num_draft = num_draft
            return Proposal(drafts, num_draft, q_draft=q)
        tree = draft_tree(head, self.target, self.cache, hidden, ids, self.num_valid, depth=self.depth,
                          top_k=self.top_k, total=self.total, validate=False,
                          guidance_scale=g.sampling.guidance_scale if g.streams == 2 else None)  # fmt: skip
        return self._tree_proposal(tree.tokens, tree.parents, state)

    def _tree_proposal(self, tokens, parents, state):
        """A drafted tree as the round's proposal (every node of every row, within the drafter's bounds)."""
        self.draft_forwards += self.depth
        return Proposal(tokens, torch.full_like(state.count, tokens.shape[1]), parents=parents,
                        bounds=(self.depth, self.top_k))  # fmt: skip

    def _propose_captured(self, state):
        """`propose` as one graph (`mmspec.decoding.captured_draft`): the accepted pairs padded to `depth + 1`, the
        head's whole chain or tree traced through its eager forward."""
        g = self.guidance
        self.compiler.static(self.cache)
        hidden, ids = pad_pairs(self.hidden, self.ids, self.depth + 1)
        pairs = (self.head, self.target, self.cache, hidden, ids, self.num_valid)
        num_draft, length = chain_lengths(self.length, state) if self.chain else (None, None)
        window = None
        if getattr(self.head, "windowed_cache", False):  # the round's writes: the pairs, then the drafted pairs
            drafted = length - 1 if self.chain else (self.depth - 1) * self.top_k
            window = round_window(self.cache, self.depth + 1 + drafted)
            self.compiler.static(*self.head.prepare_round(self.target))
        if self.chain:
            count = 0 if g.greedy else self.depth  # k_max uniforms a row every sampled round
            drafts, q, total, lengths = self.captured(chain_round, state, count, *pairs, g, length=length,
                                                      window=window)  # fmt: skip
            g.record("draft", total)
            self.cache.lengths = lengths
            self.draft_forwards += length
            self._num_draft = num_draft
            return Proposal(drafts, num_draft, q_draft=q)
        scale = g.sampling.guidance_scale if g.streams == 2 else None
        tokens, parents, lengths = self.captured(tree_round, state, 0, *pairs, depth=self.depth, top_k=self.top_k,
                                                 total=self.total, guidance_scale=scale, window=window)  # fmt: skip
        self.cache.lengths = lengths
        return self._tree_proposal(tokens, parents, state)

    def commit(self, result, target_out, state):
        """Next head input: pairs (h[pending], a_1), ..., (h[a_k], next token) along the accepted chain / path."""
        g, hidden = self.guidance, target_out.hidden
        if result.path is not None:
            path = g.rows(result.path.clamp(min=0))
            hidden = hidden.gather(1, path[:, :, None].expand(-1, -1, hidden.shape[-1]))
        self.hidden = hidden
        self.ids = g.rows(result.tokens.clamp(min=0))
        self.num_valid = g.rows(result.num_emitted)
        if self.chain:
            self.length.update(self._num_draft, result.num_accepted, state.finished)

    def sync_value(self):
        """Read by the loop with its one read per round: a head whose forwards read an attention window of its
        cache, the committed span; an adaptive draft length, the next round's widest chain (None: neither)."""
        return self._sync.value()

    def sync_host(self, values) -> None:
        self._sync.host(values)

    def _window_value(self):
        return self.cache.lengths.max() if getattr(self.head, "windowed_cache", False) else None

    def _window_host(self, committed: int) -> None:
        """The loop's read: the head cache's window bound restarts from the committed span."""
        self.cache.sync_window(committed)

    def select_rows(self, index):
        rows = self.guidance.row_index(index, self.cache.rows // self.guidance.streams)
        self.cache.select_rows(rows)
        self.hidden, self.ids, self.num_valid = self.hidden[rows], self.ids[rows], self.num_valid[rows]
        self.length.select_rows(index)
