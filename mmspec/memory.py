"""Per-call memory estimate of the token pipelines, checked against the memory the machine has before any forward.

The knob registry (`mmspec.methods`) bounds every knob on its own; their product can still ask for more memory than
the machine has (SJD-PAC width 5 / depth 5 is 780 tree nodes, within bounds, but at batch 64 with CFG its per-round
tensors need tens of GB). Every token pipeline (`SpeculativeARImagePipeline`, `SpeculativeJanusPipeline`,
`SpeculativeVLMPipeline`) calls `check_call_memory` in its check phase, after the drafter is resolved and before the
first target forward: the call is refused with a `MemoryBudgetError` (a `ValueError`) naming the knobs that drive
the estimate, the batch, the estimate and the budget in GiB.

Estimate model (`token_call_terms`; bytes, float32 distributions, `B` = batch items incl. `num_images_per_prompt`,
`R = B * streams` model rows (2 streams with CFG), `M = 1 + drafter.max_width` the widest target forward, `S` the
cache slots per row, `V` the vocabulary):

* KV caches (persistent): `2 * n_layer * R * n_kv_head * S * head_dim * dtype bytes` per model (target, draft model,
  EAGLE head), computed by the caller with `kv_cache_bytes`.
* target logits and distributions: `R * M * V * 4` (logits) + `3 * B * M * V * 4` (guided / processed / softmax).
* attention mask: `R * max(M, L) * S * (1 + 4)` (`L` the prefill's prompt / condition length; the bool visibility
  `[R, M, S]` and the additive float mask fused kernels make of it; a non-fused "eager" attention also builds
  `heads` times that in scores, not counted).
* tree ancestry (tree drafters): `R * M * M` bool (the `[R, M, M]` ancestor mask) + `3 * R * M * 8` (pointers).
* Jacobi window (SJD / SCD / SJD-PAC, window `L`): `6 * B * L * V * 4` (the cached `q` per position, the re-draft's
  `p` / `q` / residual / next `q`).
* SJD-PAC tree (`N` nodes, `P = width ** (depth - 2)` parents at the widest branching level): `3 * B * N * V * 4`
  (node laws) + `B * P * V * (3 * 4 + 1)` (the without-replacement draw's uniforms, keys and mask).
* LANTERN (`relaxed`): the neighbour table `V * k * 8` and its per-node gathers `B * M * k * 8 * 2`.
* GSD (`grouped`): the rank keys `3 * B * M * V * 8` and one chunk of the all-token acceptance
  `4 * max(2 ** 24, V * group_size * d) * 4` (`d`: codebook width).
* draft model (`drafter="model"`): its logits and distributions `2 * R * M * V * 4`; EAGLE (`drafter="eagle"`):
  the head's per-level distributions `3 * B * top_k * V * 4`.

The terms are summed (a conservative peak: not all live at once). Model weights are not counted: they are loaded
already, so the available memory is net of them.

Budget: `MEMORY_MARGIN` (0.9) of the memory available on the call's device now: CUDA `torch.cuda.mem_get_info`
free memory plus what PyTorch's allocator has reserved but not used; CPU `psutil.virtual_memory().available`
(psutil installed) else `MemAvailable` of `/proc/meminfo`; unknown elsewhere (no check). Override with the
environment variable `MMSPEC_MEMORY_BUDGET` (`BUDGET_ENV`): bytes or a size with a unit (`"512MiB"`, `"24GiB"`,
`"2.5GB"`), or `"off"` to skip the check; or pass `budget=` to `check_call_memory` (bytes; `float("inf")` skips).
"""

import logging
import math
import os
import re
from dataclasses import dataclass

import torch


__all__ = [
    "BUDGET_ENV",
    "MEMORY_MARGIN",
    "MemoryBudgetError",
    "Term",
    "available_bytes",
    "hf_kv_cache_bytes",
    "check_call_memory",
    "check_hf_call_memory",
    "check_memory",
    "kv_cache_bytes",
    "memory_budget",
    "parse_size",
    "token_call_terms",
]

