"""`vllm-adaptive calibrate --fusion` on the default model with a small grid: the profile it
writes, what the loader makes of it, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_adaptive.artifacts import Profile, ProfileError, save_profile
from vllm_adaptive.cli import main
from vllm_adaptive.corpora import default_code_corpus
from vllm_adaptive.depth.calibration.fusion import load_fusion_profile


@pytest.fixture(scope="module")
def profile(model_dir: Path, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fusion")
    corpus = default_code_corpus(d / "code.txt", max_chars=120_000)
    out = d / "profile"
    torch.set_num_threads(1)
    rc = main(
        [
            "calibrate", "--fusion", "--model", str(model_dir), "--corpus", str(corpus),
            "--out", str(out), "--fusion-layers", "20", "--fusion-percentiles", "5,50",
            "--fusion-max-ppl-increase", "0.5", "--fusion-prompt-len", "64",
            "--fusion-continuation", "16", "--fusion-fit-windows", "1",
            "--fusion-val-windows", "1", "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    return out


def test_profile_holds_a_tau_per_layer_and_the_exemptions(profile: Path, model_dir: Path) -> None:
    prof = load_fusion_profile(profile, model_dir)
    m = prof.meta
    assert m["kind"] == "fusion" and m["layers"] == [20]
    grid = {r["percentile"]: r for r in m["grid"]}
    assert set(grid) == {5.0, 50.0}
    # the median removes more than the 5th percentile; taus grow with the percentile
    assert grid[50.0]["tau"] > grid[5.0]["tau"] > 0
    assert grid[50.0]["removed_fraction"] > grid[5.0]["removed_fraction"]
    tau = m["tau_fuse"]["20"]
    ok = [r for r in m["grid"] if r["ppl_ratio"] <= 1.5 and r["removed_fraction"] > 0]
    assert tau == (max(ok, key=lambda r: r["removed_fraction"])["tau"] if ok else 0.0)
    if tau > 0:
        assert prof.rules[20].tau_fuse == pytest.approx(tau)
    # exemptions: special tokens, both spellings of the default anchors, a frequency table
    assert prof.exemptions.special_ids and len(prof.exemptions.anchors) >= 2
    counts = prof.exemptions.token_counts
    assert counts.shape == (49152,) and int(counts.sum()) > 10_000
    ids = torch.tensor([int(counts.argmax()), int(torch.nonzero(counts == 0)[0])])
    mask = prof.exemptions.mask(ids.tolist())
    assert mask.tolist() == [False, True]  # the commonest token fuses, an unseen one never


def test_loader_refuses_other_models_and_kinds(
    profile: Path, model_dir: Path, gemma_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ProfileError, match="different model"):
        load_fusion_profile(profile, gemma_dir)
    depth = save_profile(Profile(meta={"probe_layers": [2]}, tensors={}), tmp_path / "d", model_dir)
    with pytest.raises(ProfileError, match="not a fusion profile"):
        load_fusion_profile(depth, model_dir)


def test_bad_layers_refused(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fusion layers must lie in 1..29"):
        main(
            ["calibrate", "--fusion", "--model", str(model_dir), "--corpus", __file__,
             "--out", str(tmp_path / "p"), "--fusion-layers", "30", "--quiet"]
        )  # fmt: skip
