"""EMAD adaptive depth, offline part: collect, calibrate norms and proxies, fit budget targets.

The runtime (exits inside vLLM's forward pass) reads the profile written by `profile.py`.
"""
