"""The dynamic draft tree `dyn` (EAGLE-2; `drafters/growth.py`, `drafters/dyn.py`): at T = 0 the
grown tree is EAGLE-2's (checked against a by-hand expansion and rerank) and greedy decoding with
it equals the verifier's greedy output token for token, over an LM and a feature drafter; at T > 0
the emitted law is the verifier's (chi-square against exact enumeration, T = 1 and T = 0.8 with
top-k, on Markov tables and on tiny models), and the planted bug (the deterministic top-K tree
verified by the sampling rule) fails the same check; an LM drafter's cache stays right after
dynamic rounds with random acceptance; bad entries are refused naming eval.methods."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop, methods, protocols
from spec_jax.decoding.acceptance import tree as tree_rules
from spec_jax.decoding.drafters import dyn, features, growth, lm, trees
from spec_jax.decoding.sampling import Sampling, probs_from_logits
from spec_jax.models import llama

V = 5


@dataclasses.dataclass(frozen=True)
class MarkovTreeDrafter:
  """An order-1 Markov table as a drafter of any tree shape, grown by `growth.grow` (its `feed`
  reads the table at the level's tokens). Stateless; implements `protocols.Drafter`."""
  vocab_size: int
  shape: trees.TreeSpec
  verifier_layers: tuple[int, ...] = ()

  def init(self, params, prompt_tokens, prompt_lengths, size, v_hidden):
    return jnp.zeros((), jnp.int32)

  def propose(self, params, state, tokens, lengths, rng, sampling):
    table = params["logits"]
    root = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
    feed = lambda d, level, parent, anc, own, carry: (table[level], carry)  # noqa: E731
    proposal, state, _ = growth.grow(self.shape, feed, state, root, table[root], rng, sampling)
    return proposal, state

  def commit(self, params, state, proposal, verdict, lengths, v_hidden):
    return state


def _top_k_without_noise(rng, logp, k, bound=None):
  """The planted bug's sampler: the k best children by their unperturbed path log-probability
  (the T = 0 tree) where stochastic beam search draws them."""
  del rng, bound
  *lead, g, v = logp.shape
  values, index = jax.lax.top_k(logp.reshape(*lead, g * v), k)
  return index // v, index % v, values


class _DeterministicTreeDrafter(MarkovTreeDrafter):
  """The Markov drafter under another name, so that the loop traced with the planted bug is
  compiled for it alone."""


def _paths(proposal, b):
  """Row b's valid nodes as token paths from the root, in node order."""
  tokens, parent, valid = (np.asarray(x)[b] for x in (proposal.tokens, proposal.parent,
                                                        proposal.valid))
  out = {0: ()}
  for j in range(1, len(tokens)):
    if valid[j]:
      out[j] = out[int(parent[j])] + (int(tokens[j]),)
  return [out[j] for j in sorted(out) if j > 0]


def _eagle2_by_hand(logsm: np.ndarray, root: int, k: int, kept: int, depth: int):
  """EAGLE-2 at T = 0 in plain Python: expand the K best frontier nodes by their K best
  children, keep the K best of each level as the next frontier, then the M best of the pool by
  path log-probability, laid out level by level (each level's pool order). Token paths."""
  pool, frontier = [], [((), 0.0)]
  for _ in range(depth):
    level = []
    for path, phi in frontier:
      last = path[-1] if path else root
      for x in np.argsort(-logsm[last], kind="stable")[:k]:
        level.append((path + (int(x),), phi + float(logsm[last, x])))
    pool += level
    frontier = sorted(level, key=lambda node: -node[1])[:k]
  best = sorted(range(len(pool)), key=lambda i: (-pool[i][1], i))[:kept]
  return [pool[i][0] for i in sorted(best)]


def test_grown_tree_is_eagle2_at_t0_and_a_valid_tree_at_t1():
  table = 2.0 * jax.random.normal(jax.random.key(0), (7, 7))
  spec = dyn.shape((3, 7), 3, None, 3)
  drafter = MarkovTreeDrafter(7, spec)
  tokens = jnp.asarray([[2, 0], [5, 0], [6, 0]])
  lengths = jnp.asarray([1, 1, 1])
  propose = jax.jit(drafter.propose, static_argnames="sampling")
  proposal, _ = propose({"logits": table}, None, tokens, lengths, jax.random.key(1),
                        sampling=Sampling())
  logsm = np.asarray(jax.nn.log_softmax(table))
  for b, root in enumerate([2, 5, 6]):
    assert _paths(proposal, b) == _eagle2_by_hand(logsm, root, 3, 7, 3)
  # At T = 1 with top-2 (fewer tokens than K = 3) and M = 14: a tree the rules can walk, every
  # node's q the law its children were drawn from, children distinct and within the law,
  # padding marked.
  sampling = Sampling(1.0, top_k=2)
  drafter = MarkovTreeDrafter(7, dyn.shape((3, 14), 3, None, 3))
  proposal, _ = jax.jit(drafter.propose, static_argnames="sampling")(
      {"logits": table}, None, jnp.repeat(tokens, 30, 0), jnp.repeat(lengths, 30),
      jax.random.key(2), sampling=sampling)
  tree_rules.check_tree(proposal.tokens, proposal.parent, proposal.depth, proposal.valid,
                        max_depth=3, max_candidates=2)
  q, tok, par, valid = (np.asarray(x) for x in (proposal.q, proposal.tokens, proposal.parent,
                                                proposal.valid))
  law = np.asarray(probs_from_logits(table, sampling))
  has_children = np.zeros_like(valid)
  for b in range(tok.shape[0]):
    for j in np.nonzero(valid[b])[0][1:]:
      has_children[b, par[b, j]] = True
      assert q[b, par[b, j], tok[b, j]] > 0
  np.testing.assert_allclose(q[has_children], law[tok[has_children]], atol=1e-6)
  # 2 + 2·2 + 3·2 valid nodes of the 3 + 9 + 9 drafted: 14 kept, 2 of them padding.
  np.testing.assert_array_equal(valid.sum(1), 13)


def _markov_law_check(sampling, n_samples=4000, seed=0, cls=MarkovTreeDrafter):
  """p-value of the first three emitted tokens against the exact law, with dyn:3-4@3 drafting
  from a Markov table."""
  v_params, d_params = testing.markov_tables(V, seed=3, drafter_noise=0.5)
  prompt = [1, 4, 2]
  law = testing.markov_law(v_params, prompt, 3, sampling)
  out = loop.speculative_generate(
      v_params, d_params, generate_lib.pad_prompts([prompt] * n_samples, 3, pad_id=0),
      jax.random.key(seed), verifier=testing.MarkovVerifier(V),
      drafter=cls(V, dyn.shape((3, 4), 3, None, 3)), sampling=sampling,
      max_new_tokens=3)
  reached = float(np.sum(out.stats.reached))
  assert 0.1 < float(np.sum(out.stats.accepted_at)) / reached < 0.95  # not vacuous
  assert np.sum(out.stats.accepted_at[:, 1]) > n_samples / 20           # depth 2 accepts too
  return testing.chi_square_pvalue([tuple(r) for r in out.new_tokens()], law)


SAMPLINGS = [Sampling(1.0), Sampling(0.8, top_k=3)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.8-top3"])
def test_dyn_is_lossless_on_markov_tables(sampling):
  """Three levels, K = 3 expanded per level, M = 4 of the 3 + 9 + 9 kept: the frontier and the
  rerank across levels both cut."""
  assert _markov_law_check(sampling) > 1e-3


def test_the_deterministic_tree_fails_the_law_check(monkeypatch):
  """Planted bug: dyn grows the deterministic top-K tree at T > 0 (its q still the exact law at
  each node), verified by the sampling rule."""
  monkeypatch.setattr(growth, "perturbed_top_k", _top_k_without_noise)
  assert _markov_law_check(Sampling(1.0), cls=_DeterministicTreeDrafter) < 1e-6


# ---------------------------------------------------------------------------------------------
# Tiny transformers: an LM drafter (a perturbed copy of the verifier) and a feature drafter.

PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 8], [6, 1, 2, 9], [3]]


