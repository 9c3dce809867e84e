"""BPD draft refinement (decoding/drafters/lattice.py, bpd.LatticeRescoring, bpd_neural.py)
and Stern et al.'s top-k relaxed acceptance: the p best lattice paths against brute-force
enumeration, their prefix tree, greedy output equal to verifier greedy with global n-gram
rescoring and with local neural rescoring, neural rescoring lossless when sampling (chi-square,
with a planted bug that must fail), weight 0 = plain BPD, the relaxed rule on hand-written laws
and end to end, bad input."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.acceptance import tree as tree_acceptance
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import bpd, bpd_neural, lattice, standard, trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import bpd_heads, ngram

V = 8
PROMPTS = [[1, 2, 3, 4, 5], [4], [5, 0], [3, 3, 3]]


_log_prob = jax.jit(ngram.log_prob)
# The lattice functions under test, each compiled once, as the drafter runs them inside its jitted
# round (eagerly, each dispatches dozens of small ops that compile one by one). Weights, widths
# and counts are static, as they are there.
_top_k_lattice = jax.jit(lattice.top_k_lattice, static_argnames="top_k")
_search = jax.jit(lattice.search, static_argnames=("weight", "beam"))
_best_paths = jax.jit(lattice.best_paths, static_argnames="num")
_prefix_tree = jax.jit(lattice.prefix_tree)
_beam_tree = jax.jit(lattice.beam_tree, static_argnames=("weight", "width"))


_WIDTH = 4  # path positions each brute-force query holds (the tests' paths have at most 3)


def _path_scores(logp, lm, hist, w, paths):
  """Brute force, one row: Σ_i (1 − w)·log q_i(x_i) + w·log p_ngram(x_i | hist, x_<i) for every
  path (a list of equal-length token tuples), each context written out in full."""
  a, o = len(paths[0]), len(hist)
  assert a <= _WIDTH, a
  # Rows padded to a power of two (at least 64) and positions to _WIDTH, so that one compiled
  # query serves the paths and prefixes of every length; each (row, position) query is
  # independent of the others, and the padded ones are never read.
  rows = max(64, 1 << (len(paths) - 1).bit_length())
  ctx = np.full((rows, _WIDTH, o + _WIDTH), -1, np.int32)
  toks = np.zeros((rows, _WIDTH), np.int32)
  for j, x in enumerate(paths):
    toks[j, :a] = x
    for i in range(a):
      full = list(hist) + list(x[:i])
      ctx[j, i, o + _WIDTH - len(full):] = full
  lm_logp = np.asarray(_log_prob(lm, ctx, toks))
  return [float(sum((1 - w) * logp[i, x[i]] + w * lm_logp[j, i] for i in range(a)))
          for j, x in enumerate(paths)]


def _lattice(seed, hist, b=2, a=3, k=3, v=7):
  """(head logits [b, a, v], an order-3 n-gram LM, hist, lattice tokens, lattice log-probs) of
  random heads: the brute-force tests' lattice."""
  rng = np.random.default_rng(seed)
  # device_put, not jnp.asarray: the latter compiles a copy program per new shape.
  logits = jax.device_put((rng.normal(size=(b, a, v)) * 2).astype(np.float32))
  lm = ngram.build(rng.integers(0, v, 400), order=3, vocab_size=v)
  return (logits, lm, jax.device_put(np.asarray(hist, np.int32)), *_top_k_lattice(logits, k))


