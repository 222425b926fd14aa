"""The per-request gear record both runtimes (vLLM's and the MLX adapter) report when a request
finishes: one definition, so that telemetry means the same thing on either."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_adaptive.gears import LEVEL_NAMES

#: a step's code: a gear level, or "off" (the request ran unreduced)
CODE_NAMES = (*LEVEL_NAMES, "off")


def decode_shifts(codes: Sequence[int]) -> int:
    """Gear changes between decode steps. ``codes[0]`` is the step that read the prompt and made
    the first token: a prompt run at another gear than the first decode step is not a shift."""
    decode = codes[1:]
    return sum(a != b for a, b in zip(decode, decode[1:], strict=False))


def gear_record(
    tag: str,
    prompt_len: int,
    codes: Sequence[int],
    entropies: Sequence[float],
    pinned: int | None,
) -> dict[str, Any]:
    """``codes[i]``: the code of the step that made token ``i``; ``entropies``: the entropy in
    bits of each distribution a token was sampled from (empty when the policy reads none)."""
    counts = {name: 0 for name in CODE_NAMES}
    for c in codes:
        counts[CODE_NAMES[c]] += 1
    return {
        "tag": tag,
        "mechanism": "precision",
        "prompt_tokens": prompt_len,
        "generated_tokens": len(codes),
        "gear_tokens": counts,
        "shifts": decode_shifts(codes),
        "mean_entropy_bits": sum(entropies) / len(entropies) if entropies else None,
        "entropy_bits": [round(e, 4) for e in entropies],
        "gears": [CODE_NAMES[c] for c in codes],
        "pinned": CODE_NAMES[pinned] if pinned is not None else None,
    }
