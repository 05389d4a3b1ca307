"""The draft side's vision-token seam: what a vision policy receives (`VisionTokens`, a VLM target's projected image
embeddings `E_img` gathered per row, each token with the target's RoPE position) and the `VisionPolicy` base class
that turns them into the few tokens the draft keeps.

A policy runs once, at drafter prefill, on the draft side only: the target still reads every image token, so
speculative decoding stays lossless whichever tokens the draft keeps. Every kept token takes one of its image's
target positions (ViSpec, Kang et al., NeurIPS 2025, puts its compressed tokens at the end of the image span;
SpecVLM, arXiv 2509.11815, prunes / pools / convolves / resamples them; MSD, arXiv 2505.14260, keeps them all).

Layout: a row holds `k * tokens_per_image` image tokens (k >= 0 images, each a run of `tokens_per_image`
consecutive valid tokens in the target's order: LLaVA's 8x8 patch grid row-major on the zoo), left-packed and
padded to the longest row (`valid`). A policy splits the rows into images, compresses each image on its own
(`VisionPolicy.compress`: `[N, T, dim] -> [N, K, dim]`, T = tokens_per_image) and packs the results back.

Images of different sizes (Qwen-VL's dynamic grids, any-resolution LLaVA's tiles) come with an `ImageLayout`
(`VisionTokens.layout`: each image's length and, where known, its `(h, w)` token grid): the rows are then cut by
those lengths (`mmspec.compressors.ragged`), each image padded to the longest with a key mask, compressed by
`VisionPolicy.compress_ragged` and packed back; `tokens_per_image` is then only the nominal size the policy was built
for (the resampler's query bound, the pool / conv grid check), not a split length. A layout where every image is
`tokens_per_image` tokens takes the fixed path above, unchanged.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from mmspec.compressors.ragged import RaggedImages, pack_ragged, split_ragged
from mmspec.counting import host_checks_enabled
from mmspec.models.hf.image_layout import ImageLayout


__all__ = [
    "ImageBatch",
    "VisionPolicy",
    "VisionTokens",
    "check_question",
    "check_vision_tokens",
    "gather_images",
    "is_ragged",
]


@dataclass
class VisionTokens:
    """Draft-side image tokens of a batch of rows (left-packed, padded to the longest row)."""

    tokens: Tensor  # [rows, M, dim]  image tokens
    positions: Tensor  # [rows, M] long  the target RoPE position each token takes (one of its image's positions)
    valid: Tensor  # [rows, M] bool  False = padding
    global_vec: Tensor | None = None  # [rows, dim]  ViSpec's global vector of the row's last image (zeros: no image)
    choice: Tensor | None = None  # [rows] long  the elastic gate's expert (-1: row without image)
    # valid tokens per row known on the host (`gather_images` with host `counts`, a policy's output): the policies
    # split and pack rows with host-known shapes, no device read; None: read once from `valid` where needed
    host_counts: list[int] | None = None
    # each row's images by their actual lengths (and grids), host-known; None: runs of `tokens_per_image`
    layout: ImageLayout | None = None

    @property
    def counts(self) -> Tensor:
        """`[rows]` long: valid tokens per row."""
        return self.valid.sum(dim=1)


class ImageBatch(NamedTuple):
    """Every image of a `VisionTokens` batch on its own (what `VisionPolicy.compress` works on)."""

    tokens: Tensor  # [N, T, dim]  N = images over all rows, T = tokens_per_image
    positions: Tensor  # [N, T] long
    question: Tensor | None  # [N, dim]  the question of each image's row
    present: Tensor  # [rows, I] bool  row r has an image in slot i (a prefix of each row), I = most images in a row
    index: Tensor | None = (
        None  # [N] long  each image's slot in `present.flatten()` (host-known: `pack` without reads)
    )
    host_images: list[int] | None = None  # images per row, on the host


def _check_tokens_per_image(tokens_per_image) -> int:
    if isinstance(tokens_per_image, bool) or not isinstance(tokens_per_image, int):
        raise TypeError(f"tokens_per_image must be an int, got {type(tokens_per_image).__name__}")
    if tokens_per_image < 1:
        raise ValueError(f"tokens_per_image must be >= 1, got {tokens_per_image}")
    return tokens_per_image


def _check_multiple(counts, tokens_per_image: int) -> None:
    """`counts`: a host list (no read) or a `[rows]` tensor (read once)."""
    counts = counts if isinstance(counts, list) else counts.tolist()
    for row, n in enumerate(counts):
        if n % tokens_per_image:
            raise ValueError(
                f"image_mask: row {row} has {n} image tokens, not a multiple of tokens_per_image={tokens_per_image} "
                "(images of different sizes need an image_layout: mmspec.models.hf.image_layout)"
            )


def _check_layout(layout, counts: list[int]) -> None:
    """`layout` (an `ImageLayout`) must cover `counts` image tokens per row (host lists, no read)."""
    if not isinstance(layout, ImageLayout):
        raise TypeError(f"layout must be an ImageLayout or None, got {type(layout).__name__}")
    if layout.counts != list(counts):
        raise ValueError(f"layout: images of {layout.counts} tokens per row, the rows hold {list(counts)}")


def is_ragged(layout, tokens_per_image: int) -> bool:
    """The images need the ragged path: a layout that is not every image `tokens_per_image` tokens on the square
    grid."""
    return layout is not None and not layout.uniform(tokens_per_image)


def _host_counts(image: "VisionTokens") -> list[int]:
    """Valid tokens per row on the host: `image.host_counts`, else one read of `valid`."""
    return image.host_counts if image.host_counts is not None else image.counts.tolist()


def gather_images(embeds: Tensor, image_mask: Tensor, tokens_per_image: int | None = None,
                  counts: list[int] | None = None, layout: ImageLayout | None = None) -> VisionTokens:  # fmt: skip
    """Each row's image tokens, in order, each at its index in the row (prompts are right-aligned, so the index is the
    target's position).

    Args:
        embeds: `[rows, L, dim]` the decoder's input embeddings (projected image features merged in).
        image_mask: `[rows, L]` bool, True at image tokens.
        tokens_per_image: when given, every row must hold a multiple of it (ValueError naming `image_mask`).
        counts: optional, the image tokens per row as a host list (from the prompt's host copy, e.g. the
            processor's output): the shapes come from it without a device read (checked against `image_mask` where
            reads are free, `mmspec.counting.host_checks_enabled`); None: read once.
        layout: optional, each row's images by length (`ImageLayout`, host-known): kept on the result for the
            policies (images of different sizes); its per-row totals serve as `counts` when those are not given.

    Returns `VisionTokens` with M = the most image tokens in a row (padding: zeros at position 0, valid False).
    """
    if not isinstance(embeds, Tensor):
        raise TypeError(f"embeds must be a Tensor, got {type(embeds).__name__}")
    if not isinstance(image_mask, Tensor):
        raise TypeError(f"image_mask must be a Tensor, got {type(image_mask).__name__}")
    if embeds.dim() != 3 or not embeds.is_floating_point():
        raise ValueError(f"embeds must be a floating [rows, L, dim] tensor, got {embeds.dtype} {tuple(embeds.shape)}")
    if image_mask.dtype != torch.bool or tuple(image_mask.shape) != tuple(embeds.shape[:2]):
        raise ValueError(
            f"image_mask must be a bool [rows, L] = {tuple(embeds.shape[:2])} tensor, got "
            f"{image_mask.dtype} {tuple(image_mask.shape)}"
        )
    if image_mask.device != embeds.device:
        raise ValueError(f"image_mask is on {image_mask.device}, embeds on {embeds.device}")
    rows, length, dim = embeds.shape
    device_counts = image_mask.sum(dim=1)  # [rows]
    source = "counts"
    if layout is not None:
        if len(layout.lengths) != rows:
            raise ValueError(f"layout: {len(layout.lengths)} rows of images for {rows} rows")
        if counts is not None:
            _check_layout(layout, [int(n) for n in counts])
        counts, source = layout.counts, "layout: image tokens per row"
    if counts is None:
        counts = device_counts.tolist()  # the one read
    else:
        counts = [int(n) for n in counts]
        if len(counts) != rows:
            raise ValueError(f"counts: {len(counts)} host counts for {rows} rows")
        if host_checks_enabled(image_mask.device) and counts != device_counts.tolist():
            raise ValueError(
                f"{source} {counts} do not match image_mask's image tokens per row {device_counts.tolist()}"
            )
    if tokens_per_image is not None and layout is None:
        _check_multiple(counts, _check_tokens_per_image(tokens_per_image))
    most = max(counts, default=0)
    counts_t = device_counts
    # a stable sort of "not an image token" puts each row's image indices first, in order
    order = torch.sort((~image_mask).to(torch.uint8), dim=1, stable=True).indices[:, :most]  # [rows, M]
    valid = torch.arange(most, device=embeds.device) < counts_t[:, None]  # [rows, M]
    positions = torch.where(valid, order, torch.zeros_like(order))  # [rows, M]
    tokens = embeds.gather(1, positions[..., None].expand(rows, most, dim))  # [rows, M, dim]
    tokens = tokens.masked_fill(~valid[..., None], 0.0)
    return VisionTokens(tokens=tokens, positions=positions, valid=valid, host_counts=counts, layout=layout)


def check_vision_tokens(image, tokens_per_image: int, dim: int | None = None) -> None:
    """ValueError / TypeError naming the field of `image` that is malformed: shapes, dtypes, `valid` not a prefix of
    each row, positions not strictly increasing, a row's image tokens not a multiple of `tokens_per_image` (without
    a layout) or not its `layout`'s."""
    if not isinstance(image, VisionTokens):
        raise TypeError(f"image must be a VisionTokens (see gather_images), got {type(image).__name__}")
    tokens, positions, valid = image.tokens, image.positions, image.valid
    for name, value in (("tokens", tokens), ("positions", positions), ("valid", valid)):
        if not isinstance(value, Tensor):
            raise TypeError(f"image.{name} must be a Tensor, got {type(value).__name__}")
    if tokens.dim() != 3 or not tokens.is_floating_point():
        raise ValueError(
            f"image.tokens must be a floating [rows, M, dim] tensor, got {tokens.dtype} {tuple(tokens.shape)}"
        )
    shape = tuple(tokens.shape[:2])
    if positions.dtype != torch.long or tuple(positions.shape) != shape:
        raise ValueError(
            f"image.positions must be a long {shape} tensor, got {positions.dtype} {tuple(positions.shape)}"
        )
    if valid.dtype != torch.bool or tuple(valid.shape) != shape:
        raise ValueError(f"image.valid must be a bool {shape} tensor, got {valid.dtype} {tuple(valid.shape)}")
    if positions.device != tokens.device or valid.device != tokens.device:
        raise ValueError(
            f"image.positions ({positions.device}) and image.valid ({valid.device}) must be on image.tokens' device "
            f"({tokens.device})"
        )
    if dim is not None and tokens.shape[2] != dim:
        raise ValueError(f"image.tokens has dim {tokens.shape[2]}, the policy was built for dim {dim}")
    layout = image.layout
    if layout is not None:
        if len(layout.lengths) != shape[0] or max(layout.counts, default=0) > shape[1]:
            raise ValueError(f"image.layout's tokens per row {layout.counts} do not fit image.valid {shape}")
    if image.host_counts is not None:
        if len(image.host_counts) != shape[0] or max(image.host_counts, default=0) > shape[1]:
            raise ValueError(f"image.host_counts {image.host_counts} does not fit image.valid {shape}")
        if layout is None:
            _check_multiple(image.host_counts, tokens_per_image)
        else:
            _check_layout(layout, image.host_counts)
    if not host_checks_enabled(valid.device):
        return  # the value checks below read the device: only where a read is free (the CPU)
    counts = valid.sum(dim=1)  # [rows]
    if image.host_counts is not None and counts.tolist() != image.host_counts:
        raise ValueError(f"image.host_counts {image.host_counts} do not match image.valid's {counts.tolist()}")
    prefix = torch.arange(shape[1], device=valid.device) < counts[:, None]
    if not torch.equal(valid, prefix):
        raise ValueError("image.valid must be True on a prefix of each row (left-packed image tokens)")
    if layout is None:
        _check_multiple(counts, tokens_per_image)
    else:
        _check_layout(layout, counts.tolist())
    if bool((positions[valid] < 0).any()):
        raise ValueError("image.positions must be >= 0 on valid tokens")
    if shape[1] > 1 and bool(((positions[:, 1:] <= positions[:, :-1]) & valid[:, 1:]).any()):
        raise ValueError("image.positions must be strictly increasing along each row's valid tokens")


