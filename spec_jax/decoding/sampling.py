"""Sampling strategies as exact distributions.

`probs_from_logits` turns logits into the float32 law a token is drawn from after temperature,
top-k and top-p. Speculative decoding needs that law itself (q for the drafter, p for the
verifier), not just a sample, so every strategy is expressed as "transform logits → probabilities,
then draw", and the same transform is applied to drafter and verifier.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import parallel


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
  # Removed tokens get -inf (not float32's min), so a row with nothing left stays an empty law
  # (NaN after the softmax, reported by `law_status`) instead of turning uniform.
  neg_inf = -jnp.inf
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


# ---------------------------------------------------------------------------------------------
# Exact draws.
#
# Gumbel-max draws token i with probability p_i only if the noise reaches log(p_top / p_i) above
# the top token's. JAX's default Gumbel noise, −log(−log u) with u on a 2^23-point float32 grid,
# never exceeds ~15.9, so tokens 1e-7 below the top come out about half as often as they should
# and tokens 1e-8 below never. Every draw here uses noise with 46 bits of resolution where the
# upper tail needs it (jax's mode="high": largest value ~32, so only tokens below e^-32 ≈ 1e-14 of
# the top are lost, a total mass under 3e-9 even for a 262k vocabulary), and draws in two stages
# so that this noise costs less than the old one:
#   1. the vocabulary is cut into blocks of K ≈ √V tokens; a block is drawn with probability
#      proportional to its mass by Gumbel-max over the blocks' log-masses (V/K noise values);
#   2. a token is drawn inside the chosen block by Gumbel-max over its K log-probabilities.
# P(i) = (M_b / M) · (p_i / M_b) = p_i / M, exactly; the only pass over all V entries is the
# block sums. The tokens differ from `jax.random.categorical`'s for the same key.

def gumbel(rng: jax.Array, shape) -> jax.Array:
  """f32 standard Gumbel noise, resolved to ~2^-46 in probability in its upper tail (see above)."""
  return jax.random.gumbel(rng, shape, jnp.float32, mode="high")


def uniform(rng: jax.Array, shape) -> jax.Array:
  """f32 U[0, 1) resolved to 2^-46 near 0 (jax's default: 2^-23), so an accept test u < a with a
  tiny ratio a is exact to float32 resolution; near 1 it has float32's own spacing (2^-24)."""
  hi, lo = jax.random.uniform(rng, (2, *shape), jnp.float32)
  # Below 1/2 the low word fills in the bits float32 can hold; above it adding could round to 1.
  return jnp.where(hi >= 0.5, hi, hi + lo * 2.0 ** -23)


def block_size(v: int) -> int:
  """K: the power of two nearest above √V (at least 2), which minimises V/K + K noise values."""
  return max(2, 1 << math.ceil(math.log2(max(math.sqrt(v), 1.0))))


def to_blocks(x: jax.Array, fill) -> jax.Array:
  """x[..., V] → [..., ⌈V/K⌉, K], padded with `fill` (0 for probabilities, -inf for logs)."""
  v = x.shape[-1]
  k = block_size(v)
  nb = -(-v // k)
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * k - v)], constant_values=fill)
  return x.reshape(*x.shape[:-1], nb, k)


def _safe_log(p: jax.Array) -> jax.Array:
  return jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)


