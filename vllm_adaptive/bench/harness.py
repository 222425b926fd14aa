"""`vllm-adaptive bench`: adaptive configs against stock vLLM, measured in one run.

The baseline is stock vLLM on the same checkpoint with the plugin not loaded
(`VLLM_PLUGINS=""`), always measured in the same run. Each config (and each peer
checkpoint, `--peer`) runs in an engine of its own (one process each, see engine_run.py)
on the same prompts and held-out streams. By default the engines stay alive and are timed
alternately, one batch size at a time, in ABBA order over several rounds (schedule.py); the
figures are medians over rounds with their spread. See `run_bench` for the JSON layout
(per engine: `memory`, see `engine_run.collect_memory`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.bandwidth import (
    bandwidth_share,
    checkpoint_weight_bytes,
    stream_bandwidth,
)
from vllm_adaptive.bench.free_running import free_running_agreement
from vllm_adaptive.bench.labels import config_label
from vllm_adaptive.bench.machine import env_info, load_average, mem_available_bytes
from vllm_adaptive.bench.schedule import abba_order, ratios_per_round, spread
from vllm_adaptive.bench.teacher_forcing import ForcedStream, greedy_agreement, perplexity
from vllm_adaptive.config import additional_config_for, load_config_arg
from vllm_adaptive.corpora import CorpusFile, read_corpus, token_windows
from vllm_adaptive.flops import DenseShape


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_workload(args: argparse.Namespace, corpora: list[CorpusFile]) -> dict[str, Any]:
    """Prompts for the throughput runs and held-out streams for teacher forcing,
    drawn round-robin from the evaluation part of every corpus."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    n_prompts = max(args.batch_sizes)
    per_corpus_prompts = math.ceil(n_prompts / len(corpora))
    per_corpus_streams = math.ceil(args.ppl_streams / len(corpora))
    stream_len = args.ppl_prefix + args.ppl_tokens
    prompts, streams = [], []
    for ci, corpus in enumerate(corpora):
        ids = tok(corpus.eval_text, add_special_tokens=False)["input_ids"]
        # Streams and prompts come from disjoint halves of the held-out text.
        half = len(ids) // 2
        for w in token_windows(ids[:half], stream_len, per_corpus_streams):
            streams.append(
                {"corpus": ci, "prefix": w[: args.ppl_prefix], "forced": w[args.ppl_prefix :]}
            )
        prompts.append(token_windows(ids[half:], args.prompt_tokens, per_corpus_prompts))
    # interleave so that every batch size mixes corpora
    mixed = [p for group in zip(*prompts, strict=True) for p in group][:n_prompts]
    streams = sorted(streams, key=lambda s: s["corpus"])
    return {"prompts": mixed, "streams": streams}


