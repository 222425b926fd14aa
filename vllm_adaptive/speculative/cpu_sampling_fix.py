"""A fix for vLLM 0.32's CPU fallback of the rejection sampler's ``expand_kernel``.

Without Triton, vLLM replaces the sampler's Triton kernels with C++ ones
(``vllm/utils/cpu_triton_utils.py``). The replacement for ``expand_kernel`` converts its output
buffer to int64 before the C++ call (``_ensure_int64`` makes a copy of a float tensor) and never
copies the result back. ``expand_batch_to_tokens`` uses it to give every draft token its
request's temperature, so with random sampling the temperatures of draft positions are
uninitialised memory and the rejection sampler accepts and recovers tokens from garbage
distributions. Greedy requests do not read it. It breaks every proposer on CPU, vLLM's own
``ngram`` included (measured: docs/speculative.md).

The plugin's proposer re-registers a correct implementation in its own engines only, after the
platform's overrides: a stock engine keeps vLLM's behaviour, bug included.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm.adaptive.speculative")

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel(output, input_ptr, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """``output[t] = x[r]`` for every token ``t`` of request ``r`` (``replace_from`` in ``x``
    becomes ``replace_to``), in ``output``'s own dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    vals = torch.where(
        input_ptr == replace_from, torch.as_tensor(replace_to, dtype=input_ptr.dtype), input_ptr
    )
    output.copy_(torch.repeat_interleave(vals, counts, output_size=output.numel()))


def install() -> bool:
    """Replace vLLM's CPU ``expand_kernel`` fallback when it is the one in use."""
    from vllm.triton_utils import dispatcher

    current = dispatcher._registry.get(KERNEL)
    if current is None or getattr(current[1], "__module__", "") != "vllm.utils.cpu_triton_utils":
        return False
    dispatcher.register_kernels({KERNEL: expand_kernel})
    logger.info("vllm-adaptive speculative: replaced vLLM's CPU expand_kernel fallback")
    return True
