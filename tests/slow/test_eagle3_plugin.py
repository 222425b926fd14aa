"""vLLM's own EAGLE-3 proposer with the plugin loaded: the adaptive Llama class gives vLLM the
target's auxiliary hidden states (``SupportsEagle3``), so an EAGLE-3 head works with adaptivity
on, as with stock. An untrained head (``eagle3_head.random_head``) is enough for what is checked
here: vLLM drafts with it, and greedy output stays identical to stock vLLM (lossless); a head
made for another model is refused at engine start, naming the mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.eagle3 import eagle3_spec, run_eagle3
from tests.support.engines import make_llm, metric, shutdown
from tests.support.workloads import run_workloads
from vllm_adaptive.speculative.eagle3_head import MARKER, random_head


@pytest.fixture(scope="module")
def head(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_head(tmp_path_factory.mktemp("eagle3") / "head", model_dir)


@pytest.mark.parametrize(
    "adaptive",
    [{}],  # the fp16 gear's case runs in the default suite: tests/engine/test_eagle3_fp16.py
    ids=["adaptivity-off"],
)
def test_eagle3_drafts_and_output_identical_to_stock(
    model_dir: Path, head: Path, stock_f32: dict, adaptive: dict
) -> None:
    got, drafted, gears = run_eagle3(model_dir, adaptive, head)
    assert drafted > 100, drafted  # vLLM's EAGLE-3 proposer really ran on the plugin's model
    assert gears["linears"] == [], gears  # adaptivity off: vLLM's own head, untouched
    for key, seqs in got.items():
        assert seqs == stock_f32["spec_mixed"][key], key


def test_head_for_another_model_refused_at_start(
    model_dir: Path, head: Path, tmp_path, capfd
) -> None:
    """The engine does not start, and what the user sees names the mismatch: vLLM's
    multiprocess engine raises a generic start failure in the caller and prints the worker's
    error (the plugin's message) above it, so both are read."""
    other = tmp_path / "head"
    other.mkdir()
    for f in head.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / MARKER).write_text(json.dumps({"target_fingerprint": "0" * 64}))
    with pytest.raises(Exception) as excinfo:
        make_llm(
            model_dir, {"adaptive": {}}, dtype="float32", speculative_config=eagle3_spec(other)
        )
    seen = capfd.readouterr()
    shown = f"{excinfo.value}\n{seen.out}\n{seen.err}"
    assert "made for another model (fingerprint 000000000000" in shown, shown[-3000:]


def hybrid_summary(model) -> dict:
    """Worker side: the hybrid drafter's per-source tally (``speculative/hybrid.py``)."""
    return model.hybrid_drafts.summary()


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_hybrid_lookup_and_learned_drafts_output_identical_to_stock(
    model_dir: Path, head: Path, stock_f32: dict, lookup: str
) -> None:
    """``adaptive.hybrid``: vLLM's EAGLE-3 proposer plus a lookup drafter, chosen per request
    and step. With an untrained head only the lookup's drafts are accepted, so its tally shows
    that both sources really drafted and that the lookup's drafts reached the verifier."""
    if lookup == "suffix":
        pytest.importorskip("arctic_inference", reason="bash scripts/install-suffix-decoding.sh")
    hybrid = {"lookup": lookup, "learned_tokens": 1}
    llm = make_llm(
        model_dir,
        {"adaptive": {"hybrid": hybrid}},
        dtype="float32",
        speculative_config=eagle3_spec(head) | {"suffix_decoding_max_cached_requests": 0},
    )
    try:
        got = run_workloads(llm, ["spec_mixed"])["spec_mixed"]
        (tally,) = llm.apply_model(hybrid_summary)
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    finally:
        shutdown(llm)
    for key, seqs in got.items():
        assert seqs == stock_f32["spec_mixed"][key], key
    assert tally["learned"]["drafts"] > 20, tally
    assert tally["lookup"]["drafts"] > 5 and tally["lookup"]["accepted"] > 10, tally
    assert tally["lookup"]["acceptance"] > tally["learned"]["acceptance"], tally
    # vLLM's own counter agrees with the tally of what was verified
    assert accepted >= tally["lookup"]["accepted"], (accepted, tally)


def test_hybrid_without_a_learned_drafter_refused_at_start(
    model_dir: Path, capfd: pytest.CaptureFixture
) -> None:
    """The worker refuses the engine and its log (the engine's processes share the test's
    file descriptors) names the problem."""
    with pytest.raises(Exception, match="initialization failed"):
        make_llm(
            model_dir,
            {"adaptive": {"hybrid": {"lookup": "ngram"}}},
            dtype="float32",
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        )
    out = "".join(capfd.readouterr())
    assert "adaptive.hybrid mixes lookup drafts into vLLM's learned drafter" in out, out[-2000:]


@pytest.mark.parametrize("method", ["suffix", "suffix-per-batch-size", "ngram"])
def test_vllm_lookup_drafters_on_the_fp16_gear_identical_to_stock(
    model_dir: Path, stock_f32: dict, method: str
) -> None:
    """serve.sh's float32 default: the fixed fp16 gear under vLLM's own suffix drafter (ngram,
    which needs no extra package, the same path): drafts verified in float32, greedy output
    identical to stock float32's, drafts really accepted. With a per-batch-size schedule (k 8
    for one request, none above, as serve.sh sets it) vLLM 0.32's suffix proposer would
    assert at the first batch of two (intrusion suffix-dynamic-k)."""
    if method.startswith("suffix"):
        pytest.importorskip("arctic_inference", reason="bash scripts/install-suffix-decoding.sh")
        spec = {"method": "suffix", "num_speculative_tokens": 8}
        spec["suffix_decoding_max_cached_requests"] = 0
        if method == "suffix-per-batch-size":
            spec["num_speculative_tokens_per_batch_size"] = [[1, 1, 8], [2, 1024, 0]]
    else:
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    fp16 = {"precision": {"policy": "fixed", "gear": "fp16"}}
    llm = make_llm(model_dir, {"adaptive": fp16}, dtype="float32", speculative_config=spec)
    try:
        got = run_workloads(llm, ["spec_mixed"])["spec_mixed"]
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    finally:
        shutdown(llm)
    assert accepted > 10, accepted
    for key, seqs in got.items():
        assert seqs == stock_f32["spec_mixed"][key], key
