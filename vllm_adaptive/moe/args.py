"""Arguments of ``vllm-adaptive moe ...`` (torch-free: the CLI parser imports this module)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_moe_arguments(parser: argparse.ArgumentParser):
    """The offline ``moe`` subcommands; returns the subparsers (the CLI adds ``moe bench``, which
    runs engines, from :mod:`vllm_adaptive.bench.moe`)."""
    sub = parser.add_subparsers(dest="moe_command", required=True)
    build = sub.add_parser(
        "build",
        help="MoEfy a dense Llama checkpoint with non-default options (the default model: "
        "`models prepare smollm2-135m-moefied`)",
    )
    build.add_argument(
        "--base",
        default="smollm2-135m-instruct",
        help="dense checkpoint directory, or a name `models prepare` knows",
    )
    build.add_argument(
        "--corpus",
        nargs="+",
        required=True,
        help="text files; the first 90%% of each is calibration text",
    )
    build.add_argument("--out", required=True, help="empty or new output directory")
    build.add_argument("--experts", type=int, default=None, help="experts per layer (E)")
    build.add_argument(
        "--top-k", type=int, default=None, help="num_experts_per_tok in config (default: E)"
    )
    build.add_argument(
        "--windows", type=int, default=None, help="calibration windows of 256 tokens per corpus"
    )
    build.add_argument("--seed", type=int, default=None)
    build.set_defaults(func=_run_build)

    quality = sub.add_parser(
        "quality",
        help="teacher-forced perplexity and top-1 agreement of a MoEfied model against the dense "
        "one on held-out text, per top-k, router and oracle routing (no vLLM)",
    )
    quality.add_argument(
        "--model",
        nargs="+",
        default=["smollm2-135m-moefied"],
        help="MoEfied checkpoint directories or names (several: one plot)",
    )
    quality.add_argument("--dense", default="smollm2-135m-instruct")
    quality.add_argument(
        "--corpus", nargs="+", required=True, help="text files; the last 10%% of each is read"
    )
    quality.add_argument(
        "--k", default=None, help="comma-separated top-k values (default E/8,E/4,E/2,E)"
    )
    quality.add_argument("--windows", type=int, default=12, help="windows per corpus")
    quality.add_argument("--window", type=int, default=256, help="tokens per window")
    quality.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="relative perplexity tolerance for the suggested default k",
    )
    quality.add_argument("--out", default=None, help="JSON file (default: print it)")
    quality.add_argument("--plot", default=None, help="PNG: perplexity and agreement vs k")
    quality.set_defaults(func=_run_quality)

    m2r2 = sub.add_parser(
        "train-m2r2",
        help="train the m2r2 expert predictor's adapters (layer l's residual -> layer l+d's) on "
        "the MoEfied model's own residual stream at a top-k (no vLLM)",
    )
    m2r2.add_argument("--model", nargs=1, default=["smollm2-135m-moefied"])
    m2r2.add_argument("--corpus", nargs="+", required=True, help="text files (calibration part)")
    m2r2.add_argument("--out", required=True, help="output directory")
    m2r2.add_argument(
        "--top-k", type=int, default=None, help="routing k of the stream (default: config's)"
    )
    m2r2.add_argument("--distances", type=int, default=2, help="lookahead distances 1..D")
    m2r2.add_argument("--rank", type=int, default=16)
    m2r2.add_argument("--steps", type=int, default=150)
    m2r2.add_argument("--batch", type=int, default=256, help="tokens per step")
    m2r2.add_argument("--lr", type=float, default=1e-2)
    m2r2.add_argument("--windows", type=int, default=12, help="windows of 256 tokens per corpus")
    m2r2.add_argument("--seed", type=int, default=0)
    m2r2.set_defaults(func=_run_train_m2r2)
    return sub


def _resolve(name_or_dir: str) -> Path:
    """A checkpoint directory (``vllm_adaptive.cli`` turns model names into prepared
    directories before a ``moe`` command runs)."""
    p = Path(name_or_dir)
    if not p.is_dir():
        raise SystemExit(f"{name_or_dir}: not a checkpoint directory")
    return p


def _run_build(args: argparse.Namespace) -> int:
    import torch

    from vllm_adaptive.moe.moefy import MoefyOptions, write_moefied

    torch.set_num_threads(1)
    opts = MoefyOptions()
    for field, value in (
        ("experts", args.experts),
        ("top_k", args.top_k),
        ("windows_per_corpus", args.windows),
        ("seed", args.seed),
    ):
        if value is not None:
            setattr(opts, field, value)
    if args.top_k is None:
        opts.top_k = opts.experts  # no quality measured for this E yet: all experts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SystemExit(f"{out} is not empty")
    summary = write_moefied(_resolve(args.base), out, list(args.corpus), opts)
    print(json.dumps({k: v for k, v in summary.items() if k != "layers"}, indent=2))
    print(out)
    return 0


def _run_train_m2r2(args: argparse.Namespace) -> int:
    import torch

    from vllm_adaptive.moe.m2r2 import train_stream_adapters

    torch.set_num_threads(1)
    doc = train_stream_adapters(
        _resolve(args.model[0]),
        list(args.corpus),
        args.out,
        top_k=args.top_k,
        distances=args.distances,
        rank=args.rank,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        windows_per_corpus=args.windows,
        seed=args.seed,
    )
    print(json.dumps({k: doc[k] for k in ("held_out_topk_recall", "seconds", "train_tokens")}))
    print(args.out)
    return 0


def _run_quality(args: argparse.Namespace) -> int:
    from vllm_adaptive.moe.quality import plot_quality, run_quality, smallest_k_within

    ks = [int(k) for k in args.k.split(",")] if args.k else None
    results = []
    for model in args.model:
        r = run_quality(
            _resolve(model), _resolve(args.dense), list(args.corpus), ks, args.windows, args.window
        )
        r["tolerance"] = args.tolerance
        r["smallest_k_within_tolerance"] = smallest_k_within(r, args.tolerance)
        results.append(r)
    payload = results[0] if len(results) == 1 else {"models": results}
    text = json.dumps(payload, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    if args.plot:
        plot_quality(results, Path(args.plot))
    for r in results:
        print(
            f"[moe quality] {r['model']}: smallest router k within +{args.tolerance:.0%} "
            f"perplexity on every corpus: {r['smallest_k_within_tolerance']}",
            file=sys.stderr,
        )
    return 0
