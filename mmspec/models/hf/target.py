"""transformers decoder models on mmspec's `StaticKVCache`: a `Cache` subclass, a position provider and the target
adapter of the decoding loop (`mmspec.decoding.target.Target`).

Works for `LlavaForConditionalGeneration` (vision tower + projector run once, at prefill) and plain causal LMs
(`LlamaForCausalLM` and friends): both expose `.model` (the base model) and the output head
`get_output_embeddings()`; the language model's decoder stack is `model.model.language_model` (LLaVA) or
`model.model` (causal LM).

How a forward over `M` new tokens is run (`HFForward.__call__`):

    slots [rows, M], positions [rows, M] (or [3, rows, M])   # from mmspec.cache chain_inputs / tree_inputs
    mask [rows, 1, M, max_seq] = cache.visibility(slots, new-token mask)   # committed prefix + chain / tree
    base(input_ids, position_ids=positions, attention_mask=mask, past_key_values=StaticCache(kv, slots))

transformers returns an already-built 4-D mask as is, and every attention layer calls `cache.update(k, v, layer)`,
which writes at `slots` and hands back the layer's K/V `[rows, kv_heads, window, head_dim]`; masked slots (other
rows' scratch, padding, rejected drafts) are never attended to. The cache holds room for the whole answer
(prompt + `max_new_tokens` + scratch), but a forward reads only its first `window` slots (`attention_window`: the
longest row's committed length + the forward's slots, rounded up to `WINDOW_BUCKET`), so a step costs what the
tokens generated so far cost, not what `max_new_tokens` allows; the slots past the window are masked anyway, so the
answer is the same. The cache itself is allocated in chunks: prefill allocates the prompt + one bucket, and a forward
that needs more slots doubles it (`grow`, up to the prompt + `max_new_tokens` + scratch reserved at prefill). Rows are right-padded at prefill: row `r`'s
prompt sits at slots `0 .. L_r - 1` and its committed length is `L_r`, so ragged prompts need no left padding.

Positions go through one provider (`mmspec.models.hf.positions.Positions`): the default is position == slot (1-D
RoPE). The Qwen-VL family's M-RoPE (`mmspec.models.hf.mrope`, chosen by `positions_for(model)`) takes the prompt's
3-D ids from the model's own `get_rope_index` at prefill and afterwards returns `logical + rope_delta[r]` on all three
axes, `rope_delta` per row kept through `select_rows`. Nothing in the loop or the cache changes for it.
"""

import logging
from contextlib import nullcontext

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from mmspec.cache import StaticKVCache, chain_inputs, tree_inputs
from mmspec.counting import host_checks_enabled
from mmspec.decoding.cached_target import CachedTarget
from mmspec.decoding.captured_draft import captures_rounds
from mmspec.decoding.compiled import bucket_width, dense, pad_block
from mmspec.decoding.guidance import Guidance
from mmspec.decoding.target import TargetOutput
from mmspec.models.hf.inputs import capture_decoder_inputs, capture_layer_inputs, decoder_of, image_token_mask
from mmspec.models.hf.mrope import positions_for
from mmspec.models.hf.positions import Positions


logger = logging.getLogger(__name__)

__all__ = [
    "WINDOW_BUCKET",
    "HFTarget",
    "Positions",
    "StaticCache",
    "attention_window",
    "captured_cache_slots",
    "decoder_of",
    "right_align",
    "round_window",
]

# attention windows are multiples of this many slots (a few sizes over a generation, each far below max_seq)
WINDOW_BUCKET = 128


