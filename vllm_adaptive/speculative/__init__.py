"""Self-speculative decoding: the target model drafts its own tokens (first layers, M2R2
adapters, or its own low-precision weights) and vLLM's rejection sampler verifies them.

vLLM loads :class:`~vllm_adaptive.speculative.proposer.SelfSpeculativeProposer` through
``speculative_config = {"method": "custom_class", "model": ...}``; ``adaptive.speculative``
says which draft it runs (docs/speculative.md).
"""
