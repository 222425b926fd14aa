"""Quality of a MoEfied model against its dense model on held-out text (transformers, float32,
no vLLM): teacher-forced perplexity on the corpus and top-1 agreement with the dense model's
greedy token at every position, for several top-k, with the trained router and with the oracle
router (the experts with the largest output contribution on each token: a reference, not a
runtime option). Also the router's recall of the oracle top-k on the same text, measured on the
MoE model's own residual stream.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vllm_adaptive.moe.reference import load_moefied, moefied_mlps, set_routing


def eval_windows(tok, path: str | Path, windows: int, window: int) -> list[list[int]]:
    from vllm_adaptive.corpora import read_corpus, token_windows

    ids = tok(read_corpus(path).eval_text, add_special_tokens=False)["input_ids"]
    return token_windows(ids, window, windows)


@torch.no_grad()
def logits_of(
    model, windows: list[list[int]], bos: int | None, desc: str, progress: bool
) -> list[torch.Tensor]:
    """Per window, [window-1, vocab] log-probabilities predicting tokens 1..window-1."""
    out = []
    for w in tqdm(windows, desc=desc, disable=not progress, file=sys.stderr, leave=False):
        ids = ([bos] if bos is not None else []) + list(w)
        logits = model(torch.tensor([ids])).logits[0].float()
        logits = logits[1:] if bos is not None else logits
        out.append(F.log_softmax(logits[:-1], dim=-1))
    return out


def score(
    logprobs: list[torch.Tensor], windows: list[list[int]], dense_top1: list[torch.Tensor] | None
) -> dict[str, float]:
    nll, agree, n = 0.0, 0, 0
    for lp, w, ref in zip(logprobs, windows, dense_top1 or [None] * len(windows), strict=True):
        target = torch.tensor(w[1:])
        nll += float(-lp.gather(1, target[:, None]).sum())
        if ref is not None:
            agree += int((lp.argmax(-1) == ref).sum())
        n += len(target)
    out = {"ppl": round(float(torch.exp(torch.tensor(nll / n))), 4), "tokens": n}
    if dense_top1 is not None:
        out["agreement"] = round(agree / n, 4)
    return out


def run_quality(
    model_dir: str | Path,
    dense_dir: str | Path,
    corpora: list[str | Path],
    ks: list[int] | None = None,
    windows: int = 12,
    window: int = 256,
    progress: bool = True,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_adaptive.corpora import prompt_bos
    from vllm_adaptive.moe.moefy import ks_for

    model_dir, dense_dir = Path(model_dir), Path(dense_dir)
    dense = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval()
    moe = load_moefied(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    experts = int(config["num_local_experts"])
    ks = ks or ks_for(experts)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    bos = prompt_bos(tok)
    result: dict[str, Any] = {
        "label": "MoE upcycled from the dense model by vllm-adaptive (not a trained MoE)",
        "model": str(model_dir),
        "dense": str(dense_dir),
        "num_local_experts": experts,
        "moe_intermediate_size": int(config["moe_intermediate_size"]),
        "shipped_top_k": int(config["num_experts_per_tok"]),
        "windows": windows,
        "window": window,
        "dtype": "float32 (weights read from the bfloat16 checkpoints)",
        "corpora": {},
    }
    t0 = time.perf_counter()
    for path in corpora:
        name = Path(path).stem
        ws = eval_windows(tok, path, windows, window)
        dense_lp = logits_of(dense, ws, bos, f"{name} dense", progress)
        top1 = [lp.argmax(-1) for lp in dense_lp]
        rows: dict[str, Any] = {"dense": score(dense_lp, ws, None)}
        del dense_lp
        for mode in ("router", "oracle", "neuron_oracle"):
            for k in ks:
                if mode != "router" and k == experts:
                    continue  # every expert: no routing, the router row already measures it
                track = mode == "router" and k < experts
                set_routing(moe, top_k=k, mode=mode, track=track, apply=True)
                lp = logits_of(moe, ws, bos, f"{name} {mode} k={k}", progress)
                row = score(lp, ws, top1)
                row["ppl_vs_dense"] = round(row["ppl"] / rows["dense"]["ppl"] - 1.0, 4)
                if track:
                    row.update(_recall(moe))
                rows[f"{mode}_k{k}"] = row
                if progress:
                    print(f"[moe quality] {name} {mode} k={k}: {_brief(row)}", file=sys.stderr)
        # the router's recall where a predictor would see it: on the dense model's own stream
        for k in ks:
            if k < experts:
                set_routing(moe, top_k=k, mode="router", track=True, apply=False)
                logits_of(moe, ws, bos, f"{name} recall k={k} (dense stream)", progress)
                rows[f"dense_stream_recall_k{k}"] = _recall(moe)
                if progress:
                    print(
                        f"[moe quality] {name} dense-stream recall k={k}: "
                        f"{rows[f'dense_stream_recall_k{k}']['router_recall']}",
                        file=sys.stderr,
                    )
        result["corpora"][name] = {"path": str(path), "rows": rows}
    set_routing(
        moe, top_k=int(config["num_experts_per_tok"]), mode="router", track=False, apply=True
    )
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def _recall(moe) -> dict[str, Any]:
    """The router's recall of the oracle top-k (mean over layers), and how often the busiest
    expert of a layer is picked (fraction of tokens; k/E when the load is perfectly even)."""
    mlps = moefied_mlps(moe)
    load = torch.tensor([m.stats.expert_counts for m in mlps], dtype=torch.float)
    tokens = torch.tensor([max(m.stats.tokens, 1) for m in mlps], dtype=torch.float)
    busiest = load.max(1).values / tokens
    return {
        "router_recall": round(sum(m.stats.recall for m in mlps) / len(mlps), 4),
        "router_recall_per_layer": [round(m.stats.recall, 4) for m in mlps],
        "busiest_expert_token_fraction": {
            "max": round(float(busiest.max()), 4),
            "mean_over_layers": round(float(busiest.mean()), 4),
        },
    }


def _brief(row: dict[str, Any]) -> str:
    keys = ("ppl", "ppl_vs_dense", "agreement", "router_recall")
    return " ".join(f"{k} {row[k]}" for k in keys if k in row)


def smallest_k_within(result: dict[str, Any], tolerance: float) -> int | None:
    """The smallest router k whose perplexity is within ``tolerance`` (relative) of the dense
    model's on every corpus."""
    experts = result["num_local_experts"]
    for k in range(1, experts + 1):
        rows = [c["rows"].get(f"router_k{k}") for c in result["corpora"].values()]
        if all(r is not None and r["ppl_vs_dense"] <= tolerance for r in rows):
            return k
    return None


