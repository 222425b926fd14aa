"""Chat requests built from the corpora: an instruction about a window of real text, in the
model's chat template.

What a `vllm serve` user sends most is a chat turn, and a draft head trained only on raw
corpus text drafts poorly inside the assistant's answers (the template, the system prompt and
the answering style are text it never saw). The same builder feeds the EAGLE-3 trainer's
``--data-source chat`` and the serving bench's ``--prompt-style chat``, so the two measure the
same kind of request. Instructions cycle through a fixed list per corpus kind (code when the
file name says so, prose else); the text they are about comes from the corpus split the caller
names (calibration for training, held-out for benchmarks).
"""

from __future__ import annotations

from pathlib import Path

from vllm_adaptive.corpora import spread_windows

CODE_INSTRUCTIONS = (
    "Explain what this Python code does.",
    "Is there a bug in this code? Explain briefly.",
    "Write a short docstring for this code.",
    "Describe, step by step, what happens when this code runs.",
    "How could this code be made simpler?",
    "Which Python features does this code use?",
)
PROSE_INSTRUCTIONS = (
    "Summarize this text in a few sentences.",
    "Explain this to a beginner.",
    "What are the main points of this passage?",
    "Write two questions this text answers, and answer them.",
    "Rewrite this passage more clearly.",
    "What command or setting does this text describe, and why would someone use it?",
)
#: the least text a prompt carries besides the template and the instruction
MIN_CONTEXT_TOKENS = 8
_MARK = "@@vllm-adaptive-content@@"


def instructions_for(corpus_path: str | Path) -> tuple[str, ...]:
    """The instruction list for a corpus file: code when its name says code."""
    return CODE_INSTRUCTIONS if "code" in Path(corpus_path).name.lower() else PROSE_INSTRUCTIONS


def user_message(instruction: str, context: str) -> str:
    return f"{instruction}\n\n{context}"


def template_ids(tok) -> tuple[list[int], list[int]]:
    """The token ids the chat template puts before and after one user message (system prompt
    and the assistant's turn start included)."""
    if getattr(tok, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: chat prompts need one")
    text = tok.apply_chat_template(
        [{"role": "user", "content": _MARK}], add_generation_prompt=True, tokenize=False
    )
    before, after = text.split(_MARK)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return enc(before), enc(after)


def chat_prompt_ids(
    tok, text: str, corpus_path: str | Path, count: int, length: int
) -> list[list[int]]:
    """``count`` chat prompts of exactly ``length`` token ids about windows of ``text`` (fewer
    when the text is short): template head, instruction, the window, template tail."""
    before, after = template_ids(tok)
    instructions = instructions_for(corpus_path)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    heads = [enc(f"{i}\n\n") for i in instructions]
    overhead = len(before) + len(after) + max(len(h) for h in heads)
    if length - overhead < MIN_CONTEXT_TOKENS:
        raise ValueError(
            f"chat prompts of {length} tokens: the template and instruction take {overhead}, "
            f"leaving fewer than {MIN_CONTEXT_TOKENS} for the text; ask for at least "
            f"{overhead + MIN_CONTEXT_TOKENS}"
        )
    ids = enc(text)
    out = []
    longest_body = length - len(before) - len(after) - min(len(h) for h in heads)
    for n, w in enumerate(spread_windows(ids, longest_body, count)):
        head = heads[n % len(heads)]
        body = w[: length - len(before) - len(after) - len(head)]
        out.append([*before, *head, *body, *after])
    return out


def chat_messages(tok, text: str, corpus_path: str | Path, count: int, tokens: int) -> list[str]:
    """``count`` user messages (an instruction and about ``tokens`` tokens of ``text``), for a
    client that applies the chat template itself (``vllm bench serve``)."""
    instructions = instructions_for(corpus_path)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    windows = spread_windows(ids, tokens, count)
    return [
        user_message(instructions[n % len(instructions)], tok.decode(w).strip())
        for n, w in enumerate(windows)
    ]
