"""What one step of the depth runtime's layer loop works on: the plan, the step's fixed inputs,
and the rows still running. Shared by the runtime and the KV strategies (`kv_strategies/`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts


@dataclass
class StepPlan:
    cap: torch.Tensor  # [R] int64, deepest layer each row may run
    floor: torch.Tensor  # [R] int64, shallowest probe a row may stop at
    may_exit: torch.Tensor  # [R] bool, decode rows with the exit signal on
    thresholds: torch.Tensor  # [R, P] float32
    decode: np.ndarray  # [R] bool
    samples: np.ndarray  # [R] bool: the row's last token is sampled (decode, last prefill chunk)
    states: list | None
    all_visible_below: int  # mask strategy: layers below see every cached slot
    resume: list  # recompute strategy: (row, position, slot, depth) of tokens to resume
    fusion: Any = None  # token fusion: the step's `fusion_runtime.StepFusion`, None: no fusion
    #: [R, P] bool: row r may exit at probe p (`ExitDecisions.candidate_matrix`); None: no row
    candidates: torch.Tensor | None = None


@dataclass
class Step:
    """What a step's layer loop runs on, fixed for the step."""

    parts: ModelParts
    md: Any  # the step's attention metadata (all rows)
    plan: StepPlan
    input_ids: torch.Tensor | None
    swaps: Any = None  # the step's `attention_port.LayerSwaps` (None: metadata never swapped)


@dataclass
class ActiveRows:
    """The rows a layer loop still runs, and the state of their tokens."""

    rows: torch.Tensor  # [A] the active rows, ascending
    qsl: torch.Tensor  # [A + 1] CPU int64, their tokens' start in ``h``
    tok: torch.Tensor  # [T] active token -> step token
    pos: torch.Tensor  # [T] positions
    h: torch.Tensor  # [T, H] hidden, with ``res`` the residual stream ``h + res``
    res: torch.Tensor | None
