"""Draft-tree construction: Gumbel-top-k and stochastic beam search laws, masks, shapes, bad input."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding.drafters import standard, trees
from spec_jax.decoding.sampling import Sampling


# Each library step jitted once (its configuration static), so that a test compiles one program
# per configuration rather than one per eager op; inputs are built and results read on the host.
_gumbel_top_k = jax.jit(trees.gumbel_top_k, static_argnums=2)
_expand = jax.jit(trees.expand, static_argnums=(0, 1, 6, 7))
_root_level = jax.jit(trees.root_level)


def _log(p):
  """float32 log-probabilities of p on the host, log 0 = -inf."""
  with np.errstate(divide="ignore"):
    return np.log(np.asarray(p, np.float32))


def _plackett_luce(probs, k):
  """Exact law of an ordered sample of k items without replacement from probs."""
  law = {}
  for seq in itertools.permutations(range(len(probs)), k):
    pr, left = 1.0, 1.0
    for i in seq:
      pr *= probs[i] / left
      left -= probs[i]
    law[seq] = pr
  return law


def test_gumbel_top_k_is_an_ordered_sample_without_replacement():
  probs = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
  idx, values = jax.device_get(
      _gumbel_top_k(jax.random.key(0), _log(probs)[None].repeat(40_000, 0), 2))
  assert np.all(np.diff(values, axis=1) <= 0)                        # decreasing order
  samples = [tuple(r) for r in idx.tolist()]
  assert testing.chi_square_pvalue(samples, _plackett_luce(probs, 2)) > 1e-3
  # Fewer finite scores than k: the missing draws are marked -inf.
  _, values = jax.device_get(_gumbel_top_k(jax.random.key(1), _log([[0.5, 0.5, 0.0]]), 3))
  assert np.isfinite(values[0, :2]).all() and values[0, 2] == -np.inf
  # And the test can fail: top-2 of the *unperturbed* ranks twice over is not that law.
  wrong = [tuple(r) for r in np.argsort(-(np.log(probs + 1e-30) + np.random.default_rng(0)
                                          .gumbel(size=(40_000, 5)) * 0.5))[:, :2].tolist()]
  assert testing.chi_square_pvalue(wrong, _plackett_luce(probs, 2)) < 1e-6


def test_gumbel_top_k_law_is_shift_invariant():
  """Scores are log-probabilities up to a constant: adding a constant must not change the law.
  Scores on a 0.5 grid stay exact at 4e6 (float32's spacing there is 0.5), but Gumbel noise added
  at that magnitude is rounded to the grid, which biases the draw; normalising first keeps it
  exact (this test fails without the normalisation)."""
  logp = np.array([0.0, -0.5, -1.0, -1.5])
  probs = np.exp(logp) / np.exp(logp).sum()
  law = _plackett_luce(probs, 2)
  for shift in (0.0, 4e6):
    scores = np.asarray(logp + shift, np.float32)[None].repeat(40_000, 0)
    idx, values = _gumbel_top_k(jax.random.key(5), scores, 2)
    assert testing.chi_square_pvalue([tuple(r) for r in np.asarray(idx).tolist()], law) > 1e-3
    assert np.all(np.asarray(values) < 50)  # perturbed *normalised* scores
  # The same draw without normalising loses the law.
  g = np.asarray(jax.random.gumbel(jax.random.key(5), (40_000, 4), jnp.float32))
  raw = np.argsort(-(np.float32(logp + 4e6) + g), axis=1, kind="stable")[:, :2]
  assert testing.chi_square_pvalue([tuple(r) for r in raw.tolist()], law) < 1e-6


def test_chain_shape():
  spec = trees.chain(4)
  assert spec.is_chain and spec.level_widths == (1, 1, 1, 1) and spec.num_nodes == 5
  assert spec.max_candidates == 1 and spec.rule == "speculative" and spec.scheme == "chain"
  with pytest.raises(ValueError, match="decode.gamma"):
    trees.chain(0)


Q_ROOT = np.array([0.5, 0.3, 0.2], np.float32)
Q_NEXT = np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1]], np.float32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _sbs_levels(key, n, width, truncate):
  """(first, second, values) of stochastic beam search of width `width` and depth 2 over the
  two-step law Q_ROOT, Q_NEXT: level 1's token on each level-2 node's path, level 2's tokens and
  perturbed values, all [n, width]."""
  q_root, q_next = jnp.asarray(Q_ROOT), jnp.asarray(Q_NEXT)
  spec = standard.tree("rsd_s", depth=2, width=width)
  s = Sampling(1.0)
  root = trees.root_level(jnp.zeros((n,), jnp.int32))
  key1, key2 = jax.random.split(key)
  l1 = trees.expand(spec, 1, key1, jnp.log(q_root)[None, None].repeat(n, 0),
                    q_root[None, None].repeat(n, 0), root, 0, s)
  q1 = q_next[l1.tokens]                                                 # [n, W, V]
  if not truncate:  # the bug docs/design.md §6 warns about: children's Gumbels not conditioned
    l1 = l1.replace(value=jnp.where(l1.valid, 0.0, -jnp.inf))
  l2 = trees.expand(spec, 2, key2, jnp.log(q1), q1, l1, 1, s)
  first = jnp.take_along_axis(l1.tokens, l2.parent - 1, axis=1)
  return first, l2.tokens, l2.value


def _two_level_sbs(n, width, truncate=True, seed=0):
  """Stochastic beam search of width `width` and depth 2 over a hand-made two-step law."""
  first, second, values = jax.device_get(_sbs_levels(jax.random.key(seed), n, width, truncate))
  return first, second, values, Q_ROOT, Q_NEXT


def test_stochastic_beam_search_samples_sequences_without_replacement():
  """Kool et al. 2019, Thm 1: at the last level, SBS of width W returns a Gumbel-top-W sample of
  whole sequences from the joint law q(x1) q(x2 | x1), in decreasing perturbed order."""
  n = 30_000
  first, second, values, q_root, q_next = _two_level_sbs(n, 2)
  assert np.all(np.diff(values, axis=1) <= 0)
  joint = np.asarray(q_root)[:, None] * np.asarray(q_next)               # [x1, x2]
  seqs = [(a, b) for a in range(3) for b in range(3)]
  law = _plackett_luce(joint.reshape(-1), 2)
  samples = [(3 * f[0] + s[0], 3 * f[1] + s[1]) for f, s in zip(first.tolist(), second.tolist())]
  assert len(seqs) == 9 and testing.chi_square_pvalue(samples, law) > 1e-3
  # Without the truncation the law is wrong, and the test sees it.
  first, second, *_ = _two_level_sbs(n, 2, truncate=False)
  samples = [(3 * f[0] + s[0], 3 * f[1] + s[1]) for f, s in zip(first.tolist(), second.tolist())]
  assert testing.chi_square_pvalue(samples, law) < 1e-6


def test_truncated_gumbel_max_equals_the_bound():
  logp = _log([[0.2, 0.5, 0.3, 0.0]] * 4)
  bound = np.asarray([0.0, -3.0, 5.0, -np.inf], np.float32)
  g = np.asarray(jax.jit(trees.truncated_gumbel)(jax.random.key(0), logp, bound))
  np.testing.assert_allclose(np.max(g[:3], axis=-1), bound[:3], atol=1e-6)
  assert np.all(np.isneginf(g[:, 3])) and np.all(np.isneginf(g[3]))
  assert np.all(np.isfinite(g[:3, :3]))


def test_hand_drawn_tree_mask_and_positions():
  """RSD-C with b = (2, 2): root 0; children 1, 2; grandchildren 3, 4 (of 1) and 5, 6 (of 2)."""
  spec = standard.tree("rsd_c", depth=2, branching=(2, 2))
  assert spec.level_widths == (2, 4) and spec.num_nodes == 7 and spec.level_offsets == (0, 1, 3)
  assert spec.depths() == (0, 1, 1, 2, 2, 2, 2)
  tree = trees.Tree(tokens=np.zeros((1, 7), np.int32),
                    parent=np.asarray([[-1, 0, 0, 1, 1, 2, 2]], np.int32),
                    depth=np.asarray([spec.depths()], np.int32), valid=np.ones((1, 7), bool))
  ancestor_matrix = jax.jit(trees.ancestor_matrix, static_argnums=1)
  anc = np.asarray(ancestor_matrix(tree.parent, 2)[0]).astype(int)
  want = np.array([[1, 0, 0, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0, 0, 0],
                   [1, 0, 1, 0, 0, 0, 0],
                   [1, 1, 0, 1, 0, 0, 0],
                   [1, 1, 0, 0, 1, 0, 0],
                   [1, 0, 1, 0, 0, 1, 0],
                   [1, 0, 1, 0, 0, 0, 1]])
  np.testing.assert_array_equal(anc, want)
  # Prefix of 5 committed tokens: the root (the 5th) sits at slot base = 4, node j at 4 + j.
  base = np.asarray([4], np.int32)
  tree_mask = jax.jit(trees.tree_mask, static_argnums=2)
  mask = np.asarray(tree_mask(anc.astype(bool)[None], base, 14)[0]).astype(int)
  prefix = np.ones((7, 4), int)
  np.testing.assert_array_equal(mask, np.concatenate([prefix, want, np.zeros((7, 3), int)], 1))
  positions = base[:, None] + tree.depth
  np.testing.assert_array_equal(positions, [[4, 5, 5, 6, 6, 6, 6]])
  # Incremental rows (what the drafter builds level by level) agree with the full matrix.
  ancestor_rows = jax.jit(trees.ancestor_rows, static_argnums=3)
  rows0 = np.eye(7, dtype=bool)[np.zeros((1, 1), np.int32)]
  rows1 = ancestor_rows(rows0, np.zeros((1, 2), np.int32), np.asarray([[1, 2]], np.int32), 7)
  rows2 = ancestor_rows(rows1, np.asarray([[0, 0, 1, 1]], np.int32),
                        np.asarray([[3, 4, 5, 6]], np.int32), 7)
  np.testing.assert_array_equal(np.concatenate([rows0, rows1, rows2], 1)[0], want.astype(bool))


@pytest.mark.parametrize("method,kw,widths,cands", [
    ("rsd_c", dict(branching=(3, 2)), (3, 6, 6), 3),
    ("rsd_s", dict(width=4), (4, 4, 4), 4),
    ("specinfer", dict(width=2), (2, 2, 2), 2),
    ("spectr", dict(width=3), (3, 3, 3), 3)])
def test_tree_shapes(method, kw, widths, cands):
  spec = standard.tree(method, depth=3, **kw)
  assert spec.level_widths == widths
  assert spec.num_nodes == 1 + sum(widths)
  assert spec.max_candidates == cands


@pytest.mark.parametrize("spec", [
    trees.TreeSpec("branching", 3, branching=(3, 2)), trees.TreeSpec("beam", 3, width=2),
    trees.TreeSpec("dynamic", 4, width=3, kept=8), trees.TreeSpec("dynamic", 1, width=2, kept=2)],
    ids=lambda spec: spec.describe())
def test_call_widths_are_the_tokens_growth_feeds_each_call(spec):
  """The cost model's drafter calls per round (`TreeSpec.call_widths`): the root's one token,
  then the tokens of every call `growth.grow` makes, read from a drafter that records them."""
  from spec_jax.decoding.drafters import growth  # noqa: PLC0415
  b, v, fed = 2, 7, []

  def feed(d, tokens, parent, anc, own, carry):
    fed.append(tokens.shape[1])
    logits = jax.random.normal(jax.random.key(d), (b, tokens.shape[1], v))
    return logits, carry

  jax.eval_shape(lambda: growth.grow(  # traced only: the shapes are what is counted
      spec, feed, None, jnp.zeros((b,), jnp.int32),
      jax.random.normal(jax.random.key(0), (b, v)), jax.random.key(1), Sampling(1.0)))
  assert spec.call_widths == (1, *fed)
  assert trees.chain(4).call_widths == (1, 1, 1, 1)  # a chain: γ one-token calls


def test_a_trees_round_drafts_for_its_call_widths():
  """The in-run theory's drafting cost (`bench.call_costs`): a chain's d calls at c each, a
  tree's at c·s(w) for the tokens w each feeds; a tree without its s(w) is refused, not counted
  at c a call; a method with no drafter model drafts for nothing."""
  from spec_jax.decoding import methods  # noqa: PLC0415
  from spec_jax.evaluation import bench, metrics  # noqa: PLC0415
  chain = methods.Cost(calls=4, model="drafter")
  assert bench.call_costs(chain, 0.1, None) == [0.1] * 4
  spec = trees.TreeSpec("dynamic", 4, width=8, kept=32)
  tree = methods.Cost(calls=4, model="drafter", widths=spec.call_widths)
  got = bench.call_costs(tree, 0.1, {1: 1.0, 8: 2.5})
  assert got == pytest.approx([0.1, 0.25, 0.25, 0.25])
  assert metrics.round_speedup(1.76, r_m=3.0, drafting=sum(got)) == pytest.approx(1.76 / 3.85)
  with pytest.raises(ValueError, match=r"no s\(w\) for the tree's call widths \[8\]"):
    bench.call_costs(tree, 0.1, {1: 1.0})
  assert bench.call_costs(methods.Cost(calls=1), 0.0, None) == [0.0]
  assert bench.call_cost_ratios(methods.Cost(calls=1), None, (8,)) == {1: 1.0}  # no model
  assert bench.call_cost_ratios(chain, None, ()) == {1: 1.0}  # one-token calls: nothing timed


def test_expand_levels():
  """Level construction: RSD-C children are distinct tokens in decreasing Gumbel order; greedy
  RSD-C is top-k; chains draw per chain; zero-probability tokens never appear."""
  b, v = 64, 5
  q = np.array([0.5, 0.25, 0.25, 0.0, 0.0], np.float32)
  logits, qs = _log(q)[None, None].repeat(b, 0), q[None, None].repeat(b, 0)
  root = _root_level(np.zeros((b,), np.int32))
  spec = standard.tree("rsd_c", depth=1, branching=(4,))
  lvl = jax.device_get(_expand(spec, 1, jax.random.key(0), logits, qs, root, 0, Sampling(1.0)))
  toks, valid = lvl.tokens, lvl.valid
  assert valid[:, :3].all() and not valid[:, 3].any()           # only 3 tokens have mass
  assert all(len(set(r[:3])) == 3 for r in toks.tolist())
  np.testing.assert_array_equal(lvl.parent, 0)
  greedy = jax.device_get(_expand(spec, 1, jax.random.key(0), logits, qs, root, 0,
                                  Sampling(0.0)))
  np.testing.assert_array_equal(greedy.tokens[:, 0], 0)
  chains = standard.tree("specinfer", depth=2, width=3)
  lvl = jax.device_get(_expand(chains, 1, jax.random.key(1), logits, qs, root, 0, Sampling(1.0)))
  assert np.isin(lvl.tokens, [0, 1, 2]).all()
  to_3 = np.zeros((b, 3, v), np.float32)
  to_3[:, :, 3] = 1.0
  lvl2 = jax.device_get(_expand(chains, 2, jax.random.key(2), 9.0 * to_3, to_3, lvl, 1,
                                Sampling(1.0)))
  np.testing.assert_array_equal(lvl2.parent, np.broadcast_to([1, 2, 3], (b, 3)))
  np.testing.assert_array_equal(lvl2.tokens, 3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="rsd_c", depth=2, branching=()), "branching is empty"),
    (dict(method="rsd_c", depth=2, branching=(2, 0)), "integers >= 1"),
    (dict(method="rsd_c", depth=1, branching=(2, 2)), "at most one entry per depth"),
    (dict(method="rsd_s", depth=2, width=0), "beam width W"),
    (dict(method="spectr", depth=2, width=0), "number of drafts K"),
    (dict(method="rsd_s", depth=0, width=2), "decode.gamma .*depth L"),
    (dict(method="medusa", depth=2), "unknown")])
def test_bad_tree_shapes(kwargs, match):
  with pytest.raises(ValueError, match=match):
    standard.tree(**kwargs)


@pytest.mark.parametrize("shift", [0.0, 1e6])
def test_perturbed_top_k_is_exact_under_a_far_bound_and_large_shifts(shift):
  """Children conditioned on a maximum 40 below their own scores (deep stochastic beam search
  and dynamic trees reach such gaps) keep the ordered law of a sample without replacement
  (conditioning on the maximum leaves the order's Plackett–Luce law unchanged), also with scores
  and bound shifted by 1e6. In float32 every value rounds to the bound there, so ranking the
  returned values alone falls back to index order, and the same check fails on that."""
  probs = np.array([0.3, 0.25, 0.2, 0.1, 0.1, 0.05])  # two blocks of 4 (sampling.to_blocks)
  n = 20_000
  logp = np.asarray(np.log(probs) + shift, np.float32)[None, None].repeat(n, 0)    # [n, 1, V]
  bound = np.full((n, 1), shift - 40.0, np.float32)
  draw = jax.jit(trees.perturbed_top_k, static_argnums=2)
  group, item, values = draw(jax.random.key(3), logp, 2, bound)
  assert np.all(np.asarray(group) == 0) and np.all(np.asarray(values) <= shift - 40.0 + 1e-3)
  law = _plackett_luce(probs, 2)
  assert testing.chi_square_pvalue([tuple(r) for r in np.asarray(item).tolist()], law) > 1e-3
  # Ranked by the returned values alone, ties at the bound broken by item index.
  assert np.all(np.asarray(values) == np.asarray(values)[:, :1])
  by_index = np.sort(np.asarray(item), axis=1)
  assert testing.chi_square_pvalue([tuple(r) for r in by_index.tolist()], law) < 1e-6
