"""Which drafter's tokens each request verifies next, and how each drafter's drafts fare.

A lookup drafter (a suffix tree or an n-gram match over the request's own text) costs almost
nothing and is right most of the time when it matches at all; a learned drafter (EAGLE-3)
always has a guess but costs a head pass per position and is right less often. Per request and
step the mix takes the lookup draft when it has at least ``min_lookup_tokens`` tokens, the
learned one otherwise, and tallies, from the tokens the target accepted one step later, how many
of each source's drafted tokens were accepted (vLLM's counters add both sources together).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

LOOKUP = "lookup"
LEARNED = "learned"


@dataclass
class SourceTally:
    """Drafts one source proposed that the target then verified."""

    drafts: int = 0
    tokens: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        """Accepted tokens per drafted token."""
        return self.accepted / self.tokens if self.tokens else 0.0


@dataclass
class DraftMix:
    """Per-request choice between a lookup draft and a learned draft."""

    min_lookup_tokens: int = 1
    tally: dict[str, SourceTally] = field(
        default_factory=lambda: {LOOKUP: SourceTally(), LEARNED: SourceTally()}
    )
    #: req_id -> (source, drafted tokens) of the drafts handed out last step
    pending: dict[str, tuple[str, int]] = field(default_factory=dict)

    def choose(
        self, req_ids: list[str], learned: list[list[int]], looked: list[list[int]]
    ) -> list[list[int]]:
        """The drafts each request verifies next step (rows in ``req_ids`` order)."""
        out: list[list[int]] = []
        for req_id, mine, theirs in zip(req_ids, learned, looked, strict=True):
            if len(theirs) >= self.min_lookup_tokens:
                source, draft = LOOKUP, list(theirs)
            else:
                source, draft = LEARNED, list(mine)
            if draft:
                self.pending[req_id] = (source, len(draft))
            else:
                self.pending.pop(req_id, None)
            out.append(draft)
        return out

    def verified(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """Count last step's drafts against the tokens the target kept for each request: a
        request that kept ``n`` tokens accepted ``n - 1`` drafted ones (the last is the
        target's own). A request the step did not sample (a prefill chunk) keeps its pending
        draft; one that left the batch is dropped."""
        present = set(req_ids)
        for req_id, kept in zip(req_ids, sampled, strict=True):
            if not kept or req_id not in self.pending:
                continue
            source, n = self.pending.pop(req_id)
            t = self.tally[source]
            t.drafts += 1
            t.tokens += n
            t.accepted += min(len(kept) - 1, n)
        for req_id in [r for r in self.pending if r not in present]:
            del self.pending[req_id]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per source: drafts, drafted and accepted tokens, acceptance per drafted token."""
        return {
            name: {**asdict(t), "acceptance": round(t.acceptance, 4)}
            for name, t in self.tally.items()
        }
