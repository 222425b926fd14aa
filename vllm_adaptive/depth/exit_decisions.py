"""Which rows stop at a probe layer, and what a stopped row emits: the plan's candidates, the
exit signal's verdict on them (`policies/`), and the calibrated readout ``a_l * RMSNorm(h) +
b_l``. Shared by every layer loop (the runtime's depth-peeling, the Exit River's own loop)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_adaptive.depth.counters import EngineCounters
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.policies.probe import ProbeBatch
from vllm_adaptive.depth.step import ActiveRows, Step, StepPlan


class ExitDecisions:
    def __init__(
        self,
        signal: Any,
        profile: ExitProfile,
        eps: float,
        counters: EngineCounters,
        emad_only: bool,
    ) -> None:
        self.signal = signal
        #: EMAD alone: a threshold below the proxy's floor can never pass, so such a row is no
        #: candidate (no signal work for it)
        self.emad_only = emad_only
        self.probe_index = {layer: p for p, layer in enumerate(profile.probe_layers)}
        self.probe_layers = np.asarray(profile.probe_layers, dtype=np.int64)
        self.proxy_floor_np = np.asarray(profile.proxy_floor, dtype=np.float64)
        self.norm_a, self.norm_b = profile.norm_a, profile.norm_b
        self.eps = eps
        self.counters = counters

    def to(self, device: torch.device) -> None:
        self.norm_a, self.norm_b = self.norm_a.to(device), self.norm_b.to(device)
        if hasattr(self.signal, "to"):
            self.signal.to(device)

    def probe(self, count: int) -> int | None:
        """The probe index after ``count`` blocks; None: no probe there."""
        return self.probe_index.get(count)

    def needs_prev(self, count: int) -> bool:
        """The signal reads the block's input stream at ``count`` (River-LLM's cosine)."""
        return self.signal.needs_prev_stream and (count in self.probe_index)

    def candidate_matrix(
        self, cap: np.ndarray, floor: np.ndarray, may_exit: np.ndarray, thresholds: np.ndarray
    ) -> torch.Tensor | None:
        """[R, P] bool, once per step: row r may exit at probe p (its signal on, the probe within
        its floor and cap, and for EMAD alone a threshold the proxy can reach). None where no
        row may exit anywhere, so that the layer loop skips every probe without a cap there."""
        cand = (
            may_exit[:, None]
            & (floor[:, None] <= self.probe_layers[None, :])
            & (cap[:, None] > self.probe_layers[None, :])
        )
        if self.emad_only:
            cand &= thresholds >= self.proxy_floor_np[None, :]  # else it cannot pass
        return torch.from_numpy(cand) if cand.any() else None

    def candidates(self, plan: StepPlan, rows: torch.Tensor, p: int) -> torch.Tensor:
        """Rows (of the active ``rows``) that may exit at probe ``p``."""
        if plan.candidates is None:
            return torch.zeros(rows.shape[0], dtype=torch.bool)
        return plan.candidates[rows, p]

    def live_probes(self, plan: StepPlan) -> list[bool]:
        """Per probe: whether any row of the step may exit there."""
        if plan.candidates is None:
            return [False] * len(self.probe_layers)
        return plan.candidates.any(0).tolist()

    def readout(self, p: int, stream: torch.Tensor) -> torch.Tensor:
        """The calibrated readout at probe ``p`` of residual streams ``stream``."""
        x = stream.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.norm_a[p] + self.norm_b[p]

    def decide(
        self,
        step: Step,
        act: ActiveRows,
        count: int,
        j: torch.Tensor,
        prev: torch.Tensor | None,
        acc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exit mask for the candidate rows ``j`` (of ``act``, decode rows: one token each)
        after ``count`` blocks; ``prev``: the block's input stream when the signal needs it;
        ``acc``: their accelerated states when ``count`` is an ARLA gate."""
        p = self.probe_index[count]
        h, res = act.h, act.res
        first = act.qsl[j].to(h.device)
        self.counters.probe_evals += int(j.numel())
        ids = None
        if step.input_ids is not None and self.signal.needs_token_ids:
            ids = step.input_ids[act.tok[first]]
        batch = ProbeBatch(
            layer=count,
            probe=p,
            stream=h[first] + res[first],
            prev_stream=None if prev is None else prev[first],
            token_ids=ids,
            readout=lambda x, p=p: self.readout(p, x),
            thresholds=step.plan.thresholds[act.rows[j], p].to(h.device),
            accelerated=acc,
        )
        return self.signal.exit_mask(batch).cpu()
