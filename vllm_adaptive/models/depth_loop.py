"""The decoder stack owned by the depth runtime, for any architecture whose vLLM ``*Model``
has Llama's layout (``embed_input_ids``, ``layers`` from ``start_layer`` to ``end_layer``,
``norm(hidden, residual)``) and whose blocks take and return ``(hidden, residual)``.

:class:`DepthLayerLoop` is mixed in before the stock ``*Model``: when a depth runtime is
attached (``depth_runtime``) and the step is one it can plan, the runtime decides which tokens
run which layers (``depth/runtime.py``); otherwise :meth:`DepthLayerLoop.run_final` runs every
layer, through the runtime's compiled blocks when it has them (so vLLM's warm-up compiles them).
:func:`attach_depth_runtime` loads and checks the profile at engine start and wires the runtime
into the model; errors name the config key. Used by ``llama.py`` and ``gemma3.py``.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

import torch
from torch import nn

from vllm_adaptive.config import AdaptiveConfigError
from vllm_adaptive.depth.kv_strategies import kv_strategy_class
from vllm_adaptive.depth.runtime import DepthRuntime
from vllm_adaptive.engine.attention_metadata import (
    CpuStepAttention,
    attention_skipped,
    group_window,
    step_attention_metadata,
)
from vllm_adaptive.engine.vllm_api import (
    CompilationMode,
    IntermediateTensors,
    VllmConfig,
    get_pp_group,
)
from vllm_adaptive.models.interface import ModelParts


class DepthLayerLoop:
    """Mixin for a vLLM decoder ``*Model``: its stack runs through the depth runtime when one
    is attached; see the module docstring."""

    depth_runtime: DepthRuntime | None = None

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

        runtime = self.depth_runtime
        if runtime is not None and residual is None and not extra_layer_kwargs:
            md = step_attention_metadata(runtime.parts.layer_names[0])
            out = runtime.forward(md, positions, hidden, input_ids)
            if out is not None:
                return out
        if runtime is not None and not extra_layer_kwargs and get_pp_group().is_last_rank:
            return self.run_final(positions, hidden, residual)
        hidden, residual = self.run_layers(positions, hidden, residual, **extra_layer_kwargs)

        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def run_final(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """Every layer and the final norm for every token, through the runtime's stack graph:
        the fallback for steps the depth runtime does not plan (dummy, profiling and padded
        steps), so that vLLM's warm-up compiles the runtime's graphs."""
        runtime = self.depth_runtime
        assert runtime is not None
        parts = runtime.parts
        if runtime.block_compile_seconds() is None and attention_skipped():
            return _warm_up(parts, positions, hidden, residual)
        out, _ = parts.run_stack(positions, hidden, residual)
        return out

    def run_layers(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        **extra_layer_kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer for every token, without the final norm: the path with depth off, and
        with it on a pipeline stage before the last (block by block)."""
        runtime = self.depth_runtime
        if runtime is not None and not extra_layer_kwargs:
            for layer in runtime.parts.layers:
                hidden, residual = layer.run_block(positions, hidden, residual)
            return hidden, residual
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual, **extra_layer_kwargs)
        return hidden, residual


