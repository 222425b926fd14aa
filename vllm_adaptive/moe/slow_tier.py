"""**Slow tier** (:class:`SlowTier`): one file holding every expert's weights, one contiguous
record per (layer, expert), each record starting on a page boundary (so a record's pages belong
to it alone), memory-mapped read-only, without read-around (``MADV_RANDOM``: reading one
record must not pull its neighbours into the page cache) and with one ``MADV_WILLNEED`` of
exactly the record before each copy. The file's pages leave the page cache once written, so
first loads are cold too. Dropping a record (:meth:`SlowTier.drop`) removes its
pages from this process's mapping (``madvise(MADV_DONTNEED)``) and from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``), so the next read of that record really comes from the
disk. :meth:`SlowTier.measure_bandwidth` times cold reads of a few records after dropping them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("vllm.adaptive.moe")

PAGE = mmap.PAGESIZE
Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class RecordLayout:
    """The parts of one expert record: name -> shape, all of one dtype, packed in order."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: torch.dtype

    # Cached: every load reads nbytes, and computing it (torch.empty for the item size) cost
    # ~100 us per load on the compute thread (profiled with docs/experiments/moe_eviction.py).
    @functools.cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def offsets(self) -> dict[str, tuple[int, int]]:
        """name -> (byte offset, byte length) inside a record."""
        return dict(self._offsets)

    @functools.cached_property
    def _offsets(self) -> dict[str, tuple[int, int]]:
        out, off = {}, 0
        for name, shape in self.parts:
            n = math.prod(shape) * self.itemsize
            out[name] = (off, n)
            off += n
        return out

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(n for _, n in self._offsets.values())

    @functools.cached_property
    def stride(self) -> int:
        """Bytes between records: the record rounded up to whole pages."""
        return -(-self.nbytes // PAGE) * PAGE


def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


class SlowTier:
    """The file of all experts' records, memory-mapped read-only (see the module docstring)."""

    def __init__(
        self, path: str | os.PathLike, num_layers: int, num_experts: int, layout: RecordLayout
    ) -> None:
        self.path = Path(path)
        self.num_layers, self.num_experts, self.layout = num_layers, num_experts, layout
        self.size = num_layers * num_experts * layout.stride
        self.fd = os.open(self.path, os.O_RDONLY)
        actual = os.fstat(self.fd).st_size
        if actual != self.size:
            os.close(self.fd)
            raise ValueError(f"{self.path}: {actual} bytes, expected {self.size}")
        self.mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        # No read-around on page faults: with it, reading one record pulls the neighbouring
        # records' pages into the page cache (measured: the whole next record), and their
        # later "cold" loads would be warm. read_into asks for exactly one record instead.
        self.mm.madvise(mmap.MADV_RANDOM)
        self._bytes = np.frombuffer(self.mm, dtype=np.uint8)
        self.bytes_read = 0
        self.drops = 0
        self.drop_calls: list[Key] = []  # the last drops, for tests (bounded)

    # -- writing ------------------------------------------------------------------------------

    @classmethod
    def write(
        cls,
        path: str | os.PathLike,
        num_layers: int,
        num_experts: int,
        layout: RecordLayout,
        records: Callable[[int, int], Mapping[str, torch.Tensor]],
    ) -> SlowTier:
        """Write every record (``records(layer, expert)`` gives its parts), flush it to disk and
        open the file. The file is written whole before anything maps it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        offsets = layout.offsets()
        shapes = dict(layout.parts)
        buf = bytearray(layout.stride)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for layer in range(num_layers):
                for expert in range(num_experts):
                    parts = records(layer, expert)
                    for name, (off, n) in offsets.items():
                        t = parts[name]
                        if tuple(t.shape) != shapes[name]:
                            raise ValueError(
                                f"record ({layer}, {expert}) part {name}: shape "
                                f"{tuple(t.shape)}, expected {shapes[name]}"
                            )
                        raw = t.detach().to("cpu", layout.dtype).contiguous().view(torch.uint8)
                        buf[off : off + n] = raw.numpy().tobytes()
                    os.pwrite(fd, buf, (layer * num_experts + expert) * layout.stride)
            os.ftruncate(fd, num_layers * num_experts * layout.stride)
            os.fsync(fd)  # dirty pages cannot be dropped from the page cache
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # first loads read the disk too
        finally:
            os.close(fd)
        return cls(path, num_layers, num_experts, layout)

    # -- reading ------------------------------------------------------------------------------

    def offset(self, key: Key) -> int:
        layer, expert = key
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise KeyError(f"no expert record {key}")
        return (layer * self.num_experts + expert) * self.layout.stride

    def read_into(self, key: Key, dst: np.ndarray) -> None:
        """Copy one record (``layout.nbytes`` bytes) from the mapping into ``dst`` (uint8).
        numpy's copy releases the GIL, so this overlaps with compute on another thread."""
        off = self.offset(key)
        n = self.layout.nbytes
        self.mm.madvise(mmap.MADV_WILLNEED, off, self.layout.stride)  # one read-ahead of it
        np.copyto(dst[:n], self._bytes[off : off + n])
        self.bytes_read += n

    def drop(self, key: Key) -> None:
        """Drop the record's pages from this mapping and from the page cache."""
        off, n = self.offset(key), self.layout.stride
        self.mm.madvise(mmap.MADV_DONTNEED, off, n)
        os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_DONTNEED)
        self.drops += 1
        self.drop_calls.append(key)
        del self.drop_calls[:-64]

    def resident_fraction(self, key: Key) -> float | None:
        """Fraction of the record's pages in memory (``mincore``), None where unavailable."""
        if _LIBC is None:
            return None
        off, n = self.offset(key), self.layout.stride
        addr = self._bytes.__array_interface__["data"][0] + off
        vec = (ctypes.c_ubyte * (n // PAGE))()
        if _LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) != 0:
            return None
        return sum(v & 1 for v in vec) / len(vec)

    def measure_bandwidth(self, keys: Iterable[Key]) -> dict[str, float]:
        """Cold-read ``keys`` (each dropped first) into a scratch buffer; bytes/s and time."""
        keys = list(keys)
        scratch = np.empty(self.layout.stride, dtype=np.uint8)
        for key in keys:
            self.drop(key)
        n0 = self.bytes_read
        t0 = time.perf_counter()
        for key in keys:
            self.read_into(key, scratch)
        dt = time.perf_counter() - t0
        nbytes = self.bytes_read - n0
        for key in keys:
            self.drop(key)
        return {
            "records": len(keys),
            "bytes": nbytes,
            "seconds": dt,
            "bytes_per_s": nbytes / dt if dt > 0 else float("inf"),
        }

    def close(self) -> None:
        if self.fd < 0:
            return
        del self._bytes
        self.mm.close()
        os.close(self.fd)
        self.fd = -1
