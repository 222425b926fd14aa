"""The MLX backend on the real default checkpoint (SmolLM2-135M), against stock mlx-lm.

Runs on MLX's CPU build; float32 (MLX's CPU quantized kernels are fast only with float32
activations, see docs/metal-backend.md). Prompts and outputs are kept short: MLX's CPU GEMM is
slow (a 32-token prefill takes about a second here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install '.[mlx]')")
pytest.importorskip("mlx_lm", reason="the MLX backend needs mlx-lm")

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from vllm_adaptive.config import AdaptiveConfigError  # noqa: E402
from vllm_adaptive.metal_backend.engine import MlxEngine, Sampling  # noqa: E402
from vllm_adaptive.metal_backend.loading import load_mlx  # noqa: E402
from vllm_adaptive.overrides import RequestOverrides  # noqa: E402

DTYPE = "float32"
NEW = 12  # generated tokens per identity check


@pytest.fixture(scope="module")
def stock(model_dir: Path):
    return load_mlx(model_dir, DTYPE)


@pytest.fixture(scope="module")
def prompts(stock) -> list[list[int]]:
    _, tok = stock
    code = Path(argparse.__file__).read_text()[4000:5000]
    return [tok.encode(code)[:16], tok.encode("The capital of France is")]


@pytest.fixture(scope="module")
def stock_greedy(stock, prompts) -> list[list[int]]:
    model, _ = stock
    return [[t for t, _ in generate_step(mx.array(p), model, max_tokens=NEW)] for p in prompts]


def _tag(name: str) -> RequestOverrides:
    return RequestOverrides(request_tag=name)


def test_rope_settings_of_transformers_5_checkpoints_reach_mlx_lm(model_dir, stock) -> None:
    """mlx-lm reads top-level rope_theta only; the checkpoint nests it (transformers 5). The
    logits against transformers: tests/slow/test_mlx_bench.py."""
    import json

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    model, _ = stock
    assert "rope_theta" not in hf
    assert model.args.rope_theta == hf["rope_parameters"]["rope_theta"] == 100000.0


def test_everything_off_is_stock_mlx_lm_token_for_token(model_dir, stock, prompts, stock_greedy):
    model, _ = stock
    eng = MlxEngine(model_dir, {}, dtype=DTYPE)
    assert eng.mechanism == "none"
    for p, want in zip(prompts, stock_greedy, strict=True):
        assert list(eng.generate(p, NEW)) == want
    # seeded sampling draws the same tokens as mlx-lm's sampler with the same seed
    mx.random.seed(11)
    sampler = make_sampler(1.0, 0.95)
    want = [t for t, _ in generate_step(mx.array(prompts[1]), model, max_tokens=8, sampler=sampler)]
    assert list(eng.generate(prompts[1], 8, Sampling(1.0, 0.95, seed=11))) == want
    assert want != stock_greedy[1][:8]  # (it did sample)


@pytest.fixture(scope="module")
def gear_engine(model_dir) -> MlxEngine:
    return MlxEngine(model_dir, {"precision": {"policy": "gearbx"}}, dtype=DTYPE)


def test_gears_shift_and_are_reported(gear_engine, stock) -> None:
    _, tok = stock
    ids = tok.encode(Path(argparse.__file__).read_text()[20000:23000])
    gear_engine.teacher_force(ids[:8], ids[8:40], _tag("tf"))
    (rec,) = gear_engine.request_records("tf")
    assert rec["mechanism"] == "precision" and rec["generated_tokens"] == 32
    used = {g for g, n in rec["gear_tokens"].items() if n}
    assert len(used) >= 2 and rec["shifts"] >= 1, rec["gears"]
    assert len(rec["entropy_bits"]) == len(rec["gears"]) == 32
    tel = gear_engine.telemetry()["precision"]
    assert tel["policy"]["policy"] == "gearbx" and tel["policy"]["calibrated"]
    assert tel["level_byte_ratios"]["low"] < tel["level_byte_ratios"]["mid"] < 1.0
    assert set(tel["resident_bytes"]) == {"int4", "int8", "full"}


def test_gear_overrides_pin_or_switch_off(gear_engine, prompts, stock_greedy) -> None:
    # "off" and a pin to the high gear (full precision for gearbx) run the model itself
    assert (
        list(gear_engine.generate(prompts[0], NEW, overrides=RequestOverrides(mode="off")))
        == (stock_greedy[0])
    )
    high = RequestOverrides(gear="high", request_tag="high")
    assert list(gear_engine.generate(prompts[0], NEW, overrides=high)) == stock_greedy[0]
    low = RequestOverrides(gear="low", request_tag="low")
    list(gear_engine.generate(prompts[1], 6, overrides=low))
    (rec,) = gear_engine.request_records("low")
    assert rec["gears"] == ["low"] * 6 and rec["pinned"] == "low"


def test_group_size_the_model_cannot_take_is_refused_at_start(model_dir) -> None:
    cfg = {"precision": {"policy": "fixed", "gear": "int4", "group_size": 128}}
    with pytest.raises(AdaptiveConfigError, match=r"adaptive\.precision\.group_size: 128"):
        MlxEngine(model_dir, cfg, dtype=DTYPE)


def test_exit_profile_runs_and_exits(model_dir, depth_profile, prompts, stock_greedy) -> None:
    # no floor: exits may start at the first decode token (the default floor tapers over 16)
    cfg = {"depth": {"profile": str(depth_profile), "floor": None}}
    eng = MlxEngine(model_dir, cfg, dtype=DTYPE)
    code = prompts[0]
    list(eng.generate(code, 16, overrides=_tag("d")))
    (rec,) = eng.request_records("d")
    depths = rec["depths"]
    assert len(depths) == 16 and depths[0] == 30
    assert min(depths) < 30, depths  # tokens exited
    assert all(a >= b for a, b in zip(depths[1:], depths[2:], strict=False)), depths  # monotone
    assert set(depths) <= {*eng.depth.profile.probe_layers, 30}
    # a request at budget 1.0 runs every layer: stock output
    full = RequestOverrides(depth_budget=1.0, request_tag="full")
    assert list(eng.generate(code, NEW, overrides=full)) == stock_greedy[0]
    assert set(eng.request_records("full")[0]["depths"]) == {30}


def test_profile_of_another_model_is_refused(model_dir, depth_profile, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for f in Path(model_dir).iterdir():
        if f.name != "config.json":
            (other / f.name).symlink_to(f)
    text = (Path(model_dir) / "config.json").read_text()
    (other / "config.json").write_text(text.replace('"unk_token_id": 0', '"unk_token_id": 3'))
    with pytest.raises(AdaptiveConfigError, match=r"adaptive\.depth\.profile: .*different model"):
        MlxEngine(other, {"depth": {"profile": str(depth_profile)}}, dtype=DTYPE)


def test_lowbit_self_draft_is_lossless(model_dir, stock, prompts, stock_greedy) -> None:
    eng = MlxEngine(model_dir, {"speculative": {"draft": "lowbit"}}, dtype=DTYPE)
    for i, (p, want) in enumerate(zip(prompts, stock_greedy, strict=True)):
        assert list(eng.generate(p, NEW, overrides=_tag(f"s{i}"))) == want
    (rec,) = eng.request_records("s0")
    assert rec["mechanism"] == "speculative" and rec["drafted"] > 0 and rec["accepted"] > 0
    assert rec["emitted"] == NEW
    # Seeded sampling. The first token is drawn from the target's prompt logits before any
    # draft, so with the same seed it is mlx-lm's own sampler's; later tokens come from the
    # verifier's own draws (same distribution, other draws): the seed must decide them, also
    # after a request with another seed.
    model, _ = stock
    seeded = {s: list(eng.generate(prompts[1], 4, Sampling(0.8, 0.95, seed=s))) for s in (7, 9)}
    assert list(eng.generate(prompts[1], 4, Sampling(0.8, 0.95, seed=7))) == seeded[7]
    assert seeded[7] != seeded[9]  # control: the seed decides the draws
    mx.random.seed(7)
    sampler = make_sampler(0.8, 0.95)
    ref = generate_step(mx.array(prompts[1]), model, max_tokens=1, sampler=sampler)
    assert seeded[7][:1] == [t for t, _ in ref]
    assert seeded[7][0] != stock_greedy[1][0]  # (seed 7 draws a token that is not the argmax)
    assert eng.telemetry()["speculative"]["acceptance"] > 0


@pytest.mark.skipif(
    not mx.metal.is_available(), reason="needs Apple silicon (Metal); MLX here is the CPU build"
)
def test_identity_on_the_metal_device(model_dir, prompts) -> None:
    mx.set_default_device(mx.gpu)
    try:
        model, _ = load_mlx(model_dir, DTYPE)
        want = [t for t, _ in generate_step(mx.array(prompts[1]), model, max_tokens=NEW)]
        eng = MlxEngine(model_dir, {}, dtype=DTYPE)
        assert list(eng.generate(prompts[1], NEW)) == want
    finally:
        mx.set_default_device(mx.cpu)
