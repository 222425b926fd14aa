"""What every adaptive twin of a stock vLLM model class shares.

:class:`AdaptiveCausalLM` is mixed in before the stock class (``class
AdaptiveLlamaForCausalLM(AdaptiveCausalLM, LlamaForCausalLM)``): it implements
:class:`~vllm_adaptive.models.interface.SupportsAdaptive` from the architecture's
``_build_parts`` and wires the mechanisms that hold on every architecture (precision gears,
self-drafts, the depth runtime where the architecture attached one) into loading, the forward
and the logits. :func:`stack_parts` reads vLLM's usual decoder-only layout
(``model.{embed_tokens, layers, norm}``, ``lm_head``) so an architecture file only says what
one of its layers is made of.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from vllm_adaptive.config import AdaptiveConfig, AdaptiveConfigError
from vllm_adaptive.engine.attention_metadata import step_query_start_loc
from vllm_adaptive.engine.vllm_api import IntermediateTensors, VllmConfig
from vllm_adaptive.models.interface import LayerParts, ModelParts
from vllm_adaptive.models.precision import calibrate_from_prefill, install_precision
from vllm_adaptive.precision.controller import PrecisionController


def stack_parts(
    causal_lm: nn.Module,
    layer_parts: Callable[[int, nn.Module], LayerParts],
    embedding_scale: float | None = None,
) -> ModelParts:
    """The parts of a vLLM ``*ForCausalLM`` laid out as ``model.{embed_tokens, layers, norm,
    start_layer, end_layer}`` and ``lm_head``; ``layer_parts(i, layer)`` describes one decoder
    layer of this pipeline stage."""
    inner = causal_lm.model
    config = causal_lm.config
    layers = tuple(
        layer_parts(i, inner.layers[i]) for i in range(inner.start_layer, inner.end_layer)
    )
    return ModelParts(
        embed=inner.embed_input_ids,
        embedding=inner.embed_tokens,
        layers=layers,
        final_norm=inner.norm,
        head=causal_lm.lm_head,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        embedding_scale=embedding_scale,
    )


class HasAdaptiveParts:
    """Mixin implementing ``SupportsAdaptive`` from the architecture's ``_build_parts``."""

    supports_adaptive: ClassVar[Literal[True]] = True

    def _build_parts(self) -> ModelParts:
        raise NotImplementedError

    def adaptive_parts(self) -> ModelParts:
        """The model's parts, built once (the modules stay in place afterwards: gears swap
        quant methods and the river maps weights on the same linears)."""
        parts = self.__dict__.get("_adaptive_parts")
        if parts is None:
            parts = self._build_parts()
            self.__dict__["_adaptive_parts"] = parts
        return parts


class AdaptiveCausalLM(HasAdaptiveParts):
    """Mixin for an adaptive twin; see the module docstring. The architecture sets
    ``self.depth`` (None where it has no depth runtime) and implements ``_build_parts``."""

    adaptive_config: AdaptiveConfig
    precision: PrecisionController | None
    depth: Any

    def _init_adaptive(self, vllm_config: VllmConfig, adaptive: AdaptiveConfig) -> None:
        """After the stock constructor: the state the mechanisms fill in at load."""
        self.adaptive_config = adaptive
        self.precision = None
        self._tokenizer_path = vllm_config.model_config.tokenizer
        self._model_dir = vllm_config.model_config.model
        self._speculates = vllm_config.speculative_config is not None
        self.speculative_draft = None  # built at load_weights when adaptive.speculative is on
        self.depth = None  # read by the introspection and the proposer
        self.hybrid_drafts = None  # read by the model runner (intrusion hybrid-drafts)
        spec = vllm_config.speculative_config
        if getattr(spec, "method", None) == "suffix" and getattr(
            spec, "num_speculative_tokens_per_batch_size", None
        ):
            from vllm_adaptive.engine import intrusions

            intrusions.apply("suffix-dynamic-k")  # vLLM's suffix proposer asserts a fixed k
        if adaptive.active_hybrid is not None:
            from vllm_adaptive.engine import intrusions
            from vllm_adaptive.speculative.hybrid import HybridDrafts

            intrusions.apply("hybrid-drafts")
            self.hybrid_drafts = HybridDrafts(vllm_config, adaptive.active_hybrid)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)  # type: ignore[misc]
        if self.depth is not None:
            self.depth.weights_loaded()
        if self.adaptive_config.active_speculative is not None:
            # Packed draft weights are made from the float ones, which vLLM's CPU weight
            # processing (oneDNN prepacking) removes once loading ends.
            from vllm_adaptive.speculative.drafts import build_draft

            try:
                self.speculative_draft = build_draft(
                    self.adaptive_config.active_speculative, self, self._model_dir
                )
            except ValueError as e:
                raise AdaptiveConfigError(str(e)) from None
        if self.adaptive_config.active_precision is not None:
            self.precision = install_precision(
                self,
                self.adaptive_config.active_precision,
                self._tokenizer_path,
                self._model_dir,
                speculates=self._speculates,
            )
            self.precision.stats.num_layers = self.adaptive_parts().num_layers
        return loaded

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | IntermediateTensors:
        if self.precision is not None:
            self.precision.begin_step(positions, step_query_start_loc())
        model = self.model  # type: ignore[attr-defined]
        hidden = model(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if self.precision is not None and isinstance(hidden, torch.Tensor):
            rows = self.precision.calibration_rows()
            if rows is not None:
                calibrate_from_prefill(self, hidden, rows)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)  # type: ignore[misc]
        if self.precision is not None and logits is not None:
            self.precision.observe_logits(logits)
        return logits

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The model's head over a draft's states: not a sampled row of the step, so the
        precision controller never sees it (its row count may equal the batch's)."""
        return super().compute_logits(hidden_states)  # type: ignore[misc]

    def kernel_dispatch(self) -> dict:
        """The reduced-precision kernels this worker measured and runs, per format, shape and
        token-count bucket (the bench records it next to its timings)."""
        from vllm_adaptive.introspection import kernel_dispatch

        return kernel_dispatch(self)
