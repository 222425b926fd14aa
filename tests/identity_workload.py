"""The fixed workload the identity tests run on every engine."""

from __future__ import annotations

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
MAX_TOKENS = 64
# Two seeded random-sampling requests ride in the mixed batch: per-request seeds
# must reproduce exactly across engines too.
SEEDED = {2: 1234, 7: 99}


def _params(i: int | None) -> Any:
    from vllm import SamplingParams

    if i in SEEDED:
        return SamplingParams(
            temperature=0.8, top_p=0.95, seed=SEEDED[i], max_tokens=MAX_TOKENS, ignore_eos=True
        )
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run_identity_workload(llm: Any) -> dict[str, list[list[int]]]:
    """Each prompt alone (greedy), then all prompts as one mixed batch."""
    alone = [
        list(llm.generate([p], _params(None), use_tqdm=False)[0].outputs[0].token_ids)
        for p in PROMPTS
    ]
    llm.reset_prefix_cache()
    batch = llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    return {"alone": alone, "batch": [list(o.outputs[0].token_ids) for o in batch]}
