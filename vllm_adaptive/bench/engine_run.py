"""One engine's measurements, run in its own process by the harness.

Usage (internal): python -m vllm_adaptive.bench.engine_run SPEC.json OUT.json

Each engine gets a fresh process so that engines never share memory, caches
or threads, and a crash in one config is reported instead of taking down the
whole benchmark.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _generate(llm: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def measure_throughput(
    llm: Any, prompts: list[list[int]], batch_sizes: list[int], max_tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Decode tokens/s, TTFT and mean inter-token latency per batch size.

    Prefill time is measured by the same batch with max_tokens=1; decode time
    is the rest of a max_tokens run. The prefix cache is reset before every
    timed call so that no call reuses another's prefill.
    """
    from vllm import SamplingParams

    def timed(batch: list[list[int]], n: int) -> float:
        llm.reset_prefix_cache()
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=n,
                ignore_eos=True,
                detokenize=False,
                extra_args={"adaptive_request_tag": f"tp-b{len(batch)}-n{n}-{j}"},
            )
            for j in range(len(batch))
        ]
        t0 = time.perf_counter()
        outs = _generate(llm, batch, params)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return dt

    timed(prompts[: max(batch_sizes)], 4)  # warm-up: allocator, kernels, caches
    result: dict[str, dict[str, float]] = {"decode_tokens_per_s": {}, "ttft_s": {}, "itl_s": {}}
    for b in batch_sizes:
        batch = prompts[:b]
        best_rate, best = 0.0, (0.0, 0.0)
        for _ in range(repeats):
            prefill = timed(batch, 1)
            full = timed(batch, max_tokens)
            decode = max(full - prefill, 1e-9)
            rate = b * (max_tokens - 1) / decode
            if rate > best_rate:
                best_rate, best = rate, (prefill, decode / (max_tokens - 1))
        result["decode_tokens_per_s"][str(b)] = best_rate
        result["ttft_s"][str(b)] = best[0]
        result["itl_s"][str(b)] = best[1]
        _log(
            f"  batch {b:>3}: {best_rate:8.1f} decode tok/s, ttft {best[0] * 1e3:7.1f} ms, "
            f"itl {best[1] * 1e3:6.1f} ms"
        )
    return result


def greedy_outputs(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt in one batch (speculation must not change them)."""
    from vllm import SamplingParams

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
    from vllm import SamplingParams

    from vllm_adaptive.bench.teacher_forcing import FORCE_KEY, read_forced_output

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


def run(spec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    from vllm import LLM

    from vllm_adaptive.bench.teacher_forcing import TeacherForcingLogitsProcessor

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
    out: dict[str, Any] = {"engine_start_s": start_s}
    out.update(
        measure_throughput(
            llm, spec["prompts"], spec["batch_sizes"], spec["max_tokens"], spec["repeats"]
        )
    )
    if spec.get("greedy_outputs"):
        out["greedy_outputs"] = greedy_outputs(llm, spec["prompts"], spec["max_tokens"])
    if speculative:
        out["speculation"] = speculation_metrics(llm)
    if spec["teacher_forcing"]:
        out["teacher_forced"] = measure_teacher_forced(llm, spec["streams"])
    if spec["additional_config"]:
        out["gears"] = collect_gear_telemetry(llm)
        out["depth"] = collect_depth_telemetry(llm)
    out["memory"] = collect_memory(llm)
    return out, llm


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
    return {"engine": tel["engine"], "requests": {r["tag"]: r for r in tel["finished"]}}


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


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    result, llm = run(spec)
    tmp = out_path + ".partial"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)  # the result exists only once it is complete
    # vLLM's CPU engine sometimes aborts during interpreter teardown
    # ("terminate called without an active exception"); the measurements are
    # already on disk, so stop the engine explicitly and leave without teardown.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
