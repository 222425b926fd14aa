"""Rebuild a loadable fusion profile directory from the profile JSON kept in the repository.

`docs/data/fusion-profile-smollm2-split-repeats.json` is the JSON half of the run-2 profile
(docs/token-fusion.md); its tensors (the fusion layers, taus and the rare-token table) are not
in the repository. The layers and taus are in the JSON; the table is recounted here on the
calibration part of the same corpora, checked against the JSON's sha256s, exactly as
`calibration.fusion.build_exemptions` counted it. No forward pass: seconds.

    python docs/experiments/fusion_profile_from_json.py \
        --json docs/data/fusion-profile-smollm2-split-repeats.json \
        --model ~/.cache/vllm-adaptive/models/smollm2-135m-instruct \
        --corpus /tmp/mlxdev/corpora/code.txt --corpus /tmp/mlxdev/corpora/prose.txt \
        --out /tmp/fusion-bench/fusion-profile
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--corpus", action="append", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from vllm_adaptive.artifacts import Profile, fingerprint_matches, save_profile
    from vllm_adaptive.corpora import read_corpus
    from vllm_adaptive.depth.calibration.fusion import KIND, load_fusion_profile, token_counts

    meta = json.loads(Path(args.json).read_text())
    if meta.get("kind") != KIND:
        raise SystemExit(f"{args.json}: not a fusion profile (kind {meta.get('kind')!r})")
    if not fingerprint_matches(meta["model_fingerprint"], args.model)[0]:
        raise SystemExit(f"{args.json}: made for another model than {args.model}")
    files = [read_corpus(c) for c in args.corpus]
    want = {c["sha256"] for c in meta["corpora"]}
    got = {f.sha256 for f in files}
    if want != got:
        raise SystemExit(f"corpora differ from the profile's: {sorted(want)} vs {sorted(got)}")
    tok = AutoTokenizer.from_pretrained(args.model)
    vocab = int(AutoConfig.from_pretrained(args.model).vocab_size)
    layers = [int(x) for x in meta["layers"]]
    tensors = {
        "fusion_layers": torch.tensor(layers, dtype=torch.int32),
        "fusion_tau": torch.tensor([meta["tau_fuse"][str(x)] for x in layers]),
        "fusion_token_counts": token_counts(tok, [f.calibration_text for f in files], vocab).to(
            torch.int32
        ),
    }
    stale = ("format_version", "model_fingerprint", "tensors_sha256", "tensor_names")
    keep = {k: v for k, v in meta.items() if k not in stale}
    keep["rebuilt_from"] = str(args.json)
    save_profile(Profile(meta=keep, tensors=tensors), args.out, args.model)
    prof = load_fusion_profile(args.out, args.model)
    print(json.dumps({"out": args.out, "tau_fuse": {k: r.tau_fuse for k, r in prof.rules.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
