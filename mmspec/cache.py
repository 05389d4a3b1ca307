"""Static (gpt-fast style) KV cache with per-row lengths, plus the chain / token-tree input helpers.

One `StaticKVCache` serves a whole model: K and V are preallocated as `[n_layer, rows, n_kv_head, max_seq, head_dim]`
and every row `r` has a committed length `lengths[r]`. Slots `< lengths[r]` are the row's committed history; slots
`>= lengths[r]` are scratch that a forward may write (draft chains, token trees, padding of finished rows) and that
is simply ignored afterwards unless committed. Nothing is ever cropped or copied on rollback:

* rollback: `cache.lengths = old_lengths` (or `cache.rollback(old_lengths)`);
* commit a chain of `n[r]` tokens written at `lengths[r] + 0 .. n[r]-1`: `cache.commit(n)`;
* commit an accepted tree path: `cache.commit_path(path, path_len)` gathers the K/V of the path's nodes (written at
  `lengths[r] + node`) into the contiguous slots `lengths[r] + 0, 1, ...` and advances the lengths.

Conventions shared by the models (`mmspec.models.llamagen.gpt.LlamaGenGPT`, `mmspec.models.llamagen.eagle.EagleHead`):

* rows: with classifier-free guidance the rows are `[cond rows; uncond rows]` (2B rows, row `b` and `B + b` hold the
  same tokens); every row has its own length, so rows of one batch can be at different lengths in the same forward.
* a forward over `M` new tokens takes `input_pos [rows, M]` (RoPE positions), `write_slots [rows, M]` (cache slots,
  default `input_pos`) and `attention_mask [rows, M, M]` (bool, True = query i may attend to new token j). A query
  always also sees the committed prefix of its row (`slot < lengths[r]` and `key_valid[r, slot]`).
* trees are given as `parents [rows, M]` in topological order (`parents[r, i] < i`; `-1` = attached to the committed
  prefix). Node `i` is written at slot `lengths[r] + i` and has RoPE position `lengths[r] + depth(i)` where
  `depth(i) = 0` for a node with parent `-1`. It attends to the committed prefix, its ancestors and itself. A chain is
  the tree with `parents = [-1, 0, 1, ..., M-2]`.

`key_valid [rows, max_seq]` is True everywhere except at padded condition slots (LlamaGen t2i: left-padded text
features, `emb_mask == False`), which are never attended to by any later query.
"""

import logging

import torch

from mmspec.counting import host_checks_enabled


logger = logging.getLogger(__name__)


