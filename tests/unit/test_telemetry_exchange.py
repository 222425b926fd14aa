"""The worker -> frontend telemetry exchange (files, JSON only) and its Prometheus collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vllm_adaptive import telemetry_exchange as tx
from vllm_adaptive.telemetry_exchange import (
    STATS_DIR_ENV,
    append_request_record,
    read_engine_stats,
    read_request_records,
    write_engine_stats,
)

DEPTH_STATS = {
    "mechanism": "depth",
    "num_layers": 30,
    "decode_tokens": 100,
    "prefill_tokens": 40,
    "layers_executed": 2400,
    "exit_tokens": {"12": 30, "24": 20, "30": 50},
    "requests_finished": 3,
    "decision_seconds": 0.25,
    "forward_seconds": 4.5,
}

# what a precision engine writes (vllm_adaptive/precision/telemetry.py): every decode token at
# full depth, plus decode tokens by gear and gear shifts
PRECISION_STATS = {
    "mechanism": "precision",
    "num_layers": 30,
    "decode_tokens": 10,
    "layers_executed": 300,
    "exit_tokens": {"30": 10},
    "gear_tokens": {"low": 6, "high": 4, "": "x"},
    "gear_shifts": 3,
    "decision_seconds": 0.125,
    "forward_seconds": 0.5,
}


@pytest.fixture
def live_pids():
    """Pids of live processes (other engines' writers), ended after the test."""
    procs = []

    def make() -> int:
        procs.append(subprocess.Popen(["sleep", "300"]))
        return procs[-1].pid

    yield make
    for p in procs:
        p.kill()
        p.wait()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: the pid names no process (until the system reuses it)
    return p.pid


# -- engine stats ----------------------------------------------------------------------------


def test_engine_stats_round_trip_and_atomic_write(tmp_path: Path, monkeypatch) -> None:
    write_engine_stats({"decode_tokens": 1}, tmp_path)
    write_engine_stats(DEPTH_STATS, tmp_path)  # replaces this process's file
    assert [p.name for p in tmp_path.iterdir()] == [f"engine-{os.getpid()}.json"]
    assert read_engine_stats(tmp_path) == [DEPTH_STATS]

    # A write that fails half-way leaves the previous file whole and no temporary behind.
    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(tx.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_engine_stats({"decode_tokens": 7}, tmp_path)
    monkeypatch.undo()
    assert read_engine_stats(tmp_path) == [DEPTH_STATS]
    assert [p.name for p in tmp_path.iterdir()] == [f"engine-{os.getpid()}.json"]

    with pytest.raises(ValueError):
        write_engine_stats({"forward_seconds": float("nan")}, tmp_path)  # not strict JSON


def test_mechanisms_of_one_process_share_its_file(tmp_path: Path) -> None:
    """Depth on a precision gear: both runtimes live in the worker and export; the file keeps
    both (it used to hold whichever wrote last), with depth's token and layer counts (precision
    counts every token at full depth), both deciding times, one forward time."""
    write_engine_stats(PRECISION_STATS, tmp_path)
    write_engine_stats(DEPTH_STATS, tmp_path)
    write_engine_stats({**PRECISION_STATS, "gear_shifts": 5}, tmp_path)  # precision again
    (got,) = read_engine_stats(tmp_path)
    assert got["mechanism"] == "precision+depth"
    for key in ("decode_tokens", "layers_executed", "exit_tokens", "num_layers"):
        assert got[key] == DEPTH_STATS[key], key
    assert got["gear_tokens"] == PRECISION_STATS["gear_tokens"] and got["gear_shifts"] == 5
    assert got["decision_seconds"] == 0.25 + 0.125 and got["forward_seconds"] == 4.5
    assert got["prefill_tokens"] == 40 and got["requests_finished"] == 3
    write_engine_stats({"decode_tokens": 2}, tmp_path)  # no mechanism named: the whole file
    assert read_engine_stats(tmp_path) == [{"decode_tokens": 2}]


def test_partial_and_foreign_files_are_skipped(tmp_path: Path) -> None:
    write_engine_stats(DEPTH_STATS, tmp_path)
    (tmp_path / "engine-1.json").write_text('{"decode_tokens": 5, "exit_')  # torn write
    (tmp_path / "engine-2.json").write_text("[1, 2]")  # JSON, not an object
    (tmp_path / "engine-3.json").mkdir()  # unreadable
    (tmp_path / ".engine-4.123.tmp").write_text(json.dumps({"decode_tokens": 9}))
    (tmp_path / "other.json").write_text(json.dumps({"decode_tokens": 9}))
    assert read_engine_stats(tmp_path) == [DEPTH_STATS]


def test_files_of_dead_engine_processes_are_ignored(tmp_path: Path, live_pids) -> None:
    """Only live engines count: a restarted engine or an inherited directory must not add a dead
    process's totals; nor does a pid reused by a process started after the file was written."""
    live, reused, dead = live_pids(), live_pids(), _dead_pid()
    for pid, tokens in [(live, 1), (reused, 10), (dead, 100)]:
        (tmp_path / f"engine-{pid}.json").write_text(json.dumps({"decode_tokens": tokens}))
    old = os.stat(tmp_path / f"engine-{reused}.json").st_mtime - 3600
    os.utime(tmp_path / f"engine-{reused}.json", (old, old))  # written before `reused` started
    write_engine_stats({"decode_tokens": 1000}, tmp_path)  # this process: alive
    got = sorted(s["decode_tokens"] for s in read_engine_stats(tmp_path))
    assert got == [1, 1000]
    assert len(list(tmp_path.glob("engine-*.json"))) == 4  # ignored, not deleted


def test_empty_or_missing_dir(tmp_path: Path) -> None:
    assert read_engine_stats(tmp_path / "new") == []
    assert read_request_records("x", tmp_path / "new") == []


# -- request records -------------------------------------------------------------------------


def test_request_records_by_tag_newest_last(tmp_path: Path) -> None:
    for i in range(3):
        append_request_record({"tag": "a", "i": i}, tmp_path)
        append_request_record({"tag": "b", "i": i}, tmp_path)
    append_request_record({"tag": 'wé"ird/tag', "i": 9}, tmp_path)
    append_request_record({"tag": "ab", "i": 8}, tmp_path)  # contains "a", not tag "a"
    with open(tmp_path / tx.REQUESTS_FILE, "a") as f:
        f.write('{"tag": "a", "i": ')  # a torn last line
    assert [r["i"] for r in read_request_records("a", tmp_path)] == [0, 1, 2]
    assert [r["i"] for r in read_request_records("b", tmp_path)] == [0, 1, 2]
    assert read_request_records('wé"ird/tag', tmp_path) == [{"tag": 'wé"ird/tag', "i": 9}]
    assert read_request_records("nope", tmp_path) == []
    for bad in ({}, {"tag": ""}, {"tag": 3}):
        with pytest.raises(ValueError, match="tag"):
            append_request_record(bad, tmp_path)


def test_request_records_rotate_keeping_one_old_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tx, "REQUESTS_MAX_BYTES", 1000)
    pad = "x" * 80
    for i in range(60):  # ~100 bytes per line: ~10 lines per file, several rotations
        append_request_record({"tag": "t", "i": i, "pad": pad}, tmp_path)
    current = tmp_path / tx.REQUESTS_FILE
    old = tmp_path / tx.REQUESTS_OLD_FILE
    assert old.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        tx.REQUESTS_FILE,
        tx.REQUESTS_OLD_FILE,
    ]
    # A file grows past the limit by at most one line before it is rotated.
    assert current.stat().st_size <= 1000 + 120 and old.stat().st_size <= 1000 + 120
    kept = [r["i"] for r in read_request_records("t", tmp_path)]
    assert kept == list(range(kept[0], 60))  # contiguous, oldest first, newest last
    assert 10 < len(kept) < 30  # the oldest records were dropped


