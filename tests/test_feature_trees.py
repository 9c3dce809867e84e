"""Feature drafters (EAGLE) drafting trees (`drafters/features.py` through `drafters/growth.py`):
every tree method reproduces the verifier's greedy output token for token on a ragged batch with
stop tokens; sampled trees emit the verifier's law (chi-square against exact enumeration at T = 1
and at T = 0.8 with top-k), and the deterministic top-K tree verified by the sampling rule (the
planted bug) fails the same check; after rounds with random acceptance along the drafted trees,
fixed and dynamic, the drafter's cache and its kept law and feature equal a fresh forward over
the committed text with the verifier's features."""

import jax
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding.drafters import dyn, features, standard, trees
from spec_jax.decoding.sampling import Sampling


SHAPES = {"rsd_c": dict(branching=(2, 2)), "rsd_s": dict(width=2),
          "specinfer": dict(width=2), "spectr": dict(width=2)}


@pytest.fixture(scope="module")
def models():
  return testing.tiny_feature_pair()


@pytest.fixture(scope="module")
def greedy_reference(models):
  return testing.greedy_reference(*models[:2])


@pytest.mark.parametrize("method", sorted(SHAPES))
def test_greedy_feature_trees_equal_verifier_greedy(method, models, greedy_reference):
  v_cfg, v_params, d_cfg, d_params = models
  drafter = features.FeatureDrafter(d_cfg, standard.tree(method, 3, **SHAPES[method]))
  testing.assert_greedy_equal(v_cfg, v_params, drafter, d_params, greedy_reference)


def _law_pvalue(spec, sampling, cls=features.FeatureDrafter):
  v_cfg, v_params, d_cfg, d_params = testing.tiny_feature_pair(vocab_size=6, sharpness=3.0,
                                                                sigma=0.5)
  return testing.sd_law_pvalue(v_cfg, v_params, cls(d_cfg, spec), d_params, [1, 4, 2],
                               sampling=sampling)


@pytest.mark.parametrize("method,sampling", [("rsd_c", Sampling(1.0)),
                                             ("spectr", Sampling(0.8, top_k=4))])
def test_sampled_feature_trees_are_lossless(method, sampling):
  assert _law_pvalue(standard.tree(method, 2, **SHAPES[method]), sampling) > 1e-3


def _gumbel_top_k_without_noise(rng, scores, k):
  del rng
  values, index = jax.lax.top_k(scores, k)
  return index, values


class _DeterministicTreeDrafter(features.FeatureDrafter):
  """The feature drafter under another name, so that the loop traced with the planted bug below
  is compiled for it alone."""


def test_the_deterministic_tree_fails_the_law_check(monkeypatch):
  """Planted bug: RSD-C's children the drafter's top 2 instead of a Gumbel-top-2 sample (the
  T = 0 tree), q still the exact law, verified by the sampling rule."""
  monkeypatch.setattr(trees, "gumbel_top_k", _gumbel_top_k_without_noise)
  assert _law_pvalue(standard.tree("rsd_c", 2, (2, 2)), Sampling(1.0),
                     _DeterministicTreeDrafter) < 1e-6


def _check_node_laws(drafter, params, state, proposal, lengths):
  """Every drafted node's q is the drafter's law after its path fed as a chain (pairs of the
  previous step's predicted feature and the token, one call each from the kept state): each
  node's pair carries its own parent's predicted feature."""
  apply = drafter._apply()  # noqa: SLF001

  @jax.jit
  def feed(cache, feature, x, pos):
    out, hidden, cache = apply(params, x, pos, cache, features=feature)
    return cache, hidden[-1], jax.nn.softmax(out[:, 0])

  tokens, parent, valid, q = (np.asarray(x) for x in (proposal.tokens, proposal.parent,
                                                      proposal.valid, proposal.q))
  b = tokens.shape[0]
  kept_law = jax.nn.softmax(state["logits"])
  for row in range(b):
    for node in sorted(set(parent[row][valid[row]].tolist()) - {-1}):
      path = []
      j = node
      while j > 0:
        path.insert(0, int(tokens[row, j]))
        j = int(parent[row, j])
      cache, feature, law = state["cache"], np.asarray(state["feature"])[:, None], kept_law
      for i, x in enumerate(path):
        pos = np.full((b, 1), lengths[row] + i, np.int32)
        cache, feature, law = feed(cache, feature, np.full((b, 1), x, np.int32), pos)
      np.testing.assert_allclose(q[row, node], np.asarray(law)[row], atol=1e-5,
                                 err_msg=f"row {row}, node {node}")


def test_drafter_state_after_random_acceptance_is_a_fresh_forward():
  """Rounds of propose / verifier score / a random accepted path and next token / both commits:
  the drafter's K/V at every committed slot, and the law and predicted feature it keeps for the
  next round, equal a fresh forward over the committed text with the verifier's features (a
  wrong node, feature, token or slot in the commit changes them); every node's law is the
  drafter's along its path (`_check_node_laws`). A dynamic tree, whose layout differs per row
  and whose frontier overflows the proposal's slots (7 drafting slots for 5 nodes); the fixed
  layouts share its feed and commit."""
  v_cfg, v_params, d_cfg, d_params = testing.tiny_feature_pair()
  drafter = features.FeatureDrafter(d_cfg, dyn.shape((3, 4), 3, None, 3))

  def check_laws(step, before, proposal, lengths):
    if step == 1:  # a round after a commit of a tree's path
      _check_node_laws(drafter, d_params, before, proposal, lengths)

  state, tokens, lengths, depths = testing.feature_rounds(v_cfg, v_params, drafter, d_params,
                                                          on_propose=check_laws)
  assert max(depths) == 3 and len(depths) >= 3  # paths of several depths, the deepest too
  testing.assert_fresh_feature_state(v_cfg, v_params, drafter, d_params, state, tokens, lengths)
