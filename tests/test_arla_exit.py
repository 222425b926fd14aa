"""M2R2's ARLA router as an exit signal of the depth engine (`policies/arla.py`, the accelerated
stream in `depth/accelerated.py`).

Unit tests: the config and its refusals, the adapter checks at build time, the policy on
hand-made states. The engine tests (marked ``engine``) run one float32 engine with a random
exit-mode adapter whose first router never exits and second always does, and check every
generated token against the plain-torch M2R2 reference in transformers: the first decode token
is the accelerated stream's readout at the second gate (its context has full-depth slow K/V,
so the reference is exact), later tokens the calibrated readout at the depth cap it set, which
also shows that the cache holds the slow stream's K/V where the accelerated one ran. Requests
with exits off in the same batch produce stock vLLM's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from vllm_adaptive.config import AdaptiveConfigError, SignalConfig, parse_adaptive_config
from vllm_adaptive.depth.accelerated import AcceleratedStash, AcceleratedStream
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.policies.arla import ArlaExitSignal
from vllm_adaptive.depth.policies.build import build_exit_signal, load_arla_adapters
from vllm_adaptive.depth.policies.probe import ProbeBatch
from vllm_adaptive.depth.profile import Profile, model_fingerprint, save_profile
from vllm_adaptive.m2r2.adapters import AdapterConfig, M2R2Adapters

D, LAYERS, VOCAB = 8, 6, 20


# -- config -----------------------------------------------------------------------------------


def _signal(signal: dict) -> SignalConfig:
    return parse_adaptive_config({"depth": {"profile": "p", "signal": signal}}).depth.signal


def test_arla_config_defaults() -> None:
    sig = _signal({"policy": "arla", "arla": {"adapter": "/a"}})
    assert sig.policy == ("arla",) and sig.arla.adapter == "/a" and sig.arla.threshold == 0.5
    assert _signal({"policy": "arla", "arla": {"adapter": "/a", "threshold": 0.9}}).arla.threshold
    assert SignalConfig().arla is None  # other signals are untouched


@pytest.mark.parametrize(
    ("signal", "needle"),
    [
        ({"policy": "arla"}, 'policy "arla" needs "arla": {"adapter": DIR}'),
        ({"policy": "arla", "arla": {}}, "adaptive.depth.signal.arla.adapter: Field required"),
        ({"policy": "arla", "arla": {"adapter": ""}}, "adaptive.depth.signal.arla.adapter"),
        ({"policy": "arla", "arla": {"adapter": "a", "threshold": 0.0}},
         "adaptive.depth.signal.arla.threshold"),
        ({"policy": "arla", "arla": {"adapter": "a", "threshold": 1.0}},
         "adaptive.depth.signal.arla.threshold"),
        ({"policy": "arla", "arla": {"adapter": "a", "bogus": 1}},
         "adaptive.depth.signal.arla.bogus: unknown key"),
        ({"policy": "emad", "arla": {"adapter": "a"}},
         '"arla" settings given but "policy" does not use arla'),
        ({"policy": ["emad", "arla"], "arla": {"adapter": "a"}},
         '"arla" cannot be combined with other signals'),
    ],
)  # fmt: skip
def test_bad_arla_config_names_the_key(signal: dict, needle: str) -> None:
    with pytest.raises(AdaptiveConfigError) as err:
        _signal(signal)
    assert needle in str(err.value)


# -- building: the adapter against the model and the profile -----------------------------------


def _fake_model(tmp: Path, layers: int = LAYERS) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = {"vocab_size": VOCAB, "hidden_size": D, "num_hidden_layers": layers,
           "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file(
        {"model.norm.weight": torch.ones(D), "lm_head.weight": torch.randn(VOCAB, D)},
        str(tmp / "model.safetensors"),
    )
    return tmp


def _fake_profile(tmp: Path, model: Path, probes: list[int]) -> ExitProfile:
    P = len(probes)
    meta = {"probe_layers": probes, "num_layers": LAYERS, "budget": 0.6, "budget_kind": "layers"}
    tensors = {
        "norm_a": torch.ones(P, D),
        "norm_b": torch.zeros(P, D),
        "lowrank_u": torch.randn(VOCAB, 4),
        "lowrank_v": torch.randn(D, 4),
        "threshold": torch.zeros(P),
        "table_thresholds": torch.zeros(3, P),
        "table_layers_fraction": torch.tensor([1.0, 0.8, 0.5]),
        "table_flops_fraction": torch.tensor([1.0, 0.85, 0.6]),
    }
    save_profile(Profile(meta=meta, tensors=tensors), tmp, model)
    return ExitProfile.load(tmp, model)


def _adapter(model: Path, out: Path, fingerprint_of: Path | None = None, **kw) -> Path:
    args = {"mode": "exit", "gates": [2, 4], "rank": 2, "arla_latent": 4} | kw
    cfg = AdapterConfig.from_model_config(json.loads((model / "config.json").read_text()), **args)
    meta = {"model_fingerprint": model_fingerprint(fingerprint_of or model)}
    M2R2Adapters.zeros(cfg, seed=0).save(out, meta)
    return out


def _arla_cfg(adapter: Path, threshold: float = 0.5) -> SignalConfig:
    return SignalConfig.model_validate(
        {"policy": "arla", "arla": {"adapter": str(adapter), "threshold": threshold}}
    )


def test_arla_adapter_is_checked_against_model_and_profile(tmp_path: Path) -> None:
    model = _fake_model(tmp_path / "m")
    prof = _fake_profile(tmp_path / "p", model, [1, 2, 3, 4, 5])
    good = _adapter(model, tmp_path / "good")
    adapters = load_arla_adapters(_arla_cfg(good, 0.7), prof, model)
    sig = build_exit_signal(_arla_cfg(good, 0.7), prof, arla_adapters=adapters)
    assert isinstance(sig, ArlaExitSignal) and sig.gates == (2, 4) and sig.threshold == 0.7
    assert AcceleratedStream(adapters).interval_starting_at(2) == (1, 2, 4)
    with pytest.raises(ValueError, match="needs its adapter"):
        build_exit_signal(_arla_cfg(good), prof)

    key = "adaptive.depth.signal.arla.adapter"
    spec = _adapter(model, tmp_path / "spec", mode="spec", k=2, gates=None)
    with pytest.raises(ValueError, match=f"{key}: .* --mode spec; .* needs --mode exit"):
        load_arla_adapters(_arla_cfg(spec), prof, model)
    sparse = _fake_profile(tmp_path / "p2", model, [2, 3, 5])
    with pytest.raises(ValueError, match=rf"{key}: gates \[4\] of \[2, 4\] are not probe layers"):
        load_arla_adapters(_arla_cfg(good), sparse, model)
    other = _fake_model(tmp_path / "other")  # same shapes, other weights
    foreign = _adapter(model, tmp_path / "foreign", fingerprint_of=other)
    with pytest.raises(ValueError, match=f"{key}: adapter .* was made for another model"):
        load_arla_adapters(_arla_cfg(foreign), prof, model)
    with pytest.raises(ValueError, match=f"{key}: adapter .* missing adapter.json"):
        load_arla_adapters(_arla_cfg(tmp_path / "nowhere"), prof, model)


def test_runtime_refuses_arla_with_river_and_bad_gates(tmp_path: Path) -> None:
    """The engine builds its runtime from these; `load_depth_runtime` turns the ValueError into
    an AdaptiveConfigError (tested for the other signals through a real engine)."""
    from vllm_adaptive.config import DepthConfig
    from vllm_adaptive.depth.runtime import DepthRuntime

    model = _fake_model(tmp_path / "m")
    prof = _fake_profile(tmp_path / "p", model, [1, 3, 5])
    adapter = _adapter(model, tmp_path / "a")
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(model)))
    signal = {"policy": "arla", "arla": {"adapter": str(adapter)}}

    river = DepthConfig.model_validate({"profile": "p", "signal": signal, "kv_strategy": "river"})
    with pytest.raises(ValueError, match='"arla" cannot run with adaptive.depth.kv_strategy'):
        DepthRuntime(None, river, prof, vllm_config)
    mono = DepthConfig.model_validate({"profile": "p", "signal": signal})
    with pytest.raises(ValueError, match=r"gates \[2, 4\] of \[2, 4\] are not probe layers"):
        DepthRuntime(None, mono, prof, vllm_config)


# -- the policy on hand-made states -----------------------------------------------------------


def _routers(biases: list[float], latent: int = 4) -> list:
    """Routers whose exit logit is exactly ``bias`` (output weights zero)."""
    ad = M2R2Adapters.zeros(
        AdapterConfig(mode="exit", num_layers=LAYERS, hidden_size=D, num_heads=2,
                      num_kv_heads=1, head_dim=4, rank=2, gates=[2, 4], arla_latent=latent)
    )  # fmt: skip
    with torch.no_grad():
        for r, b in zip(ad.routers, biases, strict=True):
            r.head_out.weight.zero_()
            r.head_out.bias.fill_(b)
    return list(ad.routers)


def _batch(layer: int, n: int, states: torch.Tensor | None) -> ProbeBatch:
    return ProbeBatch(layer=layer, probe=layer - 1, stream=torch.randn(n, D), accelerated=states)


def test_arla_exits_only_above_threshold() -> None:
    states = torch.randn(3, 3, D)  # gate 2: states p_0, p_1, p_2
    p = torch.sigmoid(torch.tensor(0.4)).item()
    assert ArlaExitSignal(_routers([0.4, 0.0]), [2, 4], 0.5).exit_mask(_batch(2, 3, states)).all()
    below = ArlaExitSignal(_routers([0.4, 0.0]), [2, 4], p - 1e-6)
    assert below.exit_mask(_batch(2, 3, states)).all()
    # strictly above: P(exit) equal to the threshold does not exit
    at = ArlaExitSignal(_routers([0.4, 0.0]), [2, 4], p)
    assert not at.exit_mask(_batch(2, 3, states)).any()
    assert (
        not ArlaExitSignal(_routers([0.0, 0.0]), [2, 4], 0.5).exit_mask(_batch(2, 3, states)).any()
    )
    with pytest.raises(ValueError, match=r"probability in \(0, 1\)"):
        ArlaExitSignal(_routers([0.0, 0.0]), [2, 4], 1.0)


def test_arla_decides_per_row_with_its_gates_router() -> None:
    """A real (random) router: the mask is P(exit) > threshold row by row, from router j at
    gate j, on the interval's states; rows picked by `ProbeBatch.select` keep their states."""
    ad = M2R2Adapters.zeros(
        AdapterConfig(mode="exit", num_layers=LAYERS, hidden_size=D, num_heads=2,
                      num_kv_heads=1, head_dim=4, rank=2, gates=[2, 5], arla_latent=4),
        seed=3,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    states = torch.randn(64, 4, D, generator=g)  # gate 5: p_2 .. p_5
    with torch.no_grad():
        prob = ad.routers[1].exit_probability(states)
    threshold = float(prob.median())
    sig = ArlaExitSignal(ad.routers, [2, 5], threshold)
    mask = sig.exit_mask(_batch(5, 64, states))
    assert torch.equal(mask, prob > threshold) and 0 < int(mask.sum()) < 64
    assert not torch.equal(mask, ad.routers[0].exit_probability(states) > threshold)
    idx = torch.tensor([1, 7, 30])
    assert torch.equal(sig.exit_mask(_batch(5, 64, states).select(idx)), mask[idx])
    with pytest.raises(ValueError, match=r"reads 4 states per row"):
        sig.exit_mask(_batch(5, 64, states[:, 1:]))


def test_arla_never_exits_off_its_gates() -> None:
    sig = ArlaExitSignal(_routers([50.0, 50.0]), [2, 4], 0.5)
    for layer in (1, 3, 5):  # probe layers that are no gate: no states, no exit
        assert not sig.exit_mask(_batch(layer, 4, None)).any()
    assert sig.exit_mask(_batch(4, 4, torch.randn(4, 3, D))).all()
    with pytest.raises(ValueError, match="needs the accelerated states at gate 2"):
        sig.exit_mask(_batch(2, 4, None))
    assert sig.exit_mask(_batch(2, 0, torch.zeros(0, 3, D))).numel() == 0


def test_stash_gives_the_states_of_rows_still_running() -> None:
    states = torch.arange(5.0).view(5, 1, 1).expand(5, 3, D).clone()
    stash = AcceleratedStash(0, 2, torch.tensor([1, 3, 4, 8, 9]), states)
    # rows 3 and 8 dropped out (exited elsewhere, reached their cap): the others keep theirs
    got = stash.states_for(torch.tensor([1, 4, 9]))
    assert got[:, 0, 0].tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(RuntimeError, match="no accelerated states"):
        stash.states_for(torch.tensor([2]))
    with pytest.raises(RuntimeError, match="no accelerated states"):
        stash.states_for(torch.tensor([10]))


# -- through one real engine (float32) against the transformers reference ---------------------

GATES = [4, 10]  # probe layers of the `depth_profile` fixture (every 2 layers)
N_NEW = 8
ADAPTER_SCALE = 0.5  # random up-projections: accelerated logprobs move by 0.1-1 nats at gate 10
TOL = 2e-3  # float32 logprobs, vLLM's CPU kernels vs transformers
TOP = 5  # logprobs compared per token
EXIT_PROMPTS = [
    "def quicksort(items):\n    ",
    "The history of the printing press",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\ndef softmax(x):",
]
OFF_PROMPTS = [  # exits off (budget 1.0), in the same batch; one shares an exiting prompt
    "The history of the printing press",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
]
_STOCK = r"""
import json, sys
from vllm import LLM, SamplingParams
model, prompts, n, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=1024,
          enable_prefix_caching=False)
params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
outs = llm.generate(prompts, params, use_tqdm=False)
with open(out, "w") as f:
    json.dump([list(o.outputs[0].token_ids) for o in outs], f)
"""


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


@pytest.fixture(scope="module")
def stock_ids(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Stock vLLM (plugin not loaded), float32, the same batch of prompts, greedy."""
    out = tmp_path_factory.mktemp("arla-stock") / "ids.json"
    prompts = json.dumps(EXIT_PROMPTS + OFF_PROMPTS)
    proc = subprocess.run(
        [sys.executable, "-c", _STOCK, str(model_dir), prompts, str(N_NEW), str(out)],
        env={**os.environ, "VLLM_PLUGINS": ""},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


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
            kv = layers[i].self_attn.attn.kv_cache
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
def arla_run(model_dir: Path, depth_profile: Path, arla_adapter, stock_ids) -> dict:
    """One engine, one batch (exiting and exits-off requests together); the engine is shut
    down before the checks. Started after the stock subprocess has finished."""
    from vllm import SamplingParams

    from tests.conftest import _make_llm, _shutdown
    from vllm_adaptive.introspection import depth_telemetry

    depth = {
        "profile": str(depth_profile),
        "floor": None,  # the first decode token may exit
        "signal": {"policy": "arla", "arla": {"adapter": str(arla_adapter[0])}},
    }
    llm = _make_llm(
        model_dir, {"adaptive": {"depth": depth}}, dtype="float32", enable_prefix_caching=False
    )
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
        _shutdown(llm)
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


@pytest.mark.engine
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


@pytest.mark.engine
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


@pytest.mark.engine
def test_rows_without_exits_are_stock_and_counters_moved(arla_run: dict, stock_ids) -> None:
    runs = arla_run["runs"]
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
