"""The MoE fast tier without an engine: (1) what the eviction victim search costs per load, (2)
the hit rate of each eviction policy on routing traces, with and without a perfect prefetcher.

Both replay traces through the real ``FastTier`` (``vllm_adaptive/moe/replay.py``: one-page
records, every load drained before the next layer, so hit rates do not depend on timing).

    # (1) victim search, synthetic trace: 30 layers x top-8 of 16, 25% capacity
    python docs/experiments/moe_eviction.py victim-bench --steps 16 --repeats 3 \
        --prefetch none,perfect:1 --out docs/data/moe-victim-search-after.json
    # (2) eviction policy: traces recorded from the MoEfied model at top-8 (transformers) on
    #     held-out windows of each corpus, plus the synthetic one
    python docs/experiments/moe_eviction.py simulate \
        --model ~/.cache/vllm-adaptive/models/smollm2-135m-moefied \
        --corpus /tmp/mlxdev/corpora/prose.txt /tmp/mlxdev/corpora/code.txt \
        --windows 4 --window 128 --prefetch none,perfect:1,perfect:2,pregate:1,pregate:2 \
        --out docs/data/moe-eviction-sim.json
    # (1) was also run with --capacity 0.5 --prefetch none (the -50.json files)

Written up in docs/moe-runtime.md ("Eviction policy").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from vllm_adaptive.moe.replay import (
    perfect_predictions,
    replay,
    synthetic_trace,
    tiny_slow_tier,
    trace_from_masks,
)
from vllm_adaptive.moe.tiers import FastTier


def run_one(slow, trace, capacity: float, eviction: str, predictions) -> dict:
    slots = max(1, round(capacity * slow.num_layers * slow.num_experts))
    fast = FastTier(slow, slots, eviction=eviction)
    try:
        return replay(fast, trace, predictions).as_dict() | {"slots": slots}
    finally:
        fast.loader.shutdown()


def predictions_for(spec: str, trace, recorded=None, batch: int = 1):
    """``none``, ``perfect:D`` or ``pregate:D`` (recorded traces only) for ``trace``."""
    name, _, d = spec.partition(":")
    d = int(d or 1)
    if name == "none":
        return None
    if name == "perfect":
        return perfect_predictions(trace, d)
    if name == "pregate":
        if recorded is None:
            return "n/a"
        masks, inputs, routers = recorded
        layers, n, _ = masks.shape
        k = int(masks[0, 0].sum())
        per = n // batch
        # layer j's router on layer l's MLP input, each token's top-k (Pre-gated MoE)
        pre = {
            (la, j): torch.zeros(n, masks.shape[2], dtype=torch.bool).scatter_(
                1, (inputs[la] @ routers[j].T).topk(k, dim=-1).indices, True
            )
            for la in range(layers)
            for j in range(la + 1, min(layers, la + d + 1))
        }
        out = []
        for t in range(per):
            rows = [s * per + t for s in range(batch)]
            out.append(
                [
                    {
                        j: pre[la, j][rows].any(0).nonzero().flatten().tolist()
                        for j in range(la + 1, min(layers, la + d + 1))
                    }
                    for la in range(layers)
                ]
            )
        return out
    raise ValueError(f"unknown prefetch {spec!r}")


def victim_bench(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        slow = tiny_slow_tier(Path(d) / "x.bin", args.layers, args.experts)
        try:
            for batch in args.batches:
                trace = synthetic_trace(args.steps, args.layers, args.experts, args.top_k, batch)
                for eviction in args.evictions:
                    for prefetch in args.prefetch:
                        preds = predictions_for(prefetch, trace)
                        reps = [
                            run_one(slow, trace, args.capacity, eviction, preds)
                            for _ in range(args.repeats)
                        ]
                        us = [1e6 * r["victim_seconds"] / max(1, r["victim_calls"]) for r in reps]
                        row = {
                            "batch": batch,
                            "eviction": eviction,
                            "prefetch": prefetch,
                            "slots": reps[0]["slots"],
                            "victim_calls": reps[0]["victim_calls"],
                            "loads": reps[0]["loads"],
                            "victim_us_per_search_median": statistics.median(us),
                            "victim_us_per_search_min": min(us),
                            "victim_us_per_search_max": max(us),
                            "replay_seconds_median": statistics.median(r["seconds"] for r in reps),
                            "replay_us_per_load_median": 1e6
                            * statistics.median(r["seconds"] for r in reps)
                            / max(1, reps[0]["loads"]),
                            "hit_rate": reps[0]["hit_rate"],
                        }
                        rows.append(row)
                        print(
                            f"b{batch} {eviction:6s} prefetch {prefetch:4s} slots {row['slots']}"
                            f": {row['victim_calls']} searches, "
                            f"{row['victim_us_per_search_median']:.1f} us/search (min "
                            f"{row['victim_us_per_search_min']:.1f}, max "
                            f"{row['victim_us_per_search_max']:.1f}), replay "
                            f"{row['replay_us_per_load_median']:.0f} us/load, hit rate "
                            f"{row['hit_rate']:.3f}",
                            flush=True,
                        )
        finally:
            slow.close()
    return {
        "what": "victim search cost per load, synthetic trace",
        "args": vars(args),
        "rows": rows,
    }


def record(model_dir: str, corpus: str, top_k: int, windows: int, length: int):
    """The MoEfied model at ``top_k`` on held-out windows: routing masks [L, N, E] (bool), MLP
    inputs [L, N, H] and routers [L, E, H]."""
    from transformers import AutoTokenizer

    from vllm_adaptive.corpora import prompt_bos, read_corpus, token_windows
    from vllm_adaptive.moe.collect import collect_mlp_inputs
    from vllm_adaptive.moe.reference import load_moefied, moefied_mlps

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(read_corpus(corpus).eval_text, add_special_tokens=False)["input_ids"]
    wins = token_windows(ids, length, windows)
    model = load_moefied(model_dir, top_k=top_k)
    inputs = collect_mlp_inputs(model, wins, prompt_bos(tok), progress=False)
    masks = []
    for mlp, x in zip(moefied_mlps(model), inputs, strict=True):
        with torch.no_grad():
            idx = mlp.router(x).topk(top_k, dim=-1).indices
        mask = torch.zeros(x.shape[0], mlp.num_experts, dtype=torch.bool).scatter_(1, idx, True)
        masks.append(mask)
    routers = torch.stack([m.router.weight.detach().float() for m in moefied_mlps(model)])
    return torch.stack(masks), torch.stack(inputs), routers


def _score(trace, preds) -> dict:
    """Recall and precision of the predictions against the trace (all distances)."""
    if preds is None:
        return {}
    correct = predicted = needed = 0
    for step, pstep in zip(trace, preds, strict=True):
        for per_layer in pstep:
            for j, experts in per_layer.items():
                correct += len(set(experts) & set(step[j]))
                predicted += len(experts)
                needed += len(step[j])
    return {"recall": correct / max(1, needed), "precision": correct / max(1, predicted)}


def simulate(args) -> dict:
    traces: dict[str, tuple | None] = {}
    for corpus in args.corpus or []:
        t0 = time.perf_counter()
        traces[Path(corpus).stem] = record(
            args.model, corpus, args.top_k, args.windows, args.window
        )
        print(f"recorded {corpus}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    traces["synthetic"] = None
    rows = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        slow = tiny_slow_tier(Path(d) / "x.bin", args.layers, args.experts, io=False)
        try:
            for name, recorded in traces.items():
                for batch in args.batches:
                    if recorded is None:
                        trace = synthetic_trace(
                            args.windows * args.window // batch,
                            args.layers,
                            args.experts,
                            args.top_k,
                            batch,
                        )
                    else:
                        trace = trace_from_masks(recorded[0], batch)
                    for prefetch in args.prefetch:
                        preds = predictions_for(prefetch, trace, recorded, batch)
                        if preds == "n/a":
                            continue
                        scored = _score(trace, preds)
                        for capacity in args.capacities:
                            for eviction in args.evictions:
                                r = run_one(slow, trace, capacity, eviction, preds)
                                row = {
                                    "trace": name,
                                    "batch": batch,
                                    "steps": len(trace),
                                    "experts_per_step": sum(map(len, sum(trace, []))) / len(trace),
                                    "capacity": capacity,
                                    "prefetch": prefetch,
                                    "eviction": eviction,
                                    **scored,
                                    **r,
                                }
                                rows.append(row)
                                print(
                                    f"{name:9s} b{batch} cap {capacity:.0%} prefetch "
                                    f"{prefetch:4s} {eviction:6s}: hit rate {r['hit_rate']:.3f}, "
                                    f"loads/step {r['loads'] / len(trace):.1f}",
                                    flush=True,
                                )
        finally:
            slow.close()
    return {
        "what": "fast-tier hit rate per eviction policy on routing traces (engine-free replay)",
        "model": args.model,
        "top_k": args.top_k,
        "trace_tokens_per_corpus": args.windows * args.window,
        "note": "recorded: the MoEfied model's router top-k on held-out windows (teacher-forced "
        "text, transformers, float32); synthetic: uniform random top-k per token and layer. "
        "Batch b: b streams of the same trace decoded together (union per layer). Every load "
        "drained before the next layer: prefetches always arrive in time. prefetch "
        "'perfect:D': exactly the experts of layers l+1..l+D; 'pregate:D': layer j's router on "
        "layer l's recorded MLP input (recorded traces only).",
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("victim-bench", "simulate"):
        s = sub.add_parser(name)
        s.add_argument("--layers", type=int, default=30)
        s.add_argument("--experts", type=int, default=16)
        s.add_argument("--top-k", type=int, default=8)
        s.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 8])
        s.add_argument("--evictions", type=lambda v: v.split(","), default=["lru", "cyclic"])
        s.add_argument(
            "--prefetch",
            type=lambda v: v.split(","),
            default=["none", "perfect:1", "pregate:1", "pregate:2"],
            help="none, perfect:D, pregate:D (recorded traces only)",
        )
        s.add_argument("--out", default=None, help="JSON file")
    vb = sub.choices["victim-bench"]
    vb.add_argument("--capacity", type=float, default=0.25)
    vb.add_argument("--steps", type=int, default=32)
    vb.add_argument("--repeats", type=int, default=3)
    sim = sub.choices["simulate"]
    sim.add_argument("--model", default=None)
    sim.add_argument("--corpus", nargs="*", default=[])
    sim.add_argument("--windows", type=int, default=4, help="held-out windows per corpus")
    sim.add_argument("--window", type=int, default=128, help="tokens per window")
    sim.add_argument(
        "--capacities", type=lambda v: [float(c) for c in v.split(",")], default=[0.25, 0.5]
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.cmd == "simulate" and args.corpus and not args.model:
        p.error("--corpus needs --model (the MoEfied checkpoint that routes)")
    result = victim_bench(args) if args.cmd == "victim-bench" else simulate(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
