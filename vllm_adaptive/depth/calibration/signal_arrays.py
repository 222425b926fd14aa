"""The per-token inputs of the exit signals at each probe layer, cut into decode streams.

The calibration of QuickSilver and River, and their exit simulation, work on these arrays
([P, S, K]: probe layers, streams, positions) rather than on hidden states: drift and cosine
come from `collect` for every layer, the entropy is the EMAD profile's proxy at each probe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SignalArrays:
    probe_layers: list[int]  # ascending, 1-based block counts
    drift: np.ndarray  # [P, S, K] ||h_l - h_{l-1}||_2 at each probe layer l
    cosine: np.ndarray  # [P, S, K] cos(h_{l-1}, h_l)
    entropy: np.ndarray  # [P, S, K] the runtime's entropy (proxy of the calibrated readout)
    token_ids: np.ndarray  # [S, K] input token of each position

    @classmethod
    def from_collected(
        cls,
        probe_layers: list[int],
        drift: np.ndarray,
        cosine: np.ndarray,
        entropy: np.ndarray,
        token_ids: np.ndarray,
        num_streams: int,
        stream_len: int,
        streams: np.ndarray,
    ) -> SignalArrays:
        """``drift``/``cosine``: [L-1, N] for every layer (row l-1 is layer l); ``entropy``:
        [P, N] at the probes; keeps the streams ``streams`` (N = num_streams * stream_len)."""
        rows = np.asarray(probe_layers) - 1
        S, K = num_streams, stream_len

        def cut(a: np.ndarray) -> np.ndarray:
            return a.reshape(a.shape[0], S, K)[:, streams]

        return cls(
            probe_layers=list(probe_layers),
            drift=cut(drift[rows]),
            cosine=cut(cosine[rows]),
            entropy=cut(entropy),
            token_ids=token_ids.reshape(S, K)[streams],
        )


def layer_quantiles(a: np.ndarray, layers: list[int], qs: tuple[float, ...]) -> dict[str, list]:
    """Percentiles ``qs`` of ``a`` [P, ...] per probe layer, for the profile's figures."""
    q = np.percentile(a.reshape(a.shape[0], -1), qs, axis=1)
    return {
        "layers": list(layers),
        **{f"q{p:g}": row.tolist() for p, row in zip(qs, q, strict=True)},
    }
