"""Exit signals (QuickSilver halting, River similarity, combinations): rules on synthetic
tensors, config errors, the profile keys, the simulator, and one real calibration run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vllm_adaptive.artifacts import Profile, ProfileError, save_profile
from vllm_adaptive.config import AdaptiveConfigError, SignalConfig, parse_adaptive_config
from vllm_adaptive.depth.calibration.budget import SimData, simulate, simulate_mask
from vllm_adaptive.depth.calibration.quicksilver import (
    QuickSilverCalibration,
    calibrate_quicksilver,
    quicksilver_passes,
)
from vllm_adaptive.depth.calibration.river import RiverCalibration, calibrate_river, river_passes
from vllm_adaptive.depth.calibration.signal_arrays import SignalArrays
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.policies.build import build_exit_signal
from vllm_adaptive.depth.policies.combine import CombinedExitSignal
from vllm_adaptive.depth.policies.emad import EmadExitSignal
from vllm_adaptive.depth.policies.probe import ProbeBatch
from vllm_adaptive.depth.policies.quicksilver import QuickSilverExitSignal, halting_rule
from vllm_adaptive.depth.policies.river import RiverExitSignal
from vllm_adaptive.flops import DenseShape

D = 8


def _qs_batch(layer, drift, entropy, ids, forced=None) -> ProbeBatch:
    """Rows whose drift and (readout) entropy are exactly the given numbers: the readout is
    the identity and the test's entropy function reads coordinate 0."""
    n = len(drift)
    stream = torch.zeros(n, D)
    stream[:, 0] = torch.tensor(entropy, dtype=torch.float32)
    prev = stream.clone()
    prev[:, -1] -= torch.tensor(drift, dtype=torch.float32)
    return ProbeBatch(
        layer=layer,
        probe=layer - 1,
        stream=stream,
        prev_stream=prev,
        token_ids=torch.tensor(ids),
        readout=lambda h: h,
        forced_halt=None if forced is None else torch.tensor(forced),
    )


class _Entropy:
    """Coordinate 0 as the entropy, counting the rows it was asked about."""

    def __init__(self) -> None:
        self.rows = 0

    def __call__(self, normed: torch.Tensor, probe: int) -> torch.Tensor:
        self.rows += normed.shape[0]
        return normed[:, 0]


def _qs(**kw) -> tuple[QuickSilverExitSignal, _Entropy]:
    ent = _Entropy()
    args = {"tau_drift": 1.0, "tau_entropy": 0.5, "min_halting_depth": 5, **kw}
    return QuickSilverExitSignal(ent, **args), ent


# -- QuickSilver ------------------------------------------------------------------------------


def test_quicksilver_needs_both_signals_and_skips_entropy_when_drift_fails() -> None:
    sig, ent = _qs()
    # drift/entropy: both low, drift high, entropy high, both high, both on the threshold
    b = _qs_batch(6, [0.5, 2.0, 0.5, 2.0, 1.0], [0.1, 0.1, 0.9, 0.9, 0.5], [10, 11, 12, 13, 14])
    assert sig.exit_mask(b).tolist() == [True, False, False, False, False]  # strict "<"
    assert ent.rows == 2  # only the rows whose drift passed (0 and 2) paid for the entropy


def test_quicksilver_minimum_halting_depth_and_window() -> None:
    sig, ent = _qs(min_halting_depth=5, max_halting_layer=20, forced_halt_ids=[7])
    rows = ([0.1, 0.1], [0.1, 0.1], [3, 7])  # would halt; the second is forced anyway
    for layer in range(1, 6):  # l <= l_min: nothing halts, forced tokens neither
        assert not sig.exit_mask(_qs_batch(layer, *rows)).any()
    assert ent.rows == 0  # outside the window nothing is computed
    assert sig.exit_mask(_qs_batch(6, *rows)).all()
    assert sig.exit_mask(_qs_batch(20, *rows)).all()
    assert not sig.exit_mask(_qs_batch(21, *rows)).any()  # past the window's end
    assert [sig.in_window(x) for x in (5, 6, 20, 21)] == [False, True, True, False]


def test_protected_tokens_never_halt() -> None:
    sig, ent = _qs(protected_ids=[1, 2])
    b = _qs_batch(10, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1, 2, 3], forced=[True, True, False])
    # converged (drift 0, entropy 0) and even flagged forced by the runtime: still no halt
    assert sig.exit_mask(b).tolist() == [False, False, True]
    assert ent.rows == 1


