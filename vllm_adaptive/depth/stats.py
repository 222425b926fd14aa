"""Decode tokens by the depth they ran: the statistics every depth engine reports (the vLLM
runtime and the MLX adapter), kept and summarised in one place so that both report the same
keys with the same meaning."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodeDepthStats:
    decode_tokens: int = 0
    layers_executed: int = 0  # decode token-layers
    probe_evals: int = 0  # (token, probe layer) exit-signal evaluations
    exit_tokens: dict[int, int] = field(default_factory=dict)  # decode tokens by depth

    def observe(self, depths: Iterable[int]) -> None:
        """The depths the decode tokens of one step ran."""
        for d in depths:
            self.decode_tokens += 1
            self.layers_executed += d
            self.exit_tokens[d] = self.exit_tokens.get(d, 0) + 1

    def summary(self) -> dict[str, Any]:
        """The report's keys: counts, the mean decode depth and the depth histogram."""
        return {
            "decode_tokens": self.decode_tokens,
            "layers_executed": self.layers_executed,
            "probe_evals": self.probe_evals,
            "mean_decode_depth": (
                self.layers_executed / self.decode_tokens if self.decode_tokens else None
            ),
            "exit_tokens": {str(k): v for k, v in sorted(self.exit_tokens.items())},
        }
