"""The KV-skipping attention backend (``vllm_adaptive/attention/masked_backend.py``), without an
engine: real vLLM ``Attention`` layers built after ``register_masked_backend()``, vLLM's own CPU
metadata builder, a CPU_ATTN cache written by the impl's ``do_kv_cache_update`` (vLLM's
``cpu_attn_reshape_and_cache``), and ``Attention.forward`` run inside a forward context, so the
K/V write and the attention go through vLLM's ``unified_kv_cache_update`` /
``unified_attention_with_output`` ops exactly as in the engine.

The batch: a decode after 45 cached tokens, a chunk of 6 after 37 cached tokens, and a fresh
9-token prompt; 4 query heads, 2 KV heads, head 64, block 32, float32.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)
from vllm.v1.attention.backends.registry import (  # noqa: E402
    _ATTN_OVERRIDES,
    AttentionBackendEnum,
    register_backend,
)

from vllm_adaptive.attention import masked_backend as mb  # noqa: E402
from vllm_adaptive.attention.masked_backend import (  # noqa: E402
    MaskedAttentionUnsupported,
    MaskedCPUAttentionBackend,
    MaskedCPUAttentionImpl,
    layer_index_from_name,
    masked_backend_active,
)
from vllm_adaptive.depth.mask_context import (  # noqa: E402
    StepMask,
    current_mask,
    mask_stats,
    publish_mask,
    reset_mask_stats,
)
from vllm_adaptive.engine import intrusions  # noqa: E402
from vllm_adaptive.engine.intrusions import (  # noqa: E402
    MASKED_BACKEND_PATH,
    register_masked_backend,
    unregister_masked_backend,
)
from vllm_adaptive.kernels.masked_paged_attention import (  # noqa: E402
    logical_kv,
    masked_paged_attention,
    split_cpu_kv_cache,
)

H, KVH, D, BS, NB = 4, 2, 64, 32, 12
SCALE = D**-0.5
CTX = [45, 37, 0]  # cached tokens per request
QLEN = [1, 6, 9]  # this step's tokens per request
LAYER = 3  # the decoder index of the layer under test
NUM_LAYERS = 6
DTYPE = torch.float32


def _vllm_config() -> VllmConfig:
    """A VllmConfig without a model: what the CPU backend and ``Attention`` read of the model
    config is its dtype (the rest is the defaults of a decoder)."""
    cfg = VllmConfig()
    cfg.model_config = types.SimpleNamespace(
        dtype=DTYPE,
        rswa_window=None,
        is_mm_prefix_lm=False,
        get_num_attention_heads=lambda parallel_config: H,
    )
    return cfg


def _restore_registry(saved: str | None) -> None:
    cpu = AttentionBackendEnum.CPU_ATTN
    cpu.clear_override()
    if saved is not None:
        _ATTN_OVERRIDES[cpu] = saved
    intrusions._clear_selector_cache()


@pytest.fixture
def registry_guard():
    """Leaves vLLM's backend registry (and the selector cache) as the test found it."""
    saved = _ATTN_OVERRIDES.get(AttentionBackendEnum.CPU_ATTN)
    yield
    _restore_registry(saved)


@pytest.fixture(autouse=True)
def _clean_stats():
    reset_mask_stats()
    yield
    reset_mask_stats()


def _build_attention(cfg: VllmConfig, prefix: str):
    from vllm.model_executor.layers.attention import Attention

    with set_current_vllm_config(cfg):
        return Attention(H, D, SCALE, num_kv_heads=KVH, prefix=prefix)


