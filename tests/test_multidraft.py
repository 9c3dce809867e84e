"""The per-level acceptance analysis (evaluation/multidraft.py) against brute-force enumeration
and against the tree rules themselves: the probabilities it reports for SpecInfer, SpecTr and RSD
are the acceptance frequencies `acceptance.tree.verify_tree` shows on one-level trees."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.decoding.acceptance import kseq
from spec_jax.decoding.acceptance import tree as ta
from spec_jax.evaluation import multidraft

V = 6
ROWS = 20_000


def _laws():
  """q has no mass on the last token (a candidate set can exhaust its support); p has all."""
  r = np.random.default_rng(3)
  p = r.dirichlet(np.ones(V))
  q = np.append(r.dirichlet(np.full(V - 1, 0.5)), 0.0)
  return p.astype(np.float32), q.astype(np.float32)


def _residual(r, s):
  res = np.maximum(0.0, r - s)
  return res / res.sum() if res.sum() > 1e-12 else r


def _enumerate(p, q, k, rule):
  """P(one of k candidates accepted), summed over every ordered candidate tuple (float64)."""
  p, q = p.astype(np.float64), q.astype(np.float64)
  rho = float(kseq.kseq_rho(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), k))
  total = 0.0
  for xs in itertools.product(range(V), repeat=k):
    if rule == "rsd" and len(set(xs)) < k:
      continue
    prob, r, s, miss = 1.0, p, q, 1.0
    for x in xs:
      prob *= s[x] if rule == "rsd" else q[x]
      if rule == "spectr":
        a = min(1.0, p[x] / (rho * q[x])) if q[x] > 0 else 0.0
      else:
        a = min(1.0, r[x] / s[x]) if s[x] > 0 else 0.0
        r = _residual(r, s)
        if rule == "rsd":
          s = s.copy()
          s[x] = 0.0
          s = s / s.sum() if s.sum() > 0 else s
      miss *= 1.0 - a
    total += prob * (1.0 - miss)
  return total


@pytest.mark.parametrize("k", [1, 2, 3])
def test_closed_forms_match_enumeration(k):
  p, q = _laws()
  got = jax.device_get(multidraft.level_acceptance(jnp.asarray(p), jnp.asarray(q),
                                                   jax.random.key(0), k=k, draws=4096))
  assert float(got["sd"]) == pytest.approx(float(np.minimum(p, q).sum()), abs=1e-6)
  assert float(got["specinfer"]) == pytest.approx(_enumerate(p, q, k, "specinfer"), abs=1e-5)
  assert float(got["spectr"]) == pytest.approx(_enumerate(p, q, k, "spectr"), abs=1e-5)
  assert float(got["rsd"]) == pytest.approx(_enumerate(p, q, k, "rsd"), abs=0.01)  # Monte Carlo
  if k == 1:  # one candidate: every rule is chain speculative sampling
    for rule in ("specinfer", "spectr", "rsd"):
      assert float(got[rule]) == pytest.approx(float(got["sd"]), abs=1e-5)
  else:  # the laws are chosen so the rules differ; a formula that ignores the residual is caught
    beta = float(np.minimum(p, q).sum())
    assert abs(float(got["specinfer"]) - (1 - (1 - beta) ** k)) > 0.02


def _one_level_acceptance(p, q, k, rule, seed=0):
  """Acceptance frequency of verify_tree on ROWS one-level trees with k candidates from q."""
  r = np.random.default_rng(seed)
  q64 = q.astype(np.float64) / q.sum()
  if rule == "rrs_without":
    with np.errstate(divide="ignore"):
      cand = np.argsort(-(np.log(q64) + r.gumbel(size=(ROWS, V))), axis=1)[:, :k]
  else:
    cand = r.choice(V, size=(ROWS, k), p=q64)
  tokens = jnp.asarray(np.pad(cand, ((0, 0), (1, 0))).astype(np.int32))
  parent = jnp.broadcast_to(jnp.array([-1] + [0] * k), (ROWS, k + 1))
  depth = jnp.broadcast_to(jnp.array([0] + [1] * k), (ROWS, k + 1))
  valid = jnp.ones((ROWS, k + 1), bool)
  pp = jnp.broadcast_to(jnp.asarray(p), (ROWS, k + 1, V))
  qq = jnp.broadcast_to(jnp.asarray(q), (ROWS, k + 1, V))
  v = ta.verify_tree(pp, qq, tokens, parent, depth, valid, jax.random.key(seed + 1), rule=rule,
                     max_depth=1, max_candidates=k)
  return float(np.mean(np.asarray(v.num_accepted)))


@pytest.mark.parametrize("name,rule", [("specinfer", "rrs_with"), ("spectr", "kseq"),
                                       ("rsd", "rrs_without")])
def test_the_tree_rules_accept_as_often_as_reported(name, rule):
  p, q = _laws()
  k = 3
  want = float(multidraft.level_acceptance(jnp.asarray(p), jnp.asarray(q), jax.random.key(0),
                                           k=k, draws=4096)[name])
  got = _one_level_acceptance(p, q, k, rule)
  se = np.sqrt(want * (1 - want) / ROWS)
  assert abs(got - want) < 5 * se + 0.003, (name, got, want)


def test_analyse_averages_generated_positions_only():
  """analyse on a tiny verifier/drafter pair: one value per k and rule, k = 1 the same for every
  rule, positions = the generated tokens (prompt positions excluded)."""
  from spec_jax import testing
  from spec_jax.decoding import generate as generate_lib
  from spec_jax.decoding import sampling as sampling_lib
  v_cfg, v_params = testing.tiny_model(seed=0)
  d_cfg, d_params = testing.tiny_model(seed=1)
  prompts = generate_lib.pad_prompts([[1, 2, 3], [4, 5]], 4, 0)
  out = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg,
                              sampling=sampling_lib.Sampling(1.0), max_new_tokens=5)
  result = multidraft.analyse(v_params, v_cfg, d_params, d_cfg, [out], ks=(1, 3), draws=8,
                              chunk=4)
  assert result["k"] == [1, 3] and result["rows"] == 2
  assert result["positions"] == int(np.sum(np.asarray(out.lengths) - np.asarray(out.prompt_lengths)))
  for a, b in multidraft.PAIRS:  # paired differences: the difference of the means
    assert result[f"{a}_minus_{b}"][1] == pytest.approx(result[a][1] - result[b][1], abs=2e-4)
    assert result[f"{a}_minus_{b}"][0] == pytest.approx(0.0, abs=1e-4)  # k = 1: all are SD
  for rule in ("specinfer", "spectr", "rsd"):
    assert result[rule][0] == pytest.approx(result["sd"][0], abs=1e-3)
    assert 0 < result[rule][1] <= 1 and result[rule][1] >= result["sd"][1] - 1e-3
