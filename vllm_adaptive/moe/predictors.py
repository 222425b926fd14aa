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
- ``m2r2`` (M2R2's accelerated residual, appendix A.3): trained adapters
  (:mod:`vllm_adaptive.moe.m2r2`) map layer l's residual stream to an estimate of layer j's,
  whose ``post_attention_layernorm`` and router then name layer j's experts (top-k union over
  the batch). It reads the ``residual`` argument.
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

    def bind(
        self,
        routers: Sequence[torch.Tensor],
        top_k: int,
        norms: Sequence[torch.Tensor] | None = None,
        eps: float = 1e-5,
    ) -> None:
        """The model's routers (layer -> weight [E, hidden]), its top-k and, for predictors that
        read the residual stream, every layer's ``post_attention_layernorm`` weight and eps."""
        self.routers, self.top_k = routers, top_k
        self.norms, self.eps = norms, eps

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


class M2R2Predictor(ExpertPredictor):
    """Layer j's router on the adapters' estimate of layer j's residual (module docstring)."""

    name = "m2r2"

    def __init__(self, lookahead: int = 1, adapters=None) -> None:
        super().__init__(lookahead)
        if adapters is None:
            raise ValueError('predictor "m2r2" needs trained adapters (adaptive.moe.m2r2_adapters)')
        if lookahead > adapters.config.distances:
            raise ValueError(
                f"lookahead {lookahead} > the adapters' {adapters.config.distances} distances"
            )
        self.adapters = adapters
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _layer(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        if j not in self._cache:  # float32 copies, made once
            if self.norms is None:
                raise RuntimeError("m2r2: bind() without the layers' norms")
            self._cache[j] = (self.norms[j].float(), self.routers[j].float())
        return self._cache[j]

    def predict(
        self, layer: int, mlp_input: torch.Tensor, residual: torch.Tensor | None
    ) -> dict[int, list[int]]:
        from vllm_adaptive.moe.m2r2 import rms_norm

        out: dict[int, list[int]] = {}
        if residual is None or residual.shape[0] == 0:
            return out
        h = residual.float()
        with torch.no_grad():
            for j in self.targets(layer):
                est = self.adapters.estimate(layer, j - layer, h)
                norm, router = self._layer(j)
                logits = rms_norm(est, norm, self.eps) @ router.t()
                out[j] = torch.unique(logits.topk(self.top_k, dim=-1).indices).tolist()
        return out


PREDICTORS: dict[str, type[ExpertPredictor]] = {
    ExpertPredictor.name: ExpertPredictor,
    PregatePredictor.name: PregatePredictor,
    M2R2Predictor.name: M2R2Predictor,
}


def make_predictor(name: str, lookahead: int = 1, adapters=None) -> ExpertPredictor:
    """``adapters``: the :class:`~vllm_adaptive.moe.m2r2.StreamAdapters` of ``m2r2``."""
    try:
        cls = PREDICTORS[name]
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; known: {sorted(PREDICTORS)}") from None
    if cls is M2R2Predictor:
        return cls(lookahead, adapters)
    return cls(lookahead)
