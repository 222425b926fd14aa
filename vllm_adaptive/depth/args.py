"""`vllm-adaptive calibrate` arguments, importable without torch (keeps the CLI start fast).

Defaults mirror `CalibrationOptions` / `CollectConfig`.
"""

from __future__ import annotations

import argparse


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--corpus", action="append", required=True, help="plain-text file (repeat)")
    p.add_argument("--out", required=True, help="profile directory to write")
    p.add_argument("--budget", type=float, default=0.6, help="cost fraction of full depth")
    p.add_argument("--budget-kind", choices=("layers", "flops"), default="layers")
    p.add_argument("--tokens", type=int, default=256 * 32, help="teacher-forced")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--keep", type=int, default=64, help="positions kept/window")
    p.add_argument("--probe-every", type=int, default=2)
    p.add_argument("--rank", type=int, default=32)
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
    p.add_argument("--plot", help="PNG of per-layer agreement and thresholds")
    p.add_argument("--json", action="store_true", help="print the full summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
