"""`Resampler(num_queries, num_heads)`: learned-query cross-attention over one image's tokens (Q-Former-like) —
ViSpec's vision adaptor (Kang et al., NeurIPS 2025: `ImgAdaptor`, 2 queries by default) and the resampler expert of
SpecVLM's elastic compressor (arXiv 2509.11815: 2 queries is the sweet spot).

`Q` learned queries `[Q, dim]` (~ N(0, dim^-0.5)) attend, non-causally, over the image's tokens through k / v
projections (no RoPE on K: the image's order is in the tokens themselves), then an output projection:
`A = o_proj(SDPA(queries, k_proj(E), v_proj(E)))`, `[Q, dim]` per image. The queries enter directly (no q
projection: it would only multiply a learned matrix by learned vectors).

- `global_vector=False`: the Q tokens sit at the LAST Q positions of the image's span.
- `global_vector=True` (ViSpec): `A[:Q-1]` at the last Q-1 positions; `A[Q-1]` is the image's global vector
  (`VisionTokens.global_vec` holds the row's last image's; ViSpec fuses it into every later text position).

Images of different sizes (`compress_ragged`): the same queries attend over each image's own tokens (a key mask over
the padding); an image shorter than the kept tokens keeps as many as it has, at all its positions.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmspec.compressors.base import ImageBatch, VisionPolicy
from mmspec.compressors.ragged import RaggedImages


__all__ = ["Resampler"]


def _int_arg(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


class Resampler(VisionPolicy):
    """Learned-query cross-attention: `num_queries` tokens per image (`num_queries - 1` and a global vector with
    `global_vector=True`); `num_queries * dim + 3 * dim * (dim + 1)` parameters.

    Args:
        num_queries: learned queries, 1..tokens_per_image (2.. with `global_vector`).
        num_heads: attention heads; must divide `dim`.
        global_vector: ViSpec's layout (the last query's output is the global image vector).
        generator: draws the initial weights (no global RNG).
    """

    def __init__(
        self,
        num_queries: int = 2,
        num_heads: int = 1,
        global_vector: bool = False,
        tokens_per_image: int = 64,
        dim: int = 576,
        generator: torch.Generator | None = None,
    ):
        if dim is None:
            raise ValueError("dim is required for Resampler (its weights are dim wide)")
        super().__init__(tokens_per_image, dim)
        if not isinstance(global_vector, bool):
            raise TypeError(f"global_vector must be a bool, got {type(global_vector).__name__}")
        self.num_queries = _int_arg("num_queries", num_queries, 2 if global_vector else 1, tokens_per_image)
        self.num_heads = _int_arg("num_heads", num_heads, 1, dim)
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide dim={dim}")
        self.global_vector = self.has_global = global_vector
        self.keep = num_queries - 1 if global_vector else num_queries
        self.queries = nn.Parameter(torch.empty(num_queries, dim))  # [Q, dim]
        self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, device="meta") for _ in range(3))
        for proj in (self.k_proj, self.v_proj, self.o_proj):
            proj.to_empty(device="cpu")
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Queries and projection weights ~ N(0, dim^-0.5) (variance-preserving), zero biases."""
        std = self.dim**-0.5
        nn.init.normal_(self.queries, 0.0, std, generator=generator)
        for proj in (self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(proj.weight, 0.0, std, generator=generator)
            nn.init.zeros_(proj.bias)

    def _attend(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """`tokens [N, T, dim]` (`mask [N, T]`: the keys each image's queries see) -> `[N, Q, dim]`."""
        if tokens.dtype != self.queries.dtype or tokens.device != self.queries.device:
            raise TypeError(
                f"image.tokens is {tokens.dtype} on {tokens.device}, Resampler's weights {self.queries.dtype} on "
                f"{self.queries.device}: move the policy with .to()"
            )
        n, t, dim = tokens.shape
        h, q = self.num_heads, self.num_queries
        head = dim // h
        query = self.queries.reshape(1, q, h, head).transpose(1, 2).expand(n, h, q, head)  # [N, h, Q, head]
        key = self.k_proj(tokens).reshape(n, t, h, head).transpose(1, 2)  # [N, h, T, head]
        value = self.v_proj(tokens).reshape(n, t, h, head).transpose(1, 2)  # [N, h, T, head]
        keys = None if mask is None else mask[:, None, None, :]  # [N, 1, 1, T]
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=keys)  # [N, h, Q, head], non-causal
        return self.o_proj(attended.transpose(1, 2).reshape(n, q, dim))  # [N, Q, dim]

    def kept(self, length: int, grid=None) -> int:
        return min(self.keep, length)

    def compress_ragged(self, images: RaggedImages, generator=None) -> tuple[Tensor, Tensor, Tensor | None]:
        out = self._attend(images.tokens, images.mask)  # [N, Q, dim]
        k, device = self.keep, images.tokens.device
        # image j's kept tokens at its last kept_j positions: index length_j - kept_j + q
        first = torch.tensor([n - self.kept(n) for n in images.lengths], dtype=torch.long, device=device)  # [N]
        last = max(images.positions.shape[1] - 1, 0)
        index = (first[:, None] + torch.arange(k, device=device)[None]).clamp(max=last)  # [N, keep]
        kept_positions = images.positions.gather(1, index) if k else images.positions[:, :0]  # [N, keep]
        if self.global_vector:
            return out[:, :k], kept_positions, out[:, k]  # [N, Q-1, dim], [N, Q-1], [N, dim]
        return out, kept_positions, None

    def compress(self, images: ImageBatch, generator=None) -> tuple[Tensor, Tensor, Tensor | None]:
        tokens, positions = images.tokens, images.positions  # [N, T, dim], [N, T]
        out = self._attend(tokens)
        t = tokens.shape[1]
        k = self.keep
        kept_positions = positions[:, t - k :]  # [N, keep] the span's last positions
        if self.global_vector:
            return out[:, :k], kept_positions, out[:, k]  # [N, Q-1, dim], [N, Q-1], [N, dim]
        return out, kept_positions, None