def plot_quality(results: list[dict[str, Any]], out: Path) -> None:
    """Perplexity against k, router (solid) and oracle (dashed), the dense model dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.0))
    for ax, metric in zip(axes, ("ppl", "agreement"), strict=True):
        for ci, corpus in enumerate(results[0]["corpora"]):
            color = f"C{ci}"
            for r in results:
                rows = r["corpora"][corpus]["rows"]
                e = r["num_local_experts"]
                style = (
                    "-"
                    if len(results) == 1
                    else ("-" if e == results[0]["num_local_experts"] else "-.")
                )
                for mode, ls in (("router", style), ("oracle", "--"), ("neuron_oracle", ":")):
                    if mode == "neuron_oracle" and r is not results[0]:
                        continue
                    pts = sorted(
                        (int(key.split("_k")[1]) / e, row[metric])
                        for key, row in rows.items()
                        if key.split("_k")[0] == mode
                    )
                    if mode != "router":
                        pts.append((1.0, rows[f"router_k{e}"][metric]))
                    xs, ys = zip(*pts, strict=True)
                    label = f"{corpus} {mode.replace('_', '-')}" + (
                        "" if mode == "neuron_oracle" else f" (E={e})"
                    )
                    marker = "." if mode == "neuron_oracle" else "o"
                    ax.plot(xs, ys, ls, color=color, marker=marker, label=label)
            if metric == "ppl":
                ax.axhline(
                    results[0]["corpora"][corpus]["rows"]["dense"]["ppl"],
                    color=color,
                    ls=(0, (1, 4)),
                    lw=0.8,
                    label=f"{corpus} dense",
                )
        ax.set_xlabel("fraction of experts active (k / E)")
        ax.set_ylabel("perplexity" if metric == "ppl" else "top-1 agreement with dense")
        if metric == "ppl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        "MoEfied SmolLM2-135M (upcycled from dense by the project, not a trained MoE)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
