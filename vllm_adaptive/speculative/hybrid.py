"""Hybrid drafting around vLLM's own EAGLE / EAGLE-3 drafter (``adaptive.hybrid``).

vLLM runs one drafter per engine. This object rides along in the model runner (entry
``hybrid-drafts`` of :mod:`vllm_adaptive.engine.intrusions` calls it at three points of a step)
and adds a lookup drafter, vLLM's suffix-decoding or n-gram proposer:

1. when vLLM calls the learned drafter, its draft length is capped at ``learned_tokens`` (the
   drafter still runs every step: its first pass writes the head's KV for the tokens the target
   just accepted, which later steps attend to whichever source drafted);
2. after vLLM's bookkeeping, the tokens each request kept this step are noted;
3. when the engine takes the drafts, the lookup drafter proposes from each request's own text
   and :class:`~vllm_adaptive.speculative.draft_mix.DraftMix` picks per request.

Lossless as any vLLM drafting: drafts are greedy token ids without probabilities (vLLM's
``draft_sample_method: "greedy"``, checked at engine start), and the rejection sampler verifies
whatever it is handed against the target.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_adaptive.config import HybridConfig
from vllm_adaptive.speculative.draft_mix import DraftMix

logger = logging.getLogger("vllm.adaptive.speculative")

#: How often (steps that drafted) the mix logs each source's acceptance.
LOG_EVERY_STEPS = 512


def engine_problem(spec: Any, settings: HybridConfig) -> str | None:
    """Why an engine's ``speculative_config`` cannot carry ``settings`` (None when it can)."""
    method = getattr(spec, "method", None)
    if spec is None or method not in ("eagle", "eagle3"):
        return (
            "adaptive.hybrid mixes lookup drafts into vLLM's learned drafter: speculative_config "
            f'must name one ({{"method": "eagle3", "model": HEAD, ...}}), got {method!r}'
        )
    k = int(spec.num_speculative_tokens)
    if settings.learned_tokens > k:
        return (
            f"adaptive.hybrid.learned_tokens {settings.learned_tokens} > speculative_config's "
            f"num_speculative_tokens {k} (the longest draft any source may give)"
        )
    sample = getattr(spec, "draft_sample_method", "greedy")
    if sample != "greedy":
        return (
            f"adaptive.hybrid: draft_sample_method {sample!r} sends draft probabilities that a "
            'lookup draft does not have; use "greedy" (vLLM\'s default)'
        )
    if settings.lookup == "suffix":
        try:
            import arctic_inference.suffix_decoding  # noqa: F401
        except ImportError:
            return (
                'adaptive.hybrid.lookup "suffix" needs Arctic Inference '
                '(bash scripts/install-suffix-decoding.sh), or use lookup "ngram"'
            )
    return None


class HybridDrafts:
    """The runner-side state of one engine's hybrid drafting."""

    def __init__(self, vllm_config: Any, settings: HybridConfig) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.mix = DraftMix(settings.min_lookup_tokens)
        self.lookup: Any = None  # built on the first step (the ngram proposer JIT-compiles)
        self.sampled: list[list[int]] | None = None
        self.steps = 0
        self._drafter: Any = None

    # -- 1. the learned drafter ------------------------------------------------------------
    def cap_drafter(self, drafter: Any) -> None:
        """Make ``drafter.propose`` draft at most ``learned_tokens`` positions (once)."""
        if drafter is None or drafter is self._drafter:
            return
        propose = drafter.propose
        cap = self.settings.learned_tokens

        @functools.wraps(propose)
        def capped(num_speculative_tokens: int, *args: Any, **kwargs: Any) -> Any:
            self.k = int(num_speculative_tokens)  # the scheduler's k this step
            return propose(min(cap, self.k), *args, **kwargs)

        drafter.propose = capped
        self._drafter = drafter
        logger.info(
            "vllm-adaptive hybrid drafts: %s lookup up to %d tokens, else %s drafting %d",
            self.settings.lookup,
            self.k,
            type(drafter).__name__,
            cap,
        )

    # -- 2. what the target kept -----------------------------------------------------------
    def kept(self, valid_sampled_token_ids: list[list[int]]) -> None:
        self.sampled = valid_sampled_token_ids

    # -- 3. the drafts the scheduler gets --------------------------------------------------
    def drafts(
        self, input_batch: Any, req_ids: list[str], learned: list[list[int]]
    ) -> list[list[int]]:
        """Per request, the lookup draft where one matches, else ``learned``."""
        sampled = self.sampled
        self.sampled = None
        if sampled is None or len(sampled) != len(req_ids):
            return learned  # no bookkeeping this step (nothing sampled): vLLM's drafts as they are
        self.mix.verified(req_ids, sampled)
        looked = self._look_up(input_batch, sampled)
        out = self.mix.choose(req_ids, learned, looked)
        self.steps += 1
        if self.steps % LOG_EVERY_STEPS == 0:
            logger.info(
                "vllm-adaptive hybrid drafts after %d steps: %s", self.steps, self.summary()
            )
        return out

    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps, **self.mix.summary()}

    def _look_up(self, input_batch: Any, sampled: list[list[int]]) -> list[list[int]]:
        if self.lookup is None:
            self.lookup = self._build_lookup()
        if self.settings.lookup == "suffix":
            # vLLM's suffix proposer keeps each request's tree fed from ``sampled`` and asserts
            # its own k; a smaller k this step (vLLM's dynamic k) truncates
            drafts = self.lookup.propose(self.lookup.num_speculative_tokens, input_batch, sampled)
            return [d[: self.k] for d in drafts]
        return self.lookup.propose(
            self.k, sampled, input_batch.num_tokens_no_spec, input_batch.token_ids_cpu
        )

    def _build_lookup(self) -> Any:
        if self.settings.lookup == "ngram":
            from vllm_adaptive.speculative.proposer import prompt_lookup_proposer

            return prompt_lookup_proposer(self.vllm_config, self.settings.ngram)
        from vllm_adaptive.engine.vllm_api import SuffixDecodingProposer

        return SuffixDecodingProposer(self.vllm_config)
