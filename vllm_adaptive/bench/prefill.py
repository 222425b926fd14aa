"""`vllm-adaptive bench --prefill-lens 512,2048,8000`: the prefill bench (token fusion, issue 20).

The main bench once per prompt length, with the throughput prompts and the teacher-forced
prefixes both that long (``--prompt-tokens`` = ``--ppl-prefix`` = the length), so that one run
gives, per length and against stock vLLM in the same run: time to first token and prefill
tokens/s (the batch's prompt tokens over its TTFT), the perplexity of the continuation after the
(fused) prefill, free-running greedy agreement, and, for configs with ``adaptive.depth.fusion``,
the fraction of the prompts' token-layers fusion removed (the engine's own count). The fusion
events of one throughput prompt of the longest length are plotted with ``--fusion-plot``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.labels import config_label


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _prefill_rates(entry: dict[str, Any], length: int) -> dict[str, float]:
    return {b: int(b) * length / t for b, t in entry["ttft_s"].items() if t}


def _fusion(entry: dict[str, Any]) -> dict[str, Any] | None:
    return ((entry.get("depth") or {}).get("engine") or {}).get("fusion")


def summarize_length(results: dict[str, Any], length: int) -> dict[str, Any]:
    """The prefill figures of one length's main-bench results."""
    base = results["baseline"]
    stock_rates = _prefill_rates(base, length)
    rows = []
    for run in results["runs"]:
        rates = _prefill_rates(run, length)
        fusion = _fusion(run)
        rows.append(
            {
                "config": run["config"],
                "ttft_s": run["ttft_s"],
                "prefill_tokens_per_s": rates,
                "ttft_speedup": {
                    b: base["ttft_s"][b] / t for b, t in run["ttft_s"].items() if t
                },  # stock TTFT / run TTFT: > 1 = faster first token
                "ppl": run["ppl"],
                "ppl_rel_change": run["ppl_rel_change"],
                "greedy_agreement_teacher_forced": run["greedy_agreement"],
                "decode_speedup": run.get("speedup"),  # decode tokens/s against stock
                "free_running": run.get("free_running"),
                "removed_token_layers_fraction": (
                    fusion["removed_fraction"] if fusion is not None else None
                ),
                "fusion": fusion,
            }
        )
    return {
        "prompt_tokens": length,
        "stock": {
            "ttft_s": base["ttft_s"],
            "prefill_tokens_per_s": stock_rates,
            "ppl": base["ppl"],
        },
        "runs": rows,
    }


def table_markdown(out: dict[str, Any]) -> str:
    lines = [
        "| prompt tokens | config | batch | TTFT s (stock) | TTFT s | TTFT speed-up | prefill "
        "tok/s (stock) | prefill tok/s | decode speed-up | token-layers removed | ppl change | "
        "teacher-forced agreement | free-running agreement |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for length, s in out["lengths"].items():
        for r in s["runs"]:
            label = config_label(r["config"])
            fr = r.get("free_running") or {}
            removed = r["removed_token_layers_fraction"]
            decode = r.get("decode_speedup") or {}
            for b, t in r["ttft_s"].items():
                lines.append(
                    f"| {length} | {label} | {b} | {s['stock']['ttft_s'][b]:.3f} | {t:.3f} | "
                    f"x{r['ttft_speedup'][b]:.3f} | {s['stock']['prefill_tokens_per_s'][b]:.0f} | "
                    f"{r['prefill_tokens_per_s'][b]:.0f} | "
                    + (f"x{decode[b]:.3f}" if b in decode else "-")
                    + " | "
                    + (f"{removed:.2%}" if removed is not None else "-")
                    + f" | {r['ppl_rel_change']:+.2%} | "
                    + f"{r['greedy_agreement_teacher_forced']:.3f} | "
                    + (
                        f"{fr['agreement']:.3f} "
                        f"({fr.get('prompts', '?')} x {fr.get('tokens', '?')})"
                        if fr.get("agreement") is not None
                        else "-"
                    )
                    + " |"
                )
    return "\n".join(lines) + "\n"


def plot_fusion_events(events: list[dict[str, Any]], prompt_len: int, num_layers: int,
                       path: str, title: str) -> None:  # fmt: skip
    """Each fusion group of one prompt as a bar over the positions it merged, at its layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4))
    for e in events:
        ax.plot([e["first"], e["last"]], [e["layer"], e["layer"]], lw=3, color="tab:red")
        ax.plot([e["last"]], [e["layer"]], marker="o", ms=3, color="tab:purple")
    ax.set_xlim(0, prompt_len)
    ax.set_ylim(0, num_layers)
    ax.set_xlabel("prompt position")
    ax.set_ylabel("layer (blocks run before fusing)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot(out: dict[str, Any], raw: dict[str, Any], args: argparse.Namespace) -> bool:
    length = max(out["lengths"], key=int)
    for run in raw[length]["runs"]:
        depth = run.get("depth") or {}
        events = depth.get("fusion_events")
        if not events:
            continue
        tag = next((e["tag"] for e in events if e["tag"].startswith("tp-b1-")), events[0]["tag"])
        # the timed runs repeat a prompt under one tag: each group once
        seen = {(e["layer"], e["first"], e["last"]): e for e in events if e["tag"] == tag}
        mine = list(seen.values())
        fusion = depth["engine"]["fusion"]
        plot_fusion_events(
            mine,
            int(length),
            depth["num_layers"],
            args.fusion_plot,
            f"fusion events of one {length}-token prompt ({tag}): {len(mine)} groups; over the "
            f"engine's life {fusion['removed_fraction']:.1%} of fused rows' token-layers removed",
        )
        return True
    return False


def run_prefill_bench(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_adaptive.bench.harness import run_bench

    out: dict[str, Any] = {"mode": "prefill", "model": str(args.model), "lengths": {}}
    raw: dict[str, Any] = {}
    for length in args.prefill_lens:
        sub = copy.copy(args)
        sub.prompt_tokens = length
        sub.ppl_prefix = length
        _log(f"prefill bench: prompts of {length} tokens")
        res = run_bench(sub)
        raw[str(length)] = res
        out["lengths"][str(length)] = summarize_length(res, length)
        for r in out["lengths"][str(length)]["runs"]:
            _log(
                f"  {length}: {json.dumps(r['config'])[:80]}: TTFT "
                + ", ".join(f"b{b} x{v:.3f}" for b, v in r["ttft_speedup"].items())
                + f", ppl {r['ppl_rel_change']:+.2%}"
                + (
                    f", removed {r['removed_token_layers_fraction']:.2%} of token-layers"
                    if r["removed_token_layers_fraction"] is not None
                    else ""
                )
            )
        out["full"] = raw  # every length's main-bench results, written as they come
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    if getattr(args, "table_md", None):
        Path(args.table_md).write_text(table_markdown(out))
        _log(f"wrote {args.table_md}")
    if getattr(args, "fusion_plot", None):
        if _plot(out, raw, args):
            _log(f"wrote {args.fusion_plot}")
        else:
            _log("no fusion events to plot (no config with adaptive.depth.fusion fused anything)")
    return out


def run_from_args(args: argparse.Namespace) -> int:
    run_prefill_bench(args)
    _log(f"wrote {args.json}")
    return 0
