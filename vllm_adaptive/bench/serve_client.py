"""vLLM's own benchmark client, ``vllm bench serve``, as the benches run it: the prompts (windows of
the corpora's held-out split, or chat requests about them, as its ``custom`` dataset), the
command (greedy, texts kept for agreement) and its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.servers import SERVED_NAME, OnlineBenchError


def prompts_per_concurrency(concurrency: int, minimum: int) -> int:
    """Two full waves of requests, and at least ``minimum``."""
    return max(minimum, 2 * concurrency)


#: ``--prompt-style``: raw windows of held-out text, or chat requests about them
PROMPT_STYLES = ("text", "chat")


def write_prompts(
    model_dir: Path,
    corpora: Sequence[str],
    count: int,
    tokens: int,
    out: Path,
    style: str = "text",
) -> list[str]:
    """``count`` prompts from the corpora's held-out split (alternating files), as ``vllm bench
    serve``'s custom dataset (a JSONL of ``{"prompt": ...}``): windows of ``tokens`` tokens
    (``text``), or user messages asking about such windows (``chat``:
    :mod:`vllm_adaptive.chat_prompts`; the client applies the chat template)."""
    from transformers import AutoTokenizer

    from vllm_adaptive.chat_prompts import chat_messages
    from vllm_adaptive.corpora import read_corpus, token_windows

    if style not in PROMPT_STYLES:
        raise OnlineBenchError(f"prompt style {style!r}: one of {PROMPT_STYLES}")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    per_file: list[list[str]] = []
    share = -(-count // len(corpora))
    for path in corpora:
        text = read_corpus(path).eval_text
        if style == "chat":
            per_file.append(chat_messages(tok, text, path, share, tokens))
            continue
        ids = tok(text, add_special_tokens=False)["input_ids"]
        per_file.append([tok.decode(w) for w in token_windows(ids, tokens, share)])
    prompts = [p for group in zip(*per_file, strict=False) for p in group][:count]
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return prompts


def split_prompts(prompts: Sequence[str], counts: dict[int, int], out_dir: Path) -> dict[int, Path]:
    """One dataset file per concurrency level, ``counts[c]`` prompts each, no prompt in two
    levels (a level repeating another's prompts would time vLLM's prefix cache, not prefill)."""
    if sum(counts.values()) > len(prompts):
        raise OnlineBenchError(f"{len(prompts)} prompts for {sum(counts.values())} requests")
    paths: dict[int, Path] = {}
    start = 0
    for c, n in counts.items():
        paths[c] = out_dir / f"prompts-c{c}.jsonl"
        mine = prompts[start : start + n]
        paths[c].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in mine))
        start += n
    return paths


def client_command(
    url: str,
    model_dir: Path,
    prompts: Path,
    concurrency: int,
    num_prompts: int,
    output_len: int,
    result_dir: Path,
    result_name: str,
    served_name: str = SERVED_NAME,
    style: str = "text",
) -> list[str]:
    """The client's command line. ``style`` ``chat``: the client applies the model's chat
    template and requests end at the end of turn (at most ``output_len`` tokens), as a chat
    user's do; ``text``: raw prompts decoding exactly ``output_len`` tokens."""
    vllm = Path(sys.executable).parent / "vllm"
    as_text = ["--skip-chat-template", "--ignore-eos"] if style == "text" else []
    return [
        str(vllm) if vllm.exists() else "vllm",
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        served_name,
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(prompts),
        "--disable-shuffle",
        "--custom-output-len",
        str(output_len),
        *as_text,
        "--temperature",
        "0",
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_name,
    ]


def run_client(cmd: list[str], log: Path, result: Path) -> dict[str, Any]:
    with open(log, "wb") as out:
        rc = subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ}
        ).returncode
    if rc != 0 or not result.is_file():
        raise OnlineBenchError(f"vllm bench serve failed (exit {rc}); log {log}")
    return json.loads(result.read_text())
