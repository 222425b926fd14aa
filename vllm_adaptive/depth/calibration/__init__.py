"""Offline adaptive-depth calibration (transformers, no vLLM): collecting states on the corpora,
fitting the readouts and proxies, and choosing thresholds for EMAD (``emad``), QuickSilver
halting (``quicksilver``), the exit river (``river``) and token fusion (``fusion``). The engine
reads what it writes through ``vllm_adaptive.artifacts``."""
