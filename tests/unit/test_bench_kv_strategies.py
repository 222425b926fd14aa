"""`vllm-adaptive bench` reporting for depth configs (KV strategy x exit signal), no engines.

Engine outputs are synthetic but shaped like engine_run's (`run`'s dict, the depth runtime's
`engine_stats` and request records, `collect_memory`'s record) and go through the harness's
own merge/summary code, so the result dicts are the ones `vllm-adaptive bench --json` writes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_adaptive.bench.labels import config_label, run_labels
from vllm_adaptive.bench.memory import engine_memory, process_memory, read_proc_status
from vllm_adaptive.bench.plot import plot_pareto
from vllm_adaptive.bench.report import depth_table_markdown, main
from vllm_adaptive.bench.summary import merge_rounds, summarize_all
from vllm_adaptive.config import parse_adaptive_config
from vllm_adaptive.flops import DenseShape

L = 30
SHAPE = DenseShape(
    num_layers=L, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64,
    vocab=49152,
)  # fmt: skip
CONTEXT = 96.0
STOCK_TPS = {"1": 20.0, "8": 100.0}
STOCK_LP = -2.0  # every teacher-forced position: stock ppl e^2
FORCED = 5  # forced tokens per stream (4 decode-path logprobs each)
WORKLOAD = {
    "prompts": [[1, 2, 3]] * 8,
    "streams": [
        {"corpus": 0, "prefix": [1, 2], "forced": [5] * FORCED},
        {"corpus": 1, "prefix": [3, 4], "forced": [6] * FORCED},
    ],
}
CORPORA = [SimpleNamespace(path="code.txt"), SimpleNamespace(path="prose.txt")]
P = "/profiles/smollm2-emad"


def _depth(**kw: Any) -> dict[str, Any]:
    return {"depth": {"profile": P, **kw}}


MASK = _depth(budget=0.6, kv_strategy="mask")
RIVER = _depth(
    kv_strategy="river",
    river={"entry_layer": 8, "group_size": 32, "symmetric": False, "offload_backbone": False},
    signal={"policy": "river", "river": {"tau": 0.95, "batch_min": False}},
)
RIVER_W8A16 = _depth(
    kv_strategy="river",
    river={"entry_layer": 8, "precision": "w8a16"},
    signal={"policy": "river", "river": {"tau": 0.95}},
)
RIVER_OFFLOAD = _depth(
    kv_strategy="river",
    river={"entry_layer": 8, "group_size": 64, "symmetric": True, "offload_backbone": True},
    signal={"policy": "river", "river": {"tau": 0.9}},
)
PROPAGATE_QS = _depth(
    kv_strategy="propagate",
    signal={"policy": "quicksilver", "quicksilver": {"tau_drift": 60, "tau_entropy": 2.0}},
)
MONOTONE = _depth(budget=0.6, kv_strategy="monotone")
PROFILE_BUDGET = _depth()
COMBINED = _depth(
    budget=0.6,
    signal={"policy": ["emad", "river"], "combine": "any", "river": {"tau": 0.9}},
)


def _engine_stats(cfg: dict[str, Any], decode_tokens: int) -> dict[str, Any]:
    """The depth runtime's `engine_stats()` keys (vllm_adaptive/depth/runtime.py)."""
    d = cfg["depth"]
    sig = d.get("signal", {}).get("policy", "emad")
    strategy = d.get("kv_strategy", "monotone")
    return {
        "mechanism": "depth",
        "signal": [sig] if isinstance(sig, str) else list(sig),
        "kv_strategy": strategy,
        "propagated_kv": 40 if strategy == "propagate" else 0,
        "river_token_layers": 50 if strategy == "river" else 0,
        "masked_steps": 3 if strategy == "mask" else 0,
        "num_layers": L,
        "budget": d.get("budget", 0.8),
        "budget_kind": "layers",
        "probe_layers": list(range(2, L, 2)),
        "steps": 10,
        "decode_tokens": decode_tokens,
        "prefill_tokens": 40,
        "layers_executed": 20 * decode_tokens,
        "mean_decode_depth": 20.0,
        "exit_tokens": {"10": 1, "30": decode_tokens - 1},
        "capped_prefills": 0,
        "prefills_with_context": 0,
        "backfilled_kv": 0,
        "peels": 4,
        "probe_evals": decode_tokens,
        "proxy_rank": 32,
        "proxy": "lowrank",
        "decision_seconds": 0.1,
        "peel_seconds": 0.01,
        "forward_seconds": 2.0,
        "requests_finished": 3,
    }