def _models(kind, vocab_size=16, sharpness=2.0, sigma=0.3):
  """(v_cfg, v_params, d_cfg, d_params): a tiny verifier and a drafter, `kind` "lm" (the
  verifier perturbed by N(0, (0.1 sigma)²)) or "feature" (`testing.tiny_feature_pair`)."""
  if kind == "lm":
    v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=vocab_size, sharpness=sharpness)
    return v_cfg, v_params, v_cfg, testing.perturbed(v_params, 0.1 * sigma)
  return testing.tiny_feature_pair(vocab_size, sharpness, sigma)


@pytest.fixture(scope="module")
def greedy_reference():
  """Both drafters share the verifier."""
  return testing.greedy_reference(*_models("lm")[:2])


@pytest.mark.parametrize("kind", ["lm", "feature"])
def test_greedy_dyn_equals_verifier_greedy(kind, greedy_reference):
  """A ragged batch (one prompt of one token) with stop tokens."""
  v_cfg, v_params, d_cfg, d_params = _models(kind)
  drafter = features.for_model(d_cfg, dyn.shape((2, 5), 3, None, 3))
  testing.assert_greedy_equal(v_cfg, v_params, drafter, d_params, greedy_reference)


def test_dyn_over_a_feature_drafter_is_lossless():
  """dyn:3-4@2 over a feature drafter on a tiny verifier, the first two tokens against its exact
  law (the Markov tests above check both samplings and the planted bug with more rows; an LM
  drafter shares everything but its feed, which the greedy and cache tests cover)."""
  v_cfg, v_params, d_cfg, d_params = _models("feature", vocab_size=6, sharpness=3.0, sigma=0.5)
  drafter = features.FeatureDrafter(d_cfg, dyn.shape((3, 4), 2, None, 3))
  assert testing.sd_law_pvalue(v_cfg, v_params, drafter, d_params, [1, 4, 2],
                               sampling=Sampling(1.0)) > 1e-3


