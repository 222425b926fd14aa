"""The machine record of every bench JSON (bench/machine.py) and the dispatch readings
(bench/dispatch.py) on plain torch modules."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from vllm_adaptive.bench.dispatch import kernel_dispatch, linear_methods
from vllm_adaptive.bench.machine import ISA_FLAGS, cpuinfo, env_info
from vllm_adaptive.corpora import read_corpus


def test_env_info_records_cpu_isa_and_versions(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_text("hello world\n" * 50)
    env = env_info([read_corpus(f)])
    json.dumps(env)
    assert env["cpu"] and env["cores"] >= 1 and env["torch"]
    assert set(env["isa"]) <= set(ISA_FLAGS) and set(env["isa"]) <= set(env["cpu_flags"])
    if Path("/proc/cpuinfo").exists() and "avx2" in Path("/proc/cpuinfo").read_text():
        assert "avx2" in env["isa"]
    assert env["torch_cpu_capability"]  # e.g. "AVX2", "AVX512", "DEFAULT"
    assert env["corpora"][0]["sha256"] == read_corpus(f).sha256
    assert cpuinfo()["isa"] == env["isa"]


class _Method:
    pass


class _Kernel:
    def _apply_weights_onednn(self) -> None:
        pass

    def __init__(self) -> None:
        self.linear_method = self._apply_weights_onednn


def test_linear_methods_and_dispatch_hook() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.ReLU())
    assert linear_methods(model) == {}  # plain torch linears: no vLLM quant method
    for m in model[:2]:
        m.input_size = 2
        m.quant_method = _Method()
    model[1].scheme = SimpleNamespace(kernel=_Kernel())
    assert linear_methods(model) == {
        "_Method": 1,
        "_Method/SimpleNamespace/_Kernel:_apply_weights_onednn": 1,
    }
    assert kernel_dispatch(model) is None  # stock: no table
    model.kernel_dispatch = lambda: {"qkv_proj": "fp16-fbgemm"}
    assert kernel_dispatch(model) == {"qkv_proj": "fp16-fbgemm"}
