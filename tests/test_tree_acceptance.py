"""Tree acceptance rules on hand-written probability tables, no model (docs/design.md §2, §6).

Statistical tests build draft trees from hand tables the way the real samplers do (Gumbel-top-k
siblings without replacement for RSD, i.i.d. chains for SpecInfer/SpecTr), verify B independent
rows in one jitted call, and check (a) the law of the emitted tokens against the verifier's
(chi-square) and (b) the acceptance rate against its exact value (binomial, 5σ), since a rule
can keep the token law and still accept less than it should (docs/design.md §6). Planted bugs
(mismatched sibling sampling, K-SEQ with ρ = 1) must fail the same checks by orders of
magnitude. Seeds are fixed; thresholds (p > 1e-3 to pass, p < 1e-6 to fail) leave wide margins.
One-level tests put k = 1..4 candidates in one compiled shape (padding via `valid`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding.acceptance import kseq, residuals
from spec_jax.decoding.acceptance import tree as ta

B = 20_000
V = 5
K = 4  # most candidates in the one-level tests; rows are split into k = 1..K groups

_verify_jit = jax.jit(ta._verify_tree, static_argnames=("rule", "max_depth", "max_candidates",
                                                        "kseq_rho_override"))


def _verify(*args, rule, max_depth, max_candidates, kseq_rho_override=None):
  """One jitted program per (rule, shapes, ρ override); keywords always passed the same way so
  the tests share compilations."""
  return _verify_jit(*args, rule=rule, max_depth=max_depth, max_candidates=max_candidates,
                     kseq_rho_override=kseq_rho_override)


# ---------------------------------------------------------------------------------------------
# Helpers.

def _law_pvalue(samples, law):
  """Chi-square p-value of integer samples (rows of a 1-D or 2-D array) against a law array."""
  samples = np.asarray(samples).reshape(len(samples), -1)
  law = np.asarray(law, np.float64)
  table = {tuple(int(i) for i in idx): float(law[idx]) for idx in np.ndindex(law.shape)}
  return testing.chi_square_pvalue([tuple(int(x) for x in s) for s in samples], table)


def _binomial_close(successes, trials, prob, sigmas=5.0):
  se = np.sqrt(max(prob * (1 - prob), 1e-12) / trials)
  return abs(successes / trials - prob) <= sigmas * se + 1e-9


def _one_level_tables():
  """q0 has support {0, 1, 2}, p0 all five tokens: residuals carry real weight, and with k = 4
  siblings drawn without replacement the fourth has q = 0 (the support is exhausted) and must
  be skipped."""
  r = np.random.default_rng(0)
  p0 = r.dirichlet(np.ones(V)).astype(np.float32)
  q0 = np.append(r.dirichlet(np.full(V - 2, 0.7)), [0.0, 0.0]).astype(np.float32)
  return p0, q0


def _np_draw(r, q, k, without_replacement):
  """k candidates per row from q [V] or q [B, V] (float64 numpy, no compilation): Gumbel-top-k
  (an ordered sample without replacement, as `trees.gumbel_top_k` draws siblings; tokens with
  q = 0 come last once the support is exhausted) or k i.i.d. draws by inverse CDF."""
  q = np.broadcast_to(np.asarray(q, np.float64), (B, V))
  if without_replacement:
    with np.errstate(divide="ignore"):
      perturbed = np.log(q) + r.gumbel(size=q.shape)
    return np.argsort(-perturbed, axis=1, kind="stable")[:, :k].astype(np.int32)
  cdf = np.cumsum(q, axis=1)
  cdf /= cdf[:, -1:]
  u = r.random((B, k))
  return (u[..., None] < cdf[:, None, :]).argmax(-1).astype(np.int32)


def _one_level_inputs(without_replacement, seed):
  """Root with k = 1..K children (a quarter of the rows each), candidates drawn from q0.
  Returns (k per row, verify_tree's positional tree arrays p, q, tokens, parent, depth, valid)."""
  p0, q0 = _one_level_tables()
  cand = _np_draw(np.random.default_rng(seed), q0, K, without_replacement)
  tokens = jnp.asarray(np.pad(cand, ((0, 0), (1, 0))))
  parent = jnp.broadcast_to(jnp.array([-1] + [0] * K), (B, K + 1))
  depth = jnp.broadcast_to(jnp.array([0] + [1] * K), (B, K + 1))
  k = np.repeat(np.arange(1, K + 1), B // K)
  valid = jnp.asarray(np.arange(K + 1)[None] <= k[:, None])
  p = jnp.broadcast_to(jnp.asarray(p0), (B, K + 1, V))
  q = jnp.broadcast_to(jnp.asarray(q0), (B, K + 1, V))
  return k, (p, q, tokens, parent, depth, valid)


def _first_token(tokens, v):
  n, path = np.asarray(v.num_accepted), np.asarray(v.path)
  return np.where(n >= 1, np.take_along_axis(np.asarray(tokens), path, 1)[:, 0],
                  np.asarray(v.next_token))


def _one_level(rule, without_replacement, seed, kseq_rho_override=None):
  """Verify the one-level trees. Returns (k, first emitted token, n, verdict)."""
  k, args = _one_level_inputs(without_replacement, seed)
  v = _verify(*args, jax.random.key(seed + 100), rule=rule, max_depth=1, max_candidates=K,
              kseq_rho_override=kseq_rho_override)
  return k, _first_token(args[2], v), np.asarray(v.num_accepted), v


def _np_residual(r, s):
  res = np.maximum(0.0, r - s)
  return res / res.sum() if res.sum() > 1e-12 else r


def _exact_accept(p, q, k, rule, iid):
  """Exact P(some candidate accepted) by enumerating candidate sequences (float64).
  rule: "rrs_with" or "rrs_without"; iid: candidates i.i.d. from q, else without replacement."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)

  def go(r, s, drawn_law, left):
    if left == 0 or drawn_law.sum() <= 0:
      return 0.0
    total = 0.0
    law = drawn_law / drawn_law.sum()
    for x in np.flatnonzero(law):
      if s[x] <= 0:  # cannot come from s: skipped, one candidate fewer
        total += law[x] * go(r, s, drawn_law, left - 1)
        continue
      a = min(1.0, r[x] / s[x])
      r2 = _np_residual(r, s)
      s2 = s
      if rule == "rrs_without":
        s2 = s.copy()
        s2[x] = 0.0
        s2 = s2 / s2.sum() if s2.sum() > 0 else s2
      nxt = drawn_law if iid else np.where(np.arange(len(q)) == x, 0.0, drawn_law)
      total += law[x] * (a + (1 - a) * go(r2, s2, nxt, left - 1))
    return total

  return go(p, q, q, k)


def _np_kseq_rho(p, q, k):
  """ρ* by float64 bisection, independent of the module's float32 version."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  beta = lambda rho: np.minimum(q, p / rho).sum()  # noqa: E731
  lo, hi = 1.0, float(k)
  if 1 - (1 - beta(1.0)) ** k <= beta(1.0) + 1e-12:
    return 1.0
  for _ in range(60):
    mid = 0.5 * (lo + hi)
    lo, hi = (lo, mid) if 1 - (1 - beta(mid)) ** k <= mid * beta(mid) else (mid, hi)
  return hi


# ---------------------------------------------------------------------------------------------
# The hand example: p = [.3, .4, .3], q = [.6, .3, .1].

P_HAND = np.array([0.3, 0.4, 0.3], np.float32)
Q_HAND = np.array([0.6, 0.3, 0.1], np.float32)


def test_hand_table_one_rejection_update():
  r = np.asarray(residuals.residual_update(jnp.asarray(P_HAND), jnp.asarray(Q_HAND)))
  s = np.asarray(residuals.remove_token(jnp.asarray(Q_HAND), jnp.int32(0)))
  np.testing.assert_allclose(r, [0, 1 / 3, 2 / 3], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(s, [0, 3 / 4, 1 / 4], rtol=1e-6)
  np.testing.assert_allclose(min(1.0, r[1] / s[1]), 4 / 9, rtol=1e-6)
  # Rejecting token 1 next leaves max(0, r − s) = [0, 0, 5/12]: token 2 for sure.
  np.testing.assert_allclose(np.asarray(residuals.residual_update(jnp.asarray(r), jnp.asarray(s))),
                             [0, 0, 1], atol=1e-6)
  # With replacement the draft law stays q: r ← norm(max(0, r − q)) = norm([0, 1/30, 17/30]).
  np.testing.assert_allclose(np.asarray(residuals.residual_update(jnp.asarray(r), jnp.asarray(Q_HAND))),
                             [0, 1 / 18, 17 / 18], rtol=1e-5)
  # Degenerate residual (r ≈ s): falls back to r instead of dividing zeros.
  np.testing.assert_allclose(np.asarray(residuals.residual_update(jnp.asarray(Q_HAND),
                                                           jnp.asarray(Q_HAND))), Q_HAND)
  # Exhausted s: all zeros, so later candidates are skipped.
  assert np.all(np.asarray(residuals.remove_token(jnp.array([0.0, 1.0, 0.0]), jnp.int32(1))) == 0)


def _hand_root_with_children(*children):
  """verify_tree's positional arrays (p, q, tokens, parent, depth, valid) for B rows of the hand
  tables: root token 4 with the given depth-1 children, padded to the one-level shape."""
  pad = lambda law: jnp.broadcast_to(jnp.asarray(np.pad(law, (0, V - 3))), (B, K + 1, V))  # noqa: E731
  rows = lambda x: jnp.broadcast_to(jnp.array(x), (B, K + 1))  # noqa: E731
  k = len(children)
  return (pad(P_HAND), pad(Q_HAND), rows([4, *children] + [0] * (K - k)),
          rows([-1] + [0] * K), rows([0] + [1] * K), rows([True] * (k + 1) + [False] * (K - k)))


def test_hand_table_end_to_end():
  # Root with children [0, 1] (drawn without replacement, in that order), padded into the
  # one-level shape: P(accept 0) = 1/2, P(accept 1 | 0 rejected) = 4/9, else token 2.
  v = _verify(*_hand_root_with_children(0, 1), jax.random.key(0), rule="rrs_without",
              max_depth=1, max_candidates=K)
  n, path, nxt = map(np.asarray, (v.num_accepted, v.path[:, 0], v.next_token))
  outcome = np.where(n == 1, path, 2 + nxt)  # 1: node 1, 2: node 2, 4: rejected → token 2
  assert set(np.unique(outcome)) <= {1, 2, 4}
  assert _law_pvalue(outcome, np.array([0, 1 / 2, 2 / 9, 0, 5 / 18])) > 1e-3
  rejected_first = outcome != 1
  assert _binomial_close(np.sum(outcome == 2), rejected_first.sum(), 4 / 9)
  assert np.all(np.asarray(v.num_candidates)[:, 0] == 2) and np.all(np.asarray(v.reached))
  np.testing.assert_allclose(np.asarray(v.alpha)[:, 0], np.minimum(P_HAND, Q_HAND).sum(),
                             rtol=1e-6)


def test_path_names_the_accepted_candidate_among_duplicates():
  """Two i.i.d. candidates carrying the same token (nodes 1 and 2): K-SEQ and SpecInfer try them
  in order, and the path names the one accepted, node 2 when node 1 was rejected. Token 0 has
  p/q = 1/2: SpecInfer accepts node 1 w.p. 1/2 and never its copy (the residual left after
  rejecting token 0 has no mass on it); K-SEQ accepts each in turn w.p. a = 1/(2ρ)."""
  tree = _hand_root_with_children(0, 0)
  rho = float(kseq.kseq_rho(jnp.asarray(P_HAND), jnp.asarray(Q_HAND), 2))
  for rule, a1, a2 in (("rrs_with", 0.5, 0.5 * 0.0), ("kseq", 0.5 / rho, 0.5 / rho)):
    v = _verify(*tree, jax.random.key(3), rule=rule, max_depth=1, max_candidates=K)
    n, node = np.asarray(v.num_accepted), np.asarray(v.path)[:, 0]
    assert set(np.unique(node[n == 1])) <= {1, 2} and np.all(node[n == 0] == 0)
    # With replacement the residual after rejecting token 0 has no mass on 0: a second copy of
    # it is never accepted. K-SEQ keeps p and q fixed: the copy is accepted w.p. a.
    assert _binomial_close(np.sum(node == 1), B, a1), rule
    assert _binomial_close(np.sum(node == 2), B, (1 - a1) * a2), rule
  assert np.sum(node == 2) > B // 10  # the case the path must get right does occur


def test_kseq_rho_and_residual_hand_table():
  # k = 2: ρ* = 1.4 (β = 0.6 and 1 − 0.4² = 0.84 = 1.4 · 0.6); k = 1 is plain SD (ρ = 1).
  p, q = jnp.asarray(P_HAND), jnp.asarray(Q_HAND)
  np.testing.assert_allclose(float(kseq.kseq_rho(p, q, 1)), 1.0)
  np.testing.assert_allclose(float(kseq.kseq_rho(p, q, 2)), 1.4, rtol=1e-5)
  for k in (2, 3, 4):
    np.testing.assert_allclose(float(kseq.kseq_rho(p, q, k)), _np_kseq_rho(P_HAND, Q_HAND, k),
                               rtol=1e-5)
  # Exactness of the step: accepted mass min(q, p/ρ)·(1 − (1−β)^k)/β plus (1−β)^k · residual
  # gives p back.
  for k in (1, 2, 3, 4):
    rho = float(kseq.kseq_rho(p, q, k))
    m = np.minimum(Q_HAND, P_HAND / rho)
    beta = m.sum()
    law = m * (1 - (1 - beta) ** k) / beta + (1 - beta) ** k * np.asarray(
        kseq.kseq_residual(p, q, rho, k))
    np.testing.assert_allclose(law, P_HAND, atol=2e-6)
  np.testing.assert_allclose(np.asarray(kseq.kseq_residual(p, q, 1.0, 0)), P_HAND)  # k = 0: p
  # Disjoint supports: nothing is ever accepted, the residual is p.
  np.testing.assert_allclose(float(kseq.kseq_rho(jnp.array([1.0, 0]), jnp.array([0, 1.0]), 3)), 1)


# ---------------------------------------------------------------------------------------------
# Losslessness of one step (first emitted token), k = 1..4.

@pytest.mark.parametrize("rule,without_replacement", [("rrs_without", True),
                                                      ("rrs_with", False), ("kseq", False)])
def test_first_token_lossless_and_acceptance_exact(rule, without_replacement):
  p0, q0 = _one_level_tables()
  k, first, n, v = _one_level(rule, without_replacement, seed=1)
  for kk in range(1, K + 1):
    rows = k == kk
    assert _law_pvalue(first[rows], p0) > 1e-3, (rule, kk)
    if rule == "kseq":
      rho = _np_kseq_rho(p0, q0, kk)
      exact = 1 - (1 - np.minimum(q0, p0 / rho).sum()) ** kk
    else:
      exact = _exact_accept(p0, q0, kk, rule, iid=not without_replacement)
    assert _binomial_close(n[rows].sum(), rows.sum(), exact), (rule, kk, n[rows].mean(), exact)
  # k = 1: every rule is chain speculative sampling, accepting with Σ min(p, q).
  alpha = np.minimum(p0, q0).sum()
  assert _binomial_close(n[k == 1].sum(), (k == 1).sum(), alpha)
  np.testing.assert_allclose(np.asarray(v.alpha)[:, 0], alpha, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(v.reached)[:, 0], True)


def test_planted_bug_without_replacement_siblings_verified_with_replacement():
  p0, _ = _one_level_tables()
  # Two seeds' rows: at k = 2 the excess is small enough that 5,000 rows put p near 1e-6.
  runs = [_one_level("rrs_with", True, seed=seed) for seed in (1, 2)]
  k = np.concatenate([r[0] for r in runs])
  first = np.concatenate([r[1] for r in runs])
  # k = 1 is untouched (one candidate is both kinds of sample); from k = 2 on it over-accepts.
  assert _law_pvalue(first[k == 1], p0) > 1e-3
  for kk in (2, 3, 4):
    assert _law_pvalue(first[k == kk], p0) < 1e-6, kk


def test_planted_bug_kseq_rho_fixed_at_one():
  p0, _ = _one_level_tables()
  k, first, _, _ = _one_level("kseq", False, seed=1, kseq_rho_override=1.0)
  assert _law_pvalue(first[k == 1], p0) > 1e-3  # ρ* = 1 at k = 1 anyway
  for kk in (2, 3, 4):
    assert _law_pvalue(first[k == kk], p0) < 1e-6, kk


def test_iid_siblings_verified_without_replacement_stay_exact_but_accept_less():
  # Not a bug here, and worth knowing: a duplicate of a rejected token has s(x) = 0 and is
  # skipped, and an i.i.d. draw that is not a duplicate is distributed exactly as s, so the
  # token law stays p. The duplicates are wasted: acceptance falls below rrs_with's. The test
  # also guards the skip: accepting s(x) = 0 candidates whenever r(x) > 0 breaks the law.
  p0, q0 = _one_level_tables()
  k, first, n, _ = _one_level("rrs_without", False, seed=2)
  for kk in range(1, K + 1):
    rows = k == kk
    assert _law_pvalue(first[rows], p0) > 1e-3, kk
    exact = _exact_accept(p0, q0, kk, "rrs_without", iid=True)
    assert _binomial_close(n[rows].sum(), rows.sum(), exact), (kk, n[rows].mean(), exact)
  with_replacement = _exact_accept(p0, q0, K, "rrs_with", iid=True)
  assert n[k == K].mean() < with_replacement - 5 * np.sqrt(0.25 / (B // K))


# ---------------------------------------------------------------------------------------------
# Two levels: the first two emitted tokens follow the verifier's joint law.

def _two_level_tables():
  r = np.random.default_rng(3)
  d = lambda *shape: r.dirichlet(np.ones(V), size=shape).astype(np.float32)  # noqa: E731
  return d(), d(), d(V), d(V), d(V)  # p0, q0, P1[a], Q1[a], P2[b]


def _two_level_tree(seed, p0, q0, P1, Q1, P2, kind):
  """kind "rsd": RSD-C with branching (2, 2) (Gumbel-top-2 at every node); kind "chains":
  K = 3 i.i.d. chains of length 2. Both have M = 7 nodes; returns (p, q, tokens, parent, depth)
  as numpy arrays."""
  r = np.random.default_rng(seed)
  if kind == "rsd":
    t1 = _np_draw(r, q0, 2, True)                                              # nodes 1, 2
    t2 = np.concatenate([_np_draw(r, Q1[t1[:, j]], 2, True) for j in range(2)], axis=1)
    parent, depth = [-1, 0, 0, 1, 1, 2, 2], [0, 1, 1, 2, 2, 2, 2]             # 3, 4 | 5, 6
  else:
    t1 = _np_draw(r, q0, 3, False)                                             # nodes 1..3
    t2 = np.stack([_np_draw(r, Q1[t1[:, j]], 1, False)[:, 0] for j in range(3)], axis=1)
    parent, depth = [-1, 0, 0, 0, 1, 2, 3], [0, 1, 1, 1, 2, 2, 2]             # nodes 4..6
  tokens = np.concatenate([np.zeros((B, 1), np.int32), t1, t2], axis=1)
  p = np.concatenate([np.broadcast_to(p0, (B, 1, V)), P1[t1], P2[t2]], axis=1)
  q = np.concatenate([np.broadcast_to(q0, (B, 1, V)), Q1[t1],
                      np.zeros((B, 6 - t1.shape[1], V), np.float32)], axis=1)  # leaves: unused
  rows = lambda x: np.broadcast_to(np.asarray(x, np.int32), (B, 7))  # noqa: E731
  return p, q, tokens, rows(parent), rows(depth)


@pytest.mark.parametrize("rule,kind", [("rrs_without", "rsd"), ("rrs_with", "chains"),
                                       ("kseq", "chains")])
def test_two_level_joint_law(rule, kind):
  tables = _two_level_tables()
  p0, q0, P1, Q1, P2 = tables
  p, q, tokens, parent, depth = _two_level_tree(4, *tables, kind=kind)
  valid = np.ones((B, 7), bool)
  ta.check_tree(tokens[:50], parent[:50], depth[:50], valid[:50], max_depth=2, max_candidates=3)
  v = _verify(*map(jnp.asarray, (p, q, tokens, parent, depth, valid)), jax.random.key(5),
              rule=rule, max_depth=2, max_candidates=3)
  n, path, nxt = np.asarray(v.num_accepted), np.asarray(v.path), np.asarray(v.next_token)
  path_tok = np.take_along_axis(tokens, path, 1)
  first = np.where(n >= 1, path_tok[:, 0], nxt)
  second = np.where(n >= 2, path_tok[:, 1], nxt)
  # Rows that stopped at depth 0 emit their second token next round, from P1[first]; draw it
  # here from the verifier itself (the next round's first token is what the test above checks).
  fresh = _np_draw(np.random.default_rng(6), P1[first], 1, False)[:, 0]
  second[n == 0] = fresh[n == 0]
  assert _law_pvalue(first, p0) > 1e-3
  assert _law_pvalue(np.stack([first, second], 1), p0[:, None] * P1) > 1e-3
  # The path is one concrete chain carrying the emitted tokens; the stats are consistent.
  assert np.all(parent[np.arange(B), path[:, 0]][n >= 1] == 0)
  assert np.all(parent[np.arange(B), path[:, 1]][n >= 2] == path[n >= 2, 0])
  assert np.all(path[n < 2, 1] == 0) and np.all(path[n < 1, 0] == 0)
  reached, cands = np.asarray(v.reached), np.asarray(v.num_candidates)
  assert np.all(reached[:, 0]) and np.all(reached[:, 1] == (n >= 1))
  if kind == "chains":
    # Depth 2 examines the next token of every chain whose first token was accepted.
    same = (tokens[:, 1:4] == first[:, None]).sum(1)
    np.testing.assert_array_equal(cands[n >= 1, 1], same[n >= 1])
    assert np.any(same[n >= 1] >= 2)  # duplicates across chains did occur
  else:
    np.testing.assert_array_equal(cands[:, 1], np.where(n >= 1, 2, 0))


# ---------------------------------------------------------------------------------------------
# Greedy and the active set, on hand-drawn trees in the two-level tests' shape (B rows, M = 7,
# V = 5, D = 2, C = 3), so they reuse those compiled programs: hand rows are tiled to B.

_HAND_TREE = dict(  # depth 1: nodes 1-3; depth 2: node 4 (child of 1), nodes 5-6 (of 2)
    tokens=[0, 3, 1, 4, 1, 0, 2], parent=[-1, 0, 0, 0, 1, 2, 2], depth=[0, 1, 1, 1, 2, 2, 2])
_CHAINS = dict(  # three i.i.d. chains (1, 2), (1, 3), (1, 3)
    tokens=[0, 1, 1, 1, 2, 3, 3], parent=[-1, 0, 0, 0, 1, 2, 3], depth=[0, 1, 1, 1, 2, 2, 2])


def _hand_rows(tree, argmaxes, ties=()):
  """Rows of one hand tree, tiled to B; p at node i of row b is one-hot at argmaxes[b][i], or
  split evenly over `ids` for each (row, node, ids) in `ties`."""
  rows = len(argmaxes)
  p = np.zeros((rows, 7, V), np.float32)
  for b, targets in enumerate(argmaxes):
    p[b, np.arange(7), targets] = 1.0
  for b, node, ids in ties:
    p[b, node] = 0.0
    p[b, node, ids] = 1.0 / len(ids)
  tile = lambda x: jnp.asarray(np.resize(x, (B,) + x.shape[1:]))  # noqa: E731
  arr = lambda name: np.broadcast_to(np.asarray(tree[name], np.int32), (rows, 7))  # noqa: E731
  return (tile(p), tile(arr("tokens")), tile(arr("parent")), tile(arr("depth")),
          jnp.ones((B, 7), bool))


def test_greedy_hand_tree():
  argmaxes = [
      [1, 0, 2, 0, 0, 0, 4],  # node 2 (second sibling), its second child 6 (a leaf): bonus 4
      [0, 0, 0, 0, 0, 0, 0],  # no depth-1 node carries argmax p = 0: n = 0, next = 0
      [4, 0, 0, 3, 0, 0, 0],  # node 3, a depth-1 leaf: bonus = argmax p at node 3
      [0, 0, 0, 0, 0, 2, 0],  # tie 1 / 3 at the root → 1 (lowest id, as argmax): node 2, node 5
  ]
  p, tokens, parent, depth, valid = _hand_rows(_HAND_TREE, argmaxes, ties=[(3, 0, [1, 3])])
  ta.check_tree(tokens[:4], parent[:4], depth[:4], valid[:4], max_depth=2, max_candidates=3)
  # The tree loop passes the drafter's one-hot q at T = 0; greedy never reads it.
  v = _verify(p, p, tokens, parent, depth, valid, jax.random.key(0), rule="greedy",
              max_depth=2, max_candidates=3)
  got = lambda f: np.asarray(getattr(v, f))[:4]  # noqa: E731
  np.testing.assert_array_equal(got("num_accepted"), [2, 0, 1, 2])
  np.testing.assert_array_equal(got("next_token"), [4, 0, 3, 2])
  np.testing.assert_array_equal(got("path"), [[2, 6], [0, 0], [3, 0], [2, 5]])
  np.testing.assert_array_equal(got("num_candidates"), [[3, 2], [3, 0], [3, 0], [3, 2]])
  np.testing.assert_array_equal(got("reached"), got("num_candidates") > 0)


def test_active_set_with_duplicate_chains():
  # All three chains start with token 1: A = {1, 2, 3}, and depth 2 examines all three second
  # tokens (p read at node 1). Token 3 is on chains 2 and 3; the path is chain 2's own nodes
  # [2, 5], a concrete chain, not the first node of A at each depth ([1, 5]).
  argmax = [1, 3, 3, 3, 0, 2, 2]
  p, tokens, parent, depth, valid = _hand_rows(_CHAINS, [argmax])
  ta.check_tree(tokens[:1], parent[:1], depth[:1], valid[:1], max_depth=2, max_candidates=3)
  v = _verify(p, None, tokens, parent, depth, valid, jax.random.key(0), rule="greedy",
              max_depth=2, max_candidates=3)
  assert int(v.num_accepted[0]) == 2 and int(v.next_token[0]) == 2
  np.testing.assert_array_equal(np.asarray(v.path[0]), [2, 5])
  np.testing.assert_array_equal(np.asarray(v.num_candidates[0]), [3, 3])
  # A sampling rule with one-hot laws (p = q at every node) accepts surely: the candidate with
  # token 2 has q = 0 and is skipped, the next one (token 3) is taken.
  v = _verify(p, p, tokens, parent, depth, valid, jax.random.key(1), rule="rrs_with",
              max_depth=2, max_candidates=3)
  assert np.all(np.asarray(v.num_accepted) == 2) and np.all(np.asarray(v.next_token) == 2)
  np.testing.assert_array_equal(np.asarray(v.path[0]), [2, 5])


# ---------------------------------------------------------------------------------------------
# Batch behaviour and bad input.

def test_row_independence_and_no_retrace():
  # Changing every other row (their tokens and laws) leaves row 0's verdict bit for bit and
  # reuses the compiled program.
  _, args = _one_level_inputs(False, seed=7)
  key = jax.random.key(8)
  ref = _verify(*args, key, rule="kseq", max_depth=1, max_candidates=K)
  size = _verify_jit._cache_size()
  p, q, tokens = args[:3]
  p2 = p.at[1:].set(jnp.roll(p[1:], 1, axis=-1))
  tokens2 = tokens.at[1:].set((tokens[1:] + 1) % V)
  got = _verify(p2, q, tokens2, *args[3:], key, rule="kseq", max_depth=1, max_candidates=K)
  assert _verify_jit._cache_size() == size
  for field in ("num_accepted", "next_token", "path", "reached", "alpha", "num_candidates"):
    np.testing.assert_array_equal(np.asarray(getattr(got, field))[0],
                                  np.asarray(getattr(ref, field))[0])
  assert np.any(np.asarray(got.next_token) != np.asarray(ref.next_token))


def test_bad_input():
  p = jnp.full((2, 3, 4), 0.25)
  tokens = jnp.zeros((2, 3), jnp.int32)
  parent = jnp.array([[-1, 0, 0]] * 2)
  depth = jnp.array([[0, 1, 1]] * 2)
  valid = jnp.ones((2, 3), bool)
  key = jax.random.key(0)
  call = lambda **kw: ta.verify_tree(**{**dict(  # noqa: E731
      p=p, q=p, tokens=tokens, parent=parent, depth=depth, valid=valid, rng=key,
      rule="rrs_without", max_depth=1, max_candidates=2), **kw})
  with pytest.raises(ValueError, match="decode.rule"):
    call(rule="rrs")
  with pytest.raises(ValueError, match="vocabulary"):
    call(q=jnp.full((2, 3, 5), 0.2))
  with pytest.raises(ValueError, match="tokens"):
    call(tokens=jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="valid"):
    call(valid=jnp.ones((3, 3), bool))
  with pytest.raises(ValueError, match="needs q"):
    call(q=None)
  with pytest.raises(ValueError, match="max_candidates"):
    call(max_candidates=3)
  with pytest.raises(ValueError, match="max_depth"):
    call(max_depth=0)
  with pytest.raises(ValueError, match="p must be"):
    call(p=p[0], q=p[0])


def test_check_tree_rejects_malformed_trees():
  good = {k: np.array([v]) for k, v in _CHAINS.items()}
  good["valid"] = np.ones((1, 7), bool)
  ta.check_tree(**good, max_depth=2, max_candidates=3)
  with pytest.raises(ValueError, match="max_candidates"):
    ta.check_tree(**good, max_depth=2, max_candidates=2)  # three chains share the prefix (1,)
  with pytest.raises(ValueError, match="max_depth"):
    ta.check_tree(**good, max_depth=1, max_candidates=3)
  bad = {**good, "parent": np.array([[-1, 0, 0, 0, 1, 2, 6]])}
  with pytest.raises(ValueError, match="node 6"):
    ta.check_tree(**bad, max_depth=2, max_candidates=3)
  bad = {**good, "valid": np.array([[1, 1, 0, 1, 1, 1, 1]], bool)}  # node 5's parent is padding
  with pytest.raises(ValueError, match="node 5"):
    ta.check_tree(**bad, max_depth=2, max_candidates=3)
