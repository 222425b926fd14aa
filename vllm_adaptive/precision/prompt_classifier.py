"""GEARBX's cold-start prompt classifier (section 11): an initial gear before any entropy exists.

    score = 2 n_math + 1.5 n_code + 0.3 min(|W| / 50, 3) + 1.5 [mean word length > 6.5]

Scores >= 4.0 start in high gear, >= 1.5 in mid, else low. The paper names the counted classes
(mathematical symbols; programming and reasoning keywords) but not the lists; the lists below are
ours. Observed entropy overrides the cold-start gear within a few decode steps.
"""

from __future__ import annotations

import re

from vllm_adaptive.gears import HIGH, LOW, MID

MATH_SYMBOLS = frozenset("=+-*/^<>≤≥≠≈∑∏∫√∞πθλσμ∂∇%")
CODE_KEYWORDS = frozenset(
    """def class return import from lambda function var let const if else elif for while
    async await try except catch finally struct enum impl fn pub int float void bool null none
    true false print printf console select where join prove proof theorem lemma therefore hence
    because derive compute calculate solve step algorithm complexity""".split()
)
HIGH_SCORE = 4.0
MID_SCORE = 1.5

_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def prompt_score(text: str) -> float:
    """The paper's score for one prompt."""
    words = text.split()
    n_math = sum(ch in MATH_SYMBOLS for ch in text)
    n_code = sum(w.lower() in CODE_KEYWORDS for w in _WORD.findall(text))
    mean_len = sum(len(w) for w in words) / len(words) if words else 0.0
    return (
        2.0 * n_math
        + 1.5 * n_code
        + 0.3 * min(len(words) / 50.0, 3.0)
        + 1.5 * float(mean_len > 6.5)
    )


def cold_start_level(text: str) -> int:
    """Initial gear level of a prompt."""
    score = prompt_score(text)
    if score >= HIGH_SCORE:
        return HIGH
    if score >= MID_SCORE:
        return MID
    return LOW
