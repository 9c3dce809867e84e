"""Chain acceptance rules: which draft tokens the verifier keeps, and the token it adds.

Shapes: B batch rows (independent), G = γ draft tokens, V vocabulary.
  p      f32[B, G+1, V]  verifier law at each draft position plus the bonus position, after
                         temperature/top-k/top-p (`sampling.probs_from_logits`)
  q      f32[B, G, V]    the exact law each draft token was sampled from (DESIGN §2, §6: never a
                         one-hot stand-in, never another precision)
  draft  int32[B, G]
Every rule returns a `Verdict`: n accepted drafts, then one more token (the correction at the
first rejection, or the bonus drawn from p_G when all G were accepted), so a round emits n + 1.

Rules are pure and jittable; G and V are static (taken from shapes) and nothing loops over B.
All arithmetic is float32 on the laws as given.
"""

from __future__ import annotations

import operator

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.decoding.sampling import sample

# A residual with less mass than this is rounding noise, not a law (p == q up to float error, or
# p/q not quite normalised); a rejection that lands there falls back to p_n. The true rejection
# probability is then below this floor too, so the fallback moves the emitted law by < 1e-6.
_MIN_RESIDUAL_MASS = 1e-6

LENIENCES = ("lin", "sq", "exp")


@flax.struct.dataclass
class Verdict:
  """num_accepted int32[B] in [0, G]: accepted draft tokens (a round emits num_accepted + 1).
  next_token int32[B]: correction token (on rejection) or bonus token (all G accepted).
  accept_prob f32[B, G]: probability the rule accepts draft i given it reached i,
    min(1, f(p_i(x_i)) / q_i(x_i)) (f = identity when lossless); 1/0 for greedy.
  """
  num_accepted: jax.Array
  next_token: jax.Array
  accept_prob: jax.Array


def positive_int(value, field: str, meaning: str = "") -> int:
  """`value` as a Python int; ValueError naming `field` unless it is an integer >= 1."""
  try:
    value = operator.index(value)
  except TypeError:
    raise ValueError(f"{field} must be an integer >= 1, got {value!r}.") from None
  if value < 1:
    raise ValueError(f"{field} must be >= 1{meaning}, got {value}.")
  return value


def validate_gamma(gamma, max_gamma: int | None = None, field: str = "decode.gamma") -> int:
  """γ as a Python int; ValueError naming `field` if γ < 1 or γ > max_gamma (e.g. cache room)."""
  gamma = positive_int(gamma, field, " (draft tokens per round)")
  if max_gamma is not None and gamma > max_gamma:
    raise ValueError(f"{field} = {gamma} exceeds the maximum {max_gamma} allowed here.")
  return gamma


def acceptance_rate(p: jax.Array, q: jax.Array) -> jax.Array:
  """f32[...]: α = Σ_x min(p(x), q(x)) for p, q f32[..., V] (Leviathan et al. 2023, Def. 3.1 and
  Cor. 3.6: the chance that speculative sampling accepts a draft drawn from q)."""
  return jnp.sum(jnp.minimum(p.astype(jnp.float32), q.astype(jnp.float32)), axis=-1)


def _check_shapes(p, q, draft) -> int:
  """Static shape checks (q may be None for greedy); returns γ."""
  q_shape = None if q is None else q.shape
  if p.ndim != 3 or draft.ndim != 2 or (q is not None and q.ndim != 3):
    raise ValueError(f"Expected p[B, γ+1, V], q[B, γ, V], draft[B, γ]; got p{p.shape}, "
                     f"q{q_shape}, draft{draft.shape}.")
  gamma = validate_gamma(draft.shape[1])
  if (p.shape[:2] != (draft.shape[0], gamma + 1)
      or (q is not None and q.shape[:2] != draft.shape)):
    raise ValueError(f"Shapes disagree on B or γ: p{p.shape} (want [B, γ+1, V]), "
                     f"q{q_shape}, draft{draft.shape}.")
  if q is not None and p.shape[2] != q.shape[2]:
    # DESIGN §6: a drafter/verifier vocabulary mismatch must fail loudly or be mapped explicitly.
    raise ValueError(f"Verifier vocabulary {p.shape[2]} != drafter vocabulary {q.shape[2]}; map "
                     "draft ids and q into the verifier vocabulary first.")
  return gamma


