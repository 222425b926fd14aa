"""The logit-lens oracle: how deep a token must go before a plain readout already says what the
full model says, on held-out text (transformers, float32, no vLLM).

The plain logit lens reads an intermediate block output ``h_l`` through the model's own final
norm and LM head. Per token, two zero-error exits bound what any exit rule without trained
readouts can save:

- "first match": the first layer whose lens argmax equals the final greedy token (an oracle
  that knows where to stop);
- "stable": the first layer from which every later layer also matches (a rule that stops once
  the answer has settled).

Both are reported as the mean fraction of layers run, per corpus, with the per-layer agreement
curve. The last layer always matches (it is the model's output), which the pass checks.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI parser imports this module: keep torch out of it
    import torch


@dataclass
class OracleResult:
    """One model on one text."""

    corpus: str
    num_layers: int
    tokens: int
    agreement: list[float]  # [L]: fraction of tokens whose lens at layer l+1 matches the final
    first_match: float  # mean fraction of layers run, exiting at the first match
    stable: float  # mean fraction of layers run, exiting where all later layers match


def oracle_depths(match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the 1-based first-match and stable depths from ``match`` [L, N] bool (row l is
    layer l+1; the last row must be all True)."""
    import torch

    num_layers = match.shape[0]
    if not bool(match[-1].all()):
        raise ValueError("the last layer's lens must match the final token everywhere")
    layer = torch.arange(1, num_layers + 1).unsqueeze(1).expand_as(match)
    big = torch.full_like(layer, num_layers + 1)
    first = torch.where(match, layer, big).min(dim=0).values
    # stable: one past the deepest mismatch (0 mismatches: depth 1)
    deepest_miss = torch.where(~match, layer, torch.zeros_like(layer)).max(dim=0).values
    stable = deepest_miss + 1
    return first, stable


def lens_match(model, windows: list[list[int]], score: int, bos: int | None) -> torch.Tensor:
    """[L, N] bool: does the plain lens at each block output give the final greedy token, for
    the last ``score`` positions of every window. ``bos`` is prepended (not scored) when the
    model's tokenizer adds one to every prompt (Gemma degenerates without it)."""
    import torch

    with torch.no_grad():
        return _lens_match(model, windows, score, bos)


def _lens_match(model, windows: list[list[int]], score: int, bos: int | None) -> torch.Tensor:
    import torch

    inner = model.model
    layers = list(inner.layers)
    outs: list[torch.Tensor] = [None] * len(layers)  # type: ignore[list-item]

    def hook(i):
        def fn(_module, _args, output):
            outs[i] = output[0] if isinstance(output, tuple) else output

        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    head = model.get_output_embeddings()
    rows = []
    try:
        for w in windows:
            ids = ([bos] if bos is not None else []) + list(w)
            logits = model(torch.tensor([ids])).logits[0, -score:].float()
            final = logits.argmax(-1)
            per_layer = []
            for h in outs:
                lens = head(inner.norm(h[0, -score:])).float()
                per_layer.append(lens.argmax(-1) == final)
            rows.append(torch.stack(per_layer))
    finally:
        for h in handles:
            h.remove()
    return torch.cat(rows, dim=1)


def summarize(corpus: str, match: torch.Tensor) -> OracleResult:
    first, stable = oracle_depths(match)
    num_layers = match.shape[0]
    return OracleResult(
        corpus=corpus,
        num_layers=num_layers,
        tokens=int(match.shape[1]),
        agreement=[round(float(x), 4) for x in match.float().mean(dim=1)],
        first_match=round(float(first.float().mean()) / num_layers, 4),
        stable=round(float(stable.float().mean()) / num_layers, 4),
    )


def run_oracle(
    model_dir: str | Path,
    corpora: list[str | Path],
    windows: int = 8,
    window: int = 256,
    score: int = 192,
    progress: bool = True,
) -> list[OracleResult]:
    """The oracle on the evaluation part (the last 10%) of each corpus file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_adaptive.corpora import prompt_bos, read_corpus, token_windows

    if not 0 < score <= window:
        raise ValueError(f"score must be in 1..window ({window}), got {score}")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    bos = prompt_bos(tok)
    results = []
    for path in corpora:
        text = read_corpus(path).eval_text
        ids = tok(text, add_special_tokens=False)["input_ids"]
        t0 = time.perf_counter()
        match = lens_match(model, token_windows(ids, window, windows), score, bos)
        results.append(summarize(str(path), match))
        if progress:
            r = results[-1]
            print(
                f"[oracle] {Path(path).name}: {r.tokens} tokens, first match {r.first_match:.3f}"
                f", stable {r.stable:.3f} of {r.num_layers} layers "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    return results


def plot(results: list[OracleResult], title: str, out: Path) -> None:
    """Per-layer agreement of the plain lens with the final token, one line per corpus."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in results:
        xs = range(1, r.num_layers + 1)
        label = f"{Path(r.corpus).name} (first {r.first_match:.2f}, stable {r.stable:.2f})"
        ax.plot(xs, r.agreement, marker=".", label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("lens argmax = final greedy token")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def add_oracle_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="checkpoint directory, or a name `models prepare` knows"
    )
    parser.add_argument(
        "--corpus", nargs="+", required=True, help="text files; their last 10%% is read"
    )
    parser.add_argument("--windows", type=int, default=8, help="token windows per corpus")
    parser.add_argument("--window", type=int, default=256, help="tokens per window")
    parser.add_argument("--score", type=int, default=192, help="scored positions per window")
    parser.add_argument("--out", default=None, help="JSON file (default: print it)")
    parser.add_argument("--plot", default=None, help="PNG of the per-layer agreement")


def run_from_args(args: argparse.Namespace) -> int:
    model = Path(args.model)
    if not model.is_dir():
        from vllm_adaptive.model_zoo import prepare

        model = prepare(args.model, quiet=True)
    results = run_oracle(model, args.corpus, args.windows, args.window, args.score)
    report = {
        "model": str(model),
        "lens": "plain: the final norm and LM head on each block output, float32",
        "windows": args.windows,
        "window": args.window,
        "score": args.score,
        "results": [asdict(r) for r in results],
    }
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    if args.plot:
        plot(results, f"plain logit lens: {model.name}", Path(args.plot))
    return 0