def test_best_paths_match_brute_force_and_form_a_prefix_tree():
  """The lattice search under heads + n-gram scores (an order-3 LM: each position's term
  depends on the earlier path tokens) with no prefix dropped: the kept paths are exactly the p
  best of the k^h by brute force, best first, and the prefix tree holds each of them as a
  root-to-leaf path with every shared prefix once."""
  b, a, k, p, w = 2, 3, 3, 5, 0.6
  logits, lm, hist, lat_tokens, lat_logp = _lattice(0, [[-1, 4], [2, 6]])
  cand, score = _search(lat_tokens, lat_logp, hist, lm, w)
  assert cand.shape == (b, k ** a, a)
  kept, top = _best_paths(score, cand, p)
  logp = np.asarray(jax.nn.log_softmax(logits, -1))
  hist_rows, kept_rows, top_rows = np.asarray(hist), np.asarray(kept), np.asarray(top)
  for row in range(b):
    heads_top = [np.argsort(-logp[row, i])[:k] for i in range(a)]
    every = [tuple(map(int, x)) for x in itertools.product(*heads_top)]
    scores = _path_scores(logp[row], lm, hist_rows[row], w, every)
    brute = sorted(zip(scores, every), key=lambda t: -t[0])[:p]
    assert [tuple(map(int, x)) for x in kept_rows[row]] == [x for _, x in brute]
    np.testing.assert_allclose(top_rows[row], [s for s, _ in brute], rtol=1e-5)
  root = np.asarray([11, 12], np.int32)
  tree = _prefix_tree(root, kept)
  tree_acceptance.check_tree(tree.tokens, tree.parent, tree.depth, tree.valid, max_depth=a,
                             max_candidates=min(p, k))
  toks, par, val = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.valid))
  for row in range(b):
    paths = {tuple(int(t) for t in x) for x in kept_rows[row]}
    leaves = set()
    for node in np.flatnonzero(val[row]):
      path, n = [], node
      while n > 0:
        path.append(int(toks[row, n]))
        n = par[row, n]
      if len(path) == a:
        leaves.add(tuple(reversed(path)))
    assert leaves == paths
    prefixes = {x[:d] for x in paths for d in range(1, a + 1)}
    assert val[row, 1:].sum() == len(prefixes)


def test_search_beyond_max_paths_is_a_beam_over_prefix_scores():
  """With fewer prefixes kept per level than the lattice has (what k^h > MAX_PATHS forces), the
  search keeps the `beam` best prefixes of each level by their exact prefix scores: checked
  against a brute-force beam on a 3^3 lattice; and with the heads alone (w = 0, a score that
  sums independent per-position terms) its p ≤ beam best paths are still the exact p best."""
  b, a, k, beam, w = 2, 3, 3, 2, 0.7
  logits, lm, hist, lat_tokens, lat_logp = _lattice(3, [[5, 1], [-1, -1]])
  cand, score = _search(lat_tokens, lat_logp, hist, lm, w, beam=beam)
  assert cand.shape == (b, beam * k, a)
  logp = np.asarray(jax.nn.log_softmax(logits, -1))
  hist_rows, cand_rows, score_rows = np.asarray(hist), np.asarray(cand), np.asarray(score)
  for row in range(b):
    heads_top = [np.argsort(-logp[row, i])[:k] for i in range(a)]
    prefixes = [()]
    for i in range(a):
      grown = [x + (int(t),) for x in prefixes for t in heads_top[i]]
      scores = _path_scores(logp[row], lm, hist_rows[row], w, grown)
      ranked = [x for _, x in sorted(zip(scores, grown), key=lambda t: -t[0])]
      prefixes = ranked[:beam] if i < a - 1 else ranked
    got = [tuple(map(int, x)) for x in cand_rows[row]]
    assert sorted(got) == sorted(prefixes)
    np.testing.assert_allclose(
        score_rows[row], _path_scores(logp[row], lm, hist_rows[row], w, got), rtol=1e-5)
  cand, score = _search(lat_tokens, lat_logp, None, None, 0.0, beam=beam)
  kept = np.asarray(_best_paths(score, cand, beam)[0])
  for row in range(b):
    heads_top = [np.argsort(-logp[row, i])[:k] for i in range(a)]
    every = [tuple(map(int, x)) for x in itertools.product(*heads_top)]
    best = sorted(every, key=lambda x: -sum(logp[row, i, t] for i, t in enumerate(x)))[:beam]
    assert [tuple(map(int, x)) for x in kept[row]] == best


