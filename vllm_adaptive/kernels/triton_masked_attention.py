"""Triton decode kernel for paged attention with the per-slot depth mask.

Same semantics as :func:`vllm_adaptive.kernels.masked_paged_attention.masked_paged_attention`
(read its module doc for the mask rule and the cache layouts); this module only covers **decode
rows** (one query token per request), the case where a depth-adaptive step spends its attention
time on a GPU. Prefill rows (more than one query token) go to the torch implementation:
:func:`masked_attention` splits a mixed batch and runs both.

Kernel (flash-decoding with the mask folded into the loads):

- grid ``(decode rows, num_kv_heads, splits)``; a program owns one request, one KV head and a
  contiguous range of the request's KV blocks. It loads the ``G = num_heads / num_kv_heads``
  query heads that share the KV head as one ``[G_PAD, HEAD_PAD]`` tile (``G_PAD >= 16``, the
  smallest ``tl.dot`` tile; the padding rows are masked), so every K/V block is read once per KV
  head (GQA), not once per query head.
- per KV block: the block id from the block table, the depth record of its ``BLOCK`` slots
  (int16), ``visible = pos < seq_len & (pos == seq_len - 1 | record > layer)``; K (as a
  ``[HEAD, BLOCK]`` tile, any layout through its four strides) and V are loaded with ``visible``
  as the load mask, so **slots that are masked or past ``seq_len`` are never read** (poisoned
  memory there cannot matter) and block-table entries past the request's last block are never
  loaded. Scores ``q . K`` (``tl.dot``, fp32 accumulation), masked scores ``-inf``, online softmax
  in base 2 with a guard so a fully masked block (max ``-inf``) yields zero weight, not NaN.
- one split: the program writes ``acc / l`` (zero where ``l == 0``: a fully masked row). Several
  splits: each writes its ``(m, l, acc)`` to fp32 buffers and a second kernel combines them per
  (row, head); splits are chosen so that about two programs run per SM (``default_splits``).

Dots: bf16 / fp16 operands go to ``tl.dot`` as they are (``P`` is cast to V's dtype, as in
flash attention); fp32 runs ``input_precision="ieee"`` (no TF32). Under Triton's CPU interpreter
(``TRITON_INTERPRET=1`` set before triton is imported; the tests do so in a child process) the
operands are upcast to fp32 first: the interpreter's bf16 dot is wrong in Triton 3.9 (see
``triton_packed.py``).

Constraints (else :func:`masked_attention` uses the torch path): block size a power of two
>= 16, head size <= 256 (padded to a power of two >= 16), query / cache dtype fp16, bf16 or fp32.
Imports without triton (``TRITON_AVAILABLE`` False; :func:`masked_attention` then always runs
torch, :func:`masked_decode_attention` raises ``RuntimeError``).
"""

from __future__ import annotations

import torch

from vllm_adaptive.kernels.masked_paged_attention import (
    LAYOUT_CPU,
    logical_kv,
    masked_paged_attention,
)

try:  # guarded: the package must import where triton is absent (CPU-only installs)
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:  # ImportError, or a triton that fails to initialise
    triton = None
    tl = None
    TRITON_AVAILABLE = False

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 64
MIN_BLOCKS_PER_SPLIT = 4
MAX_HEAD = 256
LOG2E = 1.4426950408889634


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(1, n) - 1).bit_length())


