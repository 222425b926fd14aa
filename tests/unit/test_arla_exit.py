"""M2R2's ARLA router as an exit signal of the depth engine (`policies/arla.py`, the accelerated
stream in `depth/accelerated.py`).

Unit tests: the config and its refusals, the adapter checks at build time, the policy on
hand-made states. The engine tests are in tests/engine/test_arla_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_adaptive.artifacts import Profile, model_fingerprint, save_profile
from vllm_adaptive.config import AdaptiveConfigError, SignalConfig, parse_adaptive_config
from vllm_adaptive.depth.accelerated import AcceleratedStash, AcceleratedStream
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.policies.arla import ArlaExitSignal
from vllm_adaptive.depth.policies.build import build_exit_signal, load_arla_adapters
from vllm_adaptive.depth.policies.probe import ProbeBatch
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
    signal = {"policy": "arla", "arla": {"adapter": str(adapter)}}

    river = DepthConfig.model_validate({"profile": "p", "signal": signal, "kv_strategy": "river"})
    with pytest.raises(ValueError, match='"arla" cannot run with adaptive.depth.kv_strategy'):
        DepthRuntime(None, river, prof, None, str(model), torch.float32)
    mono = DepthConfig.model_validate({"profile": "p", "signal": signal})
    with pytest.raises(ValueError, match=r"gates \[2, 4\] of \[2, 4\] are not probe layers"):
        DepthRuntime(None, mono, prof, None, str(model), torch.float32)


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