def test_stats_dir_created_once_and_inherited(tmp_path: Path) -> None:
    """The plugin's register() creates the dir in the parent; children inherit it."""
    script = """
import json, os, subprocess, sys
from vllm_adaptive.engine.plugin import register
register()
register()  # vLLM may call it twice in one process
from vllm_adaptive.telemetry_exchange import stats_dir, write_engine_stats, read_engine_stats
d = os.environ["ADAPTIVE_STATS_DIR"]
assert str(stats_dir()) == d
child = subprocess.Popen(
    [sys.executable, "-c",
     "import sys; from vllm_adaptive.telemetry_exchange import *; "
     "write_engine_stats({'decode_tokens': 5}); print(stats_dir(), flush=True); sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
)
child_dir = child.stdout.readline().strip()
read = read_engine_stats()  # the child is alive: counted
child.stdin.close()
child.wait()
print(json.dumps({"dir": d, "child": child_dir, "read": read, "after": read_engine_stats()}))
"""
    env = {k: v for k, v in os.environ.items() if k != STATS_DIR_ENV}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["dir"]).name.startswith("vllm-adaptive-")
    assert result["child"] == result["dir"]
    assert result["read"] == [{"decode_tokens": 5}]
    assert result["after"] == []  # the child exited: its file no longer counts
    assert not Path(result["dir"]).exists()  # a created dir is removed when its creator exits

    # A dir the user names is used (created if needed) and kept.
    named = tmp_path / "named"
    env[STATS_DIR_ENV] = str(named)
    subprocess.run(
        [sys.executable, "-c", "from vllm_adaptive.engine.plugin import register; register()"],
        env=env,
        check=True,
    )
    assert named.is_dir()


