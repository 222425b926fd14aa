"""River-LLM's "KV integrity" (sec. 4.1, Fig. 5) on our model: river K/V vs backbone K/V.

River-LLM reports that the K and V vectors written by its 4-bit Exit River layers stay above
0.97 cosine similarity to the backbone's own K/V whatever the exit point, with the value
similarity drifting down (0.97-0.98) as more river layers are traversed (Fig. 5b). This tool
measures the same quantity on the default model in transformers, float32, teacher-forced on
held-out text (the last 10% of each corpus, ``CorpusFile.eval_text``):

* for every exit layer e, the backbone's hidden state after block e at *every* position is fed
  to blocks e+1..L run with fake-quantized (quantize -> dequantize) int4 copies of their
  linears, attending over the river's own K/V for all positions. The whole sequence exits at
  e (River's sequence-level exit), so this is an upper bound on the drift a token-level exit
  sees (there the earlier positions' K/V are partly backbone-written);
* at each river layer l > e it records the cosine similarity between the river's K (after
  rotary) / V and the backbone's K / V at layer l, averaged over positions and KV heads;
  per e it reports the mean and minimum over river layers and the final layer's value
  (Fig. 5b's "final layer backbone-exit value similarity");
* "match" is the next-token greedy agreement of the river's logits (original norm + LM head)
  with the full backbone's, over all positions.

Quantizers (``vllm_adaptive.kernels.packed``, as ``depth/exit_river.py`` uses them):
``asym32`` is the model's own Q4_1 grid (asymmetric, groups of 32), so the river reproduces the
backbone: a control (expect ~1.0); ``asym64`` is HQQ's default shape and ``sym32`` symmetric
absmax, neither on the model's grid. The layer math and the quantized copies come from
``river_exit_path.py`` (next to this file, imported from the script's directory).

Command (about 100 s on 2 CPU cores shared with another job; the cost is ~155 river layers
per quantizer and window, ~0.4 s per 256-token layer there, plus ~1 min of quantizing)::

    .venv/bin/python docs/experiments/river_kv_similarity.py \
        --corpus /tmp/corpora/code.txt --corpus /tmp/corpora/prose.txt \
        --windows 1 --window 96 --json docs/data/river-kv-similarity.json

(one 96-token window per corpus: 192 positions per cell; 4 x 256 windows would take ~12 min there.)

Prints a markdown table on stdout and progress lines on stderr; ``--json`` also keeps the
per-layer curves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from river_exit_path import DEFAULT_MODEL, LINEARS, SCHEMES, river_weights

from vllm_adaptive.corpora import read_corpus, token_windows_with_next
from vllm_adaptive.depth.calibration.collect import load_model

EXITS = (1, 2, 4, 8, 12, 16, 20, 24, 28)


def backbone_weights(layer) -> dict[str, torch.Tensor]:
    return {
        name: mod.weight.detach()
        for name, mod in layer.named_modules()
        if name.split(".")[-1] in LINEARS
    }


def layer_kv(layer, w, h, cos_sin):
    """One Llama decoder layer over a [T, d] sequence with linear weights ``w``.

    Returns (h_out, k, v) with k (after rotary) and v as [kv_heads, T, head_dim]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lin = torch.nn.functional.linear
    attn = layer.self_attn
    hd = attn.head_dim
    T = h.shape[0]
    x = layer.input_layernorm(h)
    q = lin(x, w["self_attn.q_proj"]).view(1, T, -1, hd).transpose(1, 2)
    k = lin(x, w["self_attn.k_proj"]).view(1, T, -1, hd).transpose(1, 2)
    v = lin(x, w["self_attn.v_proj"]).view(1, T, -1, hd).transpose(1, 2)
    cos, sin = cos_sin
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    a = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), is_causal=True
    )
    h = h + lin(a.transpose(1, 2).reshape(T, -1), w["self_attn.o_proj"])
    x = layer.post_attention_layernorm(h)
    mlp = layer.mlp
    g = lin(x, w["mlp.gate_proj"])
    u = lin(x, w["mlp.up_proj"])
    return h + lin(mlp.act_fn(g) * u, w["mlp.down_proj"]), k[0], v[0]