def test_forced_halting_by_token_id_and_by_row_flag() -> None:
    sig, ent = _qs(forced_halt_ids=[9])
    # forced rows halt with drift and entropy far above the thresholds
    b = _qs_batch(6, [50.0, 50.0, 50.0], [9.0, 9.0, 9.0], [9, 4, 4], forced=[False, True, False])
    assert sig.exit_mask(b).tolist() == [True, True, False]
    assert ent.rows == 0  # forced rows need no entropy; the third failed drift
    with pytest.raises(ValueError, match="both protected and forced"):
        _qs(protected_ids=[9], forced_halt_ids=[9])


def test_halting_rule_precedence_on_numpy_and_torch() -> None:
    # protected > forced halt > (drift and entropy), element-wise, same code for both types
    p = [True, True, False, False, False, False]
    f = [True, False, True, False, False, False]
    d = [True, True, False, True, True, False]
    e = [True, True, False, True, False, True]
    want = [False, False, True, True, False, False]
    got_np = halting_rule(*(np.array(x) for x in (d, e, p, f)))
    got_t = halting_rule(*(torch.tensor(x) for x in (d, e, p, f)))
    assert got_np.tolist() == want and got_t.tolist() == want


def test_quicksilver_simulation_mask_matches_the_runtime_signal() -> None:
    """The calibration's pass mask is the runtime signal's decision, row for row."""
    rng = np.random.default_rng(0)
    layers = list(range(1, 12))
    S, K = 3, 20
    arrays = SignalArrays(
        probe_layers=layers,
        drift=rng.uniform(0, 2, size=(len(layers), S, K)),
        cosine=rng.uniform(0, 1, size=(len(layers), S, K)),
        entropy=rng.uniform(0, 1, size=(len(layers), S, K)),
        token_ids=rng.integers(0, 6, size=(S, K)),
    )
    opts = QuickSilverCalibration(min_halting_depth=4, protected_ids=(0, 1), forced_halt_ids=(5,))
    passes, cost = quicksilver_passes(arrays, 1.0, 0.5, opts, drift_flops=1.0, entropy_flops=10.0)
    sig, _ = _qs(min_halting_depth=4, protected_ids=[0, 1], forced_halt_ids=[5])
    for p, layer in enumerate(layers):
        for s in range(S):
            b = _qs_batch(
                layer, arrays.drift[p, s].tolist(), arrays.entropy[p, s].tolist(),
                arrays.token_ids[s].tolist(),
            )  # fmt: skip
            assert sig.exit_mask(b).tolist() == passes[p, s].tolist()
    assert np.all(cost[:4] == 0)  # not evaluated below the window
    assert set(np.unique(cost[4:])) <= {1.0, 11.0}


# -- River ------------------------------------------------------------------------------------


def _river_batch(layer: int, cosines: list[float]) -> ProbeBatch:
    """Rows whose cos(prev, stream) is exactly the given values."""
    c = torch.tensor(cosines, dtype=torch.float64)
    prev = torch.zeros(len(cosines), D, dtype=torch.float64)
    prev[:, 0] = 1.0
    cur = torch.zeros_like(prev)
    cur[:, 0] = c
    cur[:, 1] = torch.sqrt(1 - c**2)
    return ProbeBatch(layer=layer, probe=layer - 1, stream=cur * 3.0, prev_stream=prev * 0.5)


def test_river_per_token_threshold_and_entry_layer() -> None:
    sig = RiverExitSignal(0.9, entry_layer=3)
    assert sig.per_row and sig.needs_prev_stream and not sig.needs_token_ids
    b = _river_batch(4, [0.95, 0.85, 0.91, -0.5])
    assert sig.exit_mask(b).tolist() == [True, False, True, False]
    assert not sig.exit_mask(_river_batch(2, [0.99, 0.99])).any()  # before L_s
    assert sig.exit_mask(_river_batch(4, [])).shape == (0,)
    with pytest.raises(ValueError, match="cosine"):
        RiverExitSignal(1.5)