def _leading_true(ok_BxG: jax.Array) -> jax.Array:
  """int32[B]: length of the all-True prefix of each row (n = index of the first rejection)."""
  return jnp.sum(jnp.cumprod(ok_BxG.astype(jnp.int32), axis=1), axis=1)


def _at(x_BxGxV: jax.Array, i_BxG: jax.Array) -> jax.Array:
  """x[b, g, i[b, g]]: the probability of each row's token at each position."""
  return jnp.take_along_axis(x_BxGxV, i_BxG[..., None], axis=-1)[..., 0]


def _row(x_BxGxV: jax.Array, n_B: jax.Array) -> jax.Array:
  """x[b, n[b]] -> f32[B, V]."""
  return jnp.take_along_axis(x_BxGxV, n_B[:, None, None], axis=1)[:, 0]


def greedy(p: jax.Array, q: jax.Array, draft: jax.Array, rng: jax.Array) -> Verdict:
  """Greedy verification: accept draft i while it equals argmax p_i (ties → lowest id, as
  jnp.argmax); next = argmax p at the first mismatch, or argmax p_γ when all match. The output is
  exactly the verifier's greedy continuation. q and rng are unused (kept for one signature); q may
  be None, so drafters without an exact law (n-gram, prompt lookup) can still be verified."""
  del rng
  gamma = _check_shapes(p, q, draft)
  target_BxG1 = jnp.argmax(p.astype(jnp.float32), axis=-1).astype(jnp.int32)
  match_BxG = draft.astype(jnp.int32) == target_BxG1[:, :gamma]
  n_B = _leading_true(match_BxG)
  next_B = jnp.take_along_axis(target_BxG1, n_B[:, None], axis=1)[:, 0]
  return Verdict(num_accepted=n_B, next_token=next_B, accept_prob=match_BxG.astype(jnp.float32))


def _rejection_sample_chain(p, q, draft, rng, lenience_fn) -> Verdict:
  """Chain speculative sampling with acceptance ratio f(p)/q; f = identity is lossless.

  Leviathan et al. 2023, Alg. 1 (Chen et al. 2023, Alg. 2), with DistillSpec's lenience
  (Zhou et al. 2024, §5.3). Positions are 0-based here (the paper's i is our i + 1). For
  i = 0..γ-1 draw u_i ~ U[0, 1) and
    accept x_i  iff  u_i · q_i(x_i) < f(p_i(x_i))      [⇔ u_i < min(1, f(p)/q); safe at q = 0]
    n = number of leading accepts = index of the first rejection (γ if none)
    next ~ norm(max(0, p_n − min(q_n, f(p_n))))   if n < γ   [Alg. 1: norm(max(0, p − q))]
    next ~ p_γ                                     if n = γ   [the bonus token]
  Randomness is split once per purpose (accept uniforms, then one categorical draw per row from
  the law chosen for that row), so any two rules built on this function with the same rng see
  the same uniforms and the same draw: lenience ε = 1 is speculative sampling bit for bit.
  """
  gamma = _check_shapes(p, q, draft)
  p = p.astype(jnp.float32)
  q = q.astype(jnp.float32)
  draft = draft.astype(jnp.int32)
  rng_accept, rng_next = jax.random.split(rng)

  p_draft_BxG = _at(p[:, :gamma], draft)
  q_draft_BxG = _at(q, draft)
  f_draft_BxG = lenience_fn(p_draft_BxG)
  u_BxG = jax.random.uniform(rng_accept, draft.shape, jnp.float32)
  # Multiplying instead of dividing keeps q(x) = 0 well defined: such a token was never drawn,
  # but if it shows up it is accepted iff f(p(x)) > 0. p(x) = 0 is never accepted (u·q < 0 fails).
  accepted_BxG = u_BxG * q_draft_BxG < f_draft_BxG
  safe_q_BxG = jnp.where(q_draft_BxG > 0, q_draft_BxG, 1.0)  # no 0/0 in the unused branch
  accept_prob_BxG = jnp.where(q_draft_BxG > 0, jnp.minimum(1.0, f_draft_BxG / safe_q_BxG),
                              (f_draft_BxG > 0).astype(jnp.float32))
  n_B = _leading_true(accepted_BxG)

  # Residual at the first rejection; rows with n = γ read q_{γ-1} here and ignore the result.
  p_n_BxV = _row(p, n_B)
  q_n_BxV = _row(q, jnp.minimum(n_B, gamma - 1))
  residual_BxV = jnp.maximum(0.0, p_n_BxV - jnp.minimum(q_n_BxV, lenience_fn(p_n_BxV)))
  mass_B = jnp.sum(residual_BxV, axis=-1, keepdims=True)
  # Degenerate residual (p ≈ q but float still rejected): draw from p_n rather than from zeros.
  residual_BxV = jnp.where(mass_B > _MIN_RESIDUAL_MASS, residual_BxV / mass_B, p_n_BxV)
  # n = γ: the bonus law p_γ is p_n itself.
  law_BxV = jnp.where((n_B == gamma)[:, None], p_n_BxV, residual_BxV)
  next_B = sample(rng_next, law_BxV)
  return Verdict(num_accepted=n_B, next_token=next_B, accept_prob=accept_prob_BxG)


