"""Gemma 3 270M, the second architecture, through real vLLM engines.

With the plugin loaded and no adaptive section the engine is stock vLLM; with
``{"adaptive": {}}`` the adaptive class runs with every mechanism off and is token-identical to
stock (greedy and seeded sampling, alone and in one mixed batch); precision gears run on it;
every mechanism it cannot support stops the engine at start with a message naming the key
(adaptive depth: ``test_gemma3_depth.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engines import GEMMA3_NUM_BLOCKS, REPO, make_llm, shutdown, suite_engine_args
from tests.support.workloads import MAX_TOKENS, PROMPTS, run_workloads
from vllm_adaptive.introspection import describe_model, describe_parts, gear_telemetry


@pytest.fixture(scope="module", params=["plugin-off", "adaptive-all-off"])
def engine(request, gemma_dir: Path):
    """Plugin loaded but no adaptive section (must be stock vLLM), then the adaptive class
    with every mechanism off; one at a time."""
    config = {} if request.param == "plugin-off" else {"adaptive": {}}
    llm = make_llm(gemma_dir, config, num_gpu_blocks_override=GEMMA3_NUM_BLOCKS)
    yield request.param, llm
    shutdown(llm)


def test_reference_is_sane(stock_gemma_bf16: dict, gemma_dir: Path) -> None:
    from transformers import AutoTokenizer

    ref = stock_gemma_bf16["identity"]
    assert len(ref["alone"]) == len(PROMPTS)
    assert all(len(seq) == MAX_TOKENS for seq in ref["alone"] + ref["batch"])
    assert ref["batch"][2] != ref["alone"][2]  # the seeded request really sampled
    text = AutoTokenizer.from_pretrained(gemma_dir).decode(ref["alone"][1])
    assert "return" in text, text  # "def fibonacci(n):" (base model, fed its BOS)


def test_model_class(engine) -> None:
    name, llm = engine
    (info,) = llm.apply_model(describe_model)
    if name == "plugin-off":
        assert info == {
            "class": "vllm.model_executor.models.gemma3.Gemma3ForCausalLM",
            "adaptive_config": None,
        }
    else:
        assert info["class"] == "vllm_adaptive.models.gemma3.AdaptiveGemma3ForCausalLM"
        assert info["adaptive_config"]["precision"] is None


def test_model_interface(engine, gemma_dir: Path) -> None:
    """Gemma 3's parts: the four norms per block, query/key norms, the per-layer sliding
    window of its layer type, the scaled embedding; no layer is a Llama block."""
    name, llm = engine
    (parts,) = llm.apply_model(describe_parts)
    if name == "plugin-off":
        assert parts is None
        return
    cfg = json.loads((gemma_dir / "config.json").read_text())
    assert parts["owned"] and parts["num_layers"] == cfg["num_hidden_layers"] == 18
    assert parts["embedding_scale"] == pytest.approx(cfg["hidden_size"] ** 0.5)
    windows = [layer["sliding_window"] for layer in parts["layers"]]
    want = [cfg["sliding_window"] if t == "sliding_attention" else None for t in cfg["layer_types"]]
    assert windows == want and None in windows and 512 in windows
    for layer in parts["layers"]:
        assert layer["owned"], layer["index"]
        assert layer["linears"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
        assert layer["optional"] == [
            "act_fn",
            "pre_feedforward_norm",
            "post_feedforward_norm",
            "q_norm",
            "k_norm",
        ]
        assert layer["block_recipe"] is None


def test_identical_to_stock(engine, stock_gemma_bf16: dict) -> None:
    name, llm = engine
    got, ref = run_workloads(llm, ["identity"])["identity"], stock_gemma_bf16["identity"]
    for i, (a, b) in enumerate(zip(got["alone"], ref["alone"], strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None, f"{name}: prompt {i} alone diverges from stock at token {first}"
    assert got["batch"] == ref["batch"], name


GEARS = {
    "precision": {
        "policy": "gearbx",
        "routing": "token",
        "gearbx": {
            "calibration": "none",
            "cold_start": False,
            "window": 2,
            "min_gear_duration": 2,
            "theta_low": 1.0,
            "theta_high": 2.5,
        },
    }
}


def test_gears_run_and_stay_close_to_full_precision(gemma_dir: Path) -> None:
    """GEARBX per-token gears through vLLM's own Gemma 3 linears: requests shift gears, and a
    request pinned to full precision in the same engine matches the greedy text of the geared
    ones closely (Gemma 3's Q5_0/Q4_K/Q6_K grid is not the int4 grid the low gear uses)."""
    from vllm import SamplingParams

    llm = make_llm(gemma_dir, {"adaptive": GEARS}, num_gpu_blocks_override=GEMMA3_NUM_BLOCKS)
    try:

        def params(tag: str, **extra):
            return SamplingParams(
                temperature=0.0,
                max_tokens=32,
                ignore_eos=True,
                extra_args={"adaptive_request_tag": tag, **extra},
            )

        prompts = PROMPTS[:4]
        geared = llm.generate(prompts, [params(f"g{i}") for i in range(4)], use_tqdm=False)
        full = llm.generate(
            prompts, [params(f"f{i}", adaptive_mode="off") for i in range(4)], use_tqdm=False
        )
        int8 = llm.generate(
            prompts, [params(f"m{i}", adaptive_gear="mid") for i in range(4)], use_tqdm=False
        )
        tel = {r["tag"]: r for r in llm.apply_model(gear_telemetry)[0]["finished"]}
    finally:
        shutdown(llm)
    gears_used = set()
    for i in range(4):
        assert sum(tel[f"g{i}"]["gear_tokens"].values()) == 32
        gears_used |= {g for g, n in tel[f"g{i}"]["gear_tokens"].items() if n}
        assert tel[f"f{i}"]["gear_tokens"]["off"] == 32
        assert tel[f"m{i}"]["gear_tokens"]["mid"] == 32
    assert len(gears_used) > 1, tel
    # int8 (the mid gear) barely moves greedy output; the entropy-routed mix moves it more
    agree8 = [
        sum(a == b for a, b in zip(m.outputs[0].token_ids, f.outputs[0].token_ids, strict=True))
        for m, f in zip(int8, full, strict=True)
    ]
    assert sum(agree8) / (32 * 4) >= 0.7, agree8
    assert all(len(g.outputs[0].token_ids) == 32 for g in geared)


# Every mechanism is refused by the same check in the adaptive class's constructor: one engine
# start shows the wiring (the refusal stops the engine, the log names the key);
# tests/unit/test_gemma3_support.py checks the message of every refused config.
REFUSED = {
    "depth": (
        {"depth": {"profile": "/nonexistent", "kv_strategy": "monotone"}},
        "adaptive.depth: the runtime peels rows on layer 0's attention metadata and records "
        "one depth per KV slot, and vLLM's hybrid KV cache splits Gemma 3's layers",
    ),
}
_SPEC = {
    "method": "custom_class",
    "model": "vllm_adaptive.speculative.proposer.SelfSpeculativeProposer",
    "num_speculative_tokens": 2,
}
_TRY_ENGINES = """
import json, sys
from vllm import LLM
if __name__ == "__main__":
    model, args, cases = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    for name, (adaptive, spec) in cases.items():
        print(f"=== {name}", file=sys.stderr, flush=True)
        try:
            extra = {"speculative_config": spec} if spec else {}
            LLM(model=model, additional_config={"adaptive": adaptive}, **args, **extra)
            print(f"=== {name} STARTED", file=sys.stderr, flush=True)
        except Exception as e:
            print(f"=== {name} FAILED {type(e).__name__}", file=sys.stderr, flush=True)
"""


def test_unsupported_mechanisms_stop_the_engine_at_start(gemma_dir: Path) -> None:
    """A refused config fails a real engine's start, and the log names the key and why (one
    child process tries each config in turn)."""
    cases = {
        name: (adaptive, _SPEC if "speculative" in adaptive else None)
        for name, (adaptive, _) in REFUSED.items()
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _TRY_ENGINES,
            str(gemma_dir),
            json.dumps(suite_engine_args(num_gpu_blocks_override=GEMMA3_NUM_BLOCKS)),
            json.dumps(cases),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ},
    )
    log = proc.stdout + proc.stderr  # vLLM logs to stdout, the markers go to stderr
    for name, (_, needle) in REFUSED.items():
        assert f"=== {name} FAILED" in log, (name, log[-3000:])
        assert needle in log, (name, log[-3000:])
    assert "STARTED" not in log
