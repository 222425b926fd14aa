"""The measurement harness, its pieces alone (end to end: tests/slow/test_bench_end_to_end.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from vllm_adaptive.bench.teacher_forcing import FORCE_KEY, TeacherForcingLogitsProcessor
from vllm_adaptive.corpora import prompt_windows, read_corpus, spread_windows, token_windows
from vllm_adaptive.flops import DenseShape


def _params(forced=None) -> SamplingParams:
    return SamplingParams(max_tokens=2, extra_args={FORCE_KEY: forced} if forced else None)


def test_forcing_processor_tracks_rows_and_steps() -> None:
    proc = TeacherForcingLogitsProcessor(None, torch.device("cpu"), False)
    out_a, out_b = [], [7]
    proc.update_state(
        BatchUpdate(
            3,
            removed=[],
            added=[
                (0, _params([5, 6]), [1], out_a),
                (1, _params(), [1], []),
                (2, _params([3, 4]), [1], out_b),
            ],
            moved=[],
        )
    )
    logits = torch.zeros(3, 10)
    out = proc.apply(logits.clone())
    assert out[0].argmax() == 5 and torch.isinf(out[0]).sum() == 9  # step 0 of [5, 6]
    assert torch.equal(out[1], torch.zeros(10))  # unforced request untouched
    assert out[2].argmax() == 4  # one token already out: step 1 of [3, 4]
    proc.update_state(
        BatchUpdate(3, removed=[1], added=[], moved=[(2, 0, MoveDirectionality.SWAP)])
    )
    out = proc.apply(torch.zeros(3, 10))
    assert out[0].argmax() == 4 and out[2].argmax() == 5


def test_forcing_processor_validates() -> None:
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError):
        TeacherForcingLogitsProcessor.validate_params(SamplingParams(extra_args={FORCE_KEY: "x"}))
    with pytest.raises(VLLMValidationError, match="exceeds"):
        TeacherForcingLogitsProcessor.validate_params(
            SamplingParams(max_tokens=5, extra_args={FORCE_KEY: [1, 2]})
        )


def test_corpus_split_is_disjoint_and_windows_spread(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("".join(f"line {i}\n" for i in range(1000)))
    c = read_corpus(f)
    assert c.calibration_text + c.eval_text == c.text
    assert len(c.eval_text) == pytest.approx(0.1 * len(c.text), abs=2)
    wins = token_windows(list(range(100)), 10, 3)
    assert [w[0] for w in wins] == [0, 30, 60] and all(len(w) == 10 for w in wins)
    with pytest.raises(ValueError, match="too short"):
        token_windows(list(range(20)), 10, 3)
    # a generated source's prompts: the non-overlapping layout while the text holds it ...
    ids = list(range(100))
    assert prompt_windows(ids, 10, 5) == spread_windows(ids, 10, 5)
    # ... then more, overlapping, distinct and spread over the whole text
    more = prompt_windows(ids, 10, 19)
    assert len(more) == 19 and len({w[0] for w in more}) == 19
    assert more[0][0] == 0 and more[-1][-1] == 99 and all(len(w) == 10 for w in more)
    assert prompt_windows(list(range(5)), 10, 3) == []
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_corpus(bad)


def test_flops_model_counts_smollm2() -> None:
    shape = DenseShape.from_hf_config(
        {
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
        }
    )
    # 2 x (q 576*576 + kv 2*576*192 + o 576*576 + mlp 3*576*1536) per layer
    per_layer = 2 * (576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536)
    assert shape.layer_linear_flops() == per_layer
    full = shape.flops_per_token(context_len=100)
    assert full == 30 * (per_layer + 4 * 9 * 64 * 100) + 2 * 576 * 49152
    assert shape.flops_per_token(100, mean_layers=15) < full
