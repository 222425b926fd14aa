"""vLLM's ``custom_class`` proposer for self-speculative decoding.

vLLM builds it with the engine config (``speculative_config = {"method": "custom_class",
"model": "vllm_adaptive.speculative.proposer.SelfSpeculativeProposer",
"num_speculative_tokens": k}``), hands it the loaded target model (``load_model``), and after
every step calls ``propose`` with the tokens each request just accepted. The proposer drafts up
to ``k`` tokens per request greedily from the configured draft source, and vLLM's rejection
sampler verifies them against the full model in the next step.

Why output is unchanged: drafts are the argmax of the draft's logits, a deterministic function
of the context, and no draft probabilities are passed. vLLM then treats the draft distribution
as one-hot, accepts a draft token x with probability min(1, p(x)) (greedy: iff x is the target's
argmax) and on rejection samples from p with x removed, renormalised: exactly the target's
distribution (Leviathan et al. 2023, with q = one-hot).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_adaptive.config import (
    SELF_SPECULATIVE_PROPOSER,
    AdaptiveConfigError,
    PromptLookupConfig,
    SpeculativeConfig,
    adaptive_config_from_vllm,
)
from vllm_adaptive.speculative.draft_step import (
    DraftPass,
    SharedKVDraftStep,
    compiled_draft_pass,
    engine_compiles,
)
from vllm_adaptive.speculative.requests import DraftingRequests

logger = logging.getLogger("vllm.adaptive.speculative")

#: How often the proposer logs what drafting costs (draft steps).
LOG_EVERY_STEPS = 256


def prompt_lookup_proposer(vllm_config: Any, lookup: PromptLookupConfig) -> Any:
    """vLLM's own n-gram proposer, on a copy of the engine config that names its match
    lengths (the engine's speculative method is another one, which sets none)."""
    import copy

    from vllm_adaptive.engine.vllm_api import NgramProposer

    config = copy.copy(vllm_config)
    config.speculative_config = copy.copy(vllm_config.speculative_config)
    config.speculative_config.prompt_lookup_min = lookup.min
    config.speculative_config.prompt_lookup_max = lookup.max
    return NgramProposer(config)


class SelfSpeculativeProposer:
    """Drafts from the target model itself; settings from ``adaptive.speculative``."""

    def __init__(self, vllm_config: Any) -> None:
        adaptive = adaptive_config_from_vllm(vllm_config)
        if adaptive is None or adaptive.speculative is None:
            raise AdaptiveConfigError(
                f"{SELF_SPECULATIVE_PROPOSER} needs an adaptive.speculative section in "
                '--additional-config, e.g. {"adaptive": {"speculative": {"draft": "lowbit"}}}'
            )
        self.vllm_config = vllm_config
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.settings: SpeculativeConfig | None = adaptive.active_speculative
        self.model: Any = None
        self.draft: Any = None
        self.draft_pass: DraftPass | None = None
        self.step: SharedKVDraftStep | None = None
        self.requests: DraftingRequests | None = None
        self.lookup: Any = None
        self.stats = {
            "steps": 0,
            "rows": 0,
            "draft_tokens": 0,
            "positions": 0,
            "seconds": 0.0,
            "lookup_rows": 0,
        }
        from vllm_adaptive.engine import intrusions

        # random sampling with drafts is wrong on CPU without it (intrusions.expand_kernel)
        intrusions.apply("cpu-expand-kernel")
        # the runner that builds this proposer hands itself over once it has loaded the model
        intrusions.apply("drafter-runner")
        if self.settings is None:
            logger.info("vllm-adaptive speculative: adaptive.mode is off, no drafts are proposed")

    # -- vLLM's drafter interface ------------------------------------------------------------
    def load_model(self, model: Any) -> None:
        """Called by the model runner with the loaded target model: build the draft from its
        own weights (no second checkpoint) and watch its steps for their attention metadata."""
        if self.settings is None:
            return
        from vllm_adaptive.speculative.drafts import describe

        draft = getattr(model, "speculative_draft", None)
        if draft is None:
            raise AdaptiveConfigError(
                f"adaptive.speculative: {type(model).__name__} built no draft (self-speculation "
                "needs the plugin's adaptive model class for this architecture)"
            )
        self.model = model
        self.draft = draft
        self.draft_pass = compiled_draft_pass(draft.forward, engine_compiles(self.vllm_config))
        if self.settings.prompt_lookup is not None:
            self.lookup = prompt_lookup_proposer(self.vllm_config, self.settings.prompt_lookup)
        self.step = SharedKVDraftStep(model, self.vllm_config)
        self.step.check_backend()
        model.register_forward_pre_hook(lambda _module, _args: self.step.capture())
        info = describe(self.draft)
        logger.info(
            "vllm-adaptive speculative: draft %s, k=%d, %.1f MB of draft weights, %s pass",
            info["name"],
            self.k,
            info["resident_bytes"] / 1e6,
            "compiled" if engine_compiles(self.vllm_config) else "eager",
        )

    def attach_runner(self, runner: Any) -> None:
        """Called by vLLM's model runner once it has loaded the model and this proposer (entry
        ``drafter-runner`` of :mod:`vllm_adaptive.engine.intrusions`): per-request
        ``adaptive_mode: "off"`` needs to know which request is in which batch row, which the
        ``custom_class`` interface does not pass."""
        if self.settings is None:
            return
        self.requests = DraftingRequests(runner)

    @torch.inference_mode()
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
        **_: Any,
    ) -> list[list[int]]:
        """Up to ``k`` greedy draft tokens for each request that sampled this step (requests
        sent with ``adaptive_mode: "off"`` excepted)."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if self.draft_pass is None or self.step is None:
            return drafts
        if self.requests is None:
            raise RuntimeError(
                "vllm-adaptive speculative: the model runner never attached itself to the "
                "proposer (intrusions entry drafter-runner); this vLLM is not supported"
            )
        on = self.requests.drafting(len(sampled_token_ids))
        sampled = [s if d else [] for s, d in zip(sampled_token_ids, on, strict=True)]
        if self.lookup is not None:
            looked = self.lookup.propose(self.k, sampled, num_tokens_no_spec, token_ids_cpu)
            for r, tokens in enumerate(looked):
                if tokens:  # a match in the request's own context: no draft model for it
                    drafts[r] = tokens
                    sampled[r] = []
                    self.stats["lookup_rows"] += 1
        batch = self.step.plan(sampled, num_tokens_no_spec, self.k)
        if batch is None:
            return drafts
        t0 = time.perf_counter()
        # The token each row feeds first: its last known one (just sampled, no K/V yet).
        feed = token_ids_cpu[batch.rows, batch.start].astype(np.int64)
        out = np.zeros((batch.rows.size, self.k), dtype=np.int64)
        dev = self.step.md.block_table.device
        for j in range(int(batch.budget.max())):
            live = np.nonzero(batch.budget > j)[0]
            with self.step.one_token(batch.rows[live], batch.start[live] + j) as positions:
                ids = torch.from_numpy(feed[live]).to(dev)
                hidden = self.draft_pass(positions, ids)
                logits = self.draft.head.logits(self.model, hidden)
            nxt = logits.argmax(dim=-1).cpu().numpy()
            out[live, j] = nxt
            feed[live] = nxt
        for i, r in enumerate(batch.rows):
            drafts[r] = out[i, : batch.budget[i]].tolist()
        self.stats["steps"] += 1
        self.stats["rows"] += int(batch.rows.size)
        self.stats["draft_tokens"] += int(batch.budget.sum())
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["positions"] += int(batch.budget.max())
        if self.stats["steps"] % LOG_EVERY_STEPS == 0:
            s = self.stats
            logger.info(
                "vllm-adaptive speculative: %d steps, %d draft tokens for %d rows, %.1f ms per "
                "draft position (one batched one-token pass of the draft), %d rows drafted by "
                "prompt lookup",
                s["steps"],
                s["draft_tokens"],
                s["rows"],
                1e3 * s["seconds"] / max(s["positions"], 1),
                s["lookup_rows"],
            )
        return drafts
