"""Reconstruction error of Matryoshka tiers (int4 / int2 sliced from int8) vs direct quantizers.

Reads every linear weight (q, k, v, o, gate, up, down) of a safetensors checkpoint, default the
project's default model, and for each grouping (per-row, g32, g64) reports, over all those
weights together:

- ``rel_fro``: sqrt(sum ||W - W_q||_F^2 / sum ||W||_F^2)   (aggregate relative Frobenius error)
- ``mean_rel_fro``: mean over matrices of ||W - W_q||_F / ||W||_F
- ``max_abs``: largest |W - W_q| element anywhere

for these quantizers (all on the same grouping):

- ``int8 symmetric``: the Matryoshka base (GEARBX absmax, codes in [-127, 127]);
- ``int{4,2} matryoshka-msb``: the tier read as the top bits of the int8 codes (shift, bin centre);
- ``int{4,2} direct-midrise``: the same grid and scales, rounded directly from the float weight
  (so the gap to ``matryoshka-msb`` is the cost of slicing / double rounding);
- ``int{4,2} matryoshka-round``: MatQuant-style ``round(q / 2**(8-r))`` slice (reference only);
- ``int{4,2} symmetric``: GEARBX symmetric (int4 in [-7, 7], int2 ternary), own absmax scales;
- ``int{4,2} asymmetric``: min/max with all 2**r levels, own scales (int4 g32 = the Q4_1 grid).

Writes JSON (``--json``) and prints a markdown table. Does not write near the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vllm_adaptive.kernels.matryoshka import (
    matryoshka_quantize,
    quantize_on_tier_grid,
    slice_codes,
)
from vllm_adaptive.kernels.packed import (
    coarse_grid_fraction,
    dequantize,
    dequantize_codes,
    quantize,
    storage_range,
)

DEFAULT_CKPT = Path.home() / ".cache/vllm-adaptive/models/smollm2-135m-instruct/model.safetensors"
LINEAR_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def load_linear_weights(path: Path, limit: int | None = None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            if name.endswith(LINEAR_SUFFIXES):
                out[name] = f.get_tensor(name).to(torch.float32)
                if limit and len(out) >= limit:
                    break
    return out


def round_slice(m, bits: int) -> torch.Tensor:
    """MatQuant-style rounded slice of the int8 codes, dequantized (reference only)."""
    step = 2 ** (8 - bits)
    lo, hi = storage_range(bits)
    c = torch.round(m.base.data.to(torch.float32) / step).clamp_(lo, hi).to(torch.int8)
    return dequantize_codes(c, m.base.scales * float(step), None)


def quantizers(w: torch.Tensor, group: int | None) -> dict[str, torch.Tensor]:
    """name -> reconstructed float32 weight."""
    m = matryoshka_quantize(w, group, check_double_quant=False)
    out = {"int8 symmetric (matryoshka base)": m.dequantize(8)}
    for bits in (4, 2):
        out[f"int{bits} matryoshka-msb"] = m.dequantize(bits)
        assert torch.equal(m.codes(bits), slice_codes(m.base.data, bits))
        out[f"int{bits} direct-midrise (same grid)"] = dequantize(quantize_on_tier_grid(w, m, bits))
        out[f"int{bits} matryoshka-round"] = round_slice(m, bits)
        out[f"int{bits} symmetric"] = dequantize(
            quantize(w, bits, group, symmetric=True, check_double_quant=False)
        )
        out[f"int{bits} asymmetric"] = dequantize(
            quantize(w, bits, group, symmetric=False, check_double_quant=False)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CKPT))
    ap.add_argument("--groups", default="row,32,64", help="576 = 9 x 64: g128 does not divide K")
    ap.add_argument("--limit", type=int, default=None, help="only the first N linear weights")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="docs/data/matryoshka-quality.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    ckpt = Path(args.checkpoint)
    if not ckpt.exists():
        raise SystemExit(f"checkpoint not found: {ckpt}")
    weights = load_linear_weights(ckpt, args.limit)
    print(f"{len(weights)} linear weights from {ckpt}", file=sys.stderr)
    fracs = [coarse_grid_fraction(w) for w in weights.values()]
    groups = [None if g == "row" else int(g) for g in args.groups.split(",")]

    acc: dict[tuple[str, str], dict] = {}
    wsq = 0.0
    started = time.perf_counter()
    for i, (name, w) in enumerate(weights.items()):
        wsq += float(w.pow(2).sum())
        for g in groups:
            gname = "per-row" if g is None else f"g{g}"
            for qname, wq in quantizers(w, g).items():
                e = wq - w
                a = acc.setdefault((gname, qname), {"esq": 0.0, "rel": [], "max_abs": 0.0})
                esq = float(e.pow(2).sum())
                a["esq"] += esq
                a["rel"].append((esq / float(w.pow(2).sum())) ** 0.5)
                a["max_abs"] = max(a["max_abs"], float(e.abs().max()))
        if (i + 1) % 30 == 0 or i + 1 == len(weights):
            print(
                f"[{i + 1}/{len(weights)} {time.perf_counter() - started:.0f}s] {name}",
                file=sys.stderr,
                flush=True,
            )

    rows = []
    for (gname, qname), a in acc.items():
        rows.append(
            {
                "group": gname,
                "quantizer": qname,
                "rel_fro": (a["esq"] / wsq) ** 0.5,
                "mean_rel_fro": sum(a["rel"]) / len(a["rel"]),
                "max_abs": a["max_abs"],
            }
        )
    meta = {
        "checkpoint": str(ckpt),
        "matrices": len(weights),
        "parameters": sum(w.numel() for w in weights.values()),
        "max_abs_weight": max(float(w.abs().max()) for w in weights.values()),
        "coarse_grid_fraction_min": min(fracs),
        "coarse_grid_fraction_mean": sum(fracs) / len(fracs),
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)

    print(
        f"{meta['matrices']} linear weights, {meta['parameters'] / 1e6:.1f} M parameters, "
        f"max |W| = {meta['max_abs_weight']:.3f}; groups of 32 on a <=16-level grid: "
        f"{meta['coarse_grid_fraction_min']:.0%} (min over matrices).\n"
    )
    print("| grouping | quantizer | rel. Frobenius (all) | mean rel. Frobenius | max abs |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['group']} | {r['quantizer']} | {r['rel_fro']:.4f} | "
            f"{r['mean_rel_fro']:.4f} | {r['max_abs']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
