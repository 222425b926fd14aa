"""In-process A/B of the depth runtime between two versions of the plugin's code: best-of-3
decode tok/s at batch 1 and 8, one engine per process, with the engine's depth counters.

    PYTHONPATH=runs/code/<commit> python docs/experiments/depth_code_ab.py PROFILE   # before
    python docs/experiments/depth_code_ab.py PROFILE                                  # after

Optional after PROFILE: a dtype (default bfloat16), a budget (default 0.85; "profile": the
profile's own) and a precision gear (e.g. fp16; default none).

(`vllm-adaptive bench-serve` extracts runs/code/<commit> for a server spec with "code".) Run
the two alternately (A B A B): this host's noise is larger than the difference sought.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path


def main() -> None:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's function
    from vllm import LLM, SamplingParams

    import vllm_adaptive
    from vllm_adaptive.environment import cpu_flags
    from vllm_adaptive.model_zoo import model_dir

    profile = sys.argv[1]
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    budget = sys.argv[3] if len(sys.argv) > 3 else "0.85"
    gear = sys.argv[4] if len(sys.argv) > 4 else None
    adaptive: dict = {"depth": {"profile": profile}}
    if budget != "profile":
        adaptive["depth"]["budget"] = float(budget)
    if gear:
        adaptive["precision"] = {"policy": "fixed", "gear": gear}
    llm = LLM(
        model=str(model_dir("smollm2-135m-instruct")),
        dtype=dtype,
        max_model_len=1024,
        seed=0,
        additional_config={"adaptive": adaptive},
    )
    corpus = Path("runs/corpora/prose.txt")
    if not corpus.is_file():  # `vllm-adaptive calibrate` writes the corpora here
        corpus = Path.home() / ".cache/vllm-adaptive/corpora/prose.txt"
    words = corpus.read_text()[50000:80000].split()
    prompts = [" ".join(words[i * 60 : (i + 1) * 60]) for i in range(8)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    out: dict = {
        "code": vllm_adaptive.__file__,
        "cpu": platform.processor() or os.uname().machine,
        "isa": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
    }
    for batch in (1, 8):
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            llm.generate(prompts[:batch], params, use_tqdm=False)
            best = max(best, batch * 64 / (time.perf_counter() - t0))
        out[f"batch{batch}_tok_s"] = round(best, 1)
    from vllm_adaptive.introspection import depth_telemetry

    eng = llm.apply_model(depth_telemetry)[0]["engine"]
    keys = ("steps", "whole_stack_steps", "span_steps", "peels", "exit_tokens")
    keys += ("decision_seconds", "forward_seconds", "block_compile_seconds")
    out["engine"] = {k: eng.get(k) for k in keys}
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
