"""River-LLM's exit path, teacher-forced in transformers: next-token match rate vs exit depth.

River-LLM's 98% next-token match rate (sec. 4.2, GSM8K, Llama 3.2 1B, tau = 0.5) is for its
Exit River: a token whose state-transition similarity cos(h_{l-1}, h_l) passes tau runs the
*remaining* layers through 4-bit copies of them that write the same KV cache, then the
original LM head. That is not what our depth runtime does today (it emits the calibrated
readout at the exit layer). This tool measures the River semantics on the default model so
the two can be compared:

* every window is teacher-forced in float32; positions before the last ``--keep`` are the
  prompt and run the backbone (River's prefill uses one sequence-level depth; full depth is
  the conservative choice); each kept position decides after every block l >= ``--entry``
  whether s_l > tau, and from the next block on runs the int4 copy of each layer;
* K/V are shared exactly as in decode: inside each layer, every position's q/k/v, o_proj and
  MLP come from the weights of the path it is on (backbone or river), and attention runs over
  all earlier positions' K/V as written by their own paths;
* the match rate compares the argmax of the River logits with the full backbone's, and the
  perplexity ratio uses the next text token. "Readout" rows are the same exits with the plain
  logit lens at the exit layer instead of the river (the runtime's semantics, uncalibrated).

The river weights are quantized with the project's packed quantizer: ``--scheme asym64``
(HQQ's default shape: 4-bit, zero point, groups of 64) or ``sym32``; the default model's
linears already lie on a Q4_1 grid (asymmetric, groups of 32), so ``asym32`` reproduces them
and the river is the backbone (a control). Prints a markdown table, ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vllm_adaptive.corpora import read_corpus, token_windows_with_next
from vllm_adaptive.depth.calibration.collect import load_model
from vllm_adaptive.depth.policies.river import state_transition_similarity
from vllm_adaptive.kernels.packed import dequantize, quantize

DEFAULT_MODEL = Path.home() / ".cache/vllm-adaptive/models/smollm2-135m-instruct"
SCHEMES = {"asym64": (64, False), "sym32": (32, True), "asym32": (32, False)}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def river_weights(layer, scheme: str) -> dict[str, torch.Tensor]:
    """Fake-quantized (quantize -> dequantize) copies of one decoder layer's linear weights."""
    group, symmetric = SCHEMES[scheme]
    out = {}
    for name, mod in layer.named_modules():
        if name.split(".")[-1] in LINEARS:
            w = mod.weight.detach().float()
            packed = quantize(w, 4, group, symmetric=symmetric, check_double_quant=False)
            out[name] = dequantize(packed)
    return out


def _lin(mod, w_river, x, sel):
    """Per-position weights: the river copy for rows in ``sel``, the backbone for the rest."""
    full = torch.nn.functional.linear(x, mod.weight)
    if not bool(sel.any()):
        return full
    return torch.where(sel[:, None], torch.nn.functional.linear(x, w_river), full)