def slots_needed(cache: StaticKVCache, key_slots: Tensor | None, new_slots: int | None = None,
                 can_grow: bool = False) -> int:  # fmt: skip
    """Slots a forward touches: every row's committed prefix and the slots `key_slots [rows, K]` it writes or attends
    to, of which the last `new_slots` (default all `K`) per row are new. `key_slots` None: a captured round's
    forwards together (`round_window`), writing at most `new_slots` slots per row right after the committed prefix.

    Exact on the CPU (a free read). On an accelerator it is an upper bound kept on the host, so a forward needs no
    sync: every forward writes its slots right after what is already touched (committed prefix, then the chain or
    the tree's levels in order), so the touched span grows by at most `new_slots` per forward; the device is read
    only when that bound outgrows the window of the last read (about once per `WINDOW_BUCKET` slots). The CPU path
    checks that bound on every forward, so the tests prove it holds for every drafter.

    In the last bucket of a cache that cannot grow (`can_grow` False) the window is the whole cache once a read has
    reached it, whatever the bound: the bound is then capped at `max_seq` without a read, also when `max_seq` is
    not a multiple of `WINDOW_BUCKET` (a partial last bucket)."""
    width = key_slots.shape[1] if new_slots is None else int(new_slots)
    bound = getattr(cache, "touched_bound", None)
    bound = None if bound is None else bound + width
    if bound is not None and not _free_reads(cache.lengths if key_slots is None else key_slots):
        if getattr(cache, "host_synced", False):  # re-synced every round by the loop's read (`HFTarget.sync_host`)
            cache.touched_bound = bound if can_grow else min(bound, cache.max_seq)
            return cache.touched_bound
        if _round_up(bound) <= min(cache.touched_window, cache.max_seq):
            cache.touched_bound = bound
            return bound
        if not can_grow and cache.touched_window >= cache.max_seq:  # the last bucket, partial or not
            cache.touched_bound = min(bound, cache.max_seq)
            return cache.touched_bound
    exact = _read_slots_in_use(cache, key_slots, width)
    if bound is not None and exact > bound:
        raise RuntimeError(f"cache slots in use ({exact}) past their host-side bound ({bound}): a forward wrote slots "
                           "beyond the touched span")  # fmt: skip
    cache.touched_bound, cache.touched_window = exact, _round_up(exact)
    return exact


def _read_slots_in_use(cache: StaticKVCache, key_slots: Tensor | None, width: int) -> int:
    """The exact span in use (a host read: one device sync on an accelerator); `key_slots` None: the committed span
    plus `width` new slots (a round's writes, known after it only)."""
    if key_slots is None:
        return int(cache.lengths.max()) + width
    return int(torch.maximum(cache.lengths.max(), key_slots.max() + 1)) if key_slots.numel() else 1


def _free_reads(t: Tensor) -> bool:
    """Whether reading `t` on the host costs no device sync (CPU tensors; not inside `mmspec.counting.HostReads`,
    which takes the accelerator branches)."""
    return host_checks_enabled(t.device)


def attention_window(cache: StaticKVCache, key_slots: Tensor, new_slots: int | None = None) -> int:
    """`slots_needed` rounded up to a multiple of `WINDOW_BUCKET` (at most `cache.max_seq`)."""
    return min(cache.max_seq, _round_up(slots_needed(cache, key_slots, new_slots)))


def round_window(cache: StaticKVCache, new_slots: int, fit=None, can_grow: bool = False) -> int:
    """The attention window of a drafter's whole captured round (`mmspec.decoding.captured_draft`) whose forwards
    write at most `new_slots` slots per row after the committed prefix of `cache`: one window for all of them, known
    on the host before the graph runs, so it is one of the graph's shapes (a multiple of `WINDOW_BUCKET`). From the
    host-side bound as every forward's (`slots_needed`: no device read once the loop's read has synced it). `fit`
    (`HFTarget._fit`) grows a cache that `can_grow` to the slots needed first."""
    needed = slots_needed(cache, None, new_slots, can_grow=can_grow)
    if fit is not None:
        needed = fit(cache, needed)
    return min(cache.max_seq, _round_up(needed))


