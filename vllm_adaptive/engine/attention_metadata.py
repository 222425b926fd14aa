"""vLLM's attention metadata, read and rewritten for the plugin's mechanisms: the only module
that reads vLLM's forward context or builds CPU attention metadata.

- This step's metadata (:func:`step_attention_metadata`, :func:`step_query_start_loc`,
  :func:`attention_skipped`): the model classes read them once per step and pass them down.
- Metadata for a subset of the step (depth-peeling: :func:`subset_cpu_metadata`; token fusion:
  :func:`fused_cpu_metadata`; one query per row for tokens that are not this step's:
  :func:`one_token_cpu_metadata`), and the forward context that installs it per layer
  (:func:`layer_metadata_swaps`, :func:`one_token_forward_context`).
- Writing K/V into a layer's paged cache outside its attention call (:func:`write_layer_kv`).
- :class:`CpuStepAttention`: all of the above for one engine, as the depth mechanisms' port
  (`depth/attention_port.StepAttention`) asks for it; the model glue hands it to the runtime.

The attention layers read their metadata and slot mapping from vLLM's forward context by layer
name, so a subset is metadata sliced to the active requests (re-based query offsets, their
sequence lengths, block-table rows and slots) with the CPU kernel's scheduler metadata
recomputed. Only vLLM's CPU backend (CPU_ATTN) is supported: on GPU backends a subset would
also need its own CUDA graph (one per active-set size) or an eager fallback, see
docs/adaptive-depth.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from vllm_adaptive.depth.attention_port import CacheGeometry, token_index

SUPPORTED_BACKENDS = ("CPU_ATTN",)


@dataclasses.dataclass(frozen=True)
class CpuSchedulerArgs:
    """What the CPU backend's builder passes to its scheduler-metadata op."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int
    isa: str
    kv_cache_dtype: str

    @classmethod
    def from_layer(
        cls, attn: Any, dtype: torch.dtype, kv_cache_dtype: str, sliding_window: int | None = None
    ) -> CpuSchedulerArgs:
        """``sliding_window``: the window the metadata is built for (default ``attn``'s own);
        metadata shared by layers of several windows takes theirs (:func:`group_window`)."""
        return cls(
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_size,
            dtype=dtype,
            sliding_window=attn.impl.sliding_window if sliding_window is None else sliding_window,
            isa=attn.isa,
            kv_cache_dtype=kv_cache_dtype,
        )


def group_window(attns: Any) -> int:
    """The window vLLM's CPU metadata builder assumes for a KV cache group: the one every layer
    of it shares, else -1 (none). Gemma 3 with the hybrid KV cache manager off holds windowed
    and global layers in one group, whose shared metadata may assume no window."""
    windows = {attn.impl.sliding_window for attn in attns}
    return windows.pop() if len(windows) == 1 else -1


def _scheduler_metadata(
    md: Any, args: CpuSchedulerArgs, seq_lens: torch.Tensor, qsl: torch.Tensor
) -> torch.Tensor:
    """What vLLM's CPU metadata builder computes for a batch of requests."""
    from vllm import _custom_ops as ops
    from vllm import envs

    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=int(seq_lens.shape[0]),
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        seq_lens=seq_lens,
        dtype=args.dtype,
        query_start_loc=qsl,
        causal=md.causal,
        sliding_window_size=args.sliding_window,
        isa=args.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def subset_cpu_metadata(md: Any, rows: torch.Tensor, args: CpuSchedulerArgs) -> Any:
    """`CPUAttentionMetadata` for requests ``rows`` (ascending) of ``md``."""
    qsl = md.query_start_loc
    counts = (qsl[1:] - qsl[:-1])[rows]
    new_qsl = torch.zeros(len(rows) + 1, dtype=qsl.dtype, device=qsl.device)
    torch.cumsum(counts, 0, out=new_qsl[1:])
    seq_lens = md.seq_lens[rows]
    sched = _scheduler_metadata(md, args, seq_lens, new_qsl)
    return dataclasses.replace(
        md,
        num_actual_tokens=int(counts.sum()),
        max_query_len=int(counts.max()),
        query_start_loc=new_qsl,
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens,
        block_table=md.block_table[rows],
        slot_mapping=md.slot_mapping[token_index(qsl, rows)],
        scheduler_metadata=sched,
    )


