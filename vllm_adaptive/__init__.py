"""vllm-adaptive: a vLLM plugin that spends compute where tokens need it."""

__version__ = "0.1.0"
