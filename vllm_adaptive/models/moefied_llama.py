"""MoEfied Llama in vLLM: vLLM's Llama decoder (attention, norms, rotary, KV cache) with each
MLP replaced by a top-k mixture of experts (docs/moe.md, issue 19).

The checkpoint (``architectures: ["MoefiedLlamaForCausalLM"]``, ``num_local_experts`` E,
``num_experts_per_tok`` k, ``moe_intermediate_size`` m) is a Llama checkpoint whose MLP neurons
are permuted so expert e is rows ``e*m:(e+1)*m`` of ``gate_proj``/``up_proj`` and columns of
``down_proj``, plus ``model.layers.{i}.mlp.router.weight`` [E, hidden]. :class:`MoefiedMoE`
keeps each expert as its own weights (``w_gate_up`` [E, 2m, H], ``w_down`` [E, H, m]) and
computes only the experts some token of the batch selected (``moe/runtime.py``).

Without an ``adaptive.moe`` section every expert stays resident: the reference. With one, the
experts are written to the slow tier at load and computed from the fast tier
(``moe/tiers.py``, ``moe/runtime.py``); the resident copies are freed. Registered under its own
name (no stock vLLM twin: ``architectures.OWN_ARCHITECTURES``). The decoder runs eagerly (the
experts a step computes depend on the data).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from vllm_adaptive.config import AdaptiveConfig, AdaptiveConfigError, adaptive_config_from_vllm
from vllm_adaptive.engine.vllm_api import (
    IntermediateTensors,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    VllmConfig,
    ignore_torch_compile,
    init_logger,
)
from vllm_adaptive.models.base import HasAdaptiveParts, stack_parts
from vllm_adaptive.models.interface import LayerParts, ModelParts
from vllm_adaptive.models.llama import llama_layer_parts
from vllm_adaptive.moe.runtime import MoeRuntime, expert_cols, expert_rows, moe_resident, route

logger = init_logger("vllm.adaptive.moe")

ARCHITECTURE = "MoefiedLlamaForCausalLM"
MOE_FIELDS = ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size")


def moe_shape(config) -> tuple[int, int, int]:
    """(E, k, m) from the HF config; errors name the field."""
    missing = [f for f in MOE_FIELDS if not isinstance(getattr(config, f, None), int)]
    if missing:
        raise AdaptiveConfigError(f"{ARCHITECTURE}: config.json lacks integer {missing}")
    e, k, m = (getattr(config, f) for f in MOE_FIELDS)
    if not 1 <= k <= e or e * m != config.intermediate_size:
        raise AdaptiveConfigError(
            f"{ARCHITECTURE}: need 1 <= num_experts_per_tok ({k}) <= num_local_experts ({e}) "
            f"and num_local_experts * moe_intermediate_size ({e} * {m}) == intermediate_size "
            f"({config.intermediate_size})"
        )
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        raise AdaptiveConfigError(f"{ARCHITECTURE}: experts need hidden_act silu, no MLP bias")
    return e, k, m


class MoefiedMoE(nn.Module):
    """Router + E experts of one layer (see the module docstring)."""

    def __init__(self, layer: int, hidden: int, num_experts: int, top_k: int, m: int) -> None:
        super().__init__()
        self.layer, self.num_experts, self.top_k, self.m = layer, num_experts, top_k, m
        dtype = torch.get_default_dtype()
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.w_gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * m, hidden, dtype=dtype), requires_grad=False
        )
        self.w_down = nn.Parameter(
            torch.empty(num_experts, hidden, m, dtype=dtype), requires_grad=False
        )
        self.runtime: MoeRuntime | None = None  # set by the model when tiers are on

    def _expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w_gate_up[e], self.w_down[e]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        mask = route(x, self.router_weight, self.top_k)
        runtime = self.__dict__.get("_runtime")
        if runtime is None:
            return moe_resident(x, mask, self._expert)
        return runtime.layer(self.layer, x, residual, mask)

    # the runtime is not a submodule (no parameters, shared by every layer)
    @property
    def runtime(self) -> MoeRuntime | None:
        return self.__dict__.get("_runtime")

    @runtime.setter
    def runtime(self, value: MoeRuntime | None) -> None:
        self.__dict__["_runtime"] = value


class MoefiedDecoderLayer(LlamaDecoderLayer):
    """vLLM's Llama decoder layer with the MLP replaced by :class:`MoefiedMoE`; the forward
    also hands the residual stream to the MoE (for predictors that read it)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        config = vllm_config.model_config.hf_config
        e, k, m = moe_shape(config)
        layer = int(prefix.rsplit(".", 1)[-1])
        self.mlp = MoefiedMoE(layer, config.hidden_size, e, k, m)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states, residual), residual