def test_dyn_over_an_lm_drafter_is_lossless():
  """dyn:3-4@2 over an LM drafter (its own feed and cache relayout), three tokens under a
  temperature and top-k against the verifier's exact law: the first round's tree and a second
  round after it."""
  v_cfg, v_params, d_cfg, d_params = _models("lm", vocab_size=6, sharpness=3.0, sigma=3.0)
  drafter = lm.LMDrafter(d_cfg, dyn.shape((3, 4), 2, None, 3))
  assert testing.sd_law_pvalue(v_cfg, v_params, drafter, d_params, [1, 4, 2], n=3,
                               sampling=Sampling(0.8, top_k=4)) > 1e-3


def test_lm_drafter_cache_after_dyn_rounds():
  """After dynamic rounds with random acceptance along the drafted tree, the LM drafter's cache
  holds the committed text's K/V: its law of the next draft (catch-up window) equals a fresh
  forward over the committed text. (With the frontier's K/V left in their drafting slots, no
  `growth.relayout`, the commit moves the wrong slots and this fails.)"""
  _, _, d_cfg, d_params = _models("lm")
  spec = dyn.shape((4, 6), 3, None, 3)   # 9 drafting slots for a proposal of 7 nodes
  drafter = lm.LMDrafter(d_cfg, spec)
  padded = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  size = 64
  cache = jax.jit(drafter.init, static_argnums=3)(d_params, padded.tokens, padded.lengths, size,
                                                  {})
  assert cache.size == size + 2 == size + growth.extra_slots(spec)
  tokens = np.zeros((len(PROMPTS), size), np.int32)
  tokens[:, :8] = np.asarray(padded.tokens)
  lengths = np.array(padded.lengths)
  rng = np.random.default_rng(0)
  propose = jax.jit(drafter.propose, static_argnames="sampling")
  commit = jax.jit(drafter.commit)
  depths = set()
  for step in range(5):
    proposal, cache = propose(d_params, cache, tokens, lengths, jax.random.key(step),
                              sampling=Sampling(1.0))
    verdict = testing.random_verdict(proposal, rng)
    cache = commit(d_params, cache, proposal, verdict, lengths, {})
    # New host arrays for the next round: the calls above may still read (on CPU, alias) these.
    tokens, lengths = tokens.copy(), lengths.copy()
    drafted, accepted, path, bonus = (np.asarray(x) for x in (
        proposal.tokens, verdict.num_accepted, verdict.path, verdict.next_token))
    for b in range(len(PROMPTS)):
      n = int(accepted[b])
      depths.add(n)
      tokens[b, lengths[b]:lengths[b] + n + 1] = [*drafted[b, path[b, :n]], int(bonus[b])]
      lengths[b] += n + 1
  assert max(depths) == 3 and len(depths) >= 3  # paths of several depths, the deepest too
  logits, _, _ = jax.jit(drafter._catch_up)(d_params, cache, tokens, lengths)  # noqa: SLF001
  longest = int(lengths.max())
  positions = np.arange(longest, dtype=np.int32)[None].repeat(len(PROMPTS), 0)
  fresh, _, _ = jax.jit(llama.make_apply(d_cfg))(d_params, tokens[:, :longest], positions)
  fresh = np.take_along_axis(np.asarray(fresh), (lengths - 1)[:, None, None], axis=1)[:, 0]
  np.testing.assert_allclose(logits, fresh, atol=1e-4, rtol=1e-4)


