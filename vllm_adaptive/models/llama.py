"""Adaptive Llama: vLLM's Llama with the layer loop owned by the plugin.

The decoder layers, attention, weights and loading are vLLM's own (inherited,
not copied). What this class adds is the place where adaptive mechanisms
decide which tokens run which layers: `AdaptiveLlamaModel.run_layers`. With
every mechanism off it runs every layer for every token, and the output is
token-for-token stock vLLM's (tests/test_identity.py).
"""

from __future__ import annotations

from itertools import islice

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from vllm.sequence import IntermediateTensors

from vllm_adaptive.config import AdaptiveConfig, AdaptiveConfigError, adaptive_config_from_vllm


def check_engine_compatible(vllm_config: VllmConfig) -> None:
    """Refuse engine features the adaptive layer loop does not handle yet."""
    spec = vllm_config.speculative_config
    if spec is not None and getattr(spec, "method", None) in ("eagle", "eagle3"):
        raise AdaptiveConfigError(
            f"adaptive: speculative method {spec.method!r} needs auxiliary hidden states "
            "from the target model, which the adaptive layer loop does not produce yet"
        )


class AdaptiveLlamaModel(LlamaModel):
    """LlamaModel whose forward delegates the layer schedule to `run_layers`."""

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
        **extra_layer_kwargs,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]

        hidden, residual = self.run_layers(positions, hidden, residual, **extra_layer_kwargs)

        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def run_layers(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        **extra_layer_kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The depth schedule: with every mechanism off, all layers for all tokens."""
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual, **extra_layer_kwargs)
        return hidden, residual


class AdaptiveLlamaForCausalLM(LlamaForCausalLM):
    """Registered as "AdaptiveLlamaForCausalLM"; chosen by the dispatcher when
    `additional_config` has an "adaptive" section."""

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        prefix: str = "",
        layer_type: type[nn.Module] = LlamaDecoderLayer,
    ) -> None:
        adaptive = adaptive_config_from_vllm(vllm_config) or AdaptiveConfig()
        check_engine_compatible(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        self.adaptive_config = adaptive

    def _init_model(
        self,
        vllm_config: VllmConfig,
        prefix: str = "",
        layer_type: type[nn.Module] = LlamaDecoderLayer,
    ) -> AdaptiveLlamaModel:
        return AdaptiveLlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
