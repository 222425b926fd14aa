"""Outputs of named workloads on one engine, for comparing engines across processes.

    python -m tests.support.engine_outputs MODEL_DIR ENGINE_ARGS_JSON WORKLOADS_JSON OUT.json

Run with ``VLLM_PLUGINS=""`` for stock vLLM with the plugin not loaded (``engines.run_stock``).
"""

from __future__ import annotations

import json
import sys

from tests.support.workloads import run_workloads

if __name__ == "__main__":
    from vllm import LLM

    model, engine_args, names, out = sys.argv[1:5]
    llm = LLM(model=model, **json.loads(engine_args))
    with open(out, "w") as f:
        json.dump(run_workloads(llm, json.loads(names)), f)