class StaticKVCache:
    """Preallocated per-layer K/V for `rows` sequences of at most `max_seq` slots.

    Args:
        n_layer: number of attention layers that share this cache (layer `l` uses `k[l]`, `v[l]`).
        rows: number of sequences (2B with classifier-free guidance: `[cond rows; uncond rows]`).
        n_kv_head: key/value heads per layer.
        max_seq: slots per row; allocate condition length + image tokens + the largest scratch forward (draft tree
            or chain size), since scratch writes go to `lengths[r] + i` even for finished rows.
        head_dim: per-head dimension.
        dtype, device: storage dtype/device (use the model's).
    """

    def __init__(self, n_layer, rows, n_kv_head, max_seq, head_dim, *, dtype=torch.float32, device=None):
        for name, value in (("n_layer", n_layer), ("rows", rows), ("n_kv_head", n_kv_head), ("max_seq", max_seq)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        shape = (n_layer, rows, n_kv_head, max_seq, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.key_valid = torch.ones(rows, max_seq, dtype=torch.bool, device=device)

    # ------------------------------------------------------------------ shape info
    @property
    def rows(self):
        return self.k.shape[1]

    @property
    def max_seq(self):
        return self.k.shape[3]

    @property
    def device(self):
        return self.k.device

    @property
    def dtype(self):
        return self.k.dtype

    def reset(self):
        """Forget every row (lengths 0, all slots valid). K/V storage is left as is: it is scratch."""
        self.lengths.zero_()
        self.key_valid.fill_(True)
        return self

    def clone(self):
        """A deep copy (for tests / branching)."""
        new = object.__new__(StaticKVCache)
        new.k, new.v = self.k.clone(), self.v.clone()
        new.lengths, new.key_valid = self.lengths.clone(), self.key_valid.clone()
        return new

    # ------------------------------------------------------------------ writing (used by the models)
    def check_slots(self, write_slots, values=True):
        """Raise ValueError if `write_slots [rows, M]` has the wrong shape or (with `values`: one host sync) points
        outside `[0, max_seq)`."""
        if write_slots.dim() != 2 or write_slots.shape[0] != self.rows:
            raise ValueError(f"write_slots must be [rows={self.rows}, M], got {tuple(write_slots.shape)}")
        if (
            values
            and host_checks_enabled(write_slots.device)
            and not torch.compiler.is_compiling()
            and write_slots.numel()
        ):
            lo, hi = int(write_slots.min()), int(write_slots.max())
            if lo < 0 or hi >= self.max_seq:
                raise ValueError(
                    f"write_slots out of range [0, {self.max_seq}) (got min {lo}, max {hi}); "
                    "allocate the cache with more max_seq slack for scratch writes"
                )

    def update(self, layer, write_slots, k_new, v_new):
        """Write `k_new, v_new [rows, n_kv_head, M, head_dim]` at `write_slots [rows, M]` of `layer`; return the
        layer's full K, V `[rows, n_kv_head, max_seq, head_dim]` (views into the cache).

        When every row writes the same contiguous slots `s .. s + M - 1` (a 1-token step at equal lengths, batch 1
        chains, prefill) the write is one slice copy (`contiguous_run`, decided once per `write_slots` tensor);
        otherwise one `index_put` of every `(row, slot)`. Both write exactly the same values."""
        k_layer, v_layer = self.k[layer], self.v[layer]
        k_new, v_new = k_new.to(k_layer.dtype), v_new.to(v_layer.dtype)  # no copy when the dtypes agree
        start = self._run_start(write_slots)
        stop = None if start is None else start + write_slots.shape[1]
        if start is not None and start >= 0 and stop <= self.max_seq:  # else index_put (its errors, its wrap-around)
            k_layer[:, :, start:stop] = k_new
            v_layer[:, :, start:stop] = v_new
            return k_layer, v_layer
        rows = torch.arange(write_slots.shape[0], device=write_slots.device)[:, None].expand_as(write_slots)
        # index_put on the [rows, slots, heads, hd] view (2-3x faster than a 4-D scatter_ for M > 1 on CPU)
        k_layer.transpose(1, 2)[rows, write_slots] = k_new.transpose(1, 2)
        v_layer.transpose(1, 2)[rows, write_slots] = v_new.transpose(1, 2)
        return k_layer, v_layer

    def _run_start(self, write_slots):
        """`contiguous_run(write_slots)`, remembered for the tensor (and its version) last asked about: every layer
        of a forward writes the same `write_slots`, so the check runs once per forward, not once per layer. While
        compiling there is no run (`contiguous_run` reads the slots on the host) and no memo: its `_version` guard
        would break the graph at every layer."""
        if torch.compiler.is_compiling():
            return None
        memo = getattr(self, "_run_memo", None)
        if memo is not None and memo[0] is write_slots and memo[1] == write_slots._version:
            return memo[2]
        start = contiguous_run(write_slots)
        self._run_memo = (write_slots, write_slots._version, start)
        return start

    def visibility(self, key_slots, key_mask):
        """Full boolean mask `[rows, M, max_seq]` for `M` queries.

        Each query sees the committed, valid prefix of its row, plus uncommitted slot `key_slots[r, j]` iff
        `key_mask[r, i, j]`. For a forward over `M` new tokens, `key_slots` are their write slots and `key_mask` the
        `[rows, M, M]` new-token mask; `key_slots` may also list slots written by earlier forwards (`[rows, K]`,
        `key_mask [rows, M, K]`).
        """
        rows, k = key_slots.shape
        m = key_mask.shape[1]
        if tuple(key_mask.shape) != (rows, m, k) or key_mask.dtype != torch.bool:
            raise ValueError(
                f"key_mask must be bool [rows={rows}, M, K={k}], got {key_mask.dtype} {tuple(key_mask.shape)}"
            )
        slots = torch.arange(self.max_seq, device=self.device)
        committed = (slots[None, :] < self.lengths[:, None]) & self.key_valid  # [rows, S]
        mask = committed[:, None, :].expand(rows, m, self.max_seq).clone()
        mask.scatter_(2, key_slots[:, None, :].expand(rows, m, k), key_mask)
        return mask

    def sync_window(self, committed: int) -> None:
        """Restart the host-side bound of the slots in use (`touched_bound`, kept by the transformers adapter's
        `slots_needed`) from `committed`, a span its owner knows on the host (the loop's one read per round, or 0
        for a fresh cache): from then on the bound is trusted without a read of the device."""
        self.touched_bound, self.host_synced = int(committed), True

    def select_rows(self, index):
        """Keep only rows `index [R']` (e.g. to drop finished sequences from later forwards); copies the storage."""
        self.k, self.v = self.k[:, index], self.v[:, index]
        self.lengths, self.key_valid = self.lengths[index], self.key_valid[index]
        return self

    # ------------------------------------------------------------------ commit / rollback
    def rollback(self, lengths):
        """Set the committed lengths back to `lengths [rows]` (a tensor or int). Nothing else changes."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.device).expand(self.rows)
        self.lengths = lengths.clone()
        return self

    def commit(self, num_tokens):
        """Commit `num_tokens [rows]` (or an int) tokens that were written contiguously at `lengths[r] + 0, 1, ...`."""
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.long, device=self.device).expand(self.rows)
        self.lengths = self.lengths + num_tokens
        return self

    def commit_path(self, path, path_len):
        """Commit an accepted tree path.

        Args:
            path: `[rows, P]` node indices (into the last tree forward, whose node `i` was written at slot
                `lengths[r] + i`) from the first accepted node to the last, increasing along the path. Entries at
                `j >= path_len[r]` are ignored.
            path_len: `[rows]` number of accepted nodes per row (0 for rows that commit nothing, e.g. finished rows).

        The K/V of node `path[r, j]` is copied to slot `lengths[r] + j` in every layer, then `lengths += path_len`.
        """
        path = torch.as_tensor(path, device=self.device).long()
        path_len = torch.as_tensor(path_len, dtype=torch.long, device=self.device).expand(self.rows)
        if path.dim() != 2 or path.shape[0] != self.rows:
            raise ValueError(f"path must be [rows={self.rows}, P], got {tuple(path.shape)}")
        p = path.shape[1]
        if p == 0:
            return self
        j = torch.arange(p, device=self.device)
        keep = j[None, :] < path_len[:, None]
        src = self.lengths[:, None] + torch.where(keep, path, j[None, :])  # ignored entries copy onto themselves
        dst = self.lengths[:, None] + j[None, :]
        self.check_slots(src)
        self.check_slots(dst)
        n_layer, rows, n_kv, _, hd = self.k.shape
        index_src = src[None, :, None, :, None].expand(n_layer, rows, n_kv, p, hd)
        index_dst = dst[None, :, None, :, None].expand(n_layer, rows, n_kv, p, hd)
        for store in (self.k, self.v):
            gathered = store.gather(3, index_src)  # gather everything first: no read-after-write hazards
            store.scatter_(3, index_dst, gathered)
        self.lengths = self.lengths + path_len
        return self


class ConcatKV:
    """Training-time stand-in for a one-layer `StaticKVCache` (the EAGLE heads' `forward_unrolled` /
    `unrolled_steps`): `update` appends the new keys/values along the slot axis out of place, so autograd flows
    through every step, and returns all of them; there are no slots (`write_slots` is ignored), lengths or masks.
    A transformers layer takes it wrapped in `mmspec.models.hf.target.StaticCache`."""

    def __init__(self):
        self.k, self.v = None, None

    def update(self, layer, write_slots, k_new, v_new):
        """Append `k_new` / `v_new [rows, n_kv_head, M, head_dim]`; returns every key and value so far."""
        self.k = k_new if self.k is None else torch.cat([self.k, k_new], dim=2)
        self.v = v_new if self.v is None else torch.cat([self.v, v_new], dim=2)
        return self.k, self.v


def contiguous_run(write_slots):
    """`s` if every row of `write_slots [rows, M]` is `s, s + 1, ..., s + M - 1` (the same slots in every row), else
    None. Decided only where reading the slots on the host is free (CPU tensors, not while compiling): elsewhere
    None, so an accelerator never syncs for it and takes the general write."""
    if not host_checks_enabled(write_slots.device) or torch.compiler.is_compiling() or write_slots.numel() == 0:
        return None
    first = write_slots[:1, :1]
    run = first + torch.arange(write_slots.shape[1], dtype=write_slots.dtype)[None, :]
    return int(first) if torch.equal(write_slots, run.expand_as(write_slots)) else None


# ---------------------------------------------------------------------- input helpers
def chain_inputs(lengths, num_tokens):
    """Positions, write slots and mask for a causal chain of `num_tokens` new tokens after `lengths [rows]`.

    Returns:
        `(input_pos [rows, M], write_slots [rows, M], attention_mask [rows, M, M])`.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    offsets = torch.arange(num_tokens, device=lengths.device)
    input_pos = lengths[:, None] + offsets[None, :]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=lengths.device).tril()
    return input_pos, input_pos.clone(), causal.expand(lengths.shape[0], -1, -1)


def forward_inputs(lengths, shape, input_pos, write_slots, attention_mask, cache_mask, device):
    """A cached forward's `(input_pos, write_slots, attention_mask)` for input ids of `shape (rows, M)`, with the
    defaults filled in: without `input_pos`, a causal chain after `lengths` (`chain_inputs`; its slots and mask unless
    given); without `write_slots`, `input_pos`; without `attention_mask` and `cache_mask`, causal among the M new
    tokens (`[rows, M, M]` on `device`). A given `cache_mask` leaves `attention_mask` as it is."""
    rows, num_tokens = shape
    if input_pos is None:
        input_pos, default_slots, default_mask = chain_inputs(lengths, num_tokens)
        write_slots = default_slots if write_slots is None else write_slots
        if attention_mask is None and cache_mask is None:
            attention_mask = default_mask
    if write_slots is None:
        write_slots = input_pos
    if attention_mask is None and cache_mask is None:
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()
        attention_mask = causal.expand(rows, num_tokens, num_tokens)
    return input_pos, write_slots, attention_mask


def check_parents(parents):
    """Raise ValueError unless `parents [rows, M]` is a topologically ordered forest (`-1 <= parents[r, i] < i`)."""
    if parents.dim() != 2:
        raise ValueError(f"parents must be [rows, M], got shape {tuple(parents.shape)}")
    idx = torch.arange(parents.shape[1], device=parents.device)
    # an accelerator: a host read; inside a captured graph, a break (the engine's layouts are its own)
    if not host_checks_enabled(parents.device) or torch.compiler.is_compiling():
        return
    if parents.numel() and bool(((parents < -1) | (parents >= idx[None, :])).any()):
        raise ValueError("parents must satisfy -1 <= parents[r, i] < i (topological order, -1 = committed prefix)")


def tree_ancestry(parents, max_depth=None):
    """Depths `[rows, M]` and ancestor-or-self mask `[rows, M, M]` (mask[r, i, j]: j is i or an ancestor of i).

    Memory: the `[rows, M, M]` bool result plus `O(rows * M)` per step -- never an `M x M` intermediate per row
    beyond the result (an earlier version built an int64 one-hot of `[rows, M, M]` per level, 10x the result).

    Args:
        parents: `[rows, M]` topologically ordered forest (`check_parents`).
        max_depth: an upper bound on every node's depth (0 for a child of the prefix; e.g. from the knobs): then
            exactly `max_depth` vectorised steps; None: `ceil(log2(M))` pointer-doubling steps (a fixed
            number of device ops for any tree). Never a host read. Nodes deeper than `max_depth` would get a wrong
            depth: pass a true bound.
    """
    check_parents(parents)
    rows, m = parents.shape
    device = parents.device
    mask = torch.eye(m, dtype=torch.bool, device=device).expand(rows, m, m).clone()
    depth = torch.zeros(rows, m, dtype=torch.long, device=device)
    self_index = torch.arange(m, device=device).expand(rows, m)
    # Chase every node's ancestors one level per step: `ancestor` is the ancestor at distance d (or -1), so the loop
    # runs max-depth times (a few), not once per node. Each step marks mask[r, i, ancestor[r, i]] with one scatter
    # (rows whose chain has ended mark their own, already True, diagonal).
    if max_depth is None:
        return _ancestry_by_doubling(parents, mask)
    ancestor = parents.clone()
    for _ in range(max_depth):
        found = ancestor >= 0  # [rows, M]
        mask.scatter_(2, torch.where(found, ancestor, self_index)[..., None], True)
        depth += found.long()
        ancestor = torch.where(found, parents.gather(1, ancestor.clamp(min=0)), -1)
    return depth, mask


def _ancestry_by_doubling(parents, mask):
    """`tree_ancestry` without a depth bound, in `ceil(log2(M))` pointer-doubling steps (a fixed number of device
    ops for any tree, no host read): `up` is each node's ancestor at distance `2^k` (saturating at its topmost
    ancestor, or itself for a root), and `mask[i] |= mask[up[i]]` extends the ancestors covered from distances
    `< 2^k` to `< 2^(k+1)`; a saturated pointer only adds true ancestors. Peak memory: the `[rows, M, M]` bool
    result plus one gathered copy of it."""
    rows, m = parents.shape
    device = parents.device
    self_index = torch.arange(m, device=device).expand(rows, m)
    up = torch.where(parents >= 0, parents, self_index)
    # depth by the same doubling on [rows, M] vectors (`mask.sum` would make an int64 copy of the whole mask):
    # `depth[i]` counts the ancestors within distance `< 2^k` of i, `jump[i]` is the ancestor at distance 2^k or -1
    depth, jump = (parents >= 0).long(), parents
    for _ in range(max(m - 1, 1).bit_length()):
        mask |= mask.gather(1, up[..., None].expand(rows, m, m))  # rows of mask at `up` (expanded: no copy)
        up = up.gather(1, up)
        has = jump >= 0
        depth = depth + torch.where(has, depth.gather(1, jump.clamp(min=0)), 0)
        jump = torch.where(has, jump.gather(1, jump.clamp(min=0)), -1)
    return depth, mask


def tree_inputs(parents, lengths, max_depth=None):
    """Positions, write slots and mask to score a token tree in one forward.

    Args:
        parents: `[rows, M]` parent index of each node (`-1` = child of the last committed token), topological order.
        lengths: `[rows]` committed cache lengths.
        max_depth: optional bound on node depths (`tree_ancestry`: a fixed number of steps, no host read).

    Returns:
        `(input_pos, write_slots, attention_mask)`: node `i` has RoPE position `lengths + depth(i)`, is written at
        slot `lengths + i`, and attends to its ancestors and itself (plus the committed prefix, added by the model).
    """
    parents = torch.as_tensor(parents).long()
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=parents.device)
    depth, mask = tree_ancestry(parents, max_depth)
    input_pos = lengths[:, None] + depth
    write_slots = lengths[:, None] + torch.arange(parents.shape[1], device=parents.device)[None, :]
    return input_pos, write_slots, mask


