"""M2R2's accelerated stream against the EAGLE-3 head on the head's own held-out prompts, per
drafted token and per byte read (docs/speculative.md, "M2R2 on the head's data").

    python docs/experiments/m2r2_vs_eagle3.py MODEL EAGLE3_DATA_DIR PROMPT_LEN \
        "label=ADAPTER_DIR" ["label=ADAPTER_DIR" ...]

For each adapter (and the early exit at the same depth, zero adapters): the fraction of the
continuation positions of each held-out window (tokens PROMPT_LEN.. of ``eval.pt``, the target's
greedy text) where the accelerated stream's argmax is the target's own greedy token: the
acceptance of a first drafted position, teacher-forced, as the EAGLE-3 trainer's held-out
curve reports it. Also each draft's parameters read per drafted token against a target step.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM

from vllm_adaptive.m2r2.adapters import M2R2Adapters
from vllm_adaptive.m2r2.reference import draft_logits, slow_forward


def main() -> None:
    model_dir, data_dir, prompt_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    windows = torch.load(f"{data_dir}/eval.pt", weights_only=True)["tokens"].long()
    greedy = slow_forward(model, windows, kv_layers=0).greedy  # target argmax at each position
    cont = slice(prompt_len - 1, windows.shape[1] - 1)  # positions drafting continuation tokens
    cfg = model.config
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    head = cfg.vocab_size * cfg.hidden_size
    target = cfg.num_hidden_layers * layer + head
    print(f"target step: {target / 1e6:.1f}M parameters ({cfg.num_hidden_layers} layers, head)")
    for spec in sys.argv[4:]:
        label, path = spec.split("=", 1)
        adapters, _ = M2R2Adapters.load(path, model_dir=model_dir)
        k = adapters.config.k
        rows = [("early exit", M2R2Adapters.zeros(adapters.config)), (label, adapters)]
        for name, a in rows:
            logits = draft_logits(model, a, windows)
            hit = (logits.argmax(-1) == greedy)[:, cont].float().mean().item()
            adapter = sum(p.numel() for p in a.parameters())
            read = k * layer + head + adapter
            print(f"{name} (k {k}): first-position acceptance {hit:.3f}; reads "
                  f"{read / 1e6:.1f}M parameters per drafted token ({read / target:.1%} of a "
                  f"target step)")  # fmt: skip


if __name__ == "__main__":
    main()