def test_beam_tree_keeps_every_levels_beam():
  """lattice.beam_tree against a brute-force beam on a 3^3 lattice with an order-3 n-gram: level d
  holds exactly the W best extensions of level d − 1 (W = 4 > k = 3: level 1 is the 3 lattice
  tokens and one padding node), with their exact prefix scores' order, each node under its own
  prefix; a valid tree for the greedy walk."""
  b, a, k, width, w = 2, 3, 3, 4, 0.6
  logits, lm, hist, lat_tokens, lat_logp = _lattice(4, [[-1, 4], [2, 6]])
  root = np.asarray([11, 12], np.int32)
  tree = _beam_tree(root, lat_tokens, lat_logp, hist, lm, w, width)
  assert tree.tokens.shape == (b, 1 + width * a)
  tree_acceptance.check_tree(tree.tokens, tree.parent, tree.depth, tree.valid, max_depth=a,
                             max_candidates=min(width, k))
  toks, par, val, dep = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.valid,
                                                 tree.depth))
  logp = np.asarray(jax.nn.log_softmax(logits, -1))
  hist_rows = np.asarray(hist)
  for row in range(b):
    heads_top = [np.argsort(-logp[row, i])[:k] for i in range(a)]
    prefixes, levels = [()], []
    for i in range(a):
      grown = [x + (int(t),) for x in prefixes for t in heads_top[i]]
      scores = _path_scores(logp[row], lm, hist_rows[row], w, grown)
      prefixes = [x for _, x in sorted(zip(scores, grown), key=lambda t: -t[0])][:width]
      levels.append(prefixes)
    got = [[] for _ in range(a)]
    for node in np.flatnonzero(val[row]):
      if node == 0:
        continue
      path, n = [], node
      while n > 0:
        path.append(int(toks[row, n]))
        n = par[row, n]
      got[dep[row, node] - 1].append(tuple(reversed(path)))
    assert got == levels   # best first within each level
  assert val[:, 1:1 + width].sum(axis=1).tolist() == [k, k]   # level 1: k real nodes, 1 pad
  # Width 1 at w = 0 is the heads' own argmax chain (plain greedy BPD's draft).
  chain = _beam_tree(root, lat_tokens, lat_logp, None, None, 0.0, 1)
  np.testing.assert_array_equal(np.asarray(chain.tokens)[:, 1:], np.argmax(logp, -1))


def _setup(num_heads=3, seed=1):
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=V, sharpness=3.0)
  cfg = bpd_heads.BPDConfig.for_verifier(v_cfg, num_heads=num_heads, hidden=16)
  params = bpd_heads.init_params(cfg, jax.random.key(seed), v_cfg, v_params)
  k1, k2 = jax.random.split(jax.random.key(seed + 100))
  params["w1"] = jax.random.normal(k1, params["w1"].shape) / np.sqrt(cfg.d_model)
  params["w2"] = jax.random.normal(k2, params["w2"].shape) / np.sqrt(cfg.width)
  return v_cfg, v_params, cfg, params


def _ngram(order=3):
  """An n-gram LM of a random corpus: it reorders the lattice paths, which is all greedy
  exactness has to survive."""
  return ngram.build(np.random.default_rng(5).integers(0, V, 600), order=order, vocab_size=V)


def _decode(v_cfg, v_params, drafter, d_params, prompts, sampling, n, seed=0):
  return loop.speculative_generate(
      v_params, d_params, prompts, jax.random.key(seed),
      verifier=verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers), drafter=drafter,
      sampling=sampling, max_new_tokens=n)


def _greedy_baselines(v_cfg, v_params, cfg, heads):
  """(prompts, the verifier's greedy output, plain greedy BPD's output) for 12 new tokens."""
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=12)
  plain_drafter = bpd.BPDDrafter(cfg, v_cfg)
  plain = _decode(v_cfg, v_params, plain_drafter, plain_drafter.params(heads, v_params), prompts,
                  Sampling(), 12)
  return prompts, ar, plain


