"""Causal paged attention with a per-slot depth mask (QuickSilver KV skipping, D-LLM "KV mask").

Under KV skipping a token that stops after ``D`` layers writes K/V at layers ``0 .. D-1`` only;
the depth record (``vllm_adaptive/depth/record.py``) holds that ``D`` for every slot of the paged
KV cache. Attention at layer ``l`` (0-based) must then leave out every slot whose K/V at ``l`` were
never written: its memory holds a stale token's K/V, or whatever the allocator left there.

**The mask rule.** For request ``r`` with ``seq_len`` tokens of which the last ``query_len`` are
this step's (``ctx = seq_len - query_len`` tokens were cached before the step), a query at
position ``p`` attends to key position ``j`` at layer ``l`` iff

    j <= p   and   ( j >= ctx   or   depth_record[slot(j)] > l )

i.e. cached keys are visible iff their record says layer ``l`` was written, and this step's own
keys (``ctx <= j <= p``) are visible causally whatever their record says. That is consistent with
how the record is maintained: it is committed at the *end* of a step, for every slot written in
it, so during the step the record of this step's slots is stale (0 for a fresh slot, or the depth
of a token that occupied the slot earlier) and must not be read. This step's keys are present at
layer ``l`` whenever the query runs layer ``l``, because the depth runtime peels whole requests
(``peeling.py``): a request's tokens of one step run the same layers, and the attention layer
writes this step's K/V (``do_kv_cache_update``) before attending. Token-granular exits *inside* a
prefill (QuickSilver halting per token) would break that premise and need a per-token "still
running" flag for this step's keys; the runtime does not do that, so neither does this function.

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
per group there is a fixed number of torch ops; nothing loops over tokens in Python. Not
supported: sliding windows, ALiBi, soft-capping, sinks, fp8 caches, encoder attention.
"""

from __future__ import annotations

import torch

LAYOUT_CPU = "cpu"
LAYOUT_NHD = "nhd"
LAYOUTS = (LAYOUT_CPU, LAYOUT_NHD)

# elements of one gathered K (or V) group / one score chunk, float32: 16M elements = 64 MiB
DEFAULT_MAX_ELEMS = 1 << 24


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


