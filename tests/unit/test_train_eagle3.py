"""EAGLE-3 head training (`vllm-adaptive train draft`) on a tiny random Llama target.

The head's forward is checked against an independent step-by-step reference written after
vLLM's code (``llama_eagle3.py``'s layer and model, ``llm_base_proposer.propose``'s chaining
with a KV cache, transformers' rotary embedding); the untrained head against the target itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vllm_adaptive.speculative import eagle3_data as edata
from vllm_adaptive.speculative import eagle3_draft as ed
from vllm_adaptive.speculative import eagle3_head as e3
from vllm_adaptive.speculative import train_eagle3 as te
from vllm_adaptive.speculative.draft_args import DraftTrainOptions

VOCAB = 128
TEXT = (
    "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
    "to be or not to be, that is the question. all that glitters is not gold. "
) * 60


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one thread (two spin-wait on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A 4-layer random Llama (hidden 64, vocab 128, GQA 4/2, rope theta 5000 in transformers
    5's ``rope_parameters``) with a character tokenizer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a less flat target than the default init
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    model.save_pretrained(d)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({chr(c): c for c in range(32, VOCAB - 1)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("corpus") / "text.txt"
    p.write_text(TEXT)
    return p


def _hf(target: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


def _head(target: Path, draft_vocab: int = 48, layers=(1, 2, 3), num_layers: int = 1):
    cfg_t = json.loads((target / "config.json").read_text())
    cfg = e3.head_config(cfg_t, draft_vocab, layers, num_layers)
    model = _hf(target)
    return ed.Eagle3Draft(cfg, model.model.embed_tokens.weight), model


def _randomise(head: ed.Eagle3Draft, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (p.shape[1] ** -0.5))


# -- the forward against a vLLM-shaped reference ----------------------------------------------
def _ref_norm(x, w, eps, residual=None):
    """vLLM RMSNorm.forward_native: with ``residual``, the fused add first; returns (out, sum)."""
    if residual is not None:
        x = x + residual
        residual = x
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return out if residual is None else (out, residual)


def _ref_draft_chain(head: ed.Eagle3Draft, tokens, aux, p: int, k: int, theta: float):
    """vLLM's proposer for one request whose verified tokens end at ``p + 1``: the first pass
    over positions 0..p (input token s + 1 with fc(aux[s])) fills a KV cache; each later step
    is one query at the next position with the drafted (here: the next real) token and the
    previous step's pre-norm hidden, appending its K/V. Rotary from transformers."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    sd = {n: t.detach() for n, t in head.state_dict().items()}
    cfg = head.cfg
    eps, H, KV, D = (
        cfg["rms_norm_eps"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    rot = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=cfg["hidden_size"],
            num_attention_heads=H,
            head_dim=D,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
        )
    )
    lin = lambda name, x: x @ sd[name].T  # noqa: E731
    prefixes = ["midlayer.", *(f"layers.{i}." for i in range(1, cfg["num_hidden_layers"]))]

    def attention(m, x, positions, cache_k, cache_v):
        n = x.shape[0]
        q = lin(m + "self_attn.q_proj.weight", x).view(n, H, D).transpose(0, 1)[None]
        kk = lin(m + "self_attn.k_proj.weight", x).view(n, KV, D).transpose(0, 1)[None]
        v = lin(m + "self_attn.v_proj.weight", x).view(n, KV, D).transpose(0, 1)[None]
        cos, sin = rot(x[None], positions[None])
        q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
        cache_k.append(kk[0].transpose(0, 1))
        cache_v.append(v[0].transpose(0, 1))
        K = torch.cat(cache_k, 0).repeat_interleave(H // KV, 1)  # S, H, D
        V = torch.cat(cache_v, 0).repeat_interleave(H // KV, 1)
        S = K.shape[0]
        qpos = torch.arange(S - n, S)
        scores = torch.einsum("hnd,shd->hns", q[0], K) * D**-0.5
        scores = scores.masked_fill(torch.arange(S)[None, None, :] > qpos[None, :, None], -1e30)
        attn = torch.einsum("hns,shd->nhd", scores.softmax(-1), V).reshape(n, H * D)
        return lin(m + "self_attn.o_proj.weight", attn)

    def layer(ids, hidden, positions, caches):
        hs, residual = hidden, None
        for i, m in enumerate(prefixes):
            if i == 0:  # LlamaDecoderLayer.forward, layer_idx 0, norm_before_residual False
                embeds = _ref_norm(head.embed[ids], sd[m + "input_layernorm.weight"], eps)
                residual = hidden
                x = torch.cat([embeds, _ref_norm(hidden, sd[m + "hidden_norm.weight"], eps)], -1)
            else:  # layer_idx > 0: the fused add of the previous layer's output
                x, residual = _ref_norm(hs, sd[m + "input_layernorm.weight"], eps, residual)
            attn = attention(m, x, positions, *caches[i])
            hs, residual = _ref_norm(attn, sd[m + "post_attention_layernorm.weight"], eps, residual)
            g, u = lin(m + "mlp.gate_proj.weight", hs), lin(m + "mlp.up_proj.weight", hs)
            hs = lin(m + "mlp.down_proj.weight", torch.nn.functional.silu(g) * u)
        # LlamaModel.forward: norm with the fused add; aux_output = the pre-norm sum
        normed, prenorm = _ref_norm(hs, sd["norm.weight"], eps, residual)
        return lin("lm_head.weight", normed), prenorm

    caches = [([], []) for _ in prefixes]
    hidden = lin("fc.weight", aux[: p + 1])  # combine_hidden_states
    ids = tokens[1 : p + 2]  # shifted by one, the last one is the sampled (next) token
    logits, prenorm = layer(ids, hidden, torch.arange(p + 1), caches)
    outs = [(logits[-1], prenorm[-1])]
    hidden = prenorm[-1:]
    for j in range(1, k):
        ids = tokens[p + j + 1 : p + j + 2]
        logits, prenorm = layer(ids, hidden, torch.tensor([p + j]), caches)
        outs.append((logits[-1], prenorm[-1]))
        hidden = prenorm
    return outs


@pytest.mark.parametrize("num_layers", [1, 2])
def test_head_forward_matches_vllm_reference(target: Path, num_layers: int) -> None:
    torch.manual_seed(0)
    head, _ = _head(target, num_layers=num_layers)
    assert len(head.stack()) == num_layers
    _randomise(head)
    T, k = 12, 3
    tokens = torch.randint(3, VOCAB, (2, T))
    aux = torch.randn(2, T, 3 * 64) * 3.0
    with torch.no_grad():
        outs = head.ttt(tokens, aux, k)
        for b in range(2):
            for p in (0, 4, T - k - 1):
                ref = _ref_draft_chain(head, tokens[b], aux[b], p, k, 5000.0)
                for j in range(k):
                    torch.testing.assert_close(
                        outs[j].logits[b, p], ref[j][0], rtol=1e-4, atol=1e-4
                    )
                    torch.testing.assert_close(
                        outs[j].hidden[b, p], ref[j][1], rtol=1e-4, atol=1e-4
                    )
    assert head.cfg["rope_theta"] == 5000.0  # the target's, read from rope_parameters


def test_untrained_head_is_the_target_layer(target: Path) -> None:
    """fc = [0, 0, I] and the decoder layer copied from the target's layer L: the first draft
    step's pre-norm output is the target's residual after L + 1 layers (transformers), which
    also pins hidden_states[i] as vLLM's aux state after i layers."""
    head, model = _head(target, layers=(0, 1, 2))
    draft_ids = torch.arange(3, 51)
    init_state = {n: t.float() for n, t in model.state_dict().items()}
    ed.init_from_target(head, init_state, draft_ids, 2)
    tokens = torch.randint(3, VOCAB, (2, 10))
    with torch.no_grad():
        hs = model(tokens, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[0], hs[1], hs[2]], -1)
        out = head.ttt(tokens, aux, 1)[0]
    torch.testing.assert_close(out.hidden, hs[3], rtol=1e-5, atol=1e-5)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight[draft_ids])
    # two head layers continue the target: from layer 1 they reproduce the state after 3
    head2, _ = _head(target, layers=(0, 0, 1), num_layers=2)
    ed.init_from_target(head2, init_state, draft_ids, 1)
    with torch.no_grad():
        out2 = head2.ttt(tokens, torch.cat([hs[0], hs[0], hs[1]], -1), 1)[0]
    torch.testing.assert_close(out2.hidden, hs[3], rtol=1e-5, atol=1e-5)


