"""Draft sources: what computes a draft token's logits from the target model's own parts.

Each source is one class with ``forward(positions, token_ids) -> [rows, hidden]`` (the final-
normed hidden state of one draft position, a pure tensor function over parts gathered at
construction, so the proposer can compile it) and a ``head`` (:class:`DraftHead`), run inside a
one-token forward context (:mod:`vllm_adaptive.speculative.draft_step`). A new draft idea is one
new module here.
"""

from __future__ import annotations

from typing import Any

from vllm_adaptive.config import SpeculativeConfig


def build_draft(settings: SpeculativeConfig, model: Any, model_dir: str) -> Any:
    """The configured draft source for a loaded target ``model``."""
    if settings.draft == "early":
        from vllm_adaptive.speculative.drafts.early import EarlyLayersDraft

        return EarlyLayersDraft(model, settings.layers or 4, settings.head_precision)
    if settings.draft == "lowbit":
        from vllm_adaptive.speculative.drafts.lowbit import LowBitDraft

        return LowBitDraft(model, settings)
    from vllm_adaptive.speculative.drafts.m2r2 import M2R2Draft

    return M2R2Draft(model, settings, model_dir)


def describe(draft: Any) -> dict[str, Any]:
    """What a draft is, for logs and benches."""
    return {"name": draft.name, "resident_bytes": int(draft.resident_bytes())}
