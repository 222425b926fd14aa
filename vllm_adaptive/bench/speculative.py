"""`vllm-adaptive bench --spec ...`: speculative decoding against no speculation, per corpus.

Each ``--spec`` is one engine: ``{"method": "ngram", "k": 4}`` (vLLM's built-in prompt-lookup
proposer), ``{"method": "suffix", "k": 8}`` (vLLM's suffix decoding, which needs Snowflake's
arctic-inference: ``scripts/install-suffix-decoding.sh``) or ``{"draft":
{...adaptive.speculative...}, "k": 4}`` (the plugin's self-speculative proposer), each
optionally with ``"target": {...adaptive.precision...}`` (a fixed-gear target, e.g. ``{"policy":
"fixed", "gear": "fp16"}``: the drafts are verified by the fp16 model, which in float32 gives
stock's greedy output). ``"options"`` adds keys to a vLLM method's ``speculative_config``, e.g.
``{"suffix_decoding_max_cached_requests": 0}`` (suffix decoding's global tree of earlier
responses would otherwise have seen the bench's repeated prompts answered). For every corpus,
stock vLLM and every spec engine run the same prompts from that corpus; reported per engine and
batch size: decode tokens/s and its ratio to stock, acceptance rate and mean accepted length
(vLLM's own counters), and whether greedy output was identical to stock's (speculation is
lossless: in float32 it must be; in bfloat16 verification of k+1 tokens at once may round
differently from one at a time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

from vllm_adaptive.config import SELF_SPECULATIVE_PROPOSER, parse_adaptive_config
from vllm_adaptive.corpora import read_corpus

#: vLLM's own proposers the bench runs (``"method"``).
VLLM_METHODS = ("ngram", "suffix")


def _log(msg: str) -> None:
    print(f"[bench-spec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_spec(text: str) -> dict[str, Any]:
    """One ``--spec`` value, checked before any engine starts."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--spec {text!r}: not JSON ({e})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("k"), int) or spec["k"] < 1:
        raise ValueError(f"--spec {text!r}: needs an integer k >= 1")
    unknown = set(spec) - {"k", "method", "draft", "target", "label", "options"}
    if unknown:
        raise ValueError(f"--spec {text!r}: unknown keys {sorted(unknown)}")
    if ("method" in spec) == ("draft" in spec):
        raise ValueError(f'--spec {text!r}: give either "method": "ngram" or "draft": {{...}}')
    if "options" in spec and ("method" not in spec or not isinstance(spec["options"], dict)):
        raise ValueError(
            f'--spec {text!r}: "options" (an object of vLLM speculative_config keys) is for '
            '"method" engines'
        )
    if "method" in spec and spec["method"] not in VLLM_METHODS:
        raise ValueError(f"--spec {text!r}: the built-in methods benched are {VLLM_METHODS}")
    if spec.get("method") == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        raise ValueError(
            f"--spec {text!r}: vLLM's suffix decoding needs arctic-inference, which is not "
            "installed (bash scripts/install-suffix-decoding.sh)"
        )
    if "draft" in spec or "target" in spec:
        parse_adaptive_config(_adaptive(spec))
    return spec