def path_to_leaf(parents, leaf):
    """Root-to-leaf node indices of `leaf [rows]` in a tree given by `parents [rows, M]`.

    Returns:
        `(path [rows, D], path_len [rows])` with `D` = max depth + 1; entries past `path_len` are 0. Rows whose
        `leaf` is `-1` get `path_len = 0`. The result feeds `StaticKVCache.commit_path` directly.
    """
    parents = torch.as_tensor(parents).long()
    leaf = torch.as_tensor(leaf, dtype=torch.long, device=parents.device)
    rows, m = parents.shape
    ar = torch.arange(rows, device=parents.device)
    nodes = [leaf]
    cur = leaf
    for _ in range(m):
        cur = torch.where(cur >= 0, parents[ar, cur.clamp(min=0)], cur)
        if not bool((cur >= 0).any()):
            break
        nodes.append(cur)
    stacked = torch.stack(nodes[::-1], dim=1)  # [rows, D], left-padded with -1
    path_len = (stacked >= 0).sum(1)
    # shift each row left so that its path starts at column 0
    d = stacked.shape[1]
    shift = d - path_len
    cols = (torch.arange(d, device=parents.device)[None, :] + shift[:, None]).clamp(max=d - 1)
    path = stacked.gather(1, cols)
    path = torch.where(torch.arange(d, device=parents.device)[None, :] < path_len[:, None], path, 0)
    return path, path_len


def prepend_root(root_tokens, tokens, parents):
    """Verification tree = `[root] + draft nodes`: returns `(tokens [B, N+1], parents [B, N+1])` with the root at
    index 0 (parent -1) and every draft node shifted by one (children of the root point at 0)."""
    root_tokens = root_tokens.reshape(-1, 1).to(tokens.dtype)
    shifted = torch.where(parents >= 0, parents + 1, torch.zeros_like(parents))
    return (torch.cat([root_tokens, tokens], dim=1), torch.cat([torch.full_like(parents[:, :1], -1), shifted], dim=1))
