"""mmspec: speculative decoding for multimodal generation.

The verifier core lives in `mmspec.verify` (pure, batched acceptance rules) and `mmspec.sampling`
(logits -> the exact distributions samples are drawn from). Models are in `mmspec.models`, drafters in
`mmspec.drafters`, Diffusers-style pipelines in `mmspec.pipelines` and evaluation in `mmspec.eval`.
"""

__version__ = "0.1.0"
