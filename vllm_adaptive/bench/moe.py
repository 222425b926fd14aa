"""`vllm-adaptive moe bench`: expert offloading in a real vLLM engine (issue 19's bench).

Not a timed test: a measurement to read. One engine at a time, in this process: first the
all-resident model (no ``adaptive.moe``: the reference for speed and for the tokens), then one
tiered engine whose fast tier (``set_moe_capacity``) and predictor (``set_moe_predictor``) are
switched between runs, so every configuration shares the slow-tier file and the process. For
each corpus, capacity (fraction of all experts' bytes), predictor (and lookahead) and batch
size it records tokens/s, stall seconds per generated token, fast-tier hit rate, prediction
recall and precision per lookahead distance, the loader's busy time and achieved read
bandwidth, and whether the greedy tokens equal the resident engine's; plus the slow tier's cold
read bandwidth measured at engine start, and the machine (CPU model, ISA flags).

Workload: prompts are token windows from the held-out last 10% of each corpus, greedy,
``ignore_eos``; batch 1 runs its prompts one after another, batch b runs b prompts at once.
Each engine first runs the whole workload once untimed (CPU kernels are set up per shape: the
first runs of an engine are slower); before each capacity's first measurement one warm-up
generation fills the fast tier (steady state, not cold start); the counters are reset before
every measurement. The slow tier's cold read bandwidth is measured on 64 records spread over
the file (dropped from the page cache first).

Repeats (``repeats``): every cell (corpus, batch, capacity, predictor; and the resident engine's
corpus, batch) is measured that many times, in rounds (round r runs every cell of a capacity
once before round r+1 starts), so a burst of load from other jobs on the machine hits different
cells rather than one cell's repeats. Tokens/s is reported per run and as median, min and max;
the counters (hits, loads, stall, ...) are summed over a cell's runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

#: ``name`` or ``name:lookahead``
from vllm_adaptive.bench.moe_report import plot_bench, table

DEFAULT_PREDICTORS = ("none", "pregate:1", "pregate:2", "m2r2:1", "m2r2:2")


def _log(msg: str) -> None:
    print(f"[moe bench] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def parse_predictor(spec: str) -> tuple[str, int]:
    name, _, d = spec.partition(":")
    return name, int(d) if d else 1


def corpus_prompts(tok, path: str, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the held-out last 10% of a corpus file."""
    from vllm_adaptive.corpora import read_corpus, token_windows

    cf = read_corpus(path)
    ids = tok(cf.eval_text, add_special_tokens=False)["input_ids"]
    return token_windows(ids, length, count)


def _run(llm, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, Any]:
    """Generate greedily, ``batch`` prompts at a time; wall time and the tokens."""
    from vllm_adaptive.engine.vllm_api import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = [TokensPrompt(prompt_token_ids=p) for p in prompts[i : i + batch]]
        outs = llm.generate(chunk, params, use_tqdm=False)
        tokens.extend(list(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - t0
    generated = sum(len(t) for t in tokens)
    from vllm_adaptive.bench.machine import load_average

    return {
        "load_average_1min": (load_average() or (None,))[0],  # other jobs on the machine
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "tokens": tokens,
    }


def _warm_up(llm, workloads: dict, batches: list[int], max_tokens: int) -> None:
    """The whole workload once, untimed."""
    for w in workloads.values():
        for b in batches:
            _run(llm, w[b], b, max_tokens)


def _engine(model: str, top_k: int, moe: dict | None, kv_cache_gib: int):
    import os

    from vllm_adaptive.engine.vllm_api import LLM

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)  # the CPU backend's KV cache size
    # apply_model sends the bench's functions (moe_stats, set_moe_*) to the engine's worker
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    args: dict[str, Any] = {
        "dtype": "bfloat16",
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": 1024,
        "enable_prefix_caching": False,  # every run prefills its prompts
        "hf_overrides": {"num_experts_per_tok": top_k},
    }
    adaptive = {"adaptive": {"moe": moe}} if moe is not None else {}
    return LLM(model=model, additional_config=adaptive, **args)


#: counters summed over a cell's repeats
SUMMED = (
    "hits",
    "misses",
    "late",
    "loads",
    "prefetches",
    "prefetch_skipped",
    "prefetch_promoted",
    "prefetch_cancelled",
    "evictions",
    "stall_seconds",
    "load_seconds",
    "bytes_read",
    "violations",
    "tokens",
    "steps",
    "forward_seconds",
)


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max of one cell's repeats (and the values)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": list(values),
    }


