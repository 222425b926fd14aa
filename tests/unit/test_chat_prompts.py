"""Chat requests built from the corpora (`vllm_adaptive/chat_prompts.py`), with the default
model's own tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_adaptive import chat_prompts as cp
from vllm_adaptive.corpora import read_corpus

TEXT = "def add(a, b):\n    return a + b\n\n" * 200


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_prompt_ids_have_the_exact_length_in_the_template(tok) -> None:
    before, after = cp.template_ids(tok)
    ids = cp.chat_prompt_ids(tok, TEXT, "code.txt", 12, 64)
    assert len(ids) == 12 and {len(p) for p in ids} == {64}
    for n, p in enumerate(ids):
        assert p[: len(before)] == before and p[-len(after) :] == after
        text = tok.decode(p)
        assert cp.CODE_INSTRUCTIONS[n % len(cp.CODE_INSTRUCTIONS)] in text
        assert "return a + b" in text and text.endswith("<|im_start|>assistant\n")
    # what the instruction talks about follows the corpus kind
    prose = tok.decode(cp.chat_prompt_ids(tok, TEXT, "/x/prose.txt", 1, 64)[0])
    assert cp.PROSE_INSTRUCTIONS[0] in prose
    with pytest.raises(ValueError, match="ask for at least"):
        cp.chat_prompt_ids(tok, TEXT, "code.txt", 1, 30)


def test_messages_are_about_held_out_text(tok, tmp_path: Path) -> None:
    path = tmp_path / "code.txt"
    path.write_text("x = 1\n" * 900 + "held_out_marker()\n" * 100)
    corpus = read_corpus(path)
    msgs = cp.chat_messages(tok, corpus.eval_text, path, 4, 20)
    assert len(msgs) == 4 and all("held_out_marker" in m and "x = 1" not in m for m in msgs)
    assert msgs[1].startswith(cp.CODE_INSTRUCTIONS[1] + "\n\n")


def test_a_tokenizer_without_a_chat_template_is_refused() -> None:
    class Plain:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        cp.template_ids(Plain())
