"""MoEfy a dense Llama offline: split each MLP's neurons into equal experts by co-activation and
train a router per layer (transformers + torch, no vLLM). The result is an MoE *upcycled from
the dense model by this project*, not a trained MoE.

Steps, per layer ``i`` (all seeded, one thread is enough):

1. Calibration: the dense model runs over windows of the calibration part (the first 90%) of
   each corpus file; a pre-hook keeps every MLP input ``x`` (after ``post_attention_layernorm``).
   The intermediate activations ``a = act(gate(x)) * up(x)`` are recomputed from ``x`` when
   needed (the MLP is a function of its input alone), so only ``x`` is stored.
2. Clustering: every neuron's profile is its ``|a|`` over ``profile_tokens`` calibration tokens,
   scaled to unit L2 norm (co-activation = cosine similarity of profiles). Balanced spherical
   k-means: k-means++ seeding, then alternate (a) a capacity-constrained greedy assignment (the
   neurons most certain of their best centroid, by the margin between their best and second-best
   similarity, choose first; a full centroid takes no more) and (b) centroids = normalized mean
   member profile, until the assignment stops changing. Every expert gets exactly I/E neurons.
3. Permutation: neurons sorted by expert (stable), so expert ``e`` is the contiguous block
   ``e*m:(e+1)*m`` of gate/up rows and down columns. The permuted dense model computes the same
   function (only the order of the down projection's sum changes).
4. Router: a bias-free linear ``hidden -> E`` on ``x``, trained with soft-target cross entropy
   against each expert's share of the MLP output, ``c_e / sum_e' c_e'`` with
   ``c_e = ||down_e(a_e)||``.
   One router then ranks experts for every k (a top-k membership target would need one router
   per k), and the ranking it learns is the one the oracle top-k uses. The inputs are scaled per
   feature by their RMS for the optimizer, and the scale is folded back into the weight.
   The last ``router_holdout`` of the calibration tokens are held out of the router's training to
   report its recall of the oracle top-k per layer.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from vllm_adaptive.moe.collect import collect_mlp_inputs
from vllm_adaptive.moe.reference import (
    ARCHITECTURE,
    expert_contributions,
    mlp_intermediate,
    router_key,
    topk_mask,
)

#: The shipped defaults (docs/moe.md, "The MoEfied model"; docs/data/moefied-quality.json).
DEFAULT_EXPERTS = 16
#: The smallest k whose perplexity stays within +5% of the dense model's on both held-out
#: corpora: with this upcycled model that is every expert (k = 15 costs +9% on code, +6% on
#: prose; k = 8 costs 4-7x). A runtime picks its own k (config's num_experts_per_tok).
DEFAULT_TOP_K = 16

SIDECAR = "moefy.json"


@dataclass
class MoefyOptions:
    experts: int = DEFAULT_EXPERTS
    top_k: int = DEFAULT_TOP_K  # written as num_experts_per_tok
    windows_per_corpus: int = 40
    window: int = 256
    profile_tokens: int = 8192
    kmeans_iters: int = 40
    router_steps: int = 400
    router_batch: int = 2048
    router_lr: float = 1e-2
    router_holdout: float = 0.1
    seed: int = 0


# -- calibration --------------------------------------------------------------------------------


def calibration_windows(tok, corpora: list[str | Path], window: int, per_corpus: int):
    """``per_corpus`` windows of ``window`` tokens spread evenly over the calibration part of
    every corpus file, and each file's sha256 and size."""
    from vllm_adaptive.corpora import read_corpus, token_windows

    windows, info = [], []
    for path in corpora:
        cf = read_corpus(path)
        ids = tok(cf.calibration_text, add_special_tokens=False)["input_ids"]
        windows.extend(token_windows(ids, window, per_corpus))
        info.append({"path": str(path), "sha256": cf.sha256, "calibration_tokens": len(ids)})
    return windows, info


# -- clustering ---------------------------------------------------------------------------------


