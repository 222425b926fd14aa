"""The logit-lens oracle on hand-made match tables and a tiny random model."""

from __future__ import annotations

import pytest
import torch

from vllm_adaptive.oracle import lens_match, oracle_depths, summarize


def test_depths_on_a_hand_made_table() -> None:
    # 4 layers x 4 tokens; columns: matches from layer 1 on / flips back and forth /
    # only the last layer / matches at 2, misses at 3
    match = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 1],
            [1, 0, 0, 0],
            [1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    first, stable = oracle_depths(match)
    assert first.tolist() == [1, 2, 4, 2]
    assert stable.tolist() == [1, 4, 4, 4]
    r = summarize("x", match)
    assert r.agreement == [0.25, 0.75, 0.25, 1.0]
    assert r.first_match == pytest.approx((1 + 2 + 4 + 2) / 4 / 4, abs=1e-4)
    assert r.stable == pytest.approx((1 + 4 + 4 + 4) / 4 / 4, abs=1e-4)
    with pytest.raises(ValueError, match="last layer"):
        oracle_depths(match[:3])


def test_lens_on_a_tiny_model_matches_a_manual_readout() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    windows = [[3, 7, 9, 11, 2, 5], [1, 4, 4, 8, 30, 12]]
    match = lens_match(model, windows, score=4, bos=0)
    assert match.shape == (3, 8)
    assert bool(match[-1].all())  # the last block's lens is the model's own output
    with torch.no_grad():
        out = model(torch.tensor([[0, *windows[1]]]), output_hidden_states=True)
        final = out.logits[0, -4:].argmax(-1)
        h1 = out.hidden_states[1][0, -4:]  # block 1's raw output
        lens1 = model.lm_head(model.model.norm(h1)).argmax(-1)
    assert match[0, 4:].tolist() == (lens1 == final).tolist()
