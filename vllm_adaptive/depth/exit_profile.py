"""A calibration profile as the runtime uses it: probe layers, readout norms, proxy factors,
and the q-table that turns any budget into per-layer exit thresholds; plus, when it was
calibrated with ``--signal quicksilver`` / ``--signal river``, those signals' thresholds (None
otherwise: older profiles load unchanged).

``ExitProfile.load(..., framework="numpy")`` holds numpy arrays instead of torch tensors and
imports no torch (the MLX backend's path); the default keeps torch tensors for the vLLM runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_adaptive.artifacts import ProfileError, load_profile

_REQUIRED = (
    "norm_a",
    "norm_b",
    "lowrank_u",
    "lowrank_v",
    "threshold",
    "table_thresholds",
    "table_layers_fraction",
    "table_flops_fraction",
)


@dataclass
class ExitProfile:
    probe_layers: list[int]  # exits after this many blocks (ascending, < num_layers)
    num_layers: int
    temperature: float
    budget: float
    budget_kind: str  # "layers" | "flops"
    norm_a: Any  # [P, d] float32 (torch tensor, or numpy array with framework="numpy")
    norm_b: Any  # [P, d]
    lowrank_u: Any  # [V, r]
    lowrank_v: Any  # [d, r]
    proxy: str  # "lowrank" | "feature": the proxy the thresholds were calibrated for
    feature_knots: list[tuple[Any, Any]]  # per probe, isotonic map knots (float64)
    topk: int
    proxy_floor: np.ndarray  # [P] smallest proxy value: thresholds below it never pass
    thresholds: np.ndarray  # [P] at the profile's own budget
    table_thresholds: np.ndarray  # [Q, P], rows by increasing q (more exits)
    table_cost: np.ndarray  # [Q] simulated cost fraction of each row (budget_kind)
    path: str = ""
    special_token_ids: tuple[int, ...] = ()  # the tokenizer's, at calibration
    quicksilver_thresholds: tuple[float, float] | None = None  # (drift, entropy in nats)
    quicksilver_entropy: str = "proxy"  # which entropy the thresholds were calibrated for
    river_tau: float | None = None
    river_table_tau: np.ndarray | None = None  # [R] candidate taus, ascending
    river_table_cost: np.ndarray | None = None  # [R] simulated cost fraction (budget_kind)

    @classmethod
    def load(
        cls, profile_dir: str | Path, model_dir: str | Path, framework: str = "pt"
    ) -> ExitProfile:
        """Load and check a profile for ``model_dir``; `ProfileError` says what is wrong.
        ``framework``: "pt" (torch tensors) or "numpy" (numpy arrays, no torch import)."""
        prof = load_profile(profile_dir, model_dir, framework="numpy")
        missing = [k for k in _REQUIRED if k not in prof.tensors]
        if missing:
            raise ProfileError(
                f"profile {profile_dir} lacks {missing}: made by an older calibrate; recalibrate"
            )
        m, t = prof.meta, prof.tensors
        if framework == "pt":
            import torch

            def arr(a: np.ndarray, dtype: Any = np.float32) -> Any:
                return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
        elif framework == "numpy":

            def arr(a: np.ndarray, dtype: Any = np.float32) -> Any:
                return np.ascontiguousarray(a, dtype=dtype)
        else:
            raise ValueError(f'framework must be "pt" or "numpy", not {framework!r}')

        def f64(name: str) -> np.ndarray:
            return np.asarray(t[name], dtype=np.float64)

        kind = m.get("budget_kind", "layers")
        return cls(
            probe_layers=[int(x) for x in m["probe_layers"]],
            num_layers=int(m["num_layers"]),
            temperature=float(m.get("temperature", 1.0)),
            budget=float(m["budget"]),
            budget_kind=kind,
            norm_a=arr(t["norm_a"]),
            norm_b=arr(t["norm_b"]),
            lowrank_u=arr(t["lowrank_u"]),
            lowrank_v=arr(t["lowrank_v"]),
            proxy=str(m.get("proxy", "lowrank")),
            feature_knots=[
                (arr(t[f"feature_knots_x.{p}"], None), arr(t[f"feature_knots_y.{p}"], None))
                for p in range(len(m["probe_layers"]))
                if f"feature_knots_x.{p}" in t
            ],
            topk=int(m.get("topk", 32)),
            proxy_floor=(
                f64("proxy_floor") if "proxy_floor" in t else np.zeros(len(m["probe_layers"]))
            ),
            thresholds=f64("threshold"),
            table_thresholds=f64("table_thresholds"),
            table_cost=f64(f"table_{kind}_fraction"),
            path=str(profile_dir),
            special_token_ids=tuple(int(i) for i in m.get("special_token_ids", [])),
            quicksilver_thresholds=(
                tuple(float(x) for x in np.asarray(t["quicksilver_thresholds"]).tolist())
                if "quicksilver_thresholds" in t
                else None
            ),
            quicksilver_entropy=str(m.get("quicksilver", {}).get("entropy", "proxy")),
            river_tau=float(t["river_tau"][0]) if "river_tau" in t else None,
            river_table_tau=f64("river_table_tau") if "river_table_tau" in t else None,
            river_table_cost=(
                f64(f"river_table_{kind}_fraction") if f"river_table_{kind}_fraction" in t else None
            ),
        )

    @property
    def readout_layers(self) -> list[int]:
        """Depths a token can end at: every probe layer, and the full model."""
        return [*self.probe_layers, self.num_layers]

    def thresholds_for(self, budget: float) -> np.ndarray:
        """Per-probe exit thresholds whose simulated cost fits ``budget``.

        1.0 means no exits (thresholds of -inf). The profile's own budget: the thresholds it
        was calibrated to (for a profile calibrated to an agreement target, those of the target:
        the simulated cost is not monotone in q, so the table's first row within the same cost
        can be a more aggressive one). Otherwise the most conservative row of the q-table whose
        cost is within the budget; if no row reaches it, the cheapest row.
        """
        if budget >= 1.0:
            return np.full(len(self.probe_layers), -np.inf)
        if abs(budget - self.budget) < 1e-9:
            return self.thresholds
        fits = np.nonzero(self.table_cost <= budget + 1e-9)[0]
        row = int(fits[0]) if len(fits) else int(np.argmin(self.table_cost))
        return self.table_thresholds[row]

    def river_tau_for(self, budget: float) -> float:
        """River's tau whose simulated cost fits ``budget``: the largest (most conservative)
        candidate within it; 1.0 (never exits) for budget 1.0; the cheapest if none fits."""
        if self.river_table_tau is None or self.river_table_cost is None:
            raise ProfileError(f"profile {self.path} has no River table; calibrate --signal river")
        if budget >= 1.0:
            return 1.0
        fits = np.nonzero(self.river_table_cost <= budget + 1e-9)[0]
        row = int(fits[-1]) if len(fits) else int(np.argmin(self.river_table_cost))
        return float(self.river_table_tau[row])
