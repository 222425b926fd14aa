"""Teacher forcing through the decode path of an engine built with the bench's
``TeacherForcingLogitsProcessor`` (``LLM(logits_processors=[...])``)."""

from __future__ import annotations

import math
from typing import Any


def teacher_force(llm, prompt_ids: list[int], forced_ids: list[int], tag: str, **extra) -> Any:
    """Force ``forced_ids`` after ``prompt_ids``; the stream's per-position log-probabilities
    of the forced tokens and the model's own greedy tokens (``ForcedStream``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_adaptive.bench.teacher_forcing import FORCE_KEY, read_forced_output

    params = SamplingParams(
        temperature=0.0,
        max_tokens=len(forced_ids),
        ignore_eos=True,
        logprobs=1,
        extra_args={FORCE_KEY: forced_ids, "adaptive_request_tag": tag, **extra},
    )
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)
    return read_forced_output(out, forced_ids)


def agreement(stream, forced_ids: list[int]) -> float:
    """Fraction of positions where the greedy token is the forced (reference) one."""
    hits = sum(a == b for a, b in zip(stream.greedy, forced_ids[1:], strict=False))
    return hits / (len(forced_ids) - 1)


def perplexity(stream) -> float:
    return math.exp(-sum(stream.logprobs) / len(stream.logprobs))
