"""Teacher forcing through vLLM's decode path.

`TeacherForcingLogitsProcessor` forces each decode step's token to the next
token of a held-out text (given per request in `extra_args[FORCE_KEY]`).
vLLM computes returned logprobs from the model's raw logits *before* logits
processors run, so with `logprobs=1` each step reports the forced token's
log-probability and the model's own greedy token: teacher-forced perplexity
and greedy agreement measured on exactly what the model does at decode time,
adaptive decisions included.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_adaptive.bench.metrics import ForcedStream, greedy_agreement, perplexity
from vllm_adaptive.engine.vllm_api import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    SamplingParams,
    VLLMValidationError,
)

__all__ = [
    "FORCE_KEY",
    "ForcedStream",
    "TeacherForcingLogitsProcessor",
    "greedy_agreement",
    "perplexity",
    "read_forced_output",
]

FORCE_KEY = "bench_force_tokens"


class TeacherForcingLogitsProcessor(LogitsProcessor):
    """Replaces each forced request's logits by a one-hot on its next text token."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        forced = (sampling_params.extra_args or {}).get(FORCE_KEY)
        if forced is None:
            return
        if not isinstance(forced, list) or not all(isinstance(t, int) and t >= 0 for t in forced):
            raise VLLMValidationError(
                f"{FORCE_KEY} must be a list of non-negative token ids", parameter=FORCE_KEY
            )
        if sampling_params.max_tokens is not None and sampling_params.max_tokens > len(forced):
            raise VLLMValidationError(
                f"{FORCE_KEY}: max_tokens ({sampling_params.max_tokens}) exceeds the "
                f"{len(forced)} forced tokens",
                parameter=FORCE_KEY,
            )

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        # batch row -> (forced token ids, live reference to the request's output ids)
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            forced = (params.extra_args or {}).get(FORCE_KEY) if params is not None else None
            if forced is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (forced, output_ids)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows, targets = [], []
        for index, (forced, output_ids) in self.rows.items():
            step = len(output_ids)
            if step < len(forced):
                rows.append(index)
                targets.append(forced[step])
        if rows:
            r = torch.tensor(rows, device=logits.device)
            t = torch.tensor(targets, device=logits.device)
            logits[r] = float("-inf")
            logits[r, t] = 0.0
        return logits


def read_forced_output(output: Any, forced: list[int]) -> ForcedStream:
    """Extract per-position logprobs of the forced tokens and the greedy tokens.

    Position 0 is produced by the prefill pass, not by a decode step, so it is
    dropped: what remains is scored through the decode path only.
    """
    completion = output.outputs[0]
    if list(completion.token_ids) != forced[: len(completion.token_ids)]:
        raise RuntimeError("teacher forcing failed: the engine did not emit the forced tokens")
    lps, greedy = [], []
    for pos, entry in enumerate(completion.logprobs or []):
        if pos == 0:
            continue
        tok = forced[pos]
        lps.append(entry[tok].logprob)
        greedy.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return ForcedStream(lps, greedy)
