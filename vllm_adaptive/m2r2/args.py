"""Arguments of `vllm-adaptive train m2r2` (no torch import: the CLI builds its parser from
this module for every command)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class TrainOptions:
    model: str
    corpus: list[str]
    out: str
    mode: str = "spec"
    k: int = 4
    gates: list[int] | None = None
    rank: int = 8
    steps: int = 300
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-2
    lr_up_ratio: float = 1.0
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    alpha0: float = 1.0
    alpha1: float = 1.0
    alpha_router: float = 1.0
    labels: str = "corpus"
    save_every: int = 50
    keep_checkpoints: int = 3
    val_every: int = 25
    val_windows: int = 16
    resume: bool = False
    device: str | None = None
    seed: int = 0
    threads: int = 2
    progress: bool = True
    stop_after: int | None = None  # testing: stop after this step as if interrupted
    corpus_sha256: list[str] = field(default_factory=list)
    #: an EAGLE-3 greedy data folder (``train draft --data-source greedy``'s ``train/data``):
    #: train and validate on the same windows the learned head saw, instead of the corpora
    greedy_data: str | None = None

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(20, max(1, self.steps // 10))


def _gates(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gates wants e.g. 6,12,18,24, got {text!r}") from None


def add_m2r2_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainOptions(model="", corpus=[], out="")
    p.add_argument("--model", required=True, help="HF model directory (Llama family)")
    p.add_argument("--corpus", action="append", default=[], help="UTF-8 text file (repeatable)")
    p.add_argument(
        "--greedy-data",
        default=None,
        help="train on an EAGLE-3 greedy data folder (OUT/train/data of `train draft "
        "--data-source greedy`): the same windows and held-out prompts as that head",
    )
    p.add_argument("--out", required=True, help="output directory (adapter, checkpoints, metrics)")
    p.add_argument("--mode", choices=("spec", "exit"), default=d.mode)
    p.add_argument("--k", type=int, default=d.k, help="spec: draft depth (layers)")
    p.add_argument(
        "--gates", type=_gates, default=None, help="exit: gate layers, default every N//5 layers"
    )
    p.add_argument("--rank", type=int, default=d.rank)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument(
        "--lr-up-ratio",
        type=float,
        default=d.lr_up_ratio,
        help="learning-rate multiplier of the zero-initialised up-projections (LoRA+)",
    )
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup", type=int, default=None, help="default min(20, steps/10)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--alpha0", type=float, default=d.alpha0, help="cross-entropy weight")
    p.add_argument("--alpha1", type=float, default=d.alpha1, help="distillation weight")
    p.add_argument("--alpha-router", type=float, default=d.alpha_router, help="exit: ARLA BCE")
    p.add_argument("--labels", choices=("corpus", "model"), default=d.labels)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--val-every", type=int, default=d.val_every)
    p.add_argument("--val-windows", type=int, default=d.val_windows)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)
