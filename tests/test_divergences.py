"""Divergences (spec_jax.training.divergences): closed forms on hand tables, limits, gradients
by finite differences, the decoding-time transform, and bad input. No model; milliseconds."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.decoding import sampling as sampling_lib
from spec_jax.training import divergences as dv

S1 = sampling_lib.Sampling(temperature=1.0)
P = np.array([0.5, 0.3, 0.15, 0.05])
Q = np.array([0.2, 0.2, 0.5, 0.1])


def _kl(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  nz = a > 0
  return float(np.sum(a[nz] * np.log(a[nz] / b[nz])))


def _jsd(p, q, beta):
  m = beta * p + (1 - beta) * q
  return beta * _kl(p, m) + (1 - beta) * _kl(q, m)


def _value(name, p, q, beta=0.5, sampling=S1):
  return float(dv.per_token(name, jnp.log(jnp.asarray(p, jnp.float32)),
                            jnp.log(jnp.asarray(q, jnp.float32)), sampling=sampling, beta=beta))


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_closed_forms_on_a_hand_table(beta):
  # Hand values: KL(P‖Q) = .5 ln 2.5 + .3 ln 1.5 + .15 ln .3 + .05 ln .5 = 0.3523...
  assert _kl(P, Q) == pytest.approx(0.5 * np.log(2.5) + 0.3 * np.log(1.5) + 0.15 * np.log(0.3)
                                    + 0.05 * np.log(0.5))
  assert _value("fkl", P, Q) == pytest.approx(_kl(P, Q), rel=1e-5)
  assert _value("rkl", P, Q) == pytest.approx(_kl(Q, P), rel=1e-5)
  assert _value("jsd", P, Q, beta) == pytest.approx(_jsd(P, Q, beta), rel=1e-5)
  # TVD = ½ Σ|p - q| = ½ (.3 + .1 + .35 + .05) = 0.4, and = 1 - Σ min(p, q).
  assert _value("tvd", P, Q) == pytest.approx(0.4, rel=1e-6)
  assert _value("tvd", P, Q) == pytest.approx(1 - np.minimum(P, Q).sum(), rel=1e-6)
  alpha = dv.acceptance_rate(jnp.log(jnp.asarray(P)), jnp.log(jnp.asarray(Q)))
  assert float(alpha) == pytest.approx(0.6, rel=1e-6)


def test_temperature_is_applied_to_both_laws():
  # At T = 0.5 the laws are p² and q², renormalised.
  s = sampling_lib.Sampling(temperature=0.5)
  p2, q2 = P ** 2 / (P ** 2).sum(), Q ** 2 / (Q ** 2).sum()
  assert _value("fkl", P, Q, sampling=s) == pytest.approx(_kl(p2, q2), rel=1e-5)
  assert _value("tvd", P, Q, sampling=s) == pytest.approx(0.5 * np.abs(p2 - q2).sum(), rel=1e-5)


def test_limits():
  rng = np.random.default_rng(0)
  for _ in range(5):
    p = rng.dirichlet(np.ones(7))
    q = rng.dirichlet(np.ones(7))
    for name in dv.DIVERGENCES:
      assert _value(name, p, p) == pytest.approx(0.0, abs=1e-6), name
    for beta in (0.0, 1.0):  # m = q or m = p: JSD[0] = JSD[1] = 0 even for p ≠ q
      assert _value("jsd", p, q, beta) == pytest.approx(0.0, abs=1e-7)
    assert 0 < _value("jsd", p, q, 0.5) <= np.log(2)
    # JSD[β]/β → KL(p‖q) as β → 0 and JSD[β]/(1-β) → KL(q‖p) as β → 1.
    # (The gap is O(β·χ²(p‖q)); β = 1e-4 keeps it under 1% for these laws.)
    assert _value("jsd", p, q, 1e-4) / 1e-4 == pytest.approx(_value("fkl", p, q), rel=1e-2)
    assert _value("jsd", p, q, 1 - 1e-4) / 1e-4 == pytest.approx(_value("rkl", p, q), rel=1e-2)
    assert _value("tvd", p, q) == pytest.approx(1 - np.minimum(p, q).sum(), abs=1e-6)


@pytest.mark.parametrize("sampling", [
    sampling_lib.Sampling(1.0), sampling_lib.Sampling(0.7, top_k=3),
    sampling_lib.Sampling(1.3, top_p=0.8), sampling_lib.Sampling(0.9, top_k=5, top_p=0.6)])
def test_log_law_is_the_decoding_law(sampling):
  logits = jax.random.normal(jax.random.key(1), (4, 9)) * 3
  log_law = dv.log_law(logits, sampling)
  probs = sampling_lib.probs_from_logits(logits, sampling)
  np.testing.assert_allclose(np.exp(log_law), probs, atol=1e-6)
  # Exactly -inf off the support, finite on it (even where a probability underflows).
  assert np.array_equal(np.isneginf(log_law), probs == 0)
  far = jnp.asarray([[0.0, -200.0, 1.0]])
  assert np.isfinite(dv.log_law(far, sampling_lib.Sampling(1.0))).all()



def test_log_law_cuts_top_p_at_its_boundary():
  """A law exact in binary: the mass before a 1/8 token is exactly 0.75, so top_p = 0.75 cuts it
  in training's law as in decoding's."""
  exact = jnp.log(jnp.array([[0.125, 0.5, 0.125, 0.25]]))
  law = np.exp(dv.log_law(exact, sampling_lib.Sampling(1.0, top_p=0.75)))
  np.testing.assert_allclose(law, [[0, 2 / 3, 0, 1 / 3]], atol=1e-6)


def _fd_grad(f, x, eps=1e-2):
  """Central differences of f at x, shaped [*f's shape, *x's shape]; all coordinates in one
  vmapped, jitted call."""
  x = jnp.asarray(x, jnp.float32)
  e = eps * jnp.eye(x.size, dtype=jnp.float32).reshape((x.size, *x.shape))
  vals = jax.jit(jax.vmap(f))(jnp.concatenate([x + e, x - e]))   # [2·size, *f's shape]
  diff = (vals[:x.size] - vals[x.size:]) / (2 * eps)
  return jnp.moveaxis(diff, 0, -1).reshape((*diff.shape[1:], *x.shape))


@pytest.mark.parametrize("sampling", [sampling_lib.Sampling(1.0),
                                      sampling_lib.Sampling(0.8, top_k=4)], ids=["full", "topk"])
def test_gradients_match_finite_differences(sampling):
  zp = jax.random.normal(jax.random.key(2), (2, 6)) * 1.5
  zq = jax.random.normal(jax.random.key(3), (2, 6)) * 1.5
  mask = jnp.asarray([1.0, 1.0])
  names = ["jsd", "tvd"] if sampling.top_k else sorted(dv.DIVERGENCES)  # KL: rejected under top-k
  # All divergences as one vector-valued function: one jacobian and one FD compile per side.
  f_student = lambda z: jnp.stack([dv.divergence(n, zp, z, mask, sampling=sampling, beta=0.3)
                                   for n in names])  # noqa: E731
  f_teacher = lambda z: jnp.stack([dv.divergence(n, z, zq, mask, sampling=sampling, beta=0.3)
                                   for n in names])  # noqa: E731
  for f, z in ((f_student, zq), (f_teacher, zp)):
    jac = jax.jit(jax.jacrev(f))(z)                      # [divergence, 2, 6]
    assert np.all(np.isfinite(jac))
    fd = _fd_grad(f, z)                                  # [divergence, 2, 6]
    np.testing.assert_allclose(jac, fd, atol=2e-3, err_msg=str(names))


def test_gradient_closed_forms():
  # d KL(p‖q)/dz_q = (q - p)/T and d KL(q‖p)/dz_q = q (log q - log p - KL(q‖p)) / T per token.
  t = 0.7
  s = sampling_lib.Sampling(t)
  zp = jax.random.normal(jax.random.key(4), (5,))
  zq = jax.random.normal(jax.random.key(5), (5,))
  p, q = jax.nn.softmax(zp / t), jax.nn.softmax(zq / t)
  g = jax.grad(lambda z: dv.per_token("fkl", zp, z, sampling=s))(zq)
  np.testing.assert_allclose(g, (q - p) / t, atol=1e-6)
  rkl = float(dv.per_token("rkl", zp, zq, sampling=s))
  g = jax.grad(lambda z: dv.per_token("rkl", zp, z, sampling=s))(zq)
  np.testing.assert_allclose(g, q * (jnp.log(q) - jnp.log(p) - rkl) / t, atol=1e-6)


def test_zero_probabilities_give_exact_zero_terms_and_finite_gradients():
  # A top-k teacher law puts zeros where the student has mass: JSD/TVD stay finite, and the
  # gradient w.r.t. the teacher's cut logits is exactly 0 (they are not part of its law).
  s = sampling_lib.Sampling(1.0, top_k=2)
  zp = jnp.asarray([[3.0, 2.0, 0.0, -1.0]])
  zq = jnp.asarray([[0.0, 1.0, 2.0, 0.5]])
  for name in ("jsd", "tvd"):
    val = dv.per_token(name, zp, zq, sampling=s)
    gp = jax.grad(lambda z: dv.per_token(name, z, zq, sampling=s)[0])(zp)
    gq = jax.grad(lambda z: dv.per_token(name, zp, z, sampling=s)[0])(zq)
    assert np.isfinite(val).all() and np.isfinite(gp).all() and np.isfinite(gq).all()
    np.testing.assert_array_equal(gp[0, 2:], 0.0)
  # Closed form with the truncated laws: p keeps tokens {0, 1}, q keeps {1, 2}.
  p = np.r_[np.exp([3.0, 2.0]) / np.exp([3.0, 2.0]).sum(), 0, 0]
  q = np.r_[0, np.exp([1.0, 2.0]) / np.exp([1.0, 2.0]).sum(), 0]
  assert float(dv.per_token("jsd", zp, zq, sampling=s)[0]) == pytest.approx(_jsd(p, q, 0.5),
                                                                              rel=1e-5)
  assert float(dv.per_token("tvd", zp, zq, sampling=s)[0]) == pytest.approx(
      0.5 * np.abs(p - q).sum(), rel=1e-5)


def test_masked_mean_ignores_masked_tokens():
  zp = jax.random.normal(jax.random.key(6), (2, 3, 5))
  zq = jax.random.normal(jax.random.key(7), (2, 3, 5))
  mask = jnp.asarray([[0, 1, 1], [0, 0, 1]], jnp.float32)
  per = dv.per_token("tvd", zp, zq, sampling=S1)
  want = float(per[0, 1] + per[0, 2] + per[1, 2]) / 3
  assert float(dv.divergence("tvd", zp, zq, mask, sampling=S1)) == pytest.approx(want, rel=1e-6)
  # Garbage logits at masked positions change nothing.
  zq2 = zq.at[0, 0].set(1e4)
  assert float(dv.divergence("tvd", zp, zq2, mask, sampling=S1)) == pytest.approx(want, rel=1e-6)
  assert float(dv.divergence("fkl", zp, zq, jnp.zeros((2, 3)), sampling=S1)) == 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="kl"), r"distill.divergence='kl' is not a divergence; choose one of \['fkl'"),
    (dict(name="jsd", beta=-0.1), r"distill.beta must be in \[0, 1\]"),
    (dict(name="jsd", beta=1.5), r"distill.beta must be in \[0, 1\]"),
    (dict(name="jsd", beta=float("nan")), r"distill.beta must be in \[0, 1\]"),
    (dict(name="fkl", sampling=sampling_lib.Sampling(0.0)),
     r"distill.temperature=0 \(greedy\) has no gradient"),
    (dict(name="rkl", sampling=sampling_lib.Sampling(1.0, top_k=5)),
     r"distill.divergence='rkl' with distill.top_k=5.*infinite.*'jsd', 'tvd'"),
])
def test_bad_input_names_the_field(kwargs, message):
  kwargs = {"beta": 0.5, "sampling": S1, **kwargs}
  z = jnp.zeros((2, 4))
  with pytest.raises(ValueError, match=message):
    dv.per_token(kwargs.pop("name"), z, z, **kwargs)


def test_vocab_mismatch_fails_loudly():
  with pytest.raises(ValueError, match=r"Verifier \(teacher\) vocabulary 5 != drafter \(student\) "
                     r"vocabulary 4"):
    dv.divergence("fkl", jnp.zeros((1, 2, 5)), jnp.zeros((1, 2, 4)), jnp.ones((1, 2)),
                  sampling=S1)
