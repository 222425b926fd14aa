"""File-based telemetry exchange between vLLM's worker processes and its frontend.

The adaptive runtimes run inside vLLM's worker process; the Prometheus
exporter (:mod:`vllm_adaptive.engine.metrics`) and the HTTP route
(:mod:`vllm_adaptive.engine.routes`) run in the frontend (API server). They meet in
one directory, JSON only (no pickle: nothing read here can execute code):

``engine-<pid>.json``
    One file per engine process: a JSON object of cumulative totals since that
    process started (any JSON-able dict; the depth runtime writes e.g.
    ``{"mechanism": "depth", "num_layers": 30, "decode_tokens": ...,
    "layers_executed": ..., "exit_tokens": {"12": ..., "30": ...}, ...}``).
    Rewritten whole and atomically (temporary file + ``os.replace``), so a
    reader sees the old or the new file, never half of one. Write from one
    rank per engine (e.g. tensor-parallel rank 0): readers sum the files of
    engine processes that are still alive. A file whose process is gone is
    ignored (left in place): a restarted engine, or a directory inherited from
    an earlier run, must not add a dead process's totals to ``/metrics``. A pid
    the system has since given to a process started after the file's last write
    counts as gone too (Linux: the start time in ``/proc/<pid>/stat``).

``requests.jsonl``
    One JSON line per finished request, with a ``"tag"`` key (the request's
    ``adaptive_request_tag`` or a name the runtime chose). Appends and
    rotation are serialised by ``flock`` on ``requests.jsonl.lock``. When the
    file exceeds :data:`REQUESTS_MAX_BYTES` (20 MiB) the next append first
    renames it to ``requests.jsonl.1`` (replacing the previous one), so at most
    about 40 MiB are kept and the oldest records are dropped.

The directory is ``$ADAPTIVE_STATS_DIR``. When that is unset,
:func:`ensure_stats_dir` (called by the plugin's ``register()``, which vLLM
runs in the frontend before it spawns the engine and worker processes) creates
a fresh ``vllm-adaptive-*`` temporary directory and exports it in
``os.environ``, so every process spawned afterwards inherits the same one. A
directory created that way is removed when the creating process exits; set
``ADAPTIVE_STATS_DIR`` yourself to keep the files.

The name has no ``VLLM_`` prefix on purpose: vLLM warns about unknown ``VLLM_*``
variables (and ``--fail-on-environ-validation`` refuses them), and registering it would put
a per-run path into vLLM's torch.compile cache key.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Environment variable naming the exchange directory (inherited by spawned processes).
STATS_DIR_ENV = "ADAPTIVE_STATS_DIR"
#: Rotation threshold of ``requests.jsonl`` in bytes (read at every append).
REQUESTS_MAX_BYTES = 20 * 1024 * 1024

ENGINE_PREFIX = "engine-"
REQUESTS_FILE = "requests.jsonl"
REQUESTS_OLD_FILE = REQUESTS_FILE + ".1"
REQUESTS_LOCK_FILE = REQUESTS_FILE + ".lock"

_lock = threading.Lock()


def ensure_stats_dir() -> Path:
    """The exchange directory; create it (and export it) if ``$ADAPTIVE_STATS_DIR`` is unset.

    Safe to call any number of times, in any process: it only creates a
    directory when the variable is unset, so processes that inherited it share it.
    """
    with _lock:
        value = os.environ.get(STATS_DIR_ENV)
        if value:
            path = Path(value)
            path.mkdir(parents=True, exist_ok=True)
            return path
        path = Path(tempfile.mkdtemp(prefix="vllm-adaptive-"))
        os.environ[STATS_DIR_ENV] = str(path)
        atexit.register(_remove_own_dir, path, os.getpid())
        return path


def stats_dir() -> Path:
    """The exchange directory (see :func:`ensure_stats_dir`)."""
    return ensure_stats_dir()


def _remove_own_dir(path: Path, creator_pid: int) -> None:
    # A forked child inherits atexit handlers; only the creating process cleans up.
    if os.getpid() == creator_pid:
        shutil.rmtree(path, ignore_errors=True)


def _dir(directory: str | os.PathLike | None) -> Path:
    if directory is None:
        return stats_dir()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- engine stats (one file per engine process, rewritten atomically) -------------------------


#: per exchange directory, per mechanism: the latest totals each mechanism of this process wrote
_mine: dict[Path, dict[str, dict[str, Any]]] = {}
#: keys a depth runtime owns when it shares a process with other mechanisms (they count every
#: decode token at full depth, which under depth is not what ran)
DEPTH_OWNED = ("decode_tokens", "layers_executed", "exit_tokens", "num_layers")


def merge_mechanisms(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One process's totals from the mechanisms that run in it (depth on a precision gear, ...):
    the depth runtime's token and layer counts, deciding time summed (each mechanism's own),
    forward time the longest (they time the same forward), other keys from the first writer."""
    if len(entries) == 1:
        return entries[0]
    depth = next((e for e in entries if e.get("mechanism") == "depth"), None)
    merged: dict[str, Any] = {}
    for entry in entries:
        for key, value in entry.items():
            if key == "mechanism" or (
                depth is not None and entry is not depth and key in DEPTH_OWNED
            ):
                continue
            if key == "decision_seconds" and isinstance(value, (int, float)):
                merged[key] = merged.get(key, 0.0) + value
            elif key == "forward_seconds" and isinstance(value, (int, float)):
                merged[key] = max(merged.get(key, 0.0), value)
            else:
                merged.setdefault(key, value)
    merged["mechanism"] = "+".join(str(e.get("mechanism")) for e in entries)
    return merged


