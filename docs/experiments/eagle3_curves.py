"""Held-out acceptance of EAGLE-3 heads against training tokens, one line per head and drafted
position, from each head's ``vllm_adaptive.json`` (written by `vllm-adaptive train draft`).

    python docs/experiments/eagle3_curves.py OUT.png LABEL=HEAD_DIR [LABEL=HEAD_DIR ...] \
        [--title TEXT]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = "EAGLE-3 heads trained on CPU, SmolLM2-135M target, k = 3"
    if "--title" in argv:
        i = argv.index("--title")
        title, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    out, heads = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", ":"]
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for (label, head), color in zip(heads, colors, strict=False):
        curve = json.loads((Path(head) / "vllm_adaptive.json").read_text())["acceptance_curve"]
        x = [r["train_tokens"] / 1000 for r in curve]
        for j in range(len(curve[0]["acceptance"])):
            ax.plot(
                x,
                [r["acceptance"][j] for r in curve],
                styles[j % 3],
                color=color,
                label=f"{label}, position {j + 1}",
            )
    ax.set_xlabel("training tokens (thousands)")
    ax.set_ylabel("held-out greedy acceptance (chain)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
