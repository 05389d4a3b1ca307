"""mmspec: speculative decoding for multimodal generation.

The verifier core lives in `mmspec.verify` (pure, batched acceptance rules as objects) and `mmspec.sampling`
(logits -> the exact distributions samples are drawn from); the decoding engine every pipeline shares in
`mmspec.decoding` (one loop over a target adapter, a drafter and a rule) with the method registry `mmspec.methods`.
Models are in `mmspec.models`, drafters in `mmspec.drafters`, Diffusers-style pipelines in `mmspec.pipelines` and
evaluation in `mmspec.eval`.

`import mmspec` is cheap (no torch): the names below (the four pipelines, `load`, the verifier's functions) load their
module on first use (PEP 562), so the command line (`mmspec --help`) starts without importing torch.
"""

import importlib


__version__ = "0.1.0"

# public name -> defining module, imported on first access
_LAZY = {
    **dict.fromkeys(
        [
            "SpeculativeARImagePipeline",
            "SpeculativeContinuousARPipeline",
            "SpeculativeJanusPipeline",
            "SpeculativeVLMPipeline",
        ],
        "mmspec.pipelines",
    ),
    "load": "mmspec.models",
    "SamplingParams": "mmspec.sampling",
    "SpecStats": "mmspec.stats",
    **dict.fromkeys(
        [
            "RULES",
            "VerifyResult",
            "get_rule",
            "verify_continuous",
            "verify_exact",
            "verify_greedy",
            "verify_grouped",
            "verify_jacobi",
            "verify_relaxed",
            "verify_tree",
        ],
        "mmspec.verify",
    ),
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
