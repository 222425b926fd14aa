"""Why the MoEfied model loses quality (docs/moe.md, "What the figures say"): two diagnostics
on the dense SmolLM2 (transformers, one thread, no vLLM; the figures are the project's, on an
upcycled model, never a claim about trained MoEs).

``clustering``: per layer, the share of per-token importance ``|a_i| * ||down[:, i]||`` that
the best k of E experts capture, relative to the best ``k * I/E`` single neurons, for the
co-activation clustering the build uses, variants of its neuron profile, and a random balanced
split (calibration text; the first 3,000 tokens cluster, the rest measure).

``layers``: oracle routing at ``--k`` in one layer at a time (all others dense) on a MoEfied
checkpoint: the perplexity and agreement each layer costs alone (held-out text).

    .venv/bin/python docs/experiments/moefy_diagnostics.py clustering \
        --corpus code.txt prose.txt
    .venv/bin/python docs/experiments/moefy_diagnostics.py layers --k 8 \
        --corpus code.txt prose.txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from vllm_adaptive.moe.moefy import balanced_kmeans, calibration_windows, collect_mlp_inputs
from vllm_adaptive.moe.reference import mlp_intermediate, topk_mask


def profiles(kind: str, a: torch.Tensor, down_norm: torch.Tensor) -> torch.Tensor:
    s = a.abs() * down_norm
    if kind == "abs":  # what the build uses
        p = a.abs().T
    elif kind == "tokennorm":
        p = (s / s.sum(-1, keepdim=True)).T
        p = p - p.mean(1, keepdim=True)
    elif kind in ("tophalf", "topquarter"):
        frac = 2 if kind == "tophalf" else 4
        p = topk_mask(s, s.shape[-1] // frac).float().T
        p = p - p.mean(1, keepdim=True)
    else:
        raise ValueError(kind)
    p = p.contiguous()
    return p / p.norm(dim=1, keepdim=True).clamp(min=1e-12)


@torch.no_grad()
def clustering(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_adaptive.corpora import prompt_bos

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    windows, _ = calibration_windows(tok, args.corpus, 256, 8)
    xs = collect_mlp_inputs(model, windows, prompt_bos(tok), progress=False)
    e, m = args.experts, model.config.intermediate_size // args.experts
    for li in args.layers:
        mlp = model.model.layers[li].mlp
        a = mlp_intermediate(mlp, xs[li])
        dn = mlp.down_proj.weight.norm(dim=0)
        s = a.abs() * dn
        test = s[3000:]
        ref = {k: test.topk(k * m, -1).values.sum(-1) for k in (e // 4, e // 2, 3 * e // 4)}
        row = {}
        for kind in ("abs", "tokennorm", "tophalf", "topquarter", "random"):
            if kind == "random":
                labels = np.random.RandomState(0).permutation(np.repeat(np.arange(e), m))
            else:
                labels = balanced_kmeans(profiles(kind, a[:3000], dn), e, 40, li)
            per_expert = torch.zeros(test.shape[0], e).index_add_(1, torch.from_numpy(labels), test)
            row[kind] = {
                k: round(float((per_expert.topk(k, -1).values.sum(-1) / r).mean()), 3)
                for k, r in ref.items()
            }
        print(f"layer {li}: {row}", flush=True)


@torch.no_grad()
def layers(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from vllm_adaptive.corpora import prompt_bos
    from vllm_adaptive.moe.quality import eval_windows, logits_of, score
    from vllm_adaptive.moe.reference import load_moefied, moefied_mlps, set_routing

    moe = load_moefied(args.model)
    tok = AutoTokenizer.from_pretrained(args.model)
    bos = prompt_bos(tok)
    ws = {Path(c).stem: eval_windows(tok, c, args.windows, 256) for c in args.corpus}
    mlps = moefied_mlps(moe)
    set_routing(moe, top_k=mlps[0].num_experts)
    dense = {c: logits_of(moe, w, bos, c, False) for c, w in ws.items()}
    top1 = {c: [lp.argmax(-1) for lp in v] for c, v in dense.items()}
    base = {c: score(dense[c], ws[c], None)["ppl"] for c in ws}
    for li in range(len(mlps)):
        set_routing(moe, top_k=mlps[0].num_experts)
        mlps[li].top_k, mlps[li].mode = args.k, "oracle"
        out = {}
        for c, w in ws.items():
            r = score(logits_of(moe, w, bos, c, False), w, top1[c])
            out[c] = {"ppl_vs_dense": round(r["ppl"] / base[c] - 1, 3), "agreement": r["agreement"]}
        print(f"oracle k={args.k} only in layer {li}: {out}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("clustering")
    c.add_argument(
        "--model", default=str(Path.home() / ".cache/vllm-adaptive/models/smollm2-135m-instruct")
    )
    c.add_argument("--corpus", nargs="+", required=True)
    c.add_argument("--experts", type=int, default=16)
    c.add_argument("--layers", type=int, nargs="+", default=[0, 3, 10, 20, 29])
    c.set_defaults(func=clustering)
    lyr = sub.add_parser("layers")
    lyr.add_argument(
        "--model", default=str(Path.home() / ".cache/vllm-adaptive/models/smollm2-135m-moefied")
    )
    lyr.add_argument("--corpus", nargs="+", required=True)
    lyr.add_argument("--k", type=int, default=8)
    lyr.add_argument("--windows", type=int, default=4)
    lyr.set_defaults(func=layers)
    args = p.parse_args()
    torch.set_num_threads(1)
    args.func(args)


if __name__ == "__main__":
    main()
