"""Mixture of experts (issue 19).

Offline (no vLLM): ``moefy`` builds an MoE upcycled from a dense Llama model (co-activation
clustering of each MLP's neurons into equal experts, a trained linear router per layer);
``reference`` is its forward in plain torch on a transformers Llama; ``quality`` measures its
perplexity and agreement against the dense model.

Runtime (in the engine, ``models/moefied_llama.py``): ``tiers`` holds the experts in a slow tier
(a memory-mapped file) and a bounded fast tier loaded on a background thread; ``predictors``
name the experts of the next layers ahead of time; ``runtime`` ties them to a model's layers.

The MoEfied SmolLM2 is built by the project from the dense model: it is not a trained MoE, and
every figure measured on it says so."""
