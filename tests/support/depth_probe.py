"""Worker-side instruments for the adaptive-depth engine tests (run through LLM.apply_model).

The KV audit wraps every attention layer's cache write and attention call and keeps its own
shadow of which (layer, slot) K/V were written, independent of the runtime's depth record:
a write at layer 0 means a new token owns the slot (its deeper layers are unwritten until
written again); any write at layer l marks (l, slot). Before each attention call it checks
that every slot the call attends to (positions [0, seq_len) of each request, through the
block table) has K/V at that layer.
"""

from __future__ import annotations

from typing import Any

import torch

_AUDIT: dict[str, Any] = {}


def _cache(kv_cache: Any) -> torch.Tensor:
    return kv_cache[0] if isinstance(kv_cache, (list, tuple)) else kv_cache


def _poison(kv_cache: Any, slots: torch.Tensor, block_size: int):
    """NaN into the K and V of ``slots`` at this layer (CPU_ATTN layout); returns a function
    that puts the old values back. The poison lasts for one attention call only: left in
    place, it would sit in slots past ``seq_len`` of reused blocks, which vLLM's fused op
    multiplies by a zero weight (0 * NaN = NaN) although they are not attended."""
    from vllm_adaptive.kernels.masked_paged_attention import logical_kv, split_cpu_kv_cache

    k, v = logical_kv(*split_cpu_kv_cache(_cache(kv_cache)), "cpu")  # [nb, nkv, bs, hs] views
    blocks, offs = slots // block_size, slots % block_size
    saved_k, saved_v = k[blocks, :, offs, :].clone(), v[blocks, :, offs, :].clone()
    k[blocks, :, offs, :] = float("nan")
    v[blocks, :, offs, :] = float("nan")

    def restore() -> None:
        k[blocks, :, offs, :] = saved_k
        v[blocks, :, offs, :] = saved_v

    return restore


def install_kv_audit(model: Any, mask_aware: bool = False) -> int:
    """``mask_aware``: under the `mask` KV strategy unwritten cached slots are expected in the
    attended range; they are poisoned with NaN instead of counted, and any non-finite attention
    output is the violation (a masked slot contributed)."""
    layers = model.adaptive_parts().layers
    num_layers = len(layers)
    if _AUDIT.get("installed"):
        return num_layers
    _AUDIT.update(
        installed=True,
        violations=[],
        reads=0,
        checked_slots=0,
        writes=0,
        shadow=None,
        mask_aware=mask_aware,
        poisoned=0,
        nan_outputs=[],
    )

    def shadow_for(kv_cache: Any) -> torch.Tensor:
        if _AUDIT["shadow"] is None:
            num_blocks, _, block_size, _ = _cache(kv_cache).shape
            _AUDIT["block_size"] = block_size
            _AUDIT["shadow"] = torch.zeros(num_layers, num_blocks * block_size, dtype=torch.bool)
        return _AUDIT["shadow"]

    for index, layer in enumerate(layers):
        impl = layer.attn.impl
        orig_update, orig_forward = impl.do_kv_cache_update, impl.forward

        def update(attn, key, value, kv_cache, slot_mapping, _i=index, _orig=orig_update):
            shadow = shadow_for(kv_cache)
            slots = slot_mapping.long().cpu()
            if _i == 0:
                shadow[:, slots] = False
            shadow[_i, slots] = True
            _AUDIT["writes"] += int(slots.numel())
            return _orig(attn, key, value, kv_cache, slot_mapping)

        def forward(attn, query, key, value, kv_cache, md, *args, _i=index, _o=orig_forward, **kw):
            restores = []
            if md is not None and hasattr(md, "block_table"):
                shadow = shadow_for(kv_cache)
                bs = _AUDIT["block_size"]
                seq_lens = md.seq_lens.cpu().tolist()
                for r, n in enumerate(seq_lens):
                    pos = torch.arange(int(n))
                    slots = md.block_table[r].cpu().long()[pos // bs] * bs + pos % bs
                    ok = shadow[_i, slots]
                    _AUDIT["reads"] += 1
                    _AUDIT["checked_slots"] += int(n)
                    if bool(ok.all()):
                        continue
                    if _AUDIT["mask_aware"]:
                        restores.append(_poison(kv_cache, slots[~ok], bs))
                        _AUDIT["poisoned"] += int((~ok).sum())
                    else:
                        _AUDIT["violations"].append((_i, int((~ok).sum())))
            result = _o(attn, query, key, value, kv_cache, md, *args, **kw)
            if _AUDIT["mask_aware"] and md is not None and hasattr(md, "num_actual_tokens"):
                out = result if isinstance(result, torch.Tensor) else args[0] if args else None
                if out is not None and not bool(torch.isfinite(out[: md.num_actual_tokens]).all()):
                    _AUDIT["nan_outputs"].append(_i)
            for restore in reversed(restores):
                restore()
            return result

        impl.do_kv_cache_update = update
        impl.forward = forward
    return num_layers


def audit_report(model: Any) -> dict[str, Any]:
    v = _AUDIT.get("violations", [])
    return {
        "installed": bool(_AUDIT.get("installed")),
        "violations": len(v),
        "first_violations": v[:5],
        "reads": _AUDIT.get("reads", 0),
        "checked_slots": _AUDIT.get("checked_slots", 0),
        "writes": _AUDIT.get("writes", 0),
        "poisoned": _AUDIT.get("poisoned", 0),
        "nan_outputs": len(_AUDIT.get("nan_outputs", [])),
        "first_nan_layers": _AUDIT.get("nan_outputs", [])[:5],
    }


def install_mask_audit(model: Any) -> int:
    return install_kv_audit(model, mask_aware=True)


def reset_nan_outputs(model: Any) -> None:
    _AUDIT["nan_outputs"] = []


def scrub_nan_kv(model: Any) -> int:
    """Zero every non-finite K/V value in the engine's caches; returns how many there were.

    A negative control that lets the poison through leaves NaN in the K/V the poisoned
    attention outputs went on to write; freed blocks keep it, and vLLM's fused op multiplies
    slots past ``seq_len`` by a zero weight (0 * NaN = NaN), so a later request in a reused
    block would read it. Scrubbing restores the cache a real engine would have."""
    scrubbed = 0
    for layer in model.adaptive_parts().layers:
        caches = layer.attn.kv_cache
        for cache in caches if isinstance(caches, (list, tuple)) else [caches]:
            if cache.numel():
                bad = ~torch.isfinite(cache)
                scrubbed += int(bad.sum())
                cache.masked_fill_(bad, 0)
    return scrubbed


def stop_publishing_mask(model: Any) -> None:
    """Negative control for the mask strategy: attention no longer learns which cached slots
    are masked, so it reads the poisoned ones."""
    import vllm_adaptive.depth.runtime as runtime  # where the layer loop publishes it

    runtime._saved_publish = runtime.publish_mask
    runtime.publish_mask = lambda mask: runtime._saved_publish(None)


def restore_publishing_mask(model: Any) -> None:
    import vllm_adaptive.depth.runtime as runtime

    runtime.publish_mask = runtime._saved_publish


def reset_audit_violations(model: Any) -> None:
    _AUDIT["violations"] = []


def break_prefill_cap(model: Any) -> None:
    """Negative control: let prefills ignore shallow cached slots (reads unwritten K/V)."""
    record = model.depth.record
    record._saved_context_min = record.context_min
    record.context_min = lambda block_row, num_context: None


def restore_prefill_cap(model: Any) -> None:
    record = model.depth.record
    record.context_min = record._saved_context_min


def stop_propagating(model: Any) -> None:
    """Negative control for the propagate strategy: exited tokens' skipped layers get no K/V."""
    import vllm_adaptive.depth.kv_strategies.propagate as propagate

    propagate._saved_propagate_kv = propagate.propagate_kv
    propagate.propagate_kv = lambda *args, **kwargs: 0


def restore_propagating(model: Any) -> None:
    import vllm_adaptive.depth.kv_strategies.propagate as propagate

    propagate.propagate_kv = propagate._saved_propagate_kv


def stop_resuming(model: Any) -> None:
    """Negative control for the recompute strategy: the previous token is never resumed
    through its skipped layers before the current one attends to it."""
    model.depth.kv.before_layers = lambda *args, **kwargs: None  # the strategy's resume hook


def restore_resuming(model: Any) -> None:
    del model.depth.kv.before_layers


def _exit_river(model: Any) -> Any:
    """The engine's Exit River (``vllm_adaptive/depth/exit_river.py``), found among the
    attributes of the model's depth runtime (and theirs, a few levels down) so that the
    negative control depends on ``ExitRiver``'s API only, not on where the runtime keeps it."""
    from vllm_adaptive.depth.exit_river import ExitRiver

    seen: set[int] = set()
    level = [model.depth]
    for _ in range(4):
        below = []
        for obj in level:
            if id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module, str, bytes)):
                continue
            seen.add(id(obj))
            if isinstance(obj, ExitRiver):
                return obj
            if isinstance(obj, dict):
                below += list(obj.values())
            elif isinstance(obj, (list, tuple)):
                below += list(obj)
            elif hasattr(obj, "__dict__"):
                below += list(vars(obj).values())
        level = below
    raise LookupError("no ExitRiver under the model's depth runtime (kv_strategy is not river?)")