def _round_up(slots: int) -> int:
    return -(-slots // WINDOW_BUCKET) * WINDOW_BUCKET


def captured_cache_slots(slots: int) -> int:
    """The size of a cache that captured forwards read: `slots` rounded up to a multiple of `WINDOW_BUCKET`. The
    cache's size is one of every graph's shapes (its windows are views of it), so calls whose prompts differ by a
    few tokens share their graphs instead of tracing them again."""
    return _round_up(int(slots))


def grow(cache: StaticKVCache, max_seq: int) -> StaticKVCache:
    """Enlarge `cache` in place to `max_seq` slots per row (contents kept; new slots zero and valid)."""
    extra = int(max_seq) - cache.max_seq
    if extra > 0:
        pad = cache.k.new_zeros(*cache.k.shape[:3], extra, cache.k.shape[4])
        cache.k, cache.v = torch.cat([cache.k, pad], dim=3), torch.cat([cache.v, pad], dim=3)
        cache.key_valid = torch.cat([cache.key_valid, cache.key_valid.new_ones(cache.rows, extra)], dim=1)
    return cache


def window_view(cache: StaticKVCache, window: int) -> StaticKVCache:
    """The first `window` slots of `cache` as a `StaticKVCache` sharing its storage (writes go to `cache`; its
    `visibility` masks are `[rows, M, window]`). For one forward only: commits to the view do not reach `cache`."""
    if window >= cache.max_seq:
        return cache
    view = object.__new__(StaticKVCache)
    view.k, view.v = cache.k[:, :, :, :window], cache.v[:, :, :, :window]
    view.lengths, view.key_valid = cache.lengths, cache.key_valid[:, :window]
    return view


class StaticCache(Cache):
    """A transformers `Cache` that writes into an `mmspec.cache.StaticKVCache` at the slots of the current forward.

    `write_slots [rows, M]` is set before every forward; `update` returns the per-layer K/V of the cache's slots
    (views; pass a `window_view` to read only the slots in use), and the 4-D mask passed to the model decides what
    each query sees. `get_seq_length` is the longest committed row (only used by transformers when no
    `position_ids` are given; mmspec always gives them).
    """

    def __init__(self, kv: StaticKVCache):
        super().__init__(layers=[])
        self.kv = kv
        self.write_slots: Tensor | None = None

    def __len__(self):
        return self.kv.k.shape[0]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.kv.update(layer_idx, self.write_slots, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.kv.lengths.max())

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.kv.max_seq, 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)