logger = logging.getLogger(__name__)

BUDGET_ENV = "MMSPEC_MEMORY_BUDGET"
MEMORY_MARGIN = 0.9  # of the available memory: allocator fragmentation, temporaries the model does not count
GIB = 1024**3
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
F32 = 4


class MemoryBudgetError(ValueError):
    """A call whose estimated memory exceeds the budget (raised before any forward)."""


@dataclass(frozen=True)
class Term:
    """One tensor family of the estimate: `nbytes` and the arguments / knobs it grows with (for the message)."""

    name: str
    nbytes: int
    grows_with: tuple[str, ...] = ()


def kv_cache_bytes(n_layer, rows, n_kv_head, max_seq, head_dim, dtype) -> int:
    """Bytes of one `mmspec.cache.StaticKVCache` (K and V)."""
    return 2 * int(n_layer) * int(rows) * int(n_kv_head) * int(max_seq) * int(head_dim) * _itemsize(dtype)


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else int(dtype)


def token_call_terms(*, batch, streams, vocab, width, cache_slots, kv_bytes, acceptance, drafter, knobs,
                     prefill_tokens=0, codebook_dim=None) -> list[Term]:  # fmt: skip
    """The estimate's terms for one call of a token pipeline (module docstring).

    Args:
        batch: batch items B (prompts x `num_images_per_prompt`); streams: 2 with CFG, else 1.
        vocab: V of the target's distributions; width: `drafter.max_width` (0 without a drafter);
        cache_slots: S, the target cache's slots per row; kv_bytes: the KV caches of the call (`kv_cache_bytes`).
        acceptance, drafter: the resolved method; knobs: the checked knobs (`mmspec.methods.check_knobs`).
        prefill_tokens: the prompt / condition length L of the prefill forward; codebook_dim: GSD's codebook width d.
    """
    b, r, v, s = int(batch), int(batch) * int(streams), int(vocab), int(cache_slots)
    m = 1 + int(width)
    size = _size_knobs(drafter, knobs)
    logits = r * m * v * F32 + 3 * b * m * v * F32
    terms = [
        Term("KV caches", int(kv_bytes), ("batch", "max_new_tokens") + size),
        Term("target logits and distributions [rows, M, V]", logits, ("batch",) + size),
        Term(
            "attention mask [rows, M, cache slots]", r * max(m, int(prefill_tokens)) * s * (1 + F32), ("batch",) + size
        ),
    ]
    tree = drafter in ("eagle", "model") and (knobs.get("tree_top_k") or 1) > 1
    if tree or (drafter == "jacobi" and knobs.get("jacobi_tree_width", 1) > 1):
        terms.append(Term("tree ancestry [rows, M, M]", r * m * m + 3 * r * m * 8, ("batch",) + size))
    if drafter == "jacobi":
        window = knobs["jacobi_window"]
        terms.append(
            Term("Jacobi window distributions [B, L, V]", 6 * b * window * v * F32, ("batch", "jacobi_window"))
        )
        branch, depth = knobs.get("jacobi_tree_width", 1), knobs.get("jacobi_tree_depth", 2)
        if branch > 1:
            parents = branch ** max(depth - 2, 0)
            nbytes = 3 * b * int(width) * v * F32 + b * parents * v * (3 * F32 + 1)
            terms.append(Term("SJD-PAC node laws and sibling draws [B, nodes, V]", nbytes, ("batch",) + size))
    elif drafter == "model":
        terms.append(Term("draft model logits [rows, K, V]", 2 * r * m * v * F32, ("batch", "num_draft_tokens")))
    elif drafter == "eagle":
        top_k = knobs.get("tree_top_k") or 1
        terms.append(Term("EAGLE head distributions [B, top_k, V]", 3 * b * top_k * v * F32, ("batch", "tree_top_k")))
    if acceptance == "relaxed":
        k = min(knobs.get("relaxation_top_k", 0), max(v - 1, 0))
        nbytes = v * k * 8 + 2 * b * m * k * 8
        terms.append(Term("LANTERN neighbours [V, k] and gathers", nbytes, ("relaxation_top_k", "batch")))
    if acceptance == "grouped":
        g, d = knobs.get("group_size", 1), int(codebook_dim or 1)
        nbytes = 3 * b * m * v * 8 + 4 * max(2**24, v * g * d) * F32
        terms.append(Term("GSD rank keys [B, M, V] and group windows", nbytes, ("group_size", "batch")))
    return terms


