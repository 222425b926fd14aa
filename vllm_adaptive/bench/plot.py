"""Quality loss against speed-up (one point per run), gear traces, speed and CPU ratios."""

from __future__ import annotations

from typing import Any

from vllm_adaptive.bench.labels import batch_sizes, run_group, run_labels

_STRATEGY_COLORS = {
    "monotone": "tab:blue",
    "mask": "tab:orange",
    "propagate": "tab:green",
    "river": "tab:red",
    "no depth": "tab:gray",
}
_SIGNAL_MARKERS = {"emad": "o", "quicksilver": "s", "river": "D"}
_OTHER_MARKERS = "^v<>P*Xhp"


def _style(groups: list[tuple[str, str]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Colour per KV strategy, marker per signal (fixed for the known ones)."""
    colors: dict[str, Any] = {}
    extra_colors = iter(["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"] * 4)
    markers: dict[str, str] = dict(_SIGNAL_MARKERS)
    extra_markers = iter(_OTHER_MARKERS * 4)
    for strategy, signal in groups:
        if strategy not in colors:
            colors[strategy] = _STRATEGY_COLORS.get(strategy) or next(extra_colors)
        if signal not in markers:
            markers[signal] = next(extra_markers)
    return colors, markers


def _xerr(entry: dict[str, Any], b: str) -> list[list[float]] | None:
    """Error bar of the speed ratio: min and max over rounds (None for one round)."""
    sp = (entry.get("speedup_spread") or {}).get(b)
    if not sp or sp.get("n", 1) <= 1:
        return None
    x = entry["speedup"][b]
    return [[max(x - sp["min"], 0.0)], [max(sp["max"] - x, 0.0)]]


def _agreement_text(entry: dict[str, Any]) -> str:
    fr = entry.get("free_running")
    text = f"agree {entry['greedy_agreement']:.3f}"
    return text + (f", free {fr['agreement']:.2f}" if fr else "")


def plot_pareto(results: dict[str, Any], path: str) -> None:
    """Perplexity change against decode speed ratio, one point per run and peer: at the
    smallest batch size, and beside it at the largest when several were run; error bars span
    the per-round ratios (min to max). Colour: KV strategy; marker: exit signal; peers are
    black stars; points are numbered on the plot and in the legend (outside the axes), which
    also gives teacher-forced and free-running greedy agreement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = results["runs"]
    peers = results.get("peers") or []
    sizes = batch_sizes(results)
    by_int = sorted(sizes, key=int)
    panels = [by_int[0]] if len(by_int) == 1 else [by_int[0], by_int[-1]]
    labels = run_labels(results)
    groups = [run_group(r) for r in runs]
    colors, markers = _style(groups)

    legend_rows = max(len(runs) + len(peers) + 1, 1)
    height = max(4.5, 1.2 + 0.17 * legend_rows)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.2 * len(panels) + 0.4, height), sharey=True, squeeze=False
    )
    axes = axes[0]
    ys = [100.0 * r["ppl_rel_change"] for r in runs]
    peer_ys = [100.0 * p["ppl_rel_change"] for p in peers]
    worst = max((abs(y) for y in ys + peer_ys), default=0.0)
    for ax, b in zip(axes, panels, strict=True):
        ax.scatter([1.0], [0.0], color="black", marker="x", s=60, zorder=3)
        for i, (run, (strategy, signal), y) in enumerate(zip(runs, groups, ys, strict=True)):
            x = run["speedup"][b]
            err = _xerr(run, b)
            if err is not None:
                ax.errorbar([x], [y], xerr=err, color=colors[strategy], lw=0.8, capsize=2)
            ax.scatter(
                [x],
                [y],
                color=colors[strategy],
                marker=markers[signal],
                s=42,
                zorder=3,
                edgecolors="black",
                linewidths=0.4,
            )
            ax.annotate(str(i + 1), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        for j, (peer, y) in enumerate(zip(peers, peer_ys, strict=True)):
            x = peer["speedup"][b]
            err = _xerr(peer, b)
            if err is not None:
                ax.errorbar([x], [y], xerr=err, color="black", lw=0.8, capsize=2)
            ax.scatter([x], [y], color="gold", marker="*", s=110, zorder=4, edgecolors="black")
            ax.annotate(f"P{j + 1}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.axvline(1.0, color="grey", linewidth=0.5)
        ax.axhline(0.0, color="grey", linewidth=0.5)
        ax.set_xlabel(f"decode tok/s ratio vs stock vLLM, batch {b}")
        ax.grid(alpha=0.25)
        if worst > 1000.0:  # a destroyed model beside near-lossless runs: log scale past 1%
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylim(bottom=min(-1.0, 1.5 * min(ys)), top=worst * 10)
    axes[0].set_ylabel("perplexity change vs stock (%), teacher-forced decode")
    fig.suptitle(f"vllm-adaptive bench: {results['model'].rstrip('/').split('/')[-1]}")

    handles = [Line2D([], [], color="black", marker="x", linestyle="", label="stock vLLM")]
    for i, (run, label, (strategy, signal)) in enumerate(zip(runs, labels, groups, strict=True)):
        handles.append(
            Line2D(
                [],
                [],
                color=colors[strategy],
                marker=markers[signal],
                linestyle="",
                markeredgecolor="black",
                markeredgewidth=0.4,
                label=f"{i + 1}: {label} ({_agreement_text(run)})",
            )
        )
    for j, peer in enumerate(peers):
        handles.append(
            Line2D(
                [],
                [],
                color="gold",
                marker="*",
                markersize=10,
                linestyle="",
                markeredgecolor="black",
                label=f"P{j + 1}: {peer['label']} ({_agreement_text(peer)})",
            )
        )
    axes[-1].legend(
        handles=handles,
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0.0,
        frameon=False,
        title="colour: KV strategy, marker: signal",
        title_fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


_GEAR_Y = {"low": 0, "mid": 1, "high": 2, "off": 3}


def plot_gear_traces(results: dict[str, Any], path: str) -> bool:
    """Entropy (bits) and gear over the tokens of one teacher-forced stream per corpus, one
    row per precision run. Returns False when no run recorded gears."""
    runs = [r for r in results["runs"] if r.get("gears") and r["gears"]["traces"]]
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = sorted({name for r in runs for name in r["gears"]["traces"]})
    fig, axes = plt.subplots(
        len(runs), len(corpora), figsize=(6 * len(corpora), 2.6 * len(runs)), squeeze=False
    )
    for row, run in enumerate(runs):
        policy = run["gears"]["policy"]
        maps = run["gears"]["layer_maps"]
        for col, name in enumerate(corpora):
            ax = axes[row][col]
            trace = run["gears"]["traces"].get(name)
            if trace is None:
                ax.set_visible(False)
                continue
            ent = trace["entropy_bits"]
            gears = [_GEAR_Y[g] for g in trace["gears"]]
            ax.plot(range(len(ent)), ent, color="tab:blue", lw=1, label="entropy (bits)")
            for key in ("theta_low", "theta_high"):
                if key in policy:
                    ax.axhline(policy[key], color="tab:gray", ls=":", lw=0.8)
            ax.set_ylabel("entropy (bits)", color="tab:blue")
            ax2 = ax.twinx()
            ax2.step(range(len(gears)), gears, where="post", color="tab:red", lw=1.2, label="gear")
            ax2.set_yticks([0, 1, 2, 3])
            last = maps[-1] if maps else ["low", "mid", "high", "full"]
            ax2.set_yticklabels(
                [f"low ({last[0]})", f"mid ({last[1]})", f"high ({last[2]})", "off"]
            )
            ax2.set_ylim(-0.3, 3.3)
            counts = trace["gear_tokens"]
            title = f"{policy['policy']} / {name}: " + ", ".join(
                f"{g} {n}" for g, n in counts.items() if n
            )
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("teacher-forced token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_ratios(results: dict[str, Any], path: str) -> None:
    """Decode tokens/s ratio and worker CPU-per-token ratio against stock, per batch size, for
    every run and peer: the median over rounds, bars from the lowest to the highest round, and
    the 1.00 +- 0.05 band an identical engine must fall in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(batch_sizes(results), key=int)
    entries = list(zip(run_labels(results), results["runs"], strict=True))
    entries += [(p["label"], p) for p in results.get("peers") or []]
    has_cpu = any(v is not None for _, e in entries for v in (e.get("cpu_speedup") or {}).values())
    panels = [("speedup", "decode tokens/s ratio vs stock")]
    if has_cpu:
        panels.append(("cpu_speedup", "worker CPU s/token, stock / run"))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.2 * len(panels), 4.2 + 0.18 * len(entries)), squeeze=False
    )
    width = 0.8 / max(len(entries), 1)
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        ax.axhspan(0.95, 1.05, color="tab:gray", alpha=0.15, lw=0)
        ax.axhline(1.0, color="grey", lw=0.8)
        for k, (label, e) in enumerate(entries):
            xs, ys, lo, hi = [], [], [], []
            for i, b in enumerate(sizes):
                v = (e.get(key) or {}).get(b)
                if v is None:
                    continue
                sp = (e.get(f"{key}_spread") or {}).get(b) or {"min": v, "max": v}
                xs.append(i + (k - (len(entries) - 1) / 2) * width)
                ys.append(v)
                lo.append(v - sp["min"])
                hi.append(sp["max"] - v)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=label, ms=5)
        ax.set_xticks(range(len(sizes)), [f"batch {b}" for b in sizes])
        ax.set_ylabel(title)
        ax.grid(alpha=0.25, axis="y")
    rounds = results["settings"].get("rounds", 1)
    fig.suptitle(
        f"median over {rounds} rounds (bars: min-max; band: 1.00 +- 0.05), "
        f"{results['settings'].get('dtype', '')}, "
        + ("eager" if results["settings"].get("enforce_eager") else "compiled")
    )
    axes[0][0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
