"""What a decode step costs as a function of the tokens in it: the price of verification.

Speculative decoding pays off when verifying ``k + 1`` tokens in one step costs about as much
as decoding one (the weights are read once for all of them). Whether that holds depends on the
GEMM kernels at small M. This tool measures it through stock vLLM (plugin not loaded, served
the usual way: engine core in its own process): the inter-token latency of a batch of M
requests is the time of a step with M tokens, M = 1..``--max-tokens-per-step``.

It also prints what that curve allows: for a draft with mean accepted length ``L`` (tokens
emitted per step, vLLM's ``mean_acceptance_length``), k drafts and a draft cost of ``d``
one-token steps per drafted token, the speed-up is ``L / (step(k+1)/step(1) + k * d)``, and
the best any draft can do (``d = 0``, every draft accepted) is ``(k+1) / (step(k+1)/step(1))``.

    vllm-adaptive step-cost --model MODEL_DIR --dtype bfloat16 \
        --json docs/data/step-cost-bf16.json --plot docs/figures/step-cost.png

About two minutes per dtype on 2 cores (one engine start, 9 batch sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def _log(msg: str) -> None:
    print(f"[step-cost] {msg}", file=sys.stderr, flush=True)


def measure(
    model: str, dtype: str, max_m: int, decode_tokens: int, compiled: bool = False
) -> dict[str, Any]:
    """Inter-token latency (seconds) per batch size 1..max_m on a stock engine (eager unless
    ``compiled``: vLLM's default torch.compile, a few minutes to compile here)."""
    os.environ["VLLM_PLUGINS"] = ""  # stock vLLM: the step cost of the model itself
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_adaptive.bench.engine_run import measure_throughput
    from vllm_adaptive.engine.vllm_api import LLM

    llm = LLM(model=model, dtype=dtype, enforce_eager=not compiled, seed=0, max_model_len=512)
    prompts = [[(17 * i + 31 * j) % 20000 + 100 for j in range(32)] for i in range(max_m)]
    _log(f"{dtype}: steps with 1..{max_m} tokens, {decode_tokens} decode steps each")
    res = measure_throughput(llm, prompts, list(range(1, max_m + 1)), decode_tokens, 2)
    llm.llm_engine.engine_core.shutdown()
    return {str(m): res["itl_s"][str(m)] for m in range(1, max_m + 1)}


def best_case(step: dict[str, float], k: int) -> float:
    """Speed-up with free drafts that are always accepted: k+1 tokens per (k+1)-token step."""
    return (k + 1) / (step[str(k + 1)] / step["1"])


def predicted(step: dict[str, float], k: int, accepted_length: float, draft_cost: float) -> float:
    """Speed-up for mean accepted length L and a draft costing ``draft_cost`` one-token steps
    per drafted token."""
    return accepted_length / (step[str(k + 1)] / step["1"] + k * draft_cost)


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for dtype, step in results.items():
        ms = sorted(int(m) for m in step)
        ax.plot(ms, [step[str(m)] / step["1"] for m in ms], "o-", label=f"stock vLLM, {dtype}")
    ms = sorted(int(m) for m in next(iter(results.values())))
    ax.plot(ms, [1.0] * len(ms), "k--", lw=1, label="flat (what speculation assumes)")
    ax.plot(ms, ms, ":", color="gray", lw=1, label="proportional (no batching gain)")
    ax.set_xlabel("tokens in the decode step (k + 1 when verifying k drafts)")
    ax.set_ylabel("step time / one-token step time")
    ax.set_title("Cost of verifying k+1 tokens, this CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm-adaptive step-cost", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", action="append", choices=["bfloat16", "float32"])
    ap.add_argument("--max-tokens-per-step", type=int, default=9)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--compiled", action="store_true", help="vLLM's default torch.compile")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    mode = "compiled" if args.compiled else "eager"
    results = {
        f"{dtype}, {mode}": measure(
            args.model, dtype, args.max_tokens_per_step, args.decode_tokens, args.compiled
        )
        for dtype in args.dtype or ["bfloat16"]
    }
    print("| dtype | " + " | ".join(f"M={m}" for m in results[next(iter(results))]) + " |")
    print("|---" * (len(next(iter(results.values()))) + 1) + "|")
    for dtype, step in results.items():
        cells = " | ".join(f"{step[m] / step['1']:.2f}" for m in step)
        print(f"| {dtype} (x one-token step {step['1'] * 1e3:.0f} ms) | {cells} |")
    for dtype, step in results.items():
        for k in (2, 4):
            if str(k + 1) in step:
                print(
                    f"{dtype}: best case k={k} (free drafts, all accepted): "
                    f"x{best_case(step, k):.2f}"
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(args.json.read_text())["itl_s"] if args.json.exists() else {}
        results = {**old, **results}  # one file for eager and compiled runs
        args.json.write_text(json.dumps({"itl_s": results}, indent=2) + "\n")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.plot)
    return 0
