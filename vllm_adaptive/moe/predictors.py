"""Expert predictors: given layer l's state, name the experts of layers l+1..l+d to prefetch.

One small interface (:class:`ExpertPredictor`) so the runtime does not care which predictor
runs. Each MoE layer calls :meth:`ExpertPredictor.predict` with its MLP input (after
``post_attention_layernorm``) and its residual stream (the pre-norm hidden state after
attention) *before* computing its own experts, and the runtime prefetches what comes back while
this layer and the next layers' attention compute.

- ``none``: predicts nothing; every expert is loaded on demand.
- ``pregate`` (Pre-gated MoE, Hwang et al. 2024): layer j's router applied ahead of time to
  layer l's MLP input, j = l+1..l+d; the union over the batch's tokens of each token's top-k.
  It needs no training: the routers of the MoEfied model are small and stay resident.
- M2R2's accelerated residual stream (next): trained adapters map layer l's residual stream to
  an estimate of layer j's, whose router then names the experts; it gets the ``residual``
  argument for that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ExpertPredictor:
    """Base: predicts nothing (on-demand loads only)."""

    name = "none"

    def __init__(self, lookahead: int = 1) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.lookahead = lookahead
        self.routers: Sequence[torch.Tensor] = ()
        self.top_k = 0

    def bind(self, routers: Sequence[torch.Tensor], top_k: int) -> None:
        """The model's routers (layer -> weight [E, hidden]) and its top-k."""
        self.routers, self.top_k = routers, top_k

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def targets(self, layer: int) -> range:
        """The layers a prediction at ``layer`` covers: l+1..l+d, within the model."""
        return range(layer + 1, min(layer + 1 + self.lookahead, self.num_layers))

    def predict(
        self, layer: int, mlp_input: torch.Tensor, residual: torch.Tensor | None
    ) -> dict[int, list[int]]:
        """Layer -> sorted experts to prefetch, for layers in :meth:`targets` (may omit some)."""
        return {}


class PregatePredictor(ExpertPredictor):
    """Layer j's router on layer l's MLP input (see the module docstring)."""

    name = "pregate"

    def predict(
        self, layer: int, mlp_input: torch.Tensor, residual: torch.Tensor | None
    ) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        if mlp_input.shape[0] == 0:
            return out
        for j in self.targets(layer):
            logits = mlp_input @ self.routers[j].t()
            chosen = logits.topk(self.top_k, dim=-1).indices
            out[j] = torch.unique(chosen).tolist()
        return out


PREDICTORS: dict[str, type[ExpertPredictor]] = {
    ExpertPredictor.name: ExpertPredictor,
    PregatePredictor.name: PregatePredictor,
}


def make_predictor(name: str, lookahead: int = 1) -> ExpertPredictor:
    try:
        cls = PREDICTORS[name]
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; known: {sorted(PREDICTORS)}") from None
    return cls(lookahead)
