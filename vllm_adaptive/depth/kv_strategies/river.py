"""``river`` (River-LLM): every row runs every backbone layer; a decode row that exits switches
to the Exit River's quantized copies of the remaining layers (`depth/exit_river.py`), which
write its K/V into its own slots, so every slot has K/V at every layer."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from vllm_adaptive.depth.exit_river import ExitRiver
from vllm_adaptive.depth.kv_strategies.base import KvState, KvStrategy
from vllm_adaptive.depth.step import ActiveRows, Step, StepPlan

if TYPE_CHECKING:
    from vllm_adaptive.depth.exit_decisions import ExitDecisions
    from vllm_adaptive.models.interface import ModelParts

logger = logging.getLogger("vllm.adaptive.depth")


class RiverStrategy(KvStrategy):
    name = "river"
    runs_blocks = True
    supports_accelerated_stream = False
    fills_every_layer = True
    owns_layer_loop = True
    model_needs = "runs reduced copies of the block through its recipe"

    def __init__(self, settings: Any) -> None:
        self.settings = settings  # the config's river_settings
        self.river: ExitRiver | None = None

    @classmethod
    def from_config(cls, depth_config: Any) -> RiverStrategy:
        return cls(depth_config.river_settings)

    @classmethod
    def check_engine(cls, depth_config: Any, num_layers: int) -> str | None:
        entry = depth_config.river_settings.entry_layer
        if entry >= num_layers:
            return (
                f"adaptive.depth.river.entry_layer: {entry} leaves no layer for the river "
                f"(the model has {num_layers})"
            )
        return None

    def weights_loaded(self, parts: ModelParts, num_layers: int) -> None:
        """Quantize the river's layers from the float weights."""
        r = self.settings
        self.river = ExitRiver(
            parts.layers, r.entry_layer, r.group_size, r.symmetric, precision=r.precision
        )
        if r.offload_backbone:
            self.river.map_backbone(parts.layers)
        logger.info(
            "vllm-adaptive river: %s copies of blocks %d-%d, %.1f MB",
            self.river.quantizer,
            r.entry_layer + 1,
            num_layers,
            self.river.resident_bytes() / 1e6,
        )

    def kv_cache_ready(self, state: KvState, parts: ModelParts) -> None:
        if self.river is not None and self.settings.offload_backbone:
            self.river.offload_backbone(parts.layers)

    def run_layers(
        self,
        state: KvState,
        parts: ModelParts,
        exits: ExitDecisions,
        md: Any,
        plan: StepPlan,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        input_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row runs every layer; a decode row that exits switches to the Exit River's int4
        layers for the rest, writing its K/V into its own slots. With ``river.prefill: river``
        prompt tokens take the river after the entry layer (River-LLM's sequence-level exit for
        prefill). ``depth``: backbone blocks."""
        river = self.river
        assert river is not None, "the river is built at weight loading"
        L = state.num_layers
        counters = state.counters
        num_reqs = plan.cap.shape[0]
        depth = torch.full((num_reqs,), L, dtype=torch.long)
        qsl = md.query_start_loc.cpu().long()
        dev = hidden.device
        first = qsl[:-1].to(dev)  # a decode row's (only) token
        tok = torch.arange(hidden.shape[0], device=dev)
        in_river = torch.zeros(num_reqs, dtype=torch.bool)
        river_tok = torch.zeros(hidden.shape[0], dtype=torch.bool, device=dev)
        prefill_rows = torch.from_numpy(~plan.decode)
        for r, state in enumerate(plan.states or [None] * num_reqs):
            if state is None or state.off:  # exits off: this request's prompt stays stock
                prefill_rows[r] = False
        prefill_river = self.settings.prefill == "river" and bool(prefill_rows.any())
        h, res = hidden, None
        any_exit = bool(plan.may_exit.any())
        all_rows = torch.arange(num_reqs)
        step = Step(parts, md, plan, input_ids)
        for i, layer in enumerate(parts.layers):
            count = i + 1
            prev = None
            if any_exit and exits.needs_prev(count):
                prev = h if res is None else h + res
            if bool(river_tok.any()):
                rt = torch.nonzero(river_tok).squeeze(1)
                bt = torch.nonzero(~river_tok).squeeze(1)
                h, res = river.forward_layer(
                    layer, positions, h, res, rt, bt if bt.numel() else None
                )
                counters.river_token_layers += int(river_tok[first[in_river.to(dev)]].sum())
            else:
                h, res = layer.run_block(positions, h, res)
            if prefill_river and count == river.entry_layer:
                for r in torch.nonzero(prefill_rows).squeeze(1).tolist():
                    river_tok[int(qsl[r]) : int(qsl[r + 1])] = True
                depth[prefill_rows] = count
            p = exits.probe(count)
            if p is None or count < river.entry_layer or count >= L:
                continue
            t0 = time.perf_counter()
            cand = exits.candidates(plan, all_rows, p) & ~in_river
            if bool(cand.any()):
                j = torch.nonzero(cand).squeeze(1)
                act = ActiveRows(all_rows, qsl, tok, positions, h, res)
                passed = exits.decide(step, act, count, j, prev)
                newly = j[passed]
                in_river[newly] = True
                river_tok[first[newly.to(dev)]] = True
                depth[newly] = count
            counters.decision_seconds += time.perf_counter() - t0
        out, _ = parts.final_norm(h, res)
        return out, depth
