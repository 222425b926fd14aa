"""Where one decode step's time goes: torch.profiler over a short greedy generation.

Runs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profiler sees the
model's ops, and prints the top operators by self CPU time. Used to explain the gap between the
bandwidth ideal and measured gear speed-ups (docs/precision.md).

    python docs/experiments/profile_decode.py MODEL_DIR \
        '{"precision": {"policy": "fixed", "gear": "int8"}}'
    python docs/experiments/profile_decode.py MODEL_DIR stock
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model, config = sys.argv[1], sys.argv[2]
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
    if config == "stock":
        os.environ["VLLM_PLUGINS"] = ""
        additional = {}
    else:
        additional = {"adaptive": json.loads(config)}
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        additional_config=additional,
        seed=0,
    )
    prompts = [f"Item {i}: the quick brown fox jumps over the lazy dog" for i in range(batch)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