def test_bad_entries_are_refused_before_loading():
  entry = methods.parse("dyn:3-5@3", None)
  assert entry.shape.describe() == "dyn K=3 M=5 L=3" and entry.tokens_per_call == 6
  assert entry.shape.max_candidates == 3 and entry.shape.rule == "rrs_without"
  assert methods.parse("dyn:2@3", None).shape.kept == 6
  assert methods.parse("dyn@2", None, default_width=4).shape.width == 4
  for bad, match in [("dyn:2-7@2", r"eval.methods entry dyn:2-7@2 keeps M=7 nodes, but K=2 over "
                                   r"L=2 levels drafts K \+ \(L-1\)\*K\*K = 6"),
                     ("dyn:2-3-4@2", "dyn takes K-M"), ("dyn:0-1@2", "K .* must be >= 1"),
                     ("dyn:2-0@2", "keeps M=0 nodes")]:
    with pytest.raises(ValueError, match=match):
      methods.parse(bad, None)
  # BPD heads cannot draft it; T > 0 is fine (exact), and every check runs before any model.
  with pytest.raises(ValueError, match=r"eval.methods has dyn:3-5, which needs a language or "
                                       r"feature drafter or a steered drafter"):
    methods.check(entry, methods.Source(kind="bpd"), Sampling(1.0))
  methods.check(entry, methods.Source(kind="lm"), Sampling(1.0))
  cfg = llama.model_config("test-tiny", vocab_size=2)
  with pytest.raises(ValueError, match="expands K=3 children per node, more than the drafter's 2"):
    methods.build(entry, methods.Source(kind="lm", d_cfg=cfg))
  # A reduced vocabulary drafts from its head's tokens alone.
  reduced = dataclasses.replace(llama.model_config("test-tiny"), head_ids=(4, 9),
                                tie_embeddings=False)
  with pytest.raises(ValueError, match="more than the drafter's 2 tokens it drafts from"):
    methods.build(entry, methods.Source(kind="lm", d_cfg=reduced))


def test_spells_reads_a_time_series_of_turns_as_spells():
  """experiments/dyn/spells.py's summary: turns whose one-token forward ran over 1.6× the
  median turn's are in a spell; spells are runs of them, one still open at the end closes at the
  last turn; medians per group. A limit taken from the mean (pulled up by the spells) or a spell
  left open at the end would give other answers."""
  from experiments.dyn import spells
  rows = []
  for i in range(100):  # a turn each 0.5 s; spells at 10-14 s and from 47 s on
    t = 0.5 * i
    slow = 10 <= t < 14 or t >= 47
    rows.append(dict(t=t, v1=84.0 if slow else 29.0 + (i % 3), v33=208.0 if slow else 109.0,
                     read=10.0 if slow else 15.0))
  found = spells.summarize(rows, ["v1", "v33", "read"])
  assert found["limit"] == pytest.approx(1.6 * 30.0)
  assert found["in_spell"] == 8 + 6
  assert found["spells"] == [(10.0, 14.0), (47.0, 49.5)]
  assert found["medians"] == {"out of a spell": dict(v1=30.0, v33=109.0, read=15.0),
                              "in a spell": dict(v1=84.0, v33=208.0, read=10.0)}
  calm = spells.summarize([dict(t=0.0, v1=1.0), dict(t=1.0, v1=1.2)], ["v1"])
  assert calm["spells"] == [] and list(calm["medians"]) == ["out of a spell"]
