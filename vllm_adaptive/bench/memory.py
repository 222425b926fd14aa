"""Memory of the process that holds an engine's model and KV cache.

`process_memory` runs inside the worker (pass it to `LLM.apply_model`; it is importable, so
vLLM sends it by reference). With vLLM's default `VLLM_ENABLE_V1_MULTIPROCESSING=1` the engine
core, and with one worker the model and the KV cache, live in a child of the process that
created `LLM`; `/proc/self` of the caller would miss them. `read_proc_status` is the same
reading for any pid (the caller's own, for the frontend).

All figures are host memory (Linux `/proc`). On a GPU the weights and the KV cache sit in device
memory: `cuda_peak_allocated_mb` covers those.
"""

from __future__ import annotations

import bisect
import os
from typing import Any

MB = 1024 * 1024


def read_proc_status(pid: int | str = "self") -> dict[str, float]:
    """VmHWM (peak resident set), VmRSS and its split (anonymous, file-backed) in MB."""
    fields = {"VmHWM": "vm_hwm_mb", "VmRSS": "vm_rss_mb", "RssAnon": "rss_anon_mb"}
    fields["RssFile"] = "rss_file_mb"
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(rest.split()[0]) / 1024.0  # kB
    except OSError:
        pass
    return out


def _file_mappings(pid: int | str = "self") -> list[tuple[int, int, str, float]]:
    """(start, end, path, resident MB) of every file-backed mapping, from /proc/<pid>/smaps."""
    maps: list[tuple[int, int, str, float]] = []
    try:
        with open(f"/proc/{pid}/smaps") as f:
            current: list[Any] | None = None
            for line in f:
                head = line.split()
                if not head:
                    continue
                if "-" in head[0] and not head[0].endswith(":"):
                    current = None
                    # address perms offset dev inode [path]
                    if len(head) >= 6 and head[4] != "0" and not head[5].startswith("["):
                        lo, hi = (int(x, 16) for x in head[0].split("-"))
                        current = [lo, hi, " ".join(head[5:]), 0.0]
                        maps.append(current)  # type: ignore[arg-type]
                elif current is not None and head[0] == "Rss:":
                    current[3] = int(head[1]) / 1024.0
    except OSError:
        return []
    return [tuple(m) for m in maps]  # type: ignore[misc]


def tensor_storage_bytes(tensors: Any, mappings: list[tuple[int, int, str, float]]) -> dict:
    """Bytes of the distinct storages behind ``tensors``, by device, with the host storages that
    are memory-mapped files (e.g. offloaded weights) apart: their resident part is the Rss of
    their mappings."""
    mappings = sorted(mappings)
    starts = [m[0] for m in mappings]
    seen: set[tuple[str, int]] = set()
    by_device: dict[str, int] = {}
    mapped_bytes = 0
    mapped_regions: dict[tuple[int, int], float] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ptr, n = storage.data_ptr(), storage.nbytes()
        key = (str(t.device), ptr)
        if key in seen or n == 0:
            continue
        seen.add(key)
        if t.device.type == "cpu":
            i = bisect.bisect_right(starts, ptr) - 1
            region = mappings[i] if i >= 0 and ptr < mappings[i][1] else None
            if region is not None:
                mapped_bytes += n
                mapped_regions[(region[0], region[1])] = region[3]
                continue
        by_device[str(t.device)] = by_device.get(str(t.device), 0) + n
    return {
        "bytes_by_device": by_device,
        "bytes": sum(by_device.values()),
        "mapped_file_bytes": mapped_bytes,
        "mapped_file_resident_mb": sum(mapped_regions.values()),
    }


def _kv_cache_tensors(model: Any) -> list[Any]:
    """The KV cache tensors bound to the model's attention layers (vLLM's `Attention.kv_cache`)."""
    import torch

    out = []
    for module in model.modules():
        kv = getattr(module, "kv_cache", None)
        if isinstance(kv, torch.Tensor):
            out.append(kv)
        elif isinstance(kv, (list, tuple)):
            out.extend(x for x in kv if isinstance(x, torch.Tensor))
    return out


def process_memory(model: Any) -> dict[str, Any]:
    """Memory of the process running ``model`` (call through ``LLM.apply_model``).

    - ``vm_hwm_mb``: peak resident set of this process since it started (model, KV cache pages
      touched, activations, the Python runtime), ``vm_rss_mb`` now;
    - ``params``: the model's parameters and buffers (distinct storages; memory-mapped ones apart
      with their resident MB). vLLM's CPU backend also keeps prepacked GEMM copies of some
      weights outside the parameters: those count in VmHWM/VmRSS only;
    - ``kv_cache``: the KV cache tensors bound to the attention layers (allocated bytes; on CPU
      only the pages written become resident);
    - ``adaptive``: extra resident weights of an adaptive mechanism (Exit River copies, offloaded
      backbone bytes), where the model has them.
    """
    import torch

    mappings = _file_mappings()
    tensors = [*model.parameters(), *model.buffers()]
    out: dict[str, Any] = {"pid": os.getpid(), **read_proc_status()}
    out["params"] = tensor_storage_bytes(tensors, mappings)
    try:
        out["kv_cache"] = tensor_storage_bytes(_kv_cache_tensors(model), mappings)
    except Exception:  # noqa: BLE001 - a reading, never a failure of the benchmark
        out["kv_cache"] = None
    adaptive: dict[str, Any] = {}
    river = getattr(getattr(model, "depth", None), "river", None)
    if river is not None:
        try:
            adaptive["river_resident_bytes"] = int(river.resident_bytes())
            adaptive.update(getattr(river, "offloaded", {}) or {})
        except Exception:  # noqa: BLE001
            pass
    if adaptive:
        out["adaptive"] = adaptive
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / MB
        out["cuda_peak_reserved_mb"] = torch.cuda.max_memory_reserved() / MB
        out["cuda_allocated_mb"] = torch.cuda.memory_allocated() / MB
    return out


def engine_memory(workers: list[dict[str, Any]], frontend: dict[str, Any]) -> dict[str, Any]:
    """One engine's memory record from its workers' `process_memory` and the frontend's
    `read_proc_status` (taken in the process that created `LLM`, with its pid)."""
    distinct = {w["pid"]: w for w in workers}.values()
    peak = sum(w.get("vm_hwm_mb", 0.0) for w in distinct)
    rss = sum(w.get("vm_rss_mb", 0.0) for w in distinct)
    cuda = [w["cuda_peak_allocated_mb"] for w in distinct if "cuda_peak_allocated_mb" in w]
    return {
        "peak_mb": peak,
        "rss_after_mb": rss,
        "param_bytes": sum(w["params"]["bytes"] for w in distinct),
        "param_mapped_file_bytes": sum(w["params"]["mapped_file_bytes"] for w in distinct),
        "cuda_peak_allocated_mb": sum(cuda) if cuda else None,
        "engine_core_in_child": all(w["pid"] != frontend.get("pid") for w in distinct),
        "workers": list(distinct),
        "frontend": frontend,
    }