# -- vocabulary, loss, acceptance -------------------------------------------------------------
def test_draft_vocab_and_d2t() -> None:
    greedy = torch.tensor([0, 5, 5, 1, 0, 9, 0, 2])
    text = torch.tensor([7, 1, 2, 0, 3, 0, 0, 0])
    ids = edata.choose_draft_vocab(greedy, text, 4)
    assert ids.tolist() == [1, 2, 5, 7]  # 5 (9), 1/2 (5; 1 first, more text), 7 (2)
    d2t, t2d = e3.vocab_maps(ids, 8)
    assert (torch.arange(4) + d2t).tolist() == [1, 2, 5, 7]
    assert t2d.nonzero().flatten().tolist() == [1, 2, 5, 7]
    idx = ed.target_index(ids, 8)
    assert idx.tolist() == [-1, 0, 1, -1, -1, 2, -1, 3]
    with pytest.raises(ed.DraftTrainError, match="fewer"):
        edata.choose_draft_vocab(greedy, text, 8)


def test_acceptance_counts_chains_like_vllm() -> None:
    """A fake head that drafts token t + 2 from chain p exactly except at given places."""

    class Fake:
        def __init__(self, wrong):
            self.wrong = wrong

        def ttt(self, tokens, aux, k):
            outs = []
            for j in range(k):
                want = torch.zeros_like(tokens)
                want[:, : tokens.shape[1] - j - 2] = tokens[:, j + 2 :]
                for b, p, jj in self.wrong:
                    if jj == j:
                        want[b, p] = (want[b, p] + 1) % 10
                outs.append(ed.StepOutput(torch.nn.functional.one_hot(want, 10).float(), None))
            return outs

    tokens = torch.arange(20).view(1, 20) % 10
    valid = edata.eval_valid(tokens, prompt_len=5, k=3, eos=None)
    assert valid[0].nonzero().flatten().tolist() == list(range(4, 16))
    draft_ids = torch.arange(10)
    assert ed.acceptance(Fake([]), tokens, None, valid, draft_ids, 3) == [1.0, 1.0, 1.0]
    # chain 4 misses its first token: its later tokens count as rejected however good
    rates = ed.acceptance(Fake([(0, 4, 0), (0, 6, 2)]), tokens, None, valid, draft_ids, 3)
    assert rates == pytest.approx([11 / 12, 11 / 12, 10 / 12])
    eos_valid = edata.eval_valid(torch.tensor([[3, 3, 3, 3, 3, 4, 4, 4, 2, 4, 4, 4]]), 5, 2, eos=2)
    assert eos_valid[0].nonzero().flatten().tolist() == [4, 5]  # references end at the EOS


