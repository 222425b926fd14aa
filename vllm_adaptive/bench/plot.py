"""Quality loss against speed-up, one point per run and batch size."""

from __future__ import annotations

import json
from typing import Any


def _label(config: dict[str, Any]) -> str:
    text = json.dumps(config, separators=(",", ":"))
    return text if len(text) <= 40 else text[:37] + "..."


def plot_pareto(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = "osD^v<>P*X"
    batch_sizes = list(results["baseline"]["decode_tokens_per_s"])
    ax.scatter(
        [1.0] * len(batch_sizes),
        [0.0] * len(batch_sizes),
        color="black",
        marker="x",
        s=60,
        label="stock vLLM",
        zorder=3,
    )
    for i, run in enumerate(results["runs"]):
        xs = [run["speedup"][b] for b in batch_sizes]
        ys = [100.0 * run["ppl_rel_change"]] * len(xs)
        ax.plot(
            xs,
            ys,
            marker=markers[i % len(markers)],
            linestyle=":",
            label=f"{_label(run['config'])} (agree {run['greedy_agreement']:.3f})",
        )
        for x, y, b in zip(xs, ys, batch_sizes, strict=True):
            ax.annotate(f"b{b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axvline(1.0, color="grey", linewidth=0.5)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("decode tokens/s relative to stock vLLM (same run)")
    ax.set_ylabel("perplexity change vs stock (%), teacher-forced decode")
    ax.set_title(f"vllm-adaptive bench: {results['model'].rstrip('/').split('/')[-1]}")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
