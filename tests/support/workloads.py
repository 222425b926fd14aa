"""The fixed workloads engines run, by name, so that an adaptive engine in the test process and
stock vLLM in a child process (``engine_outputs``) run exactly the same requests.

Each workload takes an ``LLM`` and returns JSON-able token ids.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\n# compute the mean of a list\n",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "A list of the planets of the solar system, in order from the Sun:",
    "The apt-get command installs packages. To remove a package and its configuration files, run",
    "Q: Why is the sky blue?\nA:",
    "for i in range(10):",
    "In 1969,",
]
MAX_TOKENS = 32  # long enough to show drift (batch-shape numerics), short enough for the tier
# Two seeded random-sampling requests ride in the mixed batch: per-request seeds
# must reproduce exactly across engines too.
SEEDED = {2: 1234, 7: 99}
EXITS_OFF_PROMPTS = 4  # the first prompts, as one greedy batch (KV-strategy engines)


def _params(i: int | None, extra_args: dict | None = None) -> Any:
    from vllm import SamplingParams

    if i in SEEDED:
        return SamplingParams(
            temperature=0.8,
            top_p=0.95,
            seed=SEEDED[i],
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            extra_args=extra_args,
        )
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=extra_args
    )


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def identity(llm: Any) -> dict[str, list[list[int]]]:
    """Each prompt alone (greedy), then all prompts as one mixed batch (greedy and seeded)."""
    alone = [_ids(llm.generate([p], _params(None), use_tqdm=False))[0] for p in PROMPTS]
    llm.reset_prefix_cache()
    batch = llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    return {"alone": alone, "batch": _ids(batch)}


def exits_off(llm: Any, extra_args: dict | None = None) -> list[list[int]]:
    """The first prompts as one greedy batch (``extra_args`` turn exits off on depth engines)."""
    prompts = PROMPTS[:EXITS_OFF_PROMPTS]
    return _ids(llm.generate(prompts, [_params(None, extra_args) for _ in prompts], use_tqdm=False))


# -- speculative decoding ----------------------------------------------------------------------
SPEC_WORDS = "the of model cache layer token draft verify block request batch accept".split()
SPEC_PROMPTS = [
    "def quicksort(items):\n    ",
    "The history of the printing press",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef softmax(x):",
    "Once upon a time, in a small village by the sea,",
    "The apt-get command installs packages. To remove a package and its configuration files, run",
]
STAT_PROMPT = "The capital of France is"


def _greedy(n: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def spec_mixed(llm: Any) -> dict[str, list[list[int]]]:
    """Each prompt alone, and a mixed batch (lengths 1..64, one long prompt prefilled in
    chunks)."""
    out = {"alone": [_ids(llm.generate([p], _greedy(40), use_tqdm=False))[0] for p in SPEC_PROMPTS]}
    long_prompt = "Chapter one. " + " ".join(SPEC_WORDS * 40)
    batch = [*SPEC_PROMPTS, long_prompt]
    lengths = [1, 64, 17, 40, 5, 33, 24]
    out["batch"] = _ids(llm.generate(batch, [_greedy(n) for n in lengths], use_tqdm=False))
    return out


def spec_cache(llm: Any) -> dict[str, list[list[int]]]:
    """A prefix-cache continuation of a finished request, and a batch too large for the KV
    cache (preemption)."""
    first = llm.generate([SPEC_PROMPTS[1]], _greedy(160), use_tqdm=False)[0]  # fills a block
    ids = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    out = {"prefix": _ids(llm.generate([{"prompt_token_ids": ids}], _greedy(32), use_tqdm=False))}
    preempt = [f"Part {k}. " + " ".join(SPEC_WORDS) for k in range(5)]
    out["preempt"] = _ids(llm.generate(preempt, _greedy(300), use_tqdm=False))
    return out


def spec_stat(llm: Any) -> dict[str, Any]:
    """The target's exact next-token distribution after the most likely first token of
    STAT_PROMPT (top 20 probabilities)."""
    from vllm import SamplingParams

    first = llm.generate([STAT_PROMPT], _greedy(1), use_tqdm=False)[0]
    t1 = first.outputs[0].token_ids[0]
    nxt = llm.generate(
        [{"prompt_token_ids": list(first.prompt_token_ids) + [t1]}],
        SamplingParams(temperature=1.0, max_tokens=1, logprobs=20, seed=0),
        use_tqdm=False,
    )[0]
    logprobs = nxt.outputs[0].logprobs[0]
    return {"t1": t1, "p": {str(t): math.exp(lp.logprob) for t, lp in logprobs.items()}}


# -- ARLA --------------------------------------------------------------------------------------
ARLA_NEW_TOKENS = 8
ARLA_EXIT_PROMPTS = [
    "def quicksort(items):\n    ",
    "The history of the printing press",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\ndef softmax(x):",
]
ARLA_OFF_PROMPTS = [  # exits off (budget 1.0), in the same batch; one shares an exiting prompt
    "The history of the printing press",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
]


def arla_batch(llm: Any) -> list[list[int]]:
    """The ARLA engine test's batch, all greedy (stock: every row is a full-depth row)."""
    prompts = ARLA_EXIT_PROMPTS + ARLA_OFF_PROMPTS
    return _ids(llm.generate(prompts, _greedy(ARLA_NEW_TOKENS), use_tqdm=False))


WORKLOADS: dict[str, Callable[[Any], Any]] = {
    "identity": identity,
    "exits_off": exits_off,
    "spec_mixed": spec_mixed,
    "spec_cache": spec_cache,
    "spec_stat": spec_stat,
    "arla_batch": arla_batch,
}


def run_workloads(llm: Any, names: list[str]) -> dict[str, Any]:
    """Run the named workloads in order, each on a fresh prefix cache."""
    out = {}
    for name in names:
        llm.reset_prefix_cache()
        out[name] = WORKLOADS[name](llm)
    return out
