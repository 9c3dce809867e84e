"""Ordered samples without replacement by Gumbel perturbation, the samplers draft trees grow with
(`trees.expand`, `dyn.py`): Gumbel-top-k, truncated Gumbels (a parent's value caps its children's)
and the top-down Gumbel process over groups of items (`perturbed_top_k`).

Shape letters (repo legend): G groups (a level's parents), V vocabulary (items), K block size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.decoding import sampling as sampling_lib

NEG_INF = -jnp.inf


def gumbel_top_k(rng: jax.Array, scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """An ordered sample of k items without replacement, P ∝ exp(scores) (Plackett–Luce), by the
  Gumbel-top-k trick (Vieira 2014; Kool et al. 2019, Eq. 5): perturb every score with an
  independent Gumbel(0) and keep the k largest, in decreasing order (`perturbed_top_k` draws
  them exactly without perturbing all V scores).

  scores f32[..., V] (log-probabilities up to a constant; -inf = never drawn). They are
  normalised (log-softmax over the finite entries) first: with a large constant (say 1e5)
  float32 would absorb the Gumbel noise (its spacing there is ~0.008) and bias the draw towards
  ties broken by index.
  Returns (indices int32[..., k], perturbed values f32[..., k]); a value of -inf marks an item that
  could not be drawn (fewer than k finite scores). The values are perturbed normalised scores."""
  scores = scores.astype(jnp.float32)
  finite = jnp.isfinite(scores)
  lse = jax.nn.logsumexp(jnp.where(finite, scores, NEG_INF), axis=-1, keepdims=True)
  scores = scores - jnp.where(jnp.isfinite(lse), lse, 0.0)  # a row with no finite score stays -inf
  _, idx, values = perturbed_top_k(rng, jnp.where(finite, scores, NEG_INF)[..., None, :], k)
  return idx, values


def _log1mexp(a: jax.Array) -> jax.Array:
  """log(1 - exp(a)) for a <= 0, accurate on both sides of -log 2 (Mächler 2012)."""
  a = jnp.minimum(a, 0.0)
  return jnp.where(a > -0.6931472, jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(a)))


def _softplus(x: jax.Array) -> jax.Array:
  """log(1 + exp(x)), stable at both ends."""
  return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _truncated(rng: jax.Array, logp: jax.Array, bound: jax.Array):
  """`truncated_gumbel` in the caller's frame: (values, log excess) f32[..., V].

  In the exponential race (e^{−G} is an exponential time) conditioning on the maximum T adds to
  every time: e^{−G_i} = e^{−T} + η_i with η_i = e^{−G̃_i} − e^{−Z} ≥ 0 (0 at the arg-max). The
  log excess log η_i orders the values exactly even where they all round to T in float32 (a bound
  far below the scores), and excesses of nested conditionings add (`perturbed_top_k`). It is
  −inf at the arg-max and +inf where logp is -inf."""
  g = sampling_lib.gumbel(rng, logp.shape)
  finite = jnp.isfinite(logp)
  g_tilde = jnp.where(finite, logp + g, NEG_INF)
  z = jnp.max(g_tilde, axis=-1, keepdims=True)
  t = bound[..., None]
  diff = jnp.where(finite, g_tilde - z, -1.0)     # ≤ 0; the -1 filler keeps log1mexp finite
  log_excess = _log1mexp(diff) - jnp.where(finite, g_tilde, 0.0)
  ok = finite & jnp.isfinite(t)
  # G = T − log(1 + e^{T} η)   [= −log(e^{−T} − e^{−Z} + e^{−G̃})]
  values = jnp.where(ok, t - _softplus(t + log_excess), NEG_INF)
  return values, jnp.where(ok, log_excess, jnp.inf)


def truncated_gumbel(rng: jax.Array, logp: jax.Array, bound: jax.Array) -> jax.Array:
  """Children's perturbed log-probabilities conditioned on their maximum being `bound` (the
  parent's perturbed value), the numerically stable form of Kool et al. 2019, App. B, Eq. 23:
    G̃_i = φ_i + Gumbel(0),  Z = max_i G̃_i,
    v_i = T − G̃_i + log(1 − exp(G̃_i − Z)),
    G_i = T − max(0, v_i) − log(1 + exp(−|v_i|))          [= −log(e^{−T} − e^{−Z} + e^{−G̃_i})]
  logp f32[..., V] (φ: the children's path log-probabilities, -inf = impossible), bound f32[...].
  The noise is added in a frame whose zero is each row's largest φ, so a large common offset
  of φ and the bound does not round it away. Returns f32[..., V]; impossible children stay -inf,
  the arg-max child gets exactly T (to float32 rounding of the frame's shift)."""
  logp = logp.astype(jnp.float32)
  ref = jnp.max(jnp.where(jnp.isfinite(logp), logp, NEG_INF), axis=-1)
  ref = jnp.where(jnp.isfinite(ref), ref, 0.0)
  values, _ = _truncated(rng, logp - ref[..., None], bound - ref)
  return values + ref[..., None]


def _top_k_by(values: jax.Array, log_excess: jax.Array, k: int) -> jax.Array:
  """int32[..., k]: positions of the k largest `values` over the last axis, equal values ranked
  by smaller log excess (then by position)."""
  iota = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
  _, _, order = jax.lax.sort((-values, log_excess, iota), dimension=values.ndim - 1, num_keys=2)
  return order[..., :k]


def perturbed_top_k(rng: jax.Array, logp: jax.Array, k: int, bound: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The k largest perturbed values logp[..., g, i] + Gumbel(0) over every group g and item i,
  in decreasing order; with `bound`, group g's values are conditioned on their maximum being
  bound[..., g] (stochastic beam search's children of a parent with perturbed value T).

  Drawn top-down (the Gumbel process; Maddison et al. 2014, Kool et al. 2019, App. B) instead of
  perturbing all G·V values: the vocabulary is cut into blocks of K ≈ √V items
  (`sampling.to_blocks`); a block's maximum is Gumbel around its log-mass (conditioned on the
  group's maximum being the bound when there is one: `truncated_gumbel` over the blocks); the
  k largest values lie in the k blocks with the largest maxima, whose items are then drawn
  conditioned on their block's maximum. Same joint law as perturbing everything, with G·V/K + k·K
  noise values, each resolved far into the tail (`sampling.gumbel`).

  Exact range: any common shift of logp and bound (everything is drawn in a frame whose zero is
  the largest score of logp[...]; tested at 1e6), and a bound at any distance below or above
  its group's scores (tested at −40). A bound ≳ 12 below the scores rounds every conditioned
  value to the bound in float32; such values are ranked by their exact excess below it
  (`_truncated`; a block's and its item's excesses add), which is exact within a group and
  between groups of equal bounds. Between groups whose different bounds round to nearby floats
  the order is float32's, as it is for any Gumbel sampler (a tie of probability ~1e-7). The
  returned values are rounded to float32 and capped at their group's bound.

  logp f32[..., G, V] (-inf = impossible); k static; bound f32[..., G] or None.
  Returns (group int32[..., k], item int32[..., k], value f32[..., k]); value -inf marks a draw
  that could not be made (fewer than k possible items)."""
  logp = logp.astype(jnp.float32)
  *lead, g, v = logp.shape
  ref = jnp.max(jnp.where(jnp.isfinite(logp), logp, NEG_INF), axis=(-2, -1))      # [...]
  ref = jnp.where(jnp.isfinite(ref), ref, 0.0)
  logp = logp - ref[..., None, None]
  blocks = sampling_lib.to_blocks(logp, NEG_INF)                          # [..., G, NB, K]
  nb, kk = blocks.shape[-2:]
  k_block, k_item = jax.random.split(rng)
  log_mass = jax.nn.logsumexp(blocks, axis=-1)                            # [..., G, NB]
  if bound is None:
    block_max = jnp.where(jnp.isfinite(log_mass),
                          log_mass + sampling_lib.gumbel(k_block, log_mass.shape), NEG_INF)
    block_excess = -block_max  # any key decreasing in the value: there is no shared bound
  else:
    cap = bound.astype(jnp.float32)
    bound = cap - ref[..., None]
    block_max, block_excess = _truncated(k_block, log_mass, bound)
  kb = min(k, g * nb)
  flat = lambda x: x.reshape(*lead, g * nb)  # noqa: E731
  sel = _top_k_by(flat(block_max), flat(block_excess), kb)               # [..., kb]
  top_max = jnp.take_along_axis(flat(block_max), sel, axis=-1)
  chosen = jnp.take_along_axis(blocks.reshape(*lead, g * nb, kk), sel[..., None], axis=-2)
  items, excess = _truncated(k_item, chosen, top_max)                    # [..., kb, K]
  if bound is not None:  # the item's excess below the group's bound: its block's plus its own
    excess = jnp.logaddexp(jnp.take_along_axis(flat(block_excess), sel, axis=-1)[..., None],
                           excess)
    t = jnp.take_along_axis(bound, sel // nb, axis=-1)[..., None]
    items = jnp.where(jnp.isfinite(items), t - _softplus(t + excess), NEG_INF)
    excess = jnp.where(jnp.isfinite(items), excess, jnp.inf)
  pos = _top_k_by(items.reshape(*lead, kb * kk), excess.reshape(*lead, kb * kk), k)
  values = jnp.take_along_axis(items.reshape(*lead, kb * kk), pos, axis=-1)
  block = jnp.take_along_axis(sel, pos // kk, axis=-1)
  item = jnp.minimum((block % nb) * kk + pos % kk, v - 1)  # padding items are never finite
  group = (block // nb).astype(jnp.int32)
  values = values + ref[..., None]
  if bound is not None:  # back in the caller's frame, rounding must not lift a value over its cap
    values = jnp.minimum(values, jnp.take_along_axis(cap, group, axis=-1))
  return group, item.astype(jnp.int32), values
