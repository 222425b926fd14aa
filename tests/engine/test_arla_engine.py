"""M2R2's ARLA router as an exit signal, through one real float32 engine with a random
exit-mode adapter whose first router never exits and second always does. Every generated token
is checked against the plain-torch M2R2 reference in transformers: the first decode token is the
accelerated stream's readout at the second gate (its context has full-depth slow K/V, so the
reference is exact), later tokens the calibrated readout at the depth cap it set, which also
shows that the cache holds the slow stream's K/V where the accelerated one ran (negative
control: a fault-injected engine that leaves the accelerated K/V in the cache deviates).
Requests with exits off in the same batch produce stock vLLM's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support import workloads
from tests.support.engines import make_llm, shutdown
from vllm_adaptive.artifacts import model_fingerprint
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.m2r2.adapters import AdapterConfig, M2R2Adapters

EXIT_PROMPTS, OFF_PROMPTS = workloads.ARLA_EXIT_PROMPTS, workloads.ARLA_OFF_PROMPTS
N_NEW = workloads.ARLA_NEW_TOKENS

GATES = [4, 10]  # probe layers of the `depth_profile` fixture (every 2 layers)
ADAPTER_SCALE = 0.5  # random up-projections: accelerated logprobs move by 0.1-1 nats at gate 10
TOL = 2e-3  # float32 logprobs, vLLM's CPU kernels vs transformers
TOP = 5  # logprobs compared per token


@pytest.fixture(scope="module")
def arla_adapter(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Exit-mode adapter at gates 4 and 10 with random deltas; router 0 never exits (its
    accelerated stream is computed and dropped), router 1 always does."""
    cfg = AdapterConfig.from_model_config(
        json.loads((model_dir / "config.json").read_text()), mode="exit", gates=GATES, rank=4
    )
    ad = M2R2Adapters.zeros(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in ad.named_parameters():
            if name.startswith("layers.") and name.endswith(("q_B", "o_B", "mlp_U")):
                t.copy_(torch.randn(t.shape, generator=g) * ADAPTER_SCALE)
        for router, bias in zip(ad.routers, (-30.0, 30.0), strict=True):
            router.head_out.weight.zero_()
            router.head_out.bias.fill_(bias)
    out = tmp_path_factory.mktemp("arla") / "adapter"
    ad.save(out, {"model_fingerprint": model_fingerprint(model_dir)})
    return out, ad.eval()


def _leave_accelerated_kv(model) -> bool:
    """Fault injection for the negative control, run in the worker (``LLM.apply_model``):
    after each step put back the K/V the accelerated stream wrote into its rows' cache blocks,
    i.e. the cache as if the stream had run after the slow one."""
    runtime = model.depth
    accel, run, peel = runtime.accelerated, runtime.accelerated.run, runtime._peel
    saved: list = []

    def late_run(layers, ctx, md, sched_args, gate_index, rows, positions, slots, stream):
        stash = run(layers, ctx, md, sched_args, gate_index, rows, positions, slots, stream)
        start, stop = accel.intervals[gate_index]
        for i in range(start, stop):
            kv = layers[i].attn.kv_cache  # the model interface's LayerParts
            cache = kv[0] if isinstance(kv, (list, tuple)) else kv  # [blocks, 2, block size, ..]
            blocks = torch.unique(slots.long() // cache.shape[2])
            saved.append((cache, blocks, cache[blocks].clone()))
        return stash

    def late_peel(*args, **kwargs):
        saved.clear()
        try:
            return peel(*args, **kwargs)
        finally:
            for cache, blocks, data in saved:  # a decode row writes one slot per block
                cache[blocks] = data
            saved.clear()

    accel.run = late_run
    runtime._peel = late_peel
    return True


@pytest.fixture(scope="module")
def arla_run(model_dir: Path, depth_profile: Path, arla_adapter) -> dict:
    """One engine, one batch (exiting and exits-off requests together); the engine is shut
    down before the checks."""
    from vllm import SamplingParams

    from vllm_adaptive.introspection import depth_telemetry

    depth = {
        "profile": str(depth_profile),
        "floor": None,  # the first decode token may exit
        "signal": {"policy": "arla", "arla": {"adapter": str(arla_adapter[0])}},
    }
    llm = make_llm(model_dir, {"adaptive": {"depth": depth}}, dtype="float32")
    try:
        before = llm.apply_model(depth_telemetry)[0]["engine"]
        on = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=TOP)
        off = SamplingParams(
            temperature=0.0,
            max_tokens=N_NEW,
            ignore_eos=True,
            extra_args={"adaptive_depth_budget": 1.0},
        )
        params = [on] * len(EXIT_PROMPTS) + [off] * len(OFF_PROMPTS)
        outs = llm.generate(EXIT_PROMPTS + OFF_PROMPTS, params, use_tqdm=False)
        after = llm.apply_model(depth_telemetry)[0]["engine"]
        # negative control: the same exiting requests with the accelerated K/V left in the cache
        assert llm.apply_model(_leave_accelerated_kv)[0]
        control = llm.generate(EXIT_PROMPTS, on, use_tqdm=False)
    finally:
        shutdown(llm)
    return {"runs": _runs(outs), "control": _runs(control), "before": before, "after": after}


def _runs(outs) -> list[dict]:
    runs = []
    for o in outs:
        c = o.outputs[0]
        lps = None
        if c.logprobs is not None:  # per step {token: logprob}: the sampled one and the top 5
            lps = [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]
        runs.append({"prompt": list(o.prompt_token_ids), "tokens": list(c.token_ids), "lp": lps})
    return runs


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _check_token(lp_ref: torch.Tensor, token: int, lp_engine: dict, where: str) -> None:
    """The engine's token is the reference's argmax (up to float32 ties), and its top
    logprobs are the reference's."""
    assert float(lp_ref[token]) >= float(lp_ref.max()) - TOL, (where, token, int(lp_ref.argmax()))
    assert token in lp_engine and len(lp_engine) >= TOP, (where, lp_engine)
    for t, lp in lp_engine.items():
        assert abs(float(lp_ref[t]) - lp) < TOL, (where, t, float(lp_ref[t]), lp)


def _distance(lp_ref: torch.Tensor, lp_engine: dict) -> float:
    return max(abs(float(lp_ref[t]) - lp) for t, lp in lp_engine.items())


@torch.no_grad()
def test_first_decode_token_is_the_accelerated_readout(
    arla_run: dict, arla_adapter, hf_model, depth_profile: Path, model_dir: Path
) -> None:
    from vllm_adaptive.m2r2.reference import accelerated_stream, readout, slow_forward

    adapters = arla_adapter[1]
    prof = ExitProfile.load(depth_profile, model_dir)
    gate_probe = prof.probe_layers.index(GATES[1])
    for k, run in enumerate(arla_run["runs"][: len(EXIT_PROMPTS)]):
        t1, t2 = run["tokens"][:2]
        slow = slow_forward(hf_model, torch.tensor([run["prompt"] + [t1]]))
        assert t1 == int(slow.greedy[0, -2])  # the prefill ran every layer
        p_gate = accelerated_stream(hf_model, adapters, slow, GATES[0], GATES[1])[-1][0, -1]
        lp = readout(hf_model, p_gate).log_softmax(-1)
        _check_token(lp, t2, run["lp"][1], f"prompt {k}")
        # not what the runtime would emit without the accelerated stream or without adapters
        h = slow.hidden[GATES[1]][0, -1]
        calibrated = _calibrated_logprobs(hf_model, prof, gate_probe, h)
        plain = accelerated_stream(hf_model, None, slow, GATES[0], GATES[1])[-1][0, -1]
        for other in (calibrated, readout(hf_model, plain).log_softmax(-1)):
            assert _distance(other, run["lp"][1]) > 25 * TOL, k


def _calibrated_logprobs(model, prof: ExitProfile, probe: int, h: torch.Tensor) -> torch.Tensor:
    """The runtime's readout at a probe (a_l * RMSNorm(h) + b_l), through the LM head."""
    eps = float(model.model.norm.variance_epsilon)
    x = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
    return model.lm_head(x * prof.norm_a[probe] + prof.norm_b[probe]).log_softmax(-1)


@torch.no_grad()
def test_later_tokens_see_the_slow_kv_where_the_accelerated_stream_ran(
    arla_run: dict, hf_model, depth_profile: Path, model_dir: Path
) -> None:
    """After the ARLA exit at gate 10 the monotone cap keeps every later token at 10 layers
    (calibrated readout, no more ARLA exits: a capped row is no candidate), and each of them
    also ran the gate-4 interval's accelerated stream. The reference gives every earlier
    position the slow stream's K/V, so a cache left holding accelerated K/V (the stream run
    after the slow one instead of before) would move these logprobs."""
    from vllm_adaptive.m2r2.reference import slow_forward

    prof = ExitProfile.load(depth_profile, model_dir)
    probe = prof.probe_layers.index(GATES[1])

    def later(run: dict):  # (reference logprobs, engine logprobs, token) of tokens 2..
        toks, P = run["tokens"], len(run["prompt"])
        slow = slow_forward(hf_model, torch.tensor([run["prompt"] + toks[:-1]]), greedy=False)
        for i in range(2, len(toks)):  # token i comes from position P + i - 1
            h = slow.hidden[GATES[1]][0, P + i - 1]
            yield _calibrated_logprobs(hf_model, prof, probe, h), run["lp"][i], toks[i]

    for k, run in enumerate(arla_run["runs"][: len(EXIT_PROMPTS)]):
        for i, (lp, lp_engine, token) in enumerate(later(run), start=2):
            _check_token(lp, token, lp_engine, f"prompt {k} token {i}")
    # the control left the accelerated stream's K/V in the cache: the check above would fail
    worst = 0.0
    runs = arla_run["runs"][: len(EXIT_PROMPTS)]
    for run, ctl in zip(runs, arla_run["control"], strict=True):
        a, b = run["lp"][1], ctl["lp"][1]  # the first decode token is not affected
        assert ctl["tokens"][:2] == run["tokens"][:2] and a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < TOL for t in a)
        worst = max(worst, *(_distance(lp, e) for lp, e, _ in later(ctl)))
    assert worst > 25 * TOL, worst


