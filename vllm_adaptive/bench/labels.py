"""Names for bench runs: a config's label, the run labels of a result, its plot groups.

Shared by the markdown table (`report.py`), the plots (`plot.py`) and the MLX bench.
"""

from __future__ import annotations

import json
from collections import Counter
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
        precision = r.get("precision", "int4")
        if precision == "int4":
            sym = "sym" if r.get("symmetric", False) else "asym"
            kind = f"g{r.get('group_size', 32)} {sym}"
        else:
            kind = precision  # per-row symmetric (w8a8 / w8a16 / int8) or fp16
        kv = f"river({kind}, L_s {r.get('entry_layer', 1)})"
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
    fusion = depth.get("fusion")
    if isinstance(fusion, dict):
        name = str(fusion.get("profile", "")).rstrip("/").rsplit("/", 1)[-1]
        extra.append(f"+fusion[{name}]" if name else "+fusion")
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


def precision_label(precision: dict[str, Any]) -> str:
    """``fixed w8a16 head w8a16``, ``gearbx w8a8/w8a16/fp16 token smooth[smooth-8k]``: what
    decides a precision run's speed and quality (policy, gears, routing, head, modules,
    smoothing), with the config's defaults left out."""
    policy = precision.get("policy", "gearbx")
    parts = [policy]
    if policy == "fixed":
        parts.append(str(precision.get("gear")))
    elif precision.get("gears"):
        parts.append("/".join(map(str, precision["gears"])))
    if precision.get("routing"):
        parts.append(str(precision["routing"]))
    if precision.get("head_gears"):
        heads = list(precision["head_gears"])
        parts.append("head " + (heads[0] if len(set(heads)) == 1 else "/".join(heads)))
    modules = precision.get("modules")
    if modules and "lm_head" not in modules:
        parts.append("no head")
    if modules and set(modules) - {"lm_head"} != {
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    }:
        parts.append("only " + ",".join(m for m in modules if m != "lm_head"))
    if precision.get("tiers"):
        parts.append(str(precision["tiers"]))
    smoothing = precision.get("smoothing")
    if smoothing:
        name = str(smoothing.get("profile", "")).rstrip("/").rsplit("/", 1)[-1]
        parts.append(f"smooth[{name}]" if name else "smooth")
    return " ".join(parts)


def config_label(config: dict[str, Any], engine: dict[str, Any] | None = None) -> str:
    """``mask/emad b0.6``, ``river(g32 asym, L_s 8)/river tau0.95``,
    ``propagate/quicksilver 60/2.0``, ``fixed w8a16 head w8a16`` (a depth config with a fixed
    precision: both, joined by ``+``); other configs: their JSON, shortened."""
    depth = config.get("depth")
    precision = config.get("precision")
    labels = []
    if isinstance(depth, dict):
        p = depth_parts(depth, engine)
        labels.append(f"{p['kv']}/{p['signal']} {p['knobs']}".rstrip())
    if isinstance(precision, dict):
        labels.append(precision_label(precision))
    if labels:
        label = " + ".join(labels)
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
