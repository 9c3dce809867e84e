"""SpecTr's K-SEQ (Sun et al. 2023, §4, Alg. K-SEQ): verifying k i.i.d. candidates with one
acceptance scale ρ, and the residual law drawn from when all k are rejected. The tree walk
(`tree.py`) calls these at each step; they are also the reference forms the tests check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.decoding.acceptance.residuals import MIN_RESIDUAL_MASS, normalize_or

# Bisection steps for SpecTr's ρ on [1, k]: 24 halvings reach float32 resolution for k ≤ 8.
# Any ρ the bisection returns is on the feasible side, so the emitted law stays exactly p; the
# remaining gap δ ≤ (k − 1)/2^24 to ρ* only costs acceptance, at most k·δ < 4e-6 for k ≤ 8.
_KSEQ_BISECTION_STEPS = 24


def _kseq_beta(p, q, rho):
  """β_{p,q}(ρ) = Σ_x min(q(x), p(x)/ρ): probability that one K-SEQ trial accepts."""
  return jnp.sum(jnp.minimum(q, p / rho[..., None]), axis=-1)


def _kseq_trials_factor(beta, k):
  """(1 − (1 − β)^k) / β = Σ_{i<k} (1 − β)^i, the expected number of trials made; k at β = 0."""
  miss = jnp.clip(1.0 - beta, 0.0, 1.0)
  safe = jnp.where(beta > 0, beta, 1.0)
  return jnp.where(beta > 0, (1.0 - jnp.power(miss, k)) / safe, k)


def kseq_rho(p: jax.Array, q: jax.Array, k: jax.Array,
             steps: int = _KSEQ_BISECTION_STEPS) -> jax.Array:
  """SpecTr's ρ for k i.i.d. candidates (Sun et al. 2023, §4, Alg. K-SEQ): the smallest
  ρ ∈ [1, k] with
      1 − (1 − β(ρ))^k ≤ ρ · β(ρ),        β(ρ) = Σ_x min(q(x), p(x)/ρ),
  the condition that makes the K-SEQ residual non-negative (see `kseq_residual`). The paper takes
  ρ* solving it with equality and finds it by bisection. The left side minus the right side is
  non-increasing in ρ (d(ρβ)/dρ = Σ_{ρq<p} q ≥ 0 and β decreases), it holds at ρ = k (Bernoulli:
  1 − (1−β)^k ≤ kβ) and ρβ(ρ) ≤ 1 − (1−β)^k at ρ = 1, so bisection brackets ρ*. Smaller ρ means a
  larger β and acceptance probability 1 − (1 − β)^k.

  p, q f32[..., V]; k [...] candidates (int or float). Returns f32[...] (1 where ρ = 1 is already
  feasible: k ≤ 1, p = q, or disjoint supports). The returned ρ is always on the feasible side.
  """
  p = p.astype(jnp.float32)
  q = q.astype(jnp.float32)
  k = jnp.asarray(k, jnp.float32)

  def feasible(rho):
    beta = _kseq_beta(p, q, rho)
    return 1.0 - jnp.power(jnp.clip(1.0 - beta, 0.0, 1.0), k) <= rho * beta

  def halve(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    ok = feasible(mid)
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  one = jnp.ones_like(k)
  _, hi = jax.lax.fori_loop(0, steps, halve, (one, jnp.maximum(k, 1.0)))
  return jnp.where(feasible(one), one, hi)


def kseq_residual(p: jax.Array, q: jax.Array, rho: jax.Array, k: jax.Array) -> jax.Array:
  """The law K-SEQ draws from when all k candidates were rejected (Sun et al. 2023, Alg. K-SEQ):
      p_res(x) = [p(x) − min(q(x), p(x)/ρ) · (1 − (1−β)^k)/β] / (1 − β)^k,   β = β_{p,q}(ρ).
  Candidate i (tried after i − 1 rejections, each with probability 1 − β) emits x with probability
  min(q(x), p(x)/ρ), so the accept branch emits min(q, p/ρ) · Σ_{i<k} (1−β)^i in all and the
  residual supplies the rest of p. We normalise by the sum instead of dividing by (1 − β)^k (the
  same number when ρ is feasible) and fall back to p when nothing is left. k = 0 gives p.
  p, q f32[..., V]; rho, k [...]. Returns f32[..., V]."""
  p = p.astype(jnp.float32)
  q = q.astype(jnp.float32)
  rho = jnp.asarray(rho, jnp.float32)
  k = jnp.asarray(k, jnp.float32)
  m = jnp.minimum(q, p / rho[..., None])
  trials = _kseq_trials_factor(jnp.sum(m, axis=-1), k)
  return normalize_or(jnp.maximum(0.0, p - m * trials[..., None]), p, MIN_RESIDUAL_MASS)


# ---------------------------------------------------------------------------------------------
