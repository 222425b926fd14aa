"""Command-line interface of `vllm-adaptive bench` (kept stable: later modes extend it)."""

from __future__ import annotations

import argparse


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--batch-sizes: expected comma-separated integers, got {text!r}"
        ) from e
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"--batch-sizes: need positive integers, got {text!r}")
    return sizes


def _prefill_lens(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--prefill-lens: expected comma-separated integers, got {text!r}"
        ) from e
    if not lens or any(n < 2 for n in lens):
        raise argparse.ArgumentTypeError(f"--prefill-lens: need lengths >= 2, got {text!r}")
    return lens


#: Timing rounds by default: an even number, so that ABBA order is balanced.
DEFAULT_ROUNDS = 6


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="checkpoint directory (see `vllm-adaptive models prepare`)"
    )
    p.add_argument(
        "--backend",
        default="vllm",
        choices=["vllm", "mlx"],
        help="vllm (default): against stock vLLM; mlx: the MLX backend against stock mlx-lm "
        "on the same checkpoint, batch 1 (--batch-sizes 1)",
    )
    p.add_argument(
        "--corpus",
        action="append",
        required=True,
        metavar="FILE",
        help="UTF-8 text file for prompts and held-out evaluation (repeatable)",
    )
    p.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="JSON",
        help="speculative decoding engine (repeatable; switches the bench to speculation, run "
        'per corpus): {"method": "ngram", "k": 4} or {"draft": {...adaptive.speculative...}, '
        '"k": 4}',
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="DIR",
        help="another checkpoint of the same model run by stock vLLM as a peer row, e.g. the "
        "W8A8 one from `vllm-adaptive models prepare smollm2-135m-instruct-w8a8` (repeatable)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="CONFIG",
        help="adaptive config: JSON object or file with one; {} = all mechanisms off (repeatable)",
    )
    p.add_argument("--json", required=True, metavar="OUT.json", help="where to write the results")
    p.add_argument("--plot", metavar="OUT.png", help="quality loss vs speed-up plot")
    p.add_argument(
        "--ratio-plot",
        metavar="OUT.png",
        help="tokens/s and worker CPU ratios vs stock per batch size, median over rounds with "
        "min-max bars",
    )
    p.add_argument(
        "--table-md",
        metavar="OUT.md",
        help="markdown table, one row per config and peer: tokens/s ratio per batch size with "
        "its spread over rounds, worker CPU ratio, mean layers run, perplexity change, greedy "
        "agreement teacher-forced and free-running, bandwidth share, peak memory (also: "
        "python -m vllm_adaptive.bench.report OUT.json)",
    )
    p.add_argument(
        "--gear-trace",
        metavar="OUT.png",
        help="entropy and gear over the tokens of one teacher-forced stream per corpus, per "
        "precision run",
    )
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8, 32], help="default 1,8,32")
    p.add_argument(
        "--prefill-lens",
        type=_prefill_lens,
        default=None,
        metavar="N,N,...",
        help="prefill bench (token fusion): the bench once per prompt length, with the "
        "throughput prompts and the teacher-forced prefixes that long; reports time to first "
        "token, prefill tokens/s, continuation perplexity, free-running agreement and the "
        "fraction of token-layers fusion removed, against stock (e.g. 512,2048,8000)",
    )
    p.add_argument(
        "--fusion-plot",
        metavar="OUT.png",
        help="prefill bench: the fusion events along one throughput prompt of the longest length",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="decode tokens per request in the throughput runs",
    )
    p.add_argument(
        "--ppl-streams",
        type=_positive,
        default=16,
        help="held-out streams fed as one batch for perplexity (at least 1: every report "
        "carries quality beside speed)",
    )
    p.add_argument(
        "--ppl-prefix", type=int, default=64, help="prompt tokens before teacher forcing starts"
    )
    p.add_argument("--ppl-tokens", type=int, default=128, help="teacher-forced tokens per stream")
    p.add_argument(
        "--prompt-tokens", type=int, default=64, help="prompt length in the throughput runs"
    )
    p.add_argument(
        "--free-tokens",
        type=int,
        default=64,
        help="greedy tokens per prompt compared with stock's, free-running (all throughput "
        "prompts in one batch)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed repetitions per batch size and round (the best is kept)",
    )
    p.add_argument(
        "--rounds",
        type=_positive,
        default=DEFAULT_ROUNDS,
        help=f"timing rounds (default {DEFAULT_ROUNDS}); each round times every engine once per "
        "batch size, engines in order, reversed every other round (ABBA); ratios are taken per "
        "round and reported as the median with their spread",
    )
    p.add_argument(
        "--engines",
        choices=["persistent", "fresh"],
        default="persistent",
        help="persistent (default): every engine stays alive and the engines take turns per "
        "batch size, seconds apart; fresh: a new engine per engine and round (one engine in "
        "memory at a time, minutes between the engines compared)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=1.2,
        help="pause before each timed measurement (vLLM's shared-memory queues busy-poll for "
        "1 s after their last message: the engine measured before must go quiet)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="float32 (default) is the fastest stock setting on the project's CPUs",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="skip torch.compile in every engine (default: vLLM's default compilation)",
    )
    p.add_argument(
        "--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB) per engine"
    )
    p.add_argument(
        "--stream-mib",
        type=int,
        default=None,
        help="array size (MiB) of the stream bandwidth measurement (default 4x the last-level "
        "cache); 0 skips it",
    )
    p.add_argument(
        "--prompts", type=int, default=4, help="mlx: prompts in the batch-1 throughput runs"
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="mlx: drafts per round for configs with adaptive.speculative",
    )
    p.add_argument("--seed", type=int, default=0)