def _record(tag: str, depths: list[int]) -> dict[str, Any]:
    """A finished request's record (DepthRequest.record); depths[0] is the prefill token."""
    return {
        "tag": tag,
        "mechanism": "depth",
        "prompt_tokens": 2,
        "generated_tokens": len(depths),
        "budget": 0.6,
        "budget_override": False,
        "mode": "on",
        "num_layers": L,
        "mean_depth": sum(depths) / len(depths),
        "exit_histogram": {},
        "depths": depths,
        "capped_prefill_depth": None,
        "finished_at": 0.0,
    }


def _memory(peak_mb: float, param_mb: float, worker_pid: int = 4242) -> dict[str, Any]:
    """engine_run.collect_memory's record, built by the real functions from a real reading."""
    worker = process_memory(torch.nn.Linear(4, 4))
    worker.update(pid=worker_pid, vm_hwm_mb=peak_mb, vm_rss_mb=peak_mb - 50.0)
    worker["params"]["bytes"] = int(param_mb * 2**20)
    return engine_memory([worker], {"pid": 1, **read_proc_status()})


def _raw(
    tps: dict[str, float],
    lp: float,
    greedy: list[int],
    peak_mb: float,
    cfg: dict[str, Any] | None = None,
    tf_depths: list[int] | None = None,
    tp_depths: list[int] | None = None,
) -> dict[str, Any]:
    """One round of engine_run's output for one engine."""
    out: dict[str, Any] = {
        "engine_start_s": 30.0,
        "decode_tokens_per_s": dict(tps),
        "ttft_s": {b: 0.05 for b in tps},
        "itl_s": {b: 1.0 / v for b, v in tps.items()},
        "teacher_forced": {
            "logprobs": [[lp] * (FORCED - 1) for _ in WORKLOAD["streams"]],
            "greedy": [list(greedy) for _ in WORKLOAD["streams"]],
            "prefill_logprobs": [[STOCK_LP] * (FORCED - 1) for _ in WORKLOAD["streams"]],
        },
        "memory": _memory(peak_mb, 250.0),
    }
    if cfg is not None:
        out["gears"] = None
        out["depth"] = None
        if "depth" in cfg:
            tf_depths = tf_depths or [L] * FORCED
            tp_depths = tp_depths or [L] * 4
            reqs = {f"tf{i}": _record(f"tf{i}", tf_depths) for i in range(2)}
            reqs["tp-b1-n4-0"] = _record("tp-b1-n4-0", tp_depths)
            n_decode = 2 * (len(tf_depths) - 1) + len(tp_depths) - 1
            out["depth"] = {"engine": _engine_stats(cfg, n_decode), "requests": reqs}
    return out


STOCK_GREEDY = [1, 2, 3, 4]