def test_river_batch_minimum_moves_every_row_together() -> None:
    sig = RiverExitSignal(0.9, batch_min=True)
    assert not sig.per_row
    assert sig.exit_mask(_river_batch(5, [0.95, 0.99, 0.92])).tolist() == [True] * 3
    # one row below tau holds the whole batch, even those far above it
    assert sig.exit_mask(_river_batch(5, [0.95, 0.99, 0.89])).tolist() == [False] * 3


# -- combinations -----------------------------------------------------------------------------


class _Fixed:
    """A per-row signal with fixed answers by token id, recording the rows it saw."""

    needs_prev_stream = False
    needs_token_ids = True

    def __init__(self, yes: set[int], per_row: bool = True) -> None:
        self.yes, self.per_row, self.seen = yes, per_row, []

    def exit_mask(self, batch: ProbeBatch) -> torch.Tensor:
        ids = batch.token_ids.tolist()
        self.seen.append(ids)
        return torch.tensor([i in self.yes for i in ids], dtype=torch.bool)


def _ids_batch(ids: list[int]) -> ProbeBatch:
    return ProbeBatch(
        layer=3, probe=0, stream=torch.zeros(len(ids), D), token_ids=torch.tensor(ids)
    )


def test_combination_all_and_any_short_circuit() -> None:
    a, b = _Fixed({1, 2}), _Fixed({2, 3})
    both = CombinedExitSignal([a, b], "all")
    assert both.exit_mask(_ids_batch([1, 2, 3, 4])).tolist() == [False, True, False, False]
    assert b.seen == [[1, 2]]  # the second signal only saw the rows the first passed
    a, b = _Fixed({1, 2}), _Fixed({2, 3})
    either = CombinedExitSignal([a, b], "any")
    assert either.exit_mask(_ids_batch([1, 2, 3, 4])).tolist() == [True, True, True, False]
    assert b.seen == [[3, 4]]  # only the rows still undecided
    a, b = _Fixed(set()), _Fixed({1})
    assert not CombinedExitSignal([a, b], "all").exit_mask(_ids_batch([1, 2])).any()
    assert b.seen == []  # nothing left to decide
    with pytest.raises(ValueError, match="combine mode"):
        CombinedExitSignal([a], "most")


def test_combination_gives_batch_coupled_signals_the_whole_batch() -> None:
    a, coupled = _Fixed({1, 2}), _Fixed({1, 2, 3}, per_row=False)
    comb = CombinedExitSignal([a, coupled], "all")
    assert not comb.per_row
    assert comb.exit_mask(_ids_batch([1, 2, 3, 4])).tolist() == [True, True, False, False]
    assert coupled.seen == [[1, 2, 3, 4]]  # its minimum is over every candidate row
    # River's batch minimum after a per-row signal: decided over all rows, then and-ed
    river = RiverExitSignal(0.9, batch_min=True)
    b = _river_batch(5, [0.95, 0.99, 0.89])
    b.token_ids = torch.tensor([1, 2, 3])
    assert not CombinedExitSignal([_Fixed({1, 2}), river], "all").exit_mask(b).any()


# -- config -----------------------------------------------------------------------------------


def test_signal_config_default_is_emad_and_lists_combine() -> None:
    cfg = parse_adaptive_config({"depth": {"profile": "p"}})
    assert cfg.depth.signal == SignalConfig() and cfg.depth.signal.policy == ("emad",)
    two = parse_adaptive_config(
        {"depth": {"profile": "p", "signal": {"policy": ["river", "emad"], "combine": "any",
                                               "river": {"tau": 0.9, "batch_min": True}}}}
    ).depth.signal  # fmt: skip
    assert two.policy == ("river", "emad") and two.combine == "any" and two.river.batch_min
    qs = parse_adaptive_config(
        {"depth": {"profile": "p", "signal": {"policy": "quicksilver", "quicksilver": {
            "protected_token_ids": [5], "forced_halt_token_ids": [6], "max_halting_layer": 24}}}}
    ).depth.signal.quicksilver  # fmt: skip
    assert qs.protected_token_ids == (5,) and qs.min_halting_depth == 5


