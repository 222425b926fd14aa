"""Adaptive depth: tokens leave the decoder stack early, with the KV cache kept consistent.

Two halves share this package and meet only through the profile on disk
(`vllm_adaptive/artifacts.py`, read by the runtime through `exit_profile.py`):

- offline calibration, no vLLM: `calibration/` (`collect.py`, teacher forcing in transformers;
  `norms.py`, `targets.py`, `budget.py`, the exit simulator; one module per signal), with
  `readout.py`, `proxies.py` and `isotonic.py`, which the runtime reads too;
- the runtime inside vLLM's forward pass: `runtime.py` (depth-peeling over
  `engine/attention_metadata.py`, the step's state in `step.py`, ARLA's `accelerated.py`), the KV
  strategies in `kv_strategies/` (one class each, over `backfill.py`, `mask_context.py`,
  `exit_river.py`), `schedule.py`, `record.py`, `requests.py` (per-request settings, resolved once
  at admission), and the exit signals in `policies/`.
"""
