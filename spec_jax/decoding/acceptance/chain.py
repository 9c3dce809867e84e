"""Chain acceptance rules: which draft tokens the verifier keeps, and the token it adds.

Shape letters (repo legend): B batch rows (independent), A = γ draft tokens, V vocabulary.
  p      f32[B, γ+1, V]  verifier law at each draft position plus the bonus position, after
                         temperature/top-k/top-p (`sampling.probs_from_logits`)
  q      f32[B, γ, V]    the exact law each draft token was sampled from (docs/design.md §2, §6: never a
                         one-hot stand-in, never another precision); q may carry one more row
                         (a chain proposal's leaf, all zeros), which is ignored
  draft  int32[B, γ]
Every rule returns a `protocols.Verdict`: n accepted drafts, then one more token (the correction
at the first rejection, or the bonus drawn from p_γ when all γ were accepted), so a round emits
n + 1; with the per-position statistics the loop records (reached, α, accept_prob).

Rules are pure and jittable; γ and V are static (taken from shapes) and nothing loops over B.
All arithmetic is float32 on the laws as given.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from spec_jax.decoding.acceptance.residuals import MIN_RESIDUAL_MASS, acceptance_rate
from spec_jax.decoding.protocols import Verdict
from spec_jax.decoding.sampling import sample, uniform

LENIENCES = ("lin", "sq", "exp")

# f(p, ε) of each lenience (DistillSpec, Zhou et al. 2024, §5.3), defined once: the rule below
# binds ε statically, `evaluation/quality.py` traces it so an ε sweep compiles once.
LENIENCE_FNS = {"lin": lambda p, e: p / e,               # f_lin(p, ε) = p / ε
                "sq": lambda p, e: p / (e * e),           # f_sq(p, ε) = p / ε²
                "exp": lambda p, e: jnp.power(p, e)}      # f_exp(p, ε) = p^ε


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


def _check_shapes(p, q, draft) -> int:
  """Static shape checks (q may be None for greedy); returns γ."""
  q_shape = None if q is None else q.shape
  if p.ndim != 3 or draft.ndim != 2 or (q is not None and q.ndim != 3):
    raise ValueError(f"Expected p[B, γ+1, V], q[B, γ, V], draft[B, γ]; got p{p.shape}, "
                     f"q{q_shape}, draft{draft.shape}.")
  gamma = validate_gamma(draft.shape[1])
  if (p.shape[:2] != (draft.shape[0], gamma + 1)
      or (q is not None and q.shape[0] != draft.shape[0])
      or (q is not None and q.shape[1] not in (gamma, gamma + 1))):
    raise ValueError(f"Shapes disagree on B or γ: p{p.shape} (want [B, γ+1, V]), "
                     f"q{q_shape} (want [B, γ, V] or [B, γ+1, V]), draft{draft.shape}.")
  if q is not None and p.shape[2] != q.shape[2]:
    # docs/design.md §6: a drafter/verifier vocabulary mismatch must fail loudly or be mapped explicitly.
    raise ValueError(f"Verifier vocabulary {p.shape[2]} != drafter vocabulary {q.shape[2]}; map "
                     "draft ids and q into the verifier vocabulary first (proposal.q).")
  return gamma


def _leading_true(ok_BxA: jax.Array) -> jax.Array:
  """int32[B]: length of the all-True prefix of each row (n = index of the first rejection)."""
  return jnp.sum(jnp.cumprod(ok_BxA.astype(jnp.int32), axis=1), axis=1)


def _at(x_BxAxV: jax.Array, i_BxA: jax.Array) -> jax.Array:
  """x[b, g, i[b, g]]: the probability of each row's token at each position."""
  return jnp.take_along_axis(x_BxAxV, i_BxA[..., None], axis=-1)[..., 0]


def _row(x_BxAxV: jax.Array, n_B: jax.Array) -> jax.Array:
  """x[b, n[b]] -> f32[B, V]."""
  return jnp.take_along_axis(x_BxAxV, n_B[:, None, None], axis=1)[:, 0]