def _warm_up(
    parts: ModelParts, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor:
    """Compile every graph of ``parts`` on a warm-up step (attention skipped); the step's
    output after the final norm."""
    out = None
    if parts.compiled_stack is not None:
        out, _ = parts.compiled_stack.warm_up(positions, hidden, residual)
    h, r = hidden, residual
    for _, _, span in parts.spans:
        h, r = span.warm_up(positions, h, r)
    for layer in parts.layers:
        if layer.compiled is not None:
            hidden, residual = layer.compiled.warm_up(positions, hidden, residual)
        else:
            hidden, residual = layer.run_block(positions, hidden, residual)
    return out if out is not None else parts.final_norm(hidden, residual)[0]


def install_depth_attention(depth: Any | None) -> None:
    """Before a model builds its layers: install the plugin's masked attention backend where the
    depth config's KV strategy masks slots (the layers pick their backend when built)."""
    if depth is not None and kv_strategy_class(depth.kv_strategy).needs_masked_attention:
        from vllm_adaptive.engine import intrusions

        intrusions.apply("masked-attention-backend")


def attach_depth_runtime(
    causal_lm: nn.Module, parts: ModelParts, vllm_config: VllmConfig, depth: Any
) -> DepthRuntime:
    """Build the runtime for ``causal_lm`` (whose ``model`` mixes in :class:`DepthLayerLoop`),
    compile its spans where the engine compiles, attach it and return it."""
    from vllm_adaptive.batch_mirror import register_listener

    runtime = load_depth_runtime(parts, vllm_config, depth, parts.head.weight)
    compiled = vllm_config.compilation_config.mode != CompilationMode.NONE
    cuts = runtime.span_cuts() if compiled else ()
    if cuts:
        from vllm_adaptive.models.compiled_blocks import with_compiled_spans

        runtime.attach_spans(with_compiled_spans(parts, cuts))
    causal_lm.model.depth_runtime = runtime
    register_listener("depth", runtime)
    return runtime


def load_depth_runtime(
    parts: ModelParts,
    vllm_config: VllmConfig,
    depth,
    unembed: torch.Tensor | None = None,
) -> DepthRuntime:
    """Load and check the profile, then build the runtime; errors name the config key."""
    from vllm_adaptive.artifacts import ProfileError
    from vllm_adaptive.depth.exit_profile import ExitProfile
    from vllm_adaptive.engine.attention_metadata import SUPPORTED_BACKENDS

    try:
        profile = ExitProfile.load(depth.profile, vllm_config.model_config.model)
    except ProfileError as e:
        raise AdaptiveConfigError(f"adaptive.depth.profile: {e}") from None
    num_layers = vllm_config.model_config.hf_config.num_hidden_layers
    if profile.num_layers != num_layers:
        raise AdaptiveConfigError(
            f"adaptive.depth.profile: made for {profile.num_layers} layers, model has {num_layers}"
        )
    if depth.floor is not None and (depth.floor.min_layers or 1) > num_layers:
        raise AdaptiveConfigError(
            f"adaptive.depth.floor.min_layers: {depth.floor.min_layers} > {num_layers} layers"
        )
    attn = parts.layers[0].attn
    backend = attn.attn_backend.get_name()
    if backend not in SUPPORTED_BACKENDS:
        raise AdaptiveConfigError(
            f"adaptive.depth: depth-peeling supports the attention backends {SUPPORTED_BACKENDS}, "
            f"this engine uses {backend}"
        )
    kv = kv_strategy_class(depth.kv_strategy)
    if kv.needs_masked_attention:
        from vllm_adaptive.attention.masked_backend import masked_backend_active

        if not masked_backend_active(attn):
            raise AdaptiveConfigError(
                f'adaptive.depth.kv_strategy: "{kv.name}" needs the plugin\'s masked attention '
                f"backend, but the attention layers were built with {type(attn.impl).__name__}"
            )
    reason = kv.check_engine(depth, num_layers)
    if reason is not None:
        raise AdaptiveConfigError(reason)
    fusion = None
    if depth.fusion is not None:
        fusion = load_engine_fusion(depth, vllm_config.model_config.model, num_layers)
    try:
        attention = CpuStepAttention(
            parts.layer_names,
            vllm_config.model_config.dtype,
            vllm_config.cache_config.cache_dtype,
            group_window(layer.attn for layer in parts.layers),
        )
        return DepthRuntime(
            parts,
            depth,
            profile,
            attention,
            model_dir=vllm_config.model_config.model,
            dtype=vllm_config.model_config.dtype,
            unembed=unembed,
            fusion=fusion,
        )
    except (ProfileError, ValueError) as e:
        raise AdaptiveConfigError(f"adaptive.depth.signal: {e}") from None


def load_engine_fusion(depth, model_dir: str, num_layers: int):
    """The token fusion mechanism for ``adaptive.depth.fusion``; errors name the config key."""
    from vllm_adaptive.artifacts import ProfileError
    from vllm_adaptive.depth.calibration.fusion import load_fusion_profile
    from vllm_adaptive.depth.fusion_runtime import EngineFusion, check_fusion_profile

    if "arla" in depth.signal.policy:
        raise AdaptiveConfigError(
            'adaptive.depth.fusion: policy "arla" runs its accelerated stream on the step\'s '
            "unfused metadata; fusion with ARLA is not built (use another exit signal)"
        )
    try:
        prof = load_fusion_profile(depth.fusion.profile, model_dir)
    except (ProfileError, KeyError, ValueError) as e:
        raise AdaptiveConfigError(f"adaptive.depth.fusion.profile: {e}") from None
    bad = [layer for layer in prof.rules if not 1 <= layer < num_layers]
    if bad:
        raise AdaptiveConfigError(
            f"adaptive.depth.fusion.profile: fusion layers must lie in 1..{num_layers - 1}: {bad}"
        )
    reason = check_fusion_profile(prof)
    if reason is not None:
        raise AdaptiveConfigError(reason)
    return EngineFusion(prof, num_layers)
