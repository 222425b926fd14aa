"""One engine's measurements, run in its own process by the harness.

Usage (internal):
    python -m vllm_adaptive.bench.engine_run SPEC.json OUT.json      # everything once
    python -m vllm_adaptive.bench.engine_run --serve SPEC.json FD     # commands on stdin

Each engine gets a process of its own so that engines never share memory, caches
or threads, and a crash in one config is reported instead of taking down the
whole benchmark. In ``--serve`` mode the engine stays alive and the harness asks for
one measurement at a time, so that engines can be timed alternately (ABBA) seconds apart.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

#: A repeat whose decode (full run minus prefill-only run) reads under this fraction of the full
#: run is dropped (the other repeats stand; none left is an error), not clamped: a slow prefill
#: reading once made a batch-32 round read
#: 2e12 tokens/s (docs/data/bench-f32-fp16.json spread from 1.2e-10 to 5.3).
MIN_DECODE_FRACTION = 0.2


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _generate(llm: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    from vllm_adaptive.engine.vllm_api import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def timed_generate(
    llm: Any, batch: list[list[int]], n: int, pids: dict[str, int] | None = None, tag: str = "tp"
) -> tuple[float, dict[str, float | None], list[list[int]]]:
    """Greedy ``n`` tokens for every prompt of ``batch`` (``ignore_eos``), prefix cache reset
    first so that no call reuses another's prefill: (wall seconds, CPU seconds of each engine
    process in ``pids`` over the call, output token ids)."""
    from vllm_adaptive.bench.cputime import cpu_delta, cpu_snapshot
    from vllm_adaptive.engine.vllm_api import SamplingParams

    llm.reset_prefix_cache()
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=n,
            ignore_eos=True,
            detokenize=False,
            extra_args={"adaptive_request_tag": f"{tag}-b{len(batch)}-n{n}-{j}"},
        )
        for j in range(len(batch))
    ]
    before = cpu_snapshot(pids or {})
    t0 = time.perf_counter()
    outs = _generate(llm, batch, params)
    dt = time.perf_counter() - t0
    cpu = cpu_delta(before, cpu_snapshot(pids or {}))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == n for t in tokens)
    return dt, cpu, tokens


def measure_batch(
    llm: Any,
    prompts: list[list[int]],
    b: int,
    max_tokens: int,
    repeats: int,
    pids: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Decode tokens/s, TTFT, mean inter-token latency and CPU seconds per decode token of each
    engine process, for the first ``b`` prompts; best of ``repeats`` by tokens/s.

    Prefill is the same batch with max_tokens=1, timed before and after the full run and the
    faster of the two kept; decode is the rest of a max_tokens run (for wall time and CPU time
    alike). One slow prefill reading (a hiccup of the machine) would otherwise be subtracted
    from a normal full run and leave a decode time near zero: a round at batch 32 once read
    10^12 tokens/s that way."""
    batch = prompts[:b]
    steps = max_tokens - 1
    best: dict[str, Any] | None = None
    implausible: list[tuple[float, float]] = []
    for _ in range(repeats):
        prefill, cpu_prefill, _ = timed_generate(llm, batch, 1, pids)
        full, cpu_full, _ = timed_generate(llm, batch, max_tokens, pids)
        again, cpu_again, _ = timed_generate(llm, batch, 1, pids)
        # two prefill readings within 10% of each other: no hiccup, whatever share decode has
        # (a long prompt's prefill can be most of a short run)
        agree = max(prefill, again) <= 1.1 * min(prefill, again)
        if again < prefill:
            prefill, cpu_prefill = again, cpu_again
        decode = full - prefill
        if decode <= 0 or (decode < MIN_DECODE_FRACTION * full and not agree):
            implausible.append((full, prefill))  # a prefill reading slower than the full run's
            continue
        rate = b * steps / decode
        if best is None or rate > best["decode_tokens_per_s"]:
            cpu_tok = {}
            for role, c in cpu_full.items():
                p = cpu_prefill.get(role)
                cpu_tok[role] = (
                    max(c - p, 0.0) / (b * steps) if c is not None and p is not None else None
                )
            best = {
                "decode_tokens_per_s": rate,
                "ttft_s": prefill,
                "itl_s": decode / steps,
                "cpu_s_per_token": cpu_tok,
                "cpu_s_full_run": cpu_full,
            }
    if best is None:
        raise RuntimeError(
            f"batch {b}: every one of {repeats} repeats timed decode at under "
            f"{MIN_DECODE_FRACTION:.0%} of the full run with prefill readings 10% apart or "
            f"more (full, prefill-only seconds: "
            f"{implausible}); the machine is too noisy to time this batch"
        )
    if implausible:
        best["implausible_repeats"] = len(implausible)
    return best


