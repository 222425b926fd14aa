"""Servers under vLLM's torch profiler (``vllm-adaptive bench-serve --profile``): each
configuration started once with the profiler ready, loaded by ``vllm bench serve --profile``,
its engine trace read into where a decode step's time goes (:mod:`server_profile`)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.serve_client import client_command, run_client, write_prompts
from vllm_adaptive.bench.servers import ServerSpec, complete_once, serving


def _wait_for_trace(directory: Path, before: set[Path], timeout: float = 300) -> Path | None:
    """The engine trace written after ``before`` was listed, once its size stops changing."""

    t0, last = time.perf_counter(), (None, -1)
    while time.perf_counter() - t0 < timeout:
        found = [p for p in directory.rglob("*.pt.trace.json*") if p not in before]
        if found:
            path = max(found, key=lambda p: p.stat().st_size)
            size = path.stat().st_size
            if (path, size) == last:
                return path
            last = (path, size)
        time.sleep(3)
    return None


def profile(
    servers: Sequence[ServerSpec],
    corpora: Sequence[str],
    out_dir: Path,
    concurrency: Sequence[int] = (1, 8),
    prompt_tokens: int = 100,
    output_len: int = 32,
) -> dict[str, Any]:
    """Each server once, recorded by vLLM's torch profiler while `vllm bench serve --profile`
    sends ``max(4, c)`` requests at each concurrency ``c``: where a decode step's time goes
    (:mod:`vllm_adaptive.bench.server_profile`). Not a speed measurement: the profiler and
    vLLM's scopes slow every op; compare the parts, not the totals, with the timed bench."""
    from vllm_adaptive.bench.env import cpu_info, versions
    from vllm_adaptive.bench.server_profile import load_trace, step_profile
    from vllm_adaptive.bench.server_profile import markdown as profile_markdown
    from vllm_adaptive.model_zoo import prepare

    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare(quiet=True)
    prompts_path = out_dir / "prompts.jsonl"
    n_max = max(max(4, c) for c in concurrency)
    write_prompts(model_dir, corpora, n_max, prompt_tokens, prompts_path)
    result: dict[str, Any] = {
        "bench": "online-profile",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "env": {"cpu": cpu_info(), "versions": versions("vllm", "torch", "vllm-adaptive")},
        "args": {"concurrency": list(concurrency), "output_len": output_len},
        "profiles": {},
    }
    for i, spec in enumerate(servers):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", spec.label).strip("-")
        trace_dir = (out_dir / f"trace-{slug}").resolve()
        trace_dir.mkdir(parents=True, exist_ok=True)
        print(f"[bench-serve] profile {i + 1}/{len(servers)}: {spec.label}", flush=True)
        with serving(spec, out_dir / f"server-{slug}-profile.log", profile_dir=trace_dir) as srv:
            complete_once(srv.url, "The capital of France is", 16, spec.model)  # warm only
            for c in concurrency:
                before = set(trace_dir.rglob("*.pt.trace.json*"))
                name = f"{slug}-c{c}-profile.json"
                cmd = client_command(
                    srv.url, model_dir, prompts_path, c, max(4, c), output_len, out_dir, name
                )
                run_client(
                    [*cmd, "--profile"], out_dir / f"client-{slug}-c{c}-profile.log", out_dir / name
                )
                trace = _wait_for_trace(trace_dir, before)
                key = f"{spec.label} @{c}"
                if trace is None:
                    result["profiles"][key] = {"error": f"no trace written in {trace_dir}"}
                    continue
                prof = step_profile(load_trace(trace))
                prof["trace"] = str(trace)
                result["profiles"][key] = prof
                print(
                    f"[bench-serve]   {c:>3} concurrent: {prof.get('step_ms')} ms per decode "
                    f"step over {prof.get('decode_steps')} steps",
                    flush=True,
                )
    (out_dir / "profile.json").write_text(json.dumps(result, indent=1))
    (out_dir / "profile.md").write_text(profile_markdown(result["profiles"]))
    return result
