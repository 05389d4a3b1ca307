"""Counter-based uniforms for captured graphs: Philox4x32-10 in plain tensor ops.

Paper: Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC'11); the known-answer vectors
of its Random123 release are the tests'. A draw is a pure function of (key, counter): no `torch.Generator` object, no
state to carry, so it traces into a `torch.compile(fullgraph=True)` graph and replays under CUDA graphs like any
other op, and each row's stream depends on its own key only (`mmspec.decoding.captured_verify` with
`enable_compile(verify=True, rng="philox")`: one key per row drawn from the row's generator once per call, the
counter the round's index).

Everything is int64 arithmetic on 32-bit words: the 32 x 32-bit products Philox needs are taken in 16-bit halves, so
no intermediate leaves int64's positive range (no reliance on signed overflow, on any backend).
"""

import torch
from torch import Tensor


__all__ = ["philox4x32", "philox_uniforms", "row_keys"]

MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """`(hi, lo)` 32-bit words of the 64-bit product of 32-bit words `a` (int64 tensor) and the constant `m`: `a`
    times each 16-bit half of `m` stays below 2^48."""
    p = a * (m & 0xFFFF)  # < 2^48
    q = a * (m >> 16)  # < 2^48
    lo = (p + ((q & 0xFFFF) << 16)) & MASK32
    hi = ((p >> 16) + q) >> 16  # floor((p + q * 2^16) / 2^32): < 2^32
    return hi, lo


def philox4x32(counter: Tensor, key: Tensor, rounds: int = 10) -> Tensor:
    """Philox4x32-`rounds` of `counter [..., 4]` under `key [..., 2]` (int64 tensors holding 32-bit words,
    broadcast against each other): `[..., 4]` int64 words."""
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & MASK32, (k1 + _W1) & MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), dim=-1)


def philox_uniforms(keys: Tensor, offset: Tensor, n: int) -> Tensor:
    """`[rows, n]` float64 uniforms on [0, 1) (53 bits each): row `r`'s are Philox blocks `(offset, j)`, j = 0, 1,
    ... under `keys[r]` (`[rows, 2]` int64 words), two uniforms a block. `offset`: a 0-d int64 tensor (< 2^63), the
    draw's index in its stream (a captured round's index): different offsets give independent draws."""
    blocks = (n + 1) // 2
    j = torch.arange(blocks, device=keys.device, dtype=torch.int64)
    offset = offset.to(device=keys.device, dtype=torch.int64)
    zero = torch.zeros_like(j)
    counter = torch.stack([(offset & MASK32).expand(blocks), (offset >> 32).expand(blocks), j, zero], dim=-1)
    words = philox4x32(counter[None], keys[:, None, :])  # [rows, blocks, 4]
    hi, lo = words[..., 0::2] >> 5, words[..., 1::2] >> 6  # 27 + 26 bits
    return ((hi * (1 << 26) + lo).to(torch.float64) / float(1 << 53)).reshape(keys.shape[0], -1)[:, :n]


def row_keys(generator, rows: int, device) -> Tensor:
    """`[rows, 2]` int64 Philox keys: from one `torch.Generator` (rows in order), or row `b`'s from `generator[b]` of
    a per-row list (so a row's stream depends on its own generator only); None draws from torch's default
    generator. One draw per call, eager: it advances the generator(s) as any draw does."""
    high = 1 << 32
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randint(0, high, (rows, 2), generator=generator, device=device, dtype=torch.int64)
    return torch.stack(
        [torch.randint(0, high, (2,), generator=g, device=device, dtype=torch.int64) for g in generator]
    )