def _results(cases: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """run_bench's result dict from (config, raw output) pairs, through the harness's code."""
    base_raw = merge_rounds([_raw(STOCK_TPS, STOCK_LP, STOCK_GREEDY, 1000.0)])
    raws = [merge_rounds([raw]) for _, raw in cases]
    baseline, runs = summarize_all(
        [c for c, _ in cases], base_raw, raws, WORKLOAD, SHAPE, CONTEXT, CORPORA
    )
    return {
        "model": "/models/smollm2-135m-instruct",
        "settings": {"batch_sizes": [int(b) for b in STOCK_TPS]},
        "baseline": baseline,
        "runs": runs,
        "env": {},
    }


def _table_rows(md: str) -> dict[str, list[str]]:
    rows = {}
    for line in md.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows[cells[0]] = cells[1:]
    return rows


# -- labels ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "label"),
    [
        (MASK, "mask/emad b0.6"),
        (MONOTONE, "monotone/emad b0.6"),
        (RIVER, "river(g32 asym, L_s 8)/river tau0.95"),
        (RIVER_OFFLOAD, "river(g64 sym, L_s 8)+offload/river tau0.9"),
        (RIVER_W8A16, "river(w8a16, L_s 8)/river tau0.95"),
        (PROPAGATE_QS, "propagate/quicksilver 60/2.0"),
        (PROFILE_BUDGET, "monotone/emad b(profile)"),
        (COMBINED, "monotone/emad|river b0.6 tau0.9"),
        ({"mode": "off", **MASK}, "off: mask/emad b0.6"),
        (
            {"depth": {**MASK["depth"], "fusion": {"profile": "/tmp/fusion-profile"}}},
            "mask/emad b0.6 +fusion[fusion-profile]",
        ),
        ({}, "{}"),
        ({"precision": {"policy": "fixed", "gear": "w8a16"}}, "fixed w8a16"),
        (
            {"precision": {"policy": "fixed", "gear": "fp16", "head_gears": ["fp16"] * 3}},
            "fixed fp16 head fp16",
        ),
        (
            {
                "precision": {
                    "policy": "gearbx",
                    "gears": ["w8a8", "w8a16", "w8a16"],
                    "routing": "token",
                    "head_gears": ["w8a16", "w8a16", "fp16"],
                    "smoothing": {"profile": "/tmp/kb/smooth-8k"},
                }
            },
            "gearbx w8a8/w8a16/w8a16 token head w8a16/w8a16/fp16 smooth[smooth-8k]",
        ),
        (
            {"precision": {"policy": "fixed", "gear": "int8", "modules": ["qkv_proj", "o_proj"]}},
            "fixed int8 no head only qkv_proj,o_proj",
        ),
        (
            {**MONOTONE, "precision": {"policy": "fixed", "gear": "fp16"}},
            "monotone/emad b0.6 + fixed fp16",
        ),
    ],
)
def test_config_labels(config: dict[str, Any], label: str) -> None:
    parse_adaptive_config(config)  # the configs are valid for the real schema
    assert config_label(config) == label


def test_label_takes_the_engine_budget_when_the_profile_decides() -> None:
    assert config_label(PROFILE_BUDGET, {"budget": 0.8}) == "monotone/emad b0.8(profile)"


def test_run_labels_tell_equal_configs_apart() -> None:
    other = json.loads(json.dumps(MASK).replace("smollm2-emad", "feature-proxy"))
    res = _results(
        [
            (MASK, _raw(STOCK_TPS, STOCK_LP, STOCK_GREEDY, 1000.0, MASK)),
            (other, _raw(STOCK_TPS, STOCK_LP, STOCK_GREEDY, 1000.0, other)),
            (MASK, _raw(STOCK_TPS, STOCK_LP, STOCK_GREEDY, 1000.0, MASK)),
        ]
    )
    assert run_labels(res) == [
        "mask/emad b0.6 [smollm2-emad] #1",
        "mask/emad b0.6 [feature-proxy]",
        "mask/emad b0.6 [smollm2-emad] #2",
    ]


# -- table ----------------------------------------------------------------------------------


