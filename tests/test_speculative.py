"""Self-speculative decoding through real vLLM engines (float32): the output is stock vLLM's.

Greedy: token-identical to the same engine without speculation, alone and in mixed batches,
with chunked prefill, prefix-cache hits and preemption, for a low-precision draft that is not on
the model's grid (so drafts are often rejected) and an early-layer draft (rejected most of the
time). Random sampling: the distribution of a drafted position matches the target model's,
tested with a chi-square test on the most likely tokens (with a negative control that shows the
test can fail).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from vllm_adaptive.config import SELF_SPECULATIVE_PROPOSER

pytestmark = pytest.mark.engine

NUM_BLOCKS = 12  # x 128 slots: the long batch preempts
ENGINE_ARGS = {
    "dtype": "float32",
    "enable_prefix_caching": True,
    "num_gpu_blocks_override": NUM_BLOCKS,
    "max_num_batched_tokens": 256,  # long prompts prefill in chunks
    "disable_log_stats": False,
}
WORDS = "the of model cache layer token draft verify block request batch accept".split()
PROMPTS = [
    "def quicksort(items):\n    ",
    "The history of the printing press",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef softmax(x):",
    "Once upon a time, in a small village by the sea,",
    "The apt-get command installs packages. To remove a package and its configuration files, run",
]
STAT_PROMPT = "The capital of France is"
STAT_SAMPLES = 1200


def _greedy(n: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy_workload(llm) -> dict[str, list[list[int]]]:
    """Alone, a mixed batch (lengths 1..64, one long prompt prefilled in chunks), a prefix-cache
    continuation of a finished request, and a batch too large for the KV cache (preemption)."""
    out = {"alone": [_ids(llm.generate([p], _greedy(40), use_tqdm=False))[0] for p in PROMPTS]}
    long_prompt = "Chapter one. " + " ".join(WORDS * 40)
    batch = [*PROMPTS, long_prompt]
    lengths = [1, 64, 17, 40, 5, 33, 24]
    out["batch"] = _ids(llm.generate(batch, [_greedy(n) for n in lengths], use_tqdm=False))
    first = llm.generate([PROMPTS[1]], _greedy(160), use_tqdm=False)[0]  # fills a 128-slot block
    ids = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    out["prefix"] = _ids(llm.generate([{"prompt_token_ids": ids}], _greedy(32), use_tqdm=False))
    preempt = [f"Part {k}. " + " ".join(WORDS) for k in range(5)]
    out["preempt"] = _ids(llm.generate(preempt, _greedy(300), use_tqdm=False))
    return out


def _metric(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def _spec_engine(model_dir: Path, draft: dict, k: int):
    from tests.conftest import _make_llm

    return _make_llm(
        model_dir,
        {"adaptive": {"speculative": draft}},
        speculative_config={
            "method": "custom_class",
            "model": SELF_SPECULATIVE_PROPOSER,
            "num_speculative_tokens": k,
        },
        **ENGINE_ARGS,
    )


@pytest.fixture(scope="module")
def stock_f32(model_dir: Path) -> dict:
    """The workloads on the same engine without speculation, and the target's exact
    next-token distribution after the most likely first token of STAT_PROMPT."""
    from vllm import SamplingParams

    from tests.conftest import _make_llm, _shutdown

    llm = _make_llm(model_dir, {}, **ENGINE_ARGS)
    try:
        ref = greedy_workload(llm)
        assert _metric(llm, "vllm:num_preemptions") > 0  # the workload really preempts
        first = llm.generate([STAT_PROMPT], _greedy(1), use_tqdm=False)[0]
        t1 = first.outputs[0].token_ids[0]
        nxt = llm.generate(
            [{"prompt_token_ids": list(first.prompt_token_ids) + [t1]}],
            SamplingParams(temperature=1.0, max_tokens=1, logprobs=20, seed=0),
            use_tqdm=False,
        )[0]
        logprobs = nxt.outputs[0].logprobs[0]
        ref["stat"] = {"t1": t1, "p": {t: math.exp(lp.logprob) for t, lp in logprobs.items()}}
    finally:
        _shutdown(llm)
    return ref


@pytest.fixture(scope="module")
def lowbit_llm(model_dir: Path, stock_f32: dict):
    """Started after the stock engine is gone: each engine re-registers vLLM's Prometheus
    metrics, and the counters read here must be this engine's."""
    from tests.conftest import _shutdown

    # symmetric absmax int4 is off the default model's Q4_1 grid: drafts are often wrong
    llm = _spec_engine(model_dir, {"draft": "lowbit", "precision": "int4", "symmetric": True}, 4)
    yield llm
    _shutdown(llm)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def _check_identity(llm, ref: dict) -> None:
    drafts0 = _metric(llm, "vllm:spec_decode_num_draft_tokens")
    accepted0 = _metric(llm, "vllm:spec_decode_num_accepted_tokens")
    preempt0 = _metric(llm, "vllm:num_preemptions")
    hits0 = _metric(llm, "vllm:prefix_cache_hits")
    got = greedy_workload(llm)
    for key in ("alone", "batch", "prefix", "preempt"):
        assert len(got[key]) == len(ref[key])
        for i, (a, b) in enumerate(zip(got[key], ref[key], strict=True)):
            assert a == b, f"{key}[{i}]: first difference at token {_first_difference(a, b)}"
    drafted = _metric(llm, "vllm:spec_decode_num_draft_tokens") - drafts0
    accepted = _metric(llm, "vllm:spec_decode_num_accepted_tokens") - accepted0
    assert drafted > 1000  # speculation really ran
    assert 0 < accepted < drafted  # some drafts accepted, some rejected
    assert _metric(llm, "vllm:num_preemptions") > preempt0
    assert _metric(llm, "vllm:prefix_cache_hits") > hits0


