"""How often bf16 alone changes SmolLM2's greedy token, and where smoothed W8A8 stands against
both references (transformers, calibration split, 24 windows x 256 tokens)."""

from __future__ import annotations

import argparse
import json


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_adaptive.corpora import read_corpus, token_windows_with_next
    from vllm_adaptive.precision.gear_plan import _FUSED_PARTS, LayerSimulator, greedy_tokens
    from vllm_adaptive.precision.smoothing import load_smoothing

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--corpus", action="append", required=True)
    p.add_argument("--smoothing-profile", required=True)
    p.add_argument("--windows", type=int, default=24)
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    files = [read_corpus(c) for c in args.corpus]
    w, _ = token_windows_with_next(tok, [f.calibration_text for f in files], 256, args.windows)
    w = torch.tensor(w)
    m32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.stack([m32(w[i : i + 1]).logits[0] for i in range(len(w))])
    r32 = logits.argmax(-1)
    top2 = logits.topk(2, -1).values
    gap = top2[..., 0] - top2[..., 1]
    m16 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    r16 = greedy_tokens(m16, w)
    out = {
        "positions": int(r32.numel()),
        "bf16_vs_float32": (r16 == r32).float().mean().item(),
        "float32_top2_gap_below": {
            str(g): (gap < g).float().mean().item() for g in (0.05, 0.1, 0.2)
        },
    }
    stats = load_smoothing(args.smoothing_profile, args.model)
    for name, model, ref in (("bf16", m16, r16), ("float32", m32, r32)):
        for label, smooth in (("w8a8", None), ("w8a8_smoothed", stats)):
            sim = LayerSimulator(model, tuple(_FUSED_PARTS), smooth, 0.5)
            sim.set_quantized(set(range(len(sim.layers))))
            r = greedy_tokens(model, w)
            sim.set_quantized(set())
            out[f"{label}_{name}_engine_vs_own_dtype"] = (r == ref).float().mean().item()
            out[f"{label}_{name}_engine_vs_float32"] = (r == r32).float().mean().item()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
