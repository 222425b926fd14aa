"""Mixture-of-experts (issue 19). ``moefy``: the offline build of an MoE upcycled from a dense
Llama model (co-activation clustering of each MLP's neurons into equal experts, a trained linear
router per layer); ``reference``: its forward in plain torch on a transformers Llama;
``quality``: its perplexity and agreement against the dense model. None of them imports vLLM.

The MoEfied SmolLM2 is built by the project from the dense model: it is not a trained MoE, and
every figure measured on it says so."""
