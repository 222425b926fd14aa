"""The in-process bench's summaries: medians over rounds, speed and CPU ratios against stock per
batch size, teacher-forced and free-running quality, the gear and depth distributions, memory and
bandwidth per engine (what `vllm-adaptive bench` writes into its JSON; no engine runs here)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.bandwidth import (
    bandwidth_share,
    checkpoint_weight_bytes,
)
from vllm_adaptive.bench.free_running import free_running_agreement
from vllm_adaptive.bench.labels import config_label
from vllm_adaptive.bench.mechanism_summary import depth_summary, gear_summary
from vllm_adaptive.bench.schedule import ratios_per_round, spread
from vllm_adaptive.bench.teacher_forcing import ForcedStream, greedy_agreement, perplexity
from vllm_adaptive.corpora import CorpusFile
from vllm_adaptive.flops import DenseShape


def bench_log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def forced_streams(result: dict[str, Any]) -> list[ForcedStream]:
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
    streams = forced_streams(result)
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
        "greedy_agreement": greedy_agreement(forced_streams(run_raw), forced_streams(base_raw)),
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
    bench_log(
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
        bench_log(f"{label}: {_one_line(entry)}")
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
        bench_log(f"{entry['label']}: {_one_line(entry)}")
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
