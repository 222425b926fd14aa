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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.bandwidth import (
    checkpoint_weight_bytes,
    stream_bandwidth,
)
from vllm_adaptive.bench.labels import config_label
from vllm_adaptive.bench.machine import env_info, load_average, mem_available_bytes
from vllm_adaptive.bench.schedule import abba_order
from vllm_adaptive.bench.summary import (
    bandwidth_entry,
    bench_log,
    merge_rounds,
    peer_label,
    summarize_all,
    summarize_peers,
)
from vllm_adaptive.config import additional_config_for, load_config_arg
from vllm_adaptive.corpora import CorpusFile, read_corpus, token_windows
from vllm_adaptive.flops import DenseShape


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
        bench_log(
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
            bench_log(f"starting engine {i + 1}/{n}: {d.name}")
            procs.append(EngineProcess(d.name, spec, d.env))
            records[i][0].update(engine_start_s=procs[i].engine_start_s, pids=procs[i].pids)
            footprint = procs[i].footprint_bytes()
            bench_log(f"  {footprint / 2**30:.2f} GiB (Pss of its processes)")
            _check_memory(i + 1, n, footprint)
        for i, p in enumerate(procs):
            bench_log(f"{defs[i].name}: teacher forcing and free-running outputs")
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
                    bench_log(_describe(defs[i].name, r, args.rounds, b, m) + _eta(t0, done, total))
            bench_log(f"round {r + 1}/{args.rounds} ratios against stock:")
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
            bench_log(
                f"engine {step}/{n * args.rounds} (round {r + 1}/{args.rounds}): {defs[i].name}"
            )
            rec = records[i][r]
            with EngineProcess(defs[i].name, spec_for(i, r), defs[i].env) as p:
                rec.update(engine_start_s=p.engine_start_s, pids=p.pids)
                if r == 0:
                    rec.update(p.ask("quality"))
                p.ask("warmup")
                for b in args.batch_sizes:
                    m = p.ask("measure", batch=b)
                    _store(rec, b, m)
                    bench_log(_describe(defs[i].name, r, args.rounds, b, m))
                fin = p.ask("finish")
                rec.update(fin if r == 0 else {"memory": fin.get("memory")})
            bench_log(_eta(t0, step, n * args.rounds).strip())
        bench_log(f"round {r + 1}/{args.rounds} ratios against stock:")
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
        bench_log("measuring single-thread stream bandwidth")
        stream = stream_bandwidth(args.stream_mib or None)
        bench_log(
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
        bench_log(
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
    bench_log(f"wrote {args.json}")
    if args.plot:
        from vllm_adaptive.bench.plot import plot_pareto

        plot_pareto(results, args.plot)
        bench_log(f"wrote {args.plot}")
    if getattr(args, "ratio_plot", None):
        from vllm_adaptive.bench.plot import plot_ratios

        plot_ratios(results, args.ratio_plot)
        bench_log(f"wrote {args.ratio_plot}")
    if getattr(args, "table_md", None):
        from vllm_adaptive.bench.report import depth_table_markdown

        Path(args.table_md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table_md).write_text(depth_table_markdown(results))
        bench_log(f"wrote {args.table_md}")
    if args.gear_trace:
        from vllm_adaptive.bench.plot import plot_gear_traces

        if plot_gear_traces(results, args.gear_trace):
            bench_log(f"wrote {args.gear_trace}")
        else:
            bench_log("no gear traces to plot (no run used adaptive.precision)")
    return 0
