"""Precision gears for the MLX engine: tiers installed in the model, per-request gear state.

Mechanism around the shared policies (``vllm_adaptive/precision/policies``: GEARBX, QuickSilver,
fixed): the policy sees entropies in bits and returns levels, exactly as in the vLLM path; this
module quantizes the tiers, sets the `GearSwitch` before each forward and records what ran.
Telemetry records have the vLLM controller's fields (``gear_tokens``, ``shifts``, entropy and
gear traces), so the bench and the docs read both the same way.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_adaptive.config import PrecisionConfig
from vllm_adaptive.flops import BYTES_PER_PARAM
from vllm_adaptive.gears import BITS, LEVEL_NAMES
from vllm_adaptive.metal_backend.arch import LlamaLayout
from vllm_adaptive.metal_backend.entropy import entropy_bits
from vllm_adaptive.metal_backend.geared import OFF, GearSwitch, MlxGearedLinear
from vllm_adaptive.metal_backend.quant import (
    QuantTier,
    check_group_size,
    matryoshka_tiers,
    quantize,
)
from vllm_adaptive.overrides import RequestOverrides
from vllm_adaptive.precision.policies import GearPolicy, RequestGearState, build_policy
from vllm_adaptive.precision.records import CODE_NAMES, gear_record

logger = logging.getLogger("vllm_adaptive.mlx.precision")


def build_tiers(
    weight: mx.array, precisions: set[str], cfg: PrecisionConfig, key: str
) -> dict[str, QuantTier]:
    """The packed tiers of one weight for the precisions its layer group names."""
    want = sorted(p for p in precisions if p != "full")
    if not want:
        return {}
    g = check_group_size(cfg.group_size, int(weight.shape[1]), key)
    if cfg.effective_tiers == "matryoshka":
        got = matryoshka_tiers(weight, g, tuple(BITS[p] for p in want))
        return {p: got[BITS[p]] for p in want}
    out = {}
    for p in want:
        bits = BITS[p]
        # int8 is symmetric as in the vLLM path (where it is per row: MLX needs groups)
        scheme = "symmetric" if (bits == 8 or cfg.symmetric is not False) else "affine"
        out[p] = quantize(weight, bits, g, scheme)
    return out


def install_gears(
    layout: LlamaLayout, cfg: PrecisionConfig, switch: GearSwitch
) -> tuple[list[MlxGearedLinear], list[tuple[str, ...]]]:
    """Replace every managed linear by a `MlxGearedLinear`; returns them and each layer's map."""
    geared: list[MlxGearedLinear] = []
    maps = []
    for i in range(layout.num_layers):
        first = len(geared)
        level_map = cfg.layer_map(i, layout.num_layers)
        maps.append(tuple(level_map))
        for module in cfg.modules:
            if module == "lm_head":
                continue  # the LM head stays full precision here (head_gears is refused)
            for parent, attr in layout.linears(i, module):
                linear = getattr(parent, attr)
                key = "adaptive.precision.group_size"
                tiers = build_tiers(linear.weight, set(level_map), cfg, key)
                g = MlxGearedLinear(linear, level_map, tiers, switch)
                setattr(parent, attr, g)
                geared.append(g)
        mx.eval([t.wq for g in geared[first:] for t in g.tiers.values()])
    return geared, maps


@dataclass
class GearRequest:
    """One request's gear state and what it ran."""

    tag: str
    state: RequestGearState
    prompt_len: int
    pinned: int | None = None  # a code fixed by the request (gear level or OFF)
    entropies: list[float] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)  # code of the step that made each token

    @property
    def code(self) -> int:
        return self.pinned if self.pinned is not None else self.state.level

    def record(self) -> dict[str, Any]:
        return gear_record(self.tag, self.prompt_len, self.codes, self.entropies, self.pinned)


