"""Gear policies and the controller's batch mirror, isolated from the engine (the engine
tests are in test_precision_engine.py)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_adaptive.config import AdaptiveConfigError, parse_adaptive_config
from vllm_adaptive.gears import HIGH, LOW, MID
from vllm_adaptive.precision.calibration import percentile_thresholds
from vllm_adaptive.precision.entropy import entropy_bits
from vllm_adaptive.precision.policies import (
    GearbxMonitor,
    GearbxSettings,
    QuickSilverSettings,
    QuickSilverTiers,
)
from vllm_adaptive.precision.prompt_classifier import cold_start_level, prompt_score

V = 32768  # the reference vocabulary: no threshold scaling


def test_entropy_bits_bounds_and_nan_guard() -> None:
    uniform = torch.zeros(2, 1024)
    assert torch.allclose(entropy_bits(uniform), torch.full((2,), 10.0), atol=1e-4)
    peaked = torch.full((1, 1024), -1e4)
    peaked[0, 3] = 0
    assert entropy_bits(peaked).item() < 1e-3
    broken = torch.tensor([[float("nan"), float("inf"), 0.0, 1.0]])
    assert math.isfinite(entropy_bits(broken).item())


def test_entropy_bits_is_the_textbook_formula_without_touching_its_input() -> None:
    """The in-place computation (reused buffers) equals -(p . log p) / ln 2 on every row shape
    and dtype the engine passes, leaves the logits alone, and a result outlives the next call."""
    g = torch.Generator().manual_seed(0)
    for shape, dtype in (
        ((8, 49152), torch.bfloat16),
        ((3, 5, 100), torch.float32),
        ((1, 7), torch.float16),
    ):
        logits = (torch.randn(shape, generator=g) * 4).to(dtype)
        logits.view(-1, shape[-1])[0, :3] = float("-inf")
        before = logits.clone()
        logp = torch.log_softmax(torch.nan_to_num(logits.float(), neginf=-1e4), dim=-1)
        want = -(logp.exp() * logp).sum(-1) / math.log(2)
        got = entropy_bits(logits)
        assert got.shape == shape[:-1] and got.dtype == torch.float32
        assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
        assert torch.equal(logits, before)
        kept = got.clone()
        entropy_bits(torch.zeros(shape))  # the next step reuses the buffers
        assert torch.equal(got, kept)
    assert entropy_bits(torch.zeros(0, 10)).shape == (0,)


def test_native_entropy_equals_the_torch_path() -> None:
    """The C++ entropy (one pass for the maximum, one for the sums, nothing written) gives the
    torch path's values on the engine's shapes and dtypes, vocabularies that are not a multiple
    of its 16 lanes, and GEARBX's NaN / inf guard; it is used only once the kernels are loaded."""
    from vllm_adaptive.kernels import native
    from vllm_adaptive.precision.entropy import torch_entropy_bits

    if not native.ensure_built():
        pytest.skip(f"no native kernels here: {native.why_unavailable()}")
    op = native.loaded_entropy_op()
    assert op is not None
    g = torch.Generator().manual_seed(1)
    for rows, vocab, dtype in (
        (8, 49152, torch.float32),
        (3, 49157, torch.bfloat16),
        (2, 5, torch.float32),
    ):
        logits = (torch.randn(rows, vocab, generator=g) * 5).to(dtype)
        logits[0, 1] = float("nan")
        logits[1, -1] = float("inf")
        logits[-1, :2] = float("-inf")
        got, want = op(logits), torch_entropy_bits(logits)
        assert got.shape == (rows,) and got.dtype == torch.float32
        assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
        assert torch.equal(entropy_bits(logits), got)  # the engine's call takes the kernel
    assert op(torch.zeros(0, 7)).shape == (0,)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        op(torch.zeros(7))


def _run(monitor: GearbxMonitor, seq: list[float], level: int) -> tuple[list[int], int]:
    state = monitor.start(None)
    state.level = level
    gears = [monitor.observe(state, e) for e in seq]
    return gears, state.shifts


