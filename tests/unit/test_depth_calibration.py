"""EMAD offline calibration: unit tests on synthetic tensors and one real CLI run."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vllm_adaptive.artifacts import (
    JSON_NAME,
    TENSORS_NAME,
    Profile,
    ProfileError,
    load_profile,
    save_profile,
)
from vllm_adaptive.depth.calibration.budget import (
    SimData,
    prune_unpaid_probes,
    search_q,
    search_q_for_agreement,
    simulate,
)
from vllm_adaptive.depth.calibration.norms import fit_affine
from vllm_adaptive.depth.calibration.targets import entropy_targets
from vllm_adaptive.depth.isotonic import IsotonicMap, isotonic_fit
from vllm_adaptive.depth.proxies import LowRankReadout
from vllm_adaptive.flops import DenseShape


@pytest.mark.parametrize("metric", ["identity", "logits"])
def test_ridge_recovers_known_affine_map(metric: str) -> None:
    g = torch.Generator().manual_seed(0)
    n, d, v = 2000, 16, 64
    x = torch.randn(n, d, generator=g)
    a_true = torch.rand(d, generator=g) + 0.5
    b_true = torch.randn(d, generator=g)
    y = x * a_true + b_true
    w = torch.randn(v, d, generator=g)
    gram = torch.eye(d) if metric == "identity" else w.T @ w
    fit = fit_affine(x, y, gram, prior_a=torch.ones(d), ridge=1e-9)
    assert torch.allclose(fit.a, a_true, atol=1e-4)
    assert torch.allclose(fit.b, b_true, atol=1e-4)
    scalar = fit_affine(x, 2.0 * x + 0.5, gram, prior_a=torch.ones(d), ridge=1e-9, scalar=True)
    assert torch.allclose(scalar.a, torch.full((d,), 2.0), atol=1e-4)
    assert torch.allclose(scalar.b, torch.full((d,), 0.5), atol=1e-4)


def _brute_isotonic(y: np.ndarray) -> np.ndarray:
    """Best non-decreasing fit among sequences built from block means of all partitions."""
    n = len(y)
    best, best_err = None, np.inf
    for cuts in itertools.product([0, 1], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        fit = np.concatenate([np.full(b - a, y[a:b].mean()) for a, b in itertools.pairwise(bounds)])
        if np.all(np.diff(fit) >= -1e-12):
            err = ((fit - y) ** 2).sum()
            if err < best_err:
                best, best_err = fit, err
    return best


def test_isotonic_monotone_and_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        y = rng.normal(size=7)
        fit = isotonic_fit(y)
        assert np.all(np.diff(fit) >= -1e-12)
        np.testing.assert_allclose(fit, _brute_isotonic(y), atol=1e-9)
        down = isotonic_fit(y, increasing=False)
        assert np.all(np.diff(down) <= 1e-12)
    np.testing.assert_allclose(isotonic_fit(np.array([1.0, 3.0, 2.0, 4.0])), [1, 2.5, 2.5, 4])
    m = IsotonicMap.fit(np.array([3.0, 1.0, 2.0, 4.0]), np.array([2.0, 1.0, 3.0, 4.0]))
    out = m(np.linspace(0, 5, 50))
    assert np.all(np.diff(out) >= -1e-12)
    assert m(np.array([4.0]))[0] == 4.0


def test_entropy_targets_non_increasing() -> None:
    rng = np.random.default_rng(2)
    ents = [rng.gamma(2.0, s, size=200) for s in (1.0, 2.0, 0.5, 1.5)]
    for q in (0.1, 0.5, 0.9):
        assert np.all(np.diff(entropy_targets(ents, q)) <= 1e-12)


def test_lowrank_full_rank_is_exact() -> None:
    w = torch.randn(50, 8)
    lr = LowRankReadout.fit(w, 8)
    h = torch.randn(5, 8)
    assert torch.allclose(lr.logits(h), h @ w.T, atol=1e-4)


def _sim_data(seed: int = 3) -> SimData:
    rng = np.random.default_rng(seed)
    probes, S, K = [2, 4, 6], 6, 40
    proxy = rng.gamma(2.0, 1.0, size=(len(probes), S, K)) * np.array([3, 2, 1])[:, None, None]
    return SimData(
        probe_layers=probes,
        num_layers=8,
        proxy=proxy,
        agree=rng.random(size=proxy.shape) < 0.5,
        context=np.tile(np.arange(100, 100 + K), (S, 1)),
    )


def test_budget_search_monotone_and_meets_budget() -> None:
    data = _sim_data()
    shape = DenseShape(8, 64, 128, 4, 2, 16, 1000)
    ents = [data.proxy[p].ravel() for p in range(3)]

    def run(q):
        return simulate(data, entropy_targets(ents, q), shape, proxy_flops=1000.0)

    prev_q = 1.0
    for budget in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        found = search_q(run, budget, "layers")
        assert found.met
        assert found.result.layers_fraction <= budget + 1e-12
        assert found.q <= prev_q + 1e-12  # a looser budget never needs a larger q
        prev_q = found.q
        flops = search_q(run, budget, "flops")
        assert not flops.met or flops.result.flops_fraction <= budget + 1e-12
    # depth never increases along a stream and starts at full depth
    r = run(0.5)
    assert r.mean_layers < 8 and 0.0 <= r.agreement <= 1.0
    impossible = search_q(run, 0.01, "layers")
    assert not impossible.met and impossible.q == 1.0


def test_agreement_search_takes_the_most_exits_that_keep_the_target() -> None:
    data = _sim_data()
    shape = DenseShape(8, 64, 128, 4, 2, 16, 1000)
    ents = [data.proxy[p].ravel() for p in range(3)]

    def run(q):
        return simulate(data, entropy_targets(ents, q), shape, proxy_flops=1000.0)

    most, least = run(1.0).agreement, run(0.0).agreement
    assert most < least  # exits cost agreement
    prev_q = 1.0
    for f in (0.3, 0.6, 0.9):
        target = most + f * (least - most)
        found = search_q_for_agreement(run, target)
        assert found.met and found.result.agreement >= target
        assert found.q <= prev_q + 1e-12  # a stricter target never allows more exits
        prev_q = found.q
        # the largest such q: a little more and the target is missed
        assert run(found.q + 1e-3).agreement < target
    loose = search_q_for_agreement(run, most + 0.3 * (least - most))
    assert loose.result.mean_layers < found.result.mean_layers  # a looser target: more exits
    assert search_q_for_agreement(run, most).q == 1.0
    impossible = search_q_for_agreement(run, min(1.0, least + 1e-6))
    assert not impossible.met and impossible.q == 0.0
    with pytest.raises(ValueError, match="target agreement"):
        search_q_for_agreement(run, 1.5)


def test_unpaid_probes_are_turned_off_and_paying_ones_kept() -> None:
    """A probe few tokens pass at costs its proxy for every token reaching it: pruning turns it
    off (FLOPs fall, agreement holds); a probe that most tokens pass at pays and stays."""
    data = _sim_data()
    data.agree[:] = True  # every exit agrees: only cost decides
    shape = DenseShape(8, 64, 128, 4, 2, 16, 1000)
    proxy_flops = 0.3 * shape.layer_linear_flops()

    def run(th):
        return simulate(data, th, shape, proxy_flops)

    # probes 0 and 2 (after layers 2 and 6): a reachable threshold (the proxy's floor, 0) that
    # no token passes, so their proxy is pure cost; probe 1: 80% of the tokens pass
    th = np.array([0.0, np.quantile(data.proxy[1], 0.8), 0.0])
    evaluated = np.array([True, True, True])
    got, result, pruned = prune_unpaid_probes(run, th, evaluated, target=0.99)
    assert sorted(pruned) == [0, 2]
    assert np.isneginf(got[[0, 2]]).all() and got[1] == th[1]
    assert result.flops_fraction < run(th).flops_fraction
    assert result.depth_hist.get(4, 0.0) > 0.5  # the paying probe still exits most tokens
    # probes that are not evaluated cost nothing: nothing to prune
    none, same, nothing = prune_unpaid_probes(run, th, np.zeros(3, dtype=bool), target=0.99)
    assert nothing == [] and np.array_equal(none, th) and same == run(th)


def _fake_model(tmp: Path, vocab: int = 32) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({"vocab_size": vocab, "hidden_size": 8}))
    save_file(
        {
            "model.norm.weight": torch.ones(8),
            "lm_head.weight": torch.arange(vocab * 8.0).view(-1, 8),
        },
        str(tmp / "model.safetensors"),
    )
    return tmp


def _profile() -> Profile:
    return Profile(
        meta={"probe_layers": [2, 4], "q": 0.25, "thresholds": [1.5, 1.0]},
        tensors={"norm_a": torch.randn(2, 8), "feature_knots_x.0": torch.randn(5).double()},
    )


def test_profile_round_trip_and_refusals(tmp_path: Path) -> None:
    model = _fake_model(tmp_path / "m")
    out = save_profile(_profile(), tmp_path / "p", model)
    loaded = load_profile(out, model)
    src = _profile()
    for k, v in src.meta.items():
        assert loaded.meta[k] == v
    for k, v in loaded.tensors.items():
        assert v.dtype == src.tensors[k].dtype and v.shape == src.tensors[k].shape
    p2 = save_profile(src, tmp_path / "p2", model)
    for k in src.tensors:
        assert torch.equal(load_profile(p2, model).tensors[k], src.tensors[k])

    other = _fake_model(tmp_path / "other", vocab=33)
    with pytest.raises(ProfileError, match="different model"):
        load_profile(out, other)

    meta = json.loads((out / JSON_NAME).read_text())
    meta["format_version"] = 999
    (out / JSON_NAME).write_text(json.dumps(meta))
    with pytest.raises(ProfileError, match="format version 999"):
        load_profile(out, model)

    (out / JSON_NAME).write_text("{not json")
    with pytest.raises(ProfileError, match="corrupt"):
        load_profile(out, model)

    (p2 / TENSORS_NAME).unlink()
    with pytest.raises(ProfileError, match=f"missing {TENSORS_NAME}"):
        load_profile(p2, model)

    p3 = save_profile(src, tmp_path / "p3", model)
    raw = bytearray((p3 / TENSORS_NAME).read_bytes())
    raw[-1] ^= 0xFF
    (p3 / TENSORS_NAME).write_bytes(bytes(raw))
    with pytest.raises(ProfileError, match="corrupt"):
        load_profile(p3, model)
    (p3 / JSON_NAME).unlink()
    with pytest.raises(ProfileError, match=f"missing {JSON_NAME}"):
        load_profile(p3, model)


def test_proxy_vocabulary_puts_predicted_tokens_first_then_frequent_ones() -> None:
    from vllm_adaptive.depth.calibration.emad import proxy_vocabulary

    def tok(text, add_special_tokens=False):  # one id per character
        return {"input_ids": [ord(c) - ord("a") for c in text]}

    texts = ["aaaabbbcc", "aab"]  # a: 6, b: 4, c: 2
    predicted = torch.tensor([7, 7, 5])
    got = proxy_vocabulary(tok, texts, predicted, vocab_size=10, size=4)
    assert got.tolist() == [0, 1, 5, 7]  # both predicted, then a and b; ascending
    assert proxy_vocabulary(tok, texts, predicted, 10, 10).tolist() == list(range(10))
    with pytest.raises(ValueError, match="proxy vocabulary"):
        proxy_vocabulary(tok, texts, predicted, 10, 11)
    # the restricted proxy is the full one's rows: its logits are the kept columns
    w = torch.randn(10, 6, dtype=torch.float64)
    full, part = LowRankReadout.fit(w, 3), LowRankReadout.fit(w, 3, got)
    h = torch.randn(4, 6)
    assert torch.allclose(part.logits(h), full.logits(h)[:, got], atol=1e-5)
    assert part.flops() < full.flops()


def test_rmsnorm_scale_reads_llama_and_gemma_norms() -> None:
    """The calibrated readout's plain lens needs the scale a final norm applies: ``weight``
    for Llama's RMSNorm, ``1 + weight`` for Gemma's."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from vllm_adaptive.depth.calibration.collect import rmsnorm_scale

    w = torch.linspace(-0.5, 2.0, 16)
    llama, gemma = LlamaRMSNorm(16, eps=1e-6), Gemma3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        llama.weight.copy_(w)
        gemma.weight.copy_(w)
    assert torch.allclose(rmsnorm_scale(llama, 16, 1e-6), w, atol=1e-6)
    assert torch.allclose(rmsnorm_scale(gemma, 16, 1e-6), 1.0 + w, atol=1e-6)