def _streams(result: dict[str, Any]) -> list[ForcedStream]:
    tf = result["teacher_forced"]
    return [ForcedStream(lp, g) for lp, g in zip(tf["logprobs"], tf["greedy"], strict=True)]


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each timing over rounds; every round's values are kept too (``*_rounds``).
    Teacher-forced and free-running results are deterministic and come from round 1, and so
    does the memory record (round 1 is the only one that runs every workload); later rounds'
    peaks are kept in ``memory.peak_mb_rounds``."""
    merged = dict(rounds[0])
    for key in ("decode_tokens_per_s", "ttft_s", "itl_s"):
        merged[key] = {b: statistics.median(r[key][b] for r in rounds) for b in rounds[0][key]}
        merged[f"{key}_rounds"] = [r[key] for r in rounds]
    cpu_rounds = [r.get("cpu_s_per_token") or {} for r in rounds]
    if any(cpu_rounds):
        merged["cpu_s_per_token"] = {
            role: {b: _median_or_none([c.get(role, {}).get(b) for c in cpu_rounds]) for b in per_b}
            for role, per_b in cpu_rounds[0].items()
        }
        merged["cpu_s_per_token_rounds"] = cpu_rounds
    if isinstance(merged.get("memory"), dict):
        merged["memory"] = {
            **merged["memory"],
            "peak_mb_rounds": [(r.get("memory") or {}).get("peak_mb") for r in rounds],
        }
    return merged


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(
    result: dict[str, Any], workload: dict[str, Any], flops_per_token: float, n_corpora: int
) -> dict[str, Any]:
    streams = _streams(result)
    by_corpus = {}
    for ci in range(n_corpora):
        sel = [s for s, w in zip(streams, workload["streams"], strict=True) if w["corpus"] == ci]
        if sel:
            by_corpus[str(ci)] = perplexity(sel)
    prefill = [ForcedStream(lp, []) for lp in result["teacher_forced"]["prefill_logprobs"]]
    cpu = result.get("cpu_s_per_token") or {}
    return {
        "decode_tokens_per_s": result["decode_tokens_per_s"],
        "ttft_s": result["ttft_s"],
        "itl_s": result["itl_s"],
        "decode_tokens_per_s_rounds": result["decode_tokens_per_s_rounds"],
        "worker_cpu_s_per_token": cpu.get("worker"),
        "cpu_s_per_token": cpu or None,
        "ppl": perplexity(streams),
        "ppl_by_corpus": by_corpus,
        "ppl_prefill": perplexity(prefill),
        "flops_per_token": flops_per_token,
        "engine_start_s": result["engine_start_s"],
        "memory": result.get("memory"),
        "dispatch": result.get("dispatch"),
        "linear_methods": result.get("linear_methods"),
    }


def gear_summary(
    result: dict[str, Any], workload: dict[str, Any], shape: DenseShape, corpora: list
) -> dict[str, Any] | None:
    """Gear distribution per workload (teacher-forced streams per corpus, throughput runs) and
    GEARBX's ideal bandwidth speed-up for that distribution."""
    tel = result.get("gears")
    if not tel:
        return None
    reqs = tel["requests"]
    ratios = tel["level_byte_ratios"]
    f = shape.decoder_linear_params() / shape.weight_params_read_per_token()

    def distribution(records: list[dict[str, Any]]) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in records:
            for g, n in r["gear_tokens"].items():
                counts[g] = counts.get(g, 0) + n
        total = sum(counts.values()) or 1
        frac = {g: n / total for g, n in counts.items()}
        inv_k = sum(frac[g] * ratios[g] for g in frac)
        return {
            "tokens": total,
            "fractions": frac,
            "shifts_per_100_tokens": 100 * sum(r["shifts"] for r in records) / total,
            "ideal_speedup": 1.0 / ((1.0 - f) + f * inv_k),
        }

    by_corpus = {}
    for ci, corpus in enumerate(corpora):
        recs = [
            reqs[f"tf{i}"]
            for i, w in enumerate(workload["streams"])
            if w["corpus"] == ci and f"tf{i}" in reqs
        ]
        if recs:
            by_corpus[Path(corpus.path).name] = distribution(recs)
    tp = [r for tag, r in reqs.items() if tag.startswith("tp-")]
    return {
        "policy": tel["policy"],
        "routing": tel["routing"],
        "layer_maps": tel["layer_maps"],
        "resident_bytes": tel["resident_bytes"],
        "level_byte_ratios": ratios,
        "managed_fraction": f,
        "teacher_forced_by_corpus": by_corpus,
        "throughput_runs": distribution(tp) if tp else None,
        "traces": {
            name: reqs[tag]
            for name, tag in (
                (
                    Path(c.path).name,
                    next(
                        (f"tf{i}" for i, w in enumerate(workload["streams"]) if w["corpus"] == ci),
                        None,
                    ),
                )
                for ci, c in enumerate(corpora)
            )
            if tag in reqs
        },
    }


