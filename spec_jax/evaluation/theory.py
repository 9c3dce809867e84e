"""Closed-form predictions for chain speculative decoding (Leviathan et al. 2023, §3).

Glossary (docs/design.md §3): α acceptance rate (Σ_x min(p, q), assumed i.i.d. across positions),
γ draft tokens per round, c cost of one drafter call relative to one verifier call,
τ block efficiency = tokens emitted per verifier call (bonus/correction token included).
Inputs may be Python scalars or numpy arrays (broadcast); outputs are float64 numpy values.
"""

from __future__ import annotations

import numpy as np

# Below this distance from α = 1 use the limit γ + 1: the closed form is 0/0 there and loses
# precision well before it (1 - α^{γ+1} cancels catastrophically).
_ALPHA_ONE_TOL = 1e-9


def _check_alpha(alpha) -> np.ndarray:
  alpha = np.asarray(alpha, dtype=np.float64)
  if not np.all((alpha >= 0.0) & (alpha <= 1.0)):  # also rejects NaN
    raise ValueError(f"alpha (acceptance rate) must be in [0, 1], got {alpha}.")
  return alpha


def _check_gamma(gamma, minimum: int) -> np.ndarray:
  gamma = np.asarray(gamma)
  if not np.issubdtype(gamma.dtype, np.integer) or np.any(gamma < minimum):
    raise ValueError(f"gamma must be an integer >= {minimum}, got {gamma}.")
  return gamma


def expected_block_efficiency(alpha, gamma):
  """τ = E[tokens per verifier call] = (1 − α^{γ+1}) / (1 − α)   (Leviathan et al. Eq. 1 /
  Thm 3.8 numerator), with the α → 1 limit γ + 1. γ = 0 (no drafting) gives τ = 1."""
  alpha = _check_alpha(alpha)
  gamma = _check_gamma(gamma, 0)
  near_one = np.abs(1.0 - alpha) < _ALPHA_ONE_TOL
  safe_alpha = np.where(near_one, 0.0, alpha)  # keep the unused branch finite
  tau = (1.0 - safe_alpha ** (gamma + 1)) / (1.0 - safe_alpha)
  return np.where(near_one, gamma + 1.0, tau)


def expected_speedup(alpha, gamma, c):
  """Expected walltime improvement τ / (γc + 1)   (Leviathan et al. Thm 3.8): one round costs
  γ drafter calls (c each) plus one verifier call, and emits τ tokens."""
  c = np.asarray(c, dtype=np.float64)
  if not np.all(c >= 0.0):
    raise ValueError(f"c (drafter/verifier cost ratio) must be >= 0, got {c}.")
  gamma = _check_gamma(gamma, 0)
  return expected_block_efficiency(alpha, gamma) / (gamma * c + 1.0)


def optimal_gamma(alpha: float, c: float, max_gamma: int) -> int:
  """argmax_{1 ≤ γ ≤ max_gamma} τ(α, γ) / (γc + 1), ties → smallest γ (Leviathan et al. §3.4
  choose γ by this same maximisation, Fig. 3). Scalars only."""
  max_gamma = int(_check_gamma(max_gamma, 1))
  gammas = np.arange(1, max_gamma + 1)
  speedups = expected_speedup(float(alpha), gammas, float(c))
  return int(gammas[np.argmax(speedups)])  # argmax returns the first maximum
