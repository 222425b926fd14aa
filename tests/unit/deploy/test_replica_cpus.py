"""ReplicaCpuBinding's choice of cores: one slice per replica rank, wrapping around."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray not installed (extra `ray`)")

from vllm_adaptive.engine.ray_serve import replica_cpus  # noqa: E402


def test_one_core_per_replica() -> None:
    assert [replica_cpus([0, 1], rank, 1) for rank in range(3)] == [[0], [1], [0]]


def test_slices_of_several_cores() -> None:
    cpus = [3, 0, 2, 1, 5, 4]  # os.sched_getaffinity order is not guaranteed
    assert [replica_cpus(cpus, rank, 2) for rank in range(4)] == [[0, 1], [2, 3], [4, 5], [0, 1]]
    assert replica_cpus([0, 1, 2], 1, 2) == [0, 1]  # one full slice only: replicas share it


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        replica_cpus([0, 1], 0, 0)
    with pytest.raises(ValueError):
        replica_cpus([], 0, 1)