@ignore_torch_compile
class MoefiedLlamaModel(LlamaModel):
    """LlamaModel run eagerly: which experts run depends on the data."""


def _slow_tier_path(directory: str | None) -> Path:
    if directory is None:
        base = Path(tempfile.mkdtemp(prefix="vllm-adaptive-moe-"))
        atexit.register(shutil.rmtree, base, True)
    else:
        base = Path(directory)
        base.mkdir(parents=True, exist_ok=True)
    path = base / f"experts-{os.getpid()}.bin"
    atexit.register(lambda: path.unlink(missing_ok=True))
    return path


class MoefiedLlamaForCausalLM(HasAdaptiveParts, LlamaForCausalLM):
    """Registered as "MoefiedLlamaForCausalLM" (see the module docstring)."""

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        prefix: str = "",
        layer_type: type[nn.Module] = MoefiedDecoderLayer,
    ) -> None:
        adaptive = adaptive_config_from_vllm(vllm_config) or AdaptiveConfig()
        if adaptive.mode == "on" and (
            adaptive.precision is not None
            or adaptive.depth is not None
            or adaptive.speculative is not None
        ):
            raise AdaptiveConfigError(
                f"adaptive: {ARCHITECTURE} supports only the adaptive.moe section (precision, "
                "depth and speculation manage a dense Llama MLP)"
            )
        if vllm_config.parallel_config.pipeline_parallel_size > 1 or (
            vllm_config.parallel_config.tensor_parallel_size > 1
        ):
            raise AdaptiveConfigError(f"{ARCHITECTURE}: one worker only (no TP/PP) for now")
        shape = moe_shape(vllm_config.model_config.hf_config)  # refuse a bad config first
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        self.num_experts, self.top_k, self.expert_size = shape
        self.adaptive_config = adaptive
        self.model_dir = vllm_config.model_config.model
        self.moe_runtime: MoeRuntime | None = None

    def _init_model(
        self,
        vllm_config: VllmConfig,
        prefix: str = "",
        layer_type: type[nn.Module] = MoefiedDecoderLayer,
    ) -> MoefiedLlamaModel:
        return MoefiedLlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _build_parts(self) -> ModelParts:
        def layer_parts(i: int, layer: MoefiedDecoderLayer) -> LayerParts:
            return replace(llama_layer_parts(i, layer, dense_mlp=False), experts=layer.mlp)

        return stack_parts(self, layer_parts)

    def moe_layers(self) -> list[MoefiedMoE]:
        return [layer.experts for layer in self.adaptive_parts().layers]

    # -- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        e, m = self.num_experts, self.expert_size
        mlps = self.moe_layers()
        loaded: set[str] = set()
        seen: dict[int, set[str]] = {}

        def others():
            for name, w in weights:
                parts = name.split(".")
                if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] == "mlp":
                    i, which = int(parts[2]), parts[4]
                    mlp = mlps[i]
                    with torch.no_grad():
                        if which == "gate_proj":
                            mlp.w_gate_up[:, :m].copy_(expert_rows(w, e))
                        elif which == "up_proj":
                            mlp.w_gate_up[:, m:].copy_(expert_rows(w, e))
                        elif which == "down_proj":
                            mlp.w_down.copy_(expert_cols(w, e))
                        elif which == "router":
                            mlp.router_weight.copy_(w)
                        else:
                            raise ValueError(f"{ARCHITECTURE}: unexpected tensor {name}")
                    seen.setdefault(i, set()).add(which)
                    continue
                yield name, w

        loaded |= super().load_weights(others())
        want = {"gate_proj", "up_proj", "down_proj", "router"}
        for i in range(len(mlps)):
            missing = want - seen.get(i, set())
            if missing:
                raise ValueError(f"{ARCHITECTURE}: layer {i} lacks MLP tensors {sorted(missing)}")
            prefix = f"model.layers.{i}.mlp."
            loaded |= {prefix + p for p in ("router_weight", "w_gate_up", "w_down")}
        moe = self.adaptive_config.active_moe
        if moe is not None:
            self.moe_runtime = self._build_tiers(moe)
        return loaded

    def _build_tiers(self, moe) -> MoeRuntime:
        from vllm_adaptive.moe.predictors import make_predictor
        from vllm_adaptive.moe.slow_tier import RecordLayout, SlowTier
        from vllm_adaptive.moe.tiers import FastTier

        mlps = self.moe_layers()
        num_layers, e, m = len(mlps), self.num_experts, self.expert_size
        hidden = mlps[0].w_gate_up.shape[2]
        dtype = mlps[0].w_gate_up.dtype
        layout = RecordLayout((("gate_up", (2 * m, hidden)), ("down", (hidden, m))), dtype)
        total = num_layers * e
        if moe.fast_tier_bytes is not None:
            slots, key = moe.fast_tier_bytes // layout.stride, "adaptive.moe.fast_tier_bytes"
        else:
            capacity = 1.0 if moe.capacity is None else moe.capacity
            slots, key = int(capacity * total + 1e-9), "adaptive.moe.capacity"
        if slots < 1:
            raise AdaptiveConfigError(
                f"{key}: the fast tier holds no expert (one is {layout.stride} bytes)"
            )
        slots = min(slots, total)
        path = _slow_tier_path(moe.slow_tier_dir)
        t0 = time.perf_counter()
        slow = SlowTier.write(
            path,
            num_layers,
            e,
            layout,
            lambda layer, x: {"gate_up": mlps[layer].w_gate_up[x], "down": mlps[layer].w_down[x]},
        )
        write_s = time.perf_counter() - t0
        probe = [(i * num_layers // 8, (i * 5) % e) for i in range(min(8, total))]
        bandwidth = slow.measure_bandwidth(dict.fromkeys(probe))
        logger.info(
            "vllm-adaptive moe: slow tier %s: %d experts x %d bytes written in %.2f s; cold read "
            "%.1f MB/s (%d records, %.3f s); fast tier %d slots (%.1f MB, %.0f%% of experts), "
            "predictor %s",
            path,
            total,
            layout.stride,
            write_s,
            bandwidth["bytes_per_s"] / 1e6,
            bandwidth["records"],
            bandwidth["seconds"],
            slots,
            slots * layout.stride / 1e6,
            100 * slots / total,
            moe.predictor,
        )
        adapters = None
        if moe.predictor == "m2r2":
            adapters = self._load_m2r2(moe.m2r2_adapters, moe.lookahead)
        tier = FastTier(slow, slots, eviction=moe.eviction)
        predictor = make_predictor(moe.predictor, moe.lookahead, adapters)
        self._bind(predictor)
        runtime = MoeRuntime(
            tier,
            predictor,
            num_layers,
            e,
            self.top_k,
            info={
                "slow_tier_path": str(path),
                "record_bytes": layout.stride,
                "slow_tier_cold_read_bytes_per_s": bandwidth["bytes_per_s"],
            },
        )
        for mlp in mlps:  # the slow tier holds them now: free the resident copies
            mlp.w_gate_up.data = torch.empty(0, dtype=dtype)
            mlp.w_down.data = torch.empty(0, dtype=dtype)
            mlp.runtime = runtime
        atexit.register(lambda: runtime.tier.close())  # the tier may be replaced (resize)
        return runtime

    def _load_m2r2(self, directory: str, lookahead: int):
        """The m2r2 predictor's adapters, refused at start (naming the key) when they do not fit."""
        from vllm_adaptive.moe.m2r2 import StreamAdapterError, load_for_engine

        mlps = self.moe_layers()
        try:
            return load_for_engine(
                directory,
                model_dir=self.model_dir,
                num_layers=len(mlps),
                hidden_size=mlps[0].router_weight.shape[1],
                num_experts=self.num_experts,
                top_k=self.top_k,
                lookahead=lookahead,
            )
        except StreamAdapterError as e:
            raise AdaptiveConfigError(f"adaptive.moe.m2r2_adapters: {e}") from None

    def _bind(self, predictor) -> None:
        layers = self.model.layers
        predictor.bind(
            [layer.mlp.router_weight.data for layer in layers],
            self.top_k,
            norms=[layer.post_attention_layernorm.weight.data for layer in layers],
            eps=float(layers[0].post_attention_layernorm.variance_epsilon),
        )

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        t0 = time.perf_counter()
        out = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        if self.moe_runtime is not None:
            self.moe_runtime.end_step(time.perf_counter() - t0)
        return out

    # -- introspection (llm.apply_model / collective_rpc) ------------------------------------

    def moe_stats(self) -> dict | None:
        """The tiered runtime's counters (None: every expert resident)."""
        return None if self.moe_runtime is None else self.moe_runtime.stats()


# -- worker-side helpers for ``llm.apply_model`` / ``collective_rpc`` (importable by name) ----


def _moefied(model) -> MoefiedLlamaForCausalLM:
    if not isinstance(model, MoefiedLlamaForCausalLM):
        raise TypeError(f"not a {ARCHITECTURE}: {type(model).__name__}")
    return model


def moe_stats(model) -> dict | None:
    """The tiered runtime's counters (``llm.apply_model(moe_stats)``); None when resident."""
    return _moefied(model).moe_stats()


def reset_moe_stats(model) -> None:
    """Zero the counters (e.g. after warm-up) without touching the tiers' contents."""
    runtime = _moefied(model).moe_runtime
    if runtime is not None:
        runtime.reset_stats()


def set_moe_predictor(
    model, name: str, lookahead: int = 1, m2r2_adapters: str | None = None
) -> None:
    """Swap the predictor of a tiered engine (the bench compares predictors on one engine)."""
    from vllm_adaptive.moe.predictors import make_predictor

    m = _moefied(model)
    runtime = m.moe_runtime
    if runtime is None:
        raise ValueError("this engine keeps every expert resident (no adaptive.moe section)")
    adapters = None
    if name == "m2r2":
        if m2r2_adapters is None:
            raise ValueError('predictor "m2r2" needs m2r2_adapters')
        adapters = m._load_m2r2(m2r2_adapters, lookahead)
    predictor = make_predictor(name, lookahead, adapters)
    m._bind(predictor)
    runtime.set_predictor(predictor)


def measure_moe_slow_tier(model, records: int = 64) -> dict:
    """Cold-read ``records`` expert records spread over the slow tier (each dropped from the page
    cache first): its read bandwidth, measured with more records than the start-up probe."""
    runtime = _moefied(model).moe_runtime
    if runtime is None:
        raise ValueError("this engine keeps every expert resident (no adaptive.moe section)")
    total = runtime.num_layers * runtime.num_experts
    step = max(1, total // records)
    keys = [divmod(i, runtime.num_experts) for i in range(0, total, step)][:records]
    return runtime.tier.slow.measure_bandwidth(keys)


def set_moe_capacity(model, capacity: float, eviction: str | None = None) -> int:
    """Give a tiered engine a new, empty fast tier of ``capacity`` x all experts (the bench
    sweeps capacities on one engine: the slow tier stays). Returns the slot count."""
    m = _moefied(model)
    runtime = m.moe_runtime
    if runtime is None:
        raise ValueError("this engine keeps every expert resident (no adaptive.moe section)")
    total = runtime.num_layers * runtime.num_experts
    slots = min(total, int(capacity * total + 1e-9))
    if slots < 1:
        raise ValueError(f"capacity {capacity}: the fast tier holds no expert")
    runtime.resize(slots, eviction)
    return slots