def sample(rng: jax.Array, probs: jax.Array) -> jax.Array:
  """int32[...] draws from probs[..., V] (float32, not necessarily normalised), exact to float32
  resolution (two-stage Gumbel-max, see above). Zero-probability tokens are never drawn. A row
  that is not a law (NaN, no mass) gives an arbitrary in-range token: `law_status` reports it."""
  v = probs.shape[-1]
  blocks = to_blocks(probs.astype(jnp.float32), 0.0)                      # [..., NB, K]
  k_block, k_token = jax.random.split(rng)
  mass = jnp.sum(blocks, axis=-1)                                         # [..., NB]
  b = first_argmax(_safe_log(mass) + gumbel(k_block, mass.shape))
  b = jnp.minimum(b, mass.shape[-1] - 1)
  chosen = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]   # [..., K]
  t = first_argmax(_safe_log(chosen) + gumbel(k_token, chosen.shape))
  return jnp.minimum(b * blocks.shape[-1] + t, v - 1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Laws that are not laws. Decoding loops record, per row, the first step whose law is broken
# (no host sync inside the loop) and `raise_for_laws` turns it into an error on the host.

LAW_OK, LAW_NAN_LOGITS, LAW_EMPTY, LAW_DRAFT_NAN = 0, 1, 2, 3


def law_status(logits: jax.Array, probs: jax.Array | None = None) -> jax.Array:
  """int32[...] for logits[..., V] and the law probs[..., V] drawn from them: LAW_NAN_LOGITS if
  a logit is NaN, LAW_EMPTY if the law has no finite positive mass (every logit -inf, +inf
  logits, or logits / temperature overflowing), else LAW_OK.

  probs None: the greedy law (one-hot at the argmax), read from the logits' maximum alone (the
  one reduction greedy decoding pays for its check). A one-hot always has mass 1, so the law is
  empty when the maximum is not finite: every logit -inf (nothing to pick, though argmax returns
  token 0) or a +inf logit (an overflow), the logits every temperature > 0 reports as LAW_EMPTY."""
  top = jnp.max(logits, axis=-1)                 # max propagates NaN; cheaper than any(isnan)
  if probs is None:
    empty = ~jnp.isfinite(top)
  else:
    mass = jnp.sum(probs, axis=-1)
    empty = ~(jnp.isfinite(mass) & (mass > 0))
  return jnp.where(jnp.isnan(top), LAW_NAN_LOGITS,
                   jnp.where(empty, LAW_EMPTY, LAW_OK)).astype(jnp.int32)


def draw(rng: jax.Array, logits: jax.Array, s: Sampling) -> tuple[jax.Array, jax.Array]:
  """One draw per row from the law `s` applied to logits[..., V] (greedy: a plain argmax), and
  the law's `law_status` int32[...]."""
  if s.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), law_status(logits)
  probs = probs_from_logits(logits, s)
  return sample(rng, probs), law_status(logits, probs)


class LawError(ValueError):
  """A decoding step met a verifier or drafter law that is not a probability distribution."""


def _cause(code: int, sampling: Sampling | None) -> str:
  if code == LAW_NAN_LOGITS:
    return ("the model's logits contain NaN (the verifier's, in speculative decoding), so its "
            "parameters or activations are not finite (a corrupt or diverged checkpoint, NaN "
            "inputs, or an overflow in a low-precision dtype: try model.dtype='float32')")
  if code == LAW_DRAFT_NAN:
    return ("the drafter's law q contains NaN, so the drafter's parameters or activations are "
            "not finite (check the drafter checkpoint, or try its dtype in float32)")
  if sampling is not None and sampling.greedy:
    return ("the greedy law (sampling.temperature=0) left no token with positive probability: "
            "the logits have no finite maximum, so every logit is -inf (a mask that removes the "
            "whole vocabulary) or a logit is +inf (an overflow in a low-precision dtype: try "
            "model.dtype='float32')")
  knobs = "" if sampling is None else (f" (sampling.temperature={sampling.temperature}, "
                                       f"top_k={sampling.top_k}, top_p={sampling.top_p})")
  return (f"the sampling transform{knobs} left no token with positive probability: every logit "
          "is -inf (a mask that removes the whole vocabulary), a logit is +inf, or logits / "
          "temperature overflow float32 (raise sampling.temperature)")


def raise_for_laws(status, at, sampling: Sampling | None = None, what: str = "decoding") -> None:
  """Host side: LawError naming the first bad row, the new-token index it stopped at and the
  likely cause, if any row of status int32[B] is not LAW_OK (`at` int32[B]: new tokens emitted
  before the bad step). Nothing after the bad step was emitted for that row."""
  status, at = parallel.to_host(status), parallel.to_host(at)
  bad = np.flatnonzero(status)
  if bad.size == 0:
    return
  b = int(bad[0])
  others = ""
  if bad.size > 1:
    others = f" ({bad.size} rows in all: {bad[:8].tolist()}{', …' if bad.size > 8 else ''})"
  raise LawError(f"{what}: row {b}{others} stopped at new token {int(at[b])}: "
                 f"{_cause(int(status[b]), sampling)}.")