@pytest.mark.parametrize(
    ("signal", "needle"),
    [
        ({"policy": "bogus"}, "adaptive.depth.signal.policy.0: Input should be 'emad'"),
        ({"policy": ["emad", "nope"]}, "adaptive.depth.signal.policy.1"),
        ({"policy": []}, '"policy" names no signal'),
        ({"policy": ["river", "river"]}, "policy lists a signal twice"),
        ({"policy": "emad", "river": {"tau": 0.5}}, '"river" settings given but "policy"'),
        ({"policy": "river", "combine": "any"}, '"combine" needs at least two'),
        ({"policy": ["river", "emad"], "combine": "most"}, "adaptive.depth.signal.combine"),
        ({"policy": "river", "river": {"tau": 1.5}}, "adaptive.depth.signal.river.tau"),
        ({"policy": "river", "river": {"entry_layer": 0}}, "adaptive.depth.signal.river.entry"),
        ({"policy": "river", "river": {"bogus": 1}}, "adaptive.depth.signal.river.bogus: unknown"),
        ({"policy": "quicksilver", "quicksilver": {"tau_drift": -1}}, "quicksilver.tau_drift"),
        (
            {"policy": "quicksilver", "quicksilver": {"min_halting_depth": -1}},
            "adaptive.depth.signal.quicksilver.min_halting_depth",
        ),
        (
            {"policy": "quicksilver", "quicksilver": {"protected_token_ids": [3],
                                                      "forced_halt_token_ids": [3]}},
            "token ids [3] are in both protected_token_ids and forced_halt_token_ids",
        ),
        (
            {"policy": "quicksilver", "quicksilver": {"max_halting_layer": 5}},
            "max_halting_layer must be above min_halting_depth",
        ),
        ({"policy": "quicksilver", "quicksilver": {"entropy": "exakt"}}, "quicksilver.entropy"),
        ({"bogus": 1}, "adaptive.depth.signal.bogus: unknown key"),
    ],
)  # fmt: skip
def test_bad_signal_config_names_the_key(signal: dict, needle: str) -> None:
    with pytest.raises(AdaptiveConfigError) as err:
        parse_adaptive_config({"depth": {"profile": "p", "signal": signal}})
    assert needle in str(err.value)


# -- profile keys and building the signal -----------------------------------------------------


def _fake_model(tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({"vocab_size": 20, "hidden_size": D}))
    save_file(
        {"model.norm.weight": torch.ones(D), "lm_head.weight": torch.randn(20, D)},
        str(tmp / "model.safetensors"),
    )
    return tmp


def _profile_tensors(P: int) -> dict[str, torch.Tensor]:
    return {
        "norm_a": torch.ones(P, D),
        "norm_b": torch.zeros(P, D),
        "lowrank_u": torch.randn(20, 4),
        "lowrank_v": torch.randn(D, 4),
        "threshold": torch.zeros(P),
        "table_thresholds": torch.zeros(3, P),
        "table_layers_fraction": torch.tensor([1.0, 0.8, 0.5]),
        "table_flops_fraction": torch.tensor([1.0, 0.85, 0.6]),
    }


