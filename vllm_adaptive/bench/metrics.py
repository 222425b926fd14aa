"""Quality figures of a bench run from per-position teacher-forced results (no vLLM, no torch):
the vLLM bench (``teacher_forcing.py``) and the MLX bench (``metal_backend/bench.py``) share
them, so both report perplexity and agreement the same way."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ForcedStream:
    """What one teacher-forced request yields, position by position."""

    logprobs: list[float]  # log p(forced token | prefix), decode steps only
    greedy: list[int]  # the model's argmax at the same positions


def perplexity(streams: list[ForcedStream]) -> float:
    total = [lp for s in streams for lp in s.logprobs]
    return math.exp(-sum(total) / len(total))


def greedy_agreement(run: list[ForcedStream], reference: list[ForcedStream]) -> float:
    """Share of teacher-forced positions where the run's argmax equals the reference's."""
    same = n = 0
    for a, b in zip(run, reference, strict=True):
        for x, y in zip(a.greedy, b.greedy, strict=True):
            same += int(x == y)
            n += 1
    return same / n


def free_running_agreement(run: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Free-running greedy generations against the reference's from the same prompts:
    ``positions``: share of positions holding the same token; ``prefix``: mean share of each
    generation that matches before the first difference (1.0: identical)."""
    same = n = 0
    prefixes = []
    for a, b in zip(run, reference, strict=True):
        length = max(len(a), len(b)) or 1
        same += sum(int(x == y) for x, y in zip(a, b, strict=False))
        n += length
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None:
            first = min(len(a), len(b))
        prefixes.append(first / length)
    return {
        "positions": same / n if n else 1.0,
        "prefix": sum(prefixes) / len(prefixes) if prefixes else 1.0,
    }
