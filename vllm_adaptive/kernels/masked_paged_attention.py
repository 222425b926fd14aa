"""Causal paged attention with a per-slot depth mask (QuickSilver KV skipping, D-LLM "KV mask").

Under KV skipping a token that stops after ``D`` layers writes K/V at layers ``0 .. D-1`` only;
the depth record (``vllm_adaptive/depth/record.py``) holds that ``D`` for every slot of the paged
KV cache. Attention at layer ``l`` (0-based) must then leave out every slot whose K/V at ``l`` were
never written: its memory holds a stale token's K/V, or whatever the allocator left there.

**The mask rule.** For request ``r`` with ``seq_len`` tokens of which the last ``query_len`` are
this step's (``ctx = seq_len - query_len`` tokens were cached before the step), a query at
position ``p`` attends to key position ``j`` at layer ``l`` iff

    j <= p   and   ( j >= ctx   or   depth_record[slot(j)] > l )

i.e. cached keys are visible iff their record says layer ``l`` was written, and this step's own keys
(``ctx <= j <= p``) are visible causally whatever their record says. That is consistent with how the
record is maintained: it is committed at the *end* of a step, for every slot written in it, so
during the step the record of this step's slots is stale (0 for a fresh slot, or the depth of a
token that occupied the slot earlier) and must not be read. This step's keys are present at layer
``l`` whenever the query runs layer ``l``, because the depth runtime peels whole requests
(``engine/attention_metadata.py``): a request's tokens of one step run the same layers, and the
attention layer writes this step's K/V (``do_kv_cache_update``) before attending. Token-granular
exits *inside* a prefill (QuickSilver halting per token) would break that premise and need a
per-token "still running" flag for this step's keys; the runtime does not do that, so neither does
this function.

``mask_step_tokens=True`` applies the record to this step's keys too (for a caller that commits
planned depths before the step); the query's own slot is then masked when its record is ``<= l``.

**Fully masked rows.** Under the default rule a query always sees its own key, so no row is ever
fully masked. With ``mask_step_tokens=True`` (or a record that claims fewer layers than the query
runs) it can happen; such a row's output is defined as **zeros** (no key contributes; the softmax
of an empty set is taken as the zero vector rather than NaN).

**Masked slots are excluded, not down-weighted:** their scores are replaced by ``-inf`` (so a
NaN / inf K in them cannot leak) and their V rows are zeroed before ``P @ V`` (so ``0 * NaN`` cannot
leak). Slots past ``seq_len`` in the last block and block-table entries past the request's blocks
are treated the same way. The Triton kernel (``triton_masked_attention.py``) goes further and
never loads them.

**Cache layouts** (``layout=``):

- ``"cpu"``: vLLM's CPU backend (CPU_ATTN) with the ``vec`` / ``vec16`` ISAs (any x86 without AMX,
  and whenever the block size is not a multiple of 32). The per-layer cache is
  ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; ``cpu_attn.py`` views it as
  ``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and chunks it along dim 2, so per
  (block, kv head) the memory holds ``block_size * head_size`` K values and then as many V values.
  Measured here (``cpu_attn_reshape_and_cache`` on known data): **K is stored transposed**,
  ``[head_size, block_size]`` (element ``(slot o, dim d)`` at ``d * block_size + o``), V plainly
  ``[block_size, head_size]``. Pass the two chunks (:func:`split_cpu_kv_cache`). The ``amx``
  (bf16 on AMX CPUs) and ``neon`` ISAs pack K differently; they are not supported here.
- ``"nhd"``: separate K and V caches ``[num_blocks, block_size, num_kv_heads, head_size]`` (the
  layout of vLLM's GPU flash-attention backends after ``kv_cache.unbind(0)``), used on GPUs.

Internally both become strided views of logical shape ``[num_blocks, num_kv_heads, block_size,
head_size]`` (:func:`logical_kv`); nothing is copied until blocks are gathered.

**Computation.** Queries and gathered K/V go to float32 (scores, softmax and ``P @ V`` in fp32;
the output is cast to the query dtype). Decode rows (one query token) are processed together,
sorted by length and grouped so that padding stays small; a prefill row is processed alone, with
its queries in chunks (each chunk only reads the keys up to its last position). Per request or
per group there is a fixed number of torch ops; nothing loops over tokens in Python. On the CPU
layout, decode rows go to the C++ kernel instead (``kernels/native.py``; a step whose rows are
all decode rows goes there without any of the above). Not supported: ALiBi, soft-capping, sinks,
fp8 caches, encoder attention.

Over 400 lines: one kernel (the decode groups and the chunked prefill share the cache
gather and the mask), with the stock CPU op it is checked and timed against.
"""