def fused_cpu_metadata(
    md: Any, counts: torch.Tensor, keep: torch.Tensor, args: CpuSchedulerArgs
) -> Any:
    """`CPUAttentionMetadata` for the same requests as ``md`` with only the tokens ``keep``
    (indices into ``md``'s tokens, ascending) left: ``counts`` of them per request (token fusion
    removes rows inside a request). Sequence lengths and block tables stay: the kept queries
    keep their positions, which the masked backend takes from the published mask."""
    qsl = md.query_start_loc
    new_qsl = torch.zeros(counts.shape[0] + 1, dtype=qsl.dtype, device=qsl.device)
    torch.cumsum(counts.to(qsl.device), 0, out=new_qsl[1:])
    sched = _scheduler_metadata(md, args, md.seq_lens, new_qsl)
    return dataclasses.replace(
        md,
        num_actual_tokens=int(counts.sum()),
        max_query_len=int(counts.max()),
        query_start_loc=new_qsl,
        slot_mapping=md.slot_mapping[keep.to(md.slot_mapping.device)],
        scheduler_metadata=sched,
    )


def one_token_cpu_metadata(
    md: Any,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    args: CpuSchedulerArgs,
) -> Any:
    """`CPUAttentionMetadata` for one query token per row: request ``rows`` of ``md`` (their
    block tables), attending to ``seq_lens`` positions, the query written to ``slot_mapping``.
    For tokens that are not this step's (the `recompute` strategy resumes earlier ones)."""
    n = int(rows.numel())
    qsl = torch.arange(n + 1, dtype=md.query_start_loc.dtype, device=md.query_start_loc.device)
    seq_lens = seq_lens.to(md.seq_lens.dtype).to(md.seq_lens.device)
    sched = _scheduler_metadata(md, args, seq_lens, qsl)
    return dataclasses.replace(
        md,
        num_actual_tokens=n,
        max_query_len=1,
        query_start_loc=qsl,
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens,
        block_table=md.block_table[rows.to(md.block_table.device)],
        slot_mapping=slot_mapping.to(md.slot_mapping.dtype).to(md.slot_mapping.device),
        scheduler_metadata=sched,
    )


@contextmanager
def layer_metadata_swaps(layer_names: list[str]) -> Iterator[LayerMetadataSwaps]:
    """Lets the layer loop swap per-layer metadata for this step; restores it afterwards."""
    from vllm.forward_context import get_forward_context

    ctx = get_forward_context()
    md_dict, slot_dict = ctx.attn_metadata, ctx.slot_mapping
    saved_md = {n: md_dict[n] for n in layer_names}
    saved_slots = {n: slot_dict.get(n) for n in layer_names}
    try:
        yield LayerMetadataSwaps(md_dict, slot_dict, layer_names)
    finally:
        md_dict.update(saved_md)
        for n, s in saved_slots.items():
            if s is not None:
                slot_dict[n] = s


@dataclasses.dataclass
class LayerMetadataSwaps:
    """This step's per-layer attention metadata in vLLM's forward context, which the layer
    loop replaces from a layer on (the rows still running, the tokens fusion kept)."""

    md_dict: dict
    slot_dict: dict
    layer_names: list[str]

    def base(self) -> Any:
        return self.md_dict[self.layer_names[0]]

    def install(self, md: Any, from_layer: int) -> None:
        """Use ``md`` for layers ``from_layer`` onwards."""
        for name in self.layer_names[from_layer:]:
            self.md_dict[name] = md
            self.slot_dict[name] = md.slot_mapping

    @contextmanager
    def installed_between(self, md: Any, start: int, stop: int) -> Iterator[None]:
        """Use ``md`` for layers ``start .. stop - 1`` inside the block, then put back what
        they had (ARLA's accelerated stream runs an interval with its own metadata)."""
        names = self.layer_names[start:stop]
        saved = [(self.md_dict[n], self.slot_dict.get(n)) for n in names]
        for n in names:
            self.md_dict[n] = md
            self.slot_dict[n] = md.slot_mapping
        try:
            yield
        finally:
            for n, (m, s) in zip(names, saved, strict=True):
                self.md_dict[n] = m
                if s is None:
                    self.slot_dict.pop(n, None)
                else:
                    self.slot_dict[n] = s


# -- this step --------------------------------------------------------------------------------


def _metadata_dict() -> dict | None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    return md if isinstance(md, dict) else None


