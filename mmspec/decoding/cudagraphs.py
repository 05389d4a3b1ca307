"""The ``"cudagraphs"`` compile backend: dynamo's CUDA-graph backend (the traced graph's own kernels captured in a CUDA
graph, no code generation) with the weights and the KV cache as static inputs.

torch's own ``backend="cudagraphs"`` treats as static only the arguments aot_autograd lifts itself. Since dynamo
inlines modules (``inline_inbuilt_nn_modules``, the default), every parameter is a graph input instead, so every
replay first copied every weight (and the KV cache, in and out) into the graph's own memory: on one H200, 556
device-to-device copies per LlamaGen-XL step, 5.9 ms of a 13.5 ms captured step whose weights stream in 0.32 ms
(`assets/bench/gpu-h200-captured.json`, the plain step's ``profile``). `cudagraphs` hands CUDA graph trees the indices
inductor itself uses (`static_input_indices`: parameters, buffers, tensors marked with
`torch._dynamo.mark_static_address`), so a replay reads them where they are, and keeps a static input's in-place
write (the KV cache's) inside the graph: torch's backend moves it out, as an eager copy of the whole cache after every
replay. A graph that writes a non-static input is not captured (a skip, counted and logged as torch's are).
Inference only: a graph traced with gradients enabled goes to torch's backend unchanged.
"""

import functools

import torch


__all__ = ["cudagraphs", "static_input_indices"]


def static_input_indices(fixed: int) -> list[int]:
    """The forward's inputs CUDA graphs must read in place, not copy: the `fixed` arguments aot_autograd lifted, and
    (inside its compile) the indices its metadata marks static -- parameters and buffers of inlined modules and
    tensors marked with `torch._dynamo.mark_static_address`."""
    from torch._inductor.compile_fx import get_static_input_idxs

    return sorted(set(range(fixed)) | set(get_static_input_idxs(fixed)))


def _forward(example_count, aot_model, aot_inputs, is_inference=False):
    """aot_autograd's forward compiler: the graph captured by CUDA graph trees with `static_input_indices`, or run as
    it is where torch's own backend would skip capturing it (CPU ops, an incompatible op; counted and logged as
    torch's skips are)."""
    from torch._dynamo.backends import cudagraphs as base
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor import cudagraph_trees, cudagraph_utils
    from torch._inductor.utils import num_fw_fixed_arguments

    interp = boxed_nop(aot_model, aot_inputs)
    fixed = num_fw_fixed_arguments(example_count, len(aot_inputs))
    static = static_input_indices(fixed)
    mutated = base.find_input_mutations(aot_model.graph)
    placeholders = cudagraph_utils.get_placeholder_info(aot_model.graph)
    if mutated - set(static):  # written in place but copied in: the write would land in the graph's copy
        skip = cudagraph_utils.get_mutation_stack_trace(placeholders, mutated - set(static))
    else:  # torch's other reasons (CPU ops, several devices, an incompatible op); static mutations are allowed
        with torch._dynamo.config.patch(cudagraph_backend_support_input_mutation=True):
            skip = base.check_for_skip(aot_model, fixed)
    if skip:
        cudagraph_utils.log_cudagraph_skip_and_bump_counter(f"skipping cudagraphs due to {skip}")
        return interp
    out = cudagraph_trees.cudagraphify_impl(
        interp,
        aot_inputs,
        static,
        device_index=base.get_device_index(aot_model),
        is_backward=False,
        is_inference=is_inference,
        stack_traces=base.get_stack_traces(aot_model),
        placeholders=placeholders,
        mutated_input_idxs=mutated,
    )
    out._boxed_call = True
    return out


def cudagraphs(gm, example_inputs):
    """A dynamo backend (module docstring)."""
    from torch._dynamo.backends.common import aot_autograd

    if torch.is_grad_enabled():
        return torch._dynamo.lookup_backend("cudagraphs")(gm, example_inputs)
    forward = functools.partial(_forward, len(example_inputs))
    compiler = aot_autograd(
        fw_compiler=forward,
        inference_compiler=functools.partial(forward, is_inference=True),
        keep_inference_input_mutations=True,  # the KV cache's write stays in the graph, in place
    )
    return compiler(gm, example_inputs)
