"""An EAGLE-3 head's greedy acceptance per corpus, counted two ways on the same continuations:
at every chain start (what `vllm-adaptive train draft` reports) and along the chain starts a
server visits (vLLM drafts again only after each verification, one position past the last
accepted token), which puts more starts right after a rejection.

    python docs/experiments/eagle3_served_acceptance.py MODEL HEAD CORPUS [CORPUS ...] \
        [--prompts 16] [--prompt-len 100] [--new-tokens 64] [--k 3] [--out result.json]

The target runs in float32 with transformers, as a float32 server's target computes (the fp16
gear's text is identical to it on the bench's prompts); prompts come from each corpus' eval
split, like the bench's held-out prompts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def load_head(head_dir: Path, embed: torch.Tensor):
    from vllm_adaptive.speculative.eagle3_draft import Eagle3Draft
    from vllm_adaptive.speculative.eagle3_head import load_head as load_saved

    cfg, state, draft_ids = load_saved(head_dir)
    head = Eagle3Draft(cfg, embed)
    head.load_state_dict(state)
    return head.eval(), draft_ids, cfg


def leading_accepted(head, tokens, aux, draft_ids, k: int) -> torch.Tensor:
    """[B, T] the number of leading drafted tokens of chain ``p`` equal to the reference."""
    with torch.no_grad():
        outs = head.ttt(tokens, aux, k)
    B, T = tokens.shape
    ok = torch.ones(B, T, dtype=torch.bool)
    n = torch.zeros(B, T, dtype=torch.long)
    for j, out in enumerate(outs):
        ref = torch.full_like(tokens, -1)
        ref[:, : max(T - j - 2, 0)] = tokens[:, j + 2 :]
        ok = ok & (draft_ids[out.logits.argmax(-1)] == ref)
        n += ok.long()
    return n


def rates(n_list: list[int], k: int) -> dict:
    chains = len(n_list)
    per_pos = [sum(n > j for n in n_list) / max(chains, 1) for j in range(k)]
    return {
        "chains": chains,
        "per_position": per_pos,
        "mean_accepted": sum(per_pos),
        "per_drafted_token": sum(per_pos) / k,
    }


def main() -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from vllm_adaptive.corpora import prompt_bos, read_corpus, spread_windows
    from vllm_adaptive.speculative.eagle3_data import greedy_continuations

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("head")
    ap.add_argument("corpus", nargs="+")
    ap.add_argument("--prompts", type=int, default=16, help="per corpus")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    torch.set_num_threads(2)
    model = LlamaForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(a.model)
    head, draft_ids, cfg = load_head(Path(a.head), model.model.embed_tokens.weight.detach())
    layers = list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    bos = prompt_bos(tok)
    eos = tok.eos_token_id
    result = {"model": a.model, "head": a.head, "k": a.k, "aux_layers": layers, "corpora": {}}
    for path in a.corpus:
        cf = read_corpus(path)
        ids = tok(cf.eval_text, add_special_tokens=False)["input_ids"]
        body = a.prompt_len - (1 if bos is not None else 0)
        prompts = [w[:body] for w in spread_windows(ids, body + a.new_tokens, a.prompts)]
        if bos is not None:
            prompts = [[bos, *p] for p in prompts]
        ev = greedy_continuations(model, torch.tensor(prompts), a.new_tokens, layers)
        tokens, aux = ev["tokens"].long(), ev["aux"].float()
        n = leading_accepted(head, tokens, aux, draft_ids, a.k)
        B, T = tokens.shape
        every, walk = [], []
        for b in range(B):
            gen = tokens[b, a.prompt_len :].tolist()
            end = a.prompt_len + (gen.index(eos) if eos in gen else len(gen)) - 1
            last = end - a.k - 1  # chains whose k references exist before the end
            p_all = range(a.prompt_len - 1, last + 1)
            every += [int(n[b, p]) for p in p_all]
            p = a.prompt_len - 1
            while p <= last:  # a server's chain starts: one past the last accepted token
                walk.append(int(n[b, p]))
                p += int(n[b, p]) + 1
        result["corpora"][Path(path).name] = {
            "every_start": rates(every, a.k),
            "served_walk": rates(walk, a.k),
        }
        print(Path(path).name, json.dumps(result["corpora"][Path(path).name]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