def head_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over heads and positions of the per-head-vector cosine similarity."""
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--corpus", action="append", required=True)
    p.add_argument("--windows", type=int, default=1, help="per corpus")
    p.add_argument("--window", type=int, default=96)
    p.add_argument("--exit", type=int, action="append", help=f"repeat (default {EXITS})")
    p.add_argument("--scheme", choices=sorted(SCHEMES), action="append",
                   help="repeat (default asym32, asym64, sym32)")  # fmt: skip
    p.add_argument("--json")
    args = p.parse_args(argv)
    exits = args.exit or list(EXITS)
    schemes = args.scheme or ["asym32", "asym64", "sym32"]
    t0 = time.perf_counter()
    model, tok, _ = load_model(args.model)
    inner = model.model
    L = len(inner.layers)
    if any(not 1 <= e < L for e in exits):
        p.error(f"exit layers must be in 1..{L - 1}")
    windows = []  # per corpus, so code and prose are both covered
    for c in args.corpus:
        windows += token_windows_with_next(tok, [read_corpus(c).eval_text], args.window,
                                           args.windows)[0]  # fmt: skip
    bws = [backbone_weights(layer) for layer in inner.layers]

    # Backbone pass: hidden state after each block, K/V per layer, greedy tokens.
    base = []
    for w in windows:
        h = inner.embed_tokens(torch.tensor([w]))[0]
        cos_sin = inner.rotary_emb(h[None], torch.arange(len(w))[None])
        hs, ks, vs = [h], [], []
        for layer, bw in zip(inner.layers, bws, strict=True):
            h, k, v = layer_kv(layer, bw, h, cos_sin)
            hs.append(h)
            ks.append(k)
            vs.append(v)
        ref = model.lm_head(inner.norm(h)).argmax(-1)
        base.append((cos_sin, hs, ks, vs, ref))
    print(f"backbone: {len(windows)} windows x {args.window} tokens, "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # fmt: skip

    rows = []
    for scheme in schemes:
        rws = [river_weights(layer, scheme) for layer in inner.layers]
        for e in exits:
            kc = torch.zeros(L - e)
            vc = torch.zeros(L - e)
            agree = 0.0
            for cos_sin, hs, ks, vs, ref in base:
                h = hs[e]
                for j, i in enumerate(range(e, L)):  # blocks e+1..L (0-based index i)
                    h, k, v = layer_kv(inner.layers[i], rws[i], h, cos_sin)
                    kc[j] += head_cos(k, ks[i])
                    vc[j] += head_cos(v, vs[i])
                agree += float((model.lm_head(inner.norm(h)).argmax(-1) == ref).sum())
            kc /= len(base)
            vc /= len(base)
            row = {
                "scheme": scheme,
                "quantizer": f"int4 g{SCHEMES[scheme][0]} "
                + ("sym absmax" if SCHEMES[scheme][1] else "asym min/max"),
                "exit_layer": e,
                "river_layers": L - e,
                "k_cos_mean": float(kc.mean()),
                "k_cos_min": float(kc.min()),
                "v_cos_mean": float(vc.mean()),
                "v_cos_min": float(vc.min()),
                "v_cos_final": float(vc[-1]),
                "k_cos_final": float(kc[-1]),
                "match_rate": agree / (len(base) * args.window),
                "k_cos_by_layer": {str(e + 1 + j): round(float(c), 6) for j, c in enumerate(kc)},
                "v_cos_by_layer": {str(e + 1 + j): round(float(c), 6) for j, c in enumerate(vc)},
            }
            rows.append(row)
            print(f"{scheme} e={e}: K {row['k_cos_mean']:.4f}/{row['k_cos_min']:.4f} "
                  f"V {row['v_cos_mean']:.4f}/{row['v_cos_min']:.4f} "
                  f"final V {row['v_cos_final']:.4f} match {row['match_rate']:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    elapsed = time.perf_counter() - t0
    print("| int4 river | exit e | K cos mean | K cos min | V cos mean | V cos min | "
          "V cos final layer | greedy match |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['scheme']} | {r['exit_layer']} | {r['k_cos_mean']:.4f} | {r['k_cos_min']:.4f} "
            f"| {r['v_cos_mean']:.4f} | {r['v_cos_min']:.4f} | {r['v_cos_final']:.4f} "
            f"| {r['match_rate']:.3f} |"
        )
    print(f"{len(windows)} windows x {args.window} tokens (held-out), {elapsed:.0f} s")
    if args.json:
        out = {
            "model": Path(args.model).name,
            "corpora": [Path(c).name for c in args.corpus],
            "split": "eval_text (last 10%)",
            "windows": len(windows),
            "window": args.window,
            "exit": "sequence-level: all positions leave the backbone after block e",
            "cos": "mean over positions and KV heads; K after rotary",
            "seconds": round(elapsed, 1),
            "rows": rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