def stop_river_kv_writes(model: Any) -> int:
    """Negative control for the river strategy: the Exit River's layers no longer write the K/V
    of the exited decode tokens they run. For the duration of each ``ExitRiver.forward_layer``
    call the layer's cache write drops, from the slot mapping, the river rows that are the one
    query token of their request (prompt tokens in the river, ``prefill: river``, and backbone
    rows still write). Returns the river's entry layer (0-based: its first layer)."""
    import inspect

    from vllm.forward_context import get_forward_context

    from vllm_adaptive.depth.exit_river import ExitRiver

    river = _exit_river(model)
    signature = inspect.signature(ExitRiver.forward_layer)
    forward_layer = river.forward_layer  # the bound method

    def forward_layer_without_exited_kv(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(river, *args, **kwargs)
        layer, rows = bound.arguments["layer"], bound.arguments["river"].cpu()
        md = get_forward_context().attn_metadata[layer.attn.layer_name]
        qsl = md.query_start_loc.cpu().long()
        decode_tokens = qsl[:-1][qsl[1:] - qsl[:-1] == 1]
        skipped = rows[torch.isin(rows, decode_tokens)]
        impl = layer.attn.impl
        write = impl.do_kv_cache_update  # the audit's wrapper: skipped slots stay unmarked

        def without_skipped(attn, key, value, kv_cache, slot_mapping):
            keep = torch.ones(slot_mapping.shape[0], dtype=torch.bool)
            keep[skipped] = False
            keep = keep.to(slot_mapping.device)
            n = slot_mapping.shape[0]
            return write(attn, key[:n][keep], value[:n][keep], kv_cache, slot_mapping[keep])

        impl.do_kv_cache_update = without_skipped
        try:
            return forward_layer(*args, **kwargs)
        finally:
            impl.do_kv_cache_update = write

    river.forward_layer = forward_layer_without_exited_kv
    return river.entry_layer


def restore_river_kv_writes(model: Any) -> None:
    del _exit_river(model).forward_layer  # the class's method again
