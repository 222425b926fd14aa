"""Contextual token fusion (issue 20) on held-out text: what a calibrated profile removes and
what it costs in continuation perplexity, per corpus and prompt length.

Reads a profile from ``vllm-adaptive calibrate --fusion`` and the last 10% of each corpus
(``CorpusFile.eval_text``, disjoint from the calibration text). For each corpus and prompt
length, ``--windows`` windows of prompt + ``--continuation`` tokens run twice through
``depth/calibration/fusion_reference.py`` (the engine's mask strategy, in plain torch,
float32): without fusion and with the profile's rules and exemptions. Reported: fraction of
the prompt's token-layers removed, continuation perplexity (teacher-forced, pooled over
windows) with and without fusion, and greedy agreement of the continuation predictions.
``--plot`` draws the fusion events of the first window of the first corpus at the first
prompt length.

Command (docs/token-fusion.md)::

    .venv/bin/python docs/experiments/fusion_eval.py --profile PROFILE \\
        --model ~/.cache/vllm-adaptive/models/smollm2-135m-instruct \\
        --corpus /tmp/mlxdev/corpora/prose.txt --corpus /tmp/mlxdev/corpora/code.txt \\
        --prompt-lens 512,2048 --windows 6,2 --json docs/data/fusion-eval.json \\
        --plot docs/figures/fusion-events-smollm2.png
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from vllm_adaptive.corpora import read_corpus
from vllm_adaptive.depth.calibration.collect import load_model
from vllm_adaptive.depth.calibration.fusion import evaluate, load_fusion_profile, plot_events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--corpus", action="append", required=True)
    ap.add_argument("--prompt-lens", default="512,2048")
    ap.add_argument("--windows", default="6,2", help="windows per corpus, per prompt length")
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, _ = load_model(args.model)
    prof = load_fusion_profile(args.profile, args.model)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    counts = [int(x) for x in args.windows.split(",")]
    rows = []
    for path in args.corpus:
        f = read_corpus(path)
        for plen, n in zip(lens, counts, strict=True):
            t0 = time.perf_counter()
            fig, runs, ws = evaluate(model, tok, [f.eval_text], prof, plen, args.continuation, n)
            row = {
                "corpus": Path(path).name,
                "prompt_len": plen,
                "windows": n,
                "continuation": args.continuation,
                **asdict(fig),
                "ppl_ratio": fig.ppl_ratio,
                "seconds": round(time.perf_counter() - t0, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.plot and len(rows) == 1:
                toks = len(runs[0].events)
                plot_events(
                    runs[0],
                    args.plot,
                    f"{Path(path).name}, held-out prompt of {plen} tokens: {toks} fusion groups, "
                    f"{runs[0].removed_fraction:.1%} of token-layers removed",
                )
    out = {"profile": prof.meta.get("tau_fuse"), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