def write_engine_stats(stats: dict[str, Any], directory: str | os.PathLike | None = None) -> None:
    """Atomically replace this process's ``engine-<pid>.json`` with ``stats`` merged with what
    the process's other mechanisms last wrote (:func:`merge_mechanisms`; keyed by
    ``stats["mechanism"]``; stats that name no mechanism replace the whole file).

    ``stats`` must be JSON-able (strict JSON: NaN and infinity raise ValueError).
    """
    path = _dir(directory)
    pid = os.getpid()
    mechanism = str(stats.get("mechanism") or "")
    with _lock:
        mine = _mine.setdefault(path, {})
        if mechanism:
            mine.pop("", None)
        else:
            mine.clear()
        mine[mechanism] = stats
        merged = merge_mechanisms(list(mine.values()))
    data = json.dumps(merged, allow_nan=False, separators=(",", ":"))
    # Hidden and not matching engine-*.json, unique per thread: readers never see it.
    tmp = path / f".{ENGINE_PREFIX}{pid}.{threading.get_ident()}.tmp"
    try:
        tmp.write_text(data)
        os.replace(tmp, path / f"{ENGINE_PREFIX}{pid}.json")
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_engine_stats(directory: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Every readable ``engine-<pid>.json`` object of a live process, in file-name order; bad
    files and files of dead processes are skipped."""
    out = []
    for file in sorted(_dir(directory).glob(f"{ENGINE_PREFIX}*.json")):
        pid = _file_pid(file)
        if pid is None:
            continue
        try:
            written = file.stat().st_mtime
            value = json.loads(file.read_text())
        except (OSError, ValueError):  # vanished, unreadable, partial or not JSON
            continue
        if isinstance(value, dict) and _alive(pid, written):
            out.append(value)
    return out


def _file_pid(file: Path) -> int | None:
    digits = file.name[len(ENGINE_PREFIX) : -len(".json")]
    return int(digits) if digits.isdigit() and int(digits) > 0 else None


def _alive(pid: int, written: float) -> bool:
    """Whether the process that wrote a file last modified at ``written`` still runs."""
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return False
    started = _start_time(pid)
    # the pid now names a process younger than the file: the writer died and the pid was reused
    return started is None or started <= written + 2.0


def _start_time(pid: int) -> float | None:
    """The process's start time (epoch seconds) from /proc, None where unavailable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks
        return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise ValueError("no btime in /proc/stat")


# -- per-request records (one JSON line each, bounded by rotation) ----------------------------


@contextlib.contextmanager
def _requests_lock(path: Path, exclusive: bool) -> Iterator[None]:
    fd = os.open(path / REQUESTS_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def append_request_record(
    record: dict[str, Any], directory: str | os.PathLike | None = None
) -> None:
    """Append one record (a JSON object with a non-empty string ``"tag"``) to ``requests.jsonl``.

    If the file already exceeds :data:`REQUESTS_MAX_BYTES`, it first becomes
    ``requests.jsonl.1`` (the previous ``.1`` is dropped).
    """
    tag = record.get("tag")
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"a request record needs a non-empty string 'tag' (got {tag!r})")
    line = (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode()
    path = _dir(directory)
    current = path / REQUESTS_FILE
    with _requests_lock(path, exclusive=True):
        try:
            size = current.stat().st_size
        except FileNotFoundError:
            size = 0
        if size > REQUESTS_MAX_BYTES:
            os.replace(current, path / REQUESTS_OLD_FILE)
        fd = os.open(current, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def read_request_records(
    tag: str, directory: str | os.PathLike | None = None
) -> list[dict[str, Any]]:
    """All kept records with this tag, oldest first (newest last); bad lines are skipped."""
    path = _dir(directory)
    # Records are written with json.dumps defaults, so the tag appears as exactly this string.
    needle = json.dumps(tag).encode()
    out = []
    with _requests_lock(path, exclusive=False):
        for name in (REQUESTS_OLD_FILE, REQUESTS_FILE):
            try:
                lines = (path / name).read_bytes().splitlines()
            except FileNotFoundError:
                continue
            for raw in lines:
                if needle not in raw:  # cheap pre-filter before parsing
                    continue
                try:
                    value = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(value, dict) and value.get("tag") == tag:
                    out.append(value)
    return out
