"""Residual-law arithmetic shared by the chain, tree and K-SEQ rules (float32 throughout).

After a draft x ~ s is rejected, the verifier's law left to sample from is norm(max(0, r − s))
(Leviathan et al. 2023, Alg. 1; applied recursively by SpecInfer and RSD). These are the
reference [..., V] forms; the tree walk runs the same recursion in a scalar form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A residual with less mass than this is rounding noise, not a law (p == q up to float error, or
# p/q not quite normalised); a rejection that lands there falls back to p. The true rejection
# probability is then below this floor too, so the fallback moves the emitted law by < 1e-6.
MIN_RESIDUAL_MASS = 1e-6


def acceptance_rate(p: jax.Array, q: jax.Array) -> jax.Array:
  """f32[...]: α = Σ_x min(p(x), q(x)) for p, q f32[..., V] (Leviathan et al. 2023, Def. 3.1 and
  Cor. 3.6: the chance that speculative sampling accepts a draft drawn from q)."""
  return jnp.sum(jnp.minimum(p.astype(jnp.float32), q.astype(jnp.float32)), axis=-1)


def normalize_or(x: jax.Array, fallback: jax.Array, floor: float) -> jax.Array:
  """x / Σx, or `fallback` where Σx ≤ floor."""
  mass = jnp.sum(x, axis=-1, keepdims=True)
  return jnp.where(mass > floor, x / jnp.where(mass > floor, mass, 1.0), fallback)


def residual_update(r: jax.Array, s: jax.Array) -> jax.Array:
  """r' = norm(max(0, r − s)): the verifier's law left after a candidate drawn from s was
  rejected. A residual with mass ≤ MIN_RESIDUAL_MASS is rounding noise (r ≈ s, so rejection
  itself had probability below that floor); it falls back to r, as the chain rule falls back
  to p_n."""
  r = r.astype(jnp.float32)
  return normalize_or(jnp.maximum(0.0, r - s.astype(jnp.float32)), r, MIN_RESIDUAL_MASS)


def remove_token(s: jax.Array, x: jax.Array) -> jax.Array:
  """s(· | · ≠ x) = s with s(x) set to 0, renormalised: the law of the next sibling drawn
  without replacement (RSD, Jeon et al. 2024, Alg. 3). All zeros once s has no mass left, which
  makes every later candidate unreachable (skipped)."""
  s = jnp.where(jnp.arange(s.shape[-1]) == jnp.asarray(x)[..., None], 0.0, s.astype(jnp.float32))
  return normalize_or(s, jnp.zeros_like(s), 0.0)
