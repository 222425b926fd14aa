"""The interface every KV strategy implements, and what it works on.

The depth runtime (`depth/runtime.py`) owns the step: plan, layer loop, commit. What differs
between strategies is what happens to the K/V of layers a token skipped (see
docs/kv-strategies.md). A strategy's hooks take what they read as arguments and write only
into what they are handed:

- ``state`` (`KvState`): the per-slot depth record, the exit-state store, the engine's
  counters and attention (metadata for tokens that are not this step's, K/V written outside an
  attention call);
- ``parts``: the model's layers and norms;
- the step's plan (`step.StepPlan`) and, while planning, a `PlanDraft` per step (the output
  of the planning hooks).

The hooks, in the order the runtime calls them:

- at engine start: `check_engine` (settings the config cannot check alone), and the flags
  `needs_masked_attention` (the model installs the masked attention backend),
  `supports_accelerated_stream` (ARLA's accelerated stream can run in its layer loop),
  `stores_exit_states` (an `ExitStateStore` is kept next to the KV cache);
- once loaded: `weights_loaded` (float weights are in place), `kv_cache_ready` (the KV
  cache exists and ``state`` with it);
- planning a step: `plan_decode` / `plan_prefill` per row, into the step's `PlanDraft`;
- running it: `step_mask` (the KV mask attention applies) and `before_layers`, then the
  runtime's depth-peeling loop, which calls `exited` for rows that stop at a layer; a strategy
  that runs every row through every layer (``owns_layer_loop``) gives its own `run_layers`;
- committing it: `fills_every_layer` (every slot written this step has K/V at every layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vllm_adaptive.depth.attention_port import LayerSwaps, StepAttention
from vllm_adaptive.depth.backfill import ExitStateStore
from vllm_adaptive.depth.counters import EngineCounters
from vllm_adaptive.depth.mask_context import StepMask
from vllm_adaptive.depth.record import SlotDepthRecord
from vllm_adaptive.depth.schedule import DepthSchedule
from vllm_adaptive.depth.step import StepPlan

if TYPE_CHECKING:
    from vllm_adaptive.depth.exit_decisions import ExitDecisions
    from vllm_adaptive.models.interface import ModelParts


@dataclass
class KvState:
    """What a KV strategy reads and writes besides the step's own tensors."""

    num_layers: int
    record: SlotDepthRecord
    store: ExitStateStore | None  # exit states per slot (recompute, refresh), None: not kept
    counters: EngineCounters
    attention: StepAttention
    schedule: DepthSchedule
    warn_once: Callable[[str, str], None]


@dataclass
class PlanDraft:
    """The parts of a step's plan that strategies shape, while the runtime plans its rows."""

    cap: np.ndarray  # [R] int64, deepest layer each row may run
    all_visible_below: int  # mask: layers below see every cached slot
    resume: list  # recompute: (row, position, slot, depth) of tokens to resume


class KvStrategy:
    name: ClassVar[str]
    needs_masked_attention: ClassVar[bool] = False
    supports_accelerated_stream: ClassVar[bool] = True
    stores_exit_states: ClassVar[bool] = False
    fills_every_layer: ClassVar[bool] = False
    #: runs every row through every layer in its own `run_layers` instead of depth-peeling
    owns_layer_loop: ClassVar[bool] = False
    #: runs decoder blocks of its own (``LayerParts.run_block``) besides the runtime's loop
    runs_blocks: ClassVar[bool] = False
    #: what the strategy needs of the model beyond depth-peeling, for refusals that name it
    model_needs: ClassVar[str] = "needs only depth-peeling"

    @classmethod
    def from_config(cls, depth_config: Any) -> KvStrategy:
        return cls()

    # -- engine start --------------------------------------------------------------------------
    @classmethod
    def check_engine(cls, depth_config: Any, num_layers: int) -> str | None:
        """Why this engine cannot run the strategy (an `AdaptiveConfigError` message), or None."""
        return None

    def weights_loaded(self, parts: ModelParts, num_layers: int) -> None:
        """The model's float weights are loaded."""

    def kv_cache_ready(self, state: KvState, parts: ModelParts) -> None:
        """The KV cache is allocated; ``state`` is on its device."""

    # -- 1. plan -------------------------------------------------------------------------------
    def plan_decode(
        self,
        state: KvState,
        parts: ModelParts,
        draft: PlanDraft,
        row: int,
        block_row: torch.Tensor,
        pos: int,
        t: int,
    ) -> None:
        """A decode row ``row`` whose token is at position ``pos``, generated token ``t``."""

    def plan_prefill(self, state: KvState, draft: PlanDraft, row: int, low: int | None) -> None:
        """A prefill row whose cached context has ``low`` as its shallowest depth record (None:
        no context). By default the row is capped there: it cannot attend to K/V of layers
        that were never written."""
        if low is not None and low < state.num_layers:
            if low <= 0:
                state.warn_once("ctx0", "vllm-adaptive depth: unrecorded context slot")
            else:
                draft.cap[row] = low
                state.counters.capped_prefills += 1

    # -- 2. run --------------------------------------------------------------------------------
    def step_mask(self, state: KvState, plan: StepPlan) -> StepMask | None:
        """The KV mask the attention backend applies during the step, None: none."""
        return None

    def before_layers(
        self, state: KvState, parts: ModelParts, swaps: LayerSwaps, md: Any, plan: StepPlan
    ) -> None:
        """Runs with the step's metadata swappable (``swaps``), before the first layer."""

    def exited(
        self,
        state: KvState,
        parts: ModelParts,
        stream: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        count: int,
    ) -> None:
        """Tokens in ``slots`` stopped after ``count`` blocks with exit state ``stream``."""

    def run_layers(
        self,
        state: KvState,
        parts: ModelParts,
        exits: ExitDecisions,
        md: Any,
        plan: StepPlan,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        input_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's layer loop when ``owns_layer_loop``: ``(output stream, depth per row)``."""
        raise NotImplementedError(f"kv_strategy {self.name!r} runs the runtime's depth-peeling")
