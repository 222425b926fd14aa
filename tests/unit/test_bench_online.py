"""The online bench's pieces that need no server: server specs, ABBA order, the baseline per
concurrency, agreement, the report (the bench itself runs servers: `vllm-adaptive bench-serve`)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from vllm_adaptive.bench import online_report, serve_client, servers


def test_server_spec_parsing_and_errors() -> None:
    s = servers.parse_server_spec('{"label": "fp16", "dtype": "float32", "adaptive": {}}')
    assert s == servers.ServerSpec("fp16", "float32", {}, ()) and not s.stock
    assert servers.parse_server_spec('{"label": "s", "dtype": "bfloat16"}').stock
    for bad, word in (
        ("{", "not JSON"),
        ('{"label": "x", "dtype": "fp8"}', "dtype"),
        ('{"label": "", "dtype": "float32"}', "label"),
        ('{"label": "x", "dtype": "float32", "adaptiv": {}}', "unknown keys"),
        ('{"label": "x", "dtype": "float32", "serve_args": "--x"}', "serve_args"),
        ('{"label": "x", "dtype": "float32", "adaptive": 1}', "adaptive"),
        ('{"label": "x", "dtype": "float32", "model": "llama-9000"}', "unknown model"),
    ):
        with pytest.raises(ValueError, match=word):
            servers.parse_server_spec(bad)


def test_server_from_another_commit(tmp_path, monkeypatch) -> None:
    """``code``: the plugin as of a git commit, imported first by the server (PYTHONPATH)."""
    head = servers.resolve_commit("HEAD")
    assert len(head) == 40
    spec = servers.parse_server_spec(
        '{"label": "before", "dtype": "bfloat16", "adaptive": {}, "code": "HEAD"}'
    )
    assert spec.code == head
    for bad, word in (
        ('{"label": "x", "dtype": "bfloat16", "adaptive": {}, "code": "no-such-rev"}', "no-such"),
        ('{"label": "x", "dtype": "bfloat16", "code": "HEAD"}', "needs the plugin on"),
    ):
        with pytest.raises(ValueError, match=word):
            servers.parse_server_spec(bad)
    dest = servers.code_checkout(head, root=tmp_path)
    assert dest == tmp_path / head
    assert (dest / "vllm_adaptive" / "engine" / "plugin.py").is_file()
    assert not (dest / "tests").exists()  # the package only
    assert servers.code_checkout(head, root=tmp_path) == dest  # extracted once
    monkeypatch.setattr(servers, "code_checkout", lambda commit: tmp_path / commit)
    env = servers.serve_env(spec)
    assert env["PYTHONPATH"] == str(tmp_path / head) and env["VLLM_PLUGINS"] == servers.PLUGINS_ON
    assert "PYTHONPATH" not in servers.serve_env(servers.ServerSpec("now", "bfloat16", {}))


def test_stock_is_really_stock_and_plugin_is_on() -> None:
    stock = servers.ServerSpec("stock", "float32")
    assert servers.serve_env(stock) == {"VLLM_PLUGINS": "", "ADAPTIVE_DRAFTS": "none"}
    on = servers.serve_env(servers.ServerSpec("p", "float32", {"precision": None}))
    assert on["VLLM_PLUGINS"] == servers.PLUGINS_ON and on["ADAPTIVE_DRAFTS"] == "none"
    assert json.loads(on["ADAPTIVE_CONFIG"]) == {"adaptive": {"precision": None}}
    peer = servers.parse_server_spec(
        '{"label": "w8a8", "dtype": "bfloat16", "model": "smollm2-135m-instruct-w8a8"}'
    )
    assert peer.stock and servers.serve_env(peer) == {
        "VLLM_PLUGINS": "",
        "ADAPTIVE_DRAFTS": "none",
        "ADAPTIVE_MODEL": "smollm2-135m-instruct-w8a8",
    }
    client = serve_client.client_command("u", "d", "p", 1, 2, 3, "r", "n", peer.model)
    assert client[client.index("--model") + 1] == "smollm2-135m-instruct-w8a8"
    assert "--skip-chat-template" in client and "--ignore-eos" in client
    chat = serve_client.client_command("u", "d", "p", 1, 2, 3, "r", "n", peer.model, "chat")
    # chat requests: the client applies the template and answers end at the end of turn
    assert "--skip-chat-template" not in chat and "--ignore-eos" not in chat
    cmd = servers.serve_command(stock, 1234)
    assert cmd[1].endswith("scripts/serve.sh") and cmd[cmd.index("--dtype") + 1] == "float32"
    # serve.sh itself, under the bench's environment: no drafter a spec did not name (its
    # float32 default adds vLLM's suffix drafter)
    for spec in (stock, servers.ServerSpec("fp16", "float32", {"precision": {"gear": "fp16"}})):
        env = {**os.environ, **servers.serve_env(spec), "SERVE_DRY_RUN": "1"}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        assert "spec none" in out.splitlines(), out


def test_defaults_follow_the_isa() -> None:
    avx2 = servers.default_servers(["avx2", "fma"])
    bf16 = servers.default_servers(["avx2", "avx512f", "avx512_bf16"])
    assert {s.dtype for s in avx2 if s.stock} == {"bfloat16", "float32"}
    assert {s.dtype for s in avx2 if not s.stock} == {"float32"}
    assert {s.dtype for s in bf16 if not s.stock} == {"bfloat16", "float32"}


def test_abba_order() -> None:
    a, b, c = (servers.ServerSpec(x, "float32") for x in "abc")
    order = [(r, s.label) for r, s in servers.abba([a, b, c], 2)]
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]


def _run(tps: float, tpot: float, ttft: float) -> dict:
    return {
        "output_throughput": tps,
        "median_tpot_ms": tpot,
        "median_ttft_ms": ttft,
        "failed": 0,
        "completed": 8,
    }


def test_baseline_is_the_faster_stock_per_concurrency() -> None:
    servers = [
        {
            "label": "stock bf16",
            "stock": True,
            "runs": {"1": [_run(30, 30, 100)], "8": [_run(50, 90, 300)]},
        },
        {
            "label": "stock f32",
            "stock": True,
            "runs": {"1": [_run(20, 45, 120)], "8": [_run(100, 70, 200)]},
        },
        {
            "label": "stock+ngram",
            "stock": True,
            "serve_args": ["--speculative-config", "{}"],
            "runs": {"1": [_run(90, 10, 100)], "8": [_run(200, 30, 200)]},
        },
        {
            "label": "stock w8a8 checkpoint",
            "stock": True,
            "model": "smollm2-135m-instruct-w8a8",
            "runs": {"1": [_run(80, 12, 90)], "8": [_run(190, 35, 190)]},
        },
        {
            "label": "p",
            "stock": False,
            "runs": {"1": [_run(60, 15, 50), _run(40, 25, 150)], "8": [_run(110, 60, 210)]},
        },
    ]
    summ = online_report.summarize(servers, [1, 8])
    # never stock+ngram, never another checkpoint
    assert summ["baseline"] == {"1": "stock bf16", "8": "stock f32"}
    p1 = summ["servers"]["p"]["1"]
    assert p1["output_throughput"] == 50 and p1["output_throughput_range"] == [40, 60]
    assert p1["x_output_throughput"] == pytest.approx(50 / 30)
    assert summ["servers"]["p"]["8"]["x_ttft"] == pytest.approx(200 / 210)


def test_a_run_on_another_model_compares_with_stock_on_that_model() -> None:
    """Every server on Gemma: the baseline is plain stock Gemma (not a server with serve
    arguments); a run mixing checkpoints keeps the default model's stock as its baseline."""
    g = "gemma3-270m"
    servers = [
        {"label": "stock", "stock": True, "model": g, "runs": {"1": [_run(40, 25, 90)]}},
        {
            "label": "stock one group",
            "stock": True,
            "model": g,
            "serve_args": ["--disable-hybrid-kv-cache-manager"],
            "runs": {"1": [_run(50, 20, 90)]},
        },
        {"label": "p", "stock": False, "model": g, "runs": {"1": [_run(30, 33, 95)]}},
    ]
    summ = online_report.summarize(servers, [1])
    assert summ["baseline"] == {"1": "stock"}
    assert summ["servers"]["p"]["1"]["x_output_throughput"] == pytest.approx(30 / 40)
    mixed = [*servers, {"label": "smol", "stock": True, "runs": {"1": [_run(60, 16, 80)]}}]
    assert online_report.summarize(mixed, [1])["baseline"] == {"1": "smol"}


