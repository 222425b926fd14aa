"""Free-running greedy agreement with stock: what a user sees change.

Teacher-forced agreement compares the greedy token at every position of a fixed text, so one
early difference costs one position. In free-running decoding the first different token sends
the rest of the output elsewhere: a config that changes the first answer token of most prompts
can still read 0.999 teacher-forced (issue 15). Both are reported side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_divergence(run: Sequence[int], reference: Sequence[int], n: int) -> int:
    """Index of the first of the first ``n`` positions where the tokens differ (``n`` if none;
    a position missing from one side counts as different)."""
    for i in range(n):
        if i >= len(run) or i >= len(reference) or run[i] != reference[i]:
            return i
    return n


def free_running_agreement(
    run: Sequence[Sequence[int]], reference: Sequence[Sequence[int]], n: int = 64
) -> dict[str, Any]:
    """Agreement of greedy outputs over the first ``n`` tokens of each prompt.

    - ``agreement``: fraction of positions (over all prompts) where both emitted the same token,
      position by position (after a divergence, matches are coincidences of the two texts);
    - ``first_divergence_mean``: mean index of the first differing token (``n`` if none);
    - ``identical_prompts``: fraction of prompts whose first ``n`` tokens are all identical;
    - ``first_token_changed``: fraction of prompts whose very first output token differs.
    """
    if len(run) != len(reference):
        raise ValueError(f"{len(run)} outputs against {len(reference)} reference outputs")
    if not run or n < 1:
        raise ValueError("need at least one prompt and n >= 1")
    same = 0
    firsts = []
    for a, b in zip(run, reference, strict=True):
        same += sum(1 for i in range(n) if i < len(a) and i < len(b) and a[i] == b[i])
        firsts.append(first_divergence(a, b, n))
    prompts = len(run)
    return {
        "tokens": n,
        "prompts": prompts,
        "agreement": same / (n * prompts),
        "first_divergence_mean": sum(firsts) / prompts,
        "identical_prompts": sum(f == n for f in firsts) / prompts,
        "first_token_changed": sum(f == 0 for f in firsts) / prompts,
        "first_divergence": firsts,
    }