def check_question(question, rows: int, dim: int) -> None:
    """`question` must be a floating `[rows, dim]` tensor (or None)."""
    if question is None:
        return
    if not isinstance(question, Tensor):
        raise TypeError(f"question must be a Tensor or None, got {type(question).__name__}")
    if not question.is_floating_point() or tuple(question.shape) != (rows, dim):
        raise ValueError(
            f"question must be a floating [rows, dim] = ({rows}, {dim}) tensor, got "
            f"{question.dtype} {tuple(question.shape)}"
        )


class VisionPolicy(nn.Module):
    """Base class: which of an image's `tokens_per_image` tokens the draft keeps (pooled, selected, resampled), each
    at one of the image's target positions. Subclasses set `keep` (tokens per image out) and implement `compress`.

    Args:
        tokens_per_image: image tokens per image (64 on the zoo: an 8x8 patch grid).
        dim: the token width; when given, inputs of another width are refused.
    """

    has_global = False  # True: `forward` fills `global_vec` (ViSpec's resampler)

    def __init__(self, tokens_per_image: int = 64, dim: int | None = None):
        super().__init__()
        self.tokens_per_image = _check_tokens_per_image(tokens_per_image)
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise TypeError(f"dim must be an int or None, got {type(dim).__name__}")
        if dim is not None and dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = dim
        self.keep = tokens_per_image  # draft-side tokens per image; subclasses overwrite

    def tokens_out(self, n_images: int) -> int:
        """Draft-side tokens for `n_images` images (stats, buffer sizes)."""
        if isinstance(n_images, bool) or not isinstance(n_images, int) or n_images < 0:
            raise ValueError(f"n_images must be an int >= 0, got {n_images!r}")
        return n_images * self.keep

    def compress(self, images: ImageBatch, generator=None) -> tuple[Tensor, Tensor, Tensor | None]:
        """`images.tokens [N, T, dim]`, `images.positions [N, T]` -> tokens `[N, keep, dim]`, positions
        `[N, keep]` (each one of that image's positions, increasing), global vectors `[N, dim]` or None."""
        raise NotImplementedError

    def kept(self, length: int, grid: tuple[int, int] | None = None) -> int:
        """Draft-side tokens of one image of `length` tokens (on its `(h, w)` token grid, None: unknown) on the
        ragged path; host arithmetic. The base class keeps every token."""
        return length

    def compress_ragged(self, images: RaggedImages, generator=None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Images of different lengths (`images.tokens [N, T, dim]` padded, `images.mask [N, T]`) -> tokens
        `[N, K, dim]`, positions `[N, K]` (image `j`'s first `kept(lengths[j], grids[j])` are its own, increasing
        positions of that image), global vectors `[N, dim]` or None."""
        raise NotImplementedError(f"{type(self).__name__} does not compress images of different sizes")

    def tokens_out_layout(self, layout: ImageLayout) -> list[int]:
        """Draft-side tokens per row for a batch of that `layout` (host arithmetic: buffer bounds, stats)."""
        if not is_ragged(layout, self.tokens_per_image):
            return [len(row) * self.keep for row in layout.lengths]
        return [sum(self.kept(n, g) for n, g in zip(row, grids, strict=True))
                for row, grids in zip(layout.lengths, layout.grids, strict=True)]  # fmt: skip

    def split(self, image: VisionTokens, question: Tensor | None = None) -> ImageBatch:
        """Checks `image` / `question` and cuts the rows into their images."""
        check_vision_tokens(image, self.tokens_per_image, self.dim)
        rows, _, dim = image.tokens.shape
        check_question(question, rows, dim)
        t = self.tokens_per_image
        device = image.tokens.device
        host = _host_counts(image)  # images per row known on the host: the shapes below need no read
        images = [n // t for n in host]
        slots = max(images, default=0)
        most = slots * t
        present = torch.arange(slots, device=device) < (image.counts // t)[:, None]  # [rows, I]
        index = torch.tensor([r * slots + i for r, n in enumerate(images) for i in range(n)], dtype=torch.long,
                             device=device)  # fmt: skip  # [N]
        tokens = image.tokens[:, :most].reshape(rows * slots, t, dim).index_select(0, index)  # [N, T, dim]
        positions = image.positions[:, :most].reshape(rows * slots, t).index_select(0, index)  # [N, T]
        per_image = None
        if question is not None:
            per_image = question.index_select(0, torch.div(index, max(slots, 1), rounding_mode="floor"))  # [N, dim]
        return ImageBatch(tokens, positions, per_image, present, index, images)

    def pack(self, present: Tensor, tokens: Tensor, positions: Tensor, global_vec: Tensor | None,
             index: Tensor | None = None, images: list[int] | None = None) -> VisionTokens:  # fmt: skip
        """Per-image outputs (`tokens [N, K, dim]`, `positions [N, K]`, `global_vec [N, dim]`) back into rows.
        `index` / `images` (`ImageBatch`'s): each image's slot and the images per row, host-known (no read);
        None: found from `present` (a read)."""
        rows, slots = present.shape
        _, k, dim = tokens.shape
        if index is None:
            index = present.flatten().nonzero().flatten()
        out = tokens.new_zeros(rows * slots, k, dim).index_copy_(0, index, tokens).reshape(rows, slots, k, dim)
        pos = positions.new_zeros(rows * slots, k).index_copy_(0, index, positions).reshape(rows, slots, k)
        valid = present[:, :, None].expand(rows, slots, k).reshape(rows, slots * k)  # [rows, I * K]
        row_global = None
        if global_vec is not None:
            per_slot = (
                global_vec.new_zeros(rows * slots, dim).index_copy_(0, index, global_vec).reshape(rows, slots, dim)
            )
            if slots:  # a row without image reads slot 0: zeros
                last = (present.sum(dim=1) - 1).clamp(min=0)  # [rows] slot of the row's last image
                row_global = per_slot[torch.arange(rows, device=present.device), last]  # [rows, dim]
            else:
                row_global = tokens.new_zeros(rows, dim)
        return VisionTokens(
            tokens=out.reshape(rows, slots * k, dim),
            positions=pos.reshape(rows, slots * k),
            valid=valid,
            global_vec=row_global,
            host_counts=None if images is None else [n * k for n in images],
        )

    def forward(self, image: VisionTokens, question: Tensor | None = None, generator=None) -> VisionTokens:
        """`image` (see `gather_images`), `question [rows, dim]` (used by question-aware policies) -> the draft's
        image tokens, `[rows, I * keep, dim]` with I = the most images in a row."""
        if is_ragged(getattr(image, "layout", None), self.tokens_per_image):
            return self.forward_ragged(image, question, generator)
        batch = self.split(image, question)
        tokens, positions, global_vec = self.compress(batch, generator=generator)
        return self.pack(batch.present, tokens, positions, global_vec, batch.index, batch.host_images)

    def split_ragged(self, image: VisionTokens, question: Tensor | None = None) -> RaggedImages:
        """Checks `image` / `question` and cuts the rows into the images of `image.layout` (host-known lengths)."""
        check_vision_tokens(image, self.tokens_per_image, self.dim)
        check_question(question, image.tokens.shape[0], image.tokens.shape[2])
        return split_ragged(image.tokens, image.positions, question, image.layout)

    def forward_ragged(self, image: VisionTokens, question: Tensor | None = None, generator=None) -> VisionTokens:
        """`forward` for images of different sizes (`image.layout`): split by length, `compress_ragged`, pack."""
        batch = self.split_ragged(image, question)
        tokens, positions, global_vec = self.compress_ragged(batch, generator=generator)
        kept = [self.kept(n, g) for n, g in zip(batch.lengths, batch.grids, strict=True)]
        tokens, positions, valid, row_global, counts = pack_ragged(batch, tokens, positions, global_vec, kept)
        return VisionTokens(tokens, positions, valid, global_vec=row_global, host_counts=counts)
