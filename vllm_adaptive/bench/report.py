"""Labels and the markdown table of a `vllm-adaptive bench` result.

Also re-renders a stored result without running anything:

    python -m vllm_adaptive.bench.report RESULTS.json [--table-md OUT.md] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def _num(v: Any) -> str:
    """A config number as written (2.0 stays 2.0, 60 stays 60)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _policies(signal: dict[str, Any]) -> list[str]:
    policy = signal.get("policy", "emad")
    return [policy] if isinstance(policy, str) else list(policy)


def depth_parts(depth: dict[str, Any], engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pieces of a depth config's label: KV strategy, signal(s) and their knobs.

    ``engine`` (the depth runtime's engine telemetry, optional) fills in a budget the config
    leaves to the profile."""
    strategy = depth.get("kv_strategy", "monotone")
    kv = strategy
    offload = False
    if strategy == "river":
        r = depth.get("river") or {}
        sym = "sym" if r.get("symmetric", False) else "asym"
        kv = f"river(g{r.get('group_size', 32)} {sym}, L_s {r.get('entry_layer', 1)})"
        if r.get("prefill") == "river":
            kv += "+prefill"
        offload = bool(r.get("offload_backbone", False))
        if offload:
            kv += "+offload"
    signal = depth.get("signal") or {}
    policies = _policies(signal)
    sep = "|" if signal.get("combine") == "any" else "&"
    knobs = []
    for p in policies:
        if p == "emad":
            budget = depth.get("budget")
            if budget is None and engine is not None and engine.get("budget") is not None:
                knobs.append(f"b{_num(engine['budget'])}(profile)")
            else:
                knobs.append(f"b{_num(budget) if budget is not None else '(profile)'}")
        elif p == "quicksilver":
            qs = signal.get("quicksilver") or {}
            drift, ent = qs.get("tau_drift"), qs.get("tau_entropy")
            knob = f"{_num(drift) if drift is not None else 'prof'}/"
            knob += _num(ent) if ent is not None else "prof"
            if qs.get("entropy"):
                knob += f" {qs['entropy']}"
            knobs.append(knob)
        elif p == "river":
            rv = signal.get("river") or {}
            tau = rv.get("tau")
            knob = f"tau{_num(tau) if tau is not None else '(profile)'}"
            if rv.get("batch_min"):
                knob += " batchmin"
            if "entry_layer" in rv:
                knob += f" from L{rv['entry_layer']}"
            knobs.append(knob)
        else:
            knobs.append(str(p))
    extra = []
    if "floor" in depth and depth["floor"] is None:
        extra.append("nofloor")
    if depth.get("refresh"):
        extra.append(
            f"refresh {depth['refresh'].get('every')}/{depth['refresh'].get('raise_layers')}"
        )
    return {
        "kv_strategy": strategy,
        "kv": kv,
        "offload": offload,
        "signal": sep.join(policies),
        "knobs": " ".join(knobs + extra),
    }


def config_label(config: dict[str, Any], engine: dict[str, Any] | None = None) -> str:
    """``mask/emad b0.6``, ``river(g32 asym, L_s 8)/river tau0.95``,
    ``propagate/quicksilver 60/2.0``; non-depth configs: their JSON, shortened."""
    depth = config.get("depth")
    if isinstance(depth, dict):
        p = depth_parts(depth, engine)
        label = f"{p['kv']}/{p['signal']} {p['knobs']}".rstrip()
        return f"off: {label}" if config.get("mode") == "off" else label
    text = json.dumps(config, separators=(",", ":"))
    return text if len(text) <= 40 else text[:37] + "..."


def _profile_name(config: dict[str, Any]) -> str | None:
    depth = config.get("depth")
    if isinstance(depth, dict) and depth.get("profile"):
        return str(depth["profile"]).rstrip("/").rsplit("/", 1)[-1]
    return None


def run_labels(results: dict[str, Any]) -> list[str]:
    """One label per run; runs whose labels coincide are told apart by their profile's
    directory name, then by their position."""
    runs = results["runs"]
    labels = [config_label(r["config"], (r.get("depth") or {}).get("engine")) for r in runs]
    counts = Counter(labels)
    for i, r in enumerate(runs):
        if counts[labels[i]] > 1 and _profile_name(r["config"]):
            labels[i] = f"{labels[i]} [{_profile_name(r['config'])}]"
    counts = Counter(labels)
    seen: Counter[str] = Counter()
    out = []
    for label in labels:
        seen[label] += 1
        out.append(f"{label} #{seen[label]}" if counts[label] > 1 else label)
    return out


def run_group(run: dict[str, Any]) -> tuple[str, str]:
    """(KV strategy, signal) of a run, for the plot's colours and markers; non-depth runs:
    ("no depth", the mechanism)."""
    depth = run["config"].get("depth")
    if isinstance(depth, dict):
        p = depth_parts(depth)
        return p["kv_strategy"], p["signal"]
    mech = next((k for k in ("precision",) if run["config"].get(k)), "none")
    return "no depth", mech


def batch_sizes(results: dict[str, Any]) -> list[str]:
    return list(results["baseline"]["decode_tokens_per_s"])


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


def depth_table_markdown(results: dict[str, Any]) -> str:
    """One markdown row per config (stock first): decode tokens/s ratio vs stock per batch
    size, mean executed backbone layers over the decode tokens of the throughput runs and of
    the teacher-forced run (fraction of all layers), FLOPs ratio, perplexity change, greedy
    agreement, peak resident memory of the engine's model process in MB (ratio vs stock).
    Depth columns are empty for non-depth configs."""
    bs = batch_sizes(results)
    base = results["baseline"]
    head = (
        ["config"]
        + [f"tok/s ratio b{b}" for b in bs]
        + [
            "mean layers, throughput runs (fraction)",
            "mean layers, teacher-forced (fraction)",
            "FLOPs ratio",
            "ppl change",
            "greedy agreement",
            "peak MB (ratio)",
        ]
    )
    rows = [
        ["stock vLLM"]
        + [f"1.00 ({base['decode_tokens_per_s'][b]:.1f} tok/s)" for b in bs]
        + ["", "", "1.000", f"ppl {base['ppl']:.3f}", "1.000", _memory_cell(base, None)]
    ]
    for label, run in zip(run_labels(results), results["runs"], strict=True):
        depth = run.get("depth")
        rows.append(
            [label.replace("|", "\\|")]
            + [f"{run['speedup'][b]:.2f}" for b in bs]
            + [
                _mean_layers(depth, "throughput_runs"),
                _mean_layers(depth, "teacher_forced"),
                f"{run['flops_ratio']:.3f}",
                ppl_change_text(run["ppl_rel_change"]),
                f"{run['greedy_agreement']:.3f}",
                _memory_cell(run, run.get("peak_memory_ratio")),
            ]
        )
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_adaptive.bench.report", description=__doc__)
    p.add_argument("results", help="JSON written by `vllm-adaptive bench --json`")
    p.add_argument("--table-md", metavar="OUT.md", help="write the markdown table here")
    p.add_argument("--plot", metavar="OUT.png", help="write the Pareto plot here")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