def _size_knobs(drafter, knobs):
    """The knobs that set the width of the target forward for `drafter`."""
    if drafter == "jacobi":
        if knobs.get("jacobi_tree_width", 1) > 1:
            return ("jacobi_tree_width", "jacobi_tree_depth", "jacobi_window")
        return ("jacobi_window",)
    if drafter in ("eagle", "model"):
        tree = (knobs.get("tree_top_k") or 1) > 1
        if tree:
            return ("tree_nodes", "tree_depth", "tree_top_k")
        return ("tree_depth",) if drafter == "eagle" else ("num_draft_tokens",)
    return ()


# ---------------------------------------------------------------------- budget
def parse_size(text) -> float:
    """`"512MiB"`, `"24GiB"`, `"2.5GB"`, `"1e9"` -> bytes; `"off"` / `"none"` / `"inf"` -> inf (no check)."""
    value = str(text).strip().lower().replace(" ", "")
    if value in ("off", "none", "inf", "unlimited"):
        return math.inf
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([a-z]*)", value)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"{BUDGET_ENV} must be a size such as 8GiB, 512MiB or 4e9 bytes, or 'off', got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def available_bytes(device) -> tuple[float | None, str]:
    """`(bytes available now, where the figure comes from)` on `device`; `(None, reason)` where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # PyTorch reuses these
        return float(free + idle), f"free memory of {device} (torch.cuda.mem_get_info)"
    if device.type == "cpu":
        try:
            import psutil
        except ImportError:
            psutil = None
        if psutil is not None:
            return float(psutil.virtual_memory().available), "available CPU memory (psutil)"
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return float(line.split()[1]) * 1024, "available CPU memory (/proc/meminfo MemAvailable)"
        except OSError:
            pass
    return None, f"the available memory of {device} is unknown"


def memory_budget(device, budget=None) -> tuple[float, str]:
    """`(bytes, description)`: `budget` if given, else `$MMSPEC_MEMORY_BUDGET`, else `MEMORY_MARGIN` of
    `available_bytes(device)` (inf where unknown)."""
    if budget is not None:
        return float(budget), "the budget argument"
    env = os.environ.get(BUDGET_ENV)
    if env:
        return parse_size(env), f"${BUDGET_ENV}"
    avail, source = available_bytes(device)
    if avail is None:
        return math.inf, source
    return avail * MEMORY_MARGIN, f"{MEMORY_MARGIN:.0%} of the {source}; set ${BUDGET_ENV} to override"


def _gib(nbytes) -> str:
    gib = nbytes / GIB
    return f"{gib:.2f} GiB" if gib >= 0.1 or gib == 0 else f"{gib:.2g} GiB"


def check_memory(terms, device, *, settings, budget=None) -> int:
    """Raise `MemoryBudgetError` if the sum of `terms` exceeds the budget (`memory_budget`); returns the estimate.

    `settings` maps the argument / knob names of the call to their values; the message names the ones the three
    largest terms grow with, with their values."""
    total = sum(t.nbytes for t in terms)
    limit, source = memory_budget(device, budget)
    if total <= limit:
        logger.debug("memory estimate %s within the budget %s (%s)", _gib(total), _gib(limit), source)
        return total
    largest = sorted(terms, key=lambda t: -t.nbytes)[:3]
    names = []
    for term in largest:
        names += [n for n in term.grows_with if n in settings and n not in names]
    knobs = ", ".join(f"{n}={settings[n]!r}" for n in names)
    parts = "; ".join(f"{t.name} {_gib(t.nbytes)}" for t in largest)
    raise MemoryBudgetError(
        f"this call needs an estimated {_gib(total)} ({parts}), more than the memory budget {_gib(limit)} ({source}): "
        f"{knobs}. Lower these, or run on a device with more memory."
    )


def check_call_memory(*, device, batch, streams, vocab, width, cache_slots, kv_bytes, acceptance, drafter, knobs,
                      prefill_tokens=0, codebook_dim=None, num_images_per_prompt=None, settings=None,
                      budget=None) -> int:  # fmt: skip
    """`token_call_terms` + `check_memory` for one pipeline call: the pipelines' single memory check (before the
    first forward). `batch` counts every row the call generates (prompts x `num_images_per_prompt`); the message
    shows it as `batch=B x2 CFG rows`; `settings`: more arguments to name (e.g. `max_new_tokens`). Returns the
    estimate in bytes."""
    terms = token_call_terms(batch=batch, streams=streams, vocab=vocab, width=width, cache_slots=cache_slots,
                             kv_bytes=kv_bytes, acceptance=acceptance, drafter=drafter, knobs=knobs,
                             prefill_tokens=prefill_tokens, codebook_dim=codebook_dim)  # fmt: skip
    settings = {**knobs, **(settings or {})}
    settings["batch"] = _BatchText(batch, streams, num_images_per_prompt)
    return check_memory(terms, device, settings=settings, budget=budget)


def hf_kv_cache_bytes(model, rows, max_seq) -> int:
    """Bytes of the `StaticKVCache` `mmspec.models.hf.HFTarget` allocates for a transformers `model` (its text
    config's layers, key/value heads and head size; the output head's dtype)."""
    t = model.config.get_text_config()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    n_kv = getattr(t, "num_key_value_heads", None) or t.num_attention_heads
    dtype = model.get_output_embeddings().weight.dtype
    return kv_cache_bytes(t.num_hidden_layers, rows, n_kv, max_seq, head_dim, dtype)


def check_hf_call_memory(target, draft, *, batch, prompt_tokens, num_tokens, acceptance, drafter, knobs,
                         draft_model=None, codebook_dim=None, num_images_per_prompt=None, settings=None,
                         device=None, budget=None) -> int:  # fmt: skip
    """`check_call_memory` for a pipeline over an `mmspec.models.hf.HFTarget` (Janus, VLMs): the cache sizes from
    the models' configs (`prompt_tokens` + `num_tokens` + the drafter's scratch slots), the target's and (`drafter=
    "model"`) the draft LM's; `draft` is the engine drafter (None: plain decoding); `device`: where the call runs
    (the pipeline's execution device; default: the target's output head's)."""
    width = draft.max_width if draft is not None else 0
    rows = int(batch) * target.guidance.streams
    slots = int(prompt_tokens) + int(num_tokens) + width + 2
    kv = hf_kv_cache_bytes(target.model, rows, slots)
    if draft_model is not None:
        kv += hf_kv_cache_bytes(draft_model, rows, slots)
    device = target.model.get_output_embeddings().weight.device if device is None else device
    return check_call_memory(device=device, batch=batch, streams=target.guidance.streams, vocab=target.vocab_size,
                             width=width, cache_slots=slots, kv_bytes=kv, acceptance=acceptance, drafter=drafter,
                             knobs=knobs, prefill_tokens=prompt_tokens, codebook_dim=codebook_dim,
                             num_images_per_prompt=num_images_per_prompt, settings=settings,
                             budget=budget)  # fmt: skip


class _BatchText:
    """`batch=64 (x2 CFG rows)` in messages."""

    def __init__(self, batch, streams, per_prompt):
        self.text = str(int(batch))
        if per_prompt is not None and per_prompt > 1:
            self.text += f" ({int(batch) // int(per_prompt)} prompts x num_images_per_prompt={per_prompt})"
        if streams > 1:
            self.text += f" x{streams} CFG rows"

    def __repr__(self):
        return self.text