# -- the Prometheus collector ----------------------------------------------------------------


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name.startswith("vllm_adaptive:")
    }


def test_collector_exports_file_totals(tmp_path: Path, live_pids) -> None:
    from vllm_adaptive.engine.metrics import COUNTERS, AdaptiveTelemetryCollector

    other = {
        "decode_tokens": 10,
        "layers_executed": 300,
        "exit_tokens": {"30": 10, "bad": 3, "12": True},
        "decision_seconds": "fast",  # not a number: counts as absent
        "forward_seconds": 0.5,
    }
    write_engine_stats(DEPTH_STATS, tmp_path)
    (tmp_path / f"engine-{live_pids()}.json").write_text(json.dumps(other))
    (tmp_path / f"engine-{live_pids()}.json").write_text("{")  # partial: skipped
    (tmp_path / f"engine-{live_pids()}.json").write_text(json.dumps(PRECISION_STATS))

    now = [0.0]
    collector = AdaptiveTelemetryCollector(
        reader=lambda: read_engine_stats(tmp_path), clock=lambda: now[0]
    )
    registry = CollectorRegistry()
    registry.register(collector)
    assert _samples(registry) == {
        ("vllm_adaptive:decode_tokens_total", ()): 120.0,
        ("vllm_adaptive:layers_executed_total", ()): 3000.0,
        ("vllm_adaptive:decision_seconds_total", ()): 0.375,
        ("vllm_adaptive:forward_seconds_total", ()): 5.5,
        ("vllm_adaptive:gear_shifts_total", ()): 3.0,
        ("vllm_adaptive:exit_tokens_total", (("depth", "12"),)): 30.0,
        ("vllm_adaptive:exit_tokens_total", (("depth", "24"),)): 20.0,
        ("vllm_adaptive:exit_tokens_total", (("depth", "30"),)): 70.0,
        ("vllm_adaptive:mean_decode_depth", ()): 3000.0 / 120.0,
        ("vllm_adaptive:gear_tokens_total", (("gear", "high"),)): 4.0,
        ("vllm_adaptive:gear_tokens_total", (("gear", "low"),)): 6.0,
        **{
            (f"vllm_adaptive:{name}", ()): 0.0
            for name, key, _ in COUNTERS
            if key.startswith("moe_")
        },
    }
    text = generate_latest(registry).decode()
    assert "# TYPE vllm_adaptive:decode_tokens_total counter" in text
    assert "# TYPE vllm_adaptive:mean_decode_depth gauge" in text
    assert 'vllm_adaptive:exit_tokens_total{depth="24"} 20.0' in text
    assert "# TYPE vllm_adaptive:gear_tokens_total counter" in text

    # Throttled: files are re-read at most once per interval.
    write_engine_stats({**DEPTH_STATS, "decode_tokens": 200}, tmp_path)
    now[0] = 0.5
    assert _samples(registry)[("vllm_adaptive:decode_tokens_total", ())] == 120.0
    now[0] = 1.5
    assert _samples(registry)[("vllm_adaptive:decode_tokens_total", ())] == 220.0