def neuron_profiles(a: torch.Tensor) -> torch.Tensor:
    """[I, T]: each neuron's |activation| over the tokens, unit L2 norm."""
    p = a.abs().T.contiguous()
    return p / p.norm(dim=1, keepdim=True).clamp(min=1e-12)


def balanced_assign(sim: np.ndarray, capacity: int) -> np.ndarray:
    """Greedy capacity-constrained assignment of rows to columns of ``sim`` [n, E]: rows with
    the largest margin between their best and second-best column choose first; each takes its
    most similar column with room left. Deterministic (stable sorts)."""
    n, e = sim.shape
    if n != capacity * e:
        raise ValueError(f"{n} rows do not fill {e} columns of {capacity}")
    part = np.sort(sim, axis=1)
    margin = part[:, -1] - (part[:, -2] if e > 1 else 0.0)
    order = np.argsort(-margin, kind="stable")
    prefs = np.argsort(-sim, axis=1, kind="stable")
    room = np.full(e, capacity)
    labels = np.empty(n, dtype=np.int64)
    for r in order:
        for c in prefs[r]:
            if room[c]:
                room[c] -= 1
                labels[r] = c
                break
    return labels


def balanced_kmeans(profiles: torch.Tensor, k: int, iters: int, seed: int) -> np.ndarray:
    """Balanced spherical k-means of the rows of ``profiles`` (unit vectors) into ``k`` clusters
    of exactly ``n/k`` rows; k-means++ seeding from ``seed``."""
    n = profiles.shape[0]
    if n % k:
        raise ValueError(f"{n} neurons are not divisible into {k} equal experts")
    g = torch.Generator().manual_seed(seed)
    x = profiles.float()
    centers = [int(torch.randint(n, (1,), generator=g))]
    dist = 1.0 - x @ x[centers[0]]
    for _ in range(1, k):
        prob = dist.clamp(min=0) ** 2
        if float(prob.sum()) <= 0:
            prob = torch.ones(n)
        c = int(torch.multinomial(prob, 1, generator=g))
        centers.append(c)
        dist = torch.minimum(dist, 1.0 - x @ x[c])
    cent = x[centers].clone()
    labels = None
    for _ in range(iters):
        new = balanced_assign((x @ cent.T).numpy(), n // k)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        lab = torch.from_numpy(labels)
        cent = torch.zeros_like(cent).index_add_(0, lab, x)
        cent = cent / cent.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return labels


def expert_permutation(labels: np.ndarray) -> torch.Tensor:
    """Neuron order with expert 0's neurons first, then expert 1's, ... (stable within one)."""
    return torch.from_numpy(np.argsort(labels, kind="stable"))


def permute_mlp_(mlp, perm: torch.Tensor) -> None:
    """Permute a Llama MLP's intermediate neurons in place (gate/up rows, down columns)."""
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(mlp.gate_proj.weight[perm])
        mlp.up_proj.weight.copy_(mlp.up_proj.weight[perm])
        mlp.down_proj.weight.copy_(mlp.down_proj.weight[:, perm])


# -- router -------------------------------------------------------------------------------------


def contribution_shares(mlp, x: torch.Tensor, experts: int, chunk: int = 4096) -> torch.Tensor:
    """[N, E]: each expert's L2-norm contribution to the (permuted) MLP output, per token."""
    out = []
    with torch.no_grad():
        for s in range(0, x.shape[0], chunk):
            a = mlp_intermediate(mlp, x[s : s + chunk])
            out.append(expert_contributions(mlp.down_proj.weight, a, experts))
    return torch.cat(out)


def recall_at(router_logits: torch.Tensor, contrib: torch.Tensor, k: int) -> float:
    """Mean over tokens of |router top-k & oracle top-k| / k."""
    hit = topk_mask(router_logits, k) & topk_mask(contrib, k)
    return float(hit.sum()) / (k * router_logits.shape[0])


def train_router(
    x: torch.Tensor, contrib: torch.Tensor, opts: MoefyOptions, seed: int
) -> torch.Tensor:
    """Router weight [E, hidden] fit on (x, contribution) pairs: soft-target cross entropy against
    the shares ``contrib / contrib.sum(-1)``, minibatch Adam with cosine decay."""
    g = torch.Generator().manual_seed(seed)
    x, contrib = x.float(), contrib.float()
    scale = x.pow(2).mean(0).sqrt().clamp(min=1e-6)
    xs = x / scale
    target = contrib / contrib.sum(-1, keepdim=True).clamp(min=1e-12)
    e = contrib.shape[1]
    w = torch.zeros(e, x.shape[1], requires_grad=True)
    opt = torch.optim.Adam([w], lr=opts.router_lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, opts.router_steps)
    n = x.shape[0]
    for _ in range(opts.router_steps):
        idx = torch.randint(n, (min(opts.router_batch, n),), generator=g)
        loss = F.cross_entropy(xs[idx] @ w.T, target[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return (w.detach() / scale).contiguous()


# -- the whole build ----------------------------------------------------------------------------


def ks_for(experts: int) -> list[int]:
    """E/8, E/4, E/2, E (those that are at least 1), the k the quality report sweeps."""
    return sorted({max(1, experts // d) for d in (8, 4, 2, 1)})


def moefy_model(
    model, mlp_inputs: list[torch.Tensor], opts: MoefyOptions, progress: bool = True
) -> dict[str, Any]:
    """Permute every MLP of ``model`` in place and train the routers from the stored MLP inputs.
    Returns ``routers`` ([E, hidden] float32 per layer), ``permutations`` and per-layer stats
    (router recall on the held-out calibration tokens, the oracle top-k's share of the output
    norm)."""
    e = opts.experts
    layers = list(model.model.layers)
    routers, perms, stats = [], [], []
    ks = ks_for(e)
    for i, layer in enumerate(
        tqdm(layers, desc="clustering + routers", disable=not progress, file=sys.stderr)
    ):
        x = mlp_inputs[i]
        n = x.shape[0]
        g = torch.Generator().manual_seed(opts.seed * 1000 + i)
        sample = torch.randperm(n, generator=g)[: min(opts.profile_tokens, n)].sort().values
        with torch.no_grad():
            a = mlp_intermediate(layer.mlp, x[sample])
        labels = balanced_kmeans(neuron_profiles(a), e, opts.kmeans_iters, opts.seed * 1000 + i)
        perm = expert_permutation(labels)
        permute_mlp_(layer.mlp, perm)
        contrib = contribution_shares(layer.mlp, x, e)
        cut = int(n * (1.0 - opts.router_holdout))
        w = train_router(x[:cut], contrib[:cut], opts, opts.seed * 1000 + i)
        logits = x[cut:].float() @ w.T
        held = contrib[cut:]
        total = held.sum(-1)
        stats.append(
            {
                "layer": i,
                "router_recall": {
                    str(k): round(recall_at(logits, held, k), 4) for k in ks if k < e
                },
                "oracle_norm_share": {
                    str(k): round(float((held.topk(k, -1).values.sum(-1) / total).mean()), 4)
                    for k in ks
                    if k < e
                },
            }
        )
        routers.append(w)
        perms.append(perm)
    return {"routers": routers, "permutations": perms, "layers": stats}


def moefied_config(base_config: dict, experts: int, top_k: int) -> dict:
    inter = base_config["intermediate_size"]
    if inter % experts:
        raise ValueError(f"intermediate size {inter} is not divisible by {experts} experts")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts}, got {top_k}")
    cfg = dict(base_config)
    cfg["architectures"] = [ARCHITECTURE]
    cfg["num_local_experts"] = experts
    cfg["num_experts_per_tok"] = top_k
    cfg["moe_intermediate_size"] = inter // experts
    return cfg


def write_moefied(
    src: Path,
    out: Path,
    corpora: list[str | Path],
    opts: MoefyOptions | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Build the MoEfied checkpoint of the dense checkpoint in ``src`` into ``out`` (an existing
    empty directory) from calibration windows of ``corpora``: see :func:`write_from_windows`."""
    from transformers import AutoTokenizer

    from vllm_adaptive.corpora import prompt_bos

    opts = opts or MoefyOptions()
    tok = AutoTokenizer.from_pretrained(str(src))
    windows, corpus_info = calibration_windows(tok, corpora, opts.window, opts.windows_per_corpus)
    return write_from_windows(src, out, windows, opts, prompt_bos(tok), corpus_info, progress)


def write_from_windows(
    src: Path,
    out: Path,
    windows: list[list[int]],
    opts: MoefyOptions,
    bos: int | None = None,
    corpus_info: list[dict] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """model.safetensors (the base tensors, MLPs permuted, plus the routers, in the base's
    dtype), config.json (MoE fields, architecture ``MoefiedLlamaForCausalLM``), ``moefy.json``
    (options, corpora, permutations, per-layer stats) and every other file of ``src`` (tokenizer,
    generation config). Returns the sidecar's summary (with wall times)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(opts.seed)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    inputs = collect_mlp_inputs(model, windows, bos, progress)
    t_collect = time.perf_counter() - t0
    built = moefy_model(model, inputs, opts, progress)
    del inputs

    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    out_state = {name: tensor.contiguous() for name, tensor in state.items()}
    for i, perm in enumerate(built["permutations"]):
        pre = f"model.layers.{i}.mlp."
        for proj in ("gate_proj", "up_proj"):
            out_state[pre + proj + ".weight"] = state[pre + proj + ".weight"][perm].contiguous()
        down = state[pre + "down_proj.weight"]
        out_state[pre + "down_proj.weight"] = down[:, perm].contiguous()
        out_state[router_key(i)] = built["routers"][i].to(down.dtype).contiguous()
    save_file(out_state, str(out / "model.safetensors"), metadata={"format": "pt"})

    base_config = json.loads((src / "config.json").read_text())
    config = moefied_config(base_config, opts.experts, opts.top_k)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            if not f.name.startswith("vllm_adaptive_manifest"):
                (out / f.name).write_bytes(f.read_bytes())
    ks = [k for k in ks_for(opts.experts) if k < opts.experts]
    layers = built["layers"]
    summary = {
        "label": "MoE upcycled from the dense model by vllm-adaptive (not a trained MoE)",
        "method": {
            "clustering": "balanced spherical k-means on unit-norm |act(gate(x))*up(x)| "
            "profiles (co-activation), greedy capacity-constrained assignment",
            "router": "bias-free linear on the MLP input; soft-target cross entropy against each "
            "expert's share of the L2 norm of the MLP output",
            "routing": "top-k of the router logits; output = sum of the selected experts' "
            "outputs (no gate weights)",
        },
        "options": asdict(opts),
        "corpora": corpus_info or [],
        "calibration_tokens": sum(len(w) for w in windows),
        "mean_router_recall_heldout_calibration": {
            str(k): round(float(np.mean([s["router_recall"][str(k)] for s in layers])), 4)
            for k in ks
        },
        "mean_oracle_norm_share": {
            str(k): round(float(np.mean([s["oracle_norm_share"][str(k)] for s in layers])), 4)
            for k in ks
        },
        "layers": layers,
    }
    sidecar = dict(summary)
    sidecar["permutations"] = [p.tolist() for p in built["permutations"]]
    (out / SIDECAR).write_text(json.dumps(sidecar) + "\n")
    # wall times stay out of the sidecar, so that the build's files are deterministic
    summary["seconds"] = {
        "calibration": round(t_collect, 1),
        "total": round(time.perf_counter() - t0, 1),
    }
    return summary
