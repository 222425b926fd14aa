"""The interface every KV strategy implements, and the plan fields a strategy shapes.

The depth runtime (`depth/runtime.py`) owns the step: plan, layer loop, commit. What differs
between strategies is what happens to the K/V of layers a token skipped (see
docs/kv-strategies.md), and the runtime asks the strategy at these points only:

- at engine start: `check_engine` (settings the config cannot check alone), and the flags
  `needs_masked_attention` (the model installs the masked attention backend),
  `supports_accelerated_stream` (ARLA's accelerated stream can run in its layer loop),
  `stores_exit_states` (an `ExitStateStore` is kept next to the KV cache);
- once loaded: `weights_loaded` (float weights are in place), `kv_cache_ready` (the KV
  cache exists and the runtime is on its device);
- planning a step: `plan_decode` / `plan_prefill` per row, on a `PlanDraft`;
- running it: `run_layers` (the whole layer loop; by default depth-peeling, around which
  `step_mask` and `before_layers` run), and `exited` for rows that stop at a layer;
- committing it: `fills_every_layer` (every slot written this step has K/V at every layer).

A strategy holds no engine state of its own except what it builds (the Exit River); it reads
and writes the runtime's record, store and counters through the runtime passed to each hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vllm_adaptive.depth.mask_context import StepMask, publish_mask
from vllm_adaptive.engine.attention_metadata import layer_metadata_swaps

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts


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

    def weights_loaded(self, runtime: Any, parts: ModelParts) -> None:
        """The model's float weights are loaded."""

    def kv_cache_ready(self, runtime: Any, parts: ModelParts) -> None:
        """The KV cache is allocated; the runtime's record and state are on its device."""

    # -- 1. plan -------------------------------------------------------------------------------
    def plan_decode(
        self,
        runtime: Any,
        parts: ModelParts,
        draft: PlanDraft,
        row: int,
        block_row: torch.Tensor,
        pos: int,
        t: int,
    ) -> None:
        """A decode row ``row`` whose token is at position ``pos``, generated token ``t``."""

    def plan_prefill(self, runtime: Any, draft: PlanDraft, row: int, low: int | None) -> None:
        """A prefill row whose cached context has ``low`` as its shallowest depth record (None:
        no context). By default the row is capped there: it cannot attend to K/V of layers
        that were never written."""
        L = runtime.num_layers
        if low is not None and low < L:
            if low <= 0:
                runtime.warn_once("ctx0", "vllm-adaptive depth: unrecorded context slot")
            else:
                draft.cap[row] = low
                runtime.counters.capped_prefills += 1

    # -- 2. run --------------------------------------------------------------------------------
    def run_layers(
        self,
        runtime: Any,
        parts: ModelParts,
        md: Any,
        plan: Any,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        input_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's layer loop: ``(output stream, depth per row)``. By default depth-peeling
        with the step's attention metadata swapped per peel and the strategy's mask published."""
        mask = self.step_mask(runtime, plan)
        with layer_metadata_swaps(runtime.layer_names) as ctx, publish_mask(mask):
            self.before_layers(runtime, parts, ctx, md, plan)
            return runtime._peel(parts, ctx, md, plan, positions, hidden, input_ids)

    def step_mask(self, runtime: Any, plan: Any) -> StepMask | None:
        """The KV mask the attention backend applies during the step, None: none."""
        return None

    def before_layers(self, runtime: Any, parts: ModelParts, ctx: Any, md: Any, plan: Any) -> None:
        """Runs inside the step's metadata context, before the first layer."""

    def exited(
        self,
        runtime: Any,
        parts: ModelParts,
        stream: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        count: int,
    ) -> None:
        """Tokens in ``slots`` stopped after ``count`` blocks with exit state ``stream``."""
