"""Where a served step goes: vLLM's own torch-profiler trace of the engine, read per step.

``vllm serve --profiler-config`` (with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``) records the engine
process while ``vllm bench serve --profile`` runs: every ``execute_model`` call is a range named
``execute_context_<reqs>(<tokens>)_generation_<reqs>(<tokens>)``, vLLM's model runner marks its
phases (``gpu_model_runner: preprocess / forward / sample / ...``), and every torch op is an event.
:func:`step_profile` turns one trace into milliseconds per decode step: the step's period (start
to start, so the scheduler, IPC and output processing between steps count), vLLM's phases, and the
self time of the ops inside, grouped (GEMMs, the plugin's custom ops, attention, the compiled
graph's own code). No vLLM import: it reads files.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
_PHASE = "gpu_model_runner: "

#: op-name substrings -> group (first match wins; matched on the lower-cased name)
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("plugin custom ops (own Python)", ("vllm_adaptive::",)),
    (
        "GEMM",
        (
            "linear_dynamic",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "onednn_mm",
            "onednn_scaled_mm",
            "int8pack_mm",
            "fbgemm",
            "mkldnn",
            "native::fp16_linear",
        ),
    ),
    ("attention", ("attention", "paged", "attn", "reshape_and_cache", "native::masked_")),
    ("compiled graph (inductor kernels)", ("torch-compiled region", "compiledfunction")),
    ("sampling ops", ("topk", "sort", "argmax", "softmax", "multinomial", "exponential")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other ops"


def load_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        raw = json.load(f)
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def self_times(events: Iterable[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """Each event with its self time (its duration less its direct children's), per thread."""
    by_thread: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: list[tuple[dict[str, Any], float]] = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, child time]
        for e in evs:
            end = e["ts"] + e["dur"]
            while stack and stack[-1][1] <= e["ts"]:
                done = stack.pop()
                out.append((done[0], done[0]["dur"] - done[2]))
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e, end, 0.0])
        while stack:
            done = stack.pop()
            out.append((done[0], done[0]["dur"] - done[2]))
    return out


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def step_profile(events: list[dict[str, Any]], top: int = 12) -> dict[str, Any]:
    """Per decode step (no prompt tokens in it), in ms: the period from one step's start to the
    next's, vLLM's phases and the op groups' self time, medians over the trace's decode steps;
    plus the ops with the most self time per step. Prefill steps are counted, not profiled."""
    steps = sorted((e for e in events if _STEP.match(e.get("name", ""))), key=lambda e: e["ts"])
    if len(steps) < 2:
        return {"error": f"{len(steps)} execute_model ranges in the trace (need 2+)"}
    thread = (steps[0].get("pid"), steps[0].get("tid"))
    on_thread = [e for e in events if (e.get("pid"), e.get("tid")) == thread]
    timed = self_times(on_thread)
    windows = []  # (start, end, batch) of decode steps followed by another step
    prefill_steps = 0
    for a, b in zip(steps, steps[1:], strict=False):
        ctx_reqs, _, gen_reqs, _ = (int(x) for x in _STEP.match(a["name"]).groups())
        if ctx_reqs:
            prefill_steps += 1
            continue
        windows.append((a["ts"], b["ts"], gen_reqs))
    if not windows:
        return {"error": "no decode step followed by another step in the trace"}
    starts = [w[0] for w in windows]
    per_window: list[dict[str, float]] = [defaultdict(float) for _ in windows]
    ops: dict[str, float] = defaultdict(float)
    import bisect

    for e, self_us in timed:
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] >= windows[i][1]:
            continue
        acc = per_window[i]
        name = e.get("name", "")
        if name.startswith(_PHASE):
            acc["phase " + name[len(_PHASE) :]] += e["dur"] / 1e3
        if _STEP.match(name):
            acc["execute_model"] += e["dur"] / 1e3
            continue  # its self time is the runner's Python between phases: in "other"
        if name.startswith(_PHASE) or e.get("cat") == "user_annotation":
            acc["runner Python (annotated ranges' own time)"] += self_us / 1e3
            continue
        acc[group_of(name)] += self_us / 1e3
        acc["all ops"] += self_us / 1e3
        ops[name] += self_us / 1e3
    keys = sorted({k for w in per_window for k in w})
    periods = [(w[1] - w[0]) / 1e3 for w in windows]
    result: dict[str, Any] = {
        "decode_steps": len(windows),
        "prefill_steps": prefill_steps,
        "batch_median": _median([float(w[2]) for w in windows]),
        "step_ms": _median(periods),
        "ms_per_step": {k: _median([w.get(k, 0.0) for w in per_window]) for k in keys},
        "top_ops_ms_per_step": {
            k: round(v / len(windows), 3)
            for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:top]
        },
    }
    ms = result["ms_per_step"]
    if result["step_ms"] is not None:
        result["ms_per_step"]["outside execute_model (scheduler, IPC, output)"] = round(
            result["step_ms"] - (ms.get("execute_model") or 0.0), 3
        )
    return result


def find_trace(directory: Path) -> Path | None:
    """The engine's trace in a profiler directory (the largest ``*.pt.trace.json[.gz]``: the
    front end writes a small one of its own)."""
    found = [p for p in directory.rglob("*.pt.trace.json*") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_size) if found else None


def profiler_serve_args(directory: Path) -> list[str]:
    """``vllm serve`` arguments that record the engine with torch's profiler into ``directory``
    (CPU activity only, no stacks: the per-op overhead stays small)."""
    cfg = {
        "profiler": "torch",
        "torch_profiler_dir": str(directory),
        "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": True,
    }
    return ["--profiler-config", json.dumps(cfg)]


def markdown(profiles: dict[str, dict[str, Any]]) -> str:
    """One column per server, one row per group: ms per decode step."""
    labels = [k for k, v in profiles.items() if "ms_per_step" in v]
    if not labels:
        return ""
    rows = sorted({k for v in profiles.values() for k in v.get("ms_per_step", {})})
    head = "| ms per decode step | " + " | ".join(labels) + " |"
    lines = [head, "|" + " --- |" * (len(labels) + 1)]
    steps = " | ".join(str(profiles[k]["step_ms"]) for k in labels)
    lines.append(f"| step (start to start) | {steps} |")
    for r in rows:
        lines.append(
            f"| {r} | "
            + " | ".join(str(profiles[k]["ms_per_step"].get(r, "")) for k in labels)
            + " |"
        )
    lines.append(
        "| decode steps (median batch) | "
        + " | ".join(
            f"{profiles[k]['decode_steps']} ({profiles[k]['batch_median']})" for k in labels
        )
        + " |"
    )
    return "\n".join(lines) + "\n"
