"""Per-layer intermediate normalization `Norm_l(h) = a_l * RMSNorm(h) + b_l` (EMAD sec. 2.4).

The paper fits a_l, b_l by ridge regression "to align logits statistics to the final layer".
We fit exactly that, in closed form: minimise over the calibration tokens

    sum_t || W (a * x_t + b) - W y_t ||^2 + lam * (||a - g||^2 + ||b||^2)

where x_t = RMSNorm(h_{l,t}), y_t is the final layer's normalised hidden (so W y_t are the
final logits) and g is the final norm weight (the ridge pulls towards the plain logit lens).
With G = W^T W (d x d) the normal equations only need d-sized sums, never [N, V] logits.
`metric="hidden"` uses G = I instead (match final hidden states before the head); that is
the calibration default: measured on SmolLM2-135M, the logit-metric fit shrinks towards the
mean logit vector and lowers top-1 agreement, the hidden-metric fit (relative ridge 1.0)
raises it at late layers. The scalar variant is a_l = s * g, b_l = c * 1 (two numbers per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_adaptive.depth.readout import Readout


@dataclass
class AffineNorm:
    a: torch.Tensor  # [d]
    b: torch.Tensor  # [d]

    def __call__(self, rms_h: torch.Tensor) -> torch.Tensor:
        return rms_h * self.a + self.b


def fit_affine(
    x: torch.Tensor,
    y: torch.Tensor,
    gram: torch.Tensor,
    prior_a: torch.Tensor,
    ridge: float = 1e-3,
    scalar: bool = False,
    bias: bool = True,
) -> AffineNorm:
    """Closed-form ridge fit of `a * x + b ~ y` under the metric `gram` (see module doc).

    `ridge` is relative: lam = ridge * mean diagonal of the normal matrix.
    """
    x = x.double()
    y = y.double()
    g = gram.double()
    n, d = x.shape
    a0 = prior_a.double()
    gy = y @ g  # [N, d] rows G y_t (G symmetric)
    if scalar:
        u = x * a0  # feature for s; feature for c is the all-ones vector
        ones = torch.ones(d, dtype=torch.float64)
        g1 = g @ ones
        m = torch.empty(2, 2, dtype=torch.float64)
        m[0, 0] = ((u @ g) * u).sum()
        m[0, 1] = m[1, 0] = (u @ g1).sum()
        m[1, 1] = n * (ones @ g1)
        rhs = torch.stack([(u * gy).sum(), (gy @ ones).sum()])
        lam = ridge * m.diagonal().mean()
        prior = torch.tensor([1.0, 0.0], dtype=torch.float64)
        sol = torch.linalg.solve(m + lam * torch.eye(2, dtype=torch.float64), rhs + lam * prior)
        return AffineNorm(a=(sol[0] * a0).float(), b=(sol[1] * ones).float())
    m = torch.empty(2 * d, 2 * d, dtype=torch.float64)
    m[:d, :d] = g * (x.T @ x)
    sx = x.sum(0)
    m[:d, d:] = sx[:, None] * g
    m[d:, :d] = m[:d, d:].T
    m[d:, d:] = n * g
    rhs = torch.cat([(x * gy).sum(0), gy.sum(0)])
    if not bias:
        m, rhs = m[:d, :d], rhs[:d]
    lam = ridge * m.diagonal().mean()
    prior = torch.cat([a0, torch.zeros(d, dtype=torch.float64)])[: m.shape[0]]
    eye = torch.eye(m.shape[0], dtype=torch.float64)
    sol = torch.linalg.solve(m + lam * eye, rhs + lam * prior)
    b = sol[d:] if bias else torch.zeros(d, dtype=torch.float64)
    return AffineNorm(a=sol[:d].float(), b=b.float())


def fit_layer_norms(
    hidden: torch.Tensor,
    final_normed: torch.Tensor,
    readout: Readout,
    fit_index: torch.Tensor,
    ridge: float = 1e-3,
    scalar: bool = False,
    metric: str = "logits",
    bias: bool = True,
) -> list[AffineNorm]:
    """One `AffineNorm` per probe layer, fit on the tokens `fit_index`."""
    if metric == "logits":
        gram = readout.unembed.double().T @ readout.unembed.double()
    elif metric == "hidden":
        gram = torch.eye(readout.hidden, dtype=torch.float64)
    else:
        raise ValueError(f"metric must be 'logits' or 'hidden', not {metric!r}")
    y = final_normed[fit_index]
    return [
        fit_affine(
            readout.rms(hidden[p][fit_index]), y, gram, readout.norm_weight, ridge, scalar, bias
        )
        for p in range(hidden.shape[0])
    ]
