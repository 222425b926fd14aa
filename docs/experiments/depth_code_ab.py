"""In-process A/B of the depth runtime between two versions of the plugin's code: best-of-3
decode tok/s at batch 1 and 8 (bf16, EMAD budget 0.85), one engine per process.

    PYTHONPATH=runs/code/<commit> python docs/experiments/depth_code_ab.py PROFILE   # before
    python docs/experiments/depth_code_ab.py PROFILE                                  # after

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
    from vllm import LLM, SamplingParams

    import vllm_adaptive
    from vllm_adaptive.environment import cpu_flags
    from vllm_adaptive.model_zoo import model_dir

    profile = sys.argv[1]
    llm = LLM(
        model=str(model_dir("smollm2-135m-instruct")),
        dtype="bfloat16",
        max_model_len=1024,
        seed=0,
        additional_config={"adaptive": {"depth": {"profile": profile, "budget": 0.85}}},
    )
    words = Path("runs/corpora/prose.txt").read_text()[50000:80000].split()
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
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