def measure_throughput(
    llm: Any,
    prompts: list[list[int]],
    batch_sizes: list[int],
    max_tokens: int,
    repeats: int,
    pids: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Every batch size once (see ``measure_batch``), after a warm-up; the record of one round:
    maps batch size -> value for ``decode_tokens_per_s``, ``ttft_s``, ``itl_s``, and
    ``cpu_s_per_token`` role -> batch size -> CPU seconds per decode token."""
    warmup(llm, prompts, batch_sizes)
    result: dict[str, Any] = {"decode_tokens_per_s": {}, "ttft_s": {}, "itl_s": {}}
    cpu: dict[str, dict[str, float | None]] = {}
    for b in batch_sizes:
        m = measure_batch(llm, prompts, b, max_tokens, repeats, pids)
        for key in ("decode_tokens_per_s", "ttft_s", "itl_s"):
            result[key][str(b)] = m[key]
        for role, v in m["cpu_s_per_token"].items():
            cpu.setdefault(role, {})[str(b)] = v
        _log(describe_measurement(b, m))
    if cpu:
        result["cpu_s_per_token"] = cpu
    return result


def warmup(llm: Any, prompts: list[list[int]], batch_sizes: list[int]) -> None:
    """Untimed runs at every batch size: allocator, kernels for those shapes, caches."""
    for b in sorted(set(batch_sizes)):
        timed_generate(llm, prompts[:b], 4, tag="warmup")


def describe_measurement(b: int, m: dict[str, Any]) -> str:
    worker = (m.get("cpu_s_per_token") or {}).get("worker")
    return (
        f"  batch {b:>3}: {m['decode_tokens_per_s']:8.1f} decode tok/s, ttft "
        f"{m['ttft_s'] * 1e3:7.1f} ms, itl {m['itl_s'] * 1e3:6.1f} ms"
        + (f", worker {worker * 1e3:6.2f} CPU ms/token" if worker is not None else "")
    )


def greedy_outputs(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt in one batch (speculation must not change them)."""
    from vllm_adaptive.engine.vllm_api import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in _generate(llm, prompts, params)]


def speculation_metrics(llm: Any) -> dict[str, Any]:
    """vLLM's speculative-decoding counters over this engine's life (timed runs included)."""
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            key = m.name.removeprefix("vllm:spec_decode_")
            out[key] = list(m.values) if hasattr(m, "values") else m.value
    drafts, tokens = out.get("num_drafts", 0), out.get("num_draft_tokens", 0)
    accepted = out.get("num_accepted_tokens", 0)
    out["acceptance_rate"] = accepted / tokens if tokens else None
    out["mean_accepted_length"] = 1 + accepted / drafts if drafts else None
    return out


