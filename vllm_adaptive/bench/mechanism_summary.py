"""What the mechanisms did during an in-process bench run: the gear distribution per workload
(precision) and the executed depth with its FLOPs and the oracle's bound (depth)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_adaptive.depth.stats import DecodeDepthStats
from vllm_adaptive.flops import DenseShape


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
        counted = DecodeDepthStats()
        counted.observe(depths)
        hist = counted.summary()["exit_tokens"]
        mean = counted.layers_executed / counted.decode_tokens
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