def test_a_level_whose_requests_failed_gets_no_ratio_and_says_so() -> None:
    """A server whose engine died mid-run: its level keeps its figures (zeros), no ratio
    against the baseline, and the table names the failures instead of dividing by zero."""
    dead = {**_run(0.3, 0.0, 500), "failed": 15, "completed": 1}
    servers = [
        {"label": "stock f32", "stock": True, "runs": {"8": [_run(50, 90, 300)]}},
        {"label": "p", "stock": False, "runs": {"8": [dead, dead]}},
    ]
    summ = online_report.summarize(servers, [8])
    p8 = summ["servers"]["p"]["8"]
    assert p8["failed_total"] == 30 and p8["x_tpot"] is None
    assert p8["x_output_throughput"] == pytest.approx(0.3 / 50)
    for s in servers:
        s.update(dtype="float32", starts=[{"start_s": 100.0}])
    report = {
        "date": "d",
        "env": {"cpu": {"model": "cpu", "key_flags": ["avx2"]}, "versions": {}},
        "args": {"concurrency": [8], "rounds": 2, "prompt_tokens": 100, "output_len": 64},
        "servers": servers,
        "summary": summ,
    }
    assert "**30 failed**" in online_report.markdown(report)


class _Tok:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]


def test_agreement_counts_identical_texts_and_prefixes() -> None:
    got = online_report.agreement(["abcd", "abxx", "zzzz"], ["abcd", "abcd", "abcd"], _Tok())
    assert got["identical"] == pytest.approx(1 / 3)
    assert got["prefix"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    with pytest.raises(ValueError):
        online_report.agreement(["a"], ["a", "b"], _Tok())


def test_spec_acceptance_from_vllm_metrics() -> None:
    page = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 8.0',
            'vllm:generation_tokens_total{engine="0"} 99.0',
        ]
    )
    after = servers.parse_spec_counters(page)
    assert after == {"drafts": 10.0, "draft_tokens": 30.0, "accepted_tokens": 12.0}
    got = servers.acceptance({"drafts": 4.0, "draft_tokens": 12.0, "accepted_tokens": 3.0}, after)
    assert got["spec_acceptance"] == 9.0 / 18.0 and got["spec_accepted_per_draft"] == 9.0 / 6.0
    assert servers.acceptance({}, {}) == {}  # a server that does not draft
    assert servers.parse_spec_counters("vllm:num_requests_running 1.0") == {}