def _verdict(p, q, n_B, next_B, accept_prob_BxA) -> Verdict:
  """The chain's Verdict: path 1..n, per-position reached / α (Σ min(p_i, q_i) where reached)."""
  b, gamma = accept_prob_BxA.shape
  pos = jnp.arange(gamma, dtype=jnp.int32)[None]
  reached = pos <= n_B[:, None]
  if q is None:
    alpha = jnp.zeros((b, gamma), jnp.float32)
  else:
    alpha = jnp.where(reached, acceptance_rate(p[:, :gamma], q[:, :gamma]), 0.0)
  return Verdict(num_accepted=n_B, next_token=next_B,
                 path=jnp.where(pos < n_B[:, None], pos + 1, 0), reached=reached, alpha=alpha,
                 num_candidates=reached.astype(jnp.int32), accept_prob=accept_prob_BxA,
                 chain=True)


def greedy(p: jax.Array, q: jax.Array, draft: jax.Array, rng: jax.Array) -> Verdict:
  """Greedy verification: accept draft i while it equals argmax p_i (ties → lowest id, as
  jnp.argmax); next = argmax p at the first mismatch, or argmax p_γ when all match. The output is
  exactly the verifier's greedy continuation. q and rng are unused (kept for one signature); q may
  be None, so drafters without an exact law (n-gram, prompt lookup) can still be verified."""
  del rng
  gamma = _check_shapes(p, q, draft)
  target_BxA1 = jnp.argmax(p.astype(jnp.float32), axis=-1).astype(jnp.int32)
  match_BxA = draft.astype(jnp.int32) == target_BxA1[:, :gamma]
  n_B = _leading_true(match_BxA)
  next_B = jnp.take_along_axis(target_BxA1, n_B[:, None], axis=1)[:, 0]
  return _verdict(p, q, n_B, next_B, match_BxA.astype(jnp.float32))


def top_k_relaxed(p: jax.Array, q: jax.Array, draft: jax.Array, rng: jax.Array, *,
                  k: int) -> Verdict:
  """Stern et al. 2018's relaxed acceptance (§5.1, top-k selection), lossy: accept draft i while
  it is among the k most likely tokens of p_i (ties at the k-th value included); next = argmax p
  at the first rejection, or argmax p_γ when every draft is kept. k = 1 is `greedy` where the
  top value is unique (a draft tied with the argmax is kept, where greedy takes the lowest id).
  p must be the verifier's full law (the loop passes its T = 1 softmax: ranks are all that
  matter); the output leaves the verifier's greedy path wherever a non-argmax draft is kept, and
  the quality cost is reported beside τ (verifier log-likelihood), as for lenience."""
  del rng
  gamma = _check_shapes(p, q, draft)
  p = p.astype(jnp.float32)
  kth_BxA = jax.lax.top_k(p[:, :gamma], k)[0][..., -1]
  p_draft_BxA = jnp.take_along_axis(p[:, :gamma], draft.astype(jnp.int32)[..., None], -1)[..., 0]
  keep_BxA = p_draft_BxA >= kth_BxA
  n_B = _leading_true(keep_BxA)
  target_BxA1 = jnp.argmax(p, axis=-1).astype(jnp.int32)
  next_B = jnp.take_along_axis(target_BxA1, n_B[:, None], axis=1)[:, 0]
  return _verdict(p, q, n_B, next_B, keep_BxA.astype(jnp.float32))


def _rejection_sample_chain(p, q, draft, rng, f) -> Verdict:
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
  q = q[:, :gamma].astype(jnp.float32)
  draft = draft.astype(jnp.int32)
  rng_accept, rng_next = jax.random.split(rng)

  p_draft_BxA = _at(p[:, :gamma], draft)
  q_draft_BxA = _at(q, draft)
  f_draft_BxA = f(p_draft_BxA)
  u_BxA = uniform(rng_accept, draft.shape)
  # Multiplying instead of dividing keeps q(x) = 0 well defined: such a token was never drawn,
  # but if it shows up it is accepted iff f(p(x)) > 0. p(x) = 0 is never accepted (u·q < 0 fails).
  accepted_BxA = u_BxA * q_draft_BxA < f_draft_BxA
  safe_q_BxA = jnp.where(q_draft_BxA > 0, q_draft_BxA, 1.0)  # no 0/0 in the unused branch
  accept_prob_BxA = jnp.where(q_draft_BxA > 0, jnp.minimum(1.0, f_draft_BxA / safe_q_BxA),
                              (f_draft_BxA > 0).astype(jnp.float32))
  n_B = _leading_true(accepted_BxA)

  # Residual at the first rejection; rows with n = γ read q_{γ-1} here and ignore the result.
  p_n_BxV = _row(p, n_B)
  q_n_BxV = _row(q, jnp.minimum(n_B, gamma - 1))
  residual_BxV = jnp.maximum(0.0, p_n_BxV - jnp.minimum(q_n_BxV, f(p_n_BxV)))
  mass_B = jnp.sum(residual_BxV, axis=-1, keepdims=True)
  # Degenerate residual (p ≈ q but float still rejected): draw from p_n rather than from zeros.
  residual_BxV = jnp.where(mass_B > MIN_RESIDUAL_MASS, residual_BxV / mass_B, p_n_BxV)
  # n = γ: the bonus law p_γ is p_n itself.
  law_BxV = jnp.where((n_B == gamma)[:, None], p_n_BxV, residual_BxV)
  next_B = sample(rng_next, law_BxV)
  return _verdict(p, q, n_B, next_B, accept_prob_BxA)