def _adaptive(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``adaptive`` section of a self-speculative spec engine."""
    out = {"speculative": spec["draft"]} if "draft" in spec else {}
    if "target" in spec:
        out["precision"] = spec["target"]
    return out


def spec_label(spec: dict[str, Any]) -> str:
    if spec.get("label"):
        return spec["label"]
    target = f", target {spec['target'].get('gear', 'geared')}" if "target" in spec else ""
    if "method" in spec:
        options = "".join(f", {k} {v}" for k, v in spec.get("options", {}).items())
        return f"{spec['method']} k={spec['k']}{options}{target}"
    d = spec["draft"]
    lookup = "prompt lookup, else " if d.get("prompt_lookup") is not None else ""
    if d["draft"] == "lowbit":
        q = d.get("precision", "int4")
        if q == "int4":
            q += " sym" if d.get("symmetric") else " asym (on grid)"
        return f"{lookup}lowbit {q} k={spec['k']}{target}"
    depth = d.get("layers", "adapter" if d["draft"] == "m2r2" else 4)
    return f"{lookup}{d['draft']} {depth} layers k={spec['k']}{target}"


def engine_settings(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(additional_config, speculative_config) of one spec engine."""
    if "method" in spec:
        cfg = {"method": spec["method"], "num_speculative_tokens": spec["k"]}
        if spec["method"] == "ngram":
            cfg.update(prompt_lookup_min=2, prompt_lookup_max=5)
        cfg.update(spec.get("options", {}))
        return ({"adaptive": _adaptive(spec)} if "target" in spec else {}), cfg
    return {"adaptive": _adaptive(spec)}, {
        "method": "custom_class",
        "model": SELF_SPECULATIVE_PROPOSER,
        "num_speculative_tokens": spec["k"],
    }


def _identical(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens equal stock's."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def run_spec_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Per corpus: stock and every spec engine alive together, timed in turn (ABBA) over
    ``--rounds`` rounds, as the main bench does; ratios are medians of per-round ratios."""
    from vllm_adaptive.bench.harness import (
        EngineDef,
        build_workload,
        engine_spec,
        timed_rounds_fresh,
        timed_rounds_persistent,
    )
    from vllm_adaptive.bench.machine import env_info
    from vllm_adaptive.bench.summary import merge_rounds, speed_ratios

    specs = [parse_spec(s) for s in args.spec]
    corpora = [read_corpus(p) for p in args.corpus]
    max_len = args.prompt_tokens + args.max_tokens + 16
    results: dict[str, Any] = {
        "settings": vars(args) | {"func": None, "order": "ABBA, engines alive together"},
        "env": env_info(corpora),
        "corpora": {},
    }
    for corpus in corpora:
        workload = build_workload(args, [corpus])
        name = Path(corpus.path).name
        defs = [
            EngineDef("stock vLLM (plugin not loaded)", str(args.model), {}, {"VLLM_PLUGINS": ""})
        ]
        engine_specs = [None]
        for spec in specs:
            additional, speculative = engine_settings(spec)
            defs.append(EngineDef(spec_label(spec), str(args.model), additional, {}))
            engine_specs.append(speculative)

        def spec_for(i: int, r: int, wl=workload, defs=defs, engine_specs=engine_specs) -> dict:
            return engine_spec(
                args,
                max_len,
                defs[i].additional,
                speculative_config=engine_specs[i],
                teacher_forcing=False,
                free_running_tokens=args.max_tokens if r == 0 else 0,
                prompts=wl["prompts"],
                streams=[],
            )

        _log(f"{name}: {len(defs)} engines, {args.rounds} rounds ({args.engines})")
        if args.engines == "persistent":
            records = timed_rounds_persistent(
                defs, [spec_for(i, 0) for i in range(len(defs))], args
            )
        else:
            records = timed_rounds_fresh(defs, spec_for, args)
        merged = [merge_rounds(rs) for rs in records]
        stock = merged[0]
        rows = []
        for spec, d, raw in zip(specs, defs[1:], merged[1:], strict=True):
            s = raw.get("speculation", {})
            ratios = speed_ratios(raw, stock)
            rows.append(
                {
                    "label": d.name,
                    "spec": spec,
                    "decode_tokens_per_s": raw["decode_tokens_per_s"],
                    "speedup": ratios["speedup"],
                    "speedup_spread": ratios["speedup_spread"],
                    "cpu_speedup": ratios["cpu_speedup"],
                    "acceptance_rate": s.get("acceptance_rate"),
                    "mean_accepted_length": s.get("mean_accepted_length"),
                    "accepted_per_position": s.get("num_accepted_tokens_per_pos"),
                    "identical_to_stock": _identical(
                        raw["free_running_outputs"], stock["free_running_outputs"]
                    ),
                    "dispatch": raw.get("dispatch"),
                    "memory": raw.get("memory"),
                }
            )
            r = rows[-1]
            _log(
                f"  {d.name}: "
                + ", ".join(f"b{b} x{v:.2f}" for b, v in r["speedup"].items())
                + f", acceptance {r['acceptance_rate'] or 0:.3f}, mean accepted length "
                f"{r['mean_accepted_length'] or 0:.2f}, identical {r['identical_to_stock']:.2f}"
            )
        results["corpora"][name] = {
            "stock_decode_tokens_per_s": stock["decode_tokens_per_s"],
            "stock_decode_tokens_per_s_rounds": stock["decode_tokens_per_s_rounds"],
            "stock_memory": stock.get("memory"),
            "runs": rows,
        }
        # written after every corpus: a long matrix that is cut short keeps what it measured
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return results


def _ratio_cell(run: dict[str, Any], b: str) -> str:
    """``median [min-max]`` over rounds (older single-timing results: the ratio alone)."""
    sp = (run.get("speedup_spread") or {}).get(b)
    if not sp or sp.get("n", 1) < 2:
        return f"{run['speedup'][b]:.2f}"
    return f"{run['speedup'][b]:.2f} [{sp['min']:.2f}-{sp['max']:.2f}]"


def table_markdown(results: dict[str, Any]) -> str:
    lines = []
    for name, c in results["corpora"].items():
        sizes = list(c["stock_decode_tokens_per_s"])
        stock = ", ".join(f"b{b} {v:.1f}" for b, v in c["stock_decode_tokens_per_s"].items())
        lines += [
            f"**{name}** (stock decode tok/s: {stock})",
            "",
            "| draft | "
            + " | ".join(f"ratio b{b}" for b in sizes)
            + " | acceptance | mean accepted length | greedy identical |",
            "|---|" + "---|" * (len(sizes) + 3),
        ]
        for r in c["runs"]:
            acc = r["acceptance_rate"]
            mal = r["mean_accepted_length"]
            cells = " | ".join(_ratio_cell(r, b) for b in sizes)
            lines.append(
                f"| {r['label']} | "
                + cells
                + f" | {acc:.3f} | {mal:.2f} | {r['identical_to_stock']:.2f} |"
                if acc is not None
                else f"| {r['label']} | " + cells + f" | - | - | {r['identical_to_stock']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], out: str) -> None:
    """Speed-up against acceptance rate, one panel per batch size, marker per corpus."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(results["corpora"].values()))
    sizes = list(first["stock_decode_tokens_per_s"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    markers = "os^vD"
    for ax, b in zip(axes[0], sizes, strict=True):
        for ci, c in enumerate(results["corpora"].values()):
            for r in c["runs"]:
                if r["acceptance_rate"] is None:
                    continue
                ax.scatter(r["acceptance_rate"], r["speedup"][b], marker=markers[ci % 5])
                ax.annotate(r["label"], (r["acceptance_rate"], r["speedup"][b]), fontsize=6)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("acceptance rate (vLLM counters)")
        ax.set_ylabel("decode tokens/s ratio to stock")
        ax.set_title(f"batch {b}; markers: " + ", ".join(results["corpora"]))
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def run_from_args(args: argparse.Namespace) -> int:
    results = run_spec_bench(args)
    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    md = table_markdown(results)
    if args.table_md:
        Path(args.table_md).write_text(md)
    if args.plot:
        plot(results, args.plot)
    print(md)
    return 0