def test_mechanism_use_from_the_plugins_metrics() -> None:
    """Mean depth, the deciding share and the gear mix of one client run, from the plugin's
    counters on /metrics before and after it (summed over engines)."""
    page = "\n".join(
        [
            "# HELP vllm_adaptive:decode_tokens_total Decode tokens.",
            'vllm_adaptive:decode_tokens_total{engine="0"} 100.0',
            'vllm_adaptive:decode_tokens_total{engine="1"} 50.0',
            "vllm_adaptive:layers_executed_total 4000.0",
            "vllm_adaptive:decision_seconds_total 1.5",
            "vllm_adaptive:forward_seconds_total 12.0",
            'vllm_adaptive:gear_tokens_total{gear="low"} 30.0',
            'vllm_adaptive:gear_tokens_total{gear="high"} 120.0',
            "vllm_adaptive:mean_decode_depth 26.7",
            'vllm_adaptive:exit_tokens_total{depth="30"} 150.0',
        ]
    )
    after = servers.parse_adaptive_counters(page)
    assert after["adaptive_decode_tokens"] == 150.0
    assert after["adaptive_gear_tokens:low"] == 30.0 and "adaptive_mean_decode_depth" not in after
    before = {
        "adaptive_decode_tokens": 50.0,
        "adaptive_layers_executed": 1000.0,
        "adaptive_decision_seconds": 0.5,
        "adaptive_forward_seconds": 2.0,
        "adaptive_gear_tokens:low": 10.0,
        "adaptive_gear_tokens:high": 40.0,
    }
    got = servers.mechanism_use(before, after)
    assert got["mean_decode_depth"] == 3000.0 / 100.0
    assert got["decision_share"] == 1.0 / 10.0
    assert got["gear_fractions"] == {"high": 0.8, "low": 0.2}
    assert servers.mechanism_use({}, servers.parse_adaptive_counters("vllm:x_total 1.0")) == {}


def test_hybrid_tally_is_the_last_one_the_server_logged(tmp_path) -> None:
    log = tmp_path / "server.log"
    line = (
        "(Worker pid=1) INFO 11-26 18:00:00 [hybrid.py:120] vllm-adaptive hybrid drafts after "
        "{n} steps: {{'steps': {n}, 'lookup': {{'drafts': {d}, 'tokens': 9, 'accepted': 6, "
        "'acceptance': 0.6667}}, 'learned': {{'drafts': 1, 'tokens': 1, 'accepted': 0, "
        "'acceptance': 0.0}}}}\n"
    )
    log.write_text("start\n" + line.format(n=512, d=3) + line.format(n=1024, d=7) + "stop\n")
    tally = servers.hybrid_tally(log)["hybrid_tally"]
    assert tally["steps"] == 1024 and tally["lookup"]["drafts"] == 7
    assert tally["learned"] == {"drafts": 1, "tokens": 1, "accepted": 0, "acceptance": 0.0}
    log.write_text("a server that does not mix drafts\n")
    assert servers.hybrid_tally(log) == {}
    assert servers.hybrid_tally(tmp_path / "missing.log") == {}


def test_each_concurrency_level_gets_prompts_of_its_own(tmp_path) -> None:
    prompts = [f"prompt {i}" for i in range(40)]
    paths = serve_client.split_prompts(prompts, {1: 16, 8: 16}, tmp_path)
    read = {
        c: [json.loads(line)["prompt"] for line in p.read_text().splitlines()]
        for c, p in paths.items()
    }
    assert read[1] == prompts[:16] and read[8] == prompts[16:32]
    assert not set(read[1]) & set(read[8])  # nothing a level could find in the prefix cache
    with pytest.raises(servers.OnlineBenchError, match="40 prompts for 48"):
        serve_client.split_prompts(prompts, {1: 16, 8: 32}, tmp_path)
