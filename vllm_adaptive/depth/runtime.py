"""Adaptive depth inside vLLM's forward pass: EMAD exits with batched depth-peeling.

Mechanism only; the exit signal (`policies/emad.py`) and the schedule (`schedule.py`) are
policies it calls. One step:

1. Plan, per request (row of the persistent batch): a decode row may stop at a probe layer
   between its floor F_t and its cap D_{t-1} (read from the per-slot depth record); a prefill
   row runs to the shallowest depth recorded for the cached slots it attends to (L unless a
   prefix-cache hit or resumed request brings slots written by exited tokens), never exits.
   A refresh row first backfills the K/V its raised cap needs (`backfill.py`).
2. Peel: run layer by layer; at each probe layer, rows at their cap stop, and decode rows
   whose proxy entropy passes the threshold stop. Their output is the calibrated readout
   `a_l * RMSNorm(h) + b_l`, which vLLM's `compute_logits` and sampler then use unchanged.
   The rest continue as one smaller batch with attention metadata sliced to them.
   With the ARLA signal (M2R2), at the first block of each gate interval the exit candidates
   at its gate first run the accelerated stream (`accelerated.py`) on the shared KV cache;
   ARLA reads those states at the gate, and a row it exits emits the final norm of the
   accelerated state instead of the calibrated readout.
3. Commit: every slot written this step records how many layers it got.

What happens to the K/V of skipped layers is the KV strategy's (`kv_strategies/`, one class
per `adaptive.depth.kv_strategy`); the runtime calls its hooks at each of these points and
holds no strategy of its own.

Over 400 lines because the three steps above share one step's state (the plan, the active rows, the
metadata of the rows still running); the mechanisms they call live in their own modules
(``engine/attention_metadata``, ``backfill``, ``accelerated``, ``fusion_runtime``,
``kv_strategies``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_adaptive.depth.accelerated import AcceleratedStash, AcceleratedStream
from vllm_adaptive.depth.backfill import ExitStateStore, backfill
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.fusion_runtime import EngineFusion
from vllm_adaptive.depth.kv_strategies import PlanDraft, build_kv_strategy
from vllm_adaptive.depth.mask_context import StepMask, current_mask, replace_mask
from vllm_adaptive.depth.policies.build import build_exit_signal, load_arla_adapters
from vllm_adaptive.depth.policies.probe import ProbeBatch
from vllm_adaptive.depth.record import SlotDepthRecord
from vllm_adaptive.depth.requests import BudgetThresholds, DepthRequests, exchange
from vllm_adaptive.depth.schedule import DepthSchedule
from vllm_adaptive.depth.stats import DecodeDepthStats
from vllm_adaptive.depth.step import ActiveRows, Step, StepPlan
from vllm_adaptive.engine.attention_metadata import (
    CpuSchedulerArgs,
    fused_cpu_metadata,
    subset_cpu_metadata,
    token_index,
)

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts

logger = logging.getLogger("vllm.adaptive.depth")


@dataclass
class EngineCounters(DecodeDepthStats):
    steps: int = 0
    prefill_tokens: int = 0
    capped_prefills: int = 0
    prefills_with_context: int = 0  # prefill rows attending to earlier slots (chunks, hits)
    backfilled_kv: int = 0
    propagated_kv: int = 0  # (token, layer) K/V written from exit states (propagate)
    river_token_layers: int = 0  # decode token-layers run in the Exit River
    recomputed_kv: int = 0  # token-layers resumed from exit states (recompute)
    masked_steps: int = 0  # steps where some cached slot was masked at some layer
    peels: int = 0
    accelerated_rows: int = 0  # (decode token, gate interval) accelerated streams computed
    accelerated_token_layers: int = 0  # decode token-layers run on the accelerated stream
    arla_exits: int = 0  # decode tokens that exited by ARLA (emitting the accelerated state)
    decision_seconds: float = 0.0
    accelerated_seconds: float = 0.0  # the accelerated stream (ARLA), inside the forward
    peel_seconds: float = 0.0
    forward_seconds: float = 0.0


class DepthRuntime:
    def __init__(
        self,
        parts: ModelParts,
        config: Any,
        profile: ExitProfile,
        vllm_config: Any,
        unembed: torch.Tensor | None = None,
        fusion: EngineFusion | None = None,
    ) -> None:
        self.config = config
        self.fusion = fusion
        self.profile = profile
        self.num_layers = profile.num_layers
        self.schedule = DepthSchedule.for_config(
            tuple(profile.readout_layers), config.floor, config.refresh
        )
        self.budget = config.budget if config.budget is not None else profile.budget
        self.kv = build_kv_strategy(config)
        self.signal_names = tuple(config.signal.policy)
        self.requests = DepthRequests(
            num_layers=self.num_layers,
            thresholds=BudgetThresholds(profile, self.budget),
            signal_names=self.signal_names,
            telemetry_path=config.telemetry_path,
        )
        self._last_export = 0.0
        self.accelerated: AcceleratedStream | None = None
        adapters = None
        if "arla" in self.signal_names:
            if not self.kv.supports_accelerated_stream:
                raise ValueError(
                    f'policy "arla" cannot run with adaptive.depth.kv_strategy "{self.kv.name}": '
                    "its layer loop has no accelerated stream (use another kv_strategy)"
                )
            adapters = load_arla_adapters(config.signal, profile, vllm_config.model_config.model)
            self.accelerated = AcceleratedStream(adapters)
        self.signal = build_exit_signal(
            config.signal, profile, unembed=unembed, arla_adapters=adapters
        )
        self.uses_budget = "emad" in self.signal_names
        self.emad_only = self.signal_names == ("emad",)
        self.probe_index = {layer: p for p, layer in enumerate(profile.probe_layers)}
        self.proxy_floor = torch.from_numpy(profile.proxy_floor).float()
        self.norm_a, self.norm_b = profile.norm_a, profile.norm_b
        self.eps = float(parts.final_norm.variance_epsilon)
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache_dtype = vllm_config.cache_config.cache_dtype
        self.parts = parts
        self.layer_names = parts.layer_names
        self.record: SlotDepthRecord | None = None
        self.store: ExitStateStore | None = None
        self.sched_args: CpuSchedulerArgs | None = None
        self.counters = EngineCounters()
        self._warned: set[str] = set()

    # -- requests ------------------------------------------------------------------------------
    def update_batch(self, batch_update: Any) -> None:
        """The persistent batch's changes, requests admitted (``batch_mirror`` listener)."""
        if self.requests.update_batch(batch_update):
            self.export(force=True)  # a request finished: its engine totals go out now

    def warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def weights_loaded(self) -> None:
        """The float weights are loaded (the Exit River quantizes its copies from them)."""
        self.kv.weights_loaded(self, self.parts)

    # -- state next to the KV cache ------------------------------------------------------------
    def _ensure_record(self, parts: ModelParts) -> bool:
        if self.record is not None:
            return True
        attn = parts.layers[0].attn
        cache = attn.kv_cache[0] if isinstance(attn.kv_cache, (list, tuple)) else attn.kv_cache
        if cache is None or cache.dim() != 4 or not hasattr(attn, "isa"):
            return False
        num_blocks, _, block_size, _ = cache.shape
        device = cache.device
        self.record = SlotDepthRecord(num_blocks * block_size, block_size, device)
        if self.config.refresh is not None or self.kv.stores_exit_states:
            hidden = parts.hidden_size
            self.store = ExitStateStore(num_blocks * block_size, hidden, self.dtype, device)
        self.sched_args = CpuSchedulerArgs.from_layer(attn, self.dtype, self.kv_cache_dtype)
        self.norm_a, self.norm_b = self.norm_a.to(device), self.norm_b.to(device)
        if hasattr(self.signal, "to"):
            self.signal.to(device)
        if self.accelerated is not None:
            self.accelerated.to(device)
        self.kv.kv_cache_ready(self, parts)
        logger.info(
            "vllm-adaptive depth: record for %d slots (block size %d), signal %s, kv_strategy "
            "%s, budget %.3g (%s), probes %s, floor %s, refresh %s, blocks %s",
            self.record.num_slots,
            block_size,
            "+".join(self.signal_names),
            self.kv.name,
            self.budget,
            self.profile.budget_kind,
            self.profile.probe_layers,
            self.config.floor,
            self.config.refresh,
            _blocks_note(self.block_compile_seconds()),
        )
        return True

    def block_compile_seconds(self) -> float | None:
        """Seconds the decoder blocks spent compiling (at vLLM's warm-up); None when they run
        eagerly or have not all compiled yet."""
        seconds = [getattr(layer.compiled, "compile_seconds", None) for layer in self.parts.layers]
        if any(s is None for s in seconds):
            return None
        return float(sum(seconds))

    # -- 1. plan ---------------------------------------------------------------------------------
    def _plan(self, parts: ModelParts, md: Any, positions: torch.Tensor) -> StepPlan:
        record = self.record
        assert record is not None
        qsl = md.query_start_loc.cpu()
        num_reqs = qsl.shape[0] - 1
        counts = (qsl[1:] - qsl[:-1]).tolist()
        seq_lens = md.seq_lens.cpu().tolist()
        last_pos = positions[(qsl[1:] - 1).long().to(positions.device)].cpu().tolist()
        states = self.requests.rows(num_reqs)
        L = self.num_layers
        P = len(self.profile.probe_layers)
        draft = PlanDraft(cap=np.full(num_reqs, L, dtype=np.int64), all_visible_below=L, resume=[])
        cap = draft.cap
        floor = np.zeros(num_reqs, dtype=np.int64)
        may_exit = np.zeros(num_reqs, dtype=bool)
        decode = np.zeros(num_reqs, dtype=bool)
        samples = np.zeros(num_reqs, dtype=bool)
        thresholds = np.full((num_reqs, P), -np.inf)
        if states is None:
            self.warn_once("unmapped", "vllm-adaptive depth: step not mapped; no exits")
        for r in range(num_reqs):
            state = states[r] if states is not None else None
            block_row = md.block_table[r]
            p = int(last_pos[r])
            samples[r] = state is not None and p + 1 == seq_lens[r] and p + 1 >= state.prompt_len
            if state is not None and counts[r] == 1 and p >= state.prompt_len:
                decode[r] = True
                t = p - state.prompt_len + 1
                self.kv.plan_decode(self, parts, draft, r, block_row, p, t)
                floor[r] = self.schedule.floor(t)
                if not state.off:
                    may_exit[r] = True
                    thresholds[r] = state.thresholds
            else:
                context = int(seq_lens[r]) - counts[r]
                low = record.context_min(block_row, context)
                if context > 0:
                    self.counters.prefills_with_context += 1
                self.kv.plan_prefill(self, draft, r, low)
                floor[r] = cap[r]
        if self.emad_only:
            # a row whose thresholds all lie below the proxy's floor can pass no probe (a
            # budget of 1.0): no candidate work for it at any layer
            may_exit &= (thresholds >= self.profile.proxy_floor).any(axis=1)
        return StepPlan(
            cap=torch.from_numpy(cap),
            floor=torch.from_numpy(floor),
            may_exit=torch.from_numpy(may_exit),
            thresholds=torch.from_numpy(thresholds).float(),
            decode=decode,
            samples=samples,
            states=states,
            all_visible_below=draft.all_visible_below,
            resume=draft.resume,
        )

    def _refresh(self, parts: ModelParts, block_row: torch.Tensor, p: int, cap: int) -> int:
        """Backfill K/V of positions [0, p) up to ``cap`` layers; keep the old cap if the
        exit states needed are not stored."""
        record, store = self.record, self.store
        assert record is not None
        if store is None:
            return int(record.read(record.slots(block_row, torch.tensor([p - 1]))).item())
        pos = torch.arange(p, device=block_row.device)
        slots = record.slots(block_row, pos)
        self.counters.backfilled_kv += backfill(parts.layers, record, store, slots, pos, cap)
        return cap

    # -- 2. peel ---------------------------------------------------------------------------------
    def _readout(self, p: int, stream: torch.Tensor) -> torch.Tensor:
        x = stream.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.norm_a[p] + self.norm_b[p]

    @torch.inference_mode()
    def forward(
        self,
        md: Any | None,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The decoder stack with exits, given this step's attention metadata ``md`` (the
        first layer's; None in dummy and profiling runs); None when this step is not one it
        can plan, and the caller runs every layer."""
        parts = self.parts
        if md is None or not self._ensure_record(parts):
            return None
        n = int(md.num_actual_tokens)
        if n != positions.shape[0]:
            # padded step: the caller runs every layer for every token; say so in the record
            self.record.write(md.slot_mapping[:n], self.num_layers)
            return None
        t0 = time.perf_counter()
        plan = self._plan(parts, md, positions)
        if self.fusion is not None:
            qsl = md.query_start_loc.cpu().long()
            plan.fusion = self.fusion.plan(plan.states, plan.decode, qsl, positions, input_ids)
            if plan.fusion is not None:
                # provisional: the masked backend reads this step's slots from the record
                # once fusion has removed rows (members get their layer when they fuse)
                self.record.write(md.slot_mapping[:n], self.num_layers)
        t_plan = time.perf_counter() - t0
        out, depth = self.kv.run_layers(self, parts, md, plan, positions, hidden, input_ids)
        self._commit(md, plan, depth, positions.shape[0])
        self.counters.decision_seconds += t_plan
        self.counters.forward_seconds += time.perf_counter() - t0
        return out

    def _candidates(self, plan: StepPlan, rows: torch.Tensor, count: int, p: int) -> torch.Tensor:
        """Rows (of the active ``rows``) that may exit after ``count`` blocks."""
        cand = plan.may_exit[rows] & (plan.floor[rows] <= count) & (plan.cap[rows] > count)
        if self.emad_only:
            cand &= plan.thresholds[rows, p] >= self.proxy_floor[p]  # else it cannot pass
        return cand

    def _decide(
        self,
        step: Step,
        act: ActiveRows,
        count: int,
        j: torch.Tensor,
        prev: torch.Tensor | None,
        acc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exit mask for the candidate rows ``j`` (of ``act``, decode rows: one token each)
        after ``count`` blocks; ``prev``: the block's input stream when the signal needs it;
        ``acc``: their accelerated states when ``count`` is an ARLA gate."""
        p = self.probe_index[count]
        h, res = act.h, act.res
        first = act.qsl[j].to(h.device)
        self.counters.probe_evals += int(j.numel())
        ids = None
        if step.input_ids is not None and self.signal.needs_token_ids:
            ids = step.input_ids[act.tok[first]]
        batch = ProbeBatch(
            layer=count,
            probe=p,
            stream=h[first] + res[first],
            prev_stream=None if prev is None else prev[first],
            token_ids=ids,
            readout=lambda x, p=p: self._readout(p, x),
            thresholds=step.plan.thresholds[act.rows[j], p].to(h.device),
            accelerated=acc,
        )
        return self.signal.exit_mask(batch).cpu()

    def _needs_prev(self, count: int) -> bool:
        return self.signal.needs_prev_stream and (count in self.probe_index)

    def _accelerate(self, step: Step, act: ActiveRows, block: int) -> AcceleratedStash | None:
        """Before block ``block`` runs: if it starts an ARLA gate interval, the accelerated
        stream of that interval for the active rows that are exit candidates at its gate."""
        accel = self.accelerated
        assert accel is not None and self.sched_args is not None
        interval = accel.interval_starting_at(block)
        if interval is None:
            return None
        j_gate, start, gate = interval
        cand = self._candidates(step.plan, act.rows, gate, self.probe_index[gate])
        if not bool(cand.any()):
            return None
        j = torch.nonzero(cand).squeeze(1)
        h, res = act.h, act.res
        first = act.qsl[j].to(h.device)  # decode rows: one token each
        stream = h[first] if res is None else h[first] + res[first]
        stash = accel.run(
            step.parts.layers,
            step.ctx,
            step.md,
            self.sched_args,
            j_gate,
            act.rows[j],
            act.pos[first],
            step.md.slot_mapping[act.tok[first]],
            stream,
        )
        self.counters.accelerated_rows += int(j.numel())
        self.counters.accelerated_token_layers += int(j.numel()) * (gate - start)
        return stash

    def _peel(self, parts, ctx, md, plan: StepPlan, positions, hidden, input_ids=None):
        L = self.num_layers
        c = self.counters
        num_reqs = plan.cap.shape[0]
        depth = plan.cap.clone()  # final depth per row
        out = torch.empty_like(hidden)
        rows = torch.arange(num_reqs)  # active rows (ascending)
        cur_qsl = md.query_start_loc.cpu().long()
        tok = torch.arange(hidden.shape[0], device=hidden.device)  # active -> step token
        h, res, pos = hidden, None, positions
        any_exit = bool(plan.may_exit.any())
        # nothing to decide between layers: no row may exit and none stops at a cap
        probing = any_exit or bool((plan.cap < L).any())
        step = Step(parts, md, plan, input_ids, ctx)
        cur_md = md  # metadata of the active rows and tokens
        sf = plan.fusion
        fusion_layers = set(self.fusion.layers) if sf is not None else set()
        fused = False  # queries are no longer contiguous: publish their positions
        stash: AcceleratedStash | None = None  # ARLA: the accelerated states of this interval
        for i, layer in enumerate(parts.layers):
            count = i + 1
            if self.accelerated is not None and any_exit and rows.numel() > 0:
                t0 = time.perf_counter()
                act = ActiveRows(rows, cur_qsl, tok, pos, h, res)
                got = self._accelerate(step, act, i)
                if got is not None or self.accelerated.interval_starting_at(i) is not None:
                    stash = got  # a new interval: the previous one's states are done
                c.accelerated_seconds += time.perf_counter() - t0
            prev = None
            if any_exit and self._needs_prev(count):
                prev = h if res is None else h + res  # the block's input stream
            h, res = layer.run_block(pos, h, res)
            if count in fusion_layers and rows.numel() > 0:
                t1 = time.perf_counter()
                got = self.fusion.fuse(
                    sf, count, rows, cur_qsl, tok, pos, h, res, input_ids,
                    self.record.block_size,
                )  # fmt: skip
                if got is not None:
                    if not fused:
                        self.fusion.counters.steps += 1
                    fused = True
                    k = got.keep.to(h.device)
                    h, res, pos, tok = got.h, got.res, pos[k], tok[k]
                    self.fusion.commit(sf, self.record, md.slot_mapping)  # members: layer l
                    cur_md = fused_cpu_metadata(cur_md, got.counts, got.keep, self.sched_args)
                    ctx.install(cur_md, count)
                    cur_qsl = cur_md.query_start_loc.cpu().long()
                    self._publish_positions(pos)
                c.peel_seconds += time.perf_counter() - t1
            p = self.probe_index.get(count)
            if p is None or not probing:
                continue
            t0 = time.perf_counter()
            stop = plan.cap[rows] == count
            cand = self._candidates(plan, rows, count, p)
            arla_js = arla_p = None
            if bool(cand.any()):
                j = torch.nonzero(cand).squeeze(1)
                acc = None
                if stash is not None and stash.gate == count:
                    acc = stash.states_for(rows[j])
                act = ActiveRows(rows, cur_qsl, tok, pos, h, res)
                passed = self._decide(step, act, count, j, prev, acc)
                stop[j] |= passed
                if acc is not None and bool(passed.any()):
                    arla_js, arla_p = j[passed], acc[passed.to(acc.device), -1]
            c.decision_seconds += time.perf_counter() - t0
            if not bool(stop.any()):
                continue
            t1 = time.perf_counter()
            js = torch.nonzero(stop).squeeze(1)
            ts = token_index(cur_qsl, js).to(h.device)
            stream = h[ts] + res[ts]
            out[tok[ts]] = self._readout(p, stream).to(out.dtype)
            if arla_js is not None:
                # ARLA exits emit the accelerated state p_{E_j}, read as the final layer is
                out[tok[cur_qsl[arla_js].to(h.device)]] = parts.final_norm(arla_p.contiguous()).to(
                    out.dtype
                )
                c.arla_exits += int(arla_js.numel())
            depth[rows[js]] = count
            if self.store is not None:
                self.store.write(md.slot_mapping[tok[ts]], stream)
            self.kv.exited(self, parts, stream, md.slot_mapping[tok[ts]], pos[ts], count)
            keep = torch.nonzero(~stop).squeeze(1)
            if keep.numel() == 0:
                rows = keep
                c.peel_seconds += time.perf_counter() - t1
                break
            tk = token_index(cur_qsl, keep).to(h.device)
            h, res, pos, tok = h[tk], res[tk], pos[tk], tok[tk]
            rows = rows[keep]
            sub = subset_cpu_metadata(cur_md, keep.to(md.query_start_loc.device), self.sched_args)
            ctx.install(sub, i + 1)
            cur_md = sub
            cur_qsl = sub.query_start_loc.cpu().long()
            if fused:
                self._publish_positions(pos)
            c.peels += 1
            c.peel_seconds += time.perf_counter() - t1
        if rows.numel() > 0:
            final, _ = parts.final_norm(h, res)
            out[tok] = final
            depth[rows] = L
        if fused:
            self.fusion.alias_outputs(sf, out)
        return out, depth

    @staticmethod
    def _publish_positions(pos: torch.Tensor) -> None:
        """The masked backend's per-query positions for the rows now running (token fusion)."""
        mask = current_mask()
        assert mask is not None, "fusion runs under the mask strategy's published mask"
        replace_mask(StepMask(mask.record, mask.all_visible_below, pos))

    # -- 3. commit -------------------------------------------------------------------------------
    def _commit(self, md: Any, plan: StepPlan, depth: torch.Tensor, num_tokens: int) -> None:
        record = self.record
        assert record is not None
        qsl = md.query_start_loc.cpu()
        counts = (qsl[1:] - qsl[:-1]).long()
        if self.kv.fills_every_layer:
            # every layer has K/V for every token (propagated, or written by the river)
            record.write(md.slot_mapping[:num_tokens], self.num_layers)
        else:
            per_token = torch.repeat_interleave(depth, counts)[:num_tokens]
            record.write(md.slot_mapping[:num_tokens], per_token.to(md.slot_mapping.device))
        if plan.fusion is not None and plan.fusion.fused:
            EngineFusion.commit(plan.fusion, record, md.slot_mapping)
        c = self.counters
        c.steps += 1
        dec = torch.from_numpy(plan.decode)
        c.prefill_tokens += int(counts[~dec].sum())
        c.observe(depth[dec].tolist())
        self.requests.observe(plan, depth.tolist())
        self.export()

    # -- telemetry -----------------------------------------------------------------------------
    def export(self, force: bool = False) -> None:
        """Engine counters for the frontend's Prometheus exporter, at most once a second."""
        now = time.monotonic()
        if force or now - self._last_export >= 1.0:
            self._last_export = now
            exchange("write_engine_stats", self.engine_stats())

    def telemetry(self) -> dict[str, Any]:
        finished, running = self.requests.records()
        out = {"engine": self.engine_stats(), "finished": finished, "running": running}
        if self.fusion is not None:
            out["fusion_events"] = self.fusion.recent_events()
        return out

    def engine_stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "mechanism": "depth",
            "signal": list(self.signal_names),
            "kv_strategy": self.kv.name,
            "propagated_kv": c.propagated_kv,
            "river_token_layers": c.river_token_layers,
            "recomputed_kv": c.recomputed_kv,
            "masked_steps": c.masked_steps,
            "num_layers": self.num_layers,
            "budget": self.budget,
            "budget_kind": self.profile.budget_kind,
            "probe_layers": self.profile.probe_layers,
            "steps": c.steps,
            **c.summary(),
            "prefill_tokens": c.prefill_tokens,
            "capped_prefills": c.capped_prefills,
            "prefills_with_context": c.prefills_with_context,
            "backfilled_kv": c.backfilled_kv,
            "peels": c.peels,
            "accelerated_rows": c.accelerated_rows,
            "accelerated_token_layers": c.accelerated_token_layers,
            "arla_exits": c.arla_exits,
            "proxy_rank": int(self.profile.lowrank_v.shape[1]),
            "proxy": self.profile.proxy,
            "decision_seconds": c.decision_seconds,
            "peel_seconds": c.peel_seconds,
            "accelerated_seconds": c.accelerated_seconds,
            "forward_seconds": c.forward_seconds,
            "block_compile_seconds": self.block_compile_seconds(),
            "requests_finished": self.requests.finished_count,
            "fusion": self.fusion.stats() if self.fusion is not None else None,
        }


def _blocks_note(compile_seconds: float | None) -> str:
    if compile_seconds is None:
        return "eager"
    return f"compiled ({compile_seconds:.1f} s at warm-up)"
