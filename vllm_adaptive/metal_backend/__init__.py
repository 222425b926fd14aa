"""The adaptive mechanisms on Apple hardware through MLX (``vllm-adaptive serve --backend mlx``).

Same ``adaptive`` config, profiles, per-request keys, bench and server contract as the vLLM
plugin; the model is mlx-lm's own class for the checkpoint, driven by this package's loop.
Nothing here imports vLLM or torch, and nothing depends on Metal: on Linux it runs on MLX's
CPU build (``pip install "vllm-adaptive[mlx]"``), which is how it is tested.

Mechanisms (this package) and policies (shared with the vLLM path) are kept apart:

- :mod:`.loading`: the checkpoint into mlx-lm, config normalised, dtype chosen.
- :mod:`.arch`: the layer loop's view of a model (embed, blocks, norm, head, linears).
- :mod:`.quant` / :mod:`.geared`: packed tiers in MLX's quantized format, the geared linear.
- :mod:`.gear_control`: per-request gear state; decisions from ``precision/policies``.
- :mod:`.depth`: EMAD exits with monotone KV; decisions from ``depth/policies/emad_rule``
  and ``depth/schedule``.
- :mod:`.speculative`: the lowbit self-draft and its verification.
- :mod:`.support`: what the backend refuses, naming the config key.
- :mod:`.engine`: one model, one request at a time: generation and teacher forcing.
- :mod:`.server` / :mod:`.bench`: the OpenAI-compatible server and ``bench --backend mlx``.
"""

from __future__ import annotations


def require_mlx() -> None:
    """Fail with the install line when MLX or mlx-lm is missing."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"the MLX backend needs mlx and mlx-lm ({e}): pip install 'vllm-adaptive[mlx]'"
        ) from None