def right_align(input_ids: Tensor, attention_mask: Tensor | None, pad_token_id: int = 0):
    """Any-side padded `input_ids [B, L]` (`attention_mask` 1 = token) -> right-padded ids and `lengths [B]`."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got {tuple(input_ids.shape)}")
    if attention_mask is None:
        return input_ids, torch.full(
            (input_ids.shape[0],), input_ids.shape[1], dtype=torch.long, device=input_ids.device
        )
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    keep = attention_mask.bool()
    lengths = keep.sum(1)
    if bool((lengths == 0).any()):
        raise ValueError("every row of attention_mask needs at least one token")
    order = torch.sort((~keep).long(), dim=1, stable=True).indices  # tokens first, order kept
    ids = input_ids.gather(1, order)
    ids = torch.where(torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None], ids, pad_token_id)
    return ids, lengths


class HFTarget(CachedTarget):
    """A transformers causal LM / LLaVA as the target of the decoding loop (see module docstring).

    Args:
        model: `LlavaForConditionalGeneration` or a `*ForCausalLM` (eval mode).
        guidance: the call's `Guidance` (one stream: no CFG for text).
        positions: the position provider (default `mmspec.models.hf.mrope.positions_for(model)`: M-RoPE for the
            Qwen-VL family, else position == slot).
        source: `"target"` or `"draft"` (the adapter also runs draft LMs): names the model in NaN errors.
        vocab: draft LMs only, optional `[N]` token ids: score only these (FR-Spec draft vocabulary, Zhao et al.
            2025); every other token gets logit `-inf`, i.e. probability 0 in `q_draft`.
        hidden_layers: optional decoder layer indices: the hidden states `prefill` / `forward` return (for the
            drafter) are the inputs of these layers concatenated `[rows, M, len * dim]` (EAGLE-3's aux hidden states,
            `mmspec.models.hf.eagle3`; recorded in the same forward, `capture_layer_inputs`) instead of the final-norm
            hidden states.

    Hooks for models that generate another modality through the same decoder (`mmspec.models.janus.target.JanusTarget`):
    `token_inputs` (what the decoder gets for new tokens: `input_ids`, or `inputs_embeds` of image tokens),
    `logits` (the output head) and `supports_guidance` (CFG rows `[cond; uncond]`: `forward`, `commit`,
    `select_rows` and `lengths` speak in batch items and address both streams, `prefill` takes the model rows).
    `commit`, `select_rows` and `lengths` are `mmspec.decoding.cached_target.CachedTarget`'s.
    """

    supports_guidance = False  # text targets: one stream

    def __init__(self, model, guidance: Guidance, positions: Positions | None = None, source: str = "target",
                 vocab: Tensor | None = None, hidden_layers: tuple[int, ...] | None = None):  # fmt: skip
        if guidance.streams != 1 and not self.supports_guidance:
            raise ValueError("classifier-free guidance is not supported for text targets (guidance_scale must be 1)")
        text = model.config.get_text_config()
        if getattr(text, "final_logit_softcapping", None):
            raise ValueError(f"{type(model).__name__}: final_logit_softcapping is not supported")
        super().__init__(guidance)
        self.model, self.source = model, source
        self.positions = positions or positions_for(model)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.text_config = text
        self.max_slots = 0
        self.vocab, self.vocab_weight = vocab, None
        if hidden_layers is not None:
            layers = list(hidden_layers) if isinstance(hidden_layers, (list, tuple)) else None
            depth = text.num_hidden_layers
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth for i in layers):
                raise ValueError(f"hidden_layers must be a non-empty list of decoder layer indices in [0, {depth}) "
                                 f"of {type(model).__name__}, got {hidden_layers!r}")  # fmt: skip
            hidden_layers = tuple(layers)
        self.hidden_layers = hidden_layers
        if vocab is not None:
            if source == "target":
                raise ValueError("vocab restricts a draft LM's output; the target always scores every token")
            vocab = torch.as_tensor(vocab, dtype=torch.long)
            if vocab.dim() != 1 or not len(vocab) or len(vocab.unique()) != len(vocab):
                raise ValueError("draft_vocab must be a 1-D tensor of distinct token ids")
            if int(vocab.min()) < 0 or int(vocab.max()) >= self.vocab_size:
                raise ValueError(f"draft_vocab ids must be in [0, {self.vocab_size})")
            head = model.get_output_embeddings()
            self.vocab = vocab.to(head.weight.device)
            self.vocab_weight = head.weight[self.vocab].detach().t().contiguous()  # [dim, N] (`mmspec.models.layout`)

    # ------------------------------------------------------------------ helpers
    def new_cache(self, rows: int, max_seq: int) -> StaticKVCache:
        t = self.text_config
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        p = self.model.get_output_embeddings().weight
        n_kv = getattr(t, "num_key_value_heads", None) or t.num_attention_heads
        return StaticKVCache(t.num_hidden_layers, rows, n_kv, max_seq, head_dim, dtype=p.dtype, device=p.device)

    def run(self, module, cache: StaticKVCache, slots: Tensor, logical: Tensor, mask: Tensor, key_slots=None,
            capture=False, position_ids=None, window=None, **inputs):  # fmt: skip
        """One forward of `module` (base model or decoder) over new tokens written at `slots [rows, M]` with the
        new-token mask `mask [rows, M, M]`; returns the final-norm hidden states `[rows, M, dim]`. `key_slots
        [rows, K]` (default `slots`) may also list uncommitted slots of earlier forwards, `mask` is then
        `[rows, M, K]` (`StaticKVCache.visibility`). `capture`: run `module` captured when the pipeline compiles
        (`self.compiler`; the per-round forwards, not the prefill). `window`: the forward runs inside a graph that
        holds a whole round (a draft LM's chain, `mmspec.drafters.text_model`): the round's attention window
        (`round_window`), and `module` is traced as it is."""
        key_slots = slots if key_slots is None else key_slots
        traced = window is not None  # inside a round's graph: the masks as a captured forward's, the module itself
        graph = capture and not traced and self.compiler is not None and cache is self.cache  # the module's own graph
        captured = traced or graph
        if not traced:
            needed = self._fit(cache, slots_needed(cache, key_slots, slots.shape[1], can_grow=self._can_grow(cache)))
            # read only the slots in use: exactly those on the CPU (free to vary), whole buckets on an accelerator
            # and when captured (one graph per bucket, `mmspec.decoding.compiled`)
            window = needed if _free_reads(key_slots) and not captured else _round_up(needed)
        cache = window_view(cache, min(cache.max_seq, window))
        visible = cache.visibility(key_slots, mask)[:, None]  # [rows, 1, M, window]
        if not captured and visible.shape[2] == 1 and _free_reads(visible) and bool(visible.all()):
            visible = None  # one token seeing every slot of the window: SDPA's unmasked kernel (plain decoding)
        elif self.model.config._attn_implementation != "flex_attention":
            # eager and SDPA: an additive float mask, built once per forward (SDPA's CPU kernels would otherwise
            # turn the boolean mask into one in every layer); flex attention takes the boolean mask
            dtype = cache.dtype
            visible = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
                ~visible, torch.finfo(dtype).min
            )
        hf_cache = StaticCache(cache)
        hf_cache.write_slots = dense(slots) if captured else slots  # a tree level's slots: a strided view
        if graph:  # the whole decoder, one graph (no per-layer frames, so no `layer_idx` recompiles)
            self.compiler.static(cache)
            module = self.compiler.forward("target" if self.source == "target" else "drafter", module)
        position_ids = self.positions(logical) if position_ids is None else position_ids
        out = module(position_ids=position_ids, attention_mask=visible, past_key_values=hf_cache,
                     use_cache=True, **inputs)  # fmt: skip
        return out.last_hidden_state

    def _can_grow(self, cache: StaticKVCache) -> bool:
        return cache is self.cache and cache.max_seq < self.max_slots

    def _fit(self, cache: StaticKVCache, needed: int) -> int:
        """`needed` slots, the cache grown to hold them first (allocated in chunks, up to what prefill reserved)."""
        if needed > cache.max_seq and cache is self.cache:
            if needed > self.max_slots:
                raise ValueError(
                    f"{self.source}: a forward needs {needed} cache slots, {self.max_slots} were reserved"
                )
            grow(cache, min(self.max_slots, max(2 * cache.max_seq, _round_up(needed))))
        return needed

    def round_window(self, new_slots: int) -> int:
        """The attention window of a captured round whose forwards write at most `new_slots` slots per row after the
        cache's committed span (`run(window=...)`), the cache grown first if they need it."""
        return round_window(self.cache, new_slots, self._fit, self._can_grow(self.cache))

    def token_inputs(self, tokens: Tensor) -> dict:
        """Decoder inputs of new tokens `[rows, M]` (default: the token ids)."""
        return {"input_ids": tokens}

    def logits(self, hidden: Tensor) -> Tensor:
        if self.vocab is None:
            return self.model.get_output_embeddings()(hidden)
        sub = hidden.to(self.vocab_weight.dtype) @ self.vocab_weight  # [..., N]
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, sub)

    # ------------------------------------------------------------------ Target protocol
    def sync_value(self) -> Tensor:
        """The committed span of the cache (a device scalar), read by the loop with its one read per round."""
        return self.cache.lengths.max()

    def sync_host(self, committed: int) -> None:
        """The loop's read of `sync_value`: the touched span restarts from the committed prefix (rejected drafts of
        the last round no longer count), so the attention window follows the tokens kept without a read of its own,
        also at bucket edges."""
        self.cache.sync_window(committed)

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, lengths: Tensor, num_tokens: int, scratch: int, return_hidden=False,
                return_vision=False, **model_inputs) -> TargetOutput:  # fmt: skip
        """Write every row's prompt (right-padded `input_ids [B, L]`, `lengths [B]`) and return the first token's
        distribution. `model_inputs`: `pixel_values` etc. (the vision tower runs here, once). With guidance on,
        `input_ids` / `lengths` are the model rows (`[cond; uncond]`, `2B`). `return_vision`: also return what the
        decoder received (`inputs_embeds [rows, L, dim]`, the projected image features merged in; recorded during
        this forward, `mmspec.models.hf.inputs`) and `image_mask [rows, L]` (vision-aware drafters); off by
        default, so plain decoding and the other drafters pay nothing.

        Returns:
            `TargetOutput(p_target [B, 1, V], hidden [rows, L, dim] | None, input_ids, lengths, inputs_embeds,
            image_mask)` -- validated.
        """
        rows, width = input_ids.shape
        device = input_ids.device
        # room for the prompt, every new token and the largest scratch forward; allocated in chunks (`run` grows it)
        self.max_slots = width + int(num_tokens) + int(scratch) + 1
        self.buckets = (1, int(scratch))  # captured forwards: every scored block is padded to one of these widths
        chunk = min(self.max_slots, _round_up(width + int(scratch) + 1) + WINDOW_BUCKET)
        # captured: the whole cache at once (a grown cache would change the strides every graph was traced with),
        # on a bucket of sizes (one per 128 slots: the graphs serve the next prompts too)
        self.cache = self.new_cache(rows, captured_cache_slots(self.max_slots) if self.compiler is not None else chunk)
        # a fresh cache has nothing in use: the prompt's span is its width, known on the host (no read)
        self.cache.sync_window(0)
        slots, _, causal = chain_inputs(torch.zeros(rows, dtype=torch.long, device=device), width)
        valid = torch.arange(width, device=device)[None, :] < lengths[:, None]  # [B, L]
        mask = causal & valid[:, None, :]
        # the prompt's positions: the provider's own (M-RoPE: the model's `get_rope_index`), else the slots
        model_inputs = {k: v for k, v in model_inputs.items() if k != "mm_token_type_ids"}  # M-RoPE: from the ids
        prompt_positions = self.positions.prompt(input_ids, lengths, model_inputs)
        with capture_decoder_inputs(self.model) if return_vision else nullcontext({}) as seen, self._aux() as aux:
            hidden = self.run(self.model.model, self.cache, slots, slots, mask, position_ids=prompt_positions,
                              input_ids=input_ids, **model_inputs)  # fmt: skip
        self.cache.commit(lengths)
        last = hidden[torch.arange(rows, device=device), lengths - 1][:, None]  # [B, 1, dim]
        # the target's first token is checked now (once per call); a draft LM's distributions only feed drafts
        # (clamped draws, verified by the target), so off a CPU its check joins the end-of-call flags (`Guidance.check`)
        validate = self.source == "target" or _free_reads(last)
        p = self.guidance.probs(self.logits(last), self.source, validate=validate)
        vision = {}
        if return_vision:
            embeds = seen.get("inputs_embeds")
            if embeds is None or tuple(embeds.shape[:2]) != (rows, width):
                raise RuntimeError(f"{self.source}: the decoder's input embeddings were not recorded at prefill")
            vision = dict(inputs_embeds=embeds, image_mask=image_token_mask(self.model, input_ids) & valid)
        drafter_hidden = hidden if aux is None else self._aux_states(aux)
        return TargetOutput(p, drafter_hidden if return_hidden else None, input_ids=input_ids, lengths=lengths,
                            positions=prompt_positions, **vision)  # fmt: skip

    def _aux(self):
        """Records the `hidden_layers` inputs during a forward (a no-op context without them)."""
        return (
            nullcontext(None) if self.hidden_layers is None else capture_layer_inputs(self.model, self.hidden_layers)
        )

    def _aux_states(self, seen):
        """The recorded `hidden_layers` inputs, concatenated in order `[rows, M, len * dim]`."""
        return torch.cat([seen[i] for i in self.hidden_layers], dim=-1)

    @property
    def bucket_rows(self) -> bool:
        """The target's `forward` pads its items to the cache's row bucket when captured (a draft LM's forwards are
        its drafter's: its cache compacts exactly)."""
        return self.source == "target"

    @torch.no_grad()
    def forward(self, tokens: Tensor, parents: Tensor | None = None, return_hidden: bool = False) -> TargetOutput:
        if self.compiler is not None:  # the cache's items (`select_rows` keeps row buckets when captured)
            tokens, parents = self.pad_items(tokens), self.pad_items(parents)
        if captures_rounds(self.compiler) and self.hidden_layers is None:  # the whole forward as one graph
            width = bucket_width(tokens.shape[1], self.buckets)
            window = self.round_window(width)
            self.compiler.static(self.cache)
            run = self.compiler.forward("target", self.model, scored_forward)  # kept across calls (the model)
            p, hidden, total = run(self, self.cache, self.guidance, tokens, parents, width=width, window=window)
            self.guidance.record(self.source, total)
            return TargetOutput(self.live_items(p), self.live_rows(hidden) if return_hidden else None)
        m = tokens.shape[1]
        # captured: one of two widths (`buckets`), padded nodes in scratch, seen by nothing
        width = None if self.compiler is None else bucket_width(m, self.buckets)
        rows, logical, slots, mask = scored_block(self.cache, self.guidance, tokens, parents, width)
        with self._aux() as aux:
            hidden = self.run(decoder_of(self.model), self.cache, slots, logical, mask, capture=True,
                              **self.token_inputs(rows))[:, :m]  # fmt: skip
        p = self.live_items(self.guidance.probs(self.logits(hidden), self.source))
        if aux is not None:
            hidden = self._aux_states(aux)[:, :m]
        return TargetOutput(p, self.live_rows(hidden) if return_hidden else None)

    def select_state_rows(self, rows: Tensor) -> None:
        self.positions.select_rows(rows)