def step_attention_metadata(layer_name: str) -> Any | None:
    """This step's CPU attention metadata of ``layer_name``; None outside a forward or in vLLM's
    dummy and profiling runs (no metadata), and for metadata that is not CPU_ATTN's."""
    md_dict = _metadata_dict()
    md = md_dict.get(layer_name) if md_dict is not None else None
    if md is None or not hasattr(md, "block_table") or not hasattr(md, "seq_lens"):
        return None
    return md


def step_query_start_loc() -> np.ndarray | None:
    """This step's query offsets per request (``[num_reqs + 1]``, int64), from any layer's
    metadata; None outside a forward or without metadata."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if isinstance(md, list):
        md = md[0] if md else None
    if isinstance(md, dict):
        md = next(iter(md.values()), None)
    qsl = getattr(md, "query_start_loc", None)
    if qsl is None:
        return None
    return qsl.cpu().numpy()[: int(qsl.shape[0])].astype(np.int64)


def attention_skipped() -> bool:
    """No attention metadata this step (vLLM's warm-up and profiling runs)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return True
    md = get_forward_context().attn_metadata
    return md is None or (isinstance(md, dict) and all(v is None for v in md.values()))


@contextmanager
def one_token_forward_context(
    md: Any,
    rows: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    args: CpuSchedulerArgs,
    layer_names: list[str],
    vllm_config: Any,
) -> Iterator[None]:
    """A forward context where every layer attends one query per row of ``md`` (``rows``) at
    ``positions``, writing its K/V to that position's slot (drafting into the target's own
    cache)."""
    from vllm.forward_context import set_forward_context

    blocks = md.block_table[rows, positions // block_size].long()
    slots = blocks * block_size + positions % block_size
    sub = one_token_cpu_metadata(md, rows, positions + 1, slots, args)
    with set_forward_context(
        {name: sub for name in layer_names},
        vllm_config,
        num_tokens=int(rows.numel()),
        slot_mapping={name: sub.slot_mapping for name in layer_names},
    ):
        yield


def write_layer_kv(attn: Any, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write K/V (``[n, kv_heads, head_size]``) into ``attn``'s paged cache at ``slots``, as
    the layer's own attention call would (for K/V made outside it: state propagation)."""
    cache = attn.kv_cache
    cache = cache[0] if isinstance(cache, (list, tuple)) else cache
    attn.impl.do_kv_cache_update(attn, k, v, cache, slots)


class CpuStepAttention:
    """vLLM's CPU attention as the depth mechanisms use it (`depth.attention_port.StepAttention`):
    one per engine, bound to the KV cache once it exists."""

    def __init__(
        self,
        layer_names: list[str],
        dtype: torch.dtype,
        kv_cache_dtype: str,
        sliding_window: int = -1,
    ) -> None:
        """``sliding_window``: the window the step's metadata assumes (:func:`group_window`)."""
        self.layer_names = layer_names
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window
        self.args: CpuSchedulerArgs | None = None

    def bind(self, attn: Any) -> CacheGeometry | None:
        cache = attn.kv_cache[0] if isinstance(attn.kv_cache, (list, tuple)) else attn.kv_cache
        if cache is None or cache.dim() != 4 or not hasattr(attn, "isa"):
            return None  # profiling run (no cache yet), or not CPU_ATTN's layout
        self.args = CpuSchedulerArgs.from_layer(
            attn, self.dtype, self.kv_cache_dtype, self.sliding_window
        )
        num_blocks, _, block_size, _ = cache.shape
        return CacheGeometry(num_blocks, block_size, cache.device)

    def _args(self) -> CpuSchedulerArgs:
        assert self.args is not None, "bind() runs once the KV cache exists"
        return self.args

    def subset(self, md: Any, rows: torch.Tensor) -> Any:
        return subset_cpu_metadata(md, rows, self._args())

    def fused(self, md: Any, counts: torch.Tensor, keep: torch.Tensor) -> Any:
        return fused_cpu_metadata(md, counts, keep, self._args())

    def one_token(
        self, md: Any, rows: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor
    ) -> Any:
        return one_token_cpu_metadata(md, rows, seq_lens, slots, self._args())

    def layer_swaps(self) -> contextlib.AbstractContextManager[LayerMetadataSwaps]:
        return layer_metadata_swaps(self.layer_names)

    def write_kv(self, attn: Any, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        write_layer_kv(attn, k, v, slots)
