"""Arguments of `vllm-adaptive train draft` (no torch import: the CLI builds its parser from
this module for every command)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class DraftTrainOptions:
    model: str
    corpus: list[str]
    out: str
    method: str = "eagle3"
    #: training data: tokens of calibration text run through the target (split over corpora)
    tokens: int = 98304
    seq_len: int = 256
    #: "text": windows of calibration text; "greedy": a calibration prompt of ``gen_prompt_len``
    #: tokens and the target's own greedy continuation (what a greedy server drafts against);
    #: "chat": the same with chat-template prompts (``chat_prompts.py``), the loss ending at the
    #: answer's end of turn
    data_source: str = "text"
    #: None: 32 for "greedy", 96 for "chat" (the template and instruction take about 40)
    gen_prompt_len: int | None = None
    #: prompts a generated shard holds; None: 256 with vLLM's engine (wide batches are what its
    #: decode is fast at), 64 with transformers (whose cache copies grow with the batch)
    gen_batch: int | None = None
    #: what writes generated windows: "auto" is vLLM's engine on a CPU where vLLM is installed
    #: (about 2.2x transformers' decode), transformers elsewhere
    generator: str = "auto"
    #: target passes and head training: "auto" is bfloat16 where the CPU computes it natively
    compute_dtype: str = "auto"
    #: where the target passes and the head's steps run: "auto" is cuda when torch sees a GPU
    #: (the recipe is the same; a GPU only affords more data in the same minutes)
    device: str = "auto"
    topk: int = 32
    draft_vocab: int = 8192
    #: target layers the head reads (default: vLLM's (2, L // 2, L - 3))
    aux_layers: list[int] | None = None
    #: decoder layers of the head (vLLM's EAGLE-3 model runs any number)
    head_layers: int = 1
    #: start from this head (its draft vocabulary, aux layers and weights) instead of the target
    init_head: str | None = None
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    #: training steps; default: ``epochs`` passes over the data
    steps: int | None = None
    epochs: float = 3.0
    batch: int = 4
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    #: held-out acceptance: greedy continuations of prompts from the corpora's eval split
    eval_k: int = 3
    eval_every: int = 25
    eval_prompts: int = 8
    #: None: 64, or 96 for "chat"
    eval_prompt_len: int | None = None
    eval_new_tokens: int = 64
    patience: int = 4
    min_delta: float = 0.005
    save_every: int = 50
    resume: bool = False
    seed: int = 0
    threads: int = 2
    data_batch: int = 4
    progress: bool = True
    stop_after: int | None = None  # testing: stop after this step as if interrupted
    corpus_sha256: list[str] = field(default_factory=list)


def _layers(text: str) -> list[int]:
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--aux-layers wants e.g. 2,15,27, got {text!r}") from None
    if len(layers) != 3:
        raise argparse.ArgumentTypeError(f"--aux-layers wants three layers, got {text!r}")
    return layers


def resolve_prompt_lengths(opts: DraftTrainOptions) -> None:
    """Fill the prompt lengths left to their defaults: a chat prompt carries the template and an
    instruction before its text, so it gets more tokens."""
    chat = opts.data_source == "chat"
    if opts.gen_prompt_len is None:
        opts.gen_prompt_len = 96 if chat else 32
    if opts.eval_prompt_len is None:
        opts.eval_prompt_len = 96 if chat else 64


def add_draft_arguments(p: argparse.ArgumentParser) -> None:
    d = DraftTrainOptions(model="", corpus=[], out="")
    p.add_argument("--method", choices=("eagle3",), default=d.method, help="draft kind")
    p.add_argument("--model", required=True, help="target: HF model directory (Llama family)")
    p.add_argument("--corpus", action="append", required=True, help="UTF-8 text file (repeatable)")
    p.add_argument(
        "--out",
        required=True,
        help="head directory (what vLLM's speculative_config 'model' names); the training "
        "state, data cache and metrics go to OUT/train/",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=d.tokens,
        help="training tokens run through the target once (cached in OUT/train/data)",
    )
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training window")
    p.add_argument(
        "--data-source",
        choices=("text", "greedy", "chat"),
        default=d.data_source,
        help="text: windows of calibration text; greedy: a calibration prompt of "
        "--gen-prompt-len tokens continued by the target's own greedy tokens to --seq-len; "
        "chat: the same with chat requests about calibration text in the model's chat "
        "template, trained up to the answer's end of turn (eval prompts are chat requests too)",
    )
    p.add_argument(
        "--gen-prompt-len",
        type=int,
        default=None,
        help="prompt tokens of a generated window (default: 32, or 96 with --data-source chat)",
    )
    p.add_argument(
        "--gen-batch",
        type=int,
        default=d.gen_batch,
        help="prompts per generation batch (one data shard); default 256 with --generator vllm, "
        "64 with transformers",
    )
    p.add_argument(
        "--generator",
        choices=("auto", "vllm", "transformers"),
        default=d.generator,
        help="what continues the prompts of generated windows: vLLM's engine (auto on a CPU "
        "where vLLM is installed; about 2.2x faster there) or transformers",
    )
    p.add_argument(
        "--compute-dtype",
        choices=("auto", "float32", "bfloat16"),
        default=d.compute_dtype,
        help="target passes and head matmuls (autocast; weights and optimizer stay float32); "
        "auto: bfloat16 where the CPU has avx512_bf16 or amx_bf16, else float32",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=d.device,
        help="where the target passes and the head's training run; auto: cuda when torch "
        "sees a GPU, else cpu (the same recipe on either)",
    )
    p.add_argument("--topk", type=int, default=d.topk, help="target logits kept per position")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=d.draft_vocab,
        help="draft vocabulary: the target's most frequent greedy tokens",
    )
    p.add_argument(
        "--aux-layers",
        type=_layers,
        default=None,
        help="the three target layers the head reads, e.g. 2,15,27 (default vLLM's: 2, L//2, L-3)",
    )
    p.add_argument(
        "--head-layers",
        type=int,
        default=d.head_layers,
        help="decoder layers of the head (each starts as the target's next layer)",
    )
    p.add_argument(
        "--init-head",
        default=None,
        metavar="DIR",
        help="fine-tune this EAGLE-3 head (made for the same target: its draft vocabulary, aux "
        "layers and decoder layers are kept) instead of starting from the target's layer",
    )
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="training-time test steps")
    p.add_argument(
        "--ttt-decay", type=float, default=d.ttt_decay, help="loss weight of step j: decay^(j-1)"
    )
    p.add_argument("--steps", type=int, default=None, help="default: --epochs over the data")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--batch", type=int, default=d.batch, help="windows per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--eval-k", type=int, default=d.eval_k, help="drafted tokens per step (k)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between evals")
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument(
        "--eval-prompt-len",
        type=int,
        default=None,
        help="held-out prompt tokens (default: 64, or 96 with --data-source chat)",
    )
    p.add_argument("--eval-new-tokens", type=int, default=d.eval_new_tokens)
    p.add_argument(
        "--patience",
        type=int,
        default=d.patience,
        help="stop after this many evals without a better acceptance (0: never)",
    )
    p.add_argument("--min-delta", type=float, default=d.min_delta)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--resume", action="store_true", help="continue from OUT/train/checkpoint.pt")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument(
        "--data-batch", type=int, default=d.data_batch, help="windows per target forward"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)


def options_from_args(args: argparse.Namespace) -> DraftTrainOptions:
    return DraftTrainOptions(
        model=args.model,
        corpus=list(args.corpus),
        out=args.out,
        method=args.method,
        tokens=args.tokens,
        seq_len=args.seq_len,
        data_source=args.data_source,
        gen_prompt_len=args.gen_prompt_len,
        gen_batch=args.gen_batch,
        generator=args.generator,
        compute_dtype=args.compute_dtype,
        device=args.device,
        topk=args.topk,
        draft_vocab=args.draft_vocab,
        aux_layers=args.aux_layers,
        head_layers=args.head_layers,
        init_head=args.init_head,
        ttt_steps=args.ttt_steps,
        ttt_decay=args.ttt_decay,
        steps=args.steps,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        eval_k=args.eval_k,
        eval_every=args.eval_every,
        eval_prompts=args.eval_prompts,
        eval_prompt_len=args.eval_prompt_len,
        eval_new_tokens=args.eval_new_tokens,
        patience=args.patience,
        min_delta=args.min_delta,
        save_every=args.save_every,
        resume=args.resume,
        seed=args.seed,
        threads=args.threads,
        data_batch=args.data_batch,
        progress=not args.no_progress,
        stop_after=args.stop_after,
    )