def combine_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's repeated runs (``_run`` results) as one: seconds and tokens summed, tokens/s
    per run with its median/min/max, ``tokens`` from the first run and whether every run
    generated the same."""
    tps = [r["tokens_per_s"] for r in runs]
    loads = [r["load_average_1min"] for r in runs if r["load_average_1min"] is not None]
    return {
        "repeats": len(runs),
        "seconds": sum(r["seconds"] for r in runs),
        "generated_tokens": sum(r["generated_tokens"] for r in runs),
        "tokens_per_s": statistics.median(tps),
        "tokens_per_s_spread": spread(tps),
        "load_average_1min": max(loads) if loads else None,  # the worst of the runs
        "tokens": runs[0]["tokens"],
        "repeats_identical": all(r["tokens"] == runs[0]["tokens"] for r in runs),
    }


def combine_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's ``moe_stats`` after each repeat (counters reset before each) as one."""
    out = dict(stats[-1])
    for key in SUMMED:
        out[key] = sum(s.get(key) or 0 for s in stats)
    demanded = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / demanded if demanded else None
    prediction: dict[str, dict[str, float]] = {}
    for s in stats:
        for d, v in (s.get("prediction") or {}).items():
            acc = prediction.setdefault(d, {"predicted": 0, "needed": 0, "correct": 0})
            for key in acc:
                acc[key] += v[key]
    for v in prediction.values():
        v["recall"] = v["correct"] / v["needed"] if v["needed"] else 0.0
        v["precision"] = v["correct"] / v["predicted"] if v["predicted"] else 0.0
    out["prediction"] = prediction
    return out


