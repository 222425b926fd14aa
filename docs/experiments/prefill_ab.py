"""Prefill time of N x 100-token random-token prompts (max_tokens 1), one engine per process:
`VLLM_PLUGINS="" python prefill_ab.py stock` against `python prefill_ab.py off` (the plugin
with every mechanism off), bf16, six repetitions per batch, run alternately (stock, off, stock,
off) to see whether the plugin adds prefill time beyond the host's noise."""

from __future__ import annotations

import json
import os
import random
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = os.path.expanduser("~/.cache/vllm-adaptive/models/smollm2-135m-instruct")
    kw = {} if sys.argv[1] == "stock" else {"additional_config": {"adaptive": {}}}
    llm = LLM(
        model=model, dtype="bfloat16", seed=0, max_model_len=2048, enable_prefix_caching=False, **kw
    )
    rng = random.Random(0)
    res = {}
    for n in (1, 8):
        ts = []
        for _ in range(6):
            prompts = [
                TokensPrompt(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(100)])
                for _ in range(n)
            ]
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            ts.append(time.perf_counter() - t)
        res[n] = [round(x * 1000, 1) for x in ts]
    print("RESULT", sys.argv[1], json.dumps(res), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
