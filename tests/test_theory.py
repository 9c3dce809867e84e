"""Closed-form speculative decoding predictions (Leviathan et al. 2023, §3)."""

import numpy as np
import pytest

from spec_jax.evaluation import theory


@pytest.mark.parametrize("alpha, gamma, tau", [(0.6, 2, 1.96), (0.8, 5, 3.69), (0.9, 10, 6.86)])
def test_block_efficiency_leviathan_table(alpha, gamma, tau):
  assert round(float(theory.expected_block_efficiency(alpha, gamma)), 2) == tau


def test_block_efficiency_limits_and_broadcast():
  assert float(theory.expected_block_efficiency(1.0, 4)) == 5.0  # every draft accepted
  assert float(theory.expected_block_efficiency(0.0, 4)) == 1.0  # only the correction token
  assert float(theory.expected_block_efficiency(0.7, 0)) == 1.0  # γ = 0: plain decoding
  # Continuous at α → 1 on both sides of the switch to the limit.
  np.testing.assert_allclose(theory.expected_block_efficiency(1 - 1e-6, 4), 5.0, rtol=1e-5)
  # Direct sum Σ_{k=0..γ} α^k.
  alphas = np.linspace(0.0, 0.99, 7)
  got = theory.expected_block_efficiency(alphas[:, None], np.arange(1, 6)[None, :])
  want = np.array([[sum(a ** k for k in range(g + 1)) for g in range(1, 6)] for a in alphas])
  np.testing.assert_allclose(got, want, rtol=1e-12)


def test_speedup():
  for alpha, gamma in [(0.6, 2), (0.8, 5), (0.9, 10)]:
    assert float(theory.expected_speedup(alpha, gamma, 0.0)) == pytest.approx(
        float(theory.expected_block_efficiency(alpha, gamma)))
  # τ(0.8, 5) = 3.68928 over 5·0.05 + 1 = 1.25.
  assert float(theory.expected_speedup(0.8, 5, 0.05)) == pytest.approx(3.68928 / 1.25)


def test_optimal_gamma():
  for alpha in (0.3, 0.6, 0.8, 0.95):
    for c in (0.01, 0.05, 0.2, 0.5):
      gammas = np.arange(1, 21)
      speedups = [(1 - alpha ** (g + 1)) / (1 - alpha) / (g * c + 1) for g in gammas]
      assert theory.optimal_gamma(alpha, c, 20) == gammas[int(np.argmax(speedups))]
  assert theory.optimal_gamma(0.8, 0.0, 12) == 12  # free drafts: draft as far as allowed
  assert theory.optimal_gamma(0.0, 0.1, 12) == 1   # nothing is ever accepted
  # Better drafters justify longer drafts.
  assert theory.optimal_gamma(0.9, 0.05, 30) > theory.optimal_gamma(0.6, 0.05, 30)


def test_bad_inputs():
  with pytest.raises(ValueError, match="alpha"):
    theory.expected_block_efficiency(1.5, 3)
  with pytest.raises(ValueError, match="alpha"):
    theory.expected_block_efficiency(float("nan"), 3)
  with pytest.raises(ValueError, match="gamma"):
    theory.expected_block_efficiency(0.5, -1)
  with pytest.raises(ValueError, match="gamma"):
    theory.expected_block_efficiency(0.5, 2.5)
  with pytest.raises(ValueError, match="c "):
    theory.expected_speedup(0.5, 3, -0.1)
  with pytest.raises(ValueError, match="gamma"):
    theory.optimal_gamma(0.5, 0.1, 0)