def test_collector_empty_dir_and_reader_errors(tmp_path: Path) -> None:
    from vllm_adaptive.engine.metrics import COUNTERS, AdaptiveTelemetryCollector

    registry = CollectorRegistry()
    registry.register(AdaptiveTelemetryCollector(reader=lambda: read_engine_stats(tmp_path)))
    samples = _samples(registry)
    assert samples["vllm_adaptive:decode_tokens_total", ()] == 0.0
    assert not any(name.endswith("mean_decode_depth") for name, _ in samples)  # no tokens yet

    def broken():
        raise RuntimeError("boom")

    collector = AdaptiveTelemetryCollector(reader=broken)
    assert collector.refresh() is False  # logged, not raised
    assert len(collector.collect()) == len(COUNTERS) + 4  # + exits, mean depth, gears, hit rate
    assert not any(name.endswith("moe_expert_hit_rate") for name, _ in samples)


def test_stat_logger_record_refreshes_and_double_registration_is_safe(
    tmp_path: Path, monkeypatch
) -> None:
    from prometheus_client import REGISTRY

    from vllm_adaptive.engine import metrics

    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path))
    loggers = [metrics.AdaptiveStatLogger(None, [0]) for _ in range(3)]  # three engines
    assert all(lg.collector is loggers[0].collector for lg in loggers)
    assert metrics.install_collector() is loggers[0].collector
    collector = loggers[0].collector
    names = {s.name for f in REGISTRY.collect() for s in f.samples}
    assert "vllm_adaptive:decode_tokens_total" in names  # once: the registry raises on duplicates

    write_engine_stats(DEPTH_STATS, tmp_path)
    collector._last_refresh = None  # earlier tests in this process may have refreshed it
    loggers[1].record(None, None, engine_idx=0)
    assert collector.totals["decode_tokens"] == 100.0
    loggers[0].log_engine_initialized()


def test_collector_exports_moe_totals(tmp_path: Path) -> None:
    from vllm_adaptive.engine.metrics import AdaptiveTelemetryCollector

    moe = {
        "mechanism": "moe",
        "moe_tokens": 40,
        "moe_hits": 30,
        "moe_misses": 10,
        "moe_loads": 12,
        "moe_evictions": 4,
        "moe_stall_seconds": 0.25,
        "moe_bytes_read": 4096,
        "moe_prefetches": 7,
        "moe_prefetch_promoted": 2,
        "moe_prefetch_cancelled": 3,
        "forward_seconds": 1.0,
    }
    write_engine_stats(moe, tmp_path)
    collector = AdaptiveTelemetryCollector(reader=lambda: read_engine_stats(tmp_path))
    registry = CollectorRegistry()
    registry.register(collector)
    got = _samples(registry)
    assert got[("vllm_adaptive:moe_expert_hits_total", ())] == 30.0
    assert got[("vllm_adaptive:moe_expert_misses_total", ())] == 10.0
    assert got[("vllm_adaptive:moe_stall_seconds_total", ())] == 0.25
    assert got[("vllm_adaptive:moe_read_bytes_total", ())] == 4096.0
    assert got[("vllm_adaptive:moe_prefetches_total", ())] == 7.0
    assert got[("vllm_adaptive:moe_prefetches_promoted_total", ())] == 2.0
    assert got[("vllm_adaptive:moe_prefetches_cancelled_total", ())] == 3.0
    assert got[("vllm_adaptive:moe_expert_hit_rate", ())] == 0.75
    assert "# TYPE vllm_adaptive:moe_expert_hit_rate gauge" in generate_latest(registry).decode()
