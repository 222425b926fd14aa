"""`vllm-adaptive train m2r2`: train M2R2 accelerator adapters (and ARLA routers) on text.

The base model is frozen (float32); only the adapters train. Each step takes ``--batch``
windows of ``--seq-len`` + 1 tokens from the *calibration* part of the corpora (the first 90%
of each file, `corpora.read_corpus`), runs the slow stream (the base model, no grad) and the
accelerated stream(s), and minimises (eq. 3 of the paper, normalised)::

    loss = alpha0 * CE  +  alpha1 * DISTILL  (+ alpha_router * BCE in exit mode)

- CE: cross entropy of lm_head(final_norm(p_gate)) against the labels: ``--labels corpus`` the
  next token of the text (the paper), ``--labels model`` the frozen model's own greedy next
  token (what speculative acceptance measures). Exit mode: mean over gates.
- DISTILL: for every accelerated layer output p_i, the per-token relative squared error
  ||p_i - h_T(i)||^2 / ||h_T(i)||^2 against the slow residual after T(i) = round((i-E)*R + E)
  layers (h_N is the last residual BEFORE the final norm), averaged over tokens and over the
  accelerated layers. Per-token normalisation because the residual norms of this model range
  from ~3 (embeddings) to ~1000 (last layers) and a few "attention sink" tokens reach ~26000:
  a plain MSE would be dominated by those. With it every term is O(1) (zero-adapter value ~ the
  relative distance between h_i and h_T(i)), so alpha1 = 1 balances CE.
- BCE (exit mode): each gate's ARLA router predicts "this gate's accelerated argmax equals the
  full model's greedy token"; the router reads *detached* accelerated states (the router does
  not steer the adapters).

Validation (``--val-windows`` windows of the held-out last 10% of each corpus, so disjoint from
training) every ``--val-every`` steps and at step 0: CE (vs corpus and vs model labels), top-1
agreement of the draft with the full model's greedy token (speculative acceptance proxy), and
the same for the adapter-free early exit at the same depth. Everything goes to
``OUT/metrics.jsonl``; ``OUT/curves.png`` is redrawn at each validation. Checkpoints every
``--save-every`` steps in ``OUT/checkpoint-STEP/`` (adapter safetensors + json, optimizer,
scheduler, RNG, step); ``--resume`` continues from the newest one exactly (the data order is a
function of seed and step only). The final adapter is written to ``OUT/``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive.m2r2.adapters import (
    JSON_NAME,
    TENSORS_NAME,
    AdapterConfig,
    AdapterError,
    M2R2Adapters,
)
from vllm_adaptive.m2r2.args import TrainOptions
from vllm_adaptive.m2r2.objective import (
    Validator,
    labels_for,
    m2r2_losses,
    plot_curves,
    read_metrics,
)
from vllm_adaptive.m2r2.reference import (
    slow_forward,
)

STATE_NAME = "trainer_state.pt"
METRICS_NAME = "metrics.jsonl"
CURVES_NAME = "curves.png"
#: arguments that must match for --resume to continue the same run
_RESUME_KEYS = (
    "mode",
    "k",
    "gates",
    "rank",
    "steps",
    "batch",
    "seq_len",
    "lr",
    "lr_up_ratio",
    "min_lr_ratio",
    "warmup",
    "weight_decay",
    "grad_clip",
    "alpha0",
    "alpha1",
    "alpha_router",
    "labels",
    "seed",
)


# -- data ------------------------------------------------------------------------------------
@dataclass
class M2R2Data:
    train: torch.Tensor  # [n, seq_len + 1] int64
    val: torch.Tensor  # [m, seq_len + 1] int64


def load_data(
    tok, corpora: list[str], seq_len: int, val_windows: int
) -> tuple[M2R2Data, list[str]]:
    """Non-overlapping windows of seq_len + 1 tokens: every window of the calibration part of
    each corpus for training; ``val_windows`` (split over the corpora) spread over the held-out
    evaluation part for validation."""
    from vllm_adaptive.corpora import read_corpus, token_windows

    train, val, shas = [], [], []
    n = len(corpora)
    for j, path in enumerate(corpora):
        cf = read_corpus(path)
        shas.append(cf.sha256)
        ids = tok(cf.calibration_text, add_special_tokens=False)["input_ids"]
        w = seq_len + 1
        count = len(ids) // w
        if count < 1:
            raise ValueError(f"corpus {path}: {len(ids)} training tokens, shorter than one window")
        train.extend(ids[i * w : (i + 1) * w] for i in range(count))
        want = val_windows // n + (1 if j < val_windows % n else 0)
        if want:
            eval_ids = tok(cf.eval_text, add_special_tokens=False)["input_ids"]
            val.extend(token_windows(eval_ids, w, want))
    empty = torch.empty(0, seq_len + 1, dtype=torch.long)
    return M2R2Data(
        torch.tensor(train, dtype=torch.long),
        torch.tensor(val, dtype=torch.long) if val else empty,
    ), shas


def load_greedy_data(folder: str | Path, seq_len: int, fingerprint: str) -> tuple[M2R2Data, list]:
    """The token windows of an EAGLE-3 greedy data folder: its training windows (calibration
    prompts continued by the target's greedy tokens) cut to ``seq_len + 1``, and its held-out
    prompts with their greedy continuations for validation. Refused when the data was made
    for another model."""
    folder = Path(folder)
    spec_path = folder / "spec.json"
    if not spec_path.is_file():
        raise AdapterError(
            f"--greedy-data {folder}: no spec.json (not a `train draft` data folder)"
        )
    spec = json.loads(spec_path.read_text())
    if spec.get("data_source") != "greedy":
        raise AdapterError(f"--greedy-data {folder}: made from {spec.get('data_source')!r} data")
    if spec.get("target_fingerprint") != fingerprint:
        raise AdapterError(
            f"--greedy-data {folder} was made for another model (fingerprint "
            f"{str(spec.get('target_fingerprint'))[:12]}, this model {fingerprint[:12]})"
        )
    if spec["seq_len"] < seq_len + 1:
        raise AdapterError(
            f"--greedy-data windows hold {spec['seq_len']} tokens; --seq-len {seq_len} needs "
            f"{seq_len + 1}"
        )
    shards = sorted(folder.glob("train-*.pt"))
    train = torch.cat(
        [torch.load(f, map_location="cpu", weights_only=True)["tokens"] for f in shards]
    )[:, : seq_len + 1]
    val = torch.load(folder / "eval.pt", map_location="cpu", weights_only=True)["tokens"]
    return M2R2Data(train.long().contiguous(), val.long().contiguous()), spec["corpus_sha256"]


def batch_indices(step: int, batch: int, n: int, seed: int) -> torch.Tensor:
    """Window indices of training step ``step`` (0-based): a fresh seeded permutation per epoch,
    so the order depends only on (seed, step) and --resume sees the same batches."""
    idx = []
    for g in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(g, n)
        perm = _perm(n, seed, epoch)
        idx.append(int(perm[pos]))
    return torch.tensor(idx, dtype=torch.long)


_PERM_CACHE: dict[tuple[int, int, int], torch.Tensor] = {}


def _perm(n: int, seed: int, epoch: int) -> torch.Tensor:
    key = (n, seed, epoch)
    if key not in _PERM_CACHE:
        _PERM_CACHE.clear()
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _PERM_CACHE[key] = torch.randperm(n, generator=g)
    return _PERM_CACHE[key]


# -- losses ----------------------------------------------------------------------------------


# -- checkpoints -----------------------------------------------------------------------------
def _checkpoints(out: Path) -> list[tuple[int, Path]]:
    found = []
    for d in out.glob("checkpoint-*"):
        tail = d.name.split("-", 1)[1]
        if d.is_dir() and tail.isdigit() and (d / STATE_NAME).is_file():
            found.append((int(tail), d))
    return sorted(found)


def _rng_state() -> dict[str, Any]:
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(
    out: Path, step: int, adapters, optimizer, scheduler, meta, keep: int, elapsed_s: float
) -> Path:
    final = out / f"checkpoint-{step}"
    tmp = out / f".checkpoint-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    adapters.save(tmp, {**meta, "step": step})
    torch.save(
        {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": _rng_state(),
            "elapsed_s": elapsed_s,
        },
        tmp / STATE_NAME,
    )
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for _, old in _checkpoints(out)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


# -- metrics and curves ----------------------------------------------------------------------


# -- the loop --------------------------------------------------------------------------------
def _lr_lambda(opts: TrainOptions):
    warm = opts.warmup_steps

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        frac = (step - warm) / max(1, opts.steps - warm)
        return opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def _adapter_config(model, opts: TrainOptions) -> AdapterConfig:
    n = int(model.config.num_hidden_layers)
    if opts.mode == "spec":
        return AdapterConfig.from_model_config(model.config, mode="spec", k=opts.k, rank=opts.rank)
    gates = opts.gates or list(range(max(1, n // 5), n, max(1, n // 5)))
    return AdapterConfig.from_model_config(model.config, mode="exit", gates=gates, rank=opts.rank)


UP_PROJECTIONS = ("q_B", "o_B", "mlp_U")


def param_groups(adapters: M2R2Adapters, opts: TrainOptions) -> list[dict[str, Any]]:
    """Up-projections (zero-initialised) train at ``lr * lr_up_ratio`` (LoRA+), the rest at
    ``lr``."""
    up, rest = [], []
    for name, p in adapters.named_parameters():
        (up if name.rsplit(".", 1)[-1] in UP_PROJECTIONS else rest).append(p)
    return [
        {"params": rest, "lr": opts.lr},
        {"params": up, "lr": opts.lr * opts.lr_up_ratio},
    ]


def train(opts: TrainOptions) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_adaptive.artifacts import model_fingerprint

    torch.set_num_threads(opts.threads)
    dev = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.labels not in ("corpus", "model"):
        raise ValueError(f"--labels must be corpus or model, got {opts.labels!r}")

    model = AutoModelForCausalLM.from_pretrained(str(opts.model), dtype=torch.float32)
    model.eval().requires_grad_(False).to(dev)
    tok = AutoTokenizer.from_pretrained(str(opts.model))
    fingerprint = model_fingerprint(opts.model)
    cfg = _adapter_config(model, opts)
    opts.gates = cfg.gates
    if opts.greedy_data:
        data, opts.corpus_sha256 = load_greedy_data(opts.greedy_data, opts.seq_len, fingerprint)
    elif opts.corpus:
        data, opts.corpus_sha256 = load_data(tok, opts.corpus, opts.seq_len, opts.val_windows)
    else:
        raise AdapterError("give --corpus (one or more) or --greedy-data")

    torch.manual_seed(opts.seed)
    adapters = M2R2Adapters.zeros(cfg, seed=opts.seed).to(dev)
    optimizer = torch.optim.AdamW(
        param_groups(adapters, opts), lr=opts.lr, weight_decay=opts.weight_decay, betas=(0.9, 0.99)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(opts))
    args_doc = {k: v for k, v in asdict(opts).items() if k not in ("progress", "stop_after")}
    meta = {
        "model_dir": str(opts.model),
        "model_fingerprint": fingerprint,
        "training_args": args_doc,
        "train_windows": int(data.train.shape[0]),
        "val_windows": int(data.val.shape[0]),
    }

    metrics_path = out / METRICS_NAME
    step = 0
    resumed_elapsed = 0.0
    resumed_val: dict[str, Any] | None = None
    if opts.resume:
        ckpts = _checkpoints(out)
        if ckpts:
            step, cdir = ckpts[-1]
            loaded, cmeta = M2R2Adapters.load(cdir, model_dir=opts.model)
            old = cmeta.get("training_args", {})
            diff = [
                f"{k}: {old.get(k)!r} -> {args_doc.get(k)!r}"
                for k in (*_RESUME_KEYS, "corpus_sha256")
                if old.get(k) != args_doc.get(k)
            ]
            if diff:
                raise AdapterError(f"--resume: {cdir} was trained with other arguments: {diff}")
            adapters.load_state_dict(loaded.state_dict())
            state = torch.load(cdir / STATE_NAME, map_location="cpu", weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            _set_rng_state(state["rng"])
            kept = [r for r in read_metrics(metrics_path) if r["step"] <= step]
            metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            resumed_elapsed = float(state.get("elapsed_s", 0.0))
            resumed_val = next((r for r in reversed(kept) if r["kind"] == "val"), None)
            print(f"resuming from {cdir} at step {step}", file=sys.stderr)
        else:
            print(f"--resume: no checkpoint in {out}, starting at step 0", file=sys.stderr)
            metrics_path.write_text("")
    else:
        for _, old_ckpt in _checkpoints(out):
            shutil.rmtree(old_ckpt)
        for name in (TENSORS_NAME, JSON_NAME, CURVES_NAME):
            (out / name).unlink(missing_ok=True)
        metrics_path.write_text("")

    title = (
        f"M2R2 {cfg.mode} "
        + (f"k={cfg.k}" if cfg.mode == "spec" else f"gates={cfg.gates}")
        + f" rank={cfg.rank} labels={opts.labels} batch={opts.batch}x{opts.seq_len} lr={opts.lr}"
    )

    def log(rec: dict[str, Any]) -> None:
        with metrics_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    validator = (
        Validator(model, cfg, data.val, opts, dev) if data.val.shape[0] and opts.val_every else None
    )
    t0 = time.time() - resumed_elapsed
    last_val: dict[str, Any] | None = resumed_val

    def validate(at: int) -> None:
        nonlocal last_val
        if validator is None:
            return
        adapters.eval()
        rec = validator.run(model, adapters)
        adapters.train()
        rec.update(kind="val", step=at, labels=opts.labels, elapsed_s=time.time() - t0)
        log(rec)
        last_val = rec
        plot_curves(read_metrics(metrics_path), out / CURVES_NAME, title)

    if step == 0:
        validate(0)
    adapters.train()
    bar = tqdm(total=opts.steps, initial=step, desc="m2r2", unit="step", disable=not opts.progress)
    while step < opts.steps:
        idx = batch_indices(step, opts.batch, data.train.shape[0], opts.seed)
        w = data.train[idx].to(dev)
        slow = slow_forward(model, w[:, :-1], kv_layers=cfg.adapted_layers)
        labels = labels_for(w, slow, opts.labels)
        res = m2r2_losses(model, adapters, slow, labels, opts)
        optimizer.zero_grad(set_to_none=True)
        res["loss"].backward()
        gnorm = torch.nn.utils.clip_grad_norm_(adapters.parameters(), opts.grad_clip)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        step += 1
        rec = {
            "kind": "train",
            "step": step,
            "loss": float(res["loss"].detach()),
            "ce": float(res["ce"].detach()),
            "distill": float(res["distill"].detach()),
            "agree": float(res["agree"].detach()),
            "grad_norm": float(gnorm),
            "lr": lr,
            "elapsed_s": time.time() - t0,
        }
        if "bce" in res:
            rec["bce"] = float(res["bce"].detach())
            rec["agree_per_gate"] = res["agree_per_gate"]
        log(rec)
        bar.set_postfix(
            loss=f"{rec['loss']:.3f}",
            ce=f"{rec['ce']:.3f}",
            distill=f"{rec['distill']:.3f}",
            agree=f"{rec['agree']:.3f}",
        )
        bar.update(1)
        del res, slow
        if opts.val_every and (step % opts.val_every == 0 or step == opts.steps):
            validate(step)
        if opts.save_every and (step % opts.save_every == 0 or step == opts.steps):
            elapsed = time.time() - t0
            save_checkpoint(
                out, step, adapters, optimizer, scheduler, meta, opts.keep_checkpoints, elapsed
            )
        if opts.stop_after is not None and step >= opts.stop_after and step < opts.steps:
            bar.close()
            return {"step": step, "stopped": True}
    bar.close()
    final_meta = {**meta, "step": step, "validation": last_val, "train_seconds": time.time() - t0}
    adapters.save(out, final_meta)
    plot_curves(read_metrics(metrics_path), out / CURVES_NAME, title)
    return {"step": step, "stopped": False, "validation": last_val, "out": str(out)}


# -- CLI -------------------------------------------------------------------------------------
def run_from_args(args: argparse.Namespace) -> int:
    opts = TrainOptions(
        model=args.model,
        corpus=list(args.corpus),
        out=args.out,
        mode=args.mode,
        k=args.k,
        gates=args.gates,
        rank=args.rank,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        lr_up_ratio=args.lr_up_ratio,
        min_lr_ratio=args.min_lr_ratio,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        alpha0=args.alpha0,
        alpha1=args.alpha1,
        alpha_router=args.alpha_router,
        labels=args.labels,
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints,
        val_every=args.val_every,
        val_windows=args.val_windows,
        resume=args.resume,
        device=args.device,
        seed=args.seed,
        threads=args.threads,
        progress=not args.no_progress,
        stop_after=args.stop_after,
        greedy_data=args.greedy_data,
    )
    try:
        res = train(opts)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    val = res.get("validation") or {}
    if val:
        print(
            f"validation: ce={val.get('ce_corpus'):.4f} (corpus) {val.get('ce_model'):.4f} "
            f"(model) agree={val.get('agree'):.4f}; early exit: "
            f"ce={val.get('baseline_ce_corpus'):.4f} {val.get('baseline_ce_model'):.4f} "
            f"agree={val.get('baseline_agree'):.4f}",
            file=sys.stderr,
        )
    print(opts.out)
    return 0
