"""Stock vLLM's own free-running noise on held-out prompts (8 windows of 100 tokens, code and
prose, 64 greedy tokens): stock bf16 at 8 rows a step against stock bf16 one prompt at a time,
and against stock float32. (AMX Xeon, 2026-12-08: 0.85 and 0.52 of positions.)

    .venv/bin/python docs/experiments/stock_noise.py
"""

import json
import os

os.environ["VLLM_PLUGINS"] = ""
from pathlib import Path

from transformers import AutoTokenizer
from vllm import LLM, SamplingParams

from vllm_adaptive.bench.free_running import free_running_agreement
from vllm_adaptive.corpora import read_corpus, spread_windows

M = str(Path.home() / ".cache/vllm-adaptive/models/smollm2-135m-instruct")
C = Path.home() / ".cache/vllm-adaptive/corpora"
tok = AutoTokenizer.from_pretrained(M)
prompts = []
for name in ("code.txt", "prose.txt"):
    ids = tok(read_corpus(C / name).eval_text)["input_ids"]
    prompts += spread_windows(ids, 100, 4)
sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def run(dtype, batched):
    llm = LLM(model=M, dtype=dtype, max_model_len=512)
    ins = [{"prompt_token_ids": p} for p in prompts]
    if batched:
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(ins, sp, use_tqdm=False)]
    else:
        outs = [list(llm.generate([i], sp, use_tqdm=False)[0].outputs[0].token_ids) for i in ins]
    del llm
    return outs


def main():
    b8 = run("bfloat16", True)
    b1 = run("bfloat16", False)
    print("bf16 8 rows vs 1 row:", json.dumps(free_running_agreement(b8, b1)))
    import gc

    gc.collect()
    f8 = run("float32", True)
    print("bf16 vs float32, 8 rows:", json.dumps(free_running_agreement(b8, f8)))


if __name__ == "__main__":
    main()