@pytest.mark.parametrize("duration", [1, 3, 8])
def test_gearbx_min_duration_bounds_shifts(duration: int) -> None:
    """Entropy oscillating across theta_low by far more than the hysteresis margin: the only
    brake left is the minimum gear duration, and it bounds the shifts."""
    m = GearbxMonitor(V, GearbxSettings(window=1, min_gear_duration=duration, cold_start=False))
    seq = [0.5, 3.0] * 50  # low, mid, low, mid ... (theta 1.8 / 3.5)
    gears, shifts = _run(m, seq, LOW)
    assert shifts <= len(seq) // duration
    runs, cur = [], 1
    for a, b in zip(gears, gears[1:], strict=False):
        if a == b:
            cur += 1
        else:
            runs.append(cur)
            cur = 1
    assert all(r >= duration for r in runs[1:])  # every completed run after the first held
    assert shifts > 0


def test_gearbx_hysteresis_holds_extreme_gears() -> None:
    """Oscillating within the hysteresis margin around a threshold never leaves low / high."""
    m = GearbxMonitor(V, GearbxSettings(window=1, min_gear_duration=1, cold_start=False))
    _, shifts = _run(m, [1.75, 1.85, 1.89] * 20, LOW)  # within theta_low + 0.1
    assert shifts == 0
    _, shifts = _run(m, [3.45, 3.55, 3.41] * 20, HIGH)  # within theta_high - 0.1
    assert shifts == 0
    _, shifts = _run(m, [1.95] * 5, LOW)  # beyond the margin: leaves low for mid
    assert shifts == 1


def test_gearbx_rolling_window_smooths_spikes() -> None:
    m = GearbxMonitor(V, GearbxSettings(window=5, min_gear_duration=1, cold_start=False))
    gears, _ = _run(m, [0.2, 0.2, 0.2, 0.2, 5.0, 0.2, 0.2], LOW)
    assert gears == [LOW] * 7  # one spike averaged over 5 tokens stays under theta_low + h


def test_gearbx_catastrophic_entropy_falls_back_at_once() -> None:
    m = GearbxMonitor(V, GearbxSettings(min_gear_duration=100, cold_start=False))
    gears, _ = _run(m, [0.1, 0.1, 14.0, 14.0], LOW)
    assert gears[-1] == HIGH  # two tokens above 0.9 * log2 V, despite the 100-token duration


def test_gearbx_vocabulary_scaling() -> None:
    m = GearbxMonitor(49152)
    scale = math.log2(49152) / 15.0
    assert m.theta_low == pytest.approx(1.8 * scale)
    assert m.theta_high == pytest.approx(3.5 * scale)


def test_percentile_calibration() -> None:
    e = [0.1 * i for i in range(1, 101)]  # 0.1 .. 10.0
    low, high = percentile_thresholds(e, V, cap_low=None, cap_high=None)
    assert low == pytest.approx(3.0) and high == pytest.approx(6.1)
    low, high = percentile_thresholds(e, V)  # the PyTorch backend's caps
    assert low == pytest.approx(0.06 * 15) and high == pytest.approx(0.12 * 15)
    low, high = percentile_thresholds([1.0] * 10, V)  # degenerate band widened to 0.2
    assert high - low == pytest.approx(0.2)
    with pytest.raises(ValueError, match="at least 5"):
        percentile_thresholds([1.0, 2.0], V)


def test_calibration_replaces_thresholds() -> None:
    m = GearbxMonitor(V)
    assert m.wants_calibration
    m.calibrate([0.1 * i for i in range(1, 101)])
    assert not m.wants_calibration and m.theta_low == pytest.approx(0.9)


def test_cold_start_classifier() -> None:
    assert cold_start_level("hello there") == LOW
    code = "def solve(x):\n    return x ** 2 + 3 * x - 7  # compute the root"
    assert prompt_score(code) >= 4.0 and cold_start_level(code) == HIGH
    mid = "Please explain why the algorithm works in simple words for a beginner"
    assert cold_start_level(mid) == MID


def test_quicksilver_tiers() -> None:
    q = QuickSilverTiers(V, QuickSilverSettings(history=8, min_history=4))
    state = q.start(None)
    assert state.level == HIGH
    levels = [q.observe(state, e) for e in [1.0, 3.0, 2.0]]
    assert levels == [HIGH] * 3  # scale unknown until min_history entropies
    assert q.observe(state, 1.1) == LOW  # normalized (1.1-1)/(3-1) = 0.05 < 0.3
    assert q.observe(state, 2.0) == MID  # 0.5
    assert q.observe(state, 2.9) == HIGH  # 0.95