def test_ngram_rescored_lattice_is_greedy_exact_and_weight_0_is_plain_bpd():
  v_cfg, v_params, cfg, heads = _setup()
  lm = _ngram()
  prompts, ar, plain = _greedy_baselines(v_cfg, v_params, cfg, heads)
  stats = {}
  for rescore in (bpd.LatticeRescoring(top_k=3, paths=6, weight=0.5),
                  bpd.LatticeRescoring(top_k=3, paths=6, weight=0.0),
                  bpd.LatticeRescoring(top_k=2, paths=1, weight=0.0),
                  bpd.LatticeRescoring(top_k=3, paths=5, weight=0.5, beam=True),
                  bpd.LatticeRescoring(top_k=2, paths=1, weight=0.0, beam=True)):
    drafter = bpd.BPDDrafter(cfg, v_cfg, rescore=rescore)
    out = _decode(v_cfg, v_params, drafter, drafter.params(heads, v_params, lm), prompts,
                  Sampling(), 12)
    assert out.new_tokens() == ar.new_tokens()
    stats[rescore.paths, rescore.weight, rescore.beam] = np.asarray(
        [out.stats.accepted, out.stats.verifier_calls, out.stats.candidates])
  # Weight 0, one path (or a beam of width 1): the heads' own argmax chain, call for call.
  for beam in (False, True):
    np.testing.assert_array_equal(stats[1, 0.0, beam][:2], np.asarray(
        [plain.stats.accepted, plain.stats.verifier_calls]))
  # The n-gram reorders the kept paths (a rescoring that ignored it would match weight 0).
  assert not np.array_equal(stats[6, 0.5, False], stats[6, 0.0, False])


def test_pruned_lattice_search_stays_greedy_exact(monkeypatch, fresh_programs):
  """A lattice larger than MAX_PATHS (here lowered to 6: two prefixes of 3^3 kept per level) is
  searched with a beam; the output is still the verifier's greedy one. The decoding loop is
  traced anew (`fresh_programs`: MAX_PATHS is no jit cache key), and the level-by-level search
  must have been traced, else the full search ran and nothing was pruned."""
  monkeypatch.setattr(lattice, "MAX_PATHS", 6)
  levels, extend = [], lattice._extend
  monkeypatch.setattr(lattice, "_extend", lambda *a: levels.append(a[0].shape) or extend(*a))
  v_cfg, v_params, cfg, heads = _setup()
  prompts, ar, _ = _greedy_baselines(v_cfg, v_params, cfg, heads)
  drafter = bpd.BPDDrafter(cfg, v_cfg, rescore=bpd.LatticeRescoring(top_k=3, paths=4, weight=0.4))
  out = _decode(v_cfg, v_params, drafter, drafter.params(heads, v_params, _ngram()), prompts,
                Sampling(), 12)
  assert out.new_tokens() == ar.new_tokens()
  # The beam branch was traced: it keeps MAX_PATHS / K = 2 prefixes per level.
  assert levels and max(shape[1] for shape in levels) == 2, levels
  with pytest.raises(ValueError, match=r"bpd.paths=7 exceeds the 6 paths"):
    bpd.BPDDrafter(cfg, v_cfg, rescore=bpd.LatticeRescoring(top_k=3, paths=7))


def test_rescoring_bad_input_names_the_field():
  v_cfg, v_params, cfg, heads = _setup()
  with pytest.raises(ValueError, match=r"bpd.paths=28 exceeds .* 3\^3 = 27"):
    bpd.BPDDrafter(cfg, v_cfg, rescore=bpd.LatticeRescoring(top_k=3, paths=28))
  with pytest.raises(ValueError, match=r"bpd.paths=70000 \(the beam width\) times "):
    bpd.BPDDrafter(cfg, v_cfg, rescore=bpd.LatticeRescoring(top_k=3, paths=70_000, beam=True))
  with pytest.raises(ValueError, match=r"bpd.top_k=0 must be an integer >= 1"):
    bpd.BPDDrafter(cfg, v_cfg, rescore=bpd.LatticeRescoring(top_k=0))
  with pytest.raises(ValueError, match=r"ngram_weight=1.5 must be in \[0, 1\]"):
    bpd.BPDDrafter(cfg, v_cfg, rescore=bpd.LatticeRescoring(weight=1.5))
  lm8 = _ngram(order=2)
  drafter = bpd.BPDDrafter(cfg, v_cfg, rescore=bpd.LatticeRescoring(top_k=2, paths=2))
  other = ngram.build([np.arange(20) % 5], order=2, vocab_size=5)
  with pytest.raises(ValueError, match="eval.bpd.ngram"):
    drafter.params(heads, v_params, other)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  with pytest.raises(ValueError, match="temperature 0 only"):
    _decode(v_cfg, v_params, drafter, drafter.params(heads, v_params, lm8), prompts,
            Sampling(1.0), 4)


