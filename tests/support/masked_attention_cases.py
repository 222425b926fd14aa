"""Random paged caches with a depth record, and a dense float64 reference, for the masked
attention tests (``tests/unit/test_masked_attention.py``) and the Triton interpreter child process
(``tests/support/triton_masked_interp_cases.py``).

A case is built from per-request token K/V that the test itself draws, so the reference never
reads the cache: every other slot of the cache (free blocks, slots past ``seq_len``, and the
context slots the record masks) holds poison (NaN / inf) or, with ``stale=``, other finite
values. Block tables are shuffled and padded with out-of-range block ids.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_adaptive.kernels.masked_paged_attention import LAYOUT_CPU, LAYOUT_NHD, logical_kv


@dataclasses.dataclass
class Case:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, max_blocks]
    depth_record: torch.Tensor  # int16 [num_blocks * block_size]
    layer: int
    scale: float
    layout: str
    k_tokens: list[torch.Tensor]  # per request [seq_len, KVH, D] (what the cache should hold)
    v_tokens: list[torch.Tensor]
    visible: list[torch.Tensor]  # per request [query_len, seq_len] bool: the mask rule
    masked_slots: torch.Tensor  # context slots the record masks at ``layer``
    kv_cache: torch.Tensor | None = None  # the CPU_ATTN layer cache, for layout "cpu"

    def args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.scale,
            self.depth_record,
            self.layer,
        )


def make_caches(layout: str, num_blocks: int, kvh: int, bs: int, hs: int, dtype: torch.dtype):
    if layout == LAYOUT_CPU:
        kv = torch.empty(num_blocks, kvh, bs, 2 * hs, dtype=dtype)
        k, v = kv.view(num_blocks, kvh, 2 * bs, hs).chunk(2, dim=2)
        return kv, k, v
    if layout == LAYOUT_NHD:
        return (
            None,
            torch.empty(num_blocks, bs, kvh, hs, dtype=dtype),
            torch.empty(num_blocks, bs, kvh, hs, dtype=dtype),
        )
    raise ValueError(layout)


def make_case(
    seed: int,
    *,
    layout: str = LAYOUT_CPU,
    dtype: torch.dtype = torch.float32,
    heads: int = 4,
    kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 32,
    query_lens: tuple[int, ...] = (1, 1, 5),
    ctx_lens: tuple[int, ...] = (40, 70, 33),
    num_layers: int = 8,
    layer: int = 3,
    spare_blocks: int = 3,
    poison: bool = True,
    stale: float | None = None,
    mask_step_tokens: bool = False,
    record_mode: str = "random",
) -> Case:
    """``record_mode``: ``random`` (context depths uniform in [0, num_layers]), ``full`` (every
    slot written through all layers: the mask is all-visible), or ``none_written`` (every
    context slot at depth 0, this step's slots too)."""
    g = torch.Generator().manual_seed(seed)
    junk = torch.Generator().manual_seed(seed + 7919)  # garbage: the real data never depends on it
    bs, kvh, hs = block_size, kv_heads, head_size
    seq = [c + q for c, q in zip(ctx_lens, query_lens, strict=True)]
    need = [-(-s // bs) for s in seq]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(need) + 2
    table = torch.full((len(seq), max_blocks), 0, dtype=torch.int32)
    pos = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[pos : pos + n].to(torch.int32)
        table[r, n:] = num_blocks + 1000 + r  # out of range: must never be dereferenced
        pos += n

    kv_cache, kc, vc = make_caches(layout, num_blocks, kvh, bs, hs, dtype)
    k_log, v_log = logical_kv(kc, vc, layout)
    if poison:
        k_log.fill_(float("nan"))
        v_log.fill_(float("inf"))
        v_log[::2] = float("nan")
    else:
        k_log.copy_(torch.randn(k_log.shape, generator=junk) * 30)
        v_log.copy_(torch.randn(v_log.shape, generator=junk) * 30)

    nslots = num_blocks * bs
    if record_mode == "full":
        record = torch.full((nslots,), num_layers, dtype=torch.int16)
    elif record_mode == "none_written":
        record = torch.zeros(nslots, dtype=torch.int16)
    else:  # random, including the stale values of this step's slots
        record = torch.randint(0, num_layers + 1, (nslots,), generator=g).to(torch.int16)

    k_tokens, v_tokens, visible, masked = [], [], [], []
    for r, s in enumerate(seq):
        ctx = ctx_lens[r]
        kt = torch.randn(s, kvh, hs, generator=g).to(dtype)
        vt = torch.randn(s, kvh, hs, generator=g).to(dtype)
        p = torch.arange(s)
        blocks = table[r, p // bs].long()
        off = p % bs
        slots = blocks * bs + off
        rec = record[slots]
        written = rec > layer
        for j in range(s):
            # a masked context slot holds whatever it held (poison, or stale values below)
            if j >= ctx or written[j]:
                k_log[blocks[j], :, off[j]] = kt[j]
                v_log[blocks[j], :, off[j]] = vt[j]
            elif stale is not None:
                k_log[blocks[j], :, off[j]] = (torch.randn(kvh, hs, generator=junk) * stale).to(
                    dtype
                )
                v_log[blocks[j], :, off[j]] = (torch.randn(kvh, hs, generator=junk) * stale).to(
                    dtype
                )
        qpos = torch.arange(ctx, s)
        causal = p[None, :] <= qpos[:, None]
        key_ok = written if mask_step_tokens else (written | (p >= ctx))
        visible.append(causal & key_ok[None, :])
        masked.append(slots[~written & (p < ctx)])
        k_tokens.append(kt)
        v_tokens.append(vt)

    qsl = torch.zeros(len(seq) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    query = torch.randn(int(qsl[-1]), heads, hs, generator=g).to(dtype)
    return Case(
        query=query,
        key_cache=kc,
        value_cache=vc,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        block_table=table,
        depth_record=record,
        layer=layer,
        scale=hs**-0.5,
        layout=layout,
        k_tokens=k_tokens,
        v_tokens=v_tokens,
        visible=visible,
        masked_slots=torch.cat(masked) if masked else torch.zeros(0, dtype=torch.long),
        kv_cache=kv_cache,
    )


def dense_reference(case: Case, sliding_window: int = -1) -> torch.Tensor:
    """float64 attention over the drawn K/V with the mask rule (and, for ``sliding_window`` W > 0,
    only the keys at ``q - W + 1 .. q``); fully masked rows are zeros."""
    q_all = case.query.double()
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    nh = q_all.shape[1]
    qsl = case.query_start_loc.tolist()
    for r, (kr, vr, vis) in enumerate(zip(case.k_tokens, case.v_tokens, case.visible, strict=True)):
        g = nh // kr.shape[1]
        kk = kr.double().repeat_interleave(g, dim=1)  # [L, H, D]
        vv = vr.double().repeat_interleave(g, dim=1)
        n = qsl[r + 1] - qsl[r]
        for t in range(n):
            seen = vis[t]
            if sliding_window > 0:  # the query sits at len - n + t (its request's last n)
                keys = torch.arange(seen.shape[0])
                seen = seen & (keys > seen.shape[0] - n + t - sliding_window)
            cols = seen.nonzero().flatten()
            if len(cols) == 0:
                continue
            s = torch.einsum("hd,lhd->hl", q_all[qsl[r] + t], kk[cols]) * case.scale
            out[qsl[r] + t] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv[cols])
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


# max |y - ref| / max |ref|; the inputs are exact in their dtype, the reference is float64 on
# them, so the error is fp32 arithmetic (torch) plus the output rounding of the dtype
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
