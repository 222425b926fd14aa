"""Masked-attention Triton kernel cases, run on CPU tensors under Triton's interpreter.

    python -m tests.support.triton_masked_interp_cases OUT.json   (from the repository root)

Like ``tests/support/triton_interp_cases.py``: it sets ``TRITON_INTERPRET=1`` before anything
imports triton and must run in a process of its own; ``tests/unit/test_masked_attention.py``
starts it once per session and checks one result per case. :func:`cases` is plain data (no
torch, no triton).

Each float case builds a random paged cache (``tests/support/masked_attention_cases.py``:
shuffled block tables padded with out-of-range ids, NaN / inf in every slot the request may not
read, a random depth record including stale records on this step's slots), runs the dispatcher
``masked_attention`` (decode rows through the kernel, prefill rows through torch) or the kernel
alone, into an output pre-filled with NaN, and reports ``{"err": max|y - ref| / max|ref|,
"err_torch": same against the torch implementation, "tol": ..., "finite": every element written
and finite}``, or ``{"error": traceback}``. Reference: float64 dense attention with the mask rule.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}


def cases() -> list[dict]:
    out: list[dict] = []
    # (heads, kv_heads, head_size, block_size): GQA 2 and 3 (the default model's 9/3), MHA,
    # MQA with 6 query heads, a head size that is not a power of two (80 -> padded to 128)
    shapes = [(4, 2, 64, 32), (9, 3, 64, 16), (4, 4, 32, 16), (6, 1, 64, 32), (4, 2, 80, 16)]
    dtypes = ("float32", "bfloat16", "float16")
    i = 0
    for layout in ("cpu", "nhd"):
        for h, kvh, hs, bs in shapes:
            for splits in (None, 1, 3):
                dt = dtypes[(i + i // 3) % 3]  # every (splits, dtype) pair occurs
                i += 1
                out.append(
                    {
                        "id": f"{layout}-h{h}kv{kvh}d{hs}-bs{bs}-s{splits}-{dt}",
                        "layout": layout,
                        "heads": h,
                        "kv_heads": kvh,
                        "head_size": hs,
                        "block_size": bs,
                        "splits": splits,
                        "dtype": dt,
                        # decode rows of several lengths (one a single token, one exactly two
                        # blocks) and one prefill row (torch path through the dispatcher)
                        "query_lens": [1, 1, 1, 4, 1],
                        "ctx_lens": [0, 2 * bs - 1, 3 * bs + 5, 20, 7 * bs + 3],
                    }
                )
    # long decode rows: many splits, blocks per split > 1, uneven last split
    for dt in dtypes:
        out.append(
            {"id": f"long-splits-{dt}", "layout": "cpu", "heads": 4, "kv_heads": 2,
             "head_size": 64, "block_size": 16, "splits": 5, "dtype": dt,
             "query_lens": [1, 1], "ctx_lens": [300, 57]}
        )  # fmt: skip
    return out


SPECIAL = (
    "masked-slots-never-read",
    "fully-masked-rows-zero",
    "no-record-is-plain-causal",
    "empty-rows",
    "default-splits",
)


def _run() -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from tests.support.masked_attention_cases import dense_reference, make_case, rel_err
    from vllm_adaptive.kernels import triton_masked_attention as tm
    from vllm_adaptive.kernels.masked_paged_attention import masked_paged_attention

    assert tm.INTERPRETED, "triton did not pick up TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    results: dict = {}

    def build(c: dict, seed: int, **kw):
        return make_case(
            seed,
            layout=c["layout"],
            dtype=getattr(torch, c["dtype"]),
            heads=c["heads"],
            kv_heads=c["kv_heads"],
            head_size=c["head_size"],
            block_size=c["block_size"],
            query_lens=tuple(c["query_lens"]),
            ctx_lens=tuple(c["ctx_lens"]),
            **kw,
        )

    def run_kernel(case, splits, **kw):
        out = torch.full_like(case.query, float("nan"))
        if splits is None:  # the dispatcher: decode rows -> kernel, others -> torch
            return tm.masked_attention(*case.args(), layout=case.layout, out=out, **kw)
        qsl = case.query_start_loc
        counts = (qsl[1:] - qsl[:-1]).tolist()
        dec = torch.tensor([r for r, n in enumerate(counts) if n == 1])
        rest = [r for r, n in enumerate(counts) if n > 1]
        tm.masked_decode_attention(
            *case.args(), dec, layout=case.layout, out=out, splits=splits, **kw
        )
        if rest:
            masked_paged_attention(*case.args(), layout=case.layout, out=out, rows=rest, **kw)
        return out

    for seed, c in enumerate(cases()):
        try:
            case = build(c, seed)
            y = run_kernel(case, c["splits"])
            ref = dense_reference(case)
            yt = masked_paged_attention(*case.args(), layout=case.layout)
            results[c["id"]] = {
                "err": rel_err(y, ref),
                "err_torch": float((y.double() - yt.double()).abs().max() / ref.abs().max()),
                "tol": TOL[c["dtype"]],
                "finite": bool(torch.isfinite(y).all()),
            }
        except Exception:
            results[c["id"]] = {"error": traceback.format_exc()}

    base = {"layout": "cpu", "heads": 9, "kv_heads": 3, "head_size": 64, "block_size": 16,
            "dtype": "bfloat16", "query_lens": [1, 1, 1], "ctx_lens": [40, 100, 9]}  # fmt: skip

    # NaN / inf in masked and unused slots, or finite garbage there: bit-identical outputs
    try:
        same = []
        for layout in ("cpu", "nhd"):
            for splits in (1, 3):
                c = {**base, "layout": layout}
                a = run_kernel(build(c, 7, poison=True), splits)
                b = run_kernel(build(c, 7, poison=True, stale=50.0), splits)
                d = run_kernel(build(c, 7, poison=False, stale=50.0), splits)
                same.append(
                    torch.equal(a, b) and torch.equal(a, d) and bool(torch.isfinite(a).all())
                )
        results["masked-slots-never-read"] = {"ok": all(same), "detail": same}
    except Exception:
        results["masked-slots-never-read"] = {"error": traceback.format_exc()}

    # mask_step_tokens with nothing written: every row fully masked -> zeros, not NaN
    try:
        ok = []
        for splits in (1, 3):
            case = build(base, 8, mask_step_tokens=True, record_mode="none_written")
            y = run_kernel(case, splits, mask_step_tokens=True)
            ok.append(bool((y == 0).all()))
        # and a random record under mask_step_tokens: some rows empty, the rest as the reference
        case = build(base, 9, mask_step_tokens=True)
        y = run_kernel(case, 3, mask_step_tokens=True)
        ref = dense_reference(case)
        ok.append(float((y.double() - ref).abs().max()) < 1e-2 * max(1.0, float(ref.abs().max())))
        results["fully-masked-rows-zero"] = {"ok": all(ok), "detail": ok}
    except Exception:
        results["fully-masked-rows-zero"] = {"error": traceback.format_exc()}

    # depth_record=None: plain causal paged attention (== a record with every layer written)
    try:
        case = build({**base, "dtype": "float32"}, 10, record_mode="full")
        y0 = run_kernel(case, 3)
        case.depth_record = None
        y1 = run_kernel(case, 3)
        err = float((y0 - y1).abs().max())
        results["no-record-is-plain-causal"] = {"ok": err < 1e-6, "detail": err}
    except Exception:
        results["no-record-is-plain-causal"] = {"error": traceback.format_exc()}

    try:
        case = build(base, 11)
        out = torch.full_like(case.query, 7.0)
        tm.masked_decode_attention(
            *case.args(), torch.zeros(0, dtype=torch.int32), layout="cpu", out=out
        )
        results["empty-rows"] = {"ok": bool((out == 7.0).all()), "detail": "untouched"}
    except Exception:
        results["empty-rows"] = {"error": traceback.format_exc()}

    try:
        s1 = tm.default_splits(1, 1, 512, "cpu")  # one long row: split (interpreter: 2 "SMs")
        s2 = tm.default_splits(64, 8, 512, "cpu")  # many rows: no split
        s3 = tm.default_splits(1, 1, 2, "cpu")  # short row: no split below 4 blocks
        results["default-splits"] = {"ok": s1 == 4 and s2 == 1 and s3 == 1, "detail": [s1, s2, s3]}
    except Exception:
        results["default-splits"] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    from tests.support.triton_interp_probe import interpreter_defect

    os.environ["TRITON_INTERPRET"] = "1"
    defect = interpreter_defect()
    res = {"skip": defect} if defect else _run()
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)
