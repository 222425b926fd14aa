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

The runtime asks the engine's attention (`attention_port.StepAttention`, which the model glue
hands it) for metadata of the rows still running; it imports nothing of vLLM. Which rows stop at
a probe, and what they emit, is `exit_decisions.ExitDecisions`.

Over 400 lines because the three steps above share one step's state (the plan, the active rows,
the metadata of the rows still running); the mechanisms they call live in their own modules
(``exit_decisions``, ``backfill``, ``accelerated``, ``fusion_runtime``, ``kv_strategies``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_adaptive.depth.accelerated import AcceleratedStash, AcceleratedStream
from vllm_adaptive.depth.attention_port import LayerSwaps, StepAttention, token_index
from vllm_adaptive.depth.backfill import ExitStateStore
from vllm_adaptive.depth.counters import EngineCounters
from vllm_adaptive.depth.exit_decisions import ExitDecisions
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.fusion_runtime import EngineFusion
from vllm_adaptive.depth.kv_strategies import KvState, PlanDraft, build_kv_strategy
from vllm_adaptive.depth.mask_context import StepMask, current_mask, publish_mask, replace_mask
from vllm_adaptive.depth.policies.build import build_exit_signal, load_arla_adapters
from vllm_adaptive.depth.record import SlotDepthRecord
from vllm_adaptive.depth.requests import BudgetThresholds, DepthRequests, exchange
from vllm_adaptive.depth.schedule import DepthSchedule
from vllm_adaptive.depth.step import ActiveRows, Step, StepPlan

if TYPE_CHECKING:
    from vllm_adaptive.models.interface import ModelParts

logger = logging.getLogger("vllm.adaptive.depth")


class DepthRuntime:
    def __init__(
        self,
        parts: ModelParts,
        config: Any,
        profile: ExitProfile,
        attention: StepAttention,
        model_dir: str,
        dtype: torch.dtype,
        unembed: torch.Tensor | None = None,
        fusion: EngineFusion | None = None,
    ) -> None:
        """``attention``: the engine's attention as the layer loop uses it (the glue's
        implementation of `attention_port.StepAttention`); ``model_dir`` and ``dtype``: the
        served model's (ARLA's adapter is checked against the first; exit states kept in the
        second)."""
        self.config = config
        self.fusion = fusion
        self.profile = profile
        self.attention = attention
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
            adapters = load_arla_adapters(config.signal, profile, model_dir)
            self.accelerated = AcceleratedStream(adapters)
        signal = build_exit_signal(config.signal, profile, unembed=unembed, arla_adapters=adapters)
        self.counters = EngineCounters()
        self.exits = ExitDecisions(
            signal,
            profile,
            eps=float(parts.final_norm.variance_epsilon),
            counters=self.counters,
            emad_only=self.signal_names == ("emad",),
        )
        self.dtype = dtype
        self.parts = parts
        self._spans: dict[int, tuple[int, Any]] = {}  # start -> (end, graph)
        self._span_ends: frozenset[int] = frozenset()
        self.record: SlotDepthRecord | None = None
        self.store: ExitStateStore | None = None
        self.state: KvState | None = None  # the KV strategies' view, once the KV cache exists
        # some slot was recorded below the full stack: a plan may read a cap from the record
        self._shallow = False
        # steps of quiet requests only may skip the plan (`_forward_quiet`) unless the step's
        # layer loop is the strategy's own or fusion may merge tokens
        self._quiet_steps = fusion is None and not self.kv.owns_layer_loop
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
        self.kv.weights_loaded(self.parts, self.num_layers)

    def span_cuts(self) -> tuple[int, ...]:
        """Where the stack may be cut into compiled spans for steps that probe: after each probe
        layer. Empty where a step needs more between blocks than a probe layer's output (the
        block's input stream, ARLA's accelerated stream, token fusion)."""
        if self.fusion is not None or self.accelerated is not None:
            return ()
        if self.exits.signal.needs_prev_stream or self.kv.owns_layer_loop or self.kv.runs_blocks:
            return ()
        probes = tuple(self.profile.probe_layers)
        if not self.exits.emad_only or self.budget >= 1.0:
            return probes  # any probe may stop a row (an engine at 1.0 serves request budgets)
        # EMAD at the engine's budget: only probes whose threshold the proxy can reach stop a
        # row, so the stack is cut there alone (a step with other live probes, from a request's
        # own budget, runs block by block)
        live = self.profile.thresholds_for(self.budget) >= self.profile.proxy_floor
        return tuple(layer for layer, ok in zip(probes, live, strict=True) if ok)

    def attach_spans(self, parts: ModelParts) -> None:
        """Run with ``parts`` (the same model with :attr:`ModelParts.spans` compiled)."""
        self.parts = parts
        self._spans = {a: (b, graph) for a, b, graph in parts.spans}
        self._span_ends = frozenset(b for _, b, _ in parts.spans)

    # -- state next to the KV cache ------------------------------------------------------------
    def _ensure_record(self, parts: ModelParts) -> bool:
        if self.record is not None:
            return True
        geometry = self.attention.bind(parts.layers[0].attn)
        if geometry is None:
            return False
        device, block_size = geometry.device, geometry.block_size
        self.record = SlotDepthRecord(geometry.num_slots, block_size, device)
        if self.config.refresh is not None or self.kv.stores_exit_states:
            hidden = parts.hidden_size
            self.store = ExitStateStore(geometry.num_slots, hidden, self.dtype, device)
        self.exits.to(device)
        if self.accelerated is not None:
            self.accelerated.to(device)
        self.state = KvState(
            num_layers=self.num_layers,
            record=self.record,
            store=self.store,
            counters=self.counters,
            attention=self.attention,
            schedule=self.schedule,
            warn_once=self.warn_once,
        )
        self.kv.kv_cache_ready(self.state, parts)
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
        graphs = [layer.compiled for layer in self.parts.layers] + [self.parts.compiled_stack]
        graphs = [g for g in graphs if g is not None] + [g for _, _, g in self.parts.spans]
        seconds = [getattr(graph, "compile_seconds", None) for graph in graphs]
        if not graphs or any(s is None for s in seconds):
            return None
        return float(sum(seconds))

    # -- 1. plan ---------------------------------------------------------------------------------
    def _plan(
        self, parts: ModelParts, md: Any, positions: torch.Tensor, states: list | None
    ) -> StepPlan:
        kv_state = self.state
        assert kv_state is not None
        record = kv_state.record
        qsl = md.query_start_loc.cpu()
        num_reqs = qsl.shape[0] - 1
        counts = (qsl[1:] - qsl[:-1]).tolist()
        seq_lens = md.seq_lens.cpu().tolist()
        last_pos = positions[(qsl[1:] - 1).long().to(positions.device)].cpu().tolist()
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
                self.kv.plan_decode(kv_state, parts, draft, r, block_row, p, t)
                floor[r] = self.schedule.floor(t)
                if not state.off:
                    may_exit[r] = True
                    thresholds[r] = state.thresholds
            else:
                context = int(seq_lens[r]) - counts[r]
                low = record.context_min(block_row, context)
                if context > 0:
                    self.counters.prefills_with_context += 1
                self.kv.plan_prefill(kv_state, draft, r, low)
                floor[r] = cap[r]
        if self.exits.emad_only:
            # a row whose thresholds all lie below the proxy's floor can pass no probe (a
            # budget of 1.0): no candidate work for it at any layer
            may_exit &= (thresholds >= self.profile.proxy_floor).any(axis=1)
        candidates = None
        if may_exit.any():
            candidates = self.exits.candidate_matrix(cap, floor, may_exit, thresholds)
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
            candidates=candidates,
        )

    # -- 2. run the layers -----------------------------------------------------------------------
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
        states = self.requests.rows(int(md.query_start_loc.shape[0]) - 1)
        if self._quiet_steps and not self._shallow and states and all(s.quiet for s in states):
            return self._forward_quiet(md, positions, hidden, states)
        t0 = time.perf_counter()
        plan = self._plan(parts, md, positions, states)
        if self.fusion is not None:
            qsl = md.query_start_loc.cpu().long()
            plan.fusion = self.fusion.plan(plan.states, plan.decode, qsl, positions, input_ids)
            if plan.fusion is not None:
                # provisional: the masked backend reads this step's slots from the record
                # once fusion has removed rows (members get their layer when they fuse)
                self.record.write(md.slot_mapping[:n], self.num_layers)
        t_plan = time.perf_counter() - t0
        out, depth = self._run_layers(parts, md, plan, positions, hidden, input_ids)
        self._commit(md, plan, depth, positions.shape[0])
        self.counters.decision_seconds += t_plan
        self.counters.forward_seconds += time.perf_counter() - t0
        return out

    def _forward_quiet(
        self, md: Any, positions: torch.Tensor, hidden: torch.Tensor, states: list
    ) -> torch.Tensor:
        """A step no row can leave early (every request quiet, no slot recorded below the full
        stack, so every strategy's plan is "all layers"): the stack as one graph, then the
        record and the telemetry, without planning row by row (per-row Python: a record read
        per decode row, the thresholds matrix)."""
        t0 = time.perf_counter()
        parts, L, n = self.parts, self.num_layers, positions.shape[0]
        out, _ = parts.run_stack(positions, hidden, None)
        t1 = time.perf_counter()
        self.record.write(md.slot_mapping[:n], L)
        qsl = md.query_start_loc.cpu().numpy().astype(np.int64)
        counts = np.diff(qsl)
        last = positions[torch.from_numpy(qsl[1:] - 1).to(positions.device)].cpu().numpy()
        seq_lens = md.seq_lens.cpu().numpy()
        prompt = np.fromiter((s.prompt_len for s in states), np.int64, len(states))
        decode = (counts == 1) & (last >= prompt)
        samples = (last + 1 == seq_lens) & (last + 1 >= prompt)
        c = self.counters
        c.steps += 1
        c.whole_stack_steps += 1
        c.quiet_steps += 1
        c.prefill_tokens += int(counts[~decode].sum())
        c.observe([L] * int(decode.sum()))
        self.requests.observe(states, samples, decode, [L] * len(states))
        self.export()
        t2 = time.perf_counter()
        c.decision_seconds += t2 - t1
        c.forward_seconds += t2 - t0
        return out

    def _run_layers(
        self,
        parts: ModelParts,
        md: Any,
        plan: StepPlan,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        input_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's layer loop: ``(output stream, depth per row)``. Depth-peeling, with the
        strategy's KV mask published to attention and its ``before_layers`` run first, unless
        the strategy runs every row through every layer itself."""
        state = self.state
        assert state is not None
        if self.kv.owns_layer_loop:
            return self.kv.run_layers(
                state, parts, self.exits, md, plan, positions, hidden, input_ids
            )
        mask = self.kv.step_mask(state, plan)
        with self.attention.layer_swaps() as swaps, publish_mask(mask):
            self.kv.before_layers(state, parts, swaps, md, plan)
            return self._peel(parts, swaps, md, plan, positions, hidden, input_ids)

    def _accelerate(self, step: Step, act: ActiveRows, block: int) -> AcceleratedStash | None:
        """Before block ``block`` runs: if it starts an ARLA gate interval, the accelerated
        stream of that interval for the active rows that are exit candidates at its gate."""
        accel = self.accelerated
        assert accel is not None
        interval = accel.interval_starting_at(block)
        if interval is None:
            return None
        j_gate, start, gate = interval
        cand = self.exits.candidates(step.plan, act.rows, self.exits.probe_index[gate])
        if not bool(cand.any()):
            return None
        j = torch.nonzero(cand).squeeze(1)
        h, res = act.h, act.res
        first = act.qsl[j].to(h.device)  # decode rows: one token each
        stream = h[first] if res is None else h[first] + res[first]
        stash = accel.run(
            step.parts.layers,
            step.swaps,
            step.md,
            self.attention,
            j_gate,
            act.rows[j],
            act.pos[first],
            step.md.slot_mapping[act.tok[first]],
            stream,
        )
        self.counters.accelerated_rows += int(j.numel())
        self.counters.accelerated_token_layers += int(j.numel()) * (gate - start)
        return stash

    def _peel(
        self,
        parts: ModelParts,
        swaps: LayerSwaps,
        md: Any,
        plan: StepPlan,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        input_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth-peeling: run block by block; after a probe block the rows that stop (at their
        cap, or by the exit signal) emit their readout and leave, and the rest run on as one
        smaller batch with metadata for them alone."""
        L = self.num_layers
        counters, exits, state = self.counters, self.exits, self.state
        assert state is not None
        num_reqs = plan.cap.shape[0]
        depth = plan.cap.clone()  # final depth per row
        out = torch.empty_like(hidden)
        rows = torch.arange(num_reqs)  # active rows (ascending)
        row_starts = md.query_start_loc.cpu().long()  # the active rows' first token in ``h``
        tok = torch.arange(hidden.shape[0], device=hidden.device)  # active -> step token
        h, res, pos = hidden, None, positions
        any_exit = bool(plan.may_exit.any())
        # decided once for the step: the probes where some row may exit, the caps where rows stop
        live = exits.live_probes(plan)
        cap_stops = set(plan.cap[plan.cap < L].tolist())
        # nothing to decide between layers: no row may exit and none stops at a cap
        probing = any(live) or bool(cap_stops)
        step = Step(parts, md, plan, input_ids, swaps)
        active_md = md  # metadata of the active rows and tokens
        step_fusion = plan.fusion
        fusion_layers = set(self.fusion.layers) if step_fusion is not None else set()
        fused = False  # queries are no longer contiguous: publish their positions
        stash: AcceleratedStash | None = None  # ARLA: the accelerated states of this interval
        if not probing and not fusion_layers:
            # nothing to decide between blocks: the whole stack in one graph
            counters.whole_stack_steps += 1
            final, _ = parts.run_stack(pos, h, res)
            return final, depth
        # rows stop only after probe layers: the stretches between them as one graph each
        spans = self._spans if self._spans_serve(plan.cap, live) else None
        if spans is not None:
            counters.span_steps += 1
        for i, layer in enumerate(parts.layers):
            count = i + 1
            if spans is not None:
                span = spans.get(i)
                if span is not None:
                    h, res = span[1](pos, h, res)
                if count not in self._span_ends:
                    continue  # inside a span: nothing to decide here
            elif self.accelerated is not None and any_exit and rows.numel() > 0:
                t0 = time.perf_counter()
                act = ActiveRows(rows, row_starts, tok, pos, h, res)
                got = self._accelerate(step, act, i)
                if got is not None or self.accelerated.interval_starting_at(i) is not None:
                    stash = got  # a new interval: the previous one's states are done
                counters.accelerated_seconds += time.perf_counter() - t0
            prev = None
            if spans is None and any_exit and exits.needs_prev(count):
                prev = h if res is None else h + res  # the block's input stream
            if spans is None:
                h, res = layer.run_block(pos, h, res)
            if count in fusion_layers and rows.numel() > 0:
                t1 = time.perf_counter()
                got = self.fusion.fuse(
                    step_fusion, count, rows, row_starts, tok, pos, h, res, input_ids,
                    state.record.block_size,
                )  # fmt: skip
                if got is not None:
                    if not fused:
                        self.fusion.counters.steps += 1
                    fused = True
                    k = got.keep.to(h.device)
                    h, res, pos, tok = got.h, got.res, pos[k], tok[k]
                    self.fusion.commit(step_fusion, state.record, md.slot_mapping)  # members
                    active_md = self.attention.fused(active_md, got.counts, got.keep)
                    swaps.install(active_md, count)
                    row_starts = active_md.query_start_loc.cpu().long()
                    self._publish_positions(pos)
                counters.peel_seconds += time.perf_counter() - t1
            p = exits.probe(count)
            if p is None or not probing or not (live[p] or count in cap_stops):
                continue
            # which active rows stop here: at their cap, or by the exit signal
            t0 = time.perf_counter()
            stop = plan.cap[rows] == count
            cand = exits.candidates(plan, rows, p)
            arla_rows = arla_states = None
            if bool(cand.any()):
                j = torch.nonzero(cand).squeeze(1)
                acc = None
                if stash is not None and stash.gate == count:
                    acc = stash.states_for(rows[j])
                act = ActiveRows(rows, row_starts, tok, pos, h, res)
                passed = exits.decide(step, act, count, j, prev, acc)
                stop[j] |= passed
                if acc is not None and bool(passed.any()):
                    arla_rows, arla_states = j[passed], acc[passed.to(acc.device), -1]
            counters.decision_seconds += time.perf_counter() - t0
            if not bool(stop.any()):
                continue
            # the stopping rows emit their readout and leave the batch
            t1 = time.perf_counter()
            stopping = torch.nonzero(stop).squeeze(1)
            stop_tokens = token_index(row_starts, stopping).to(h.device)
            stream = h[stop_tokens] + res[stop_tokens]
            out[tok[stop_tokens]] = exits.readout(p, stream).to(out.dtype)
            if arla_rows is not None:
                # ARLA exits emit the accelerated state p_{E_j}, read as the final layer is
                final = parts.final_norm(arla_states.contiguous())
                out[tok[row_starts[arla_rows].to(h.device)]] = final.to(out.dtype)
                counters.arla_exits += int(arla_rows.numel())
            depth[rows[stopping]] = count
            slots = md.slot_mapping[tok[stop_tokens]]
            if self.store is not None:
                self.store.write(slots, stream)
            self.kv.exited(state, parts, stream, slots, pos[stop_tokens], count)
            keep = torch.nonzero(~stop).squeeze(1)
            if keep.numel() == 0:
                rows = keep
                counters.peel_seconds += time.perf_counter() - t1
                break
            keep_tokens = token_index(row_starts, keep).to(h.device)
            h, res, pos, tok = h[keep_tokens], res[keep_tokens], pos[keep_tokens], tok[keep_tokens]
            rows = rows[keep]
            active_md = self.attention.subset(active_md, keep.to(md.query_start_loc.device))
            swaps.install(active_md, i + 1)
            row_starts = active_md.query_start_loc.cpu().long()
            if fused:
                self._publish_positions(pos)
            counters.peels += 1
            counters.peel_seconds += time.perf_counter() - t1
        if rows.numel() > 0:
            final, _ = parts.final_norm(h, res)
            out[tok] = final
            depth[rows] = L
        if fused:
            self.fusion.alias_outputs(step_fusion, out)
        return out, depth

    def _spans_serve(self, cap: torch.Tensor, live: list[bool]) -> bool:
        """Spans compiled, every row's cap the stack's end or a span's end, and every probe
        where a row of the step may exit a span's end."""
        if not self._spans:
            return False
        ends = self._span_ends
        layers = self.profile.probe_layers
        return all(c in ends for c in cap.unique().tolist() if c < self.num_layers) and all(
            layers[p] in ends for p, on in enumerate(live) if on
        )

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
            self._shallow = self._shallow or bool((depth < self.num_layers).any())
            per_token = torch.repeat_interleave(depth, counts)[:num_tokens]
            record.write(md.slot_mapping[:num_tokens], per_token.to(md.slot_mapping.device))
        if plan.fusion is not None and plan.fusion.fused:
            EngineFusion.commit(plan.fusion, record, md.slot_mapping)
        c = self.counters
        c.steps += 1
        dec = torch.from_numpy(plan.decode)
        c.prefill_tokens += int(counts[~dec].sum())
        c.observe(depth[dec].tolist())
        self.requests.observe(plan.states, plan.samples, plan.decode, depth.tolist())
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
            "whole_stack_steps": c.whole_stack_steps,
            "quiet_steps": c.quiet_steps,
            "span_steps": c.span_steps,
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
