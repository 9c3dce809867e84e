"""The interpolated Kneser–Ney n-gram LM (models/ngram.py): distributions sum to 1 (seen, unseen
and -1 contexts), agreement with a dict-based reference (with a planted raw-count bug that must
differ), a memorised corpus, jit/vmap/save/load, bad input, and a 50k vocabulary (long segments,
no int32 overflow)."""

import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.models import ngram

V = 7


def _corpus(seed=0, vocab=V - 1, sizes=(40, 1, 2, 25, 60, 3, 33)):
  """Documents over tokens 0..vocab-1 drawn ∝ 1/(k+1), so token V-1 is never seen."""
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, vocab + 1)
  return [rng.choice(vocab, size=s, p=p / p.sum()) for s in sizes]


class Reference:
  """Interpolated KN straight from the definition, with dicts (module docstring of ngram.py).
  raw_lower=True is the planted bug: raw counts at the lower orders."""

  def __init__(self, docs, order, vocab, raw_lower=False):
    self.order, self.vocab = order, vocab
    raw = [collections.Counter() for _ in range(order + 1)]
    left = [collections.defaultdict(set) for _ in range(order + 1)]
    for doc in docs:
      doc = [int(t) for t in doc]
      for ell in range(1, order + 1):
        for i in range(len(doc) - ell + 1):
          g = tuple(doc[i:i + ell])
          raw[ell][g] += 1
          left[ell][g].add(doc[i - 1] if i > 0 else "<s>")
    self.kids = [None] * (order + 1)  # kids[ell][h] = {w: c_l(h w)}
    self.discount = [None] * (order + 1)
    for ell in range(1, order + 1):
      counts = (raw[ell] if ell == order or raw_lower
                else {g: len(s) for g, s in left[ell].items()})
      n1 = sum(c == 1 for c in counts.values())
      n2 = sum(c == 2 for c in counts.values())
      self.discount[ell] = min(max(n1 / (n1 + 2 * n2) if n1 + 2 * n2 else 0.0, 0.1), 0.9)
      self.kids[ell] = collections.defaultdict(dict)
      for g, c in counts.items():
        self.kids[ell][g[:-1]][g[-1]] = c

  def prob(self, context, w):
    context = [int(t) for t in context]
    p = 1.0 / self.vocab  # p_1 interpolates with the uniform law
    for ell in range(1, self.order + 1):
      h = tuple(context[len(context) - (ell - 1):]) if ell > 1 else ()
      kids = self.kids[ell].get(h)
      if -1 in h or not kids:
        continue  # unseen context: back off
      d, total = self.discount[ell], sum(kids.values())
      p = max(kids.get(int(w), 0) - d, 0) / total + d * len(kids) / total * p
    return p