def test_table_columns_and_ratios(tmp_path: Path) -> None:
    mask_tf = [L, 10, 20, 30, 10]  # decode tokens: 10, 20, 30, 10 -> mean 17.5
    mask_tp = [L, 12, 12, 12]  # decode tokens: mean 12
    mask_lp = STOCK_LP - math.log(1.25)  # ppl x1.25
    cases = [
        (
            MASK,
            _raw({"1": 30.0, "8": 90.0}, mask_lp, [1, 2, 9, 9], 1100.0, MASK, mask_tf, mask_tp),
        ),
        (
            RIVER,
            _raw({"1": 25.0, "8": 105.0}, STOCK_LP, STOCK_GREEDY, 1300.0, RIVER, [L, 8, 8, L, L]),
        ),
        (
            PROPAGATE_QS,
            _raw({"1": 21.0, "8": 99.0}, STOCK_LP - 5.0, [0, 0, 0, 4], 1050.0, PROPAGATE_QS),
        ),
        ({}, _raw({"1": 19.0, "8": 101.0}, STOCK_LP, STOCK_GREEDY, 990.0, {})),
    ]
    res = _results(cases)
    res = json.loads(json.dumps(res))  # what --json writes and report.main reads back
    md = depth_table_markdown(res)
    lines = md.splitlines()
    assert lines[0].startswith(
        "| config | tok/s ratio b1 | tok/s ratio b8 | mean layers, throughput"
    )
    assert "teacher-forced" in lines[0] and "peak MB (ratio)" in lines[0]
    assert all(line.count(" | ") == lines[0].count(" | ") for line in lines)
    rows = _table_rows(md)
    assert list(rows) == [
        "stock vLLM",
        "mask/emad b0.6",
        "river(g32 asym, L_s 8)/river tau0.95",
        "propagate/quicksilver 60/2.0",
        "{}",
    ]
    stock = rows["stock vLLM"]
    assert stock[:2] == ["1.00 (20.0 tok/s)", "1.00 (100.0 tok/s)"]
    assert stock[5] == f"ppl {math.exp(2.0):.3f}" and stock[7] == "1000"

    tput, tf, flops, ppl, agree, mem = rows["mask/emad b0.6"][2:]
    assert rows["mask/emad b0.6"][:2] == ["1.50", "0.90"]  # 30/20, 90/100
    assert tput == f"12.0 ({12 / L:.2f})" and tf == f"17.5 ({17.5 / L:.2f})"
    assert ppl == "+25.00%" and agree == "0.500" and mem == "1100 (1.10)"
    assert float(flops) < 1.0
    mask_run = res["runs"][0]
    assert mask_run["depth"]["kv_strategy"] == "mask" and mask_run["depth"]["masked_steps"] == 3
    assert mask_run["peak_memory_ratio"] == pytest.approx(1.1)
    assert mask_run["memory"]["peak_mb"] == 1100.0 and mask_run["memory"]["engine_core_in_child"]

    river = rows["river(g32 asym, L_s 8)/river tau0.95"]
    assert river[:2] == ["1.25", "1.05"]
    assert river[3] == f"19.0 ({19 / L:.2f})"  # backbone blocks of decode tokens 8, 8, 30, 30
    # the Exit River runs the skipped blocks (int4, same FLOPs): no FLOPs saved by exiting
    assert float(river[4]) >= 1.0
    assert river[5] == "+0.00%" and river[6] == "1.000" and river[7] == "1300 (1.30)"
    assert res["runs"][1]["depth"]["river_layers_per_decode_token"] > 0

    qs = rows["propagate/quicksilver 60/2.0"]
    assert qs[:2] == ["1.05", "0.99"]
    assert qs[5] == f"x{math.exp(5.0):.1e}".replace("e+0", "e")  # x1.5e2
    assert qs[6] == "0.250" and qs[7] == "1050 (1.05)"

    plain = rows["{}"]
    assert plain[:2] == ["0.95", "1.01"]
    assert plain[2] == "" and plain[3] == ""  # no depth: empty depth columns
    assert plain[7] == "990 (0.99)"

    # the same table from the stored JSON, through the module's command line
    stored, out = tmp_path / "bench.json", tmp_path / "table.md"
    stored.write_text(json.dumps(res))
    assert main([str(stored), "--table-md", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    assert out.read_text() == md
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_table_without_memory_readings() -> None:
    raw = _raw(STOCK_TPS, STOCK_LP, STOCK_GREEDY, 1000.0, MASK)
    del raw["memory"]
    res = _results([(MASK, raw)])
    assert res["runs"][0]["peak_memory_ratio"] is None
    row = _table_rows(depth_table_markdown(res))["mask/emad b0.6"]
    assert row[-1] == ""


# -- plot -----------------------------------------------------------------------------------


def _twenty_configs() -> list[dict[str, Any]]:
    configs = []
    for b in (0.5, 0.6, 0.7, 0.8, 0.9):
        for strategy in ("monotone", "mask", "propagate"):
            configs.append(_depth(budget=b, kv_strategy=strategy))
    for tau in (0.9, 0.95):
        configs.append(
            _depth(
                kv_strategy="river",
                river={"entry_layer": 8},
                signal={"policy": "river", "river": {"tau": tau}},
            )
        )
    configs += [PROPAGATE_QS, RIVER_OFFLOAD, COMBINED]
    return configs


@pytest.mark.parametrize("sizes", [["1", "8"], ["1"]])
def test_pareto_plot_many_configs(tmp_path: Path, sizes: list[str]) -> None:
    configs = _twenty_configs()
    assert len(configs) == 20
    for c in configs:
        parse_adaptive_config(c)
    tps = {b: STOCK_TPS[b] for b in sizes}
    cases = [
        (
            c,
            _raw(
                {b: v * (1.0 + 0.03 * i) for b, v in tps.items()},
                STOCK_LP - 0.01 * i,
                STOCK_GREEDY,
                1000.0 + i,
                c,
                [L, 30 - i, 30 - i, L, L],
            ),
        )
        for i, c in enumerate(configs)
    ]
    base = _raw(tps, STOCK_LP, STOCK_GREEDY, 1000.0)
    baseline, runs = summarize_all(
        configs, merge_rounds([base]), [merge_rounds([r]) for _, r in cases], WORKLOAD, SHAPE,
        CONTEXT, CORPORA,
    )  # fmt: skip
    res = {"model": "/m/smollm2", "baseline": baseline, "runs": runs}
    assert len(set(run_labels(res))) == 20
    path = tmp_path / "pareto.png"
    plot_pareto(res, str(path))
    assert path.stat().st_size > 10_000


def test_pareto_plot_symlog_for_a_destroyed_model(tmp_path: Path) -> None:
    res = _results(
        [
            (MASK, _raw(STOCK_TPS, STOCK_LP - 12.0, [0, 0, 0, 0], 1000.0, MASK)),
            (RIVER, _raw(STOCK_TPS, STOCK_LP, STOCK_GREEDY, 1000.0, RIVER)),
        ]
    )
    plot_pareto(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


# -- memory ---------------------------------------------------------------------------------


def test_process_memory_reads_this_process(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16, bias=False))
    torch.save({"w": torch.randn(128, 256)}, tmp_path / "w.pt")
    mapped = torch.load(tmp_path / "w.pt", mmap=True, weights_only=True)["w"]
    model[1].weight = torch.nn.Parameter(mapped, requires_grad=False)  # like offload_backbone
    model[0].kv_cache = [torch.zeros(2, 3, 4), torch.zeros(5)]  # like vLLM's Attention.kv_cache
    model[0].register_buffer("scale", torch.ones(7))

    mem = process_memory(model)
    assert mem["pid"] == os.getpid()
    assert mem["vm_hwm_mb"] >= mem["vm_rss_mb"] > 0
    params = mem["params"]
    assert params["bytes"] == (64 * 32 + 32 + 7) * 4  # in memory: Linear 0 and the buffer
    assert params["bytes_by_device"] == {"cpu": params["bytes"]}
    assert params["mapped_file_bytes"] == 128 * 256 * 4  # the memory-mapped weight, apart
    assert params["mapped_file_resident_mb"] >= 0.0
    assert mem["kv_cache"]["bytes"] == (24 + 5) * 4
    assert "adaptive" not in mem
    json.dumps(mem)  # travels back from the worker as plain data


def test_engine_memory_in_child_or_in_process() -> None:
    w = {"pid": 7, "vm_hwm_mb": 900.0, "vm_rss_mb": 800.0, "params": {"bytes": 10}}
    w["params"]["mapped_file_bytes"] = 0
    child = engine_memory([w, dict(w)], {"pid": 3, "vm_hwm_mb": 400.0})
    assert child["engine_core_in_child"] and child["peak_mb"] == 900.0  # one process, counted once
    assert child["rss_after_mb"] == 800.0 and child["param_bytes"] == 10
    w2 = {**w, "pid": 8, "vm_hwm_mb": 700.0}
    assert engine_memory([w, w2], {"pid": 3})["peak_mb"] == 1600.0  # two workers
    same = engine_memory([{**w, "pid": 3}], {"pid": 3})
    assert not same["engine_core_in_child"]


def test_merge_rounds_keeps_round_one_memory_and_every_peak() -> None:
    r1 = _raw(STOCK_TPS, STOCK_LP, STOCK_GREEDY, 1000.0)
    r2 = _raw(STOCK_TPS, STOCK_LP, STOCK_GREEDY, 950.0)
    merged = merge_rounds([r1, r2])
    assert merged["memory"]["peak_mb"] == 1000.0
    assert merged["memory"]["peak_mb_rounds"] == [1000.0, 950.0]