def test_profile_round_trip_of_signal_keys_and_build(tmp_path: Path) -> None:
    model = _fake_model(tmp_path / "m")
    meta = {"probe_layers": [1, 2, 3], "num_layers": 4, "budget": 0.6, "budget_kind": "layers",
            "special_token_ids": [0, 2], "quicksilver": {"entropy": "proxy", "tau_drift": 0.4},
            "river": {"tau": 0.93}}  # fmt: skip
    tensors = {
        **_profile_tensors(3),
        "quicksilver_thresholds": torch.tensor([0.4, 1.25]),
        "river_tau": torch.tensor([0.93]),
        "river_table_tau": torch.tensor([0.5, 0.9, 0.99]),
        "river_table_layers_fraction": torch.tensor([0.4, 0.7, 0.95]),
        "river_table_flops_fraction": torch.tensor([0.45, 0.75, 0.96]),
        "river_table_agreement": torch.tensor([0.2, 0.6, 0.99]),
    }
    save_profile(Profile(meta=meta, tensors=tensors), tmp_path / "p", model)
    prof = ExitProfile.load(tmp_path / "p", model)
    assert prof.special_token_ids == (0, 2)
    assert prof.quicksilver_thresholds == pytest.approx((0.4, 1.25))
    assert prof.quicksilver_entropy == "proxy"
    assert prof.river_tau == pytest.approx(0.93)
    assert prof.river_tau_for(1.0) == 1.0
    assert prof.river_tau_for(0.8) == pytest.approx(0.9)  # the largest tau within the budget
    assert prof.river_tau_for(0.1) == pytest.approx(0.5)  # unreachable: the cheapest

    qs = build_exit_signal(SignalConfig(policy="quicksilver"), prof)
    assert isinstance(qs, QuickSilverExitSignal)
    assert (qs.tau_drift, qs.tau_entropy) == pytest.approx((0.4, 1.25))
    assert qs.protected_ids.tolist() == [0, 2]  # the special tokens, from the profile
    cfg = SignalConfig.model_validate(
        {"policy": "quicksilver", "quicksilver": {"tau_drift": 2.0, "protect_special_tokens": False,
                                                  "protected_token_ids": [7]}}
    )  # fmt: skip
    qs2 = build_exit_signal(cfg, prof)
    assert qs2.tau_drift == 2.0 and qs2.tau_entropy == pytest.approx(1.25)
    assert qs2.protected_ids.tolist() == [7]
    river = build_exit_signal(SignalConfig(policy="river"), prof)
    assert isinstance(river, RiverExitSignal) and river.tau == pytest.approx(0.93)
    comb = build_exit_signal(SignalConfig(policy=["river", "emad"], combine="any"), prof)
    assert isinstance(comb, CombinedExitSignal) and comb.mode == "any"
    assert isinstance(comb.signals[1], EmadExitSignal) and comb.needs_prev_stream
    assert isinstance(build_exit_signal(SignalConfig(), prof), EmadExitSignal)
    exact = SignalConfig.model_validate(
        {"policy": "quicksilver", "quicksilver": {"entropy": "exact"}}
    )
    with pytest.raises(ProfileError, match="calibrated tau_entropy for the 'proxy' entropy"):
        build_exit_signal(exact, prof)
    forced_special = SignalConfig.model_validate(
        {"policy": "quicksilver", "quicksilver": {"forced_halt_token_ids": [2]}}
    )
    with pytest.raises(ValueError, match="are special tokens"):
        build_exit_signal(forced_special, prof)

    # an EMAD-only profile loads as before and says how to get the missing thresholds
    save_profile(Profile(meta=meta, tensors=_profile_tensors(3)), tmp_path / "old", model)
    old = ExitProfile.load(tmp_path / "old", model)
    assert old.quicksilver_thresholds is None and old.river_tau is None
    with pytest.raises(ProfileError, match="--signal quicksilver"):
        build_exit_signal(SignalConfig(policy="quicksilver"), old)
    with pytest.raises(ProfileError, match="--signal river"):
        build_exit_signal(SignalConfig(policy="river"), old)
    assert isinstance(build_exit_signal(SignalConfig(policy="river", river={"tau": 0.7}), old),
                      RiverExitSignal)  # fmt: skip


# -- the simulator and the calibrations on synthetic data -------------------------------------

SHAPE = DenseShape(8, 64, 128, 4, 2, 16, 1000)


def _sim(seed: int = 3, S: int = 6, K: int = 40) -> SimData:
    rng = np.random.default_rng(seed)
    probes = [2, 4, 6]
    proxy = rng.gamma(2.0, 1.0, size=(3, S, K)) * np.array([3, 2, 1])[:, None, None]
    nll = rng.gamma(2.0, 1.0, size=(3, S, K)) + np.array([3.0, 2.0, 1.0])[:, None, None]
    return SimData(
        probe_layers=probes,
        num_layers=8,
        proxy=proxy,
        agree=rng.random(size=proxy.shape) < np.array([0.2, 0.5, 0.9])[:, None, None],
        context=np.tile(np.arange(100, 100 + K), (S, 1)),
        nll=nll,
        final_nll=np.full((S, K), 1.0),
    )


def test_simulate_mask_reproduces_emad_and_handles_batch_min_and_perplexity() -> None:
    data = _sim()
    th = np.array([1.0, 1.5, 2.0])
    old = simulate(data, th, SHAPE, 1000.0)
    new = simulate_mask(data, data.proxy <= th[:, None, None], SHAPE, 1000.0)
    for k in ("mean_layers", "flops_fraction", "agreement", "depth_hist"):
        assert getattr(old, k) == pytest.approx(getattr(new, k))
    none = simulate_mask(data, np.zeros_like(data.agree), SHAPE)
    assert none.mean_layers == 8 and none.agreement == 1.0 and none.ppl_ratio == pytest.approx(1)
    every = simulate_mask(data, np.ones_like(data.agree), SHAPE, monotone=False)
    assert every.mean_layers == 2 and every.ppl_ratio > 1
    # batch minimum: at each probe every candidate row exits, or none
    passes = data.proxy <= th[:, None, None]
    bm = simulate_mask(data, passes, SHAPE, batch_min=True, monotone=False)
    per_row = simulate_mask(data, passes, SHAPE, monotone=False)
    assert bm.mean_layers >= per_row.mean_layers
    # the floor keeps rows from being candidates: full depth at t=0 whatever the signal says
    floored = simulate_mask(data, np.ones_like(data.agree), SHAPE, floor_tokens=8, floor_min=2)
    assert floored.depth_hist.get(8, 0) > 0


