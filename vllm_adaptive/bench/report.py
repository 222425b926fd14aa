"""The markdown table of a `vllm-adaptive bench` result (run labels: `labels.py`).

Also re-renders a stored result without running anything:

    python -m vllm_adaptive.bench.report RESULTS.json [--table-md OUT.md] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.labels import batch_sizes, run_labels


def ppl_change_text(rel: float) -> str:
    """+0.12% for a change under 10x, x1.2e4 past it."""
    if abs(rel) < 9.0:
        return f"{100.0 * rel:+.2f}%"
    mant, exp = f"{1.0 + rel:.1e}".split("e")
    return f"x{mant}e{int(exp)}"


def _mean_layers(depth: dict[str, Any] | None, which: str) -> str:
    if not depth or not depth.get(which):
        return ""
    s = depth[which]
    return f"{s['mean_depth']:.1f} ({s['layers_fraction']:.2f})"


def _memory_cell(entry: dict[str, Any], ratio: float | None) -> str:
    peak = (entry.get("memory") or {}).get("peak_mb")
    if peak is None:
        return ""
    return f"{peak:.0f}" if ratio is None else f"{peak:.0f} ({ratio:.2f})"


def _ratio_cell(value: float | None, sp: dict[str, Any] | None) -> str:
    """``1.02`` for one round, ``1.02 [0.99-1.04]`` (median [min-max] over rounds) for more."""
    if value is None:
        return ""
    if not sp or sp.get("n", 1) <= 1:
        return f"{value:.2f}"
    return f"{value:.2f} [{sp['min']:.2f}-{sp['max']:.2f}]"


def _has_cpu(results: dict[str, Any]) -> bool:
    return bool(results["baseline"].get("worker_cpu_s_per_token"))


def _has_free_running(results: dict[str, Any]) -> bool:
    return any(e.get("free_running") for e in results["runs"] + results.get("peers", []))


def _has_bandwidth(results: dict[str, Any]) -> bool:
    bw = results["baseline"].get("bandwidth")
    return bool(bw and bw.get("reference_gbs"))


def _free_running_cell(fr: dict[str, Any] | None) -> str:
    if not fr:
        return ""
    return f"{fr['agreement']:.3f} ({fr['first_divergence_mean']:.1f})"


def _bandwidth_cell(entry: dict[str, Any], b: str) -> str:
    bw = entry.get("bandwidth") or {}
    wall = (bw.get("share_wall") or {}).get(b)
    cpu = (bw.get("share_worker_cpu") or {}).get(b)
    if wall is None:
        return ""
    return f"{wall:.2f}" + (f" / {cpu:.2f}" if cpu is not None else "")


def depth_table_markdown(results: dict[str, Any]) -> str:
    """One markdown row per config (stock first, peers last): decode tokens/s ratio vs stock per
    batch size (median over rounds [min-max]), mean executed backbone layers over the decode
    tokens of the throughput runs and of the teacher-forced run (fraction of all layers), FLOPs
    ratio, perplexity change, greedy agreement teacher-forced, peak resident memory of the
    engine's model process in MB (ratio vs stock). Depth columns are empty for non-depth
    configs. Where the result has them, also: worker CPU seconds per token ratio (stock's /
    the run's) per batch size, free-running greedy agreement with stock (mean index of the
    first divergence), and the share of the stream bandwidth at the smallest batch size (wall
    time / worker CPU time per step)."""
    bs = batch_sizes(results)
    base = results["baseline"]
    peers = results.get("peers") or []
    cpu, free, bw = _has_cpu(results), _has_free_running(results), _has_bandwidth(results)
    b0 = min(bs, key=int)
    head = ["config"] + [f"tok/s ratio b{b}" for b in bs]
    if cpu:
        head += [f"CPU/token ratio b{b}" for b in bs]
    head += [
        "mean layers, throughput runs (fraction)",
        "mean layers, teacher-forced (fraction)",
        "FLOPs ratio",
        "ppl change",
        "greedy agreement, teacher-forced",
    ]
    if free:
        head.append(
            f"free-running agreement ({results['settings'].get('free_running_tokens', 64)}"
            " tokens; first divergence)"
        )
    if bw:
        head.append(f"bandwidth share b{b0} (wall / CPU)")
    head.append("peak MB (ratio)")

    def row(label: str, entry: dict[str, Any], stock: bool) -> list[str]:
        depth = entry.get("depth")
        if stock:
            cells = [label] + [f"1.00 ({entry['decode_tokens_per_s'][b]:.1f} tok/s)" for b in bs]
        else:
            sp = entry.get("speedup_spread") or {}
            cells = [label.replace("|", "\\|")]
            cells += [_ratio_cell(entry["speedup"][b], sp.get(b)) for b in bs]
        if cpu:
            if stock:
                w = entry["worker_cpu_s_per_token"]
                cells += [f"1.00 ({w[b] * 1e3:.2f} ms)" if w.get(b) else "" for b in bs]
            else:
                csp = entry.get("cpu_speedup_spread") or {}
                cells += [_ratio_cell(entry["cpu_speedup"].get(b), csp.get(b)) for b in bs]
        cells += [
            _mean_layers(depth, "throughput_runs"),
            _mean_layers(depth, "teacher_forced"),
            "1.000" if stock else f"{entry['flops_ratio']:.3f}",
            f"ppl {entry['ppl']:.3f}" if stock else ppl_change_text(entry["ppl_rel_change"]),
            "1.000" if stock else f"{entry['greedy_agreement']:.3f}",
        ]
        if free:
            cells.append("1.000" if stock else _free_running_cell(entry.get("free_running")))
        if bw:
            cells.append(_bandwidth_cell(entry, b0))
        cells.append(_memory_cell(entry, None if stock else entry.get("peak_memory_ratio")))
        return cells

    rows = [row("stock vLLM", base, True)]
    for label, run in zip(run_labels(results), results["runs"], strict=True):
        rows.append(row(label, run, False))
    for peer in peers:
        rows.append(row(peer["label"], peer, False))
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_adaptive.bench.report", description=__doc__)
    p.add_argument("results", help="JSON written by `vllm-adaptive bench --json`")
    p.add_argument("--table-md", metavar="OUT.md", help="write the markdown table here")
    p.add_argument("--plot", metavar="OUT.png", help="write the Pareto plot here")
    p.add_argument("--ratio-plot", metavar="OUT.png", help="write the ratio plot here")
    args = p.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    table = depth_table_markdown(results)
    if args.table_md:
        Path(args.table_md).write_text(table)
    else:
        sys.stdout.write(table)
    if args.plot:
        from vllm_adaptive.bench.plot import plot_pareto

        plot_pareto(results, args.plot)
    if args.ratio_plot:
        from vllm_adaptive.bench.plot import plot_ratios

        plot_ratios(results, args.ratio_plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