def test_precision_config_errors_name_the_key() -> None:
    with pytest.raises(AdaptiveConfigError, match="adaptive.precision.gearbx.windw: unknown key"):
        parse_adaptive_config({"precision": {"policy": "gearbx", "gearbx": {"windw": 3}}})
    with pytest.raises(AdaptiveConfigError, match='needs "gear"'):
        parse_adaptive_config({"precision": {"policy": "fixed"}})
    with pytest.raises(AdaptiveConfigError, match="cheapest"):
        parse_adaptive_config(
            {"precision": {"policy": "gearbx", "gears": ["full", "int8", "int4"]}}
        )
    with pytest.raises(AdaptiveConfigError, match="theta_low"):
        parse_adaptive_config(
            {"precision": {"policy": "gearbx", "gearbx": {"theta_low": 4.0, "theta_high": 3.0}}}
        )
    with pytest.raises(AdaptiveConfigError, match="overlap"):
        parse_adaptive_config(
            {
                "precision": {
                    "policy": "gearbx",
                    "layer_groups": [
                        {"layers": [0, 10], "gears": ["int8", "int8", "full"]},
                        {"layers": [5, 20], "gears": ["int4", "int8", "full"]},
                    ],
                }
            }
        )


def test_layer_maps_and_defaults() -> None:
    qs = parse_adaptive_config({"precision": {"policy": "quicksilver"}}).precision
    assert qs.layer_map(0, 30) == ("int8", "int8", "int8")  # first half at the high tier
    assert qs.layer_map(29, 30) == ("int2", "int4", "int8")
    assert qs.effective_routing == "token" and qs.effective_tiers == "matryoshka"
    gb = parse_adaptive_config({"precision": {"policy": "gearbx"}}).precision
    assert gb.layer_map(0, 30) == ("int4", "int8", "full") and gb.effective_routing == "step"
    fx = parse_adaptive_config({"precision": {"policy": "fixed", "gear": "int2"}}).precision
    assert fx.layer_map(7, 30) == ("int2", "int2", "int2")


def test_fixed_gear_with_layers_of_their_own() -> None:
    """A fixed gear keeps named layers at another precision (what `calibrate --gear-plan`
    writes); each policy's groups take their own shape, and the wrong one is named."""
    fx = parse_adaptive_config(
        {
            "precision": {
                "policy": "fixed",
                "gear": "w8a8",
                "layer_groups": [{"layers": [0, 3], "gear": "full"}],
            }
        }
    ).precision
    assert fx.layer_map(2, 30) == ("full", "full", "full")
    assert fx.layer_map(3, 30) == ("w8a8", "w8a8", "w8a8")
    bad = [
        (
            {"policy": "fixed", "gear": "w8a8"},
            {"layers": [0, 3], "gears": ["full"] * 3},
            'takes "gear"',
        ),
        ({"policy": "gearbx"}, {"layers": [0, 3], "gear": "full"}, 'takes "gears"'),
        ({"policy": "gearbx"}, {"layers": [0, 3]}, "one of them"),
    ]
    for precision, group, message in bad:
        with pytest.raises(AdaptiveConfigError, match=message):
            parse_adaptive_config({"precision": {**precision, "layer_groups": [group]}})


def _controller(policy: str = "gearbx", **settings):
    from vllm_adaptive.precision.controller import PrecisionController
    from vllm_adaptive.precision.policies import build_policy

    cfg = parse_adaptive_config({"precision": {"policy": policy, **settings}}).precision
    return PrecisionController(cfg, build_policy(cfg, V), [], tokenizer_path=None)