@pytest.fixture(scope="module")
def env():
    """Layers, metadata and caches of one step (built once; the registry is restored)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    saved = _ATTN_OVERRIDES.get(AttentionBackendEnum.CPU_ATTN)
    cfg = _vllm_config()
    try:
        assert register_masked_backend()
        layer = _build_attention(cfg, f"model.layers.{LAYER}.self_attn.attn")
    finally:
        _restore_registry(saved)
    stock_layer = _build_attention(cfg, "model.layers.0.self_attn.attn")  # not registered
    with set_current_vllm_config(cfg):
        stock_impl = CPUAttentionBackendImpl(H, D, SCALE, KVH, None, None, "auto")

    gen = torch.Generator().manual_seed(0)
    seq = [c + q for c, q in zip(CTX, QLEN, strict=True)]
    nblk = [-(-s // BS) for s in seq]
    perm = torch.randperm(NB, generator=gen)
    table = torch.zeros(len(seq), max(nblk), dtype=torch.int32)
    pos = 0
    for r, n in enumerate(nblk):
        table[r, :n] = perm[pos : pos + n].int()
        pos += n
    free = perm[pos:]

    def slots(r: int, positions: range) -> torch.Tensor:
        p = torch.tensor(list(positions), dtype=torch.long)
        return table[r, p // BS].long() * BS + p % BS

    ctx_slots = [slots(r, range(CTX[r])) for r in range(len(seq))]
    step_slots = [slots(r, range(CTX[r], seq[r])) for r in range(len(seq))]
    k_tok = [torch.randn(s, KVH, D, generator=gen) for s in seq]  # K/V of every position
    v_tok = [torch.randn(s, KVH, D, generator=gen) for s in seq]

    kv = torch.zeros(NB, KVH, BS, 2 * D, dtype=DTYPE)  # vLLM allocates the CPU cache zeroed
    layer.bind_kv_cache(kv)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KVH, head_size=D, dtype=DTYPE)
    # vLLM's builder; it also assigns the ISA to the layer (``layer.isa``)
    builder = layer.attn_backend.get_builder_cls()(
        spec, [layer.layer_name], cfg, torch.device("cpu")
    )
    # earlier steps' K/V, written with the impl's own update function (vLLM's op)
    layer.impl.do_kv_cache_update(
        layer,
        torch.cat([k[:c] for k, c in zip(k_tok, CTX, strict=True)]),
        torch.cat([v[:c] for v, c in zip(v_tok, CTX, strict=True)]),
        kv,
        torch.cat(ctx_slots),
    )
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(QLEN), 0).tolist()], dtype=torch.int32)
    slot_mapping = torch.cat(step_slots)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        num_reqs=len(seq),
        num_actual_tokens=sum(QLEN),
        max_query_len=max(QLEN),
        max_seq_len=max(seq),
        block_table_tensor=table,
        slot_mapping=slot_mapping,
    )
    md = builder.build(0, common)
    assert isinstance(md, CPUAttentionMetadata) and layer.isa == builder.isa

    t = sum(QLEN)
    query = torch.randn(t, H, D, generator=gen)
    key = torch.cat([k[c:] for k, c in zip(k_tok, CTX, strict=True)])
    value = torch.cat([v[c:] for v, c in zip(v_tok, CTX, strict=True)])

    # depth record: context slots 0 .. NUM_LAYERS (about half <= LAYER), this step's slots and
    # free slots stale (must never be read)
    record = torch.randint(0, NUM_LAYERS + 1, (NB * BS,), dtype=torch.int16, generator=gen)
    masked = [s[record[s] <= LAYER] for s in ctx_slots]
    assert all(len(m) for m in masked[:2]) and all((record[s] > LAYER).any() for s in ctx_slots[:2])
    record[torch.cat(step_slots)] = 0
    return types.SimpleNamespace(**locals())


def _forward(env, kv: torch.Tensor | None = None) -> torch.Tensor:
    """``Attention.forward`` as the engine calls it (K/V write, then attention)."""
    layer = env.layer
    if kv is not None:
        layer.bind_kv_cache(kv)
    try:
        with set_forward_context(
            {layer.layer_name: env.md},
            env.cfg,
            slot_mapping={layer.layer_name: env.slot_mapping},
        ):
            out = layer.forward(
                env.query.view(env.t, -1), env.key.view(env.t, -1), env.value.view(env.t, -1)
            )
    finally:
        layer.bind_kv_cache(env.kv)
    return out.view(env.t, H, D)


def _stock(env) -> torch.Tensor:
    out = torch.empty_like(env.query)
    env.stock_impl.forward(env.layer, env.query, env.key, env.value, env.kv, env.md, out)
    return out


def _dense_reference(env, layer: int) -> torch.Tensor:
    """float64 attention from the drawn K/V with the mask rule (never reads the cache)."""
    out = torch.empty(env.t, H, D, dtype=torch.float64)
    g = H // KVH
    for r, (c, n) in enumerate(zip(CTX, QLEN, strict=True)):
        s = c + n
        k = env.k_tok[r].double().repeat_interleave(g, dim=1)  # [s, H, D]
        v = env.v_tok[r].double().repeat_interleave(g, dim=1)
        q = env.query[env.qsl[r] : env.qsl[r + 1]].double()  # [n, H, D]
        j = torch.arange(s)
        p = torch.arange(c, s)
        written = torch.ones(s, dtype=torch.bool)
        written[:c] = env.record[env.ctx_slots[r]] > layer
        vis = (j[None, :] <= p[:, None]) & (written[None, :] | (j[None, :] >= c))
        sc = torch.einsum("nhd,shd->hns", q, k) * SCALE
        sc = sc.masked_fill(~vis[None], float("-inf"))
        out[env.qsl[r] : env.qsl[r + 1]] = torch.einsum("hns,shd->nhd", sc.softmax(-1), v)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ---------------------------------------------------------------------------------------------
# the mask context
# ---------------------------------------------------------------------------------------------


def test_publish_mask_sets_and_restores():
    rec = torch.zeros(8, dtype=torch.int16)
    a, b = StepMask(rec, 2), StepMask(rec, 5)
    assert current_mask() is None
    with publish_mask(a):
        assert current_mask() is a
        with publish_mask(b):
            assert current_mask() is b
        assert current_mask() is a
        with pytest.raises(RuntimeError), publish_mask(None):
            assert current_mask() is None
            raise RuntimeError
        assert current_mask() is a
    assert current_mask() is None
    with pytest.raises(ValueError):
        StepMask(torch.zeros(8), 1)  # float record
    with pytest.raises(ValueError):
        StepMask(torch.zeros(2, 4, dtype=torch.int16), 1)
    with pytest.raises(TypeError), publish_mask("mask"):  # type: ignore[arg-type]
        pass
    assert set(mask_stats()) == {"masked", "fused", "unmasked"}


# ---------------------------------------------------------------------------------------------
# forward: no mask / all-visible layer / masked layer
# ---------------------------------------------------------------------------------------------


def test_layer_got_the_masked_impl(env):
    assert masked_backend_active(env.layer)
    assert isinstance(env.layer.impl, MaskedCPUAttentionImpl)
    assert env.layer.attn_backend is MaskedCPUAttentionBackend
    assert env.layer.attn_backend.get_name() == "CPU_ATTN"
    assert env.layer.backend is AttentionBackendEnum.CPU_ATTN
    assert not masked_backend_active(env.stock_layer)
    assert type(env.stock_layer.impl) is CPUAttentionBackendImpl


def test_no_mask_is_the_stock_op_exactly(env):
    out = _forward(env)
    assert torch.equal(out, _stock(env))
    assert mask_stats() == {"masked": 0, "fused": 0, "unmasked": 1}
    # and it is right (vLLM's op against the dense float64 reference, nothing masked)
    assert _rel(out, _dense_reference(env, layer=-1)) < 1e-5


def test_layer_below_all_visible_runs_the_fused_op(env):
    with publish_mask(StepMask(env.record, all_visible_below=LAYER + 1)):
        out = _forward(env)
    assert torch.equal(out, _stock(env))
    assert mask_stats() == {"masked": 0, "fused": 1, "unmasked": 0}


def test_masked_layer_leaves_out_masked_slots(env):
    with publish_mask(StepMask(env.record, all_visible_below=LAYER)):
        out = _forward(env)
    assert mask_stats() == {"masked": 1, "fused": 0, "unmasked": 0}
    kc, vc = split_cpu_kv_cache(env.kv)
    ref = masked_paged_attention(
        env.query, kc, vc, env.md.query_start_loc, env.md.seq_lens, env.md.block_table, SCALE,
        depth_record=env.record, layer=LAYER, layout="cpu",
    )  # fmt: skip
    assert torch.equal(out, ref)
    assert _rel(out, _dense_reference(env, LAYER)) < 1e-5
    unmasked = _stock(env)
    # the decode and the chunk have masked context; the fresh prompt has no context
    first_fresh = env.qsl[2]
    assert (out[:first_fresh] - unmasked[:first_fresh]).abs().max() > 1e-3
    assert _rel(out[first_fresh:], unmasked[first_fresh:]) < 1e-5


def test_masked_slots_are_never_read(env):
    with publish_mask(StepMask(env.record, all_visible_below=0)):
        clean = _forward(env)
        poisoned = env.kv.clone()
        kl, vl = logical_kv(*split_cpu_kv_cache(poisoned), "cpu")
        bad = torch.cat(env.masked)
        kl[bad // BS, :, bad % BS] = float("nan")
        vl[bad // BS, :, bad % BS] = float("nan")
        kl[env.free], vl[env.free] = float("nan"), float("inf")  # free blocks too
        assert kl.isnan().sum() > 0
        out = _forward(env, kv=poisoned)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)
    assert mask_stats()["masked"] == 2


def test_all_visible_record_on_the_masked_path_matches_the_stock_op(env):
    """The masked path reads the same cache and metadata as vLLM's op: with every slot written
    through every layer the two agree (different summation order: a tolerance)."""
    full = torch.full_like(env.record, NUM_LAYERS)
    with publish_mask(StepMask(full, all_visible_below=0)):
        out = _forward(env)
    assert mask_stats()["masked"] == 1
    assert _rel(out, _stock(env)) < 1e-5


def test_stale_records_of_this_steps_slots_are_ignored(env):
    rec = env.record.clone()
    rec[env.slot_mapping] = 0  # this step's slots: stale 0 (already so) ...
    with publish_mask(StepMask(rec, all_visible_below=0)):
        a = _forward(env)
    rec[env.slot_mapping] = NUM_LAYERS  # ... or anything else
    with publish_mask(StepMask(rec, all_visible_below=0)):
        b = _forward(env)
    assert torch.equal(a, b)


def test_warm_up_call_without_metadata(env):
    out = torch.full_like(env.query, 7.0)
    with publish_mask(StepMask(env.record, all_visible_below=0)):
        r = env.layer.impl.forward(env.layer, env.query, env.key, env.value, env.kv, None, out)
    assert r is out and bool((out == 7.0).all())
    assert mask_stats() == {"masked": 0, "fused": 0, "unmasked": 0}


# ---------------------------------------------------------------------------------------------
# layer index
# ---------------------------------------------------------------------------------------------


def test_layer_index_is_parsed_from_the_name_once(env):
    assert layer_index_from_name("model.layers.12.self_attn.attn") == 12
    assert layer_index_from_name("model.layers.0.self_attn.attn") == 0
    assert env.layer.impl.layer_index(env.layer) == LAYER
    assert env.layer.impl._layer_index == LAYER  # cached per impl
    for bad in ("lm_head.attn", "model.layers.1.mlp.experts.2.attn", "", None):
        with pytest.raises(MaskedAttentionUnsupported):
            layer_index_from_name(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}, "ALiBi"),
        ({"logits_soft_cap": 30.0}, "soft-capping"),
        ({"sinks": torch.zeros(H)}, "sinks"),
        ({"kv_cache_dtype": "fp8"}, "quantized KV cache"),
        ({"attn_type": "encoder_only"}, "attention type"),
        ({"attn_type": "encoder_decoder"}, "attention type"),
        ({"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}, "KV sharing"),
    ],
)
def test_unsupported_layers_are_refused_at_construction(kwargs, words):
    args = {"alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto"} | kwargs
    with set_current_vllm_config(_vllm_config()):
        with pytest.raises(MaskedAttentionUnsupported, match=words):
            MaskedCPUAttentionImpl(H, D, SCALE, KVH, **args)
        CPUAttentionBackendImpl(H, D, SCALE, KVH, **args)  # stock vLLM takes them


def test_sliding_window_layers_are_built_with_their_window():
    """Gemma 3's local layers: the masked impl keeps the window, which its masked call applies
    (the kernel's window is pinned against vLLM's op in test_masked_attention.py)."""
    args = {"alibi_slopes": None, "sliding_window": 128, "kv_cache_dtype": "auto"}
    with set_current_vllm_config(_vllm_config()):
        assert MaskedCPUAttentionImpl(H, D, SCALE, KVH, **args).sliding_window == 128


def test_amx_and_neon_isas_are_refused(env, monkeypatch):
    with set_current_vllm_config(_vllm_config()):
        for isa in ("amx", "neon"):
            monkeypatch.setattr(mb, "cpu_attn_isa", lambda *a, isa=isa, **k: isa)
            with pytest.raises(MaskedAttentionUnsupported, match=f"ISA '{isa}'"):
                MaskedCPUAttentionImpl(H, D, SCALE, KVH, None, None, "auto")
        monkeypatch.undo()
        impl = MaskedCPUAttentionImpl(H, D, SCALE, KVH, None, None, "auto")
    # the builder assigns the ISA to the layer later; the first masked call checks it
    layer = types.SimpleNamespace(
        layer_name=env.layer.layer_name, isa="amx", _k_scale_float=1.0, _v_scale_float=1.0
    )
    out = torch.empty_like(env.query)
    with publish_mask(StepMask(env.record, all_visible_below=0)):
        with pytest.raises(MaskedAttentionUnsupported, match="ISA 'amx'"):
            impl.forward(layer, env.query, env.key, env.value, env.kv, env.md, out)


# ---------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------


def test_register_overrides_cpu_attn_and_clears_the_selector_cache(registry_guard):
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig, get_attn_backend

    cpu = AttentionBackendEnum.CPU_ATTN
    cpu.clear_override()
    cfg = _vllm_config()
    with set_current_vllm_config(cfg):
        assert get_attn_backend(D, DTYPE, "auto") is CPUAttentionBackend  # now cached
        assert register_masked_backend() is True
        assert register_masked_backend() is False  # idempotent
        assert cpu.get_path() == MASKED_BACKEND_PATH
        assert cpu.get_class() is MaskedCPUAttentionBackend
        sel = AttentionSelectorConfig(
            head_size=D, dtype=DTYPE, kv_cache_dtype="auto", block_size=BS
        )
        assert current_platform.get_attn_backend_cls(None, sel) == MASKED_BACKEND_PATH
        # CPU platform ignores other selections and still answers CPU_ATTN's (overridden) path
        assert (
            current_platform.get_attn_backend_cls(AttentionBackendEnum.FLASH_ATTN, sel)
            == MASKED_BACKEND_PATH
        )
        assert get_attn_backend(D, DTYPE, "auto") is MaskedCPUAttentionBackend
        assert unregister_masked_backend() is True
        assert unregister_masked_backend() is False
        assert cpu.get_class() is CPUAttentionBackend and not cpu.is_overridden()
        assert get_attn_backend(D, DTYPE, "auto") is CPUAttentionBackend


def test_register_refuses_to_replace_another_override(registry_guard):
    cpu = AttentionBackendEnum.CPU_ATTN
    register_backend(cpu, "somebody.else.Backend")
    with pytest.raises(RuntimeError, match="already overridden"):
        register_masked_backend()
    assert cpu.get_path() == "somebody.else.Backend"
    assert unregister_masked_backend() is False  # not ours: left alone
    assert cpu.get_path() == "somebody.else.Backend"


def test_registry_is_restored_after_the_module_fixture(env):
    assert AttentionBackendEnum.CPU_ATTN.get_path() != MASKED_BACKEND_PATH
