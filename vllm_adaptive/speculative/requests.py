"""Which requests draft. A request sent with ``adaptive_mode: "off"`` gets no drafts: the
engine decodes it one token per step, as it would without speculation, while the rest of the
batch keeps drafting. Its output is the same either way (speculation is lossless); what changes
is the compute spent on it, which is what "off" asks for.

vLLM's ``custom_class`` interface hands the proposer rows of the persistent batch, not requests,
and with speculative decoding on vLLM builds no plugin logits processors in the worker, so the
batch mirror that gears and depth budgets use (`vllm_adaptive.batch_mirror`) receives nothing
here. The one object that knows which request is in which row is the model runner; it hands
itself to the proposer after loading the model (``SelfSpeculativeProposer.attach_runner``, entry
``drafter-runner`` of :mod:`vllm_adaptive.engine.intrusions`), and `DraftingRequests` reads its
persistent batch (``input_batch.req_ids``) and request states
(``requests[req_id].sampling_params``). Checked against vLLM 0.32's CPU and GPU runners; a
runner without those attributes is refused at load time rather than ignored.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_adaptive.overrides import parse_overrides

logger = logging.getLogger("vllm.adaptive.speculative")

#: Forget cached per-request decisions once this many are held (finished requests).
_CACHE_LIMIT = 4096


def _is_runner(obj: Any) -> bool:
    batch = getattr(obj, "input_batch", None)
    return (
        batch is not None
        and hasattr(batch, "req_ids")
        and isinstance(getattr(obj, "requests", None), dict)
    )


class DraftingRequests:
    """Per row of the step, whether its request drafts (``adaptive_mode`` not "off")."""

    def __init__(self, runner: Any) -> None:
        if not _is_runner(runner):
            raise RuntimeError(
                "vllm-adaptive speculative: vLLM's model runner has no persistent batch "
                "(input_batch, requests); this vLLM version is not supported"
            )
        self.runner = runner
        self._on: dict[str, bool] = {}

    def _drafts_on(self, req_id: str) -> bool:
        on = self._on.get(req_id)
        if on is None:
            state = self.runner.requests.get(req_id)
            params = getattr(state, "sampling_params", None)
            extra = getattr(params, "extra_args", None)
            overrides = parse_overrides(extra)
            on = overrides.mode != "off"
            for name in ("gear", "depth_budget"):
                if getattr(overrides, name) is not None:
                    # a speculative engine has no precision or depth section (refused at start)
                    logger.warning(
                        "vllm-adaptive: adaptive_%s ignored for request %s: this engine runs "
                        "self-speculative decoding, which has no %s",
                        name,
                        req_id,
                        "gears" if name == "gear" else "depth budget",
                    )
            if len(self._on) >= _CACHE_LIMIT:
                self._on.clear()
            self._on[req_id] = on
        return on

    def drafting(self, num_reqs: int) -> list[bool]:
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        if len(req_ids) != num_reqs:  # not the persistent batch's step: drafting is lossless
            return [True] * num_reqs
        return [self._drafts_on(r) for r in req_ids]
