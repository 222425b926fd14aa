"""How the suite builds, reads and stops real vLLM engines.

Every engine of the suite uses one set of engine arguments per dtype (``suite_engine_args``):
prefix caching on, a 12-block KV cache (long batches preempt) and 256-token prefill chunks, so
that prefix hits, preemption and chunked prefill happen in every engine's workload, and so that
an adaptive engine and its stock reference always run the same kernels on the same shapes.
(bf16 kernels on AVX512-BF16 machines sum differently for different batch and chunk shapes:
only like can be compared with like.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

NUM_BLOCKS = 12  # x 128 slots: long batches preempt
#: Gemma 3 270M: vLLM's hybrid KV cache splits its 15 sliding-window and 3 global layers into 6
#: groups of 3 layers, and a request holds blocks in every group, so one 1024-token request
#: needs more than 12 blocks; 48 still make the identity batch (10 requests x 6 groups) preempt.
GEMMA3_NUM_BLOCKS = 48


def suite_engine_args(dtype: str = "bfloat16", **overrides: Any) -> dict[str, Any]:
    """The engine arguments every suite engine and its stock reference share."""
    args = {
        "dtype": dtype,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": 1024,
        "enable_prefix_caching": True,
        "num_gpu_blocks_override": NUM_BLOCKS,
        "max_num_batched_tokens": 256,  # long prompts prefill in chunks
        "disable_log_stats": False,  # preemption, prefix-hit and draft counters
    }
    return args | overrides


def make_llm(model_dir: Path, additional_config: dict, **engine_args: Any):
    """A real ``vllm.LLM`` with the suite's arguments; ``engine_args`` add to or override them."""
    from vllm import LLM

    args = suite_engine_args(engine_args.pop("dtype", "bfloat16")) | engine_args
    return LLM(model=str(model_dir), additional_config=additional_config, **args)


def shutdown(llm) -> None:
    """Stop the engine's processes now rather than at interpreter exit."""
    llm.llm_engine.engine_core.shutdown()


def metric(llm, name: str) -> float:
    """The current value of one of the engine's Prometheus counters (summed over labels)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def run_stock(model_dir: Path, engine_args: dict, workloads: list[str], out: Path) -> dict:
    """Run named workloads (``tests/support/workloads.py``) on stock vLLM in a child process
    with the plugin not loaded (``VLLM_PLUGINS=""``); returns their outputs."""
    env = {**os.environ, "VLLM_PLUGINS": ""}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.engine_outputs",
            str(model_dir),
            json.dumps(engine_args),
            json.dumps(workloads),
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def amx_bf16_attention() -> bool:
    """vLLM's CPU attention runs its 'amx' kernel for the suite's bf16 engines on this CPU."""
    import torch

    from vllm_adaptive.engine.vllm_api import cpu_attn_isa

    return cpu_attn_isa(torch.bfloat16, 128, 64) == "amx"


#: AMX CPUs only: a batch's bf16 greedy tokens can differ late in a sequence (token 17-24 of 32)
#: between the stock reference (a child process, plugin not loaded) and an engine in the test
#: process, the plugin's inactive class and vLLM's own class alike (both seen in the CI runs of
#: 2026-11-26 on an AMX Xeon; single prompts stay identical). Through `vllm serve`, stock against
#: itself also gave different text on 4 of 16 requests at 8 concurrent (docs/results.md). Not
#: root-caused (the process's thread setup is the first suspect); the comparison still runs and
#: reports xfail on a mismatch.
AMX_EAGER_DRIFT = (
    "AMX CPUs: a batch's bf16 greedy tokens differ between processes, stock's own class "
    "included (tests/support/engines.py AMX_EAGER_DRIFT)"
)
