"""Attention backends of the plugin.

``masked_backend``: vLLM's CPU backend (CPU_ATTN) with the depth mask of the ``mask`` KV strategy
(QuickSilver KV skipping). Import it explicitly; importing this package does not import vLLM.
"""