def _summary(stats: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    gen = run["generated_tokens"]
    keep = ("loader_cpus", "slots", *SUMMED, "hit_rate")
    out = {k: stats.get(k) for k in keep}
    out["stall_seconds_per_generated_token"] = stats["stall_seconds"] / gen if gen else None
    out["loader_busy_fraction"] = stats["load_seconds"] / run["seconds"] if run["seconds"] else None
    out["loader_read_bytes_per_s"] = (
        stats["bytes_read"] / stats["load_seconds"] if stats.get("load_seconds") else None
    )
    out["prediction"] = stats["prediction"]
    return out


def run_bench(
    model: str,
    corpora: list[str],
    *,
    top_k: int,
    capacities: list[float],
    batches: list[int],
    predictors: list[str],
    m2r2_adapters: str | None,
    prompts_per_batch1: int,
    prompt_tokens: int,
    max_tokens: int,
    slow_tier_dir: str | None,
    kv_cache_gib: int = 1,
    eviction: str = "cyclic",
    repeats: int = 1,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from vllm_adaptive.bench.machine import env_info
    from vllm_adaptive.corpora import read_corpus
    from vllm_adaptive.models.moefied_llama import (
        measure_moe_slow_tier,
        moe_stats,
        reset_moe_stats,
        set_moe_capacity,
        set_moe_predictor,
    )

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    t_start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model)
    n_prompts = {b: (prompts_per_batch1 if b == 1 else b) for b in batches}
    workloads = {}
    for path in corpora:
        name = Path(path).stem
        pool = corpus_prompts(tok, path, max(n_prompts.values()) + 1, prompt_tokens)
        # batch 1 and batch b use different prompts; one more for the warm-up
        workloads[name] = {b: pool[: n_prompts[b]] for b in batches} | {"warmup": pool[-1:]}
    result: dict[str, Any] = {
        "what": "vllm-adaptive moe bench (issue 19): expert offloading in a real vLLM engine",
        "model": model,
        "model_label": "smollm2-135m-moefied: upcycled from dense SmolLM2-135M by this project, "
        f"no expert training; run at top-k {top_k} (docs/moe.md gives its quality cost)",
        "top_k": top_k,
        "eviction": eviction,
        "repeats": repeats,
        "workload": {
            "corpora": corpora,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "prompts": {str(b): n_prompts[b] for b in batches},
            "greedy": True,
            "prefix_caching": False,
        },
        "env": env_info([read_corpus(p) for p in corpora]),
        "resident": {},
        "tiered": [],
    }

    _log(f"resident engine (top-k {top_k})")
    llm = _engine(model, top_k, None, kv_cache_gib)
    try:
        _warm_up(llm, workloads, batches, max_tokens)
        resident_runs: dict[str, list] = {}
        for _ in range(repeats):
            for corpus, w in workloads.items():
                for b in batches:
                    r = _run(llm, w[b], b, max_tokens)
                    resident_runs.setdefault(f"{corpus}/b{b}", []).append(r)
                    _log(f"resident {corpus} b{b}: {r['tokens_per_s']:.2f} tok/s")
        for key, runs in resident_runs.items():
            result["resident"][key] = combine_runs(runs)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm

    moe = {"capacity": 1.0, "predictor": "none"}
    if slow_tier_dir:
        moe["slow_tier_dir"] = slow_tier_dir
    _log("tiered engine")
    llm = _engine(model, top_k, moe, kv_cache_gib)
    try:
        (s0,) = llm.apply_model(moe_stats)
        (bw,) = llm.apply_model(partial(measure_moe_slow_tier, records=64))
        result["slow_tier"] = {
            "cold_read_bytes_per_s": bw["bytes_per_s"],
            "cold_read": bw,
            "startup_probe_bytes_per_s": s0["slow_tier_cold_read_bytes_per_s"],
            "record_bytes": s0["record_bytes"],
            "experts": s0["experts"],
            "note": "64 records spread over the file, each dropped from the page cache, then "
            "read one after another; the start-up probe reads 8",
        }
        _log(f"slow tier cold read: {bw['bytes_per_s'] / 1e6:.0f} MB/s ({bw['records']} records)")
        _warm_up(llm, workloads, batches, max_tokens)
        total_runs = len(capacities) * len(predictors) * len(batches) * len(workloads) * repeats
        done = 0
        for capacity in capacities:
            (slots,) = llm.apply_model(
                partial(set_moe_capacity, capacity=capacity, eviction=eviction)
            )
            warm = True
            cells: dict[tuple, dict[str, list]] = {}
            for _ in range(repeats):
                for spec in predictors:
                    name, lookahead = parse_predictor(spec)
                    llm.apply_model(
                        partial(
                            set_moe_predictor,
                            name=name,
                            lookahead=lookahead,
                            m2r2_adapters=m2r2_adapters if name == "m2r2" else None,
                        )
                    )
                    if warm:  # fill the fast tier once per capacity
                        _run(llm, workloads[next(iter(workloads))]["warmup"], 1, max_tokens)
                        warm = False
                    for corpus, w in workloads.items():
                        for b in batches:
                            llm.apply_model(reset_moe_stats)
                            r = _run(llm, w[b], b, max_tokens)
                            (stats,) = llm.apply_model(moe_stats)
                            cell = cells.setdefault((spec, corpus, b), {"runs": [], "stats": []})
                            cell["runs"].append(r)
                            cell["stats"].append(stats)
                            done += 1
                            _log(
                                f"[{done}/{total_runs}] {corpus} cap {capacity:.0%} {spec} b{b}: "
                                f"{r['tokens_per_s']:.2f} tok/s, hit {stats['hit_rate'] or 0:.2f}"
                            )
            for (spec, corpus, b), cell in cells.items():
                name, lookahead = parse_predictor(spec)
                r = combine_runs(cell["runs"])
                stats = combine_stats(cell["stats"])
                ref = result["resident"][f"{corpus}/b{b}"]
                row = {
                    "corpus": corpus,
                    "capacity": capacity,
                    "slots": slots,
                    "eviction": eviction,
                    "predictor": name,
                    "lookahead": lookahead if name != "none" else 0,
                    "batch": b,
                    "repeats": r["repeats"],
                    "tokens_per_s": r["tokens_per_s"],  # median of the repeats
                    "tokens_per_s_spread": r["tokens_per_s_spread"],
                    "speed_vs_resident": r["tokens_per_s"] / ref["tokens_per_s"],
                    "seconds": r["seconds"],
                    "load_average_1min": r["load_average_1min"],
                    "generated_tokens": r["generated_tokens"],
                    "tokens_identical_to_resident": r["repeats_identical"]
                    and r["tokens"] == ref["tokens"],
                    **_summary(stats, r),
                }
                result["tiered"].append(row)
                pred = row["prediction"]
                rp = " ".join(
                    f"d{d} {v['recall']:.2f}/{v['precision']:.2f}" for d, v in pred.items()
                )
                sp = row["tokens_per_s_spread"]
                _log(
                    f"{corpus} cap {capacity:.0%} {spec} b{b}: {sp['median']:.2f} tok/s "
                    f"[{sp['min']:.2f}, {sp['max']:.2f}] ({row['speed_vs_resident']:.2f}x "
                    f"resident), stall {row['stall_seconds_per_generated_token']:.3f} s/tok, "
                    f"hit {row['hit_rate'] or 0:.2f}, loader busy "
                    f"{row['loader_busy_fraction']:.2f}, identical "
                    f"{row['tokens_identical_to_resident']} {rp}"
                )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    for r in result["resident"].values():
        r.pop("tokens")
    result["seconds"] = time.perf_counter() - t_start
    return result


def add_moe_bench_arguments(moe_sub) -> None:
    """``vllm-adaptive moe bench`` under the ``moe`` subcommands (``moe_sub``)."""
    bench = moe_sub.add_parser(
        "bench",
        help="expert offloading in a real vLLM engine: tokens/s, stall, hit rate, prediction "
        "recall/precision per fast-tier capacity, predictor and batch, against all-resident",
    )
    bench.add_argument("--model", nargs=1, default=["smollm2-135m-moefied"])
    bench.add_argument(
        "--top-k", type=int, default=8, help="routing k (hf_overrides num_experts_per_tok)"
    )
    bench.add_argument("--corpus", nargs="+", required=True, help="prompts from their last 10%%")
    bench.add_argument("--capacities", default="0.25,0.5,1.0")
    bench.add_argument("--batches", default="1,8")
    bench.add_argument(
        "--predictors",
        default="none,pregate:1,pregate:2,m2r2:1,m2r2:2",
        help="comma-separated NAME[:LOOKAHEAD]",
    )
    bench.add_argument("--m2r2-adapters", default=None, help="dir from `moe train-m2r2`")
    bench.add_argument("--prompts-b1", type=int, default=2, help="prompts run one by one at b1")
    bench.add_argument("--prompt-tokens", type=int, default=64)
    bench.add_argument("--max-tokens", type=int, default=24)
    bench.add_argument("--slow-tier-dir", default=None, help="default: a temporary directory")
    bench.add_argument("--kv-cache-gib", type=int, default=1)
    bench.add_argument("--eviction", choices=("cyclic", "lru"), default="cyclic")
    bench.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measure every cell this many times (in rounds); tokens/s median, min and max",
    )
    bench.add_argument("--out", required=True, help="JSON file")
    bench.add_argument("--plot", default=None, help="PNG file")
    bench.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:

    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    predictors = [p for p in args.predictors.split(",") if p]
    if any(p.startswith("m2r2") for p in predictors) and not args.m2r2_adapters:
        raise SystemExit("--predictors has m2r2: give --m2r2-adapters DIR (`moe train-m2r2`)")
    result = run_bench(
        str(_checkpoint(args.model[0])),
        list(args.corpus),
        top_k=args.top_k,
        capacities=[float(c) for c in args.capacities.split(",")],
        batches=[int(b) for b in args.batches.split(",")],
        predictors=predictors,
        m2r2_adapters=args.m2r2_adapters,
        prompts_per_batch1=args.prompts_b1,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        slow_tier_dir=args.slow_tier_dir,
        kv_cache_gib=args.kv_cache_gib,
        eviction=args.eviction,
        repeats=args.repeats,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot_bench(result, args.plot)
    sys.stdout.write(table(result))
    return 0


def _checkpoint(name_or_dir: str) -> Path:
    """A checkpoint directory (the CLI turns model names into prepared directories first)."""
    p = Path(name_or_dir)
    if not p.is_dir():
        raise SystemExit(f"{name_or_dir}: not a checkpoint directory")
    return p
