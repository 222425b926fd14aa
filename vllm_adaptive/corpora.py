"""Real text for benchmarks and calibration, with a fixed held-out split.

Every file is split once by position: the first `1 - EVAL_FRACTION` of its
characters is calibration text, the last `EVAL_FRACTION` is evaluation text.
Calibration tools read only the first part and the benchmark only the second,
so the two never overlap, whatever files are given.

The two default corpora (any UTF-8 text files work):
- code: Python's own standard library source (`default_code_corpus()`);
- prose: Debian's `debian-reference-en` (`apt-get install debian-reference-en`),
  its plain-text edition (`default_prose_corpus()`).
"""

from __future__ import annotations

import gzip
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EVAL_FRACTION = 0.1


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    text: str
    sha256: str

    @property
    def calibration_text(self) -> str:
        return self.text[: self._cut]

    @property
    def eval_text(self) -> str:
        return self.text[self._cut :]

    @property
    def _cut(self) -> int:
        return int(len(self.text) * (1.0 - EVAL_FRACTION))


def read_corpus(path: str | Path) -> CorpusFile:
    p = Path(path)
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {p}: not UTF-8 text ({e})") from None
    if len(text.strip()) == 0:
        raise ValueError(f"corpus {p}: empty")
    return CorpusFile(path=p, text=text, sha256=hashlib.sha256(raw).hexdigest())


def token_windows(token_ids: list[int], length: int, count: int) -> list[list[int]]:
    """`count` non-overlapping windows of `length` tokens, spread evenly over the text."""
    available = len(token_ids) // length
    if available < count:
        raise ValueError(
            f"held-out text has {len(token_ids)} tokens: too short for {count} windows "
            f"of {length}; give a larger corpus or ask for fewer/shorter streams"
        )
    stride = available // count
    return [token_ids[i * stride * length : i * stride * length + length] for i in range(count)]


def spread_windows(token_ids: list[int], length: int, count: int) -> list[list[int]]:
    """Up to ``count`` non-overlapping windows of ``length`` tokens spread evenly over the text
    (fewer when it is short; :func:`token_windows` refuses instead)."""
    available = len(token_ids) // length
    count = min(count, available)
    if count < 1:
        return []
    stride = available // count
    return [token_ids[i * stride * length : i * stride * length + length] for i in range(count)]


def prompt_windows(token_ids: list[int], length: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens for a generated source (the target writes the rest
    of each window): :func:`spread_windows` while the text holds that many non-overlapping ones,
    else starts spread evenly at a stride shorter than ``length``. Overlapping prompts still give
    distinct windows, since each is continued its own way, so a short text can feed more data."""
    if count <= len(token_ids) // length:
        return spread_windows(token_ids, length, count)
    last = len(token_ids) - length
    if last < 0 or count < 1:
        return []
    starts = sorted({round(i * last / max(1, count - 1)) for i in range(count)})
    return [token_ids[s : s + length] for s in starts]


def token_windows_with_next(
    tok, texts: list[str], window: int, count: int
) -> tuple[list[list[int]], list[int]]:
    """`count` windows of `window` tokens spread evenly over the concatenated texts, and the
    token that follows each window (-1 at the end of the text)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
    available = len(ids) // window
    if available < 1:
        raise ValueError(f"calibration text has {len(ids)} tokens: shorter than one window")
    count = min(count, available)
    stride = available // count
    starts = [i * stride * window for i in range(count)]
    nexts = [ids[s + window] if s + window < len(ids) else -1 for s in starts]
    return [ids[s : s + window] for s in starts], nexts


def default_code_corpus(out: str | Path, max_chars: int = 2_000_000) -> Path:
    """Concatenate the standard library's .py files (sorted, deterministic)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for f in sorted(stdlib.glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(f"# file: {f.name}\n{text}\n")
        total += len(parts[-1])
        if total >= max_chars:
            break
    out = Path(out)
    out.write_text("".join(parts), encoding="utf-8")
    return out


def default_prose_corpus(
    out: str | Path, source: str | Path = "/usr/share/debian-reference/debian-reference.en.txt.gz"
) -> Path:
    """Debian Reference (English), the plain-text edition shipped by the package."""
    src = Path(source)
    if not src.is_file():
        raise FileNotFoundError(f"{src} not found: apt-get install debian-reference-en")
    text = gzip.decompress(src.read_bytes()).decode("utf-8", errors="replace")
    out = Path(out)
    out.write_text(text, encoding="utf-8")
    return out


def prompt_bos(tok) -> int | None:
    """The BOS id when the tokenizer puts it before every prompt (as vLLM's prompts get it)."""
    with_special = tok("a")["input_ids"]
    plain = tok("a", add_special_tokens=False)["input_ids"]
    bos = tok.bos_token_id
    if bos is not None and with_special[:1] == [bos] and plain[:1] != [bos]:
        return bos
    return None
