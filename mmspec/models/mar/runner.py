"""The masked loop's adapter for MAR (`mmspec.decoding.masked.MaskedTarget`): a MAR model with its class condition
and CFG."""

import torch
from torch import Tensor

from mmspec.decoding.masked import FiniteWatch
from mmspec.models.mar.diffloss import CapturedSampler


__all__ = ["MARRunner"]


class MARRunner:
    """A MAR model with its condition and CFG: features of canvases, and its head on selected tokens.

    Rows: ``features`` takes ``[R, L, D]`` canvases and ``rows [R]`` (the image each canvas belongs to) and returns the
    conditional and unconditional ``z`` (the latter None without guidance). ``name`` (the pipeline component, e.g.
    ``"transformer"``) names the model in errors; ``watch`` (a `FiniteWatch`, set by `decode_masked`) records
    whether its outputs are finite."""

    def __init__(self, model, labels: Tensor, guided: bool, name: str = "transformer"):
        self.model, self.labels, self.guided, self.name = model, labels, guided, name
        self.forwards = 0
        self.watch: FiniteWatch | None = None
        self.compiler = None  # `mmspec.decoding.compiled.Compiler`: the head's sampler runs captured

    def saw(self, part: str, *tensors: Tensor | None) -> None:
        """Record the finiteness of outputs of ``part`` (``"features"`` / ``"diffusion head"``) of this model."""
        if self.watch is not None:
            self.watch.see(self.name, part, *tensors)

    @property
    def head(self):
        """The diffusion head (`CapturedSampler` of it when the pipeline compiles: one graph per sampler shape)."""
        if self.compiler is None:
            return self.model.diffloss
        return CapturedSampler(self.model.diffloss, self.compiler, "draft_head" if "draft" in self.name else "head")

    def features(
        self, tokens: Tensor, visible: Tensor, rows: Tensor, visible_range=None
    ) -> tuple[Tensor, Tensor | None]:
        r = tokens.shape[0]
        cond = self.model.class_embedding(self.labels[rows])
        self.forwards += 1
        if not self.guided:
            z = self.model.features(tokens, visible, cond, visible_range)
            self.saw("features", z)
            return z, None
        uncond = self.model.class_embedding(None, r)
        z = self.model.features(
            torch.cat([tokens, tokens]), torch.cat([visible, visible]), torch.cat([cond, uncond]), visible_range
        )
        self.saw("features", z)
        return z[:r], z[r:]