def _gather(
    k: torch.Tensor, v: torch.Tensor, rec2d: torch.Tensor | None, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """K, V as float32 ``[num_kv_heads, B, L, head]`` and the record ``[B, L]`` of blocks
    ``block_ids`` ``[B, nblk]`` (L = nblk * block_size)."""
    nb, nkv, bs, hs = k.shape
    b, nblk = block_ids.shape
    kg = k.transpose(0, 1)[:, block_ids].reshape(nkv, b, nblk * bs, hs).float()
    vg = v.transpose(0, 1)[:, block_ids].reshape(nkv, b, nblk * bs, hs).float()
    rg = None if rec2d is None else rec2d[block_ids].reshape(b, nblk * bs)
    return kg, vg, rg


def _attend(
    qf: torch.Tensor,
    kg: torch.Tensor,
    vg: torch.Tensor,
    key_ok: torch.Tensor,
    q_pos: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``qf`` float32 ``[B, Q, H, D]`` against ``kg`` / ``vg`` ``[KVH, B, L, D]``; ``key_ok``
    ``[B, L]`` (keys visible to every query), ``q_pos`` ``[B, Q]`` positions for the causal part
    (None: every key in ``key_ok`` is causally visible, e.g. decode). Returns ``[B, Q, H, D]``."""
    b, nq, nh, d = qf.shape
    nkv, _, length, _ = kg.shape
    g = nh // nkv
    # [B, Q, KVH, G, D] -> [KVH, B, Q*G, D]: one batched product per (kv head, request)
    q = qf.view(b, nq, nkv, g, d).permute(2, 0, 1, 3, 4).reshape(nkv, b, nq * g, d)
    scores = torch.matmul(q, kg.transpose(-1, -2)).view(nkv, b, nq, g, length)
    if q_pos is None:
        vis = key_ok[:, None, :]  # [B, 1, L]
    else:
        j = torch.arange(length, device=qf.device)
        vis = key_ok[:, None, :] & (j[None, None, :] <= q_pos[:, :, None])  # [B, Q, L]
    scores.mul_(scale).masked_fill_(~vis[None, :, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    row_any = vis.any(-1)  # [B, Q] (or [B, 1])
    if not bool(row_any.all()):
        probs.masked_fill_(~row_any[None, :, :, None, None], 0.0)
    vg = vg.masked_fill(~key_ok[None, :, :, None], 0.0)  # 0 * NaN would leak through P @ V
    out = torch.matmul(probs.view(nkv, b, nq * g, length), vg)  # [KVH, B, Q*G, D]
    return out.view(nkv, b, nq, g, d).permute(1, 2, 0, 3, 4).reshape(b, nq, nh, d)


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
    max_elems: int = DEFAULT_MAX_ELEMS,
) -> torch.Tensor:
    """Causal paged attention of ``query`` ``[num_tokens, num_heads, head_size]`` with the depth
    mask of layer ``layer`` (see the module doc for the rule and the layouts).

    ``query_start_loc`` ``[R + 1]``, ``seq_lens`` ``[R]`` (cached + this step's tokens) and
    ``block_table`` ``[R, max_blocks]`` are vLLM's attention metadata. ``depth_record``: int
    ``[num_blocks * block_size]`` indexed by slot (``block * block_size + offset``), or None for
    plain causal paged attention. ``rows``: compute only these requests (the other rows of
    ``out`` are left as they are). Returns ``out`` (allocated when not given).
    """
    k, v = logical_kv(key_cache, value_cache, layout)
    _check(query, k, block_table, seq_lens, query_start_loc, depth_record)
    nb, nkv, bs, hs = k.shape
    nh = query.shape[1]
    if out is None:
        out = torch.empty_like(query)
    dev = query.device
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    rows = list(range(len(lens))) if rows is None else list(rows)
    rec2d = None if depth_record is None else depth_record.view(nb, bs)
    decode, prefill = [], []
    for r in rows:
        n = qsl[r + 1] - qsl[r]
        if n > lens[r]:
            raise ValueError(f"request {r}: {n} query tokens but seq_len {lens[r]}")
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

    def key_mask(rg: torch.Tensor | None, length: int, seq: torch.Tensor, ctx: torch.Tensor):
        j = torch.arange(length, device=dev)[None, :]
        ok = j < seq[:, None]
        if rg is not None:
            written = rg > layer
            ok &= written if mask_step_tokens else (written | (j >= ctx[:, None]))
        return ok

    # decode rows: sorted by length, grouped while padding stays under 2x and memory bounded
    decode.sort(key=lambda r: lens[r])
    per_key = nkv * hs
    groups: list[list[int]] = []
    for r in decode:
        nblk = -(-lens[r] // bs)
        if groups:
            grp = groups[-1]
            first = -(-lens[grp[0]] // bs)
            if nblk <= 2 * first and (len(grp) + 1) * nblk * bs * per_key <= max_elems:
                grp.append(r)
                continue
        groups.append([r])
    for grp in groups:
        nblk = -(-max(lens[r] for r in grp) // bs)
        kg, vg, rg = _gather(k, v, rec2d, blocks_of(grp, nblk))
        seq = torch.tensor([lens[r] for r in grp], device=dev)
        tok = torch.tensor([qsl[r] for r in grp], device=dev)
        ok = key_mask(rg, nblk * bs, seq, seq - 1)
        o = _attend(query[tok].float().unsqueeze(1), kg, vg, ok, None, scale)
        out[tok] = o.squeeze(1).to(out.dtype)

    for r in prefill:
        n, seq_len = qsl[r + 1] - qsl[r], lens[r]
        ctx = seq_len - n
        nblk = -(-seq_len // bs)
        kg, vg, rg = _gather(k, v, rec2d, blocks_of([r], nblk))
        seq = torch.tensor([seq_len], device=dev)
        ok = key_mask(rg, nblk * bs, seq, torch.tensor([ctx], device=dev))
        chunk = max(1, max_elems // max(1, nh * seq_len))
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            kv_len = ctx + c1  # keys past the chunk's last query are causally invisible
            q = query[qsl[r] + c0 : qsl[r] + c1].float().unsqueeze(0)
            pos = torch.arange(ctx + c0, ctx + c1, device=dev)[None, :]
            o = _attend(q, kg[:, :, :kv_len], vg[:, :, :kv_len], ok[:, :kv_len], pos, scale)
            out[qsl[r] + c0 : qsl[r] + c1] = o.squeeze(0).to(out.dtype)
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