def test_batch_min_depths_are_shared_per_step() -> None:
    data = _sim(S=4, K=10)
    rng = np.random.default_rng(1)
    passes = rng.random(size=data.agree.shape) < 0.7
    r = simulate_mask(data, passes, SHAPE, batch_min=True, monotone=False)
    # recompute by hand: the first probe where every stream passes
    want = []
    for t in range(10):
        ok = [p for p in range(3) if passes[p, :, t].all()]
        want.append([2, 4, 6][ok[0]] if ok else 8)
    assert r.mean_layers == pytest.approx(np.mean(want))


def _arrays(seed: int, S: int, K: int) -> SignalArrays:
    rng = np.random.default_rng(seed)
    cos = rng.uniform(0.5, 1.0, size=(3, S, K))
    return SignalArrays(
        probe_layers=[2, 4, 6],
        drift=rng.uniform(0, 2, size=(3, S, K)),
        cosine=cos,
        entropy=rng.uniform(0, 3, size=(3, S, K)),
        token_ids=rng.integers(3, 50, size=(S, K)),
    )


def test_river_calibration_meets_its_match_rate() -> None:
    fit_sim, val_sim = _sim(4), _sim(5)
    fit, val = _arrays(4, 6, 40), _arrays(5, 6, 40)
    meta, tensors = calibrate_river(fit, fit_sim, val, val_sim, SHAPE, RiverCalibration(0.6))
    assert meta["met"]
    got = simulate_mask(fit_sim, river_passes(fit, meta["tau"], 1), SHAPE)
    assert got.agreement >= 0.6
    assert float(tensors["river_tau"][0]) == pytest.approx(meta["tau"])
    taus = tensors["river_table_tau"]
    assert np.all(np.diff(taus) > 0) and 0.5 in taus.tolist()  # the paper's tau is a row
    strict, _ = calibrate_river(fit, fit_sim, val, val_sim, SHAPE, RiverCalibration(1.01))
    assert not strict["met"] and strict["tau"] == 1.0 and strict["at_tau"]["mean_layers"] == 8


def test_quicksilver_calibration_percentiles_and_grid_choice() -> None:
    fit, val = _arrays(6, 6, 40), _arrays(7, 6, 40)
    opts = QuickSilverCalibration(min_halting_depth=3, max_ppl_increase=10.0)
    meta, tensors = calibrate_quicksilver(fit, val, _sim(7), SHAPE, opts, entropy_flops=100.0)
    window = fit.drift[1:].ravel()  # probes 4 and 6 are above l_min = 3
    assert meta["percentile_tau_drift"] == pytest.approx(np.percentile(window, 25))
    assert meta["met"] and meta["chosen"]["ppl_ratio"] <= 11.0
    ok = [r for r in meta["grid"] if r["ppl_ratio"] <= 11.0]
    assert meta["chosen"]["flops_fraction"] == min(r["flops_fraction"] for r in ok)
    assert tensors["quicksilver_thresholds"].tolist() == pytest.approx(
        [meta["tau_drift"], meta["tau_entropy"]]
    )
    assert len(meta["grid"]) == tensors["quicksilver_grid"].shape[0] == 121
    tight = QuickSilverCalibration(min_halting_depth=3, max_ppl_increase=0.0)
    meta0, t0 = calibrate_quicksilver(fit, val, _sim(7), SHAPE, tight, entropy_flops=100.0)
    assert not meta0["met"] and t0["quicksilver_thresholds"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="no probe layer above min_halting_depth"):
        calibrate_quicksilver(
            fit, val, _sim(7), SHAPE, QuickSilverCalibration(min_halting_depth=6), 1.0
        )
