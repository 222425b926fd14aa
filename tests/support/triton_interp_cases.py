"""Triton kernel correctness cases, run on CPU tensors under Triton's interpreter.

    TRITON_INTERPRET=1 python -m tests.support.triton_interp_cases OUT.json   (from the repo root)

It sets ``TRITON_INTERPRET=1`` itself before anything imports triton, and must run in a process
of its own: triton reads the flag when a kernel is decorated, and the pytest process (where vLLM
imports triton too) must keep normal compiled-kernel semantics.
``tests/unit/test_triton_kernels.py`` starts it once per session and checks one result per case.

:func:`cases` is plain data (no torch, no triton) so the test module can parametrize over it.
Each result is ``{"err": max|y - ref| / max|ref|, "tol": ..., "config": ...}`` or
``{"error": traceback}``; reference: ``F.linear(x.float(), dequantize(W))`` in float32 (for a
Matryoshka tier, ``MatryoshkaWeight.dequantize(bits)``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

DTYPES = ("float32", "bfloat16", "float16")
# max|y - ref| / max|ref|: fp32 accumulation of exact products; the output rounding of x's dtype
# dominates (bf16 2**-8, fp16 2**-11 relative), plus the weight rounded to x's dtype on the
# element-scale path.
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
M_VALUES = (1, 3, 17, 64)


def cases() -> list[dict]:
    """Every case: an id and what to build (small: the interpreter runs programs in numpy)."""
    out: list[dict] = []
    # (K, N): K not a multiple of any K block (200 = 128 + 72 = 3 * 64 + 8), N not a multiple of
    # the N block (40, 48, 72 < 64 or 64 + 8)
    packed_formats = []
    for bits in (8, 4, 2):
        for sym in (True, False):
            # per-row: block scales with a partial last K block; g32 / g64: block scales with
            # BLOCK_K = group; g40 (not a power of two) and g8 (< 16): element scales
            groups = [(None, (200, 48)), (32, (256, 40)), (40, (200, 72)), (8, (96, 40))]
            if sym:
                groups.append((64, (192, 48)))
            for group, kn in groups:
                packed_formats.append((bits, sym, group, kn))
    i = 0
    for bits, sym, group, (k, n) in packed_formats:
        for j, m in enumerate(M_VALUES):
            dt = DTYPES[(i + j) % 3]
            grp = "row" if group is None else f"g{group}"
            out.append(
                {
                    "id": f"int{bits}-{grp}-{'sym' if sym else 'asym'}-M{m}-{dt}",
                    "kind": "packed",
                    "bits": bits,
                    "group": group,
                    "symmetric": sym,
                    "m": m,
                    "k": k,
                    "n": n,
                    "dtype": dt,
                }
            )
        i += 1
    for bits in (8, 4, 2):
        for group, (k, n) in ((None, (200, 48)), (32, (256, 40)), (40, (200, 72))):
            for j, m in enumerate(M_VALUES):
                dt = DTYPES[(i + j) % 3]
                grp = "row" if group is None else f"g{group}"
                out.append(
                    {
                        "id": f"planes{bits}-{grp}-M{m}-{dt}",
                        "kind": "planes",
                        "bits": bits,
                        "group": group,
                        "m": m,
                        "k": k,
                        "n": n,
                        "dtype": dt,
                    }
                )
            i += 1
    # forced configurations: every dtype
    forced = [
        # uneven split-K: 200 / 32 -> 7 K blocks over 3 splits (3 + 3 + 1)
        ("splitk-uneven", "packed", 4, None, False, (200, 48), {"block_k": 32, "split_k": 3}),
        # a group spanning two K blocks (g128, BLOCK_K 64), asymmetric, split over 4 blocks
        ("g128-two-blocks", "packed", 4, 128, False, (256, 40), {"block_k": 64, "split_k": 2}),
        # element scales forced on a group the block path could take
        ("g32-element", "packed", 2, 32, False, (256, 40), {"block_k": 64, "element_scales": True}),
        (
            "row-element",
            "packed",
            8,
            None,
            True,
            (200, 48),
            {"block_k": 64, "element_scales": True},
        ),
        # GEMM tiles with M, N and K all ragged; no split
        ("gemm-ragged", "packed", 4, 40, True, (200, 72), {"block_m": 32, "block_n": 32}),
        ("planes-splitk", "planes", 8, 32, True, (256, 40), {"block_k": 32, "split_k": 5}),
        (
            "planes-element",
            "planes",
            4,
            64,
            True,
            (256, 40),
            {"block_k": 128, "element_scales": True},
        ),
    ]
    for name, kind, bits, group, sym, (k, n), cfg in forced:
        for dt in DTYPES:
            for m in (3, 17):
                out.append(
                    {
                        "id": f"{name}-M{m}-{dt}",
                        "kind": kind,
                        "bits": bits,
                        "group": group,
                        "symmetric": sym,
                        "m": m,
                        "k": k,
                        "n": n,
                        "dtype": dt,
                        "config": cfg,
                    }
                )
    # a Matryoshka tier as a PackedWeight (offsets = half a step), leading batch dims, strided x
    for bits in (4, 2):
        out.append(
            {"id": f"mat-tier{bits}-packed", "kind": "tier", "bits": bits, "group": 32,
             "m": 5, "k": 256, "n": 48, "dtype": "bfloat16"}
        )  # fmt: skip
    out.append(
        {"id": "batched-strided-x", "kind": "packed", "bits": 4, "group": 32, "symmetric": True,
         "m": 6, "k": 256, "n": 40, "dtype": "float16", "batched": True}
    )  # fmt: skip
    return out


# special checks (not float comparisons), reported as {"ok": bool, "detail": ...}
SPECIAL = ("tiers-read-only-their-planes", "empty-m", "default-configs")


def _run() -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F

    from vllm_adaptive.kernels import triton_packed as tp
    from vllm_adaptive.kernels.matryoshka import matryoshka_quantize
    from vllm_adaptive.kernels.packed import dequantize, quantize
    from vllm_adaptive.kernels.planes import MatryoshkaPlanes, to_planes

    assert tp.INTERPRETED, "triton did not pick up TRITON_INTERPRET=1"
    results: dict = {}
    torch.set_num_threads(1)

    def weight(n: int, k: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, k, generator=g) * 0.05

    def config(c: dict, m: int, n: int, k: int, group):
        base = tp.default_config(m, n, k, group or k, group is None, "cpu")
        if c is None:
            return None
        fields = {**base.__dict__, **c}
        return tp.KernelConfig(**fields)

    for seed, case in enumerate(cases()):
        try:
            m, k, n = case["m"], case["k"], case["n"]
            dt = getattr(torch, case["dtype"])
            w = weight(n, k, seed)
            gen = torch.Generator().manual_seed(10_000 + seed)
            x = torch.randn(m, k, generator=gen).to(dt)
            cfg = config(case.get("config"), m, n, k, case["group"])
            if case["kind"] == "packed":
                p = quantize(w, case["bits"], case["group"], symmetric=case["symmetric"])
                ref_w = dequantize(p)
                if case.get("batched"):
                    wide = torch.randn(2, 3, 2 * k, generator=gen).to(dt)
                    x = wide[..., ::2]  # [2, 3, K], stride 2 along K
                    y = tp.packed_matmul(x, p, cfg)
                    assert y.shape == (2, 3, n), y.shape
                    x, y = x.reshape(-1, k), y.reshape(-1, n)
                else:
                    y = tp.packed_matmul(x, p, cfg)
            elif case["kind"] == "planes":
                mw = matryoshka_quantize(w, case["group"])
                pl = to_planes(mw)
                ref_w = mw.dequantize(case["bits"])
                y = tp.planes_matmul(x, pl, case["bits"], cfg)
            else:  # a Matryoshka tier as a PackedWeight
                p = matryoshka_quantize(w, case["group"]).tier(case["bits"])
                ref_w = dequantize(p)
                y = tp.packed_matmul(x, p, cfg)
            assert y.dtype == dt and y.shape == (x.shape[0], n), (y.dtype, y.shape)
            ref = F.linear(x.float(), ref_w)
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            used = cfg or tp.default_config(
                m, n, k, case["group"] or k, case["group"] is None, "cpu"
            )
            results[case["id"]] = {"err": err, "tol": TOL[case["dtype"]], "config": used.__dict__}
        except Exception:
            results[case["id"]] = {"error": traceback.format_exc()}

    # tier r reads only planes A..r: scrambling the planes below it leaves the result unchanged
    try:
        mw = matryoshka_quantize(weight(40, 256, 99), 32)
        pl = to_planes(mw)
        x = torch.randn(3, 256).to(torch.float16)
        cfg = tp.KernelConfig(16, 64, 32, split_k=1)
        rnd = lambda t: torch.randint(0, 256, t.shape, dtype=torch.uint8)  # noqa: E731
        scr_c = MatryoshkaPlanes(pl.a, pl.b, rnd(pl.c), pl.scales, pl.group_size, pl.shape)
        scr_bc = MatryoshkaPlanes(pl.a, rnd(pl.b), rnd(pl.c), pl.scales, pl.group_size, pl.shape)
        same4 = torch.equal(tp.planes_matmul(x, pl, 4, cfg), tp.planes_matmul(x, scr_c, 4, cfg))
        same2 = torch.equal(tp.planes_matmul(x, pl, 2, cfg), tp.planes_matmul(x, scr_bc, 2, cfg))
        differs8 = not torch.equal(
            tp.planes_matmul(x, pl, 8, cfg), tp.planes_matmul(x, scr_c, 8, cfg)
        )
        results["tiers-read-only-their-planes"] = {
            "ok": same4 and same2 and differs8,
            "detail": {
                "tier4_ignores_C": same4,
                "tier2_ignores_BC": same2,
                "tier8_reads_C": differs8,
            },
        }
    except Exception:
        results["tiers-read-only-their-planes"] = {"error": traceback.format_exc()}

    try:
        p = quantize(weight(40, 64, 7), 4, 32)
        y = tp.packed_matmul(torch.randn(0, 64), p)
        results["empty-m"] = {"ok": tuple(y.shape) == (0, 40), "detail": list(y.shape)}
    except Exception:
        results["empty-m"] = {"error": traceback.format_exc()}

    # default configs: decode tiles for M <= 16, GEMM tiles above, BLOCK_K = group for g32/g64
    try:
        d1 = tp.default_config(1, 4096, 4096, 32, False, "cpu")
        d64 = tp.default_config(64, 4096, 4096, 4096, True, "cpu")
        d40 = tp.default_config(1, 576, 576, 48, False, "cpu")
        ok = (
            (d1.block_m, d1.block_k) == (16, 32)
            and (d64.block_m, d64.block_k, d64.split_k) == (64, 64, 1)
            and d40.block_k == 128
        )
        results["default-configs"] = {"ok": ok, "detail": [d1.__dict__, d64.__dict__, d40.__dict__]}
    except Exception:
        results["default-configs"] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    from tests.support.triton_interp_probe import interpreter_defect

    os.environ["TRITON_INTERPRET"] = "1"
    defect = interpreter_defect()
    res = {"skip": defect} if defect else _run()
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)