class GearController:
    """Engine-wide: the policy, the switch, the geared linears and finished records."""

    def __init__(
        self, cfg: PrecisionConfig, layout: LlamaLayout, tokenizer: Any, switch: GearSwitch
    ) -> None:
        self.config = cfg
        self.switch = switch
        self.tokenizer = tokenizer
        self.policy: GearPolicy = build_policy(cfg, layout.vocab_size)
        self.geared, self.layer_maps = install_gears(layout, cfg, switch)
        self.finished: list[dict[str, Any]] = []
        self.max_finished = 4096
        self.seen = 0
        self._lock = threading.Lock()
        logger.info(
            "vllm-adaptive mlx precision: %s, %d geared linears, tiers %s",
            self.policy.name,
            len(self.geared),
            self.config.effective_tiers,
        )

    # -- per request ---------------------------------------------------------------------------
    def start(self, prompt_ids: list[int], overrides: RequestOverrides) -> GearRequest:
        self.seen += 1
        pinned = None
        if overrides.mode == "off":
            pinned = OFF
        elif overrides.gear is not None:
            pinned = LEVEL_NAMES.index(overrides.gear)
        text = None
        if pinned is None:
            text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        return GearRequest(
            tag=overrides.request_tag or f"req{self.seen}",
            state=self.policy.start(text),
            prompt_len=len(prompt_ids),
            pinned=pinned,
        )

    def before_forward(self, req: GearRequest | None) -> None:
        self.switch.code = OFF if req is None else req.code

    def wants_calibration(self, req: GearRequest) -> bool:
        return req.pinned is None and self.policy.wants_calibration

    def calibrate(self, logits: mx.array) -> None:
        """GEARBX: thresholds from the entropies of (up to N evenly spaced) prompt positions."""
        n = int(logits.shape[0])
        if n < 5:
            return
        k = self.policy.settings.calibration_positions
        idx = np.unique(np.linspace(0, n - 1, min(k, n)).round().astype(np.int64))
        ent = entropy_bits(logits[mx.array(idx)]).tolist()
        self.policy.calibrate(ent)
        logger.info("vllm-adaptive mlx: gear thresholds calibrated: %s", self.policy.describe())

    def observe(self, req: GearRequest, logits: mx.array) -> None:
        """The entropy of the distribution a token was sampled from; the level of the request's
        next forward comes back from the policy."""
        e = float(entropy_bits(logits).item())
        req.entropies.append(e)
        req.codes.append(req.code)
        if req.pinned is None:
            self.policy.observe(req.state, e)

    def finish(self, req: GearRequest) -> dict[str, Any]:
        rec = req.record()
        with self._lock:
            self.finished.append(rec)
            del self.finished[: -self.max_finished]
        if self.config.telemetry_path:
            with open(self.config.telemetry_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    # -- telemetry -----------------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.geared:
            for p, t in g.tiers.items():
                out[p] = out.get(p, 0) + t.nbytes
            out["full"] = out.get("full", 0) + g.full_bytes()
        return out

    def level_byte_ratios(self) -> dict[str, float]:
        """Weight bytes a pass at each code reads from the managed linears, relative to full
        (nominal bytes per parameter, as the vLLM path reports)."""
        total = sum(g.shape[0] * g.shape[1] for g in self.geared) or 1
        return {
            name: sum(
                g.shape[0] * g.shape[1] * BYTES_PER_PARAM[g.precisions[code]] for g in self.geared
            )
            / (total * BYTES_PER_PARAM["full"])
            for code, name in enumerate(CODE_NAMES)
        }

    def telemetry(self) -> dict[str, Any]:
        return {
            "policy": self.policy.describe(),
            "routing": self.config.effective_routing,
            "tiers": self.config.effective_tiers,
            "layer_maps": [list(m) for m in self.layer_maps],
            "resident_bytes": self.resident_bytes(),
            "level_byte_ratios": self.level_byte_ratios(),
            "finished": list(self.finished),
        }
