"""The MoE bench's report: the stall, prefetch and speed figures per predictor as a markdown
table and a PNG (`vllm-adaptive moe bench` writes them next to its JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: ``name`` or ``name:lookahead``


def plot_bench(result: dict[str, Any], path: str | Path) -> None:
    """Per corpus and batch: tokens/s (median, error bars from the repeats' min to max), stall
    per token and hit rate against capacity, one line per predictor, the resident speed as a
    dashed line (its min-max as a band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["tiered"]
    groups = sorted({(r["corpus"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(3, len(groups), figsize=(4.5 * len(groups), 10), squeeze=False)
    for col, (corpus, b) in enumerate(groups):
        mine = [r for r in rows if r["corpus"] == corpus and r["batch"] == b]
        labels = sorted({(r["predictor"], r["lookahead"]) for r in mine})
        for pred, d in labels:
            pts = sorted(
                (r["capacity"], r) for r in mine if (r["predictor"], r["lookahead"]) == (pred, d)
            )
            xs = [100 * c for c, _ in pts]
            label = pred if pred == "none" else f"{pred} d={d}"
            med = [r["tokens_per_s"] for _, r in pts]
            lo = [m - _spread(r)["min"] for m, (_, r) in zip(med, pts, strict=True)]
            hi = [_spread(r)["max"] - m for m, (_, r) in zip(med, pts, strict=True)]
            axes[0][col].errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
            axes[1][col].plot(
                xs,
                [r["stall_seconds_per_generated_token"] for _, r in pts],
                marker="o",
                label=label,
            )
            axes[2][col].plot(xs, [r["hit_rate"] or 0 for _, r in pts], marker="o", label=label)
        res = result["resident"][f"{corpus}/b{b}"]
        axes[0][col].axhline(res["tokens_per_s"], color="k", ls="--", label="all resident")
        rs = _spread(res)
        axes[0][col].axhspan(rs["min"], rs["max"], color="k", alpha=0.08)
        axes[0][col].set_title(f"{corpus}, batch {b}")
        axes[0][col].set_ylabel("tokens/s")
        axes[1][col].set_ylabel("stall s / generated token")
        axes[2][col].set_ylabel("fast-tier hit rate")
        axes[2][col].set_xlabel("fast tier, % of expert bytes")
        for row in axes:
            row[col].set_ylim(bottom=0)
        axes[0][col].legend(fontsize=7)
    fig.suptitle(
        f"MoEfied SmolLM2-135M (upcycled, top-{result['top_k']} of 16), experts on disk, "
        f"{result.get('eviction', 'lru')} eviction, median of {result.get('repeats', 1)} "
        f"(bars: min-max), {result['env'].get('cpu', '')}",
        fontsize=9,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread(row: dict[str, Any]) -> dict[str, Any]:
    """A cell's tokens/s median/min/max (one run, or a result written before repeats)."""
    tps = row["tokens_per_s"]
    return row.get("tokens_per_s_spread") or {"median": tps, "min": tps, "max": tps, "runs": [tps]}


def table(result: dict[str, Any]) -> str:
    """The markdown table of docs/moe-runtime.md (per generated token: loads, seconds of the
    loader, wall seconds, stall seconds; tok/s: median [min-max] of the repeats)."""
    many = len(result["workload"]["corpora"]) > 1
    head = (
        f"| {'corpus, batch' if many else 'batch'} | fast tier | predictor "
        "| tok/s [min-max] (x resident) | s/tok | stall s/tok "
        "| loads/tok "
        "| loader s/tok | hit rate | late misses | recall / precision d=1 | d=2 | identical |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = []
    for r in result["tiered"]:
        pred = r["prediction"]
        g = r["generated_tokens"]

        def rp(d, pred=pred):
            v = pred.get(d)
            return f"{v['recall']:.2f} / {v['precision']:.2f}" if v else "-"

        name = (
            r["predictor"] if r["predictor"] == "none" else f"{r['predictor']} d={r['lookahead']}"
        )
        corpus = f"{r['corpus']}, " if many else ""
        sp = _spread(r)
        lines.append(
            f"| {corpus}{r['batch']} | {r['capacity']:.0%} | {name} | "
            f"{sp['median']:.2f} [{sp['min']:.2f}-{sp['max']:.2f}] "
            f"({r['speed_vs_resident']:.2f}x) | {r['seconds'] / g:.3f} | "
            f"{r['stall_seconds_per_generated_token']:.3f} | {r['loads'] / g:.0f} | "
            f"{r['load_seconds'] / g:.3f} | {r['hit_rate'] or 0:.2f} | "
            f"{r['late']} of {r['misses']} | {rp('1')} | {rp('2')} | "
            f"{'yes' if r['tokens_identical_to_resident'] else 'NO'} |"
        )
    res = " ".join(
        f"{k}: {_spread(v)['median']:.2f} [{_spread(v)['min']:.2f}-{_spread(v)['max']:.2f}] "
        f"tok/s ({v['seconds'] / v['generated_tokens']:.3f} s/tok);"
        for k, v in result["resident"].items()
    )
    return head + "\n".join(lines) + f"\n\nAll resident: {res}\n"
