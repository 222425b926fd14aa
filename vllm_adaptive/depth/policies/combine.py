"""Several exit signals as one: ``all`` (a row exits only if every signal agrees) or ``any``.

Signals run in the configured order; per-row signals only see the rows still undecided (for
``all`` the rows every earlier signal passed, for ``any`` the rows none passed yet), so put the
cheap ones (River's cosine, QuickSilver's drift) before EMAD's proxy. A batch-coupled signal
(River's batch minimum) always sees every candidate row, or its minimum would change meaning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_adaptive.depth.policies.probe import ExitSignal, ProbeBatch

MODES = ("all", "any")


class CombinedExitSignal:
    def __init__(self, signals: Sequence[ExitSignal], mode: str = "all"):
        if mode not in MODES:
            raise ValueError(f"combine mode must be one of {MODES}, not {mode!r}")
        if not signals:
            raise ValueError("a combination needs at least one signal")
        self.signals = list(signals)
        self.mode = mode

    @property
    def per_row(self) -> bool:
        return all(s.per_row for s in self.signals)

    @property
    def needs_prev_stream(self) -> bool:
        return any(s.needs_prev_stream for s in self.signals)

    @property
    def needs_token_ids(self) -> bool:
        return any(s.needs_token_ids for s in self.signals)

    def to(self, device: torch.device) -> CombinedExitSignal:
        for s in self.signals:
            if hasattr(s, "to"):
                s.to(device)
        return self

    def exit_mask(self, batch: ProbeBatch) -> torch.Tensor:
        n = batch.rows
        device = batch.stream.device
        want_all = self.mode == "all"
        out = torch.full((n,), want_all, dtype=torch.bool, device=device)
        for sig in self.signals:
            open_rows = out if want_all else ~out  # rows this signal can still change
            if not bool(open_rows.any()):
                break
            if sig.per_row:
                idx = torch.nonzero(open_rows).squeeze(1)
                part = batch if idx.numel() == n else batch.select(idx)
                got = torch.zeros(n, dtype=torch.bool, device=device)
                got[idx] = sig.exit_mask(part).to(device)
            else:
                got = sig.exit_mask(batch).to(device)
            out = out & got if want_all else out | got
        return out
