"""Entropy-routed precision: which packed weights (gear) each token runs through.

- :mod:`.gears`: the precisions a gear can name and their bytes per parameter.
- :mod:`.entropy`: Shannon entropy of logits, in bits, with GEARBX's NaN guard.
- :mod:`.policies`: *when* to shift (GEARBX's monitor, QuickSilver's tiers, a fixed gear).
- :mod:`.tiers` / :mod:`.linear`: *how*: per-linear packed tiers and the geared linear method.
- :mod:`.controller`: per-batch-slot request state, the step plan, telemetry.

Policies never touch tensors of the model; mechanisms never decide a gear.
"""