def test_lowbit_draft_greedy_identical_to_no_speculation(lowbit_llm, stock_f32: dict) -> None:
    _check_identity(lowbit_llm, stock_f32)


def test_request_with_mode_off_gets_no_drafts(lowbit_llm, stock_f32: dict) -> None:
    """``adaptive_mode: "off"`` turns drafting off for that request only; output unchanged."""
    from vllm import SamplingParams

    def drafts_for(params) -> tuple[float, list[list[int]]]:
        before = _metric(lowbit_llm, "vllm:spec_decode_num_draft_tokens")
        outs = lowbit_llm.generate(PROMPTS[:2], params, use_tqdm=False)
        return _metric(lowbit_llm, "vllm:spec_decode_num_draft_tokens") - before, _ids(outs)

    off = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, extra_args={"adaptive_mode": "off"}
    )
    drafted, ids = drafts_for([off, off])
    assert drafted == 0
    assert ids == stock_f32["alone"][:2]
    drafted, ids = drafts_for([off, _greedy(40)])  # one of two drafts: fewer, not none
    assert 0 < drafted <= 4 * 40
    assert ids == stock_f32["alone"][:2]


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: Counter, probs: dict[int, float], total: int) -> tuple[float, int]:
    """Chi-square of ``counts`` against ``probs`` over the tokens expected >= 5 times, the
    remaining mass pooled into one bucket."""
    keep = [t for t, p in probs.items() if p * total >= 5]
    other_p = 1.0 - sum(probs[t] for t in keep)
    stat = sum((counts[t] - probs[t] * total) ** 2 / (probs[t] * total) for t in keep)
    other = total - sum(counts[t] for t in keep)
    if other_p * total >= 5:
        stat += (other - other_p * total) ** 2 / (other_p * total)
        return stat, len(keep)
    return stat, len(keep) - 1


def test_lowbit_draft_sampling_keeps_target_distribution(lowbit_llm, stock_f32: dict) -> None:
    from vllm import SamplingParams

    stat = stock_f32["stat"]
    drafts0 = _metric(lowbit_llm, "vllm:spec_decode_num_draft_tokens")
    accepted0 = _metric(lowbit_llm, "vllm:spec_decode_num_accepted_tokens")
    params = [
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s)
        for s in range(STAT_SAMPLES)
    ]
    outs = lowbit_llm.generate([STAT_PROMPT] * STAT_SAMPLES, params, use_tqdm=False)
    second = Counter(
        o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == stat["t1"]
    )
    total = sum(second.values())
    assert total >= 300, f"only {total} samples began with the most likely token"
    drafted = _metric(lowbit_llm, "vllm:spec_decode_num_draft_tokens") - drafts0
    accepted = _metric(lowbit_llm, "vllm:spec_decode_num_accepted_tokens") - accepted0
    assert drafted > STAT_SAMPLES and 0 < accepted < drafted  # drafts both kept and rejected

    probs = {int(t): p for t, p in stat["p"].items()}
    value, df = _chi2(second, probs, total)
    assert value < _chi2_critical(df), (value, df, second.most_common(8))
    # negative control: the same samples against the target at temperature 0.6 are rejected
    z = sum(p ** (1 / 0.6) for p in probs.values())
    sharp = {t: p ** (1 / 0.6) / z * sum(probs.values()) for t, p in probs.items()}
    wrong, df_w = _chi2(second, sharp, total)
    assert wrong > _chi2_critical(df_w), (wrong, df_w)


def test_early_layer_draft_greedy_identical(model_dir: Path, stock_f32: dict) -> None:
    from tests.conftest import _shutdown

    llm = _spec_engine(model_dir, {"draft": "early", "layers": 4}, 2)
    try:
        _check_identity(llm, stock_f32)
    finally:
        _shutdown(llm)


def test_m2r2_draft_greedy_identical(model_dir: Path, stock_f32: dict, tmp_path: Path) -> None:
    """The accelerated-stream path (adapters on q, o and the MLP) through a real engine. The
    adapter has random non-zero up-projections so every delta is exercised; quality of trained
    adapters is the bench's business (docs/speculative.md)."""
    import torch

    from tests.conftest import _shutdown
    from vllm_adaptive.depth.profile import model_fingerprint
    from vllm_adaptive.m2r2.adapters import AdapterConfig, M2R2Adapters

    cfg = AdapterConfig.from_model_config(
        json.loads((model_dir / "config.json").read_text()),
        mode="spec",
        k=3,
        rank=4,
    )
    adapters = M2R2Adapters.zeros(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in adapters.named_parameters():
            if name.endswith(("q_B", "o_B", "mlp_U")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    adapters.save(tmp_path / "adapter", {"model_fingerprint": model_fingerprint(model_dir)})
    llm = _spec_engine(model_dir, {"draft": "m2r2", "adapter": str(tmp_path / "adapter")}, 3)
    try:
        _check_identity(llm, stock_f32)
    finally:
        _shutdown(llm)
