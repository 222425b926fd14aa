"""``vllm-adaptive bench --backend mlx``: adaptive configs on MLX against stock mlx-lm, one run.

Stock is mlx-lm itself on the same checkpoint and dtype (``mlx_lm.generate.generate_step`` for
speed and free-running output, the model's own forward for teacher forcing), measured in the
same process before the configs. Per config, at batch 1:

- decode tokens/s (time from the first token to the last, over the throughput prompts; the
  best of ``--repeats``), and time to first token;
- teacher-forced perplexity through the decode path (one token per step, mechanisms acting,
  as the vLLM bench does) and greedy agreement with stock at the same positions;
- free-running agreement: greedy generations from the throughput prompts against stock's
  (share of equal positions, and share before the first difference);
- the gear distribution (teacher-forced streams per corpus and throughput runs), the depth
  histogram, or the draft acceptance, from the engine's telemetry.

Prompts and streams come from the held-out 10% of each corpus (``vllm_adaptive/corpora.py``), as in
the vLLM bench. Nothing here imports vLLM or torch.

Over 400 lines: the MLX counterpart of ``bench/`` (workload, engines, quality, report) in one
module, because MLX runs on machines where the rest of ``bench/`` cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.env import cpu_info, versions
from vllm_adaptive.bench.labels import config_label
from vllm_adaptive.bench.metrics import (
    ForcedStream,
    free_running_agreement,
    greedy_agreement,
    perplexity,
)
from vllm_adaptive.bench.report import ppl_change_text
from vllm_adaptive.config import load_config_arg, parse_adaptive_config
from vllm_adaptive.corpora import CorpusFile, read_corpus, token_windows
from vllm_adaptive.depth.stats import DecodeDepthStats
from vllm_adaptive.flops import BYTES_PER_PARAM, DenseShape
from vllm_adaptive.metal_backend.support import check_supported


def _log(msg: str) -> None:
    print(f"[bench mlx] {msg}", file=sys.stderr, flush=True)


def build_workload(
    tokenizer: Any, corpora: list[CorpusFile], args: argparse.Namespace
) -> dict[str, Any]:
    """Throughput prompts and teacher-forced streams from disjoint halves of every corpus's
    held-out text (as ``bench/harness.build_workload``)."""
    per_prompts = math.ceil(args.prompts / len(corpora))
    per_streams = math.ceil(args.ppl_streams / len(corpora))
    stream_len = args.ppl_prefix + args.ppl_tokens
    prompts, streams = [], []
    for ci, corpus in enumerate(corpora):
        ids = list(tokenizer.encode(corpus.eval_text, add_special_tokens=False))
        half = len(ids) // 2
        for w in token_windows(ids[:half], stream_len, per_streams):
            streams.append(
                {"corpus": ci, "prefix": w[: args.ppl_prefix], "forced": w[args.ppl_prefix :]}
            )
        prompts.append(token_windows(ids[half:], args.prompt_tokens, per_prompts))
    mixed = [p for group in zip(*prompts, strict=True) for p in group][: args.prompts]
    return {"prompts": mixed, "streams": sorted(streams, key=lambda s: s["corpus"])}


# -- stock mlx-lm ------------------------------------------------------------------------------
def stock_generate(
    model: Any, prompt: list[int], max_tokens: int
) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first token, seconds from the first token to the last)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    t1 = None
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if t1 is None:
            t1 = time.perf_counter()
        out.append(int(tok))
    return out, t1 - t0, time.perf_counter() - t1


def stock_teacher_force(model: Any, prefix: list[int], forced: list[int]) -> ForcedStream:
    """mlx-lm's model, one token per step with its KV cache, positions as the engine reads."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if len(prefix) > 1:
        model(mx.array(prefix[:-1])[None], cache=cache)
    mx.eval(model(mx.array(prefix[-1:])[None], cache=cache))
    lps, greedy = [], []
    for pos in range(1, len(forced)):
        logits = model(mx.array([forced[pos - 1]])[None], cache=cache)[0, -1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits)
        best = mx.argmax(logits)
        mx.eval(logp, best)
        lps.append(float(logp[forced[pos]].item()))
        greedy.append(int(best.item()))
    return ForcedStream(lps, greedy)


# -- one engine --------------------------------------------------------------------------------
def _throughput(gen, prompts, max_tokens, repeats) -> dict[str, Any]:
    """``gen(i, prompt) -> (tokens, ttft, decode seconds)``; best of ``repeats`` per prompt."""
    outputs, ttfts, decode_s, tokens = [], [], 0.0, 0
    for i, prompt in enumerate(prompts):
        best = None
        for _ in range(repeats):
            toks, ttft, dec = gen(i, prompt)
            if best is None or dec < best[2]:
                best = (toks, ttft, dec)
        outputs.append(best[0])
        ttfts.append(best[1])
        decode_s += best[2]
        tokens += len(best[0]) - 1
    return {
        "decode_tokens_per_s": {"1": tokens / decode_s if decode_s else None},
        "ttft_s": {"1": sum(ttfts) / len(ttfts)},
        "outputs": outputs,
    }


