"""How closely the int4 g32 asymmetric gear gives back the default model's bf16 decoder weights
(a Q4_1 GGUF dequantized to bf16): the share of weights whose float32 dequantization, rounded
to bf16, equals the checkpoint's value. (2026-12-08: 0.819; the rest differ by bf16 rounding
of the refitted scale and offset, which is why served text is not identical to stock's.)

    PYTHONPATH=. .venv/bin/python docs/experiments/grid_exact.py [MODEL_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file

from vllm_adaptive.kernels.packed import quantize

DEFAULT = Path.home() / ".cache/vllm-adaptive/models/smollm2-135m-instruct"


def main() -> None:
    model = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    weights = load_file(next(model.glob("*.safetensors")))
    total = same = 0
    for name, w in sorted(weights.items()):
        if w.dim() != 2 or "layers." not in name:
            continue
        p = quantize(w.float(), 4, 32, symmetric=False, check_double_quant=False)
        n, k = w.shape
        codes = p.codes().float().view(n, k // 32, 32)
        deq = codes * p.scales.float().view(n, -1, 1) + p.offsets.float().view(n, -1, 1)
        same += int((deq.view(n, k).bfloat16() == w.bfloat16()).sum())
        total += w.numel()
    print(f"{total} decoder weights; bf16(dequantized) == checkpoint: {same / total:.4f}")


if __name__ == "__main__":
    main()