def test_controller_mirrors_the_persistent_batch(tmp_path, monkeypatch) -> None:
    """Slots follow vLLM's batch updates: removed, then added, then moved / swapped."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality

    from vllm_adaptive.batch_mirror import admit
    from vllm_adaptive.telemetry_exchange import STATS_DIR_ENV, read_request_records

    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path))  # finished requests' records go there
    c = _controller()

    def update(batch_update: BatchUpdate) -> None:
        c.update_batch(admit(batch_update))  # as batch_mirror.notify hands it over

    def params(tag: str, **extra) -> SamplingParams:
        return SamplingParams(extra_args={"adaptive_request_tag": tag, **extra})

    update(
        BatchUpdate(
            batch_size=3,
            removed=[],
            added=[
                (0, params("a"), [1, 2, 3], []),
                (1, params("b", adaptive_gear="low"), [4], []),
                (2, params("c", adaptive_mode="off"), [5], []),
            ],
            moved=[],
        )
    )
    assert [c.slots[i].tag for i in range(3)] == ["a", "b", "c"]
    assert c.slots[1].code == LOW and c.slots[2].code == 3  # pinned low, off
    update(
        BatchUpdate(
            batch_size=2,
            removed=[0],
            added=[],
            moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)],
        )
    )
    assert {i: s.tag for i, s in c.slots.items()} == {0: "c", 1: "b"}
    assert [r["tag"] for r in c.finished] == ["a"]
    update(BatchUpdate(batch_size=2, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert {i: s.tag for i, s in c.slots.items()} == {0: "b", 1: "c"}
    update(BatchUpdate(batch_size=2, removed=[], added=[(1, params("d"), [6], [])], moved=[]))
    assert c.slots[1].tag == "d" and c.finished[-1]["tag"] == "c"  # replaced: c finished
    (rec,) = read_request_records("c", tmp_path)  # handed to the frontend's route
    assert rec["mechanism"] == "precision" and rec["pinned"] == "off"


def test_gearbx_default_gears_follow_the_activation_dtype() -> None:
    """float32 engines get the gears with fast float32 kernels; bf16 ones the paper's."""
    cfg = parse_adaptive_config({"precision": {"policy": "gearbx"}}).precision
    assert cfg.for_dtype("float32").level_gears == ("w8a8", "fp16", "fp16")
    assert cfg.for_dtype("bfloat16").level_gears == ("int4", "int8", "full")
    # CPUs whose plugin kernels run bf16 rows on AVX512-BF16's dot product (and AMX tiles):
    # int8 is the high gear (half of bf16's bytes); AMX without the plugin's kernels keeps vLLM's
    # W8A8 GEMM as its low gear; explicit gears stay
    assert cfg.for_dtype("bfloat16", native_bf16_dot=True).level_gears == ("int4", "int8", "int8")
    assert cfg.for_dtype("float32", native_bf16_dot=True).level_gears == ("w8a8", "fp16", "fp16")
    amx = cfg.for_dtype("bfloat16", amx_int8=True, native_bf16_dot=True)
    assert amx.level_gears == ("int4", "int8", "int8")
    # a checkpoint on a 4-bit grid (the default model's Q4_1 source): int4 there at every level
    grid = cfg.for_dtype("bfloat16", amx_int8=True, native_bf16_dot=True, on_4bit_grid=True)
    assert grid.level_gears == ("int4", "int4", "int4")
    assert grid.head_map == ("int8", "int8", "int8")  # Q8_0: the head comes back as well
    assert cfg.for_dtype("bfloat16", on_4bit_grid=True).level_gears == ("int4", "int8", "full")
    assert cfg.for_dtype("float32", on_4bit_grid=True).level_gears == ("w8a8", "fp16", "fp16")
    absmax = parse_adaptive_config({"precision": {"policy": "gearbx", "symmetric": True}})
    # the paper's absmax tiers do not give the grid back: GEARBX routes between gears again
    assert absmax.precision.for_dtype(
        "bfloat16", native_bf16_dot=True, on_4bit_grid=True
    ).level_gears == ("int4", "int8", "int8")
    amx_without_kernels = cfg.for_dtype("bfloat16", amx_int8=True, native_bf16_dot=False)
    assert amx_without_kernels.level_gears == ("w8a8", "full", "full")
    assert cfg.for_dtype("float32").head_map == ("fp16", "fp16", "fp16")
    explicit = parse_adaptive_config(
        {"precision": {"policy": "gearbx", "gears": ["int4", "int8", "full"]}}
    ).precision
    assert explicit.for_dtype("float32").level_gears == ("int4", "int8", "full")
    assert explicit.for_dtype("bfloat16", native_bf16_dot=True).level_gears == (
        "int4",
        "int8",
        "full",
    )
    # no int8 dot product (AVX2 only): W8A8 measured slower than fp16 there, so fp16 everywhere
    assert cfg.for_dtype("float32", int8_dot=False).level_gears == ("fp16", "fp16", "fp16")
    assert cfg.for_dtype("bfloat16", int8_dot=False).level_gears == ("int4", "int8", "full")
    assert explicit.for_dtype("float32", int8_dot=False).level_gears == ("int4", "int8", "full")
    smooth = {"policy": "gearbx", "smoothing": {"profile": "/p"}}
    cfg = parse_adaptive_config({"precision": smooth}).precision
    assert cfg.for_dtype("float32").smoothing.alpha == 0.5
    with pytest.raises(ValueError, match="smoothing.*bfloat16"):
        cfg.for_dtype("bfloat16")
    assert cfg.for_dtype("bfloat16", amx_int8=True).smoothing.alpha == 0.5
    # a SmoothQuant profile asks for the W8A8 low gear: AMX keeps it even where the plugin's
    # int8 / 4-bit kernels run
    with_kernels = cfg.for_dtype("bfloat16", amx_int8=True, native_bf16_dot=True)
    assert with_kernels.level_gears == ("w8a8", "full", "full")
    with pytest.raises(AdaptiveConfigError, match="smoothing"):
        parse_adaptive_config({"precision": {**smooth, "gears": ["int4", "int8", "full"]}})