def scored_block(cache: StaticKVCache, guidance: Guidance, tokens: Tensor, parents: Tensor | None,
                 width: int | None = None):  # fmt: skip
    """The decoder inputs of a scored block (`HFTarget.forward`, `scored_forward`): every model row's tokens (each
    CFG stream scores the same), logical positions, cache slots and mask of a chain (`parents` None) or a tree (a
    tree's ancestry in a fixed number of ops), padded to `width` when given. Returns `(tokens, logical, slots,
    mask)`."""
    lengths, rows = cache.lengths, guidance.rows(tokens)
    if parents is None:
        logical, slots, mask = chain_inputs(lengths, tokens.shape[1])
    else:
        logical, slots, mask = tree_inputs(guidance.rows(parents), lengths)
    if width is None:
        return rows, logical, slots, mask
    return pad_block(width, rows, logical, slots, mask)


def scored_forward(target: HFTarget, cache: StaticKVCache, guidance: Guidance, tokens: Tensor, parents: Tensor | None,
                   *, width: int, window: int):  # fmt: skip
    """`HFTarget.forward` as a pure function of its inputs, for one captured graph (`enable_compile(verify=True)`):
    the block's positions, slots and mask (a tree's ancestry in a fixed number of ops), padded to `width`, the decoder
    on the round's attention `window` of `cache` (`HFTarget.round_window`), the output head and the processing.
    Returns `(p_target, hidden, sum of p_target)` (the sum for `Guidance.record`, which a graph cannot call)."""
    m = tokens.shape[1]
    rows, logical, slots, mask = scored_block(cache, guidance, tokens, parents, width)
    hidden = target.run(decoder_of(target.model), cache, slots, logical, mask, window=window,
                        **target.token_inputs(rows))[:, :m]  # fmt: skip
    p = guidance.process(target.logits(hidden))
    return p, hidden, p.sum()