def _probes(docs, order, n, seed):
  """n (context int32[n, order-1], token int32[n]): half the corpus's own windows and next
  tokens, the rest random tokens (unseen V-1 included), some contexts missing on the left."""
  rng = np.random.default_rng(seed)
  m = order - 1
  ctx = rng.integers(0, V, size=(n, m))
  tok = rng.integers(0, V, size=n)
  long_docs = [d for d in docs if len(d) > m]
  for i in range(n // 2):
    d = long_docs[rng.integers(len(long_docs))]
    j = rng.integers(m, len(d))
    ctx[i], tok[i] = d[j - m:j], d[j] if i % 3 else tok[i]
  for i in range(n // 2, n, 4):
    ctx[i, :rng.integers(m + 1)] = -1
  return ctx.astype(np.int32), tok.astype(np.int32)


@pytest.mark.parametrize("order", [1, 2, 4])
def test_probabilities_sum_to_one(order):
  docs = _corpus()
  lm = ngram.build(docs, order=order, vocab_size=V)
  m = order - 1
  ctx, _ = _probes(docs, order, 24, seed=order)
  special = np.array([[-1] * m, [V - 1] * m, [-1] * (m - 1) + [0] if m else [],
                      [V - 1] + [0] * (m - 1) if m else []], np.int32).reshape(4, m)
  ctx = np.concatenate([ctx, special])
  probs = np.exp(jax.jit(ngram.log_prob)(lm, ctx[:, None, :], jnp.arange(V)[None, :]))
  assert probs.shape == (len(ctx), V)
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
  assert (probs > 0).all()  # the never-seen token V-1 still gets mass


@pytest.mark.parametrize("order", [2, 3])
def test_agrees_with_a_dict_reference(order):
  docs = _corpus(seed=1)
  lm = ngram.build(docs, order=order, vocab_size=V)
  ctx, tok = _probes(docs, order, 48, seed=10 + order)
  got = np.exp(np.asarray(jax.jit(ngram.log_prob)(lm, ctx, tok), np.float64))
  ref = Reference(docs, order, V)
  want = np.array([ref.prob(c, t) for c, t in zip(ctx, tok)])
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # The probes can tell continuation counts from raw counts at the lower orders.
  bug = Reference(docs, order, V, raw_lower=True)
  wrong = np.array([bug.prob(c, t) for c, t in zip(ctx, tok)])
  assert np.max(np.abs(wrong - got) / got) > 1e-3


def test_memorised_corpus():
  rng = np.random.default_rng(3)
  period = rng.permutation(50)[:20]
  seq = np.tile(period, 200)
  lm = ngram.build([seq, seq[:57]], order=3, vocab_size=50)
  ctx = np.stack([seq[i:i + 2] for i in range(40)]).astype(np.int32)
  p = np.exp(jax.jit(ngram.log_prob)(lm, ctx, seq[2:42].astype(np.int32)))
  assert (p > 0.9).all(), p.min()


def test_jit_vmap_save_load_and_check(tmp_path):
  docs = _corpus(seed=2)
  lm = ngram.build(docs, order=3, vocab_size=V)
  ctx, tok = _probes(docs, 3, 30, seed=5)
  ctx, tok = ctx.reshape(2, 15, 2), tok.reshape(2, 15)               # [B, P, n-1], [B, P]
  chex.clear_trace_counter()
  jitted = jax.jit(chex.assert_max_traces(ngram.log_prob, n=1))
  got = jitted(lm, ctx, tok)
  assert got.shape == (2, 15) and got.dtype == jnp.float32
  # The same LM with other values (same shapes) reuses the compiled lookup (n=1 above).
  jitted(jax.tree.map(lambda x: x + 0, lm), ctx, tok)
  per_row = jax.jit(jax.vmap(ngram.log_prob, in_axes=(None, 0, 0)))(lm, ctx, tok)
  single = jax.jit(ngram.log_prob)
  one_by_one = np.array([[single(lm, ctx[b, p], tok[b, p]) for p in range(15)]
                         for b in range(2)])
  np.testing.assert_allclose(per_row, got, rtol=1e-6)
  np.testing.assert_allclose(one_by_one, got, rtol=1e-6)
  # A longer context uses its last n-1 tokens; a shorter one is -1 on the left.
  lookup = jax.jit(ngram.log_prob)
  np.testing.assert_array_equal(lookup(lm, np.concatenate([ctx, ctx], -1), tok), got)
  np.testing.assert_array_equal(lookup(lm, ctx[..., 1:], tok),
                                lookup(lm, np.where(np.arange(2) == 0, -1, ctx), tok))
  assert np.isneginf(lookup(lm, ctx[0, 0], jnp.int32(V)))

  path = str(tmp_path / "lm")  # no .npz suffix: saved at exactly this path
  ngram.save(lm, path)
  again = ngram.load(path)
  assert (again.order, again.vocab_size, again.search_steps) == (3, V, lm.search_steps)
  np.testing.assert_array_equal(lookup(again, ctx, tok), got)

  ngram.check(lm, V)
  with pytest.raises(ValueError, match=r"refine\.ngram.*vocabulary of 7 tokens.*has 9"):
    ngram.check(lm, 9)
  with pytest.raises(ValueError, match=r"drafter\.lm"):
    ngram.check(lm, 9, field="drafter.lm")


def test_bad_input(tmp_path):
  docs = _corpus()
  for order in (0, -2, 1.5):
    with pytest.raises(ValueError, match=r"order=.*integer >= 1"):
      ngram.build(docs, order=order, vocab_size=V)
  with pytest.raises(ValueError, match="vocab_size=0"):
    ngram.build(docs, order=2, vocab_size=0)
  for empty in ([], [np.zeros(0, np.int32)], np.zeros(0, np.int32)):
    with pytest.raises(ValueError, match="corpus is empty"):
      ngram.build(empty, order=2, vocab_size=V)
  for bad in (V, -1):
    with pytest.raises(ValueError, match=r"token_arrays\[1\].*outside \[0, vocab_size=7\)"):
      ngram.build([docs[0], np.array([0, bad, 1])], order=2, vocab_size=V)
  with pytest.raises(ValueError, match=r"token_arrays\[0\].*integer"):
    ngram.build([np.array([0.0, 1.0])], order=2, vocab_size=V)
  with pytest.raises(ValueError, match=r"3-D"):
    ngram.build(np.zeros((2, 2, 2), np.int32), order=2, vocab_size=V)
  with pytest.raises(ValueError, match=r"order=5.*no 5-gram"):
    ngram.build([np.arange(4)], order=5, vocab_size=V)
  missing = str(tmp_path / "missing.npz")
  with pytest.raises(ValueError, match="missing.npz"):
    ngram.load(missing)
  corrupt = tmp_path / "corrupt.npz"
  corrupt.write_bytes(b"not a zip file")
  with pytest.raises(ValueError, match="corrupt.npz.*rebuild"):
    ngram.load(str(corrupt))
  partial = str(tmp_path / "partial.npz")
  np.savez(partial, order=3, vocab_size=V, unigram=np.zeros(V))
  with pytest.raises(ValueError, match="partial.npz.*missing"):
    ngram.load(partial)


def test_large_vocabulary():
  vocab = 50_000
  rng = np.random.default_rng(4)
  docs = list(np.split(rng.integers(0, vocab, size=40_000), [15_000, 30_000]))
  # One context (token 0) followed by every other token: a 49,999-long segment to search.
  wide = np.zeros(2 * (vocab - 1), np.int64)
  wide[1::2] = rng.permutation(np.arange(1, vocab))
  docs.append(wide)
  lm = ngram.build(docs, order=3, vocab_size=vocab)  # build time: see the module docstring
  assert lm.search_steps[0] == (vocab - 1).bit_length()
  ctx = np.array([[1, 0], [-1, 0], [wide[-3], 0], [0, 0], [-1, -1], [vocab - 1, vocab - 2]],
                 np.int32)
  tok = np.array([1, vocab - 1, wide[-1], 12345, 0, 3], np.int32)
  got = np.exp(np.asarray(jax.jit(ngram.log_prob)(lm, ctx, tok), np.float64))
  assert np.isfinite(got).all() and (got > 0).all()
  ref = Reference(docs, 3, vocab)
  np.testing.assert_allclose(got, [ref.prob(c, t) for c, t in zip(ctx, tok)], rtol=1e-5)
  # The whole next-token law after the wide context still sums to 1.
  probs = np.exp(jax.jit(ngram.log_prob)(lm, ctx[1:3, None, :], jnp.arange(vocab)[None, :]))
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-4)