def test_bf16_engines_on_amx_gear_onto_the_amx_int8_gemm_and_keep_their_head() -> None:
    cfg = parse_adaptive_config({"precision": {"policy": "gearbx"}}).precision
    amx = cfg.for_dtype("bfloat16", amx_int8=True)
    assert amx.level_gears == ("w8a8", "full", "full")
    assert amx.head_map is None  # the bf16 head runs vLLM's own GEMM at every level
    assert cfg.for_dtype("bfloat16").head_map is None
    fixed = parse_adaptive_config({"precision": {"policy": "fixed", "gear": "w8a8"}}).precision
    assert fixed.for_dtype("float32").head_map == ("fp16", "fp16", "fp16")
    assert fixed.for_dtype("bfloat16", amx_int8=True).level_gears == ("w8a8",) * 3
    mine = {"policy": "fixed", "gear": "w8a8", "head_gears": ["w8a16", "w8a16", "w8a16"]}
    assert (
        parse_adaptive_config({"precision": mine}).precision.for_dtype("bfloat16").head_map
        == ("w8a16",) * 3
    )
    head_only = {"policy": "fixed", "gear": "w8a8", "modules": ["lm_head"]}
    with pytest.raises(ValueError, match="head_gears"):
        parse_adaptive_config({"precision": head_only}).precision.for_dtype("bfloat16")


def test_prefill_runs_the_high_gear_and_decode_the_cold_start_gear(tmp_path, monkeypatch) -> None:
    """A short plain prompt cold-starts at the low gear, but its prefill (which makes the first
    token) runs high; pinned requests prefill at their pin."""
    from vllm_adaptive.overrides import parse_overrides

    c = _controller()
    cold = c._new_slot(parse_overrides(None), [1, 2, 3])
    cold.state.level = LOW  # what the classifier gives "The capital of France is"
    assert cold.prefill_code == HIGH
    assert [cold.code_at(p) for p in (0, 2, 3, 9)] == [HIGH, HIGH, LOW, LOW]
    pinned = c._new_slot(parse_overrides({"adaptive_gear": "low"}), [1, 2, 3])
    assert [pinned.code_at(p) for p in (2, 3)] == [LOW, LOW]
    off = c._new_slot(parse_overrides({"adaptive_mode": "off"}), [1, 2, 3])
    assert off.code_at(2) == off.code_at(3) == 3
    paper = parse_adaptive_config(
        {"precision": {"policy": "gearbx", "gearbx": {"prefill": "cold_start"}}}
    ).precision
    m = GearbxMonitor(V, paper.gearbx)
    state = m.start("hello there")
    assert state.level == LOW and m.prefill_level(state) == LOW  # the paper's listing 2


def test_precision_telemetry_counts_decode_tokens_gears_and_shifts(tmp_path, monkeypatch) -> None:
    from vllm_adaptive.precision.telemetry import PrecisionTelemetry
    from vllm_adaptive.telemetry_exchange import STATS_DIR_ENV, read_engine_stats

    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path))
    t = PrecisionTelemetry(30, {"policy": "gearbx", "routing": "step"})
    t.step_started(0.001)
    t.observed([("high", False, False), ("high", False, False)], 0.002)  # two first tokens
    t.observed([("low", True, False), ("high", True, False)], 0.002)
    t.observed([("low", True, False), ("mid", True, True)], 0.002)
    t.request_finished({"tag": "x", "mechanism": "precision"})
    (stats,) = read_engine_stats(tmp_path)
    assert stats["decode_tokens"] == 4 and stats["first_tokens"] == 2
    assert stats["gear_tokens"] == {"high": 1, "low": 2, "mid": 1} and stats["gear_shifts"] == 1
    assert stats["layers_executed"] == 120 and stats["exit_tokens"] == {"30": 4}
    assert stats["requests_finished"] == 1 and stats["decision_seconds"] == pytest.approx(0.007)
    assert stats["forward_seconds"] > 0


