"""Acceptance rules on hand-written probability tables, no model (docs/design.md §2, §6).

Statistical tests simulate whole draft chains: a Markov "drafter" q_i(· | x_{i-1}) and
"verifier" p_i(· | x_{i-1}) over a tiny vocabulary, drafts drawn from q, the rule applied to a
batch of B independent rows in one jitted call. Each exactness check looks at three things, as
docs/design.md §6 asks: the law of the emitted tokens (chi-square vs p), the acceptance rate
(Σ min(p, q), binomial tolerance) and the distribution of the accepted count n. Seeds are fixed,
so every test is deterministic; thresholds (p-value > 1e-3, 5σ) make a false failure unlikely
for any seed while the planted bugs below miss by orders of magnitude.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from spec_jax.decoding import acceptance
from spec_jax.decoding.acceptance import chain
from spec_jax.decoding.protocols import chain_proposal
from spec_jax.decoding.sampling import sample
from spec_jax.evaluation import theory

B = 20_000  # rows per simulation: binomial σ of an acceptance rate is ≤ 0.0036
V = 4


# ---------------------------------------------------------------------------------------------
# Helpers.

def _chisquare_pvalue(counts, probs, min_expected=5.0):
  """Chi-square goodness of fit; cells expected below `min_expected` are pooled into one."""
  counts = np.asarray(counts, np.float64).ravel()
  probs = np.asarray(probs, np.float64).ravel()
  probs = probs / probs.sum()
  expected = probs * counts.sum()
  # A count where the law has no mass at all is an outright failure.
  if np.any(counts[expected == 0] > 0):
    return 0.0
  small = expected < min_expected
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  keep = exp > 0
  return stats.chisquare(obs[keep], exp[keep]).pvalue


def _binomial_close(successes, trials, prob, sigmas=5.0):
  se = np.sqrt(max(prob * (1 - prob), 1e-12) / trials)
  return abs(successes / trials - prob) <= sigmas * se + 1e-9


def _markov_tables(seed, gamma, vocab=V, concentration=2.0):
  """p0 [V], q0 [V], P [γ, V, V] (P[i-1, a] = p_i(· | x_{i-1} = a)), Q [γ-1, V, V]."""
  r = np.random.default_rng(seed)
  d = lambda *shape: r.dirichlet(np.full(vocab, concentration), size=shape).astype(np.float32)
  return d(), d(), d(gamma, vocab), d(gamma - 1, vocab)


@functools.partial(jax.jit, static_argnames=("rule", "batch"))
def _simulate(rule, p0, q0, P, Q, rng, batch=B):
  """Draft a chain per row from q, build the verifier laws along it, apply `rule`."""
  gamma = P.shape[0]
  keys = jax.random.split(rng, gamma + 1)
  q_rows = [jnp.broadcast_to(q0, (batch, q0.shape[-1]))]
  drafts = [sample(keys[0], q_rows[0])]
  for i in range(1, gamma):  # static γ: the draft loop, never a loop over B
    q_rows.append(Q[i - 1][drafts[-1]])
    drafts.append(sample(keys[i], q_rows[-1]))
  p_rows = [jnp.broadcast_to(p0, q_rows[0].shape)] + [P[i - 1][drafts[i - 1]]
                                                      for i in range(1, gamma + 1)]
  p, q, draft = jnp.stack(p_rows, 1), jnp.stack(q_rows, 1), jnp.stack(drafts, 1)
  return draft, rule(p, q, draft, keys[-1])


def _emitted_first_two(draft, verdict):
  """First emitted token for every row; second emitted token where n >= 1 (else -1)."""
  draft, n, nxt = map(np.asarray, (draft, verdict.num_accepted, verdict.next_token))
  first = np.where(n >= 1, draft[:, 0], nxt)
  if draft.shape[1] >= 2:
    second = np.where(n >= 2, draft[:, 1], nxt)
  else:
    second = nxt
  return first, np.where(n >= 1, second, -1)


def _accepted_count_law(p0, q0, P, Q, f=lambda p: p):
  """Exact P(n = k), k = 0..γ, for the Markov tables (forward recursion over accepted mass)."""
  gamma = P.shape[0]
  at_least = [1.0]
  m = np.minimum(q0, f(p0)).astype(np.float64)  # m(a) = P(x_0 = a and accepted)
  at_least.append(m.sum())
  for i in range(1, gamma):
    m = np.einsum("a,ab->b", m, np.minimum(Q[i - 1], f(P[i - 1])))
    at_least.append(m.sum())
  at_least.append(0.0)
  return -np.diff(at_least)


def _check_lossless(rule, gamma, seed):
  """Return the four p-values/flags of the exactness check (see module docstring)."""
  p0, q0, P, Q = _markov_tables(seed, gamma)
  draft, v = _simulate(rule, p0, q0, P, Q, jax.random.key(seed))
  first, second = _emitted_first_two(draft, v)
  n = np.asarray(v.num_accepted)
  out = {}
  out["first_token"] = _chisquare_pvalue(np.bincount(first, minlength=V), p0)
  # Given x_0 = a accepted, the next emitted token must follow p_1(· | a); x_0 itself follows
  # min(p_0, q_0) / α_0 on those rows.
  m0 = np.minimum(p0, q0)
  joint = (m0 / m0.sum())[:, None] * P[0]
  has2 = second >= 0
  out["first_two"] = _chisquare_pvalue(np.bincount(first[has2] * V + second[has2],
                                                   minlength=V * V), joint)
  out["num_accepted"] = _chisquare_pvalue(np.bincount(n, minlength=gamma + 1),
                                          _accepted_count_law(p0, q0, P, Q))
  alpha0 = float(acceptance.acceptance_rate(jnp.asarray(p0), jnp.asarray(q0)))
  out["accept_rate"] = _binomial_close(np.sum(n >= 1), n.size, alpha0)
  return out


def _broken_residual_is_p(p, q, draft, rng):
  """Planted bug: on rejection draw from p_n instead of norm(max(0, p_n − q_n))."""
  v = chain.speculative_sampling(p, q, draft, rng)
  p_n = jnp.take_along_axis(p, v.num_accepted[:, None, None], axis=1)[:, 0]
  wrong = sample(jax.random.fold_in(rng, 1), p_n)
  rejected = v.num_accepted < draft.shape[1]
  return v.replace(next_token=jnp.where(rejected, wrong, v.next_token))


def _one_hot_q(p, q, draft, rng):
  """Verifying with a one-hot q (accept with p(x)) and its matching residual: exact, but
  acceptance drops from Σ min(p, q) to Σ q·p (docs/design.md §6; transformers#47932)."""
  return chain.speculative_sampling(p, jax.nn.one_hot(draft, p.shape[-1]), draft, rng)


_lenient_eps1 = functools.partial(chain.lenient, lenience="exp", epsilon=1.0)
# One compiled program per input shape; the hand-table tests all use [B, 2, 3].
_speculative = jax.jit(chain.speculative_sampling)


# ---------------------------------------------------------------------------------------------
# Hand-written tables.

P_HAND = np.array([0.3, 0.4, 0.3], np.float32)
Q_HAND = np.array([0.6, 0.3, 0.1], np.float32)
BONUS_HAND = np.array([0.2, 0.3, 0.5], np.float32)


def _hand_inputs(draft_token, batch=B):
  p = jnp.broadcast_to(jnp.stack([P_HAND, BONUS_HAND]), (batch, 2, 3))
  q = jnp.broadcast_to(Q_HAND, (batch, 1, 3))
  return p, q, jnp.full((batch, 1), draft_token, jnp.int32)


def test_hand_table_rejection_and_residual():
  # p(0)/q(0) = 0.3/0.6: accepted half the time; residual norm(max(0, p − q)) = [0, 1/3, 2/3].
  v = _speculative(*_hand_inputs(0), jax.random.key(0))
  n, nxt = np.asarray(v.num_accepted), np.asarray(v.next_token)
  np.testing.assert_allclose(np.asarray(v.accept_prob), 0.5, rtol=1e-6)
  assert _binomial_close(n.sum(), n.size, 0.5)
  rejected = nxt[n == 0]
  assert np.all(rejected != 0)  # the residual has no mass on the rejected token
  assert _chisquare_pvalue(np.bincount(rejected, minlength=3), [0, 1 / 3, 2 / 3]) > 1e-3
  assert _chisquare_pvalue(np.bincount(nxt[n == 1], minlength=3), BONUS_HAND) > 1e-3


@pytest.mark.parametrize("token", [1, 2])
def test_hand_table_always_accepts_when_p_ge_q(token):
  v = _speculative(*_hand_inputs(token), jax.random.key(1))
  assert np.all(np.asarray(v.num_accepted) == 1)
  np.testing.assert_array_equal(np.asarray(v.accept_prob), 1.0)
  # All accepted: the extra token is the bonus, drawn from p_γ.
  counts = np.bincount(np.asarray(v.next_token), minlength=3)
  assert _chisquare_pvalue(counts, BONUS_HAND) > 1e-3


def test_zero_probabilities():
  # Even rows: the draft has p(x) = 0. Odd rows: q(x) = 0 (never drawn, but must be safe).
  p = jnp.array([[[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]],
                 [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]], jnp.float32)
  q = jnp.array([[[1.0, 0.0, 0.0]], [[1.0, 0.0, 0.0]]], jnp.float32)
  draft = jnp.array([[0], [1]], jnp.int32)
  tile = lambda x: jnp.tile(x, (B // 2,) + (1,) * (x.ndim - 1))
  v = _speculative(tile(p), tile(q), tile(draft), jax.random.key(3))
  accept_prob, n, nxt = map(np.asarray, (v.accept_prob, v.num_accepted, v.next_token))
  assert np.isfinite(accept_prob).all()
  np.testing.assert_array_equal(accept_prob[:, 0], np.tile([0.0, 1.0], B // 2))
  np.testing.assert_array_equal(n, np.tile([0, 1], B // 2))
  assert _chisquare_pvalue(np.bincount(nxt[0::2], minlength=3), [0, 0.5, 0.5]) > 1e-3  # residual
  assert np.all(nxt[1::2] == 0)  # bonus law is one-hot


def test_degenerate_residual_falls_back_to_p():
  # p is not normalised (p < q everywhere), so max(0, p − q) is all zeros while rejections
  # still happen: the guard must draw from p_n, never from an all-zero law.
  p = jnp.broadcast_to(jnp.array([[0.25, 0.25, 0.0], [0.0, 0.0, 1.0]]), (B, 2, 3))
  q = jnp.broadcast_to(jnp.array([[0.5, 0.5, 0.0]]), (B, 1, 3))
  draft = jnp.zeros((B, 1), jnp.int32)
  v = _speculative(p, q, draft, jax.random.key(2))
  n, nxt = np.asarray(v.num_accepted), np.asarray(v.next_token)
  assert _binomial_close(n.sum(), n.size, 0.5)
  assert _chisquare_pvalue(np.bincount(nxt[n == 0], minlength=3), [0.5, 0.5, 0.0]) > 1e-3


def test_greedy_one_hot():
  gamma, vocab = 3, 5
  target = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])
  p = jax.nn.one_hot(target, vocab)
  q = jnp.full((4, gamma, vocab), 1.0 / vocab)  # ignored by greedy
  draft = jnp.array([[1, 2, 3],    # all match: bonus = argmax p_γ
                     [1, 0, 3],    # first mismatch at 1: correction = argmax p_1
                     [4, 2, 3],    # mismatch at 0 even though later ones match
                     [0, 0, 0]], jnp.int32)
  v = jax.jit(chain.greedy)(p, q, draft, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(v.num_accepted), [3, 1, 0, 3])
  np.testing.assert_array_equal(np.asarray(v.next_token), [4, 2, 1, 0])
  np.testing.assert_array_equal(np.asarray(v.accept_prob),
                                [[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 1]])


def test_greedy_ties_take_lowest_index():
  p = jnp.array([[[0.4, 0.4, 0.2], [0.1, 0.45, 0.45]]])
  q = jnp.full((1, 1, 3), 1 / 3)
  v = chain.greedy(p, q, jnp.array([[1]]), jax.random.key(0))
  assert int(v.num_accepted[0]) == 0 and int(v.next_token[0]) == 0
  v = chain.greedy(p, None, jnp.array([[0]]), jax.random.key(0))  # no q: greedy-only drafters
  assert int(v.num_accepted[0]) == 1 and int(v.next_token[0]) == 1


def test_acceptance_rate_matches_numpy():
  p0, q0, P, Q = _markov_tables(0, 3)
  rate = lambda a, b: np.asarray(acceptance.acceptance_rate(jnp.asarray(a), jnp.asarray(b)))
  np.testing.assert_allclose(rate(P, P), 1.0, rtol=1e-6)
  np.testing.assert_allclose(rate(p0, q0), np.minimum(p0, q0).sum(), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Losslessness of the rule alone.

@pytest.mark.parametrize("rule", [chain.speculative_sampling, _lenient_eps1],
                         ids=["speculative", "lenient_eps1"])
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_lossless(rule, gamma):
  result = _check_lossless(rule, gamma, seed=10 + gamma)
  assert result["first_token"] > 1e-3, result
  assert result["first_two"] > 1e-3, result
  assert result["num_accepted"] > 1e-3, result
  assert result["accept_rate"], result


def test_planted_bug_residual_p_fails_token_law():
  result = _check_lossless(_broken_residual_is_p, 2, seed=12)
  assert result["first_token"] < 1e-6, result
  # Acceptance is untouched by this bug: only a token-law check can see it.
  assert result["accept_rate"], result


def test_planted_bug_one_hot_q_fails_acceptance_rate():
  result = _check_lossless(_one_hot_q, 2, seed=12)
  # Exact token law (one-hot q with its own residual is still lossless) ...
  assert result["first_token"] > 1e-3, result
  # ... but it accepts less than Σ min(p, q): the acceptance and n checks catch it.
  assert not result["accept_rate"], result
  assert result["num_accepted"] < 1e-6, result


def test_block_efficiency_matches_theory():
  # The same tables at every position and no dependence on the prefix: acceptance is i.i.d.
  # with rate α, so E[n + 1] = τ(α, γ) (Leviathan et al. Eq. 1).
  gamma = 3
  p0, q0, _, _ = _markov_tables(3, gamma)
  P = np.broadcast_to(p0, (gamma, V, V)).copy()
  Q = np.broadcast_to(q0, (gamma - 1, V, V)).copy()
  _, v = _simulate(chain.speculative_sampling, p0, q0, P, Q, jax.random.key(3))
  tokens = np.asarray(v.num_accepted) + 1.0
  alpha = float(np.minimum(p0, q0).sum())
  tau = float(theory.expected_block_efficiency(alpha, gamma))
  assert abs(tokens.mean() - tau) < 5 * tokens.std() / np.sqrt(tokens.size), (tokens.mean(), tau)


# ---------------------------------------------------------------------------------------------
# Lenience.

def _f(lenience, eps, p):
  return {"lin": p / eps, "sq": p / eps ** 2, "exp": p ** eps}[lenience]


@pytest.mark.parametrize("lenience", acceptance.LENIENCES)
def test_lenient_eps1_is_speculative_bit_for_bit(lenience):
  p0, q0, P, Q = _markov_tables(4, 3)
  rule = functools.partial(chain.lenient, lenience=lenience, epsilon=1.0)
  for seed in range(3):
    _, ref = _simulate(chain.speculative_sampling, p0, q0, P, Q, jax.random.key(seed))
    _, got = _simulate(rule, p0, q0, P, Q, jax.random.key(seed))
    for field in ("num_accepted", "next_token", "accept_prob"):
      np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                    np.asarray(getattr(ref, field)))


@pytest.mark.parametrize("lenience", acceptance.LENIENCES)
def test_lenient_accepts_more_with_analytic_probability(lenience):
  eps, gamma = 0.5, 3
  # Seed 6: every lenience still rejects ~20-40% at position 0, so the residual shapes the law.
  p0, q0, P, Q = _markov_tables(6, gamma)
  rule = functools.partial(chain.lenient, lenience=lenience, epsilon=eps)
  draft, lossy = _simulate(rule, p0, q0, P, Q, jax.random.key(6))
  _, exact = _simulate(chain.speculative_sampling, p0, q0, P, Q, jax.random.key(6))
  draft = np.asarray(draft)
  # accept_prob = min(1, f(p)/q) at the draft token, position by position.
  p_at = np.stack([p0[draft[:, 0]]] + [P[i - 1][draft[:, i - 1], draft[:, i]]
                                       for i in range(1, gamma)], 1)
  q_at = np.stack([q0[draft[:, 0]]] + [Q[i - 1][draft[:, i - 1], draft[:, i]]
                                       for i in range(1, gamma)], 1)
  np.testing.assert_allclose(np.asarray(lossy.accept_prob),
                             np.minimum(1.0, _f(lenience, eps, p_at) / q_at), rtol=1e-5)
  # f(p) ≥ p, so with the same uniforms every lossless acceptance is also a lenient one.
  assert np.all(np.asarray(lossy.accept_prob) >= np.asarray(exact.accept_prob))
  assert np.all(np.asarray(lossy.num_accepted) >= np.asarray(exact.num_accepted))
  n = np.asarray(lossy.num_accepted)
  beta0 = np.minimum(q0, _f(lenience, eps, p0)).sum()
  assert beta0 > np.minimum(q0, p0).sum() + 0.01
  assert _binomial_close(np.sum(n >= 1), n.size, beta0)
  law_n = _accepted_count_law(p0, q0, P, Q, f=lambda p: _f(lenience, eps, p))
  assert _chisquare_pvalue(np.bincount(n, minlength=gamma + 1), law_n) > 1e-3
  # Emitted law: min(q, f(p)) + (1 − Σ min(q, f(p))) · norm(max(0, p − q)); lossy, so not p.
  first, _ = _emitted_first_two(draft, lossy)
  counts = np.bincount(first, minlength=V)
  accepted = np.minimum(q0, _f(lenience, eps, p0))
  residual = np.maximum(0.0, p0 - q0)
  with_residual = lambda r: accepted + (1 - accepted.sum()) * r / r.sum()
  law = with_residual(residual)
  assert _chisquare_pvalue(counts, law) > 1e-3
  assert _chisquare_pvalue(counts, p0) < 1e-6
  # The data also tell this residual from the other readings: lenience applied to the residual
  # too, norm(max(0, f(p) − q)), and for f_lin Leviathan's "q times l" residual
  # norm(max(0, p − εq)).
  others = [np.maximum(0.0, _f(lenience, eps, p0) - q0)]
  if lenience == "lin":
    others.append(np.maximum(0.0, p0 - eps * q0))
  for other in others:
    assert _chisquare_pvalue(counts, with_residual(other)) < 1e-6
  assert np.all(law <= _f(lenience, eps, p0) + 1e-7)  # Leviathan A.5: nothing above f(p) = p/l


# ---------------------------------------------------------------------------------------------
# Bad input, jit, batch independence.

@pytest.mark.parametrize("eps", [0.0, -0.5, 1.5, float("nan")])
def test_bad_epsilon(eps):
  p, q, draft = _hand_inputs(0, batch=2)
  with pytest.raises(ValueError, match="decode.epsilon"):
    chain.lenient(p, q, draft, jax.random.key(0), lenience="lin", epsilon=eps)


def test_bad_lenience():
  p, q, draft = _hand_inputs(0, batch=2)
  with pytest.raises(ValueError, match="decode.lenience"):
    chain.lenient(p, q, draft, jax.random.key(0), lenience="cubic", epsilon=0.5)


def test_validate_gamma():
  assert acceptance.validate_gamma(4) == 4
  assert acceptance.validate_gamma(np.int64(4), max_gamma=4) == 4
  for bad, kw in [(0, {}), (-1, {}), (2.5, {}), (5, {"max_gamma": 4})]:
    with pytest.raises(ValueError, match="gamma"):
      acceptance.validate_gamma(bad, **kw)


def test_bad_shapes():
  p, q, draft = _hand_inputs(0, batch=2)
  with pytest.raises(ValueError, match="vocabulary"):
    chain.speculative_sampling(p, jnp.pad(q, ((0, 0), (0, 0), (0, 1))), draft,
                                    jax.random.key(0))
  with pytest.raises(ValueError, match="γ"):
    chain.speculative_sampling(p[:, :1], q, draft, jax.random.key(0))


@pytest.mark.parametrize("name", sorted(acceptance.RULES))
def test_rules_jit_batch_and_row_independence(name):
  rule = acceptance.RULES[name]
  if name == "lenient":
    rule = functools.partial(rule, lenience="sq", epsilon=0.7)
  if name == "top_k_relaxed":
    rule = functools.partial(rule, k=2)
  traces = []

  @jax.jit
  def run(p, q, draft, rng):
    traces.append(1)  # Python side effect: runs once per trace
    root = jnp.zeros((draft.shape[0],), jnp.int32)
    return rule(p, chain_proposal(root, draft, q), rng)

  gamma, batch = 3, 5
  p0, q0, P, Q = _markov_tables(7, gamma)
  r = np.random.default_rng(7)
  p = jnp.asarray(r.dirichlet(np.ones(V), size=(batch, gamma + 1)), jnp.float32)
  q = jnp.asarray(r.dirichlet(np.ones(V), size=(batch, gamma)), jnp.float32)
  draft = jnp.asarray(r.integers(0, V, size=(batch, gamma)), jnp.int32)
  key = jax.random.key(7)
  v = run(p, q, draft, key)
  assert v.num_accepted.shape == (batch,) and v.num_accepted.dtype == jnp.int32
  assert v.next_token.shape == (batch,) and v.next_token.dtype == jnp.int32
  fields = ["num_accepted", "next_token", "path", "reached", "alpha"]
  if name in ("greedy", "speculative", "lenient", "top_k_relaxed"):  # the chain fast path
    assert v.accept_prob.shape == (batch, gamma) and v.accept_prob.dtype == jnp.float32
    fields.append("accept_prob")
  assert v.path.shape == v.reached.shape == v.alpha.shape == (batch, gamma)
  n = np.asarray(v.num_accepted)
  assert np.all((n >= 0) & (n <= gamma))
  # Every rule on a chain: the accepted path is nodes 1..n, depths 1..n+1 reached (if ≤ γ).
  np.testing.assert_array_equal(np.asarray(v.path),
                                np.where(np.arange(gamma) < n[:, None], np.arange(1, gamma + 1), 0))
  np.testing.assert_array_equal(np.asarray(v.reached), np.arange(gamma) <= n[:, None])
  # New values, same shapes: no retrace. Changing other rows leaves row 0 alone.
  p2 = p.at[1:].set(jnp.roll(p[1:], 1, axis=-1))
  draft2 = draft.at[1:].set((draft[1:] + 1) % V)
  v2 = run(p2, q, draft2, key)
  assert len(traces) == 1
  for field in fields:
    np.testing.assert_array_equal(np.asarray(getattr(v2, field))[0],
                                  np.asarray(getattr(v, field))[0])
