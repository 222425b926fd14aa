"""Prefill time of N x 100-token random-token prompts (max_tokens 1), one engine per process:
`VLLM_PLUGINS="" python prefill_ab.py stock` against `python prefill_ab.py off` (the plugin
with every mechanism off), bf16, six repetitions per batch, run alternately (stock, off, stock,
off) to see whether the plugin adds prefill time beyond the host's noise.

`python prefill_ab.py fp16 float32` times the fixed fp16 gear instead, `fp16-suffix float32`
the gear under scripts/serve.sh's float32 drafter (vLLM's suffix decoding, drafting at one
request only), against `VLLM_PLUGINS="" python prefill_ab.py stock float32`."""

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
    mode = sys.argv[1]
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    fp16 = {"adaptive": {"precision": {"policy": "fixed", "gear": "fp16"}}}
    suffix = {
        "method": "suffix",
        "num_speculative_tokens": 8,
        "suffix_decoding_max_cached_requests": 0,
        "num_speculative_tokens_per_batch_size": [[1, 1, 8], [2, 1024, 0]],
    }
    kw = {
        "stock": {},
        "off": {"additional_config": {"adaptive": {}}},
        "fp16": {"additional_config": fp16},
        "fp16-suffix": {"additional_config": fp16, "speculative_config": suffix},
    }[mode]
    llm = LLM(
        model=model, dtype=dtype, seed=0, max_model_len=2048, enable_prefix_caching=False, **kw
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
    print("RESULT", mode, dtype, json.dumps(res), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
