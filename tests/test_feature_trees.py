"""Feature drafters (EAGLE) drafting trees (`drafters/features.py` through `drafters/growth.py`):
every tree method reproduces the verifier's greedy output token for token on a ragged batch with
stop tokens; sampled trees emit the verifier's law (chi-square against exact enumeration at T = 1
and at T = 0.8 with top-k), and the deterministic top-K tree verified by the sampling rule (the
planted bug) fails the same check; after rounds with random acceptance along the drafted trees,
fixed and dynamic, the drafter's cache and its kept law and feature equal a fresh forward over
the committed text with the verifier's features."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import dyn, features, standard, trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import llama


PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 8], [6, 1, 2, 9], [3]]
SHAPES = {"rsd_c": dict(branching=(2, 2)), "rsd_s": dict(width=2),
          "specinfer": dict(width=2), "spectr": dict(width=2)}


@pytest.fixture(scope="module")
def greedy_reference():
  """(models, padded prompts, stop ids, the verifier's greedy output with them): two stop tokens
  taken from the free-running output cut two rows early."""
  models = testing.tiny_feature_pair()
  v_cfg, v_params = models[:2]
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  free = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg,
                               sampling=Sampling(), max_new_tokens=14).new_tokens()
  stops = (free[0][5], free[2][3])
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=14, stop_ids=stops)
  assert min(map(len, ar.new_tokens())) < 14
  return models, prompts, stops, ar.new_tokens()


@pytest.mark.parametrize("method", sorted(SHAPES))
def test_greedy_feature_trees_equal_verifier_greedy(method, greedy_reference):
  (v_cfg, v_params, d_cfg, d_params), prompts, stops, want = greedy_reference
  drafter = features.FeatureDrafter(d_cfg, standard.tree(method, 3, **SHAPES[method]))
  out = testing.decode(v_cfg, v_params, drafter, d_params, prompts, Sampling(), 14, stop_ids=stops)
  assert out.new_tokens() == want
  accepted = np.asarray(out.stats.accepted)
  assert accepted.sum() > 0 and (accepted < np.asarray(out.stats.verifier_calls) * 3).any()


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
  apply = jax.jit(drafter._apply())  # noqa: SLF001
  tokens, parent, valid, q = (np.asarray(x) for x in (proposal.tokens, proposal.parent,
                                                      proposal.valid, proposal.q))
  b = tokens.shape[0]
  for row in range(b):
    for node in sorted(set(parent[row][valid[row]].tolist()) - {-1}):
      path = []
      j = node
      while j > 0:
        path.insert(0, int(tokens[row, j]))
        j = int(parent[row, j])
      cache, feature, logits = state["cache"], state["feature"][:, None], state["logits"]
      for i, x in enumerate(path):
        pos = jnp.full((b, 1), lengths[row] + i, jnp.int32)
        out, hidden, cache = apply(params, jnp.full((b, 1), x, jnp.int32), pos, cache,
                                   features=feature)
        feature, logits = hidden[-1], out[:, 0]
      np.testing.assert_allclose(q[row, node], jax.nn.softmax(logits[row]), atol=1e-5,
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
  verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  padded = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  size = 48
  v_cache, v_hidden = verifier.init(v_params, padded.tokens, size)
  state = drafter.init(d_params, padded.tokens, padded.lengths, size, v_hidden)
  tokens = np.zeros((len(PROMPTS), size), np.int32)
  tokens[:, :8] = np.asarray(padded.tokens)
  lengths = np.array(padded.lengths)
  rng = np.random.default_rng(0)
  propose = jax.jit(drafter.propose, static_argnames="sampling")
  score, v_commit, commit = jax.jit(verifier.score), jax.jit(verifier.commit), jax.jit(
      drafter.commit)
  depths = set()
  for step in range(5):
    lens = jnp.asarray(lengths)
    before = state
    proposal, state = propose(d_params, state, jnp.asarray(tokens), lens, jax.random.key(step),
                              sampling=Sampling(1.0))
    if step == 1:  # a round after a commit of a tree's path
      _check_node_laws(drafter, d_params, before, proposal, lengths)
    _, hidden, v_cache = score(v_params, v_cache, proposal, lens)
    verdict = testing.random_verdict(proposal, rng)
    v_cache = v_commit(v_cache, lens, verdict)
    state = commit(d_params, state, proposal, verdict, lens, hidden)
    for b in range(len(PROMPTS)):
      n = int(verdict.num_accepted[b])
      depths.add(n)
      path = np.asarray(proposal.tokens)[b, np.asarray(verdict.path)[b, :n]]
      tokens[b, lengths[b]:lengths[b] + n + 1] = [*path, int(verdict.next_token[b])]
      lengths[b] += n + 1
  assert max(depths) == 3 and len(depths) >= 3  # paths of several depths, the deepest too
  longest = int(lengths.max())
  x = jnp.asarray(tokens[:, :longest])
  positions = jnp.arange(longest)[None].repeat(len(PROMPTS), 0)
  _, v_fresh, _ = llama.make_apply(v_cfg, (-1,))(v_params, x, positions)
  _, d_fresh, fresh = llama.make_apply(d_cfg, (-1,))(
      d_params, x, positions, llama.init_cache(d_cfg, len(PROMPTS), longest),
      features=features.shift(v_fresh[-1]))
  for b, length in enumerate(lengths):
    for name in ("k", "v"):
      np.testing.assert_allclose(getattr(state["cache"], name)[:, b, :length],
                                 getattr(fresh, name)[:, b, :length], atol=1e-4, rtol=1e-4)
  logits, feature = drafter._last(d_params, d_fresh[-1], jnp.asarray(lengths - 1))  # noqa: SLF001
  np.testing.assert_allclose(state["logits"], logits, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(state["feature"], feature, atol=1e-4, rtol=1e-4)
