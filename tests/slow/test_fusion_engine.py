"""Contextual token fusion inside a real engine (issue 20, docs/token-fusion.md): float32,
kv_strategy mask, exits off (budget 1.0) so that fusion is the only thing that differs from
stock. The suite's engine arguments give chunked prefill (256-token chunks), prefix hits and
preemption (a 12-block cache).

(a) fusion on with thresholds that fuse nothing is token-identical to stock; (b) the KV audit
(every slot a query reads at layer j was written at layer j: unwritten slots are poisoned with
NaN for the call) stays clean with fused prefills, and fails when the fused members' slots are
not masked; (c) a fused prefill's greedy continuation and its logprobs equal the plain-torch
reference `fusion_reference.fused_forward` on the same prompt and rules, with the same groups;
(d) a preempted request resumes without fusion, counted; (e) a prefix-cache hit on fused blocks
and another chunk size (128) give the same continuation.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from tests.support import kv_strategies as kv
from tests.support.depth_probe import audit_report, install_mask_audit, reset_nan_outputs
from tests.support.engines import make_llm, metric, shutdown
from tests.support.fusion import (
    fusion_telemetry,
    reset_fusion_events,
    restore_masking_fused_slots,
    set_fusion_taus,
    stop_masking_fused_slots,
    write_fusion_profile,
)
from tests.support.workloads import spec_mixed

pytestmark = pytest.mark.slow

#: fuse a few percent of the prompt rows on this model (the calibrated profile's taus are
#: 85.8 / 100.5 / 124.2, docs/token-fusion.md; a little higher so that every prompt fuses)
TAUS = {10: 100.0, 15: 112.0, 20: 135.0}
NOTHING = {10: 1e-6, 15: 1e-6, 20: 1e-6}
#: float32 engine against float32 plain torch: summation order differs, nothing else (unfused,
#: the two agree to about 1e-5 on this prompt)
LOGPROB_TOL = 1e-4

PROSE = (
    "The lighthouse stood at the end of a long stone pier, and every evening the keeper climbed "
    "the narrow stairs to light the lamp. He had done this for thirty years, through storms and "
    "calm nights alike, and he knew every step by heart. The villagers said that he never "
    "missed a single night, not even when the fever came to the village and half the fishermen "
    "stayed in bed. One winter a ship"
)


@pytest.fixture(scope="module")
def fusion_dir(model_dir: Path, tmp_path_factory) -> Path:
    return write_fusion_profile(tmp_path_factory.mktemp("fusion") / "profile", model_dir, TAUS)


def _depth(depth_profile: Path, fusion_dir: Path) -> dict:
    return {
        "profile": str(depth_profile),
        "budget": 1.0,
        "kv_strategy": "mask",
        "fusion": {"profile": str(fusion_dir)},
    }


@pytest.fixture(scope="module")
def llm(model_dir: Path, depth_profile: Path, fusion_dir: Path):
    llm = make_llm(model_dir, {"adaptive": {"depth": _depth(depth_profile, fusion_dir)}},
                   dtype="float32")  # fmt: skip
    llm.apply_model(install_mask_audit)
    yield llm
    try:
        shutdown(llm)
    except Exception:  # test_e stops it early to start its own engine
        pass


def _stats(llm) -> dict:
    return llm.apply_model(fusion_telemetry)[0]["stats"]


def test_a_nothing_fused_is_stock(llm, stock_f32: dict) -> None:
    llm.apply_model(partial(set_fusion_taus, taus=NOTHING))
    try:
        llm.reset_prefix_cache()
        before = _stats(llm)
        got = spec_mixed(llm)
        after = _stats(llm)
    finally:
        llm.apply_model(partial(set_fusion_taus, taus=TAUS))
    assert after["rows"] > before["rows"]  # the mechanism planned fusing rows
    assert after["groups"] == before["groups"]  # and fused none
    assert got == stock_f32["spec_mixed"]


def test_b_audit_clean_with_fusion_and_fails_unmasked(llm) -> None:
    llm.reset_prefix_cache()
    moved = kv.workload(llm, 3, "fusion")
    report = llm.apply_model(audit_report)[0]
    st = _stats(llm)
    assert st["groups"] > 10 and st["removed_token_layers"] > 0, st
    assert report["poisoned"] > 1000, report  # fused members' slots were in attended ranges
    assert report["nan_outputs"] == 0, report["first_nan_layers"]
    assert moved["preemptions"] > 0 and moved["prefix_hits"] > 0
    # negative control: the same fusion with the members' slots not masked reads the poison
    llm.apply_model(stop_masking_fused_slots)
    try:
        llm.reset_prefix_cache()
        llm.generate([PROSE + " " + PROSE], kv.params(8), use_tqdm=False)
        bad = llm.apply_model(audit_report)[0]
    finally:
        llm.apply_model(restore_masking_fused_slots)
        llm.apply_model(reset_nan_outputs)
    assert bad["nan_outputs"] > 0


def _reference(model_dir: Path, fusion_dir: Path, ids: list[int], prompt_len: int):
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_adaptive.depth.calibration.fusion import load_fusion_profile
    from vllm_adaptive.depth.calibration.fusion_reference import fused_forward

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()
    prof = load_fusion_profile(fusion_dir, model_dir)
    exempt = prof.exemptions.mask(ids[:prompt_len])
    return fused_forward(model, ids, prompt_len, prof.rules, exempt=exempt)


def test_c_matches_the_reference_forward(llm, model_dir: Path, fusion_dir: Path) -> None:
    llm.reset_prefix_cache()
    llm.apply_model(reset_fusion_events)
    out = llm.generate([PROSE], kv.params(24, logprobs=1, tag="ref"), use_tqdm=False)[0]
    prompt = list(out.prompt_token_ids)
    assert len(prompt) < 128  # one chunk, one KV block: the reference cuts no groups
    gen = list(out.outputs[0].token_ids)
    engine_lp = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen, strict=True)]
    events = llm.apply_model(fusion_telemetry)[0]["events"]
    run = _reference(model_dir, fusion_dir, prompt + gen, len(prompt))
    ref_events = sorted((e.layer, e.first_token, e.last_token) for e in run.events)
    got_events = sorted((e["layer"], e["first"], e["last"]) for e in events if e["tag"] == "ref")
    assert ref_events, "the reference fused nothing on this prompt: raise TAUS"
    assert got_events == ref_events
    # the engine's greedy tokens are the reference's argmax under teacher forcing, and the
    # log-probabilities agree to float32 summation noise
    assert run.argmax.tolist()[: len(gen)] == gen
    diffs = [abs(a + float(b)) for a, b in zip(engine_lp, run.nll.tolist(), strict=True)]
    assert max(diffs) < LOGPROB_TOL, max(diffs)
    # and fusion changed something: the unfused reference's log-probabilities differ
    plain = _reference_plain(model_dir, prompt + gen, len(prompt))
    assert max(abs(a - b) for a, b in zip(run.nll.tolist(), plain, strict=True)) > 1e-3


def _reference_plain(model_dir: Path, ids: list[int], prompt_len: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_adaptive.depth.calibration.fusion_reference import fused_forward

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    return fused_forward(model.eval(), ids, prompt_len, {}).nll.tolist()


def test_d_preempted_requests_resume_unfused(llm) -> None:
    p0 = metric(llm, "vllm:num_preemptions")
    before = _stats(llm)
    prompts = [f"Part {k}. " + PROSE for k in range(5)]
    outs = llm.generate(prompts, [kv.params(300) for _ in prompts], use_tqdm=False)
    st = _stats(llm)
    report = llm.apply_model(audit_report)[0]
    assert metric(llm, "vllm:num_preemptions") - p0 > 0
    assert st["resumed_requests"] > before["resumed_requests"]
    assert st["resumed_prefills"] - before["resumed_prefills"] >= 1
    assert st["groups"] > before["groups"]
    assert report["nan_outputs"] == 0
    assert all(len(o.outputs[0].token_ids) == 300 for o in outs)


LONG = " ".join([PROSE] * 6)  # about 560 tokens: 3 chunks of 256, 5 KV blocks


def _long_run(llm) -> list[int]:
    return list(llm.generate([LONG], kv.params(24), use_tqdm=False)[0].outputs[0].token_ids)


def test_e_prefix_hit_and_chunk_sizes(llm, model_dir, depth_profile, fusion_dir) -> None:
    llm.reset_prefix_cache()
    hits0 = metric(llm, "vllm:prefix_cache_hits")
    first = _long_run(llm)
    again = _long_run(llm)  # prefix-cache hit on the fused blocks
    assert metric(llm, "vllm:prefix_cache_hits") - hits0 >= 256
    assert again == first
    report = llm.apply_model(audit_report)[0]
    assert report["nan_outputs"] == 0
    shutdown(llm)  # one engine at a time on this machine
    other = make_llm(model_dir, {"adaptive": {"depth": _depth(depth_profile, fusion_dir)}},
                     dtype="float32", max_num_batched_tokens=128)  # fmt: skip
    try:
        other.apply_model(install_mask_audit)
        got = _long_run(other)
        st = other.apply_model(fusion_telemetry)[0]["stats"]
        assert other.apply_model(audit_report)[0]["nan_outputs"] == 0
    finally:
        shutdown(other)
    assert st["groups"] > 0
    assert got == first