def depth_summary(
    result: dict[str, Any], workload: dict[str, Any], shape: DenseShape, context: float
) -> dict[str, Any] | None:
    """Executed depth of the teacher-forced and throughput tokens, their FLOPs per token by
    the EMAD FLOP model (layers run, attention at the context, proxies evaluated, LM head),
    and the share of forward time spent deciding (plan, proxies, bookkeeping).

    ``mean_depth`` counts backbone blocks. What a token does past its exit depends on the KV
    strategy and is added to its FLOPs: "river" runs every remaining block in the Exit River
    (int4 weights, the same FLOPs: it saves bytes, not FLOPs), "propagate" runs the K/V
    projections of the remaining blocks from the exit state; "monotone" and "mask" nothing."""
    tel = result.get("depth")
    if not tel:
        return None
    eng, reqs = tel["engine"], tel["requests"]
    L = eng["num_layers"]
    per_layer = shape.layer_linear_flops() + shape.layer_attention_flops(context)
    proxy = 2.0 * (shape.hidden + shape.vocab) * eng["proxy_rank"]
    probes_per_token = eng["probe_evals"] / eng["decode_tokens"] if eng["decode_tokens"] else 0.0
    strategy = eng.get("kv_strategy", "monotone")
    kv_proj = 2.0 * shape.hidden * 2 * shape.num_kv_heads * shape.head_dim
    after_exit = {"river": per_layer, "propagate": kv_proj}.get(strategy, 0.0)

    def stats(records: list[dict[str, Any]]) -> dict[str, Any] | None:
        depths = [d for r in records for d in r["depths"][1:]]  # decode tokens only
        if not depths:
            return None
        hist: dict[str, int] = {}
        for d in depths:
            hist[str(d)] = hist.get(str(d), 0) + 1
        mean = sum(depths) / len(depths)
        flops = (
            mean * per_layer
            + (L - mean) * after_exit
            + probes_per_token * proxy
            + shape.lm_head_flops()
        )
        return {
            "tokens": len(depths),
            "mean_depth": mean,
            "layers_fraction": mean / L,
            "flops_per_token": flops,
            "exit_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        }

    tf = [reqs[f"tf{i}"] for i in range(len(workload["streams"])) if f"tf{i}" in reqs]
    tp = [r for tag, r in reqs.items() if tag.startswith("tp-")]
    decode = eng["decode_tokens"]
    return {
        "budget": eng["budget"],
        "budget_kind": eng["budget_kind"],
        "probe_layers": eng["probe_layers"],
        "num_layers": L,
        "kv_strategy": eng.get("kv_strategy", "monotone"),
        "signal": eng.get("signal", ["emad"]),
        # per decode token of the whole engine (throughput and teacher-forced runs together)
        "river_layers_per_decode_token": (
            eng.get("river_token_layers", 0) / decode if decode else None
        ),
        "propagated_kv_per_decode_token": eng.get("propagated_kv", 0) / decode if decode else None,
        "masked_steps": eng.get("masked_steps", 0),
        "teacher_forced": stats(tf),
        "throughput_runs": stats(tp),
        "probe_evals_per_decode_token": probes_per_token,
        "proxy_flops_per_eval": proxy,
        "decision_share_of_forward": (
            eng["decision_seconds"] / eng["forward_seconds"] if eng["forward_seconds"] else None
        ),
        "peel_share_of_forward": (
            eng["peel_seconds"] / eng["forward_seconds"] if eng["forward_seconds"] else None
        ),
        "engine": eng,
        "fusion_events": tel.get("fusion_events"),
    }


def _per_round_ratio(
    run_rounds: list[dict[str, float]], base_rounds: list[dict[str, float]], b: str, inverse: bool
) -> list[float] | None:
    """Run/stock (stock/run if ``inverse``) of one batch size, round by round: the two figures
    of a round were measured closest in time. None when a round lacks a reading."""
    if len(run_rounds) != len(base_rounds):
        return None
    a = [r.get(b) for r in run_rounds]
    s = [r.get(b) for r in base_rounds]
    if any(v is None or v <= 0 for v in a + s):
        return None
    return ratios_per_round(s, a) if inverse else ratios_per_round(a, s)  # type: ignore[arg-type]


def speed_ratios(run: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Per batch size: decode tokens/s ratio (``speedup``) and worker CPU seconds per token
    ratio (``cpu_speedup``, stock's over the run's: > 1 = the run needs less CPU per token),
    each the median of the per-round ratios, with their spread and every round's value. With
    rounds that cannot be paired, the ratio of the medians."""
    out: dict[str, Any] = {"speedup": {}, "speedup_spread": {}, "speedup_rounds": {}}
    out.update(cpu_speedup={}, cpu_speedup_spread={}, cpu_speedup_rounds={})
    run_cpu = [(c or {}).get("worker", {}) for c in run.get("cpu_s_per_token_rounds") or []]
    base_cpu = [(c or {}).get("worker", {}) for c in baseline.get("cpu_s_per_token_rounds") or []]
    for b in baseline["decode_tokens_per_s"]:
        ratios = _per_round_ratio(
            run["decode_tokens_per_s_rounds"], baseline["decode_tokens_per_s_rounds"], b, False
        )
        if ratios is None:
            ratios = [run["decode_tokens_per_s"][b] / baseline["decode_tokens_per_s"][b]]
        sp = spread(ratios)
        out["speedup"][b], out["speedup_spread"][b] = sp["median"], sp
        out["speedup_rounds"][b] = ratios
        cpu = _per_round_ratio(run_cpu, base_cpu, b, True) if run_cpu and base_cpu else None
        if cpu:
            sp = spread(cpu)
            out["cpu_speedup"][b], out["cpu_speedup_spread"][b] = sp["median"], sp
            out["cpu_speedup_rounds"][b] = cpu
        else:
            out["cpu_speedup"][b] = None
    return out


def compare(
    run: dict[str, Any], baseline: dict[str, Any], run_raw: dict[str, Any], base_raw: dict[str, Any]
) -> dict[str, Any]:
    out = {
        **speed_ratios(run_raw, base_raw),
        "ppl_rel_change": run["ppl"] / baseline["ppl"] - 1.0,
        "greedy_agreement": greedy_agreement(_streams(run_raw), _streams(base_raw)),
        "flops_ratio": run["flops_per_token"] / baseline["flops_per_token"],
        "peak_memory_ratio": _memory_ratio(run, baseline, "peak_mb"),
        "param_bytes_ratio": _memory_ratio(run, baseline, "param_bytes"),
    }
    fr_run, fr_base = run_raw.get("free_running_outputs"), base_raw.get("free_running_outputs")
    if fr_run and fr_base:
        n = min(len(fr_run[0]), len(fr_base[0]))
        out["free_running"] = free_running_agreement(fr_run, fr_base, n)
    else:
        out["free_running"] = None
    return out


def _memory_ratio(run: dict[str, Any], baseline: dict[str, Any], key: str) -> float | None:
    a, b = (run.get("memory") or {}).get(key), (baseline.get("memory") or {}).get(key)
    return a / b if a is not None and b else None


def run_weight_bytes(entry: dict[str, Any], dense: dict[str, Any]) -> tuple[float, str]:
    """Weight bytes one decode step of a config reads, and where the figure comes from: the
    model's own dispatch table if it states them (``weight_bytes_per_step``), else the gear mix
    of the throughput runs (dense bytes / GEARBX's ideal speed-up for that mix), else the dense
    checkpoint (an upper bound for early-exit runs, which skip layers)."""
    stock = dense["weight_bytes_per_step"]
    table = entry.get("dispatch")
    if isinstance(table, dict) and table.get("weight_bytes_per_step"):
        return float(table["weight_bytes_per_step"]), "model dispatch table"
    tp = (entry.get("gears") or {}).get("throughput_runs")
    if tp and tp.get("ideal_speedup"):
        return stock / tp["ideal_speedup"], "gear mix of the throughput runs"
    if entry.get("depth"):
        return stock, "dense (early exit not counted: an upper bound)"
    return stock, "dense checkpoint"


def bandwidth_entry(
    entry: dict[str, Any], bytes_per_step: float, source: str, stream: dict[str, Any] | None
) -> dict[str, Any]:
    """Share of the measured stream bandwidth that reading ``bytes_per_step`` per decode step
    amounts to, per batch size, with the step time taken as the wall inter-token latency and
    as the worker's CPU seconds per step (CPU seconds per token x batch size)."""
    gbs = (stream or {}).get("best_gbs")
    worker = entry.get("worker_cpu_s_per_token") or {}
    return {
        "weight_bytes_per_step": bytes_per_step,
        "source": source,
        "reference_gbs": gbs,
        "share_wall": {
            b: bandwidth_share(bytes_per_step, itl, gbs) if gbs else None
            for b, itl in entry["itl_s"].items()
        },
        "share_worker_cpu": {
            b: bandwidth_share(bytes_per_step, worker[b] * int(b), gbs)
            if gbs and worker.get(b)
            else None
            for b in entry["itl_s"]
        },
    }


def summarize_all(
    configs: list[dict[str, Any]],
    base_raw: dict[str, Any],
    config_raws: list[dict[str, Any]],
    workload: dict[str, Any],
    shape: DenseShape,
    context: float,
    corpora: list[CorpusFile],
    dense_bytes: dict[str, Any] | None = None,
    stream: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The result's ``baseline`` and ``runs`` from the engines' merged outputs (stock first).
    With ``dense_bytes`` (`checkpoint_weight_bytes` of the model), every entry gets its
    ``bandwidth`` share of ``stream``."""
    stock_flops = shape.flops_per_token(context)
    baseline = summarize(base_raw, workload, stock_flops, len(corpora))
    if dense_bytes is not None:
        baseline["bandwidth"] = bandwidth_entry(
            baseline, dense_bytes["weight_bytes_per_step"], "dense checkpoint", stream
        )
    _log(
        f"stock: ppl {baseline['ppl']:.4f}, decode tok/s "
        + ", ".join(f"b{b}={v:.1f}" for b, v in baseline["decode_tokens_per_s"].items())
        + (
            f", peak memory {baseline['memory']['peak_mb']:.0f} MB"
            if (baseline.get("memory") or {}).get("peak_mb") is not None
            else ""
        )
    )
    runs = []
    for c, raw in zip(configs, config_raws, strict=True):
        # Later mechanisms report the depths/precisions they ran; with none, full cost.
        summary = summarize(raw, workload, stock_flops, len(corpora))
        depth = depth_summary(raw, workload, shape, context)
        if depth is not None and depth["teacher_forced"] is not None:
            summary["flops_per_token"] = depth["teacher_forced"]["flops_per_token"]
        entry = {"config": c, **summary, **compare(summary, baseline, raw, base_raw)}
        if depth is not None:
            entry["depth"] = depth
        gears = gear_summary(raw, workload, shape, corpora)
        if gears is not None:
            entry["gears"] = gears
        if dense_bytes is not None:
            entry["bandwidth"] = bandwidth_entry(
                entry, *run_weight_bytes(entry, dense_bytes), stream
            )
        label = config_label(c, depth["engine"] if depth is not None else None)
        _log(f"{label}: {_one_line(entry)}")
        runs.append(entry)
    return baseline, runs


def summarize_peers(
    peers: list[tuple[str, dict[str, Any]]],
    baseline: dict[str, Any],
    base_raw: dict[str, Any],
    workload: dict[str, Any],
    corpora: list[CorpusFile],
    stream: dict[str, Any] | None,
    dtype_bytes: int,
) -> list[dict[str, Any]]:
    """The result's ``peers``: stock vLLM on other checkpoints ((directory, merged output)),
    against stock on the bench's model, with the bytes their own checkpoint reads per step."""
    peer_entries = []
    for model, raw in peers:
        summary = summarize(raw, workload, baseline["flops_per_token"], len(corpora))
        entry = {
            "model": model,
            "label": peer_label(model),
            **summary,
            **compare(summary, baseline, raw, base_raw),
        }
        wb = checkpoint_weight_bytes(model, dtype_bytes)
        entry["bandwidth"] = bandwidth_entry(
            entry, wb["weight_bytes_per_step"], "peer checkpoint", stream
        )
        _log(f"{entry['label']}: {_one_line(entry)}")
        peer_entries.append(entry)
    return peer_entries


def peer_label(model: str) -> str:
    return f"peer: {Path(model).name} (stock vLLM)"


def _one_line(entry: dict[str, Any]) -> str:
    fr = entry.get("free_running") or {}
    peak = entry.get("peak_memory_ratio")
    sp = entry["speedup_spread"]
    return (
        f"ppl {entry['ppl']:.4f} ({entry['ppl_rel_change']:+.2%}), agreement teacher-forced "
        f"{entry['greedy_agreement']:.4f}"
        + (f", free-running {fr['agreement']:.3f}" if fr else "")
        + ", speedup "
        + ", ".join(
            f"b{b}={s:.3f} [{sp[b]['min']:.3f}-{sp[b]['max']:.3f}]"
            for b, s in entry["speedup"].items()
        )
        + (
            ", CPU ratio "
            + ", ".join(f"b{b}={v:.3f}" for b, v in entry["cpu_speedup"].items() if v is not None)
            if any(v is not None for v in entry["cpu_speedup"].values())
            else ""
        )
        + (f", peak memory x{peak:.2f}" if peak is not None else "")
    )


def engine_spec(
    args: argparse.Namespace, max_len: int, additional_config: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """What one engine process (``vllm_adaptive.bench.engine_run``) is told to measure: the
    engine settings shared by every bench, plus ``fields`` (prompts, teacher forcing, ...;
    ``model`` overrides the checkpoint, for peers)."""
    return {
        "model": str(args.model),
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
        "seed": args.seed,
        "max_model_len": max_len,
        "kv_cache_gib": args.kv_cache_gib,
        "additional_config": additional_config,
        "batch_sizes": args.batch_sizes,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        **fields,
    }


@dataclass
class EngineDef:
    """One engine of the bench: stock, an adaptive config, or stock vLLM on a peer checkpoint."""

    name: str
    model: str
    additional: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def _store(record: dict[str, Any], b: int, m: dict[str, Any]) -> None:
    """Put one ``measure`` reply for batch size ``b`` into a round record (engine_run.run's
    layout: maps batch size -> value)."""
    for key in ("decode_tokens_per_s", "ttft_s", "itl_s"):
        record.setdefault(key, {})[str(b)] = m[key]
    for role, v in (m.get("cpu_s_per_token") or {}).items():
        record.setdefault("cpu_s_per_token", {}).setdefault(role, {})[str(b)] = v


def _describe(name: str, r: int, rounds: int, b: int, m: dict[str, Any]) -> str:
    worker = (m.get("cpu_s_per_token") or {}).get("worker")
    return (
        f"round {r + 1}/{rounds} b{b} {name}: {m['decode_tokens_per_s']:.1f} tok/s, itl "
        f"{m['itl_s'] * 1e3:.1f} ms"
        + (f", worker {worker * 1e3:.2f} CPU ms/token" if worker is not None else "")
    )


def _eta(t0: float, done: int, total: int) -> str:
    if not done:
        return ""
    left = (time.perf_counter() - t0) / done * (total - done)
    return f" ({done}/{total}, about {left / 60:.1f} min left)"


def _check_memory(started: int, total: int, footprint: int, margin: int = 1 << 30) -> None:
    """Refuse to start more live engines than memory holds, estimated from the footprint (Pss
    of its processes) of the engine started last."""
    available = mem_available_bytes()
    if available is None or started >= total:
        return
    need = footprint * (total - started) + margin
    if available < need:
        raise SystemExit(
            f"bench: {total - started} more live engines need about {need / 2**30:.1f} GiB "
            f"({footprint / 2**30:.1f} GiB each), {available / 2**30:.1f} GiB available; use "
            "--engines fresh (one engine at a time) or fewer configs"
        )


def _round_log(defs: list[EngineDef], records: list[dict[str, Any]]) -> None:
    base = records[0].get("decode_tokens_per_s", {})
    for d, rec in zip(defs[1:], records[1:], strict=True):
        tps = rec.get("decode_tokens_per_s", {})
        _log(
            f"  {d.name}: " + ", ".join(f"b{b} x{tps[b] / base[b]:.3f}" for b in tps if base.get(b))
        )


def timed_rounds_persistent(
    defs: list[EngineDef], specs: list[dict[str, Any]], args: argparse.Namespace
) -> list[list[dict[str, Any]]]:
    """Every engine alive at once; per round and batch size, each engine measured once in ABBA
    order (a few seconds apart). Returns per engine its round records (round 1 also holds the
    quality results, the engine's start and its end-of-life readings)."""
    from vllm_adaptive.bench.engines import EngineProcess

    n = len(defs)
    procs: list[EngineProcess] = []
    records: list[list[dict[str, Any]]] = [[{} for _ in range(args.rounds)] for _ in defs]
    try:
        for i, (d, spec) in enumerate(zip(defs, specs, strict=True)):
            _log(f"starting engine {i + 1}/{n}: {d.name}")
            procs.append(EngineProcess(d.name, spec, d.env))
            records[i][0].update(engine_start_s=procs[i].engine_start_s, pids=procs[i].pids)
            footprint = procs[i].footprint_bytes()
            _log(f"  {footprint / 2**30:.2f} GiB (Pss of its processes)")
            _check_memory(i + 1, n, footprint)
        for i, p in enumerate(procs):
            _log(f"{defs[i].name}: teacher forcing and free-running outputs")
            records[i][0].update(p.ask("quality"))
        for p in procs:
            p.ask("warmup")
        total, done, t0 = args.rounds * len(args.batch_sizes) * n, 0, time.perf_counter()
        for r in range(args.rounds):
            for b in args.batch_sizes:
                for i in abba_order(n, r):
                    time.sleep(args.settle_s)
                    m = procs[i].ask("measure", batch=b)
                    _store(records[i][r], b, m)
                    done += 1
                    _log(_describe(defs[i].name, r, args.rounds, b, m) + _eta(t0, done, total))
            _log(f"round {r + 1}/{args.rounds} ratios against stock:")
            _round_log(defs, [rec[r] for rec in records])
        for i, p in enumerate(procs):
            records[i][0].update(p.ask("finish"))
    finally:
        for p in procs:
            p.stop()
    return records


def timed_rounds_fresh(
    defs: list[EngineDef], spec_for: Any, args: argparse.Namespace
) -> list[list[dict[str, Any]]]:
    """A fresh engine per engine and round, engines in ABBA order, each measuring every batch
    size in turn (minutes apart from the next engine). ``spec_for(i, round)``: its spec."""
    from vllm_adaptive.bench.engines import EngineProcess

    n = len(defs)
    records: list[list[dict[str, Any]]] = [[{} for _ in range(args.rounds)] for _ in defs]
    step, t0 = 0, time.perf_counter()
    for r in range(args.rounds):
        for i in abba_order(n, r):
            step += 1
            _log(f"engine {step}/{n * args.rounds} (round {r + 1}/{args.rounds}): {defs[i].name}")
            rec = records[i][r]
            with EngineProcess(defs[i].name, spec_for(i, r), defs[i].env) as p:
                rec.update(engine_start_s=p.engine_start_s, pids=p.pids)
                if r == 0:
                    rec.update(p.ask("quality"))
                p.ask("warmup")
                for b in args.batch_sizes:
                    m = p.ask("measure", batch=b)
                    _store(rec, b, m)
                    _log(_describe(defs[i].name, r, args.rounds, b, m))
                fin = p.ask("finish")
                rec.update(fin if r == 0 else {"memory": fin.get("memory")})
            _log(_eta(t0, step, n * args.rounds).strip())
        _log(f"round {r + 1}/{args.rounds} ratios against stock:")
        _round_log(defs, [rec[r] for rec in records])
    return records


def best_stream(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The faster of two stream readings per kind (both kept in ``readings``)."""
    out = dict(a)
    for key in ("copy_gbs", "triad_gbs", "read_gbs", "best_gbs"):
        out[key] = max(a[key], b[key])
    out["readings"] = [*(a.get("readings") or [dict(a)]), dict(b)]
    return out


def _rescale_bandwidth(entries: list[dict[str, Any]], stream: dict[str, Any]) -> None:
    """Recompute every entry's bandwidth shares against the final reference bandwidth."""
    for e in entries:
        bw = e.get("bandwidth")
        if bw:
            e["bandwidth"] = bandwidth_entry(e, bw["weight_bytes_per_step"], bw["source"], stream)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    configs = [load_config_arg(c) for c in args.config]  # fail fast on a bad config
    peers = [str(Path(p)) for p in getattr(args, "peer", None) or []]
    for p in peers:
        if not (Path(p) / "config.json").is_file():
            raise SystemExit(f"bench: --peer {p}: no config.json (a checkpoint directory?)")
    corpora = [read_corpus(p) for p in args.corpus]
    workload = build_workload(args, corpora)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    shape = DenseShape.from_hf_config(cfg)
    context = args.prompt_tokens + args.max_tokens / 2
    free_tokens = getattr(args, "free_tokens", 64)
    max_len = (
        max(
            args.ppl_prefix + args.ppl_tokens,
            args.prompt_tokens + max(args.max_tokens, free_tokens),
        )
        + 16
    )
    env = env_info(corpora)
    env["load_average_start"] = load_average()
    stream = None
    if getattr(args, "stream_mib", 0) != 0:
        _log("measuring single-thread stream bandwidth")
        stream = stream_bandwidth(args.stream_mib or None)
        _log(
            f"  copy {stream['copy_gbs']:.1f}, triad {stream['triad_gbs']:.1f}, read "
            f"{stream['read_gbs']:.1f} GB/s ({stream['array_mib']} MiB arrays, 1 thread)"
        )
    env["stream_bandwidth"] = stream
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    dense = checkpoint_weight_bytes(args.model, dtype_bytes)

    # Engine 0 is stock vLLM with the plugin not loaded; then the configs, then the peers.
    defs = [EngineDef("stock vLLM (plugin not loaded)", str(args.model), {}, {"VLLM_PLUGINS": ""})]
    defs += [
        EngineDef(f"adaptive {json.dumps(c)}", str(args.model), additional_config_for(c), {})
        for c in configs
    ]
    defs += [EngineDef(peer_label(p), p, {}, {"VLLM_PLUGINS": ""}) for p in peers]

    def spec_for(i: int, r: int) -> dict[str, Any]:
        return engine_spec(
            args,
            max_len,
            defs[i].additional,
            model=defs[i].model,
            teacher_forcing=r == 0,
            free_running_tokens=free_tokens if r == 0 else 0,
            prompts=workload["prompts"],
            streams=[{"prefix": s["prefix"], "forced": s["forced"]} for s in workload["streams"]],
        )

    if args.engines == "persistent":
        records = timed_rounds_persistent(defs, [spec_for(i, 0) for i in range(len(defs))], args)
    else:
        records = timed_rounds_fresh(defs, spec_for, args)
    merged = [merge_rounds(rs) for rs in records]
    base_raw = merged[0]
    config_raws = merged[1 : 1 + len(configs)]
    peer_raws = list(zip(peers, merged[1 + len(configs) :], strict=True))

    baseline, runs = summarize_all(
        configs, base_raw, config_raws, workload, shape, context, corpora, dense, stream
    )
    peer_entries = summarize_peers(
        peer_raws, baseline, base_raw, workload, corpora, stream, dtype_bytes
    )
    env["load_average_end"] = load_average()
    if stream is not None:
        # again at the end: a neighbour's burst during one reading must not set the reference
        end = stream_bandwidth(args.stream_mib or None)
        stream = best_stream(stream, end)
        env["stream_bandwidth"] = stream
        _log(
            f"stream bandwidth at the end: best {end['best_gbs']:.1f} GB/s; reference "
            f"{stream['best_gbs']:.1f} GB/s"
        )
        _rescale_bandwidth([baseline, *runs, *peer_entries], stream)
    env["dispatch"] = {
        "stock": baseline.get("dispatch"),
        **{config_label(r["config"]): r.get("dispatch") for r in runs},
        **{p["label"]: p.get("dispatch") for p in peer_entries},
    }
    return {
        "model": str(args.model),
        "settings": {
            "batch_sizes": args.batch_sizes,
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "ppl_streams": len(workload["streams"]),
            "ppl_prefix": args.ppl_prefix,
            "ppl_tokens": args.ppl_tokens,
            "free_running_tokens": free_tokens,
            "free_running_prompts": len(workload["prompts"]),
            "dtype": args.dtype,
            "enforce_eager": args.enforce_eager,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "engines": args.engines,
            "order": "ABBA (engines in order, reversed every other round)",
            "settle_s": args.settle_s,
            "kv_cache_gib": args.kv_cache_gib,
            "flops_context_len": context,
            "peers": peers,
        },
        "baseline": baseline,
        "runs": runs,
        "peers": peer_entries,
        "weight_bytes": dense,
        "env": env,
    }


def run_from_args(args: argparse.Namespace) -> int:
    results = run_bench(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    _log(f"wrote {args.json}")
    if args.plot:
        from vllm_adaptive.bench.plot import plot_pareto

        plot_pareto(results, args.plot)
        _log(f"wrote {args.plot}")
    if getattr(args, "ratio_plot", None):
        from vllm_adaptive.bench.plot import plot_ratios

        plot_ratios(results, args.ratio_plot)
        _log(f"wrote {args.ratio_plot}")
    if getattr(args, "table_md", None):
        from vllm_adaptive.bench.report import depth_table_markdown

        Path(args.table_md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table_md).write_text(depth_table_markdown(results))
        _log(f"wrote {args.table_md}")
    if args.gear_trace:
        from vllm_adaptive.bench.plot import plot_gear_traces

        if plot_gear_traces(results, args.gear_trace):
            _log(f"wrote {args.gear_trace}")
        else:
            _log("no gear traces to plot (no run used adaptive.precision)")
    return 0
