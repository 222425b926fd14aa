"""The geared linear: one mlx-lm linear plus packed tiers, switched per forward pass.

Mechanism only. A `GearSwitch` shared by every geared linear of a model holds the code of the
pass about to run (0 low, 1 mid, 2 high: a policy's level; 3 off: full precision), and each
linear maps codes to its own precisions (its layer group's ``(low, mid, high)``). The switch is
set before a forward and never changes inside one, so a pass runs one gear, as the vLLM path's
step routing does; at batch 1 that is also its token routing.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from vllm_adaptive.metal_backend.quant import QuantTier

OFF = 3  # the code of a request with ``adaptive_mode: off``: full precision everywhere


class GearSwitch:
    """The code the next forward runs at; set by the engine, read by every geared linear."""

    def __init__(self, code: int = OFF) -> None:
        self.code = code


class MlxGearedLinear(nn.Module):
    """``nn.Linear`` whose weight runs at the precision its code maps to."""

    def __init__(
        self,
        linear: nn.Module,
        precisions: tuple[str, ...],
        tiers: dict[str, QuantTier],
        switch: GearSwitch,
    ) -> None:
        super().__init__()
        self.full = linear
        # plain attributes (not parameters): the tiers are derived data of ``full``
        object.__setattr__(self, "_precisions", tuple(precisions) + ("full",))
        object.__setattr__(self, "_tiers", dict(tiers))
        object.__setattr__(self, "_switch", switch)
        missing = {p for p in precisions if p != "full"} - set(tiers)
        if missing:
            raise ValueError(f"no packed tier for {sorted(missing)}")

    @property
    def precisions(self) -> tuple[str, ...]:
        """Precision of each code (the last is OFF: full)."""
        return self._precisions

    @property
    def tiers(self) -> dict[str, QuantTier]:
        return self._tiers

    def precision(self) -> str:
        return self._precisions[self._switch.code]

    def __call__(self, x: mx.array) -> mx.array:
        p = self._precisions[self._switch.code]
        if p == "full":
            return self.full(x)
        y = self._tiers[p].matmul(x)
        bias = self.full.get("bias")
        return y if bias is None else y + bias

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.full.weight.shape
        return int(n), int(k)

    def full_bytes(self) -> int:
        return int(self.full.weight.nbytes)


def install(parent: Any, attr: str, geared: MlxGearedLinear) -> None:
    """Put ``geared`` in place of ``parent.<attr>``."""
    setattr(parent, attr, geared)