if TRITON_AVAILABLE:

    @triton.jit
    def _masked_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        rec_ptr,
        bt_ptr,
        seq_ptr,
        qloc_ptr,
        req_ptr,
        o_ptr,
        ml_ptr,
        acc_ptr,
        layer,
        qk_scale,
        BLOCKS_PER_SPLIT,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vs,
        stride_vd,
        stride_bt,
        stride_ot,
        stride_oh,
        NUM_HEADS: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        HEAD: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_REC: tl.constexpr,
        STEP_VISIBLE: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        r = tl.load(req_ptr + pid_r).to(tl.int64)
        tok = tl.load(qloc_ptr + r).to(tl.int64)
        seq_len = tl.load(seq_ptr + r).to(tl.int32)
        nblocks = tl.cdiv(seq_len, BLOCK)
        b_start = sp * BLOCKS_PER_SPLIT
        b_end = tl.minimum(b_start + BLOCKS_PER_SPLIT, nblocks)

        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, HEAD_PAD)
        offs_s = tl.arange(0, BLOCK)
        g_mask = offs_g < G
        d_mask = offs_d < HEAD
        heads = kvh * G + offs_g
        q = tl.load(
            q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HEAD_PAD], tl.float32)
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        for b in range(b_start, b_end):
            blk = tl.load(bt_ptr + r * stride_bt + b).to(tl.int64)
            pos = b * BLOCK + offs_s
            vis = pos < seq_len
            if HAS_REC:
                rec = tl.load(rec_ptr + blk * BLOCK + offs_s, mask=vis, other=0).to(tl.int32)
                if STEP_VISIBLE:
                    vis = vis & ((pos >= seq_len - 1) | (rec > layer))
                else:
                    vis = vis & (rec > layer)
            kt = tl.load(
                k_base
                + blk * stride_kb
                + offs_s[None, :] * stride_ks
                + offs_d[:, None] * stride_kd,
                mask=d_mask[:, None] & vis[None, :],
                other=0.0,
            )
            if UPCAST:
                s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(vis[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(
                v_base
                + blk * stride_vb
                + offs_s[:, None] * stride_vs
                + offs_d[None, :] * stride_vd,
                mask=vis[:, None] & d_mask[None, :],
                other=0.0,
            )
            if UPCAST:
                pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(vt.dtype), vt)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if SPLITS == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                o_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                o.to(o_ptr.dtype.element_ty),
                mask=g_mask[:, None] & d_mask[None, :],
            )
        else:
            # partials: ml [rows, NUM_HEADS, SPLITS, 2], acc [rows, NUM_HEADS, SPLITS, HEAD_PAD]
            row_head = pid_r * NUM_HEADS + heads
            ml = ml_ptr + (row_head * SPLITS + sp) * 2
            tl.store(ml, m_i, mask=g_mask)
            tl.store(ml + 1, l_i, mask=g_mask)
            a = acc_ptr + ((row_head * SPLITS + sp) * HEAD_PAD)[:, None] + offs_d[None, :]
            tl.store(a, acc, mask=g_mask[:, None])

    @triton.jit
    def _combine_kernel(
        ml_ptr,
        acc_ptr,
        qloc_ptr,
        req_ptr,
        o_ptr,
        stride_ot,
        stride_oh,
        NUM_HEADS: tl.constexpr,
        HEAD: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.load(req_ptr + pid_r).to(tl.int64)
        tok = tl.load(qloc_ptr + r).to(tl.int64)
        offs_sp = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_PAD)
        sp_mask = offs_sp < SPLITS
        base = (pid_r * NUM_HEADS + h) * SPLITS + offs_sp
        m = tl.load(ml_ptr + base * 2, mask=sp_mask, other=float("-inf"))
        lsum = tl.load(ml_ptr + base * 2 + 1, mask=sp_mask, other=0.0)
        acc = tl.load(
            acc_ptr + base[:, None] * HEAD_PAD + offs_d[None, :], mask=sp_mask[:, None], other=0.0
        )
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.math.exp2(m - m_safe)  # empty or fully masked splits: m = -inf -> 0
        total = tl.sum(lsum * w, 0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(
            o_ptr + tok * stride_ot + h * stride_oh + offs_d,
            o.to(o_ptr.dtype.element_ty),
            mask=offs_d < HEAD,
        )

    INTERPRETED = type(_masked_decode_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # interpreter: small, so that the default splits stay cheap but still > 1


def default_splits(num_rows: int, num_kv_heads: int, max_blocks: int, device) -> int:
    """KV splits per (row, KV head): about two programs per SM, at least
    ``MIN_BLOCKS_PER_SPLIT`` blocks per split, at most ``MAX_SPLITS``."""
    target = 2 * _sm_count(torch.device(device))
    want = _cdiv(target, max(1, num_rows * num_kv_heads))
    return max(1, min(MAX_SPLITS, want, _cdiv(max_blocks, MIN_BLOCKS_PER_SPLIT)))


def triton_usable(query: torch.Tensor, block_size: int, head_size: int) -> bool:
    """Whether :func:`masked_decode_attention` can run on these tensors."""
    if not TRITON_AVAILABLE:
        return False
    on_device = query.device.type == "cuda" or (INTERPRETED and query.device.type == "cpu")
    pow2 = block_size >= 16 and block_size & (block_size - 1) == 0
    return on_device and pow2 and head_size <= MAX_HEAD and query.dtype in DTYPES


def masked_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    depth_record: torch.Tensor | None,
    layer: int,
    rows: torch.Tensor,
    *,
    layout: str = LAYOUT_CPU,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    splits: int | None = None,
    mask_step_tokens: bool = False,
) -> torch.Tensor:
    """The Triton kernel on decode requests ``rows`` (int tensor; each must have exactly one
    query token, at ``query_start_loc[row]``; not checked on the device). Writes those tokens
    of ``out`` (allocated like ``query`` when None) and returns ``out``. ``max_seq_len``: an
    upper bound on ``seq_lens[rows]`` (computed, with a device sync, when None)."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed: the Triton kernels cannot run")
    k, v = logical_kv(key_cache, value_cache, layout)
    nb, nkv, bs, hs = k.shape
    nh = query.shape[1]
    if not triton_usable(query, bs, hs):
        raise RuntimeError(
            f"the Triton kernel needs a CUDA query (or CPU with TRITON_INTERPRET=1), a "
            f"power-of-two block size >= 16 and head size <= {MAX_HEAD}; "
            f"got {query.device}, block {bs}, head {hs}, {query.dtype}"
        )
    if nh % nkv or query.shape[2] != hs:
        raise ValueError(f"query {tuple(query.shape)} does not fit the cache {tuple(k.shape)}")
    if depth_record is not None and depth_record.numel() != nb * bs:
        raise ValueError(f"depth_record has {depth_record.numel()} slots, the cache {nb * bs}")
    if query.stride(2) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if out.stride(2) != 1:
        raise ValueError("out must be contiguous along the head dimension")
    rows = rows.to(device=query.device, dtype=torch.int32)
    n = rows.numel()
    if n == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens[rows.long()].max())
    max_blocks = _cdiv(max_seq_len, bs)
    s = splits or default_splits(n, nkv, max_blocks, query.device)
    per_split = _cdiv(max_blocks, max(1, min(s, max_blocks)))
    s = _cdiv(max_blocks, per_split)  # no empty splits for the longest row
    g = nh // nkv
    head_pad = _pow2(hs)
    upcast = query.dtype == torch.float32 or INTERPRETED
    rec = depth_record if depth_record is not None else seq_lens
    if s > 1:
        ml = torch.empty(n, nh, s, 2, dtype=torch.float32, device=query.device)
        acc = torch.empty(n, nh, s, head_pad, dtype=torch.float32, device=query.device)
    else:
        ml = acc = out  # unused
    _masked_decode_kernel[(n, nkv, s)](
        query,
        k,
        v,
        rec,
        block_table,
        seq_lens,
        query_start_loc,
        rows,
        out,
        ml,
        acc,
        int(layer),
        float(scale) * LOG2E,
        per_split,
        query.stride(0),
        query.stride(1),
        *k.stride(),
        *v.stride(),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=nh,
        G=g,
        G_PAD=_pow2(g),
        HEAD=hs,
        HEAD_PAD=head_pad,
        BLOCK=bs,
        SPLITS=s,
        HAS_REC=depth_record is not None,
        STEP_VISIBLE=not mask_step_tokens,
        UPCAST=upcast,
        num_warps=4,
    )
    if s > 1:
        _combine_kernel[(n, nh)](
            ml,
            acc,
            query_start_loc,
            rows,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=nh,
            HEAD=hs,
            HEAD_PAD=head_pad,
            SPLITS=s,
            SPLITS_PAD=_pow2(s, 2),
            num_warps=4,
        )
    return out


def masked_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    depth_record: torch.Tensor | None = None,
    layer: int = 0,
    *,
    layout: str = LAYOUT_CPU,
    out: torch.Tensor | None = None,
    mask_step_tokens: bool = False,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Dispatcher: decode rows through the Triton kernel where it can run, every other row
    (prefill, or everything without a GPU) through the torch implementation."""
    k, _ = logical_kv(key_cache, value_cache, layout)
    if out is None:
        out = torch.empty_like(query)
    if use_triton is None:
        use_triton = triton_usable(query, k.shape[2], k.shape[3])
    common = dict(layout=layout, out=out, mask_step_tokens=mask_step_tokens)
    if not use_triton:
        return masked_paged_attention(
            query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale,
            depth_record, layer, **common,
        )  # fmt: skip
    counts = (query_start_loc[1:] - query_start_loc[:-1]).cpu()
    decode = (counts == 1).nonzero().flatten()
    other = ((counts > 1).nonzero().flatten()).tolist()
    if decode.numel():
        masked_decode_attention(
            query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale,
            depth_record, layer, decode, **common,
        )  # fmt: skip
    if other:
        masked_paged_attention(
            query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale,
            depth_record, layer, rows=other, **common,
        )  # fmt: skip
    return out


__all__ = [
    "INTERPRETED",
    "TRITON_AVAILABLE",
    "default_splits",
    "masked_attention",
    "masked_decode_attention",
    "triton_usable",
]
