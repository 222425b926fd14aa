"""The EAGLE-3 head's training data, drawn from the target alone (transformers, no vLLM): the
target's auxiliary states, top-k logits and greedy tokens over windows of the corpora's
calibration split (cached in shards, resumable), the draft vocabulary, and the held-out greedy
continuations acceptance is measured on (steps 1, 2 and 5 of the recipe in
:mod:`vllm_adaptive.speculative.train_eagle3`)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive.speculative.draft_args import DraftTrainOptions
from vllm_adaptive.speculative.eagle3_draft import DraftTrainError


def choose_draft_vocab(
    greedy_counts: torch.Tensor, token_counts: torch.Tensor, n: int
) -> torch.Tensor:
    """The ``n`` ids most often the target's greedy token (ties: more frequent in the text,
    then the lower id), sorted."""
    if n >= len(greedy_counts):
        raise DraftTrainError(
            f"--draft-vocab {n}: want fewer than the target's {len(greedy_counts)} tokens"
        )
    order = torch.arange(len(greedy_counts))
    for key in (token_counts, greedy_counts):  # stable sorts: the last key is the primary one
        order = order[torch.sort(key[order], descending=True, stable=True).indices]
    return order[:n].sort().values


# -- data -------------------------------------------------------------------------------------
def _aux(hidden_states, layers: list[int]) -> torch.Tensor:
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


#: logits one target forward may hold (rows x seq x vocab, float32): wider shards (a GPU's
#: generation batches) run their teacher-forced pass in row chunks under it
PASS_LOGIT_BYTES = 4 << 30


def target_pass(
    model, ids: torch.Tensor, layers: list[int], topk: int, max_rows: int | None = None
) -> dict[str, torch.Tensor]:
    """The teacher-forced pass of the target over ``ids`` (on the model's device, in row chunks
    whose logits fit :data:`PASS_LOGIT_BYTES`, and of at most ``max_rows``): aux states (bf16),
    top-k logits, greedy tokens, returned on the CPU."""
    rows = max(1, PASS_LOGIT_BYTES // (ids.shape[1] * model.config.vocab_size * 4))
    rows = min(rows, max_rows or rows)
    parts = [_target_pass(model, ids[i : i + rows], layers, topk) for i in range(0, len(ids), rows)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _target_pass(model, ids: torch.Tensor, layers: list[int], topk: int) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(ids.to(model.device), output_hidden_states=True, use_cache=False)
        vals, idx = out.logits.float().topk(topk, dim=-1)
        return {
            "tokens": ids.to(torch.int32).cpu(),
            "aux": _aux(out.hidden_states, layers).to(torch.bfloat16).cpu(),
            "topk_ids": idx.to(torch.int32).cpu(),
            "topk_logits": vals.to(torch.float16).cpu(),
        }


def greedy_continuations(
    model, prompts: torch.Tensor, new_tokens: int, layers: list[int]
) -> dict[str, torch.Tensor]:
    """The target's greedy continuation of each prompt, with its KV cache (as served); the aux
    states come from the same passes. ``aux`` has a zero row for the last token (never read)."""
    prompts = prompts.to(model.device)
    with torch.no_grad():
        out = model(prompts, use_cache=True, output_hidden_states=True)
        auxs = [_aux(out.hidden_states, layers)]
        nxt = out.logits[:, -1].argmax(-1)
        seq = [prompts, nxt[:, None]]
        past = out.past_key_values
        for _ in range(new_tokens - 1):
            out = model(
                nxt[:, None], past_key_values=past, use_cache=True, output_hidden_states=True
            )
            past = out.past_key_values
            auxs.append(_aux(out.hidden_states, layers))
            nxt = out.logits[:, -1].argmax(-1)
            seq.append(nxt[:, None])
        aux = torch.cat(auxs, dim=1)
        aux = torch.cat([aux, torch.zeros_like(aux[:, :1])], dim=1)
        return {
            "tokens": torch.cat(seq, dim=1).to(torch.int32).cpu(),
            "aux": aux.to(torch.bfloat16).cpu(),
        }


def self_windows(model, prompts: torch.Tensor, length: int) -> torch.Tensor:
    """Each prompt continued by the target's greedy tokens to ``length`` tokens: the contexts a
    greedy server drafts in (the target's own text, its repetitions included), rather than
    human text. Runs on the model's device; returns there."""
    prompts = prompts.to(model.device)
    with torch.no_grad():
        out = model(prompts, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
        parts = [prompts, nxt[:, None]]
        for _ in range(length - prompts.shape[1] - 1):
            out = model(nxt[:, None], past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
            parts.append(nxt[:, None])
        return torch.cat(parts, dim=1)


#: ``(model_dir, dtype, max_len) -> windows``: vLLM's engine continuing prompts
#: (``engine.greedy_windows.VllmWindows``, handed in by the CLI: this module imports no vLLM)
WindowsFactory = Callable[[str, torch.dtype, int], Any]


def window_generator(name: str, device: torch.device, vllm_windows: WindowsFactory | None) -> str:
    """``auto``: vLLM where the caller has it and the target runs on the CPU (its engine decodes
    about 2.2x faster than transformers there: ``engine/greedy_windows.py``), else transformers
    (the lent GPU machines have no vLLM)."""
    if name == "auto":
        name = "vllm" if vllm_windows is not None and device.type == "cpu" else "transformers"
    if name not in ("vllm", "transformers"):
        raise DraftTrainError(f"--generator {name!r}: auto, vllm or transformers")
    if name == "vllm" and vllm_windows is None:
        raise DraftTrainError("--generator vllm: vLLM is not installed here")
    return name


def _window_writer(model, opts: DraftTrainOptions, vllm_windows: WindowsFactory | None):
    """What continues a batch of prompts to training windows: vLLM's engine or transformers'
    decode (``opts.generator``, resolved by :func:`window_generator`)."""
    if opts.generator == "vllm":
        return vllm_windows(opts.model, model.dtype, opts.seq_len)
    return lambda ids, length: self_windows(model, ids, length)


@dataclass
class Eagle3Data:
    tokens: torch.Tensor  # [n, T] int32
    aux: torch.Tensor  # [n, T, 3h] bf16
    topk_ids: torch.Tensor  # [n, T, k] int32
    topk_logits: torch.Tensor  # [n, T, k] fp16
    eval_tokens: torch.Tensor  # [m, P + G] int32
    eval_aux: torch.Tensor  # [m, P + G, 3h] bf16
    gen_seconds: float
    gen_tokens: int
    #: [n, T] bool: positions whose next token the loss counts (None: all of them)
    keep: torch.Tensor | None = None


def before_end_of_turn(tokens: torch.Tensor, prompt_len: int, eos: int | None) -> torch.Tensor:
    """``[B, T]``: True where a position's next token is at or before the first end of turn the
    target generated (a server stops there: what follows is never drafted), False after."""
    B, T = tokens.shape
    keep = torch.ones(B, T, dtype=torch.bool)
    if eos is None:
        return keep
    gen = tokens[:, prompt_len:] == eos
    first = torch.where(gen.any(1), gen.float().argmax(1) + prompt_len, torch.full((B,), T))
    return torch.arange(T)[None, :] < first[:, None]


def train_device(name: str) -> torch.device:
    """``auto``: the GPU where torch sees one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise DraftTrainError(f"--device {name!r}: auto, cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise DraftTrainError("--device cuda: torch sees no GPU here (torch.cuda.is_available())")
    return torch.device(name)


def compute_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """``auto``: bfloat16 on a GPU and where the CPU computes it natively (there it is 2-2.5x
    faster for the target pass and the head's step), float32 elsewhere (emulated bf16 is
    slower)."""
    if name == "auto":
        from vllm_adaptive.environment import cpu_flags, native_bf16

        on_gpu = device is not None and device.type == "cuda"
        name = "bfloat16" if on_gpu or native_bf16(cpu_flags()) else "float32"
    if name not in ("float32", "bfloat16"):
        raise DraftTrainError(f"--compute-dtype {name!r}: float32, bfloat16 or auto")
    return getattr(torch, name)


def data_spec(opts: DraftTrainOptions, fingerprint: str, layers: list[int]) -> dict[str, Any]:
    return {
        "target_fingerprint": fingerprint,
        "data_source": opts.data_source,
        "generator": opts.generator if opts.data_source != "text" else None,
        "gen_prompt_len": opts.gen_prompt_len if opts.data_source != "text" else None,
        "compute_dtype": opts.compute_dtype,
        "corpus_sha256": opts.corpus_sha256,
        "tokens": opts.tokens,
        "seq_len": opts.seq_len,
        "topk": opts.topk,
        "aux_layers": layers,
        "data_batch": opts.data_batch,
        "eval_prompts": opts.eval_prompts,
        "eval_prompt_len": opts.eval_prompt_len,
        "eval_new_tokens": opts.eval_new_tokens,
    }


def _chat_ids(tok, text: str, path, count: int, length: int) -> list[list[int]]:
    from vllm_adaptive.chat_prompts import chat_prompt_ids

    try:
        return chat_prompt_ids(tok, text, path, count, length)
    except ValueError as e:
        raise DraftTrainError(f"--data-source chat: {e}") from None


def build_data(
    model,
    tok,
    opts: DraftTrainOptions,
    corpora,
    layers: list[int],
    data_dir: Path,
    spec: dict,
    vllm_windows: WindowsFactory | None = None,
) -> Eagle3Data:
    """Run the target over the training windows and the eval prompts, or read what an earlier
    run with the same spec cached (shards: an interrupted generation continues)."""
    from tqdm import tqdm

    from vllm_adaptive.corpora import prompt_bos, prompt_windows, spread_windows

    spec_path = data_dir / "spec.json"
    if spec_path.is_file() and json.loads(spec_path.read_text()) != spec:
        for f in data_dir.glob("*.pt"):
            f.unlink()
    data_dir.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=1))
    stats_path = data_dir / "stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {"seconds": 0.0}

    chat = opts.data_source == "chat"
    bos = None if chat else prompt_bos(tok)  # a chat template starts its own prompts
    n_windows = max(1, opts.tokens // opts.seq_len)
    # a greedy source reads only its prompts from the text; the target writes the rest
    body = (opts.seq_len if opts.data_source == "text" else opts.gen_prompt_len) - (
        1 if bos is not None else 0
    )
    prompt_body = opts.eval_prompt_len - (1 if bos is not None else 0)
    windows: list[list[int]] = []
    prompts: list[list[int]] = []
    cached = sorted(data_dir.glob("train-*.pt"))
    generates = opts.data_source != "text"
    per_shard = opts.gen_batch if generates else opts.data_batch
    need_train = len(cached) * per_shard < n_windows
    need_eval = not (data_dir / "eval.pt").is_file()
    if need_train or need_eval:
        n = len(corpora)
        for j, cf in enumerate(corpora):
            want = n_windows // n + (1 if j < n_windows % n else 0)
            if need_train and want:
                if chat:
                    got = _chat_ids(tok, cf.calibration_text, cf.path, want, body)
                else:
                    ids = tok(cf.calibration_text, add_special_tokens=False)["input_ids"]
                    windows_of = spread_windows if opts.data_source == "text" else prompt_windows
                    got = windows_of(ids, body, want)
                if len(got) < want:
                    print(
                        f"corpus {cf.path}: {len(ids)} calibration tokens give {len(got)} "
                        f"windows of {body}, not {want}",
                        file=sys.stderr,
                    )
                windows.extend(got)
            pwant = opts.eval_prompts // n + (1 if j < opts.eval_prompts % n else 0)
            if need_eval and pwant and chat:
                prompts.extend(_chat_ids(tok, cf.eval_text, cf.path, pwant, prompt_body))
            elif need_eval and pwant:
                eids = tok(cf.eval_text, add_special_tokens=False)["input_ids"]
                span = prompt_body + opts.eval_new_tokens  # prompts spread over the eval text
                prompts.extend(w[:prompt_body] for w in spread_windows(eids, span, pwant))
        if bos is not None:
            windows = [[bos, *w] for w in windows]
            prompts = [[bos, *w] for w in prompts]
        if need_train and not windows:
            raise DraftTrainError("no training window: the corpora are shorter than --seq-len")
        if need_eval and not prompts:
            raise DraftTrainError("no eval prompt: the corpora's eval split is too short")

    t0 = time.time()
    gen_tokens = 0
    if need_train:
        # a greedy source generates in batches of --gen-batch (one shard each): per-step overhead
        # dominates a small target's decode, so wide batches are what make it affordable
        per = per_shard
        chunks = [windows[i : i + per] for i in range(0, len(windows), per)]
        bar = tqdm(
            total=len(windows) * opts.seq_len,
            initial=len(cached) * per_shard * opts.seq_len,
            desc="target pass" if opts.data_source == "text" else f"{opts.data_source} windows",
            unit="tok",
            unit_scale=True,
            disable=not opts.progress,
        )
        windows_of = _window_writer(model, opts, vllm_windows) if generates else None
        # on a CPU, GB-sized logits cost more in page faults than they save in calls
        # (256-token windows, bf16: 1,000 tok/s in chunks of 85 rows, 1,370 in 4s)
        pass_rows = opts.data_batch if model.device.type == "cpu" else None
        try:
            for i in range(len(cached), len(chunks)):
                ids = torch.tensor(chunks[i], dtype=torch.long)
                if windows_of is not None:
                    ids = windows_of(ids, opts.seq_len)
                shard = target_pass(model, ids, layers, opts.topk, pass_rows)
                if chat:
                    eot = tok.eos_token_id
                    shard["keep"] = before_end_of_turn(ids.cpu(), opts.gen_prompt_len, eot)
                torch.save(shard, data_dir / f"train-{i:05d}.pt")
                gen_tokens += ids.numel()
                bar.update(ids.numel())
                stats["seconds"] += time.time() - t0
                t0 = time.time()
                stats_path.write_text(json.dumps(stats))
        finally:
            getattr(windows_of, "close", lambda: None)()
        bar.close()
    if need_eval:
        ev = greedy_continuations(
            model, torch.tensor(prompts, dtype=torch.long), opts.eval_new_tokens, layers
        )
        torch.save(ev, data_dir / "eval.pt")
        stats["seconds"] += time.time() - t0
        stats_path.write_text(json.dumps(stats))
    shards = [torch.load(f, weights_only=True) for f in sorted(data_dir.glob("train-*.pt"))]
    ev = torch.load(data_dir / "eval.pt", weights_only=True)
    keep = [s.get("keep") for s in shards]
    return Eagle3Data(
        keep=None if any(k is None for k in keep) else torch.cat(keep),
        tokens=torch.cat([s["tokens"] for s in shards]),
        aux=torch.cat([s["aux"] for s in shards]),
        topk_ids=torch.cat([s["topk_ids"] for s in shards]),
        topk_logits=torch.cat([s["topk_logits"] for s in shards]),
        eval_tokens=ev["tokens"],
        eval_aux=ev["aux"],
        gen_seconds=float(stats["seconds"]),
        gen_tokens=gen_tokens,
    )


def eval_valid(tokens: torch.Tensor, prompt_len: int, k: int, eos: int | None) -> torch.Tensor:
    """Chain starts that vLLM could draft from: the chain's first input token (``p + 1``) is a
    generated one, and its ``k`` reference tokens end at the first EOS at the latest."""
    B, T = tokens.shape
    p = torch.arange(T)
    valid = (p >= prompt_len - 1) & (p + k + 1 <= T - 1)
    valid = valid.expand(B, T).clone()
    if eos is not None:
        gen = tokens[:, prompt_len:] == eos
        first = torch.where(gen.any(1), gen.float().argmax(1) + prompt_len, torch.full((B,), T - 1))
        valid &= (p[None, :] + k + 1) <= first[:, None]
    return valid
