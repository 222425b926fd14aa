"""The servers the benches start: a configuration (stock vLLM or the plugin with an adaptive
config) as ``scripts/serve.sh`` serves it, one at a time, its whole process group stopped when
the block ends (no engine process outlives it), and what its log and ``/metrics`` say (engine
init and compile seconds, speculative acceptance, the hybrid drafter's tally).

Stock is really stock: ``VLLM_PLUGINS=""``, so none of the plugin's code is loaded (its request
validator is no entry point; see ``engine/intrusions.py``, ``request-validator``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
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
    #: run the plugin's code as of this git commit (a before/after bench of a change on one
    #: machine, same prompts, same run); None: the working tree's
    code: str | None = None

    @property
    def stock(self) -> bool:
        return self.adaptive is None


def reference_model(models: Sequence[str]) -> str:
    """The checkpoint whose plain stock server is a run's baseline: the one every server runs
    (a run of Gemma servers compares with stock Gemma), else the default model."""
    distinct = set(models)
    return distinct.pop() if len(distinct) == 1 else SERVED_NAME


def parse_server_spec(text: str) -> ServerSpec:
    """``{"label": ..., "dtype": "bfloat16"|"float32", "adaptive": {...} (absent: stock),
    "serve_args": [...], "model": name, "code": git commit}``; a bad spec is a ValueError that
    names the problem."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--server {text!r}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--server {text!r}: want a JSON object")
    unknown = set(raw) - {"label", "dtype", "adaptive", "serve_args", "model", "code"}
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
    code = raw.get("code")
    if code is not None:
        if adaptive is None:
            raise ValueError(f"--server {text!r}: 'code' needs the plugin on ('adaptive')")
        try:
            code = resolve_commit(code)
        except ValueError as e:
            raise ValueError(f"--server {text!r}: 'code': {e}") from None
    return ServerSpec(label, dtype, adaptive, tuple(args), model, code)


def resolve_commit(rev: str) -> str:
    """The full hash of git revision ``rev`` of this repository (ValueError: none such)."""
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise ValueError(f"no commit {rev!r} in {REPO}")
    return out.stdout.strip()


def code_checkout(commit: str, root: Path = REPO / "runs" / "code") -> Path:
    """The package as of ``commit``, extracted once under ``runs/code/<commit>`` (what a server
    with ``code`` imports first, through PYTHONPATH)."""
    dest = root / commit
    if (dest / "vllm_adaptive" / "__init__.py").exists():
        return dest
    tmp = root / f".{commit}.tmp"
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    tmp.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "vllm_adaptive"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    tmp.rename(dest)
    return dest


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


def complete_once(url: str, prompt: str, max_tokens: int, model: str = SERVED_NAME) -> float:
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


_ADAPTIVE_COUNTER = re.compile(
    r"^vllm_adaptive:(decode_tokens|layers_executed|decision_seconds|forward_seconds|gear_tokens)"
    r"_total(\{[^}]*\})?\s+(\S+)$"
)
_GEAR_LABEL = re.compile(r'gear="([^"]*)"')


def parse_adaptive_counters(text: str) -> dict[str, float]:
    """The plugin's own counters in a /metrics page (docs/serving.md), keys ``adaptive_<name>``
    and ``adaptive_gear_tokens:<gear>``; empty for stock vLLM."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _ADAPTIVE_COUNTER.match(line)
        if not m:
            continue
        key = f"adaptive_{m.group(1)}"
        if m.group(1) == "gear_tokens":
            gear = _GEAR_LABEL.search(m.group(2) or "")
            key += f":{gear.group(1) if gear else '?'}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def server_counters(url: str) -> dict[str, float]:
    """vLLM's drafting counters and the plugin's counters, read once from ``/metrics``."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            page = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    return {**parse_spec_counters(page), **parse_adaptive_counters(page)}


def mechanism_use(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the plugin's mechanisms did during one client run, from its counters around it: the
    mean decoder layers per decode token (depth), the share of the forward spent deciding
    exits or gears, and the decode tokens per precision gear (fractions)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("adaptive_")}
    out: dict[str, Any] = {}
    decode = d.get("adaptive_decode_tokens", 0.0)
    if decode > 0 and d.get("adaptive_layers_executed", 0.0) > 0:
        out["mean_decode_depth"] = d["adaptive_layers_executed"] / decode
    forward = d.get("adaptive_forward_seconds", 0.0)
    if forward > 0:
        out["decision_share"] = d.get("adaptive_decision_seconds", 0.0) / forward
    gears = {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("adaptive_gear_tokens:")}
    total = sum(gears.values())
    if total > 0:
        out["gear_fractions"] = {g: v / total for g, v in sorted(gears.items())}
    return out


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
    """What the server's environment changes: the plugin off entirely for stock; no drafter
    but the spec's own (``serve_args``), whatever ``scripts/serve.sh`` adds by default."""
    model = {} if spec.model == SERVED_NAME else {"ADAPTIVE_MODEL": spec.model}
    base = {"ADAPTIVE_DRAFTS": "none", **model}
    if spec.stock:
        return {"VLLM_PLUGINS": "", **base}
    config = json.dumps({"adaptive": spec.adaptive})
    code = {} if spec.code is None else {"PYTHONPATH": str(code_checkout(spec.code))}
    return {"VLLM_PLUGINS": PLUGINS_ON, "ADAPTIVE_CONFIG": config, **base, **code}


@dataclass
class Started:
    url: str
    start_s: float
    log: Path
    proc: subprocess.Popen = field(repr=False)


def default_stop_signals() -> None:
    """Run in a started process before exec: SIGINT and SIGTERM back to their defaults and
    unblocked. A process inherits SIGINT ignored when started from a shell's background job (or
    a pytest-xdist worker), and inherits the starting thread's blocked signals; either way
    :func:`stop_group`'s SIGINT would wait for SIGKILL instead of stopping it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def start_group(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """``cmd`` in a process group of its own, which :func:`stop_group` stops whole."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=default_stop_signals, **popen)


def stop_group(proc: subprocess.Popen) -> None:
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
        proc = start_group(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
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
        stop_group(proc)


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
