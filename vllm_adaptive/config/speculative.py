"""The ``speculative`` section (the plugin's self-drafting proposer) and the ``hybrid`` one
(lookup drafts in front of vLLM's EAGLE-3)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vllm_adaptive.config.base import (
    _Strict,
)

#: The proposer class vLLM's ``speculative_config`` names (``method: "custom_class"``).
SELF_SPECULATIVE_PROPOSER = "vllm_adaptive.speculative.proposer.SelfSpeculativeProposer"


class PromptLookupConfig(_Strict):
    """Prompt lookup before the self-draft (a hybrid drafter): a request whose last ``min`` ..
    ``max`` tokens occurred earlier in its own context takes the tokens that followed them
    (vLLM's n-gram proposer); only the others run the draft model."""

    min: int = Field(2, ge=1)
    max: int = Field(5, ge=1)

    @model_validator(mode="after")
    def _check(self) -> PromptLookupConfig:
        if self.min > self.max:
            raise ValueError(f"prompt_lookup: min {self.min} > max {self.max}")
        return self


class SpeculativeConfig(_Strict):
    """Self-speculative decoding (docs/speculative.md): the target model drafts its own tokens
    and vLLM's rejection sampler verifies them with the full model, so output is unchanged.

    Needs vLLM's ``speculative_config`` too: ``{"method": "custom_class", "model":
    "vllm_adaptive.speculative.proposer.SelfSpeculativeProposer", "num_speculative_tokens": k}``.
    """

    draft: Literal["early", "lowbit", "m2r2"]
    """"early": the first ``layers`` blocks, then the final norm and LM head (LayerSkip, DEED);
    "m2r2": the same blocks plus M2R2's trained accelerator adapters (``adapter``);
    "lowbit": every block with packed low-precision copies of the model's own weights."""
    layers: int | None = Field(None, ge=1)
    """Draft depth for "early" and "m2r2" (default 4; "m2r2" takes the adapter's)."""
    precision: Literal["int8", "int4", "w8a8", "fp16"] | None = None
    """"lowbit": the weight precision of the draft (default int4). int8 is per-row symmetric
    weight-only; w8a8 adds per-token int8 activations (the fast path for float32 engines)."""
    group_size: int = Field(32, ge=8)
    """"lowbit" int4: quantization group along the input dimension."""
    symmetric: bool = False
    """"lowbit" int4: False is asymmetric min/max (on the default model's Q4_1 grid, so close
    to the model itself: a control), True symmetric absmax (off that grid)."""
    head: Literal["full", "fp16", "w8a8", "int8", "int4"] | None = None
    """Precision of the draft's LM head; default the draft precision for "lowbit", else full."""
    adapter: str | None = None
    """"m2r2": directory written by ``vllm-adaptive train m2r2 --mode spec``."""
    prompt_lookup: PromptLookupConfig | None = None
    """Try prompt lookup first for each request (drafts from its own context); the draft
    model runs only for requests without a match. Off by default."""

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.draft == "lowbit":
            if self.layers is not None:
                raise ValueError('"layers": a "lowbit" draft runs every layer (remove layers)')
        elif self.precision is not None:
            raise ValueError(f'"precision" is for draft "lowbit", not "{self.draft}"')
        if self.draft == "m2r2" and not self.adapter:
            raise ValueError('draft "m2r2" needs "adapter" (vllm-adaptive train m2r2 --out DIR)')
        if self.draft != "m2r2" and self.adapter is not None:
            raise ValueError(f'"adapter" is for draft "m2r2", not "{self.draft}"')
        return self

    @property
    def draft_precision(self) -> str:
        return self.precision or "int4"

    @property
    def head_precision(self) -> str:
        if self.head is not None:
            return self.head
        return self.draft_precision if self.draft == "lowbit" else "full"


class HybridConfig(_Strict):
    """Hybrid drafting with vLLM's own learned drafter (docs/speculative.md): per request and
    step, drafts from the request's own text where it repeats itself (a suffix tree or n-gram
    lookup, vLLM's proposers), the learned drafter's (EAGLE / EAGLE-3, vLLM's
    ``speculative_config``) otherwise. The learned drafter runs every step either way: its KV
    cache must cover every accepted token.

    vLLM's ``num_speculative_tokens`` is the longest lookup draft; ``learned_tokens`` how many
    positions the learned drafter drafts (each costs a pass of the head)."""

    lookup: Literal["suffix", "ngram"] = "suffix"
    """"suffix": vLLM's suffix decoding (Arctic Inference's trees; its ``suffix_decoding_*``
    settings are read from ``speculative_config``); "ngram": vLLM's prompt lookup."""
    learned_tokens: int = Field(1, ge=0)
    """Draft positions of the learned drafter (at most vLLM's ``num_speculative_tokens``)."""
    min_lookup_tokens: int = Field(1, ge=1)
    """A lookup draft shorter than this gives way to the learned drafter's."""
    prompt_lookup: PromptLookupConfig | None = None
    """"ngram": the match lengths (default min 2, max 5)."""

    @model_validator(mode="after")
    def _check(self) -> HybridConfig:
        if self.lookup != "ngram" and self.prompt_lookup is not None:
            raise ValueError('"prompt_lookup" sets lookup "ngram"\'s match lengths')
        return self

    @property
    def ngram(self) -> PromptLookupConfig:
        return self.prompt_lookup if self.prompt_lookup is not None else PromptLookupConfig()


class DraftHeadConfig(_Strict):
    """The precision of vLLM's EAGLE / EAGLE-3 draft head (``speculative_config``'s ``model``).

    A draft never changes the output (the target verifies it), so the head may run a lossy
    gear: a head pass reads its weights like a target step does (SmolLM2's head: ``fc``, one
    decoder layer and an 8,192-row LM head, 9.9M parameters), and its GEMMs were 2.3 ms of a
    28 ms speculative step through ``vllm serve`` on an AVX512-BF16 EPYC (docs/results.md).
    Without this section the head runs the target's fixed gear where it has one the head
    supports (``fp16`` on a float32 engine, ``int8``), else vLLM's own weights."""

    gear: Literal["full", "fp16", "int8"]
    """"full": vLLM's own head; "fp16": FBGEMM's / the plugin's fp16 GEMM (float32 engines);
    "int8": the plugin's grouped int8 kernel (float32 or bf16 activations)."""
