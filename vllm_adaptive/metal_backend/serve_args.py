"""`vllm-adaptive serve --backend mlx`'s arguments, apart from the server so that building the
command line imports nothing heavy (every subcommand's parser is built on each call, including
on machines that only train, without the config's pydantic)."""

from __future__ import annotations

import argparse


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (see `vllm-adaptive models prepare`)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="default: the directory's name")
    p.add_argument(
        "--additional-config",
        default=None,
        metavar="JSON",
        help='as for `vllm serve`: {"adaptive": {...}} (a JSON object or a file holding one)',
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="drafts per round with adaptive.speculative (vLLM: speculative_config's field)",
    )


__all__ = ["add_serve_arguments"]