def measure_teacher_forced(llm: Any, streams: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Teacher-forced logprobs and greedy tokens for every held-out stream, one batch."""
    from vllm_adaptive.bench.teacher_forcing import FORCE_KEY, read_forced_output
    from vllm_adaptive.engine.vllm_api import SamplingParams

    llm.reset_prefix_cache()
    prompts = [s["prefix"] for s in streams]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=len(s["forced"]),
            ignore_eos=True,
            logprobs=1,
            detokenize=False,
            extra_args={FORCE_KEY: s["forced"], "adaptive_request_tag": f"tf{i}"},
        )
        for i, s in enumerate(streams)
    ]
    t0 = time.perf_counter()
    outs = _generate(llm, prompts, params)
    dt = time.perf_counter() - t0
    forced = [read_forced_output(o, s["forced"]) for o, s in zip(outs, streams, strict=True)]
    n = sum(len(f.logprobs) for f in forced)
    _log(f"  teacher forcing: {len(streams)} streams, {n} decode positions in {dt:.1f} s")

    # Cross-check: the same positions scored by one prefill pass (prompt_logprobs).
    # With nothing adaptive at decode time the two must agree up to kernel numerics;
    # an adaptive mode that only acts at decode time shows up as a gap.
    llm.reset_prefix_cache()
    full = [s["prefix"] + s["forced"] for s in streams]
    outs = _generate(llm, full, SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False))
    prefill_lps = []
    for o, s, ids in zip(outs, streams, full, strict=True):
        p, m = len(s["prefix"]), len(s["forced"])
        prefill_lps.append([o.prompt_logprobs[i][ids[i]].logprob for i in range(p + 1, p + m)])
    return {
        "logprobs": [f.logprobs for f in forced],
        "greedy": [f.greedy for f in forced],
        "prefill_logprobs": prefill_lps,
    }


def start_engine(spec: dict[str, Any]) -> tuple[Any, float]:
    """The engine ``spec`` describes (teacher forcing installed when asked): (LLM, start s)."""
    from vllm_adaptive.bench.teacher_forcing import TeacherForcingLogitsProcessor
    from vllm_adaptive.engine.vllm_api import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_cache_gib"]))
    # gear telemetry is read with LLM.apply_model (an importable function, pickled by reference)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    t0 = time.perf_counter()
    speculative = spec.get("speculative_config")
    extra: dict[str, Any] = {}
    if speculative:
        extra = {"speculative_config": speculative, "disable_log_stats": False}
    if spec["teacher_forcing"]:
        extra["logits_processors"] = [TeacherForcingLogitsProcessor]
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=spec["enforce_eager"],
        seed=spec["seed"],
        max_model_len=spec["max_model_len"],
        additional_config=spec["additional_config"],
        **extra,
    )
    start_s = time.perf_counter() - t0
    _log(f"  engine started in {start_s:.0f} s")
    return llm, start_s


def free_running_outputs(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The first ``n`` greedy tokens of every prompt, all prompts in one batch (untimed)."""
    _, _, tokens = timed_generate(llm, prompts, n, tag="fr")
    return tokens


def quality(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """What is measured once per engine: teacher-forced streams, free-running greedy outputs."""
    out: dict[str, Any] = {}
    if spec["teacher_forcing"]:
        out["teacher_forced"] = measure_teacher_forced(llm, spec["streams"])
    if spec.get("free_running_tokens"):
        t0 = time.perf_counter()
        out["free_running_outputs"] = free_running_outputs(
            llm, spec["prompts"], spec["free_running_tokens"]
        )
        _log(
            f"  free-running: {len(spec['prompts'])} prompts x {spec['free_running_tokens']} "
            f"greedy tokens in {time.perf_counter() - t0:.1f} s"
        )
    return out


def finish(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """What is read at the end of an engine's life: telemetry, memory, kernel dispatch."""
    from vllm_adaptive.bench.dispatch import collect_dispatch

    out: dict[str, Any] = {}
    if spec.get("speculative_config"):
        out["speculation"] = speculation_metrics(llm)
    if spec["additional_config"]:
        out["gears"] = collect_gear_telemetry(llm)
        out["depth"] = collect_depth_telemetry(llm)
    out.update(collect_dispatch(llm))
    out["memory"] = collect_memory(llm)
    return out


def run(spec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """One engine, every measurement once (the speculation bench's engine)."""
    from vllm_adaptive.bench.cputime import engine_pids

    llm, start_s = start_engine(spec)
    pids = engine_pids(llm)
    out: dict[str, Any] = {"engine_start_s": start_s, "pids": pids}
    out.update(
        measure_throughput(
            llm, spec["prompts"], spec["batch_sizes"], spec["max_tokens"], spec["repeats"], pids
        )
    )
    if spec.get("greedy_outputs"):
        out["greedy_outputs"] = greedy_outputs(llm, spec["prompts"], spec["max_tokens"])
    out.update(quality(llm, spec))
    out.update(finish(llm, spec))
    return out, llm


def serve(spec: dict[str, Any], reply_fd: int) -> Any:
    """Keep one engine alive and answer the harness's commands, one JSON object per line on
    stdin, each answered by one JSON line on ``reply_fd`` (vLLM logs to stdout, so replies get
    a pipe of their own). Commands: ``warmup``, ``measure`` (``batch``), ``quality``,
    ``finish``, ``stop``. The first line written is ``{"ready": ...}`` once the engine runs."""
    from vllm_adaptive.bench.cputime import engine_pids

    reply = os.fdopen(reply_fd, "w", buffering=1)

    def send(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    llm, start_s = start_engine(spec)
    pids = engine_pids(llm)
    send({"ready": True, "engine_start_s": start_s, "pids": pids})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        name = cmd.get("cmd")
        try:
            if name == "warmup":
                warmup(llm, spec["prompts"], spec["batch_sizes"])
                send({"ok": True})
            elif name == "measure":
                b = int(cmd["batch"])
                send(
                    measure_batch(
                        llm, spec["prompts"], b, spec["max_tokens"], spec["repeats"], pids
                    )
                )
            elif name == "quality":
                send(quality(llm, spec))
            elif name == "finish":
                send(finish(llm, spec))
            elif name == "stop":
                send({"ok": True})
                break
            else:
                send({"error": f"unknown command {name!r}"})
        except Exception as e:  # noqa: BLE001 - reported to the harness, which stops the bench
            import traceback

            traceback.print_exc()
            send({"error": f"{type(e).__name__}: {e}"})
    reply.close()
    return llm


def collect_memory(llm: Any) -> dict[str, Any]:
    """Peak and current resident memory of the process(es) holding the model and KV cache,
    read after every measurement of this engine (VmHWM is the peak over the process's life).

    vLLM runs the engine core in a child process unless VLLM_ENABLE_V1_MULTIPROCESSING=0
    (the harness leaves the default), so the reading is taken inside each worker through
    `LLM.apply_model`; this process's own figures are kept apart as `frontend`."""
    from vllm_adaptive.bench.memory import engine_memory, process_memory, read_proc_status

    frontend = {"pid": os.getpid(), **read_proc_status()}
    try:
        workers = llm.apply_model(process_memory)
    except Exception as e:  # noqa: BLE001 - a missing reading must not lose the measurements
        _log(f"  warning: worker memory not readable ({type(e).__name__}: {e})")
        return {"error": f"{type(e).__name__}: {e}", "frontend": frontend}
    mem = engine_memory(workers, frontend)
    where = "engine core in a child process" if mem["engine_core_in_child"] else "in process"
    _log(
        f"  memory: peak {mem['peak_mb']:.0f} MB, now {mem['rss_after_mb']:.0f} MB ({where}), "
        f"parameters {mem['param_bytes'] / 2**20:.0f} MB"
    )
    return mem


def collect_depth_telemetry(llm: Any) -> dict[str, Any] | None:
    """The depth runtime's engine counters and per-request records (None without depth)."""
    from vllm_adaptive.introspection import depth_telemetry

    tel = llm.apply_model(depth_telemetry)[0]
    if tel is None:
        return None
    out = {"engine": tel["engine"], "requests": {r["tag"]: r for r in tel["finished"]}}
    if tel.get("fusion_events") is not None:
        out["fusion_events"] = tel["fusion_events"]
    return out


def collect_gear_telemetry(llm: Any) -> dict[str, Any] | None:
    """The precision controller's per-request records (None without gears)."""
    from vllm_adaptive.introspection import gear_telemetry

    tel = llm.apply_model(gear_telemetry)[0]
    if tel is None:
        return None
    records = {}
    for rec in tel["finished"] + tel["live"]:
        records[rec["tag"]] = rec  # live slots of finished requests repeat them
    tel["requests"] = records
    del tel["finished"], tel["live"]
    return tel


def _leave(llm: Any) -> None:
    # vLLM's CPU engine sometimes aborts during interpreter teardown
    # ("terminate called without an active exception"); the measurements are
    # already delivered, so stop the engine explicitly and leave without teardown.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    if sys.argv[1] == "--serve":
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        _leave(serve(spec, int(sys.argv[3])))
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    result, llm = run(spec)
    tmp = out_path + ".partial"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)  # the result exists only once it is complete
    _leave(llm)


if __name__ == "__main__":
    main()
