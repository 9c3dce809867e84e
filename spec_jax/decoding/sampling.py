"""Sampling strategies as exact distributions.

`probs_from_logits` turns logits into the float32 law a token is drawn from after temperature,
top-k and top-p. Speculative decoding needs that law itself (q for the drafter, p for the
verifier), not just a sample, so every strategy is expressed as "transform logits → probabilities,
then draw", and the same transform is applied to drafter and verifier.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """temperature 0 means greedy (argmax, a one-hot law); top_k 0 and top_p 1 mean off."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0.0:  # also rejects NaN
      raise ValueError(f"sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}.")
    if self.top_k < 0:
      raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"sampling.top_p must be in (0, 1] (1 = off), got {self.top_p}.")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @classmethod
  def from_config(cls, cfg) -> "Sampling":
    return cls(temperature=float(cfg.temperature), top_k=int(cfg.top_k), top_p=float(cfg.top_p))


def probs_from_logits(logits: jax.Array, s: Sampling) -> jax.Array:
  """float32[..., V] probabilities of the law `s` draws from, given logits[..., V]."""
  logits = logits.astype(jnp.float32)
  if s.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  logits = logits / s.temperature
  neg_inf = jnp.finfo(jnp.float32).min
  if s.top_k and s.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, s.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, neg_inf)
  if s.top_p < 1.0:
    # Keep the smallest prefix of the sorted law whose mass reaches top_p: a token stays iff the
    # mass strictly before it is < top_p (so the most likely token always stays).
    probs = jax.nn.softmax(logits, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < s.top_p
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # unsort
    logits = jnp.where(keep, logits, neg_inf)
  return jax.nn.softmax(logits, axis=-1)


def first_argmax(x: jax.Array) -> jax.Array:
  """int32[...]: index of the first maximum of x[..., V] (= jnp.argmax for finite or -inf
  entries), as a max and a min reduction. XLA's CPU argmax is a variadic reduction that does
  not fuse well with what produces its input; this form is 2-4× faster there after a Gumbel draw."""
  top = jnp.max(x, axis=-1, keepdims=True)
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where(x == top, iota, x.shape[-1]), axis=-1)


def sample(rng: jax.Array, probs: jax.Array) -> jax.Array:
  """int32[...] draws from probs[..., V] (float32). Zero-probability tokens are never drawn.
  The Gumbel-max trick with the same noise `jax.random.categorical(rng, log probs)` uses, so the
  draws are identical to it, token for token."""
  logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
  return first_argmax(logp + jax.random.gumbel(rng, logp.shape, jnp.float32))


def sample_logits(rng: jax.Array, logits: jax.Array, s: Sampling) -> jax.Array:
  """One draw per row from the law `s` applied to logits; greedy is a plain argmax."""
  if s.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return sample(rng, probs_from_logits(logits, s))