def test_rows_without_exits_are_stock_and_counters_moved(arla_run: dict, stock_f32: dict) -> None:
    runs, stock_ids = arla_run["runs"], stock_f32["arla_batch"]
    n_exit, n_off = len(EXIT_PROMPTS), len(OFF_PROMPTS)
    for k in range(n_exit, n_exit + n_off):
        assert runs[k]["tokens"] == stock_ids[k], k
    for k in range(n_exit):
        assert runs[k]["tokens"][0] == stock_ids[k][0]  # prefill: full depth
    before, after = arla_run["before"], arla_run["after"]
    decode = N_NEW - 1  # the first token comes from the prefill

    def delta(key: str) -> int:
        return after[key] - before[key]

    assert after["signal"] == ["arla"]
    assert delta("arla_exits") == n_exit  # the first decode token of each exiting request
    # that token ran both intervals; later ones (capped at 10) only the gate-4 interval
    assert delta("accelerated_rows") == n_exit * (2 + (decode - 1))
    assert delta("accelerated_token_layers") == n_exit * (4 + 6 + 4 * (decode - 1))
    hist = {
        d: after["exit_tokens"].get(d, 0) - before["exit_tokens"].get(d, 0) for d in ("10", "30")
    }
    assert hist == {"10": n_exit * decode, "30": n_off * decode}
