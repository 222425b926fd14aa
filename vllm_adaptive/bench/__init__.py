"""Measurement harness: every adaptive mode against stock vLLM, in one run."""
