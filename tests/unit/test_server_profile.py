"""The served-step profile reader (`bench/server_profile.py`) on a hand-built trace whose
per-step split is known: step periods, vLLM's phases, op groups by self time, prefill steps
counted apart, and the trace file round trip."""

import gzip
import json

from vllm_adaptive.bench.server_profile import (
    find_trace,
    group_of,
    load_trace,
    self_times,
    step_profile,
)


def _ev(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 7, "tid": tid}


def _trace():
    """A prefill step at t=0 and three decode steps (batch 2) every 10 ms: execute_model 8 ms,
    in it the forward phase 6 ms holding a 3 ms fp16 GEMM under a 4 ms plugin op (so the op's
    own time is 1 ms) and a 1 ms attention op; a 0.5 ms sampling op in the sample phase."""
    evs = [_ev("execute_context_1(100)_generation_0(0)", 0, 9000, "user_annotation")]
    for k in range(3):
        t = 10_000 * (k + 1)
        evs += [
            _ev("execute_context_0(0)_generation_2(2)", t, 8000, "user_annotation"),
            _ev("gpu_model_runner: forward", t + 100, 6000, "user_annotation"),
            _ev("vllm_adaptive::geared_linear", t + 200, 4000),
            _ev("quantized::linear_dynamic_fp16", t + 300, 3000),
            _ev("_C::cpu_attention_with_kv_cache", t + 4500, 1000),
            _ev("gpu_model_runner: sample", t + 6500, 1000, "user_annotation"),
            _ev("aten::argmax", t + 6600, 500),
        ]
    evs.append(_ev("execute_context_0(0)_generation_2(2)", 40_000, 8000, "user_annotation"))
    evs.append(_ev("unrelated thread op", 10_500, 99_000, tid=2))
    return evs


def test_self_time_subtracts_direct_children_only():
    got = {e["name"]: s for e, s in self_times(_trace()[:5]) if e["ts"] < 20_000}
    assert got["vllm_adaptive::geared_linear"] == 1000
    assert got["quantized::linear_dynamic_fp16"] == 3000
    assert got["gpu_model_runner: forward"] == 6000 - 4000


def test_decode_step_split():
    prof = step_profile(_trace())
    assert prof["decode_steps"] == 3  # the last step has no successor: no period
    assert prof["prefill_steps"] == 1
    assert prof["batch_median"] == 2
    assert prof["step_ms"] == 10.0
    ms = prof["ms_per_step"]
    assert ms["execute_model"] == 8.0
    assert ms["outside execute_model (scheduler, IPC, output)"] == 2.0
    assert ms["phase forward"] == 6.0 and ms["phase sample"] == 1.0
    assert ms["GEMM"] == 3.0
    assert ms["plugin custom ops (own Python)"] == 1.0
    assert ms["attention"] == 1.0
    assert ms["sampling ops"] == 0.5
    assert ms["all ops"] == 5.5
    # forward's own 1 ms and sample's own 0.5 ms: runner code between ops
    assert ms["runner Python (annotated ranges' own time)"] == 1.5
    assert list(prof["top_ops_ms_per_step"])[0] == "quantized::linear_dynamic_fp16"


def test_too_few_steps_is_an_error_not_a_figure():
    assert "error" in step_profile([_ev("aten::mm", 0, 10)])


def test_groups():
    assert group_of("quantized::linear_dynamic_fp16") == "GEMM"
    assert group_of("vllm_adaptive::geared_linear") == "plugin custom ops (own Python)"
    assert group_of("vllm_adaptive_native::fp16_linear") == "GEMM"
    assert group_of("vllm_adaptive_native::masked_decode") == "attention"
    assert group_of("Torch-Compiled Region: 0/0") == "compiled graph (inductor kernels)"
    assert group_of("aten::add") == "other ops"


def test_trace_file_round_trip(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    small = d / "front.pt.trace.json.gz"
    big = d / "engine.pt.trace.json.gz"
    with gzip.open(small, "wt") as f:
        json.dump({"traceEvents": []}, f)
    with gzip.open(big, "wt") as f:
        json.dump({"traceEvents": [*_trace(), {"ph": "i", "name": "marker", "ts": 0}]}, f)
    assert find_trace(d) == big
    assert step_profile(load_trace(big))["step_ms"] == 10.0