def test_served_rates_walk_the_chain_starts_a_server_visits() -> None:
    """A server drafts again one past the last accepted token: from start 0 with 2 accepted it
    next drafts at 3; every-start rates count all starts."""
    n = torch.tensor([[2, 0, 0, 0, 3, 0, 1, 0, 0, 0]])
    valid = torch.ones_like(n, dtype=torch.bool)
    valid[0, 8:] = False
    # served starts: 0 (n 2) -> 3 (n 0) -> 4 (n 3) -> 8: past the last valid start (7)
    assert ed.rates_served(n, valid, 3) == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert ed.rates_every_start(n, valid, 3) == pytest.approx([3 / 8, 2 / 8, 1 / 8])
    assert ed.rates_served(n, torch.zeros_like(valid), 3) == [0.0, 0.0, 0.0]


def test_loss_decreases_on_a_fixed_batch(target: Path) -> None:
    torch.manual_seed(0)
    head, model = _head(target)
    draft_ids = torch.arange(3, 51)
    ed.init_from_target(head, model.state_dict(), draft_ids, 3)
    tokens = torch.randint(3, 51, (2, 16))
    shard = edata.target_pass(model, tokens, [1, 2, 3], 8)
    t2d = ed.target_index(draft_ids, VOCAB)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        outs = head.ttt(tokens, shard["aux"].float(), 3)
        loss = sum(
            0.8**j
            * ed.step_loss(o.logits, j, shard["topk_ids"], shard["topk_logits"], t2d, draft_ids)[0]
            for j, o in enumerate(outs)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses


def test_target_pass_in_row_chunks_equals_one_pass(
    target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wide shards (a GPU's generation batches) run the teacher-forced pass in row chunks
    under a logits budget: the result must be the one-pass result, row for row."""
    _, model = _head(target)
    tokens = torch.randint(3, 51, (5, 16))
    whole = edata.target_pass(model, tokens, [1, 2, 3], 8)
    # two rows of logits per chunk: chunks of 2, 2 and 1 rows
    monkeypatch.setattr(edata, "PASS_LOGIT_BYTES", 2 * 16 * model.config.vocab_size * 4)
    chunked = edata.target_pass(model, tokens, [1, 2, 3], 8)
    assert set(chunked) == set(whole)
    for k in whole:
        assert chunked[k].shape == whole[k].shape and chunked[k].device.type == "cpu"
        torch.testing.assert_close(chunked[k], whole[k], rtol=1e-3, atol=1e-3)
    assert not torch.equal(chunked["aux"][0], chunked["aux"][1])  # rows are not repeated


def test_train_device_resolution() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert edata.train_device("auto").type == expected
    assert edata.train_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ed.DraftTrainError, match="no GPU"):
            edata.train_device("cuda")
    with pytest.raises(ed.DraftTrainError, match="--device"):
        edata.train_device("tpu")
    cuda = torch.device("cuda")
    assert edata.compute_dtype("auto", cuda) == torch.bfloat16  # no CPU flag decides a GPU's
    assert edata.compute_dtype("float32", cuda) == torch.float32


def test_window_generator_resolution() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    factory = object()  # what the CLI hands over where vLLM is installed
    assert edata.window_generator("auto", cpu, factory) == "vllm"
    assert edata.window_generator("auto", cpu, None) == "transformers"
    assert edata.window_generator("auto", cuda, factory) == "transformers"  # the lent GPUs
    assert edata.window_generator("transformers", cpu, factory) == "transformers"
    with pytest.raises(ed.DraftTrainError, match="not installed"):
        edata.window_generator("vllm", cpu, None)
    with pytest.raises(ed.DraftTrainError, match="--generator 'hf'"):
        edata.window_generator("hf", cpu, factory)
    args = (
        __import__("vllm_adaptive.cli", fromlist=["x"])
        .build_parser()
        .parse_args("train draft --model M --corpus a --out H --generator transformers".split())
    )
    assert te.options_from_args(args).generator == "transformers"


# -- the command end to end: data cache, resume, the saved head -------------------------------
def _opts(target: Path, corpus: Path, out: Path, **kw) -> DraftTrainOptions:
    base = dict(
        model=str(target),
        corpus=[str(corpus)],
        out=str(out),
        tokens=6 * 32,
        seq_len=32,
        topk=8,
        draft_vocab=40,
        aux_layers=[1, 2, 3],
        steps=6,
        batch=2,
        lr=1e-3,
        warmup=2,
        eval_every=3,
        eval_prompts=2,
        eval_prompt_len=12,
        eval_new_tokens=10,
        patience=0,
        save_every=2,
        threads=1,
        data_batch=4,
        compute_dtype="float32",
        generator="transformers",  # vLLM's windows: tests/engine/test_greedy_windows.py
        progress=False,
    )
    base.update(kw)
    return DraftTrainOptions(**base)


def test_train_resume_and_saved_head(target: Path, corpus: Path, tmp_path: Path) -> None:
    full = te.train(_opts(target, corpus, tmp_path / "full"))
    assert full["step"] == 6 and not full["stopped"]

    part = tmp_path / "part"
    assert te.train(_opts(target, corpus, part, stop_after=3))["stopped"]
    data_files = sorted((part / "train" / "data").glob("*.pt"))
    mtimes = [f.stat().st_mtime_ns for f in data_files]
    resumed = te.train(_opts(target, corpus, part, resume=True))
    assert resumed["step"] == 6
    assert [f.stat().st_mtime_ns for f in data_files] == mtimes  # the data was not recomputed
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as a:
        with safe_open(str(part / "model.safetensors"), "pt") as b:
            for name in a.keys():
                torch.testing.assert_close(a.get_tensor(name), b.get_tensor(name))
    with pytest.raises(ed.DraftTrainError, match="other arguments"):
        te.train(_opts(target, corpus, part, resume=True, lr=5e-4))

    head = tmp_path / "full"
    e3.check_head_for_target(head, target)
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == 40 and cfg["rope_theta"] == 5000.0
    with safe_open(str(head / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert names == set(e3.head_shapes(cfg)) | {"d2t", "t2d"}
    draft_ids = torch.arange(40) + d2t
    assert t2d.nonzero().flatten().tolist() == draft_ids.tolist()
    # the draft vocabulary: the most frequent greedy tokens over the cached data
    shards = [torch.load(p, weights_only=True) for p in sorted(data_files) if "train-" in p.name]
    greedy = torch.cat([s["topk_ids"][..., 0].flatten() for s in shards]).long()
    counts = torch.bincount(greedy, minlength=VOCAB)
    assert counts[draft_ids].min() >= counts[~t2d].max()
    meta = json.loads((head / e3.MARKER).read_text())
    assert meta["aux_layers"] == [1, 2, 3] and meta["draft_vocab_size"] == 40
    assert [r["step"] for r in meta["acceptance_curve"]] == [0, 3, 6]
    assert all(len(r["acceptance"]) == 3 for r in meta["acceptance_curve"])
    assert meta["train_tokens"] == 6 * 2 * 32 and meta["final"]


def test_greedy_source_trains_on_the_targets_own_continuations(
    target: Path, corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "g"
    opts = _opts(target, corpus, out, data_source="greedy", gen_prompt_len=8, gen_batch=4)
    assert te.train(opts)["step"] == 6
    shards = sorted((out / "train" / "data").glob("train-*.pt"))
    assert len(shards) == 2  # 6 windows in generation batches of 4
    toks = torch.cat([torch.load(f, weights_only=True)["tokens"] for f in shards]).long()
    top1 = torch.cat([torch.load(f, weights_only=True)["topk_ids"] for f in shards])[..., 0]
    assert toks.shape == (6, 32)
    # after the prompt every token is the target's greedy choice given what precedes it
    assert torch.equal(toks[:, 8:], top1[:, 7:-1].long())
    # the prompts are calibration text, which the target does not reproduce greedily
    assert not torch.equal(toks[:, 1:8], top1[:, :7].long())
    meta = json.loads((out / e3.MARKER).read_text())
    assert "greedy continuations" in meta["recipe"] and meta["compute_dtype"] == "float32"
    assert isinstance(meta["device"], str) and meta["device"]  # where it was trained
    first = meta["acceptance_curve"][0]
    assert len(first["served_acceptance"]) == 3
    assert first["served_mean_accepted"] == pytest.approx(sum(first["served_acceptance"]))
    with pytest.raises(ed.DraftTrainError, match="--gen-prompt-len"):
        te.train(_opts(target, corpus, tmp_path / "bad", data_source="greedy", gen_prompt_len=32))


def test_two_layer_head_trains_and_saves_in_vllms_names(
    target: Path, corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "two"
    assert te.train(_opts(target, corpus, out, head_layers=2))["step"] == 6
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    e3.check_head_for_target(out, target)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("layers.1.self_attn.q_proj.weight").shape == (64, 64)
    assert names == set(e3.head_shapes(cfg)) | {"d2t", "t2d"}
    assert "layers.1.hidden_norm.weight" in names and "midlayer.hidden_norm.weight" in names
    with pytest.raises(ed.DraftTrainError, match="--head-layers"):
        te.train(_opts(target, corpus, tmp_path / "zero", head_layers=0))


def test_bf16_compute_trains_and_says_so(target: Path, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    res = te.train(_opts(target, corpus, out, compute_dtype="bfloat16"))
    assert res["step"] == 6
    meta = json.loads((out / e3.MARKER).read_text())
    assert meta["compute_dtype"] == "bfloat16"
    aux = torch.load(out / "train" / "data" / "train-00000.pt", weights_only=True)["aux"]
    assert aux.dtype == torch.bfloat16 and torch.isfinite(aux.float()).all()
    assert edata.compute_dtype("float32") == torch.float32
    assert edata.compute_dtype("auto") in (torch.float32, torch.bfloat16)


def test_cli_parses_train_draft() -> None:
    from vllm_adaptive.cli import build_parser

    args = build_parser().parse_args(
        "train draft --method eagle3 --model M --corpus a --corpus b --out H "
        "--aux-layers 2,15,27".split()
    )
    opts = te.options_from_args(args)
    assert opts.corpus == ["a", "b"] and opts.aux_layers == [2, 15, 27]
    assert opts.draft_vocab == 8192 and opts.ttt_steps == 3 and opts.eval_k == 3
    assert opts.data_source == "text" and opts.compute_dtype == "auto" and opts.head_layers == 1
    assert opts.device == "auto" and opts.init_head is None
    assert opts.generator == "auto" and opts.gen_batch is None  # resolved when training starts
    te.resolve_prompt_lengths(opts)
    assert (opts.gen_prompt_len, opts.eval_prompt_len) == (32, 64)
    chat = te.options_from_args(
        build_parser().parse_args(
            "train draft --model M --corpus a --out H --data-source chat --init-head G".split()
        )
    )
    te.resolve_prompt_lengths(chat)  # room for the template and the instruction
    assert (chat.gen_prompt_len, chat.eval_prompt_len, chat.init_head) == (96, 96, "G")


def test_early_stop_keeps_the_best_head_and_stays_stopped(
    target: Path, corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "h"
    res = te.train(_opts(target, corpus, out, patience=1, min_delta=10.0))
    assert res["early_stop"] and res["step"] == 3  # the first eval after step 0 did not improve
    meta = json.loads((out / e3.MARKER).read_text())
    assert meta["best"]["step"] == 0 and meta["final"]
    again = te.train(_opts(target, corpus, out, patience=1, min_delta=10.0, resume=True))
    assert again["step"] == 3


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def test_end_of_turn_mask_counts_the_end_and_nothing_after() -> None:
    tokens = torch.tensor([[5, 6, 7, 2, 9, 2], [5, 6, 7, 8, 9, 10], [5, 2, 7, 8, 2, 10]])
    keep = edata.before_end_of_turn(tokens, prompt_len=2, eos=2)
    # position q predicts token q + 1: the end of turn (index 3) is predicted from q = 2
    assert keep[0].tolist() == [True, True, True, False, False, False]
    assert keep[1].all()  # no end of turn generated
    # an EOS inside the prompt does not end the answer
    assert keep[2].tolist() == [True, True, True, True, False, False]
    assert edata.before_end_of_turn(tokens, 2, None).all()


def test_loss_leaves_out_what_keep_drops() -> None:
    torch.manual_seed(0)
    B, T, V, k = 2, 6, 12, 4
    logits = torch.randn(B, T, V)
    topk_ids = torch.randint(0, V, (B, T, k))
    topk_logits = torch.randn(B, T, k)
    draft_ids = torch.arange(V)
    t2d = ed.target_index(draft_ids, V)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 3:] = False
    full, _ = ed.step_loss(logits, 0, topk_ids, topk_logits, t2d, draft_ids)
    masked, _ = ed.step_loss(logits, 0, topk_ids, topk_logits, t2d, draft_ids, keep)
    # the same loss as the kept rows alone: row 0 whole, row 1 up to position 2
    garbage = topk_logits.clone()
    garbage[1, 3:] = 1e4  # what keep drops cannot move the loss
    again, _ = ed.step_loss(logits, 0, topk_ids, garbage, t2d, draft_ids, keep)
    assert torch.allclose(masked, again) and not torch.allclose(full, masked)


def test_chat_source_and_fine_tuning_an_existing_head(
    target: Path, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    from vllm_adaptive import chat_prompts

    # a character tokenizer: short instructions leave room for text in short windows
    monkeypatch.setattr(chat_prompts, "PROSE_INSTRUCTIONS", ("Why?", "Say it."))

    chat_target = tmp_path / "chat-target"
    shutil.copytree(target, chat_target)
    tok = AutoTokenizer.from_pretrained(str(chat_target))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(chat_target)

    out = tmp_path / "chat"
    opts = _opts(
        chat_target, corpus, out, data_source="chat", tokens=6 * 64, seq_len=64,
        gen_prompt_len=40, gen_batch=4, eval_prompt_len=44,
    )  # fmt: skip
    assert te.train(opts)["step"] == 6
    shards = sorted((out / "train" / "data").glob("train-*.pt"))
    data = [torch.load(f, weights_only=True) for f in shards]
    toks = torch.cat([d["tokens"] for d in data]).long()
    assert toks.shape == (6, 64)
    keep = torch.cat([d["keep"] for d in data])
    assert torch.equal(keep, edata.before_end_of_turn(toks, 40, 2))
    before, after = chat_prompts.template_ids(tok)
    for row in toks.tolist():  # template, instruction, text, template: then the answer
        assert row[: len(before)] == before and row[40 - len(after) : 40] == after
    ev = torch.load(out / "train" / "data" / "eval.pt", weights_only=True)["tokens"]
    assert ev[0, 44 - len(after) : 44].tolist() == after
    with pytest.raises(ed.DraftTrainError, match="ask for at least"):
        te.train(
            _opts(chat_target, corpus, tmp_path / "short", data_source="chat", gen_prompt_len=9)
        )
    meta = json.loads((out / e3.MARKER).read_text())
    assert "chat requests" in meta["recipe"]

    # fine-tuning: the head's own vocabulary and weights are the start (lr 0 keeps them)
    tuned = tmp_path / "tuned"
    te.train(_opts(chat_target, corpus, tuned, init_head=str(out), draft_vocab=20, lr=0.0))
    with safe_open(str(tuned / "model.safetensors"), "pt") as f:
        assert f.get_tensor("d2t").shape == (40,)  # not --draft-vocab 20: the head's own
    with safe_open(str(out / "model.safetensors"), "pt") as a:
        with safe_open(str(tuned / "model.safetensors"), "pt") as b:
            assert set(a.keys()) == set(b.keys())
            for name in a.keys():
                torch.testing.assert_close(a.get_tensor(name), b.get_tensor(name))
    assert "fine-tuned from" in json.loads((tuned / e3.MARKER).read_text())["recipe"]
    with pytest.raises(ed.DraftTrainError, match="--head-layers 2"):
        te.train(_opts(chat_target, corpus, tmp_path / "x", init_head=str(out), head_layers=2))
    with pytest.raises(ed.DraftTrainError, match=r"reads layers \[1, 2, 3\]"):
        te.train(
            _opts(chat_target, corpus, tmp_path / "y", init_head=str(out), aux_layers=[0, 1, 2])
        )
    with pytest.raises(ed.DraftTrainError, match="--init-head"):
        te.train(_opts(chat_target, corpus, tmp_path / "z", init_head=str(tmp_path / "none")))
