"""What a drafter costs on steps where vLLM's per-batch-size schedule gives it k = 0.

Engines on the fixed fp16 gear (float32 activations), all in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no idle engine's worker polls while another runs), 8
concurrent greedy requests of equal length: the schedule ``[[1, 1, 3], [2, 1024, 0]]`` never
drafts here. Rounds interleave the engines (reversed every other round); the median wall per
engine is written as JSON.

- ``none``: no drafter;
- ``suffix``: vLLM's suffix drafter (its trees still learn the step's tokens at k = 0);
- ``eagle3``: an EAGLE-3 head (vLLM runs its first pass at k = 0 to keep the head's KV in step);
- ``eagle3-skip``: the same head with that pass skipped (the head's KV goes stale: only for timing,
  it would lower acceptance once drafting resumes), to price the pass itself.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python \\
        docs/experiments/idle_drafter_cost.py --head runs/eagle3-h200-6m --rounds 6 \\
        --out docs/data/idle-drafter-cost-avx2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

SCHEDULE = [[1, 1, 3], [2, 1024, 0]]


def _skippable_first_pass(skip: list[bool]) -> None:
    """Let vLLM's EAGLE proposer return no drafts at k = 0 without running the head."""
    import torch
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    orig = SpecDecodeBaseProposer.propose

    def propose(self, num_speculative_tokens, *args, **kwargs):
        if skip[0] and num_speculative_tokens == 0:
            batch = kwargs["common_attn_metadata"].batch_size()
            return torch.empty(batch, 0, dtype=torch.int64)
        return orig(self, num_speculative_tokens, *args, **kwargs)

    SpecDecodeBaseProposer.propose = propose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="~/.cache/vllm-adaptive/models/smollm2-135m-instruct")
    ap.add_argument("--head", required=True, help="an EAGLE-3 head directory for the model")
    ap.add_argument("--corpus", default="~/.cache/vllm-adaptive/corpora/prose.txt")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise SystemExit("run with VLLM_ENABLE_V1_MULTIPROCESSING=0 (see the module doc)")

    from vllm import LLM, SamplingParams

    from vllm_adaptive.bench.env import cpu_info, versions

    skip = [False]
    _skippable_first_pass(skip)
    head = str(Path(args.head).resolve())
    eagle = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    specs = {
        "none": None,
        "suffix": {
            "method": "suffix",
            "num_speculative_tokens": 3,
            "suffix_decoding_max_cached_requests": 0,
            "num_speculative_tokens_per_batch_size": SCHEDULE,
        },
        "eagle3": {**eagle, "num_speculative_tokens_per_batch_size": SCHEDULE},
        "eagle3-skip": {**eagle, "num_speculative_tokens_per_batch_size": SCHEDULE},
    }
    llms = {}
    for name, spec in specs.items():
        kw = dict(
            model=os.path.expanduser(args.model),
            dtype="float32",
            max_model_len=2048,
            enable_prefix_caching=False,
            additional_config={"adaptive": {"precision": {"policy": "fixed", "gear": "fp16"}}},
        )
        if spec:
            kw["speculative_config"] = spec
        print(f"starting {name}", flush=True)
        llms[name] = LLM(**kw)
    text = Path(os.path.expanduser(args.corpus)).read_text()
    prompts = [text[20000 + 3000 * i : 20500 + 3000 * i] for i in range(args.requests)]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, llm in llms.items():  # warm-up
        skip[0] = name == "eagle3-skip"
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    walls: dict[str, list[float]] = {n: [] for n in llms}
    for r in range(args.rounds):
        for name in list(llms) if r % 2 == 0 else list(reversed(llms)):
            skip[0] = name == "eagle3-skip"
            t = time.perf_counter()
            llms[name].generate(prompts, sp, use_tqdm=False)
            walls[name].append(time.perf_counter() - t)
        print(f"round {r + 1}/{args.rounds}", {n: round(w[-1], 3) for n, w in walls.items()})
    base = statistics.median(walls["none"])
    result = {
        "question": "cost of a drafter scheduled to k = 0 at 8 concurrent requests",
        "env": {"cpu": cpu_info(), "versions": versions("vllm", "torch")},
        "args": {k: str(v) for k, v in vars(args).items()},
        "schedule": SCHEDULE,
        "engines": {
            n: {
                "median_s": round(statistics.median(w), 3),
                "vs_none": round(statistics.median(w) / base, 3),
                "walls_s": [round(x, 3) for x in w],
            }
            for n, w in walls.items()
        },
        "identical_to_none": {n: outs[n] == outs["none"] for n in outs},
    }
    print(json.dumps(result["engines"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    os._exit(0)  # engines in this process: skip their atexit teardown


if __name__ == "__main__":
    main()
