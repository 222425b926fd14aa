"""Per-engine precision controller: request state per batch slot, the step plan, telemetry.

Lives in the worker next to the model. Three hooks drive it, all called by vLLM's own loop:

1. ``update_batch`` (from a logits processor's ``update_state``, before each forward): mirrors
   the persistent batch: requests added (cold-start gear, per-request overrides, parsed once
   by `batch_mirror.admit`), removed,
   moved or swapped, so slot ``i`` is always the request whose tokens come ``i``-th in the step.
2. ``begin_step`` (from the model's forward, outside the compiled graph): turns the slots' gear
   levels into a plan: one level for the whole step (``routing="step"``: the most demanding
   request decides) or one per token (``routing="token"``: tokens grouped by gear).
3. ``observe_logits`` (from ``compute_logits``): the entropy of each request's sampled row goes
   to its policy, which returns the level of that request's next step.

Codes in a plan: 0 low, 1 mid, 2 high (policy levels), 3 full (``adaptive_mode: "off"``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_adaptive.batch_mirror import SlotMirror
from vllm_adaptive.gears import HIGH, LEVEL_NAMES
from vllm_adaptive.overrides import RequestOverrides
from vllm_adaptive.precision.entropy import entropy_bits
from vllm_adaptive.precision.policies import GearPolicy, RequestGearState
from vllm_adaptive.precision.records import CODE_NAMES, gear_record
from vllm_adaptive.precision.telemetry import PrecisionTelemetry

logger = logging.getLogger("vllm.adaptive.precision")

OFF = 3


@dataclass
class Slot:
    """One request in the persistent batch."""

    tag: str
    state: RequestGearState
    prompt_len: int
    pinned: int | None = None  # a code fixed by the request (gear level or OFF)
    prefill_code: int = HIGH  # code of the steps that prefill the prompt (and make token 1)
    entropies: list[float] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)  # code of the step that made each token

    @property
    def code(self) -> int:
        return self.pinned if self.pinned is not None else self.state.level

    def code_at(self, last_position: int) -> int:
        """Code of a step whose last token of this request sits at ``last_position``: a step
        that is still reading the prompt (a prefill chunk, or the one that makes the first
        token) runs the prefill code."""
        return self.prefill_code if last_position < self.prompt_len else self.code

    def record(self) -> dict[str, Any]:
        rec = gear_record(self.tag, self.prompt_len, self.codes, self.entropies, self.pinned)
        rec["prefill_gear"] = CODE_NAMES[self.prefill_code]
        rec["finished_at"] = time.time()
        return rec


@dataclass
class GearStepPlan:
    num_reqs: int
    codes: np.ndarray  # per request
    token_codes: torch.Tensor | None  # per token (token routing)
    last_positions: np.ndarray | None
    query_start: np.ndarray | None
    pending_logits: bool = True
    groups: dict = field(default_factory=dict)


class PrecisionController:
    def __init__(
        self,
        precision_config,
        policy: GearPolicy,
        layer_maps: list[tuple[str, ...]],
        tokenizer_path: str | None,
        exports_telemetry: bool = True,
    ) -> None:
        """``exports_telemetry``: this process writes the engine's stats for the frontend (the
        first rank of the engine)."""
        self.config = precision_config
        self.policy = policy
        self.routing = precision_config.effective_routing
        self.layer_maps = layer_maps
        self.tokenizer_path = tokenizer_path
        self._tokenizer = None
        self.mirror: SlotMirror[Slot] = SlotMirror(
            lambda overrides, prompt_ids, _out: self._new_slot(overrides, prompt_ids), self._finish
        )
        self.slots = self.mirror.slots
        self.plan: GearStepPlan | None = None
        self.geared: list = []  # the engine's GearedLinears (models/precision.py fills it)
        self._uniform_code: int | None = None  # the code every geared linear's fast call runs
        #: False when every level runs one precision (install_precision decides): routing
        #: cannot change a token, so no entropy pass, no prompt decode, no calibration
        self.routes = True
        #: the int4 / int2 tiers' grid, "symmetric" or "asymmetric" (install_precision decides)
        self.low_bit_grid: str | None = None
        self.finished: list[dict[str, Any]] = []
        self.max_finished = 4096
        self.requests_seen = 0
        self.telemetry_path = precision_config.telemetry_path
        # engine counters and records for the frontend (metrics, the per-request route); the
        # model sets ``stats.num_layers``
        self.stats = PrecisionTelemetry(
            None, {"policy": policy.name, "routing": self.routing}, writes=exports_telemetry
        )
        self._lock = threading.Lock()

    # -- 1. batch mirror -----------------------------------------------------------------------
    def _prompt_text(self, prompt_ids: list[int] | None) -> str | None:
        if not prompt_ids or self.tokenizer_path is None:
            return None
        if self._tokenizer is None:
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            except Exception as e:  # cold start then falls back to the mid gear
                logger.warning("vllm-adaptive: no tokenizer for cold start (%s)", e)
                self.tokenizer_path = None
                return None
        return self._tokenizer.decode(prompt_ids, skip_special_tokens=True)

    def _new_slot(self, overrides: RequestOverrides, prompt_ids: list[int] | None) -> Slot:
        self.requests_seen += 1
        tag = overrides.request_tag or f"req{self.requests_seen}"
        pinned = None
        if overrides.mode == "off":
            pinned = OFF
        elif overrides.gear is not None:
            pinned = LEVEL_NAMES.index(overrides.gear)
        reads = pinned is None and self.routes and self.policy.reads_prompt()
        state = self.policy.start(self._prompt_text(prompt_ids) if reads else None)
        prefill = pinned if pinned is not None else self.policy.prefill_level(state)
        return Slot(
            tag=tag,
            state=state,
            prompt_len=len(prompt_ids or ()),
            pinned=pinned,
            prefill_code=prefill,
        )

    def _finish(self, slot: Slot) -> None:
        rec = slot.record()
        self.finished.append(rec)
        del self.finished[: -self.max_finished]
        if self.telemetry_path:
            with open(self.telemetry_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        self.stats.request_finished(rec)

    def update_batch(self, batch_update) -> None:
        with self._lock:
            self.mirror.apply(batch_update)

    # -- 2. the step plan ----------------------------------------------------------------------
    def begin_step(self, positions: torch.Tensor, qsl: np.ndarray | None) -> None:
        """This step's gear plan from the requests' positions and the step's query offsets
        per request (``qsl``; None in vLLM's dummy and profiling runs: the high gear)."""
        t0 = time.perf_counter()
        num_tokens = positions.shape[0]
        num_reqs = len(qsl) - 1 if qsl is not None else 0
        if (
            qsl is None
            or num_reqs != len(self.slots)
            or any(i not in self.slots for i in range(num_reqs))
        ):
            # A dummy / profiling run, or a batch we cannot map: everything at the high gear.
            self.plan = GearStepPlan(0, np.full(1, HIGH), None, None, None, pending_logits=False)
            self._set_uniform(HIGH)
            return
        last = positions[torch.from_numpy(qsl[1:] - 1).to(positions.device)].cpu().numpy()
        codes = np.array(
            [self.slots[i].code_at(int(last[i])) for i in range(num_reqs)], dtype=np.int64
        )
        token_codes = None
        if self.routing == "token" and len(set(codes.tolist())) > 1:
            counts = np.diff(qsl)
            token_codes = torch.from_numpy(np.repeat(codes, counts)[:num_tokens])
            if token_codes.shape[0] < num_tokens:  # padding rows: run them at the high gear
                pad = torch.full((num_tokens - token_codes.shape[0],), HIGH, dtype=torch.int64)
                token_codes = torch.cat([token_codes, pad])
        self.plan = GearStepPlan(num_reqs, codes, token_codes, last, qsl)
        if self.config.offload_inactive:
            self.offload_inactive(set(codes.tolist()) | self._prewarm_codes())
        # Every row of every layer runs one code unless tokens are routed apart (step routing:
        # the most demanding request decides, as in ``groups``).
        self._set_uniform(int(codes.max()) if token_codes is None and num_reqs else None)
        self.stats.step_started(time.perf_counter() - t0)

    def _set_uniform(self, code: int | None) -> None:
        """Point each geared linear's fast call at ``code``'s kernel (None: the grouped path).
        Tiers that come and go (``offload_inactive``) always take the grouped path, which
        restores them."""
        if self.config.offload_inactive:
            code = None
        if code == self._uniform_code:
            return
        self._uniform_code = code
        for g in self.geared:
            g.set_uniform(None if code is None else g.level_precisions[code])

    def _prewarm_codes(self) -> set[int]:
        """Levels the policies expect next (GEARBX section 3.5): kept resident."""
        return {s.state.prewarm for s in self.slots.values() if s.state.prewarm is not None}

    def offload_inactive(self, codes: set[int]) -> None:
        """Release every tier no code in ``codes`` maps to; ``GearedLinear.run`` restores a
        released tier when a later step needs it."""
        if codes == getattr(self, "_resident_codes", None):
            return
        self._resident_codes = set(codes)
        for g in self.geared:
            keep = {g.level_precisions[c] for c in codes}
            for precision in g.tiers.tiers:
                if precision not in keep and precision not in g.tiers.released:
                    g.tiers.release(precision)

    def groups(self, level_precisions: tuple[str, ...], num_tokens: int):
        """``[(precision, row index or None)]`` for a layer whose codes map to precisions.

        Rows are the step's tokens (decoder linears) or its sampled rows, one per request (the
        LM head): both are grouped by their request's gear under token routing."""
        plan = self.plan
        if plan is None:
            return [(level_precisions[HIGH], None)]
        key = (level_precisions, num_tokens)
        got = plan.groups.get(key)
        if got is not None:
            return got
        row_codes = None
        if plan.token_codes is not None:
            if plan.token_codes.shape[0] == num_tokens:
                row_codes = plan.token_codes
            elif num_tokens == plan.num_reqs:
                row_codes = torch.from_numpy(plan.codes)
        if row_codes is None:
            # step routing (or a layout we cannot map): the most demanding request decides
            got = [(level_precisions[int(plan.codes.max())], None)]
        else:
            by_precision: dict[str, list[int]] = {}
            for code in np.unique(plan.codes).tolist():
                by_precision.setdefault(level_precisions[code], []).append(code)
            if len(by_precision) == 1:
                got = [(next(iter(by_precision)), None)]
            else:
                got = []
                for precision, codes in by_precision.items():
                    mask = torch.zeros_like(row_codes, dtype=torch.bool)
                    for c in codes:
                        mask |= row_codes == c
                    got.append((precision, mask.nonzero().squeeze(1)))
        plan.groups[key] = got
        return got

    # -- 3. entropy ----------------------------------------------------------------------------
    def observe_logits(self, logits: torch.Tensor) -> None:
        plan = self.plan
        if plan is None or not plan.pending_logits or logits.shape[0] != plan.num_reqs:
            return  # prompt-logprob rows, dummy runs, or speculative layouts: not a sampled step
        plan.pending_logits = False
        t0 = time.perf_counter()
        if self.policy.reads_entropy and self.routes:
            ent = entropy_bits(logits).tolist()
        else:  # the policy ignores it: no pass over the vocabulary per request
            ent = [None] * plan.num_reqs
        rows = []
        with self._lock:
            for i, e in enumerate(ent):
                slot = self.slots.get(i)
                if slot is None or plan.last_positions[i] + 1 < slot.prompt_len:
                    continue  # a partial prefill chunk: its sample is discarded
                if e is not None:
                    slot.entropies.append(e)
                slot.codes.append(int(plan.codes[i]))
                if e is not None or not self.policy.reads_entropy:
                    self.policy.observe(slot.state, e)
                c, decode = slot.codes, bool(plan.last_positions[i] >= slot.prompt_len)
                rows.append((CODE_NAMES[c[-1]], decode, decode and len(c) > 2 and c[-1] != c[-2]))
        self.stats.observed(rows, time.perf_counter() - t0)

    def calibration_rows(self) -> tuple[int, int] | None:
        """Token range of a prefill chunk in this step with >= 5 tokens, if the policy wants one."""
        plan = self.plan
        if (
            not self.routes
            or not self.policy.wants_calibration
            or plan is None
            or plan.query_start is None
        ):
            return None
        counts = np.diff(plan.query_start)
        i = int(np.argmax(counts))
        if counts[i] < 5:
            return None
        return int(plan.query_start[i]), int(plan.query_start[i + 1])

    def calibrate(self, entropies: list[float]) -> None:
        self.policy.calibrate(entropies)
        logger.info("vllm-adaptive: gear thresholds calibrated: %s", self.policy.describe())

    # -- telemetry -----------------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        return resident_bytes(self.geared)

    def level_byte_ratios(self) -> dict[str, float]:
        """Weight bytes a step at each gear level reads, relative to the float weights."""
        from vllm_adaptive.flops import BYTES_PER_PARAM

        geared = self.geared
        total = sum(g.full_bytes for g in geared) or 1

        def nbytes(g, precision: str) -> float:
            if precision == "full":
                return g.full_bytes
            return g.tiers.shape[0] * g.tiers.shape[1] * BYTES_PER_PARAM[precision]

        return {
            name: sum(nbytes(g, g.level_precisions[code]) for g in geared) / total
            for code, name in enumerate(CODE_NAMES)
        }

    def telemetry(self) -> dict[str, Any]:
        with self._lock:
            live = [s.record() for _, s in sorted(self.slots.items())]
        return {
            "policy": self.policy.describe(),
            "routing": self.routing,
            "routes": self.routes,
            "low_bit_grid": self.low_bit_grid,
            "layer_maps": [list(m) for m in self.layer_maps],
            "resident_bytes": self.resident_bytes(),
            "level_byte_ratios": self.level_byte_ratios(),
            "nested_gemms": sum(g.nested_calls for g in self.geared),
            "finished": list(self.finished),
            "live": live,
        }


def resident_bytes(geared) -> dict[str, int]:
    """Packed bytes each precision keeps resident, summed over the geared linears."""
    out: dict[str, int] = {}
    for g in geared:
        for p in g.tiers.tiers:
            out[p] = out.get(p, 0) + g.tiers.resident_bytes(p)
        shared = g.tiers.shared_bytes()
        if shared:
            out["matryoshka_int8_storage"] = out.get("matryoshka_int8_storage", 0) + shared
        out["full"] = out.get("full", 0) + g.full_bytes
    return out
