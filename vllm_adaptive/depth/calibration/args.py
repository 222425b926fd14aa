"""`vllm-adaptive calibrate` arguments, importable without torch (keeps the CLI start fast).

Defaults mirror `CalibrationOptions` / `CollectConfig`.
"""

from __future__ import annotations

import argparse


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--corpus", action="append", required=True, help="plain-text file (repeat)")
    p.add_argument("--out", required=True, help="profile directory to write")
    p.add_argument(
        "--smoothing",
        action="store_true",
        help="write a SmoothQuant smoothing profile for the w8a8 precision (per-channel "
        "activation maxima of every linear's input; --tokens and --window apply) instead of "
        "an adaptive-depth profile",
    )
    p.add_argument(
        "--gear-plan",
        metavar="GEAR",
        choices=("w8a8",),
        help="write a fixed-gear plan instead: which decoder layers take GEAR (w8a8) while "
        "the simulated teacher-forced agreement with the model stays >= --target-agreement "
        "(the rest run the model's own weights); --tokens, --window, --smoothing-profile, "
        "--smoothing-alpha, --dtype and --plot apply",
    )
    p.add_argument(
        "--smoothing-profile",
        metavar="DIR",
        help="--gear-plan: simulate the W8A8 gear smoothed by this profile (calibrate --smoothing)",
    )
    p.add_argument(
        "--smoothing-alpha", type=float, default=0.5, help="--gear-plan: SmoothQuant alpha"
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="--gear-plan: the engine's dtype the plan is for (default bfloat16)",
    )
    p.add_argument(
        "--fusion",
        action="store_true",
        help="write a contextual token fusion profile (QuickSilver D.3: tau_fuse per fusion "
        "layer for a perplexity tolerance; the --fusion-* options apply) instead of an "
        "adaptive-depth profile",
    )
    p.add_argument(
        "--fusion-layers", default="10,15,20", help="fusion after these many blocks (comma list)"
    )
    p.add_argument(
        "--fusion-percentiles",
        default="1,2.5,5,7.5,10,15,20,30",
        help="candidate taus: these percentiles of the layer's adjacent-pair distances",
    )
    p.add_argument(
        "--fusion-max-ppl-increase",
        type=float,
        default=0.01,
        help="continuation perplexity tolerance against no fusion (0.01: +1%%)",
    )
    p.add_argument("--fusion-weighting", choices=("uniform", "score"), default="uniform")
    p.add_argument(
        "--fusion-tau-attn",
        type=float,
        default=None,
        help="also require mean cos(q_next, k_prev) above this (off by default)",
    )
    p.add_argument("--fusion-max-group", type=int, default=None, help="rows per group at most")
    p.add_argument(
        "--fusion-split-repeats",
        action="store_true",
        help="never fuse two adjacent copies of one token (not in the paper; see "
        "docs/token-fusion.md)",
    )
    p.add_argument(
        "--fusion-anchor",
        action="append",
        default=None,
        help='anchor string exempt from fusion (repeat; default "Question:" and "Answer:")',
    )
    p.add_argument(
        "--fusion-rare-min-count",
        type=int,
        default=3,
        help="tokens seen fewer times in the calibration text never fuse (0: off)",
    )
    p.add_argument("--fusion-prompt-len", type=int, default=512)
    p.add_argument("--fusion-continuation", type=int, default=64, help="scored tokens/window")
    p.add_argument("--fusion-fit-windows", type=int, default=4, help="windows for distances")
    p.add_argument("--fusion-val-windows", type=int, default=8, help="windows for the grid")
    p.add_argument("--budget", type=float, default=0.6, help="cost fraction of full depth")
    p.add_argument(
        "--target-agreement",
        type=float,
        default=None,
        help="instead of --budget: the most exits whose simulated agreement with the full "
        "model's greedy token (teacher-forced, held-out windows) stays >= this; the profile's "
        "budget is their cost",
    )
    p.add_argument(
        "--keep-unpaid-probes",
        action="store_true",
        help="with --target-agreement: keep probes whose exits save fewer FLOPs than the proxy "
        "costs there (by default they are turned off, and the report names them)",
    )
    p.add_argument("--budget-kind", choices=("layers", "flops"), default="layers")
    p.add_argument("--tokens", type=int, default=256 * 32, help="teacher-forced")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--keep", type=int, default=64, help="positions kept/window")
    p.add_argument(
        "--probe-every",
        type=int,
        default=None,
        help="probe spacing in layers (default 2; 1 with --signal quicksilver/river, which "
        "check after every block)",
    )
    p.add_argument("--rank", type=int, default=32)
    p.add_argument(
        "--proxy-vocab",
        type=int,
        default=0,
        help="the low-rank proxy's softmax over this many tokens (those the model predicts on "
        "the corpora, then the most frequent), cutting its cost in proportion; 0: the whole "
        "vocabulary",
    )
    p.add_argument("--alpha", type=float, default=1.5)
    p.add_argument("--ridge", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--proxy", choices=("lowrank", "feature"), default="lowrank")
    p.add_argument("--scalar-norm", action="store_true", help="scalar a_l, b_l per layer")
    p.add_argument("--norm-metric", choices=("logits", "hidden"), default="hidden")
    p.add_argument("--no-norm-bias", action="store_true", help="fit a_l only (b_l = 0)")
    p.add_argument("--population", choices=("all", "agree"), default="all")
    p.add_argument(
        "--min-agreement",
        type=float,
        default=0.0,
        help="disable probe layers whose calibrated readout agrees with the final layer less "
        "often (0: every probe, as the paper)",
    )
    p.add_argument("--floor-tokens", type=int, default=16, help="as adaptive.depth.floor")
    p.add_argument("--floor-min", type=int, default=None)
    p.add_argument(
        "--signal",
        action="append",
        choices=("emad", "quicksilver", "river"),
        default=None,
        help="exit signal(s) to calibrate into the profile (repeat); EMAD's part is always "
        "written, the others add their thresholds under their own keys",
    )
    p.add_argument("--qs-percentile", type=float, default=25.0, help="B.2 candidate percentile")
    p.add_argument("--qs-min-halting-depth", type=int, default=5, help="l_min (B.5)")
    p.add_argument(
        "--qs-entropy",
        choices=("proxy", "exact"),
        default="proxy",
        help="QuickSilver's entropy: the EMAD proxy (cheap) or the exact readout entropy",
    )
    p.add_argument("--qs-max-halting-layer", type=int, default=None, help="window end (G.2)")
    p.add_argument(
        "--qs-max-ppl-increase",
        type=float,
        default=0.01,
        help="B.2 grid choice: the cheapest point within this perplexity increase",
    )
    p.add_argument(
        "--river-match-rate",
        type=float,
        default=0.98,
        help="tau: smallest whose greedy match rate with the final layer stays >= this",
    )
    p.add_argument("--river-entry-layer", type=int, default=1, help="L_s: first exit layer")
    p.add_argument("--plot", help="PNG of per-layer agreement and thresholds")
    p.add_argument("--json", action="store_true", help="print the full summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
