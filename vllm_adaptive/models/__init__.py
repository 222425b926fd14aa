"""Adaptive model classes, one file per architecture (as in vLLM); each is listed in
`vllm_adaptive/architectures.py`."""
