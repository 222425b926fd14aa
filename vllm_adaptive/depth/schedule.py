"""EMAD's depth schedule per request (sec. 2.2): monotone caps, the floor and windowed refresh.

Pure arithmetic on layer counts. Depths are always readout layers (a probe layer or the full
model), so every rule snaps up to the next readout layer.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DepthSchedule:
    readout_layers: tuple[int, ...]  # ascending, last == num_layers
    floor_tokens: int = 0
    floor_min: int | None = None
    refresh_every: int | None = None
    refresh_raise: int = 0

    @classmethod
    def for_config(cls, readout_layers: tuple[int, ...], floor: Any, refresh: Any) -> DepthSchedule:
        """The schedule of an ``adaptive.depth`` config's ``floor`` and ``refresh`` sections
        (either None) over a profile's readout layers: the vLLM runtime and the MLX adapter
        build it here, so that both apply the same floors and caps."""
        return cls(
            readout_layers=tuple(readout_layers),
            floor_tokens=floor.tokens if floor is not None else 0,
            floor_min=floor.min_layers if floor is not None else None,
            refresh_every=refresh.every if refresh is not None else None,
            refresh_raise=refresh.raise_layers if refresh is not None else 0,
        )

    @property
    def num_layers(self) -> int:
        return self.readout_layers[-1]

    def snap_up(self, layers: int) -> int:
        i = bisect.bisect_left(self.readout_layers, layers)
        return self.readout_layers[min(i, len(self.readout_layers) - 1)]

    def floor(self, t: int) -> int:
        """F_t for the t-th generated token (t >= 1): a linear taper from L to F_min over the
        first `floor_tokens` tokens; 0 when there is no floor."""
        if self.floor_tokens <= 0:
            return 0
        low = self.floor_min if self.floor_min is not None else self.readout_layers[0]
        frac = min(1.0, t / self.floor_tokens)
        return self.snap_up(math.ceil(self.num_layers - frac * (self.num_layers - low)))

    def is_refresh(self, t: int) -> bool:
        return bool(self.refresh_every) and t > 0 and t % self.refresh_every == 0

    def cap(self, t: int, previous_depth: int) -> int:
        """The deepest layer token t may run: D_{t-1}, or min(L, D_{t-1} + R) at a refresh."""
        if self.is_refresh(t):
            return self.snap_up(min(self.num_layers, previous_depth + self.refresh_raise))
        return previous_depth