def measure_stock(model_dir: str, dtype: str, workload: dict[str, Any], args) -> dict[str, Any]:
    from vllm_adaptive.metal_backend.loading import load_mlx, model_dtype_name

    t0 = time.perf_counter()
    model, _ = load_mlx(model_dir, dtype)
    start = time.perf_counter() - t0
    stock_generate(model, workload["prompts"][0], 4)  # warm-up
    tp = _throughput(
        lambda i, p: stock_generate(model, p, args.max_tokens),
        workload["prompts"],
        args.max_tokens,
        args.repeats,
    )
    tf = [stock_teacher_force(model, s["prefix"], s["forced"]) for s in workload["streams"]]
    return {**tp, "teacher_forced": tf, "engine_start_s": start, "dtype": model_dtype_name(model)}


def measure_engine(
    model_dir: str, config: dict[str, Any], dtype: str, workload: dict[str, Any], args
) -> dict[str, Any]:
    from vllm_adaptive.metal_backend.engine import MlxEngine
    from vllm_adaptive.overrides import RequestOverrides

    t0 = time.perf_counter()
    eng = MlxEngine(
        model_dir, config, dtype=dtype, num_speculative_tokens=args.num_speculative_tokens
    )
    start = time.perf_counter() - t0
    list(eng.generate(workload["prompts"][0], 4, overrides=RequestOverrides(request_tag="warmup")))
    repeat = {"n": 0}

    def gen(i: int, prompt: list[int]) -> tuple[list[int], float, float]:
        repeat["n"] += 1
        o = RequestOverrides(request_tag=f"tp-{i}-{repeat['n']}")
        t0 = time.perf_counter()
        t1 = None
        out = []
        for tok in eng.generate(prompt, args.max_tokens, overrides=o):
            if t1 is None:
                t1 = time.perf_counter()
            out.append(tok)
        return out, t1 - t0, time.perf_counter() - t1

    tp = _throughput(gen, workload["prompts"], args.max_tokens, args.repeats)
    tf = [
        eng.teacher_force(s["prefix"], s["forced"], RequestOverrides(request_tag=f"tf{i}"))
        for i, s in enumerate(workload["streams"])
    ]
    return {
        **tp,
        "teacher_forced": tf,
        "engine_start_s": start,
        "telemetry": eng.telemetry(),
        "records": {tag: eng.request_records(tag) for tag in eng.records},
    }


# -- summaries ---------------------------------------------------------------------------------
def _records(raw: dict[str, Any], mechanism: str, prefix: str) -> list[dict[str, Any]]:
    return [
        r
        for tag, recs in raw["records"].items()
        if tag.startswith(prefix)
        for r in recs
        if r.get("mechanism") == mechanism
    ]


