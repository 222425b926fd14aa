"""Adaptive Llama: vLLM's Llama with the layer loop owned by the plugin.

The decoder layers, attention, weights and loading are vLLM's own (inherited, not copied).
`AdaptiveLlamaModel.forward` hands the decoder stack to the depth runtime (`depth/runtime.py`,
which decides which tokens run which layers) when adaptive depth is on and the step is one it
can plan; otherwise `run_final` runs every layer and the final norm for every token.
`llama_layer_parts` is Llama's entry in the model interface (`models/interface.py`; the
MoEfied model reuses it), and `AdaptiveLlamaForCausalLM` adds the depth runtime to what every
adaptive twin has (`models/base.py`: the precision gears and the self-speculative draft at
`load_weights`). With every mechanism off the output is token-for-token stock vLLM's
(tests/engine/test_identity.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from vllm_adaptive.config import AdaptiveConfig, AdaptiveConfigError, adaptive_config_from_vllm
from vllm_adaptive.engine.vllm_api import (
    CompilationMode,
    CUDAGraphMode,
    IntermediateTensors,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    VllmConfig,
    ignore_torch_compile,
)
from vllm_adaptive.models.base import AdaptiveCausalLM, stack_parts
from vllm_adaptive.models.depth_loop import (
    DepthLayerLoop,
    attach_depth_runtime,
    install_depth_attention,
)
from vllm_adaptive.models.interface import BlockDeltas, LayerParts, ModelParts


def check_engine_compatible(vllm_config: VllmConfig, adaptive: AdaptiveConfig) -> None:
    """Refuse engine features the adaptive layer loop does not handle yet."""
    spec = vllm_config.speculative_config
    if adaptive.active_speculative is not None and (
        spec is None or getattr(spec, "method", None) != "custom_class"
    ):
        from vllm_adaptive.config import SELF_SPECULATIVE_PROPOSER

        raise AdaptiveConfigError(
            "adaptive.speculative: vLLM's speculative_config must name the plugin's proposer: "
            f'{{"method": "custom_class", "model": "{SELF_SPECULATIVE_PROPOSER}", '
            '"num_speculative_tokens": k}'
        )
    if adaptive.active_speculative is not None and getattr(
        spec, "num_speculative_tokens_per_batch_size", None
    ):
        raise AdaptiveConfigError(
            "adaptive.speculative: vLLM does not tell a custom_class proposer the per-batch-size "
            "k of num_speculative_tokens_per_batch_size, so the schedule would be ignored; "
            "drop it from speculative_config (the plugin's proposer drafts num_speculative_tokens)"
        )
    if adaptive.active_hybrid is not None:
        from vllm_adaptive.speculative.hybrid import engine_problem

        problem = engine_problem(spec, adaptive.active_hybrid)
        if problem is not None:
            raise AdaptiveConfigError(problem)
    from vllm_adaptive.models.llama_eagle3 import draft_head_problem

    problem = draft_head_problem(adaptive, vllm_config)
    if problem is not None:
        raise AdaptiveConfigError(problem)
    if spec is not None and getattr(spec, "method", None) in ("eagle", "eagle3"):
        if adaptive.active_depth is not None:
            raise AdaptiveConfigError(
                f"adaptive.depth: speculative method {spec.method!r} reads the target's hidden "
                "states at fixed layers, which exited tokens do not reach (turn one off)"
            )
        check_draft_head(spec, vllm_config.model_config.model)
    if adaptive.active_depth is not None:
        if spec is not None:
            raise AdaptiveConfigError(
                "adaptive.depth: speculative decoding verifies several tokens per request per "
                "step; the exit schedule needs one decode token per request (turn one off)"
            )
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise AdaptiveConfigError(
                "adaptive.depth: exits need every layer on one pipeline stage "
                "(pipeline_parallel_size must be 1)"
            )
    if adaptive.active_precision is None:
        return
    # Gear control with speculation: refused once the gears are known (install_precision),
    # since a policy whose levels all run one precision routes nothing and composes with drafts.
    cg_mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if (
        vllm_config.device_config.device.type == "cuda"
        and cg_mode is not None
        and cg_mode.has_mode(CUDAGraphMode.FULL)
    ):
        raise AdaptiveConfigError(
            "adaptive.precision: full CUDA graphs freeze one gear into the graph; run with "
            "--enforce-eager or a piecewise cudagraph mode"
        )


def check_draft_head(spec, target: str) -> None:
    """Refuse an EAGLE head made for another model (the head's fingerprint of its target)."""
    from pathlib import Path

    from vllm_adaptive.speculative.eagle3_head import Eagle3HeadError, check_head_for_target

    head = getattr(spec, "model", None)
    if head and Path(head).is_dir() and Path(target).is_dir():
        try:
            check_head_for_target(head, target)
        except Eagle3HeadError as e:
            raise AdaptiveConfigError(f"speculative_config: {e}") from None


class AdaptiveLlamaModel(DepthLayerLoop, LlamaModel):
    """LlamaModel whose decoder stack runs through the depth runtime when one is attached."""

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
        **extra_layer_kwargs,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        if getattr(self, "aux_hidden_state_layers", ()):
            # EAGLE-3 drafts from the target's states at fixed layers: vLLM's own loop keeps
            # them (SupportsEagle3 is inherited from the stock class; depth is refused with it)
            return LlamaModel.forward(
                self,
                input_ids,
                positions,
                intermediate_tensors,
                inputs_embeds,
                **extra_layer_kwargs,
            )
        return DepthLayerLoop.forward(
            self, input_ids, positions, intermediate_tensors, inputs_embeds, **extra_layer_kwargs
        )


@ignore_torch_compile
class EagerAdaptiveLlamaModel(AdaptiveLlamaModel):
    """The decoder for adaptive depth: which tokens run which layer depends on the data, so
    vLLM does not compile its forward as one graph; each block is compiled on its own
    instead (``models/compiled_blocks.py``) unless the engine runs eagerly."""


class LlamaBlockRecipe:
    """Llama's decoder block (vLLM's ``LlamaDecoderLayer.forward``) from a layer's parts, for
    the mechanisms that run it with something changed: other linears (the Exit River's reduced
    copies, the low-bit draft), M2R2's adapter deltas on an unfused residual stream (ARLA's
    accelerated stream, the M2R2 draft), or only the K/V of a residual state (state
    propagation). Norms, rotary and attention are the layer's own."""

    name = "llama"

    def run_with(
        self,
        layer: LayerParts,
        linears: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = layer.input_norm(hidden)
        else:
            hidden, residual = layer.input_norm(hidden, residual)
        q, k, v = layer.split_qkv(linears["qkv_proj"](hidden))
        q, k = layer.rotary(positions, q, k)
        hidden = linears["o_proj"](layer.attn(q, k, v))
        hidden, residual = layer.post_attention_norm(hidden, residual)
        gate_up = linears["gate_up_proj"](hidden)
        hidden = linears["down_proj"](layer.act_fn(gate_up))
        return hidden, residual

    def run_accelerated(
        self, layer: LayerParts, deltas: BlockDeltas, positions: torch.Tensor, p: torch.Tensor
    ) -> torch.Tensor:
        x = layer.input_norm(p)
        qkv, _ = layer.linear("qkv_proj")(x)
        q, k, v = layer.split_qkv(qkv)
        q = q + deltas.q(x)
        q, k = layer.rotary(positions, q, k)
        a = layer.attn(q, k, v)
        o, _ = layer.linear("o_proj")(a)
        p = p + o + deltas.o(a)
        y = layer.post_attention_norm(p)
        return p + layer.mlp(y) + deltas.mlp(y)

    def kv_from_state(
        self, layer: LayerParts, state: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = layer.input_norm(state)
        qkv, _ = layer.linear("qkv_proj")(x)
        q, k, v = layer.split_qkv(qkv)
        _, k = layer.rotary(positions, q, k)
        return k, v


LLAMA_BLOCK = LlamaBlockRecipe()


def llama_layer_parts(index: int, layer: nn.Module, dense_mlp: bool = True) -> LayerParts:
    """The parts of vLLM's ``LlamaDecoderLayer`` (``dense_mlp`` False: its MLP is not
    ``gate_up_proj``/``down_proj``, as in the MoEfied model, which names its experts itself)."""
    attn = layer.self_attn
    window = getattr(attn.attn, "sliding_window", None)
    linears = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
    if dense_mlp:
        linears |= {"gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
    return LayerParts(
        index=index,
        block=layer,
        attention=attn,
        attn=attn.attn,
        rotary=attn.rotary_emb,
        q_size=attn.q_size,
        kv_size=attn.kv_size,
        input_norm=layer.input_layernorm,
        post_attention_norm=layer.post_attention_layernorm,
        linears=linears,
        mlp=layer.mlp,
        act_fn=layer.mlp.act_fn if dense_mlp else None,
        sliding_window=window,
        recipe=LLAMA_BLOCK if dense_mlp and window is None else None,
    )


class AdaptiveLlamaForCausalLM(AdaptiveCausalLM, LlamaForCausalLM):
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
        check_engine_compatible(vllm_config, adaptive)
        install_depth_attention(adaptive.active_depth)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        self._init_adaptive(vllm_config, adaptive)
        self._compile_blocks = adaptive.active_depth is not None and (
            vllm_config.compilation_config.mode != CompilationMode.NONE
        )
        if adaptive.active_depth is not None:
            self.depth = attach_depth_runtime(
                self, self.adaptive_parts(), vllm_config, adaptive.active_depth
            )

    def _build_parts(self) -> ModelParts:
        parts = stack_parts(self, llama_layer_parts)
        if getattr(self, "_compile_blocks", False):
            from vllm_adaptive.models.compiled_blocks import with_compiled_blocks

            parts = with_compiled_blocks(parts)
        return parts

    def _init_model(
        self,
        vllm_config: VllmConfig,
        prefix: str = "",
        layer_type: type[nn.Module] = LlamaDecoderLayer,
    ) -> AdaptiveLlamaModel:
        adaptive = adaptive_config_from_vllm(vllm_config)
        cls = AdaptiveLlamaModel
        if adaptive is not None and adaptive.active_depth is not None:
            cls = EagerAdaptiveLlamaModel
        return cls(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
