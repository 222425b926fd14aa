"""Probes of the geared linears' C++ route inside a real engine (run in the worker through
``llm.apply_model``): how many linears the compiled graph routes, Python calls counted."""

from __future__ import annotations


def geared_routes(model) -> dict[str, int]:
    """How many geared linears the compiled graph reaches through the C++ op, and how many
    have their routed flag set now (runs in the worker)."""
    from vllm_adaptive.models.geared_linear_method import GearedLinearMethod

    methods = [
        m.quant_method
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), GearedLinearMethod)
    ]
    return {
        "geared": len(methods),
        "routed": sum(m.route_op is not None for m in methods),
        "uniform_routed": sum(int(m.geared.uniform_routed[0]) != 0 for m in methods),
        # layers whose full gear runs vLLM's oneDNN GEMM from C++, and those flagged for it now
        "full_routed": sum("full" in m.geared.routed for m in methods),
        "flagged_full": sum(int(m.geared.uniform_routed[0]) == 4 for m in methods),
    }


def count_python_calls(model) -> int:
    """Wrap each decoder linear's Python fast call with a counter (the flag stays set: a graph
    that reads the live flag never calls it); returns how many were wrapped."""
    from vllm_adaptive.models.geared_linear_method import GearedLinearMethod

    wrapped = 0
    for name, m in model.named_modules():
        method = getattr(m, "quant_method", None)
        if not isinstance(method, GearedLinearMethod) or name.endswith("lm_head"):
            continue
        g, fast = method.geared, method.geared.fast

        def counted(x, fast=fast, g=g):
            g.python_calls = getattr(g, "python_calls", 0) + 1
            return fast(x)

        g.fast, g.python_calls = counted, 0
        wrapped += 1
    return wrapped


def _decoder_geared(model) -> list:
    from vllm_adaptive.models.geared_linear_method import GearedLinearMethod

    return [
        m.quant_method.geared
        for name, m in model.named_modules()
        if isinstance(getattr(m, "quant_method", None), GearedLinearMethod)
        and not name.endswith("lm_head")
    ]


def python_calls(model) -> dict[str, int]:
    """Calls the counters saw, and how many counters are still in place."""
    geared = _decoder_geared(model)
    return {
        "calls": sum(getattr(g, "python_calls", 0) for g in geared),
        "counted": sum(getattr(g.fast, "__name__", "") == "counted" for g in geared),
    }


def head_tier(model) -> dict[str, object]:
    """The LM head's int8 tier: its group, scale dtype, and whether it gives the head's own
    weight back to the bit."""
    import torch

    from vllm_adaptive.kernels.packed import dequantize

    g = model.lm_head.quant_method.geared
    tier = g.tiers.tiers["int8"]
    w = g.layer.weight
    return {
        "group_size": tier.group_size,
        "scale_dtype": str(tier.scales.dtype),
        "exact": bool(torch.equal(dequantize(tier, torch.float32).to(w.dtype), w)),
    }


def clear_flags(model) -> int:
    """The negative control: the flags cleared by hand, the counters left in place."""
    geared = _decoder_geared(model)
    for g in geared:
        g.uniform_routed[0] = 0
    return len(geared)


def greedy(n: int, **extra):
    """Greedy sampling of exactly ``n`` tokens, ``extra`` as the request's extra_args."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


def token_ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]
