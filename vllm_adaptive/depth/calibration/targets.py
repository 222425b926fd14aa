"""Per-layer entropy targets tau_l(q) and safety margins m_l (EMAD sec. 2.3-2.4).

Paper rule: tau_l = Quantile_q of the calibrated-readout entropies H_{l,t} over the
calibration tokens, then made non-increasing in depth by isotonic regression. The
`population="agree"` option restricts the quantile to tokens whose calibrated intermediate
argmax already equals the final one (a stricter variant, not the paper's default).
Margins: m_l = alpha * MAD(e_l), e_l = proxy entropy - exact entropy at layer l.
"""

from __future__ import annotations

import numpy as np

from vllm_adaptive.depth.isotonic import isotonic_fit


def entropy_targets(entropies: list[np.ndarray], q: float) -> np.ndarray:
    """tau_l(q) for each probe layer (ordered by depth), non-increasing in depth."""
    raw = np.array([np.quantile(h, q) if len(h) else 0.0 for h in entropies])
    return isotonic_fit(raw, increasing=False)


def margins(errors: list[np.ndarray], alpha: float = 1.5) -> np.ndarray:
    """m_l = alpha * median(|e - median(e)|)."""
    return np.array([alpha * float(np.median(np.abs(e - np.median(e)))) for e in errors])