@dataclasses.dataclass(frozen=True)
class _HeadLawRescored(bpd_neural.NeuralRescoredBPD):
  """Planted bug: drafts from the rescored law but reports the plain heads' law as q."""

  def propose(self, params, state, tokens, lengths, rng, sampling):
    proposal, state = super().propose(params, state, tokens, lengths, rng, sampling)
    heads = self._bpd().logits(params, state[0])
    q = jnp.concatenate([sampling_lib.probs_from_logits(heads, sampling),
                         jnp.zeros_like(proposal.q[:, :1])], axis=1)
    return dataclasses.replace(proposal, q=q), state


def _rescorer(v_cfg):
  return testing.tiny_model(seed=7, vocab_size=V, sharpness=3.0)


def test_neural_rescoring_greedy_exact_and_weight_0_is_plain_bpd():
  v_cfg, v_params, cfg, heads = _setup()
  lm_cfg, lm_params = _rescorer(v_cfg)
  prompts, ar, plain = _greedy_baselines(v_cfg, v_params, cfg, heads)
  for weight in (0.6, 0.0):
    drafter = bpd_neural.NeuralRescoredBPD(cfg, v_cfg, lm_cfg, top_k=3, weight=weight)
    out = _decode(v_cfg, v_params, drafter, drafter.params(heads, v_params, lm_params), prompts,
                  Sampling(), 12)
    assert out.new_tokens() == ar.new_tokens()
    same = [np.array_equal(getattr(out.stats, f), getattr(plain.stats, f))
            for f in ("accepted", "verifier_calls", "candidates")]
    # a = 0 drafts the heads' argmax chain call for call; a = 0.6 changes the drafts (else this
    # test could not tell the two apart).
    assert all(same) if weight == 0 else not all(same)


@pytest.mark.parametrize("buggy", [False, True])
def test_sampled_neural_rescoring_is_lossless(buggy):
  """T = 1: 3000 continuations of 2 tokens against the verifier's enumerated law; a drafter that
  reports the heads' law instead of the rescored one it drew from must fail."""
  v_cfg, v_params, cfg, heads = _setup(num_heads=2)
  lm_cfg, lm_params = _rescorer(v_cfg)
  kind = _HeadLawRescored if buggy else bpd_neural.NeuralRescoredBPD
  drafter = kind(cfg, v_cfg, lm_cfg, top_k=3, weight=0.7)
  law = testing.exact_sequence_law(v_cfg, v_params, [1, 4, 2], 2, Sampling(1.0))
  many = generate_lib.pad_prompts([[1, 4, 2]] * 3000, 3, pad_id=0)
  out = _decode(v_cfg, v_params, drafter, drafter.params(heads, v_params, lm_params), many,
                Sampling(1.0), 2, seed=1)
  p = testing.chi_square_pvalue([tuple(r) for r in out.new_tokens()], law)
  assert np.sum(out.stats.accepted) > 300
  assert (p < 1e-4) if buggy else (p > 1e-3)