def speculative_sampling(p: jax.Array, q: jax.Array, draft: jax.Array, rng: jax.Array
                         ) -> Verdict:
  """Lossless chain speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

  Accept x_i with probability min(1, p_i(x_i)/q_i(x_i)); at the first rejection n draw from
  norm(max(0, p_n − q_n)); if all γ are accepted draw the bonus from p_γ. Emitted tokens follow
  p exactly, and P(accept x_i | reached i) averages to α_i = Σ min(p_i, q_i) (Thm 3.5, Cor 3.6).
  """
  return _rejection_sample_chain(p, q, draft, rng, lambda p_: p_)


def _lenience_fn(lenience: str, epsilon: float):
  """f(p) for DistillSpec's lenience functions. ε = 1 returns the identity, so the lossless rule
  is reproduced with the very same float ops (XLA's CPU pow(p, 1.0) happens to be exact too, but
  nothing promises that on every backend)."""
  if lenience not in LENIENCES:
    raise ValueError(f"decode.lenience must be one of {LENIENCES}, got {lenience!r}.")
  epsilon = float(epsilon)
  if not 0.0 < epsilon <= 1.0:  # also rejects NaN
    raise ValueError(f"decode.epsilon must be in (0, 1] (1 = lossless), got {epsilon}.")
  if epsilon == 1.0:
    return lambda p_: p_
  if lenience == "lin":
    return lambda p_: p_ / epsilon                      # f_lin(p, ε) = p / ε
  if lenience == "sq":
    return lambda p_: p_ / (epsilon * epsilon)         # f_sq(p, ε) = p / ε²
  return lambda p_: jnp.power(p_, epsilon)              # f_exp(p, ε) = p^ε


def lenient(p: jax.Array, q: jax.Array, draft: jax.Array, rng: jax.Array, *, lenience: str,
            epsilon: float) -> Verdict:
  """Lossy speculative sampling with a lenience function (DistillSpec, Zhou et al. 2024, §5.3;
  Leviathan et al. 2023, App. A.5, where l = ε and f = f_lin).

  Accept x_i with probability min(1, f(p_i(x_i), ε) / q_i(x_i)), with
    f_lin = p/ε,  f_sq = p/ε²,  f_exp = p^ε,   ε ∈ (0, 1]   (ε = 1: lossless).
  On rejection draw from norm(max(0, p − min(q, f(p)))), the mass p still lacks after the
  accept step. The papers fix only the accept test (Leviathan: "multiply q(x) by l before
  comparing with p(x) in Alg. 1"); we keep Alg. 1's residual. Since f(p) ≥ p for all three
  lenience functions, max(0, p − min(q, f(p))) = max(0, p − q), and this choice
    - reduces to speculative sampling at ε = 1 (same code path, same rng use, bit for bit);
    - keeps Leviathan's guarantee that no token is emitted with probability above f(p(x))
      (p/l for f_lin): cells with q ≥ p get no residual mass, cells with q < p get at most p;
    - is the residual closest to p in total variation: it only fills cells where the accept step
      left a deficit and never overshoots them (unlike norm(max(0, p − l·q)), the other reading).
  Emitted law per position: min(q, f(p)) + (1 − Σ min(q, f(p))) · norm(max(0, p − q)).

  lenience and epsilon are static (Python values); bad ones raise ValueError naming
  decode.lenience / decode.epsilon.
  """
  return _rejection_sample_chain(p, q, draft, rng, _lenience_fn(lenience, epsilon))


# A dumb registry: configs name a rule by string; `lenient` takes lenience/epsilon as keywords.
RULES = {"greedy": greedy, "speculative": speculative_sampling, "lenient": lenient}
