"""Argument checks shared by the pipelines (and the CLI): text prompts and devices, each error naming the argument.

One copy of each check: `pipelines/janus.py` and `pipelines/vlm.py` read prompts through `check_prompts`;
`SpeculativeJanusPipeline.from_pretrained` and the CLI's `--device` (`mmspec.cli.checks.check_device`) go through
`check_device`.
"""

import torch


__all__ = ["check_device", "check_prompts"]


def check_device(device, name: str = "device") -> torch.device | None:
    """`device` as a `torch.device` (None stays None); a ValueError naming `name` unless it is a torch device that
    exists here (a CUDA / MPS device needs that backend, a CUDA index a GPU of that number)."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"{name} must be a torch device or its name (e.g. 'cpu', 'cuda:0'), got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"{name}: {device!r} is not a torch device ({err})") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: {device!r} but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{name}: {device!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name}: {device!r} but MPS is not available")
    return dev


def check_prompts(prompt, name: str = "prompt", reserved=()) -> list[str]:
    """`prompt` (a str or a non-empty list of str) as a list; each must hold text (not only whitespace), be valid
    Unicode (no lone surrogates, which tokenizers refuse with a TypeError) and contain none of the `reserved` strings
    (the model's special tokens: the chat template and the processor add those, a prompt that spells one out would
    change what the model sees). TypeError / ValueError naming `name` and the prompt's index."""
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"{name} must be a str or a non-empty list of str, got {prompt!r}")
    for i, p in enumerate(prompts):
        if not p.strip():
            raise ValueError(f"{name} must not be empty ({name} {i} is {p!r})")
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"{name} {i} is not valid Unicode text ({p[err.start : err.end]!r} at index {err.start}: "
                             "a lone surrogate)") from err  # fmt: skip
        found = [token for token in reserved if token and token in p]
        if found:
            raise ValueError(f"{name} {i} contains the special token {found[0]!r}: prompts are plain text (the chat "
                             "template and the processor add the special tokens; pass input_ids to set them)")  # fmt: skip
    return list(prompts)
