"""In-process A/B of adaptive depth at budget 1.0 against the same engine without depth.

Two engines in one process (bf16, the fixed int8 gear; the second with depth at budget 1.0),
timed in alternating segments: 4 prompts one at a time, then 8 together, 64 greedy tokens each.
The depth engine runs two arms, its quiet steps on and off (``DepthRuntime._quiet_steps``,
toggled between segments), so the three arms share one host state per round. The engines'
helpers are called by reference to this module (importable by vLLM's engine processes, which
inherit the script directory on ``sys.path``).

    .venv/bin/python docs/experiments/depth_quiet_ab.py --profile runs/emad-tf097v8k \\
        --prompts runs/bench-bf16-depth/prompts-c8.jsonl --rounds 8
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

MODEL = Path("~/.cache/vllm-adaptive/models/smollm2-135m-instruct").expanduser()


def _set_quiet(flag: bool, model) -> bool:
    model.model.depth_runtime._quiet_steps = flag
    return flag


def set_quiet(flag: bool):
    return functools.partial(_set_quiet, flag)


def counters(model) -> dict[str, float]:
    c = model.model.depth_runtime.counters
    return {"steps": c.steps, "quiet": c.quiet_steps, "decision": c.decision_seconds}


def main() -> None:
    import depth_quiet_ab as me  # by reference: the engine processes import this module
    from vllm import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="an EMAD exit profile directory")
    ap.add_argument("--prompts", required=True, help="JSONL with a 'prompt' per line (>= 8)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None, help="JSON of every segment's tok/s")
    args = ap.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's helpers
    gear = {"precision": {"policy": "fixed", "gear": "int8"}}
    depth = {**gear, "depth": {"profile": args.profile, "budget": 1.0}}
    kw = dict(dtype="bfloat16", max_model_len=2048, seed=0, gpu_memory_utilization=0.3)
    a = LLM(model=str(MODEL), additional_config={"adaptive": gear}, **kw)
    b = LLM(model=str(MODEL), additional_config={"adaptive": depth}, **kw)
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][:8]
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for llm in (a, b):
        llm.generate(prompts[:2], sp, use_tqdm=False)
    arms = {"gear": (a, None), "quiet": (b, True), "plan": (b, False)}
    res: dict[str, dict[str, list[float]]] = {k: {"c1": [], "c8": []} for k in arms}
    for r in range(args.rounds):
        for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            llm, flag = arms[name]
            if flag is not None:
                llm.apply_model(me.set_quiet(flag))
                c0 = llm.apply_model(me.counters)[0]
            t0 = time.perf_counter()
            for p in prompts[:4]:
                llm.generate([p], sp, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            t2 = time.perf_counter()
            res[name]["c1"].append(4 * 64 / (t1 - t0))
            res[name]["c8"].append(8 * 64 / (t2 - t1))
            line = f"round {r} {name}: c1 {res[name]['c1'][-1]:.1f} c8 {res[name]['c8'][-1]:.1f}"
            if flag is not None:
                c1 = llm.apply_model(me.counters)[0]
                steps = max(c1["steps"] - c0["steps"], 1)
                line += f" quiet steps {c1['quiet'] - c0['quiet']} of {steps}"
                line += f", decision {1000 * (c1['decision'] - c0['decision']) / steps:.3f} ms/step"
            print(line, flush=True)
    for name in ("quiet", "plan"):
        for conc in ("c1", "c8"):
            ratios = sorted(y / x for x, y in zip(res["gear"][conc], res[name][conc], strict=True))
            print(f"{name} / gear at {conc}: median {ratios[len(ratios) // 2]:.3f}", ratios)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