def test_fixed_gear_costs_no_entropy_and_no_prompt_decode(monkeypatch) -> None:
    """The fixed policy reads neither: the controller skips the per-step pass over the
    vocabulary and the per-request prompt decode, and still records each token's gear; GEARBX
    (a reader of both) still gets its entropies."""
    import numpy as np

    from vllm_adaptive.overrides import parse_overrides
    from vllm_adaptive.precision import controller as ctl

    calls = {"entropy": 0}

    def counting(logits):
        calls["entropy"] += 1
        return entropy_bits(logits)

    monkeypatch.setattr(ctl, "entropy_bits", counting)
    for policy, entropy_calls in (("fixed", 0), ("gearbx", 1)):
        calls["entropy"] = 0
        c = _controller(policy, **({"gear": "fp16"} if policy == "fixed" else {}))
        monkeypatch.setattr(c, "_prompt_text", lambda ids: pytest.fail("prompt decoded"))
        if policy == "gearbx":
            monkeypatch.setattr(c, "_prompt_text", lambda ids: None)
        c.slots[0] = c._new_slot(parse_overrides(None), [1, 2, 3])
        c.plan = ctl.GearStepPlan(1, np.array([HIGH]), None, np.array([3]), np.array([0, 1]))
        c.observe_logits(torch.randn(1, V))
        assert calls["entropy"] == entropy_calls
        rec = c.slots[0].record()
        assert rec["gears"] == ["high"]
        assert len(rec["entropy_bits"]) == entropy_calls


def test_low_bit_tiers_take_the_checkpoints_own_grid(caplog) -> None:
    """With "symmetric" unset, int4 / int2 tiers quantize asymmetrically where the checkpoint
    already lies on a 4-bit grid (a Q4_1 GGUF source: min/max gives it back) and symmetrically
    elsewhere; an explicit setting wins, and re-rounding a 4-bit grid is warned about."""
    from vllm_adaptive.models.precision import resolve_symmetric

    def cfg(**extra):
        return parse_adaptive_config({"precision": {"policy": "fixed", "gear": "int4", **extra}})

    assert cfg().precision.symmetric is None
    assert resolve_symmetric(cfg().precision, 0.97, "layers.0.qkv_proj") is False
    assert resolve_symmetric(cfg().precision, 0.0, "layers.0.qkv_proj") is True
    caplog.clear()
    with caplog.at_level("WARNING", logger="vllm.adaptive.precision"):
        assert resolve_symmetric(cfg(symmetric=True).precision, 0.97, "layers.0.qkv_proj")
    assert "re-round" in caplog.text and "int4" in caplog.text
    assert resolve_symmetric(cfg(symmetric=False).precision, 0.0, "x") is False
    caplog.clear()
    int8 = parse_adaptive_config({"precision": {"policy": "fixed", "gear": "int8"}}).precision
    with caplog.at_level("WARNING", logger="vllm.adaptive.precision"):
        resolve_symmetric(int8.model_copy(update={"symmetric": True}), 0.97, "x")
    assert caplog.text == ""  # no 4-bit tier to re-round


def test_gear_routing_and_speculation() -> None:
    """vLLM's drafters verify several rows per request: a policy that routes gears is refused
    at engine start naming its levels; one whose levels all run one precision composes."""
    from vllm_adaptive.models.precision import speculation_problem

    routed = [("int4", "int8", "int8", "full"), ("full", "full", "full", "full")]
    problem = speculation_problem("gearbx", routed)
    assert problem is not None and "int4/int8/int8" in problem and "fixed" in problem
    one = [("int4", "int4", "int4", "full"), ("int8", "int8", "int8", "full")]
    assert speculation_problem("gearbx", one) is None
    assert speculation_problem("fixed", routed) is None