def test_neural_rescorer_bad_input():
  v_cfg, _, cfg, _ = _setup()
  lm_cfg, _ = testing.tiny_model(seed=7, vocab_size=16)
  with pytest.raises(ValueError, match=r"bpd.rescorer: the rescoring LM has a vocabulary of 16"):
    bpd_neural.NeuralRescoredBPD(cfg, v_cfg, lm_cfg)
  lm_cfg, _ = _rescorer(v_cfg)
  with pytest.raises(ValueError, match=r"rescorer_weight=-0.1 must be in \[0, 1\]"):
    bpd_neural.NeuralRescoredBPD(cfg, v_cfg, lm_cfg, weight=-0.1)
  with pytest.raises(ValueError, match=r"γ=4 needs γ heads; these are 3"):
    bpd_neural.NeuralRescoredBPD(cfg, v_cfg, lm_cfg, gamma=4)
  features = dataclasses.replace(lm_cfg, feature_width=lm_cfg.d_model)
  with pytest.raises(ValueError, match=r"bpd.rescorer: the rescoring LM is a feature drafter.*"
                                       r"rescorer.checkpoint=runs/quickstart_scratch/drafter"):
    bpd_neural.NeuralRescoredBPD(cfg, v_cfg, features)


def test_top_k_relaxed_rule_on_hand_written_laws():
  """Stern et al.'s relaxed acceptance: a draft in the verifier's top k is kept (k = 1 is
  greedy); the first draft outside it ends the block with the verifier's argmax there."""
  from spec_jax.decoding.acceptance import chain
  p = jnp.asarray([[[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 0.0]]])
  draft = jnp.asarray([[1, 0]])
  for k, n, nxt in ((1, 0, 0), (2, 1, 3), (4, 2, 2)):
    v = chain.top_k_relaxed(p, None, draft, jax.random.key(0), k=k)
    assert (int(v.num_accepted[0]), int(v.next_token[0])) == (n, nxt), k
  g = chain.greedy(p, None, draft, jax.random.key(0))
  assert int(g.num_accepted[0]) == 0 and int(g.next_token[0]) == 0


def test_top_k_relaxed_decoding_is_lossy_with_longer_blocks():
  """End to end with BPD heads: k = 1 reproduces verifier greedy; k = 3 keeps more drafts per
  call and leaves the greedy path (lossy, as the paper reports); T > 0 and trees are refused."""
  v_cfg, v_params, cfg, heads = _setup()
  drafter = bpd.BPDDrafter(cfg, v_cfg)
  d_params = drafter.params(heads, v_params)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=16)

  def run(k, sampling=Sampling(), d=drafter):
    return loop.speculative_generate(
        v_params, d_params, prompts, jax.random.key(0), verifier=verifier, drafter=d,
        decode=loop.DecodeConfig("top_k_relaxed", relaxed_top_k=k), sampling=sampling,
        max_new_tokens=16)

  one, three = run(1), run(3)
  assert one.new_tokens() == ar.new_tokens()
  assert np.sum(three.stats.accepted) / np.sum(three.stats.verifier_calls) > (
      np.sum(one.stats.accepted) / np.sum(one.stats.verifier_calls))
  assert three.new_tokens() != ar.new_tokens()
  with pytest.raises(ValueError, match="relaxes greedy decoding"):
    run(2, Sampling(1.0))
  with pytest.raises(ValueError, match="relaxed_top_k=0 must be an integer >= 1"):
    run(0)
  tree = bpd.BPDDrafter(cfg, v_cfg, tree=standard.tree("rsd_c", 2, (2, 1)))
  with pytest.raises(ValueError, match="verifies chains"):
    run(2, d=tree)


def test_heads_refuse_a_verifier_of_the_same_shape_with_other_weights():
  """The verifier's probe fingerprint (recorded by train_bpd) tells two verifiers of one shape
  apart, and survives a bfloat16 copy of the right one."""
  import dataclasses as dc
  v_cfg, v_params, cfg, heads = _setup()
  cfg = dc.replace(cfg, verifier_probe=bpd_heads.verifier_probe(v_cfg, v_params))
  drafter = bpd.BPDDrafter(cfg, v_cfg)
  drafter.params(heads, v_params)  # the right verifier
  bf16 = dc.replace(v_cfg, dtype="bfloat16")
  bpd_heads.check_verifier(cfg, bf16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), v_params))
  _, other = testing.tiny_model(seed=3, vocab_size=V, sharpness=3.0)
  with pytest.raises(ValueError, match="drafter.checkpoint: these BPD heads were trained on "
                                       "another verifier"):
    drafter.params(heads, other)