def gear_summary(raw: dict[str, Any], corpora: list[CorpusFile], workload) -> dict[str, Any]:
    tel = raw["telemetry"]["precision"]
    ratios = tel["level_byte_ratios"]

    def distribution(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
        counts: dict[str, int] = {}
        for r in recs:
            for g, n in r["gear_tokens"].items():
                counts[g] = counts.get(g, 0) + n
        total = sum(counts.values())
        if not total:
            return None
        return {
            "tokens": total,
            "fractions": {g: n / total for g, n in counts.items()},
            "shifts_per_100_tokens": 100 * sum(r["shifts"] for r in recs) / total,
            "weight_bytes_ratio": sum(counts[g] / total * ratios[g] for g in counts),
        }

    by_corpus, traces = {}, {}
    for ci, c in enumerate(corpora):
        tags = [f"tf{i}" for i, s in enumerate(workload["streams"]) if s["corpus"] == ci]
        recs = [r for t in tags for r in raw["records"].get(t, []) if r["mechanism"] == "precision"]
        name = Path(c.path).name
        if recs:
            by_corpus[name] = distribution(recs)
            traces[name] = recs[0]
    return {
        "policy": tel["policy"],
        "routing": tel["routing"],
        "tiers": tel["tiers"],
        "layer_maps": tel["layer_maps"],
        "resident_bytes": tel["resident_bytes"],
        "level_byte_ratios": ratios,
        "teacher_forced_by_corpus": by_corpus,
        "throughput_runs": distribution(_records(raw, "precision", "tp-")),
        "traces": traces,
    }


def depth_summary(raw: dict[str, Any]) -> dict[str, Any]:
    tel = raw["telemetry"]["depth"]
    L = tel["num_layers"]

    def stats(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
        depths = [d for r in recs for d in r["depths"][1:]]  # decode tokens only
        if not depths:
            return None
        counted = DecodeDepthStats()
        counted.observe(depths)
        hist = counted.summary()["exit_tokens"]
        mean = counted.layers_executed / counted.decode_tokens
        return {
            "tokens": len(depths),
            "mean_depth": mean,
            "layers_fraction": mean / L,
            "exit_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        }

    engine = {k: v for k, v in tel.items() if k != "finished"}
    return {
        "budget": tel["budget"],
        "probe_layers": tel["probe_layers"],
        "num_layers": L,
        "teacher_forced": stats(_records(raw, "depth", "tf")),
        "throughput_runs": stats(_records(raw, "depth", "tp-")),
        "engine": engine,
    }


def summarize(
    stock: dict[str, Any],
    raws: list[dict[str, Any]],
    configs: list[dict[str, Any]],
    workload: dict[str, Any],
    corpora: list[CorpusFile],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    def ppl_by_corpus(tf: list[ForcedStream]) -> dict[str, float]:
        out = {}
        for ci, c in enumerate(corpora):
            sel = [s for s, w in zip(tf, workload["streams"], strict=True) if w["corpus"] == ci]
            if sel:
                out[Path(c.path).name] = perplexity(sel)
        return out

    base = {
        "decode_tokens_per_s": stock["decode_tokens_per_s"],
        "ttft_s": stock["ttft_s"],
        "ppl": perplexity(stock["teacher_forced"]),
        "ppl_by_corpus": ppl_by_corpus(stock["teacher_forced"]),
        "engine_start_s": stock["engine_start_s"],
    }
    runs = []
    for cfg, raw in zip(configs, raws, strict=True):
        ppl = perplexity(raw["teacher_forced"])
        b, r = base["decode_tokens_per_s"]["1"], raw["decode_tokens_per_s"]["1"]
        entry: dict[str, Any] = {
            "config": cfg,
            "decode_tokens_per_s": raw["decode_tokens_per_s"],
            "ttft_s": raw["ttft_s"],
            "speedup": {"1": r / b if b and r else None},
            "ppl": ppl,
            "ppl_by_corpus": ppl_by_corpus(raw["teacher_forced"]),
            "ppl_rel_change": ppl / base["ppl"] - 1.0,
            "greedy_agreement": greedy_agreement(raw["teacher_forced"], stock["teacher_forced"]),
            "free_running_agreement": free_running_agreement(raw["outputs"], stock["outputs"]),
            "identical_free_running": raw["outputs"] == stock["outputs"],
            "engine_start_s": raw["engine_start_s"],
            "mechanism": raw["telemetry"]["mechanism"],
        }
        if "precision" in raw["telemetry"]:
            entry["gears"] = gear_summary(raw, corpora, workload)
        if "depth" in raw["telemetry"]:
            entry["depth"] = depth_summary(raw)
        if "speculative" in raw["telemetry"]:
            entry["speculative"] = raw["telemetry"]["speculative"]
        runs.append(entry)
    return base, runs


# -- report ------------------------------------------------------------------------------------
def _gear_cell(run: dict[str, Any]) -> str:
    g = run.get("gears")
    if not g:
        return ""
    parts = []
    for name, dist in g["teacher_forced_by_corpus"].items():
        if dist:
            fr = dist["fractions"]
            stem = name.rsplit(".", 1)[0]
            parts.append(
                f"{stem}: " + "/".join(f"{100 * fr.get(k, 0):.0f}" for k in ("low", "mid", "high"))
            )
    return "; ".join(parts)


def _mechanism_cell(run: dict[str, Any]) -> str:
    if run.get("depth") and run["depth"]["teacher_forced"]:
        d = run["depth"]["teacher_forced"]
        return f"mean layers {d['mean_depth']:.1f} ({d['layers_fraction']:.2f})"
    if run.get("speculative"):
        s = run["speculative"]
        acc = s.get("acceptance")
        return f"k={s['k']}, accepted {100 * acc:.0f}%" if acc is not None else f"k={s['k']}"
    return ""


def table_markdown(results: dict[str, Any]) -> str:
    """One row per config (stock first)."""
    base = results["baseline"]
    head = [
        "config",
        "decode tok/s b1 (ratio)",
        "ppl (change)",
        "greedy agreement (teacher-forced)",
        "free-running agreement (positions / prefix)",
        "gears low/mid/high % (teacher-forced)",
        "depth / drafts",
    ]
    rows = [
        [
            "stock mlx-lm",
            f"{base['decode_tokens_per_s']['1']:.1f} (1.00)",
            f"{base['ppl']:.3f}",
            "1.000",
            "1.000 / 1.000",
            "",
            "",
        ]
    ]
    for run in results["runs"]:
        tps = run["decode_tokens_per_s"]["1"]
        fr = run["free_running_agreement"]
        label = config_label(run["config"]) if run["config"] else "{} (all off)"
        rows.append(
            [
                label.replace("|", "\\|"),
                f"{tps:.1f} ({run['speedup']['1']:.2f})",
                f"{run['ppl']:.3f} ({ppl_change_text(run['ppl_rel_change'])})",
                f"{run['greedy_agreement']:.3f}",
                f"{fr['positions']:.3f} / {fr['prefix']:.3f}",
                _gear_cell(run),
                _mechanism_cell(run),
            ]
        )
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# -- command -----------------------------------------------------------------------------------
def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_adaptive.metal_backend import require_mlx

    require_mlx()
    import mlx.core as mx

    from vllm_adaptive.metal_backend.loading import load_mlx

    if [b for b in args.batch_sizes if b != 1]:
        _log(f"batch sizes {args.batch_sizes}: the MLX engine runs one sequence; measuring b1")
    configs = [load_config_arg(c) for c in args.config]
    for c in configs:
        check_supported(parse_adaptive_config(c))  # fail fast, before any measurement
    corpora = [read_corpus(p) for p in args.corpus]
    dtype = args.dtype
    _, tokenizer = load_mlx(args.model, "auto")
    workload = build_workload(tokenizer, corpora, args)
    _log(
        f"{len(workload['prompts'])} prompts x {args.max_tokens} tokens, "
        f"{len(workload['streams'])} streams x {args.ppl_tokens} forced tokens, dtype {dtype}"
    )
    mx.random.seed(args.seed)
    t0 = time.perf_counter()
    stock = measure_stock(args.model, dtype, workload, args)
    _log(
        f"stock mlx-lm: {stock['decode_tokens_per_s']['1']:.2f} tok/s, "
        f"ppl {perplexity(stock['teacher_forced']):.4f} ({time.perf_counter() - t0:.0f} s)"
    )
    raws = []
    for c in configs:
        t0 = time.perf_counter()
        raw = measure_engine(args.model, c, dtype, workload, args)
        raws.append(raw)
        _log(
            f"{json.dumps(c)}: {raw['decode_tokens_per_s']['1']:.2f} tok/s, ppl "
            f"{perplexity(raw['teacher_forced']):.4f} ({time.perf_counter() - t0:.0f} s)"
        )
    baseline, runs = summarize(stock, raws, configs, workload, corpora)
    shape = DenseShape.from_hf_config(json.loads((Path(args.model) / "config.json").read_text()))
    return {
        "backend": "mlx",
        "model": str(args.model),
        "settings": {
            "batch_sizes": [1],
            "dtype": dtype,
            "model_dtype": stock["dtype"],
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "prompts": len(workload["prompts"]),
            "ppl_streams": len(workload["streams"]),
            "ppl_prefix": args.ppl_prefix,
            "ppl_tokens": args.ppl_tokens,
            "repeats": args.repeats,
            "num_speculative_tokens": args.num_speculative_tokens,
            "seed": args.seed,
            "weight_bytes_per_param": BYTES_PER_PARAM,
            "decoder_linear_params": shape.decoder_linear_params(),
        },
        "baseline": baseline,
        "runs": runs,
        "env": {
            "cpu": cpu_info(),
            "mlx_device": str(mx.default_device()),
            "metal_available": bool(mx.metal.is_available()),
            "versions": versions("mlx", "mlx-cpu", "mlx-metal", "mlx-lm", "vllm-adaptive"),
            "python": sys.version.split()[0],
            "corpora": [
                {"path": str(c.path), "sha256": c.sha256, "chars": len(c.text)} for c in corpora
            ],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    }


def run_from_args(args: argparse.Namespace) -> int:
    results = run_bench(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    _log(f"wrote {args.json}")
    table = table_markdown(results)
    sys.stdout.write(table)
    if getattr(args, "table_md", None):
        Path(args.table_md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table_md).write_text(table)
        _log(f"wrote {args.table_md}")
    if args.plot:
        from vllm_adaptive.bench.plot import plot_pareto

        plot_pareto(results, args.plot)
        _log(f"wrote {args.plot}")
    if args.gear_trace:
        from vllm_adaptive.bench.plot import plot_gear_traces

        if plot_gear_traces(results, args.gear_trace):
            _log(f"wrote {args.gear_trace}")
    return 0