def speculative_sampling(p: jax.Array, q: jax.Array, draft: jax.Array, rng: jax.Array
                         ) -> Verdict:
  """Lossless chain speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

  Accept x_i with probability min(1, p_i(x_i)/q_i(x_i)); at the first rejection n draw from
  norm(max(0, p_n − q_n)); if all γ are accepted draw the bonus from p_γ. Emitted tokens follow
  p exactly, and P(accept x_i | reached i) averages to α_i = Σ min(p_i, q_i) (Thm 3.5, Cor 3.6).
  """
  return _rejection_sample_chain(p, q, draft, rng, lambda p_: p_)


def lenience_fn(lenience: str, epsilon: float):
  """f(p) for DistillSpec's lenience functions with a static ε, validated (ValueError naming
  decode.lenience / decode.epsilon). ε = 1 returns the identity, so the lossless rule is
  reproduced with the very same float ops (XLA's CPU pow(p, 1.0) happens to be exact too, but
  nothing promises that on every backend)."""
  if lenience not in LENIENCES:
    raise ValueError(f"decode.lenience must be one of {LENIENCES}, got {lenience!r}.")
  epsilon = float(epsilon)
  if not 0.0 < epsilon <= 1.0:  # also rejects NaN
    raise ValueError(f"decode.epsilon must be in (0, 1] (1 = lossless), got {epsilon}.")
  if epsilon == 1.0:
    return lambda p_: p_
  return lambda p_: LENIENCE_FNS[lenience](p_, epsilon)


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
  return _rejection_sample_chain(p, q, draft, rng, lenience_fn(lenience, epsilon))


def stop_at_drafted(verdict: Verdict, p: jax.Array, valid: jax.Array, rng: jax.Array, *,
                    greedy: bool) -> Verdict:
  """A chain verdict cut at each row's last drafted node, for chains whose rows stop drafting
  early (`trees.TreeSpec.stop`; valid bool[B, γ + 1] a prefix per row, k drafts after the root).
  A row whose rule got past x_k accepted all k of its drafts; its next token is then drawn from
  p_k itself (argmax p_k for a greedy rule), the bonus of a γ = k chain, whatever the rule did at
  the invalid nodes after it. A row that rejected some x_j, j ≤ k, keeps its verdict. Since a
  row's k depends on the drafter's draws alone, each round is chain speculative decoding with
  γ = k: as exact as the rule, and greedy output stays the verifier's."""
  gamma = verdict.path.shape[1]
  k = jnp.sum(valid[:, 1:], axis=1).astype(jnp.int32)
  over = verdict.num_accepted >= k
  n = jnp.minimum(verdict.num_accepted, k)
  p_k = _row(p.astype(jnp.float32), k)
  bonus = jnp.argmax(p_k, axis=-1).astype(jnp.int32) if greedy else sample(rng, p_k)
  pos = jnp.arange(gamma, dtype=jnp.int32)[None]
  drafted = pos < k[:, None]
  reached = verdict.reached & drafted
  accept_prob = verdict.accept_prob
  if accept_prob is not None:
    accept_prob = jnp.where(drafted, accept_prob, 0.0)
  return verdict.replace(
      num_accepted=n, next_token=jnp.where(over, bonus, verdict.next_token),
      path=jnp.where(pos < n[:, None], pos + 1, 0), reached=reached,
      alpha=jnp.where(reached, verdict.alpha, 0.0), num_candidates=reached.astype(jnp.int32),
      accept_prob=accept_prob)
