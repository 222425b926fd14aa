"""M2R2 drafts (sec. 2.1.2, A.2): the accelerated residual stream of the first ``k`` layers.

The stream ``p`` starts from the token embedding and runs the target's own first ``k`` blocks
with M2R2's low-rank accelerator adapters added (:mod:`vllm_adaptive.m2r2.adapters`: on the
query, on the attention output and in parallel to the MLP), trained to land at layer ``k``
where the slow stream lands at layer ``N`` (rate ``N/k``). Its attention shares the target's
KV cache (A.1.4): positions the target verified hold the slow stream's K/V, draft positions the
accelerated stream's own. The draft token is read through the final norm and the LM head.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_adaptive.config import SpeculativeConfig
from vllm_adaptive.depth.accelerated import accelerated_block
from vllm_adaptive.depth.exit_river import require_recipes
from vllm_adaptive.m2r2.adapters import M2R2Adapters
from vllm_adaptive.speculative.drafts.head import DraftHead


class M2R2Draft:
    def __init__(self, model: Any, settings: SpeculativeConfig, model_dir: str) -> None:
        adapters, meta = M2R2Adapters.load(settings.adapter, model_dir)  # refuses other models
        cfg = adapters.config
        if cfg.mode != "spec":
            raise ValueError(
                f"adaptive.speculative.adapter: {settings.adapter} was trained with --mode "
                f"{cfg.mode}; drafts need --mode spec"
            )
        if settings.layers is not None and settings.layers != cfg.k:
            raise ValueError(
                f"adaptive.speculative.layers: {settings.layers}, but the adapter was trained "
                f"for a draft depth of {cfg.k} (leave layers out)"
            )
        parts = model.adaptive_parts()
        w = parts.embedding.weight
        self.adapters = adapters.to(device=w.device, dtype=w.dtype).eval()
        self.depth = cfg.k
        self.head = DraftHead(model, settings.head_precision)
        self.name = f"m2r2-k{cfg.k}-r{cfg.rank}"
        self.meta = meta
        require_recipes(parts.layers[: self.depth], "the M2R2 draft")
        self.embed = parts.embed
        self.layers = list(parts.layers[: self.depth])
        self.norm = parts.final_norm

    def forward(self, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Final-normed accelerated stream of one draft position (rows = requests)."""
        p = self.embed(token_ids)
        for i, layer in enumerate(self.layers):
            p = accelerated_block(layer, self.adapters, i, positions, p)
        return self.norm(p)

    def resident_bytes(self) -> int:
        params = sum(t.numel() * t.element_size() for t in self.adapters.parameters())
        return params + self.head.resident_bytes()
