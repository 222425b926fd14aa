"""Quality loss against speed-up, one point per run and batch size."""

from __future__ import annotations

import json
from typing import Any


def _label(config: dict[str, Any]) -> str:
    depth = config.get("depth")
    if isinstance(depth, dict):
        profile = str(depth.get("profile", "")).rstrip("/").rsplit("/", 1)[-1]
        return f"depth budget {depth.get('budget', 'profile')} ({profile})"
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
    worst = max((abs(100.0 * r["ppl_rel_change"]) for r in results["runs"]), default=0.0)
    if worst > 1000.0:  # a destroyed model beside near-lossless runs: log scale past 1%
        ax.set_yscale("symlog", linthresh=1.0)
        lowest = min(100.0 * r["ppl_rel_change"] for r in results["runs"])
        ax.set_ylim(bottom=min(-1.0, 1.5 * lowest), top=worst * 10)
    ax.set_xlabel("decode tokens/s relative to stock vLLM (same run)")
    ax.set_ylabel("perplexity change vs stock (%), teacher-forced decode")
    ax.set_title(f"vllm-adaptive bench: {results['model'].rstrip('/').split('/')[-1]}")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
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


def plot_calibration(summary: dict[str, Any], path: str) -> None:
    """Per probe layer: greedy agreement with the final layer under the plain logit lens and
    the calibrated Norm_l, and the exit thresholds (tau_l - m_l) against tau_l."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = summary["probe_layers"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(layers, summary["agreement_before"], marker="o", label="plain logit lens")
    ax1.plot(layers, summary["agreement_after"], marker="s", label="calibrated Norm_l")
    ax1.set_xlabel("probe layer (blocks run)")
    ax1.set_ylabel("top-1 agreement with the final layer")
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot(layers, summary["tau"], marker="o", label="tau_l (entropy target, nats)")
    thr = [t if t > -1e30 else float("nan") for t in summary["thresholds"]]
    ax2.plot(layers, thr, marker="s", label="threshold tau_l - m_l")
    ax2.axhline(0.0, color="grey", lw=0.8)
    ax2.set_xlabel("probe layer (blocks run)")
    ax2.set_ylabel("nats")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.suptitle(
        f"EMAD calibration: budget {summary['budget']} ({summary['budget_kind']}), "
        f"q={summary['q']:.4f}, rank {summary['rank']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
