"""vLLM's own CPU attention op, called the way its ``cpu_attn.py`` backend calls it: the
reference the masked kernel (`kernels/masked_paged_attention.py`) must agree with when nothing
is masked, for tests and benchmarks."""

from __future__ import annotations

import torch

from vllm_adaptive.engine.vllm_api import cpu_attn_isa
from vllm_adaptive.engine.vllm_api import custom_ops as ops


def stock_cpu_scheduler_metadata(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    isa: str | None = None,
    sliding_window: int = -1,
) -> torch.Tensor:
    """What vLLM's CPU metadata builder computes once per step (causal; ``sliding_window`` -1:
    none)."""
    nb, nkv, bs, hs = key_cache.shape
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.shape[0],
        num_heads=query.shape[1],
        num_kv_heads=nkv,
        head_dim=hs,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=sliding_window,
        isa=isa or cpu_attn_isa(query.dtype, bs, hs),
        enable_kv_split=False,
    )


def stock_cpu_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    scheduler_metadata: torch.Tensor | None = None,
    sliding_window: int = -1,
) -> torch.Tensor:
    """vLLM's own CPU attention op (no mask), called the way ``cpu_attn.py`` calls it: causal, no
    ALiBi, soft-cap or sinks, "auto" cache dtype, ``sliding_window`` -1 (none) or W.
    ``key_cache`` / ``value_cache`` are the chunks of a CPU_ATTN cache
    (:func:`split_cpu_kv_cache`); index tensors int32. For tests and benchmarks (the all-visible
    mask must agree with it)."""
    if scheduler_metadata is None:
        scheduler_metadata = stock_cpu_scheduler_metadata(
            query, key_cache, query_start_loc, seq_lens, sliding_window=sliding_window
        )
    if out is None:
        out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=sliding_window,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=scheduler_metadata,
        s_aux=None,
    )
    return out
