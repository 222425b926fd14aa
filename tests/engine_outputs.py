"""Greedy outputs of one engine, for comparing engines in separate processes.

python tests/engine_outputs.py MODEL_DIR ADDITIONAL_CONFIG_JSON OUT.json
Run with VLLM_PLUGINS="" for stock vLLM with the plugin not loaded.
"""

from __future__ import annotations

import json
import sys

from identity_workload import run_identity_workload  # noqa: E402 (script dir on sys.path)

if __name__ == "__main__":
    from vllm import LLM

    model, extra, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    llm = LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        seed=0,
        max_model_len=1024,
        additional_config=extra,
    )
    with open(out, "w") as f:
        json.dump(run_identity_workload(llm), f)