def mixed_layer(layer, rw, h, sel, cos_sin):
    """One Llama decoder layer over a [T, d] sequence, each position on its own path."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    hd = attn.head_dim
    x = layer.input_layernorm(h)
    q = _lin(attn.q_proj, rw["self_attn.q_proj"], x, sel)
    k = _lin(attn.k_proj, rw["self_attn.k_proj"], x, sel)
    v = _lin(attn.v_proj, rw["self_attn.v_proj"], x, sel)
    T = h.shape[0]
    q = q.view(1, T, -1, hd).transpose(1, 2)
    k = k.view(1, T, -1, hd).transpose(1, 2)
    v = v.view(1, T, -1, hd).transpose(1, 2)
    cos, sin = cos_sin
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = a.transpose(1, 2).reshape(T, -1)
    h = h + _lin(attn.o_proj, rw["self_attn.o_proj"], a, sel)
    x = layer.post_attention_layernorm(h)
    mlp = layer.mlp
    gate = _lin(mlp.gate_proj, rw["mlp.gate_proj"], x, sel)
    up = _lin(mlp.up_proj, rw["mlp.up_proj"], x, sel)
    return h + _lin(mlp.down_proj, rw["mlp.down_proj"], mlp.act_fn(gate) * up, sel)


@torch.no_grad()
def run_window(model, rws, ids, keep, tau, entry):
    """(river logits, readout logits, exit layer) for the last ``keep`` positions."""
    inner = model.model
    L = len(inner.layers)
    x = torch.tensor([ids])
    h = inner.embed_tokens(x)[0]
    pos = torch.arange(len(ids))[None]
    cos_sin = inner.rotary_emb(h[None], pos)
    T = len(ids)
    decode = torch.zeros(T, dtype=torch.bool)
    decode[T - keep :] = True
    exited = torch.zeros(T, dtype=torch.bool)
    exit_layer = torch.full((T,), L)
    readout = torch.zeros(T, h.shape[1])
    for i, (layer, rw) in enumerate(zip(inner.layers, rws, strict=True)):
        prev = h
        h = mixed_layer(layer, rw, h, exited, cos_sin)
        n = i + 1
        if n >= entry and n < L:
            s = state_transition_similarity(prev, h)
            new = decode & ~exited & (s > tau)
            exit_layer[new] = n
            readout[new] = h[new]
            exited |= new
    final = inner.norm(h)
    logits = model.lm_head(final)
    readout[~exited] = h[~exited]
    lens = model.lm_head(inner.norm(readout))
    return logits[T - keep :], lens[T - keep :], exit_layer[T - keep :]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--corpus", action="append", required=True)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--keep", type=int, default=48)
    p.add_argument("--tau", type=float, action="append", help="repeat (default 0.5)")
    p.add_argument("--entry", type=int, default=1, help="L_s, first exit layer")
    p.add_argument("--scheme", choices=sorted(SCHEMES), action="append")
    p.add_argument("--json")
    args = p.parse_args(argv)
    taus = args.tau or [0.5]
    schemes = args.scheme or ["asym64"]
    t0 = time.perf_counter()
    model, tok, _ = load_model(args.model)
    texts = [read_corpus(c).calibration_text for c in args.corpus]
    windows, nexts = token_windows_with_next(tok, texts, args.window, args.windows)
    refs = []
    with torch.no_grad():
        for w, nxt in zip(windows, nexts, strict=True):
            logits = model(torch.tensor([w])).logits[0, -args.keep :].float()
            tgt = torch.tensor([*w[len(w) - args.keep + 1 :], nxt])
            refs.append((logits, tgt))
    rows = []
    for scheme in schemes:
        rws = [river_weights(layer, scheme) for layer in model.model.layers]
        for tau in taus:
            agree = agree_lens = nll = nll_ref = nll_lens = count = 0.0
            depth = []
            for w, (ref, tgt) in zip(windows, refs, strict=True):
                out, lens, ex = run_window(model, rws, w, args.keep, tau, args.entry)
                ok = tgt >= 0
                g = ref.argmax(-1)
                agree += float((out.argmax(-1) == g).sum())
                agree_lens += float((lens.argmax(-1) == g).sum())

                def lp(z, t=tgt, ok=ok):
                    return -torch.log_softmax(z.float(), -1)[ok].gather(1, t[ok, None]).sum()

                nll += float(lp(out))
                nll_lens += float(lp(lens))
                nll_ref += float(lp(ref))
                count += float(ok.sum())
                depth.append(ex.float())
            n = len(windows) * args.keep
            d = torch.cat(depth)
            values, counts = d.unique(return_counts=True)
            rows.append(
                {
                    "scheme": scheme,
                    "tau": tau,
                    "entry_layer": args.entry,
                    "tokens": n,
                    "mean_exit_layer": float(d.mean()),
                    "exit_hist": {int(k): int(v) for k, v in zip(values, counts, strict=True)},
                    "river_match_rate": agree / n,
                    "river_ppl_ratio": float(torch.tensor((nll - nll_ref) / count).exp()),
                    "readout_match_rate": agree_lens / n,
                    "readout_ppl_ratio": float(torch.tensor((nll_lens - nll_ref) / count).exp()),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("| int4 river | tau | mean exit layer | river match rate | river ppl ratio | "
          "readout match rate | readout ppl ratio |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['scheme']} | {r['tau']} | {r['mean_exit_layer']:.2f} | "
            f"{r['river_match_rate']:.3f} | {r['river_ppl_ratio']:.3g} | "
            f"{r['readout_match_rate']:.3f} | {r['readout_ppl_ratio']:.3g} |"
        )
    print(f"{len(windows)} windows x {args.keep} positions, {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