from __future__ import annotations

import torch

from vllm_adaptive.kernels.native import masked_decode_op, masked_prefill_op, why_unavailable

LAYOUT_CPU = "cpu"
LAYOUT_NHD = "nhd"
LAYOUTS = (LAYOUT_CPU, LAYOUT_NHD)

# elements of one gathered K (or V) group / one score chunk, float32: 16M elements = 64 MiB
DEFAULT_MAX_ELEMS = 1 << 24
# decode: K + V elements gathered per step of the online softmax (float32: 4 MiB); 2**19 to
# 2**21 measured alike on this CPU, smaller chunks pay per-op overhead
DEFAULT_CHUNK_ELEMS = 1 << 20
# what the C++ prefill kernel is built for (other shapes take the torch path)
NATIVE_PREFILL_HEAD_SIZES = (64, 128, 256)
NATIVE_PREFILL_DTYPES = (torch.float32, torch.bfloat16)
NATIVE_PREFILL_MAX_BLOCK = 256


def split_cpu_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)`` of a CPU_ATTN layer cache, exactly as ``cpu_attn.py`` makes
    them: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` viewed as
    ``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and chunked along dim 2."""
    nb, nkv, bs, two_hs = kv_cache.shape
    kv = kv_cache.view(nb, nkv, 2 * bs, two_hs // 2)
    k, v = kv.chunk(2, dim=2)
    return k, v


def logical_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided views ``[num_blocks, num_kv_heads, block_size, head_size]`` of K and V (no copy)."""
    if layout == LAYOUT_CPU:
        nb, nkv, bs, hs = key_cache.shape
        if value_cache.shape != key_cache.shape:
            raise ValueError(f"K {tuple(key_cache.shape)} and V {tuple(value_cache.shape)} differ")
        for name, t in (("key", key_cache), ("value", value_cache)):
            if t.stride(3) != 1 or t.stride(2) != hs:
                raise ValueError(
                    f"{name}_cache is not a chunk of a CPU_ATTN cache (strides {t.stride()}); "
                    "use split_cpu_kv_cache"
                )
        k = torch.as_strided(
            key_cache,
            (nb, nkv, bs, hs),
            (key_cache.stride(0), key_cache.stride(1), 1, bs),
            key_cache.storage_offset(),
        )
        return k, value_cache
    if layout == LAYOUT_NHD:
        if value_cache.shape != key_cache.shape or key_cache.dim() != 4:
            raise ValueError(
                f"nhd caches must both be [num_blocks, block_size, num_kv_heads, head_size]: "
                f"K {tuple(key_cache.shape)}, V {tuple(value_cache.shape)}"
            )
        return key_cache.permute(0, 2, 1, 3), value_cache.permute(0, 2, 1, 3)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _raw_cpu_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, num_kv_heads, 2 * block_size * head_size]``: per (block, kv head) the K
    values then the V values, as one contiguous run (the layout ``split_cpu_kv_cache`` chunks)."""
    nb, nkv, bs, hs = key_cache.shape
    if (
        value_cache.storage_offset() != key_cache.storage_offset() + bs * hs
        or value_cache.stride() != key_cache.stride()
        or value_cache.untyped_storage().data_ptr() != key_cache.untyped_storage().data_ptr()
    ):
        raise ValueError("key_cache and value_cache must be the two chunks of one CPU_ATTN cache")
    return torch.as_strided(
        key_cache,
        (nb, nkv, 2 * bs * hs),
        (key_cache.stride(0), key_cache.stride(1), 1),
        key_cache.storage_offset(),
    )


_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer reused across calls (one per name, dtype and device; grows, never
    shrinks). Gathering decode chunks into fresh tensors costs page faults on every call
    (measured here: a 2 MiB fresh ``index_select`` 0.2-0.6 ms, into a reused buffer 0.07 ms).
    Not thread-safe: vLLM runs one forward at a time per worker process."""
    key = (name, dtype, device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf[:numel]


def _gather(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: str,
    block_ids: torch.Tensor,
    reuse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K^T ``[B, nblk, KVH, D, BS]`` and V ``[B, nblk, KVH, BS, D]`` (float32, a copy the
    caller may overwrite) of blocks ``block_ids`` ``[B, nblk]``. On the CPU layout this is one
    contiguous copy per block (K^T and V of every KV head together). ``reuse``: into the
    workspace (valid until the next reusing call)."""
    b, nblk = block_ids.shape
    flat = block_ids.reshape(-1)
    dev = key_cache.device

    def take(src: torch.Tensor, name: str) -> torch.Tensor:
        shape = (flat.numel(), *src.shape[1:])
        if not reuse:
            return src.index_select(0, flat).float()
        n = flat.numel() * src[0].numel()
        buf = _workspace(name, n, src.dtype, dev).view(shape)
        torch.index_select(src, 0, flat, out=buf)
        if src.dtype == torch.float32:
            return buf
        return _workspace(name + "-f32", n, torch.float32, dev).view(shape).copy_(buf)

    if layout == LAYOUT_CPU:
        nb, nkv, bs, hs = key_cache.shape
        raw = take(_raw_cpu_blocks(key_cache, value_cache), "kv")
        raw = raw.view(b, nblk, nkv, 2 * bs * hs)
        kb = raw[..., : bs * hs].unflatten(-1, (hs, bs))
        vb = raw[..., bs * hs :].unflatten(-1, (bs, hs))
        return kb, vb
    nb, bs, nkv, hs = key_cache.shape
    kb = take(key_cache, "k").view(b, nblk, bs, nkv, hs)
    vb = take(value_cache, "v").view(b, nblk, bs, nkv, hs)
    return kb.permute(0, 1, 3, 4, 2), vb.permute(0, 1, 3, 2, 4)


def _zero_masked_v(vb: torch.Tensor, key_ok: torch.Tensor) -> None:
    """V rows of keys nobody may see set to 0 in the gathered copy ``[B, nblk, KVH, BS, D]``:
    ``0 * NaN`` would leak through ``P @ V`` (their probabilities are exactly 0 already). Only
    the masked rows are written (an index_put; a broadcast ``masked_fill_`` over the whole
    chunk measured 1.2-2x slower, with none or half of the slots masked)."""
    b, n, o = (~key_ok).nonzero(as_tuple=True)
    if b.numel():
        vb[b, n, :, o, :] = 0.0


def _masked_softmax_(s: torch.Tensor, vis: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """In place: ``s`` -> unnormalised ``exp(s - max)`` with masked entries exactly 0; returns
    the denominator (keepdim), 1 where a row has nothing visible (so that row comes out 0)."""
    s.masked_fill_(~vis, float("-inf"))
    m = s.amax(dim=dims, keepdim=True)
    m.masked_fill_(m == float("-inf"), 0.0)
    s.sub_(m).exp_()
    denom = s.sum(dim=dims, keepdim=True)
    return denom.masked_fill_(denom == 0, 1.0)


def _decode_core(q, gather, nblk, key_ok, scale, chunk_blocks):
    """Decode rows: ``q`` float32 ``[B, H, D]``; ``key_ok`` ``[B, nblk, BS]``; ``gather(c0, c1)``
    returns K^T / V of blocks ``c0 .. c1`` (see :func:`_gather`). Blocks are processed
    ``chunk_blocks`` at a time with an online softmax (flash-decoding), so the gathered copy
    stays cache-sized. Scores are block-wise ``[B, blocks, KVH, G, BS]``: K^T and V are used as
    they were gathered (batched products, no transposed copies)."""
    b, nh, d = q.shape
    q5 = None
    m_run = l_run = acc = None
    for c0 in range(0, nblk, chunk_blocks):
        c1 = min(nblk, c0 + chunk_blocks)
        kb, vb = gather(c0, c1)
        if q5 is None:
            nkv = kb.shape[2]
            q5 = q.view(b, 1, nkv, nh // nkv, d)
        ok = key_ok[:, c0:c1]
        s = torch.matmul(q5, kb).mul_(scale)
        s.masked_fill_(~ok[:, :, None, None, :], float("-inf"))
        m_new = s.amax(dim=(1, 4), keepdim=True)
        if m_run is not None:
            m_new = torch.maximum(m_new, m_run)
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        s.sub_(m_safe).exp_()  # masked entries: exp(-inf) = 0
        _zero_masked_v(vb, ok)
        part = torch.matmul(s, vb).sum(1)  # [B, KVH, G, D]
        lsum = s.sum(dim=(1, 4), keepdim=True)
        if m_run is None:
            acc, l_run = part, lsum
        else:
            alpha = torch.exp(m_run - m_safe)  # a row with nothing visible so far: exp(-inf) = 0
            acc = acc.mul_(alpha.squeeze(1)).add_(part)
            l_run = l_run.mul_(alpha).add_(lsum)
        m_run = m_new
    denom = l_run.masked_fill(l_run == 0, 1.0).squeeze(1)  # fully masked rows come out 0
    return acc.div_(denom).view(b, nh, d)


def _prefill_core(query, kb, vb, key_ok, ctx, scale, chunk, out, qpos=None, window=-1):
    """One request's ``query`` float32 ``[Q, H, D]`` at positions ``ctx ..`` (or at ``qpos``
    ``[Q]``, ascending, when given: token fusion keeps queries that are not contiguous); keys
    as full matrices (one copy of K^T and V per request), queries in chunks of ``chunk``."""
    nq, nh, d = query.shape
    _, nblk, nkv, _, bs = kb.shape
    g = nh // nkv
    length = nblk * bs
    _zero_masked_v(vb, key_ok)
    kf = kb[0].permute(1, 2, 0, 3).reshape(nkv, d, length)
    vf = vb[0].permute(1, 0, 2, 3).reshape(nkv, length, d)
    ok = key_ok.reshape(length)
    j = torch.arange(length, device=query.device)
    for c0 in range(0, nq, chunk):
        c1 = min(nq, c0 + chunk)
        if qpos is None:
            pos = torch.arange(ctx + c0, ctx + c1, device=query.device)
        else:
            pos = qpos[c0:c1]
        kv_len = int(pos[-1]) + 1  # keys past the chunk's last query are causally invisible
        q = query[c0:c1].view(c1 - c0, nkv, g, d).transpose(0, 1).reshape(nkv, -1, d)
        s = torch.matmul(q, kf[:, :, :kv_len]).mul_(scale).view(nkv, c1 - c0, g, kv_len)
        vis = ok[None, :kv_len] & (j[None, :kv_len] <= pos[:, None])  # [Qc, kv_len]
        if window > 0:
            vis &= j[None, :kv_len] > (pos - window)[:, None]
        denom = _masked_softmax_(s, vis[None, :, None, :], (3,))
        o = torch.matmul(s.view(nkv, -1, kv_len), vf[:, :kv_len]).view(nkv, c1 - c0, g, d)
        o.div_(denom)
        out[c0:c1] = o.permute(1, 0, 2, 3).reshape(c1 - c0, nh, d).to(out.dtype)


def _check(query, k, block_table, seq_lens, query_start_loc, depth_record) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {query.shape}")
    nb, nkv, bs, hs = k.shape
    if query.shape[2] != hs:
        raise ValueError(f"query head size {query.shape[2]} != cache head size {hs}")
    if query.shape[1] % nkv:
        raise ValueError(f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {nkv}")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_table.shape[0] < len(seq_lens):
        raise ValueError(
            "query_start_loc must have num_reqs + 1 entries, block_table num_reqs rows"
        )
    if depth_record is not None and depth_record.numel() != nb * bs:
        raise ValueError(
            f"depth_record has {depth_record.numel()} slots, the cache {nb} x {bs} = {nb * bs}"
        )


def _native_buffers(query, out, depth_record):
    """What the C++ kernels take: a contiguous float32 query, a float32 output (``out`` itself
    where it is one: ``direct``), an int16 record."""
    q = (query if query.dtype == torch.float32 else query.float()).contiguous()
    if out is None:
        out = torch.empty_like(query)
    direct = out.dtype == torch.float32 and out.is_contiguous()
    o = out if direct else torch.empty(q.shape, dtype=torch.float32)
    record = depth_record
    if record is not None and (record.dtype != torch.int16 or not record.is_contiguous()):
        record = record.to(torch.int16).contiguous()
    return q, out, o, direct, record


def _native_decode(
    op, query, key_cache, value_cache, seq_lens, block_table, scale, depth_record, layer, out,
    sliding_window, mask_step_tokens,
) -> torch.Tensor:  # fmt: skip
    """Every row one decode token: the C++ kernel on the cache in place (it checks the shapes,
    the block ids and the lengths itself), writing into ``out`` where it is float32 already."""
    q, out, o, direct, record = _native_buffers(query, out, depth_record)
    op(
        o,
        q,
        key_cache,
        value_cache,
        seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32),
        block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32),
        record,
        layer,
        scale,
        sliding_window,
        mask_step_tokens,
    )
    if not direct:
        out.copy_(o)
    return out


def _native_prefill(
    op, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale,
    depth_record, layer, out, rows, query_positions, sliding_window, mask_step_tokens,
) -> torch.Tensor:  # fmt: skip
    """Any rows, prefill ones included: the C++ prefill kernel on the cache in place (tiles of
    64 queries share each K/V block; it checks shapes, block ids and positions itself)."""
    q, out, o, direct, record = _native_buffers(query, out, depth_record)

    def int32(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(torch.int32).contiguous()

    op(
        o,
        q,
        key_cache,
        value_cache,
        int32(query_start_loc),
        int32(seq_lens),
        block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32),
        int32(query_positions),
        torch.tensor(rows, dtype=torch.int32),
        record,
        layer,
        scale,
        sliding_window,
        mask_step_tokens,
    )
    if not direct and len(rows) == seq_lens.shape[0]:
        out.copy_(o)
    elif not direct:
        qsl = query_start_loc.tolist()
        for r in rows:
            out[qsl[r] : qsl[r + 1]] = o[qsl[r] : qsl[r + 1]]
    return out


def masked_paged_attention(
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
    rows: list[int] | None = None,
    mask_step_tokens: bool = False,
    query_positions: torch.Tensor | None = None,
    sliding_window: int = -1,
    max_elems: int = DEFAULT_MAX_ELEMS,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    native: bool | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``query`` ``[num_tokens, num_heads, head_size]`` with the depth
    mask of layer ``layer`` (see the module doc for the rule and the layouts).

    ``query_start_loc`` ``[R + 1]``, ``seq_lens`` ``[R]`` (cached + this step's tokens) and
    ``block_table`` ``[R, max_blocks]`` are vLLM's attention metadata. ``depth_record``: int
    ``[num_blocks * block_size]`` indexed by slot (``block * block_size + offset``), or None for
    plain causal paged attention. ``rows``: compute only these requests (the other rows of
    ``out`` are left as they are). Returns ``out`` (allocated when not given).

    ``query_positions`` ``[num_tokens]``: each query's position, for steps whose queries are not
    the last ``query_len`` positions of their request (token fusion runs a subset of a prompt's
    rows, ascending per request; a request's last query must still be at ``seq_len - 1``). This
    step's keys cannot be told from cached ones then, so it needs ``mask_step_tokens=True`` and a
    record that already holds this step's slots (the runtime's provisional record).

    ``sliding_window`` ``W > 0``: a query at position ``q`` sees keys at ``q - W + 1 .. q`` only,
    as vLLM's CPU attention op does with the same window (Gemma 3's local layers); -1: no window.

    ``native``: rows of the CPU layout go to the C++ kernels (``kernels/native.py``) when they
    are built (None, the default), always (True: an error where they cannot run) or never
    (False: the torch path). Decode rows take the decode kernel; a step with prefill rows takes
    the prefill kernel for every row where its shape is built (head size 64 / 128 / 256, block
    size a multiple of 16 up to 256, float32 or bfloat16 cache), else the torch path for them.
    """
    if sliding_window == 0 or sliding_window < -1:
        raise ValueError(f"sliding_window must be -1 (none) or positive, got {sliding_window}")
    if query_positions is not None:
        if not mask_step_tokens or depth_record is None:
            raise ValueError(
                "query_positions needs depth_record and mask_step_tokens=True (this step's keys "
                "are masked through the record when queries are not contiguous)"
            )
        if query_positions.shape != (query.shape[0],):
            raise ValueError(
                f"query_positions must be [{query.shape[0]}], got {tuple(query_positions.shape)}"
            )
    if (
        native is not False
        and layout == LAYOUT_CPU
        and rows is None
        and query_positions is None
        and query.device.type == "cpu"
        and query.dim() == 3
        and query.shape[0] == seq_lens.shape[0]  # one query token per request: all decode
    ):
        op = masked_decode_op()
        if op is not None:  # the hot path of the masked backend: straight to the C++ kernel
            return _native_decode(
                op, query, key_cache, value_cache, seq_lens, block_table, scale, depth_record,
                layer, out, sliding_window, mask_step_tokens,
            )  # fmt: skip
    k, _ = logical_kv(key_cache, value_cache, layout)
    _check(query, k, block_table, seq_lens, query_start_loc, depth_record)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    rows = list(range(len(lens))) if rows is None else list(rows)
    for r in rows:
        if qsl[r + 1] - qsl[r] > lens[r]:
            raise ValueError(
                f"request {r}: {qsl[r + 1] - qsl[r]} query tokens but seq_len {lens[r]}"
            )
    if (
        native is not False
        and layout == LAYOUT_CPU
        and query.device.type == "cpu"
        and query.shape[2] in NATIVE_PREFILL_HEAD_SIZES
        and key_cache.dtype in NATIVE_PREFILL_DTYPES
        and key_cache.shape[2] % 16 == 0
        and key_cache.shape[2] <= NATIVE_PREFILL_MAX_BLOCK
    ):
        op = masked_prefill_op()
        if op is None and native:
            raise RuntimeError(
                f"the native masked prefill kernel is unavailable: {why_unavailable()}"
            )
        if op is not None:  # prefill and mixed steps: every row on the C++ prefill kernel
            return _native_prefill(
                op, query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
                scale, depth_record, layer, out, rows, query_positions, sliding_window,
                mask_step_tokens,
            )  # fmt: skip
    nb, nkv, bs, hs = k.shape
    nh = query.shape[1]
    if out is None:
        out = torch.empty_like(query)
    dev = query.device
    rec2d = None if depth_record is None else depth_record.view(nb, bs)
    decode, prefill = [], []
    for r in rows:
        n = qsl[r + 1] - qsl[r]
        if n == 1:
            decode.append(r)
        elif n > 1:
            prefill.append(r)

    def blocks_of(rs: list[int], nblk: int) -> torch.Tensor:
        idx = torch.tensor(rs, device=block_table.device)
        ids = block_table[idx, :nblk].long()
        need = torch.tensor([-(-lens[r] // bs) for r in rs], device=ids.device)
        cols = torch.arange(nblk, device=ids.device)
        return torch.where(cols[None, :] < need[:, None], ids, 0).to(dev)  # no stray block ids

    def key_mask(ids: torch.Tensor, seq: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """[B, nblk, BS]: keys that exist and whose K/V at ``layer`` were written."""
        j = torch.arange(ids.shape[1] * bs, device=dev).view(1, -1, bs)
        ok = j < seq[:, None, None]
        if rec2d is not None:
            written = rec2d[ids] > layer
            ok &= written if mask_step_tokens else (written | (j >= ctx[:, None, None]))
        return ok

    if decode and native is not False and layout == LAYOUT_CPU and dev.type == "cpu":
        op = masked_decode_op()
        if op is None and native:
            raise RuntimeError(
                f"the native masked decode kernel is unavailable: {why_unavailable()}"
            )
        if op is not None:
            idx = torch.tensor(decode)
            tok = torch.tensor([qsl[r] for r in decode])
            out[tok] = _native_decode(
                op, query[tok], key_cache, value_cache, seq_lens[idx].contiguous(),
                block_table[idx], scale, depth_record, layer, None, sliding_window,
                mask_step_tokens,
            )  # fmt: skip
            decode = []

    # decode rows: sorted by length, grouped while padding stays under 2x and memory bounded
    decode.sort(key=lambda r: lens[r])
    per_block = 2 * nkv * bs * hs
    groups: list[list[int]] = []
    for r in decode:
        nblk = -(-lens[r] // bs)
        if groups:
            grp = groups[-1]
            first = -(-lens[grp[0]] // bs)
            if nblk <= 2 * first:
                grp.append(r)
                continue
        groups.append([r])
    for grp in groups:
        ids = blocks_of(grp, -(-max(lens[r] for r in grp) // bs))
        seq = torch.tensor([lens[r] for r in grp], device=dev)
        tok = torch.tensor([qsl[r] for r in grp], device=dev)

        def gather(c0: int, c1: int, ids: torch.Tensor = ids):
            return _gather(key_cache, value_cache, layout, ids[:, c0:c1], reuse=True)

        chunk = max(1, chunk_elems // (len(grp) * per_block))
        ok = key_mask(ids, seq, seq - 1)
        if sliding_window > 0:  # the query sits at seq - 1
            j = torch.arange(ids.shape[1] * bs, device=dev).view(1, -1, bs)
            ok &= j >= (seq - sliding_window)[:, None, None]
        o = _decode_core(query[tok].float(), gather, ids.shape[1], ok, scale, chunk)
        out[tok] = o.to(out.dtype)

    for r in prefill:
        n, seq_len = qsl[r + 1] - qsl[r], lens[r]
        ids = blocks_of([r], -(-seq_len // bs))
        kb, vb = _gather(key_cache, value_cache, layout, ids)
        ok = key_mask(
            ids, torch.tensor([seq_len], device=dev), torch.tensor([seq_len - n], device=dev)
        )
        chunk = max(1, max_elems // max(1, nh * seq_len))
        q = query[qsl[r] : qsl[r + 1]].float()
        qpos = None if query_positions is None else query_positions[qsl[r] : qsl[r + 1]].to(dev)
        _prefill_core(
            q, kb, vb, ok, seq_len - n, scale, chunk, out[qsl[r] : qsl[r + 1]], qpos, sliding_window
        )
    return out


__all__ = [
    "DEFAULT_MAX_ELEMS",
    "LAYOUTS",
    "LAYOUT_CPU",
    "LAYOUT_NHD",
    "logical_kv",
    "masked_paged_attention",
    "split_cpu_kv_cache",
]
