"""The offline bench: vLLM's own ``vllm bench throughput`` (an in-process ``vllm.LLM`` given every
prompt at once), on the same prompts and servers' configurations as the online bench.

Offline users (``LLM.generate`` over a batch) see this figure, not the server's: no HTTP front
end, the whole batch scheduled together, both cores for the engine. Each configuration runs as
its own ``vllm bench throughput`` process, one at a time, in ABBA order; stock runs with
``VLLM_PLUGINS=""`` (none of the plugin's code loaded), the plugin's configurations with the
config ``scripts/serve.sh`` would pass. vLLM's throughput bench samples at temperature 1 with
``ignore_eos``, so every request decodes exactly ``output_len`` tokens: a speed figure only
(quality comes from the online bench's greedy texts and the in-process harness).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.servers import (
    SERVED_NAME,
    OnlineBenchError,
    ServerSpec,
    abba,
    engine_init,
    serve_env,
    start_group,
    stop_group,
)

THROUGHPUT_TIMEOUT_S = 1800


def write_sharegpt(prompts: Sequence[str], out: Path) -> None:
    """The prompts as a ShareGPT file, the local format ``vllm bench throughput`` reads (its
    ``custom`` dataset is serve-only); the second turn is ignored (``--output-len`` is set)."""
    rows = [
        {"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "."}]}
        for p in prompts
    ]
    out.write_text(json.dumps(rows))


def throughput_command(
    spec: ServerSpec,
    model_dir: Path,
    dataset: Path,
    num_prompts: int,
    output_len: int,
    result: Path,
    warmups: int,
) -> list[str]:
    """``vllm bench throughput`` with the engine arguments ``scripts/serve.sh`` would give."""
    vllm = Path(sys.executable).parent / "vllm"
    cmd = [
        str(vllm) if vllm.exists() else "vllm",
        "bench",
        "throughput",
        "--model",
        str(model_dir),
        "--dtype",
        spec.dtype,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(dataset),
        "--num-prompts",
        str(num_prompts),
        "--output-len",
        str(output_len),
        "--num-warmups",
        str(warmups),
        "--output-json",
        str(result),
        *spec.serve_args,
    ]
    if not spec.stock:
        cmd += ["--additional-config", json.dumps({"adaptive": spec.adaptive})]
    return cmd


def output_throughput(result: dict[str, Any], output_len: int) -> float:
    """Output tokens per second of a ``vllm bench throughput`` result (``ignore_eos``: every
    request decodes ``output_len`` tokens; the result's own rate counts prompt tokens too)."""
    return result["num_requests"] * output_len / result["elapsed_time"]


def _run_one(cmd: list[str], env: dict[str, str], log: Path, result: Path) -> dict[str, Any]:
    with open(log, "wb") as out:
        proc = start_group(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=THROUGHPUT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop_group(proc)  # the engine core it spawned goes with it
    if rc != 0 or not result.is_file():
        why = "timed out" if rc is None else f"exit {rc}"
        raise OnlineBenchError(f"vllm bench throughput failed ({why}); log {log}")
    return json.loads(result.read_text())


def run(
    servers: Sequence[ServerSpec],
    prompts: Sequence[str],
    model_dir: Path,
    out_dir: Path,
    rounds: int = 2,
    output_len: int = 64,
    warmups: int = 8,
    kv_gib: int = 4,
) -> dict[str, Any]:
    """Every configuration ``rounds`` times (ABBA) over all ``prompts`` at once; the baseline is
    the faster plain stock."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset = out_dir / "prompts-sharegpt.json"
    write_sharegpt(prompts, dataset)
    records: dict[str, dict[str, Any]] = {
        s.label: {
            "label": s.label,
            "dtype": s.dtype,
            "stock": s.stock,
            "model": s.model,
            "command": throughput_command(
                s, model_dir, dataset, len(prompts), output_len, Path("RESULT"), warmups
            ),
            "env": serve_env(s),
            "runs": [],
        }
        for s in servers
        if s.model == SERVED_NAME  # a peer checkpoint has its own directory: online only
    }
    order = [(r, s) for r, s in abba(servers, rounds) if s.label in records]
    t_all = time.perf_counter()
    for i, (r, spec) in enumerate(order):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", spec.label).strip("-")
        result, log = out_dir / f"offline-{slug}-r{r}.json", out_dir / f"offline-{slug}-r{r}.log"
        print(
            f"[bench-serve] offline {i + 1}/{len(order)} round {r}: {spec.label} "
            f"({time.perf_counter() - t_all:.0f} s so far)",
            flush=True,
        )
        env = {**os.environ, **serve_env(spec), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
        if spec.stock:
            env.pop("ADAPTIVE_CONFIG", None)
        cmd = throughput_command(
            spec, model_dir, dataset, len(prompts), output_len, result, warmups
        )
        t0 = time.perf_counter()
        res = _run_one(cmd, env, log, result)
        tps = output_throughput(res, output_len)
        records[spec.label]["runs"].append(
            {
                "round": r,
                "output_throughput": tps,
                "elapsed_s": res["elapsed_time"],
                "num_requests": res["num_requests"],
                "process_s": time.perf_counter() - t0,
                **engine_init(log),
            }
        )
        print(f"[bench-serve]   {tps:.1f} output tok/s", flush=True)
    rows = list(records.values())
    return {
        "tool": "vllm bench throughput",
        "num_prompts": len(prompts),
        "output_len": output_len,
        "warmups": warmups,
        "sampling": "temperature 1.0, ignore_eos (vLLM's throughput bench)",
        "servers": rows,
        "summary": summarize(rows),
        "wall_s": time.perf_counter() - t_all,
    }


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median output tok/s per configuration and its ratio to the faster plain stock."""
    med = {
        r["label"]: statistics.median(x["output_throughput"] for x in r["runs"])
        for r in rows
        if r["runs"]
    }
    stock = [r["label"] for r in rows if r["stock"] and r["label"] in med]
    base = max(stock, key=med.__getitem__) if stock else None
    return {
        "baseline": base,
        "servers": {
            lb: {
                "output_throughput": v,
                "output_throughput_range": [
                    min(x["output_throughput"] for x in r["runs"]),
                    max(x["output_throughput"] for x in r["runs"]),
                ],
                "x_output_throughput": v / med[base] if base else None,
            }
            for r in rows
            if (lb := r["label"]) in med and (v := med[lb]) is not None
        },
    }


def markdown(offline: dict[str, Any]) -> str:
    summ = offline["summary"]
    lines = [
        f"Offline (`vllm bench throughput`, {offline['num_prompts']} prompts at once, "
        f"{offline['output_len']} tokens each, {offline['warmups']} warm-up prompts first; "
        f"baseline {summ['baseline']}):",
        "",
        "| configuration | dtype | output tok/s (x) | range | engine init s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in offline["servers"]:
        m = summ["servers"].get(r["label"])
        if not m:
            continue
        inits = [x["engine_init_s"] for x in r["runs"] if x.get("engine_init_s") is not None]
        init = f"{statistics.median(inits):.0f}" if inits else "-"
        x = m["x_output_throughput"]
        lo, hi = m["output_throughput_range"]
        lines.append(
            f"| {r['label']} | {r['dtype']} | {m['output_throughput']:.1f}"
            + (f" ({x:.2f}x)" if x is not None else "")
            + f" | {lo:.1f}-{hi:.1f} | {init} |"
        )
    return "\n".join(lines) + "\n"


def plot_axis(ax: Any, offline: dict[str, Any]) -> None:
    """Offline output tok/s per configuration on ``ax`` (stock grey)."""
    rows = [r for r in offline["servers"] if r["label"] in offline["summary"]["servers"]]
    summ = offline["summary"]["servers"]
    vals = [summ[r["label"]]["output_throughput"] for r in rows]
    err = [
        [
            v - summ[r["label"]]["output_throughput_range"][0]
            for r, v in zip(rows, vals, strict=True)
        ],
        [
            summ[r["label"]]["output_throughput_range"][1] - v
            for r, v in zip(rows, vals, strict=True)
        ],
    ]
    colors = ["#888888" if r["stock"] else "#2ca02c" for r in rows]
    ax.barh(range(len(rows)), vals, color=colors, xerr=err)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_title(f"offline, {offline['num_prompts']} prompts at once")
    ax.set_xlabel("output tok/s (vllm bench throughput)")
