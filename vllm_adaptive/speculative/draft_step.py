"""The mechanism behind every draft: one token per request through the target model's own
layers, attention reading and writing the target's own paged KV cache.

After a verification step, request ``r`` knows ``N`` tokens and the cache holds the target's
K/V for positions ``0 .. N-2`` (the last token, just sampled, has none yet). Draft step ``j``
feeds token ``N-1+j`` at that position: its K/V go into the slot the target will use for that
position, and it attends to the target's K/V below it and to the earlier draft positions.
Nothing the draft writes is ever read by the target: the next verification step processes every
position from ``N-1`` on and rewrites its K/V (layer by layer, before attention reads them), and
rejected positions are rewritten when they are reached again. So the draft needs no cache of its
own: it shares the target's, as M2R2 (A.1.4) shares the slow stream's.

Only slots of blocks the step already holds are used: positions up to the end of the last block
covering the step's sequence length. A request whose drafts would run past that gets fewer drafts
this step (vLLM verifies however many a request has). Blocks under those positions belong to the
request alone: vLLM shares only full blocks of computed tokens.

CPU attention (CPU_ATTN) only, like depth-peeling: its metadata for a batch of one-token queries
is rebuilt with :func:`vllm_adaptive.engine.attention_metadata.one_token_cpu_metadata`.

The draft pass is compiled when the engine compiles its model (vLLM's default; not under
``--enforce-eager``): run eagerly, its per-layer Python (module calls, norms, rotary, the
attention layer's dispatch) cost more than its kernels (docs/float32-kernels.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_adaptive.engine.attention_metadata import (
    CpuSchedulerArgs,
    one_token_forward_context,
    step_attention_metadata,
)

logger = logging.getLogger("vllm.adaptive.speculative")

DraftPass = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def engine_compiles(vllm_config: Any) -> bool:
    """Whether the engine compiles its model (vLLM's compilation mode is not NONE)."""
    mode = getattr(vllm_config.compilation_config, "mode", None)
    return mode is not None and int(mode) != 0


def compiled_draft_pass(forward: DraftPass, compile_it: bool) -> DraftPass:
    """``forward(positions, token_ids)`` compiled by inductor, dynamic in the number of rows
    (dynamo specializes one row, so batch 1 and larger batches compile once each, on first
    use; inductor's on-disk cache serves later engines). Reduced-precision linears are calls of
    :mod:`vllm_adaptive.kernels.weight_op`, attention vLLM's own opaque op."""
    if not compile_it:
        return forward
    compiled = torch.compile(forward, backend="inductor", dynamic=True, fullgraph=True)
    seen: set[bool] = set()

    def run(positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        single = token_ids.shape[0] == 1
        if single in seen:
            return compiled(positions, token_ids)
        t0 = time.perf_counter()
        out = compiled(positions, token_ids)
        seen.add(single)
        logger.info(
            "vllm-adaptive speculative: draft pass compiled for %s in %.1f s",
            "one row" if single else "several rows",
            time.perf_counter() - t0,
        )
        return out

    return run


@dataclass
class DraftBatch:
    """Requests that draft this step: batch rows, how many drafts each may make and where they
    start (the position of the last sampled token)."""

    rows: np.ndarray
    budget: np.ndarray
    start: np.ndarray


class SharedKVDraftStep:
    """Captures the target step's attention metadata; gives one-token forward contexts."""

    def __init__(self, model: Any, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        parts = model.adaptive_parts()
        self.layer_names = parts.layer_names
        self.block_size = int(vllm_config.cache_config.block_size)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache_dtype = vllm_config.cache_config.cache_dtype
        self._attn = parts.layers[0].attn
        self.sched_args: CpuSchedulerArgs | None = None
        self.md: Any = None

    def capture(self) -> None:
        """Called as the target model runs (a forward pre-hook): keep the step's metadata."""
        self.md = step_attention_metadata(self.layer_names[0])

    def check_backend(self) -> None:
        name = self._attn.attn_backend.get_name()
        if name != "CPU_ATTN":
            raise RuntimeError(
                f"adaptive.speculative: drafting into the shared KV cache supports the CPU "
                f"attention backend (CPU_ATTN); this engine uses {name}"
            )

    def plan(self, sampled: list[list[int]], num_tokens: np.ndarray, k: int) -> DraftBatch | None:
        """Which rows draft, and how many tokens each may draft (slots the step holds)."""
        md = self.md
        if md is None:
            return None
        n_rows = min(len(sampled), int(md.seq_lens.shape[0]))
        rows = np.array([r for r in range(n_rows) if sampled[r]], dtype=np.int64)
        if rows.size == 0:
            return None
        n = num_tokens[rows].astype(np.int64)
        seq = md.seq_lens[torch.from_numpy(rows)].cpu().numpy().astype(np.int64)
        bs = self.block_size
        capacity = -(-seq // bs) * bs  # end of the last block the step covers
        budget = np.minimum(k, np.minimum(capacity - n + 1, self.max_model_len - n))
        keep = budget > 0
        if not keep.any():
            return None
        return DraftBatch(rows[keep], budget[keep], n[keep] - 1)

    @contextmanager
    def one_token(self, rows: np.ndarray, positions: np.ndarray) -> Iterator[torch.Tensor]:
        """A forward context where every layer attends one query per row at ``positions``
        (writing its K/V to that position's slot); yields the positions tensor."""
        md = self.md
        if self.sched_args is None:
            self.sched_args = CpuSchedulerArgs.from_layer(
                self._attn, self.dtype, self.kv_cache_dtype
            )
        dev = md.block_table.device
        rows_t = torch.from_numpy(rows).to(dev)
        pos = torch.from_numpy(positions).to(dev)
        with one_token_forward_context(
            md, rows_t, pos, self.block_size, self.sched_args, self.layer_names, self.vllm_config
        ):
            yield pos
