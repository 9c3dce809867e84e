"""An interpolated Kneser–Ney n-gram LM whose probabilities are looked up inside `jax.jit`.

Used to rescore the top-k lattice of blockwise-parallel-decoding heads (Kim et al. 2024,
"Exploring and Improving Drafts in Blockwise Parallel Decoding": n-gram lattice rescoring).

Shape letters (repo legend): B batch, P padded prompt length, V vocabulary; this module adds
Q_ℓ, the number of distinct ℓ-grams seen in the corpus (the nodes of trie level ℓ). n is the
order; a context holds the n-1 most recent tokens, most recent last, -1 where missing.

The probabilities (Chen & Goodman 1999, interpolated Kneser–Ney, one discount per order):
  p_ℓ(w | h) = max(c_ℓ(h w) - D_ℓ, 0) / T_ℓ(h) + D_ℓ · N1+(h •) / T_ℓ(h) · p_{ℓ-1}(w | h')
  p_1(w)     = max(c_1(w) - D_1, 0) / T_1 + D_1 · N1+(•) / T_1 · 1/V
where h' drops h's oldest token, T_ℓ(h) = Σ_w c_ℓ(h w), N1+(h •) = #{w : c_ℓ(h w) > 0} and
D_ℓ = n1 / (n1 + 2 n2) from order ℓ's count-of-counts, clipped to [0.1, 0.9]. c_n is the raw
count; a lower order uses the continuation count c_ℓ(g) = N1+(• g), the number of distinct left
neighbours of g, where a document start counts as one neighbour (KenLM's <s>, so every seen
ℓ-gram has c_ℓ >= 1 and each p_ℓ sums to 1). A context h never seen with a continuation, or one
holding a -1, is skipped: p_ℓ(w | h) = p_{ℓ-1}(w | h').

Layout: a trie in CSR form, nothing dense in V except level 1 (node id = token). A node at level
ℓ-1 owns the contiguous segment [child_start, child_start + child_count) of level-ℓ nodes, sorted
by token, so finding (h, w) is a binary search of a fixed step count (jittable, vmappable).
The float terms are precomputed per node: alpha = max(c - D, 0) / T(parent) on every node and
beta = D · N1+ / T on context nodes (1 on a node without continuations), so the order-ℓ term is
alpha + beta · p_{ℓ-1}. All arrays are int32/float32: no key needs x64.
"""

from __future__ import annotations

from collections.abc import Iterable
import zipfile

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

_MAX_TOKENS = 2 ** 30  # node ids and the search's lo + hi must stay below 2^31 in int32


@flax.struct.dataclass
class NGramLM:
  """The trie. Step i = 0..n-2 adds order ℓ = i + 2 on top of order ℓ - 1:
  ctx_beta[i] f32[Q_{ℓ-1}], child_start[i], child_count[i] int32[Q_{ℓ-1}] (level-1 nodes are the
  V tokens) and token[i] int32[Q_ℓ], alpha[i] f32[Q_ℓ]. unigram f32[V] is p_1."""
  unigram: jax.Array
  ctx_beta: tuple
  child_start: tuple
  child_count: tuple
  token: tuple
  alpha: tuple
  order: int = flax.struct.field(pytree_node=False)
  vocab_size: int = flax.struct.field(pytree_node=False)
  search_steps: tuple = flax.struct.field(pytree_node=False)  # binary-search steps per step i


def _device(array, dtype) -> jax.Array:
  """A host array on the device in `dtype`, converted on the host (jnp.asarray with a new dtype
  compiles a conversion for every shape)."""
  return jax.device_put(np.asarray(array, dtype))


def _from_arrays(arrays: dict, order: int, vocab_size: int) -> NGramLM:
  """An NGramLM from numpy arrays keyed as in `save`; search steps from the longest segment."""
  def per_step(name, dtype):
    return tuple(_device(arrays[f"{name}_{ell}"], dtype) for ell in range(2, order + 1))

  # A lower-bound search over s items ends after s.bit_length() halvings.
  steps = tuple(int(np.max(arrays[f"child_count_{ell}"], initial=0)).bit_length()
                for ell in range(2, order + 1))
  return NGramLM(unigram=_device(arrays["unigram"], jnp.float32),
                 ctx_beta=per_step("ctx_beta", jnp.float32),
                 child_start=per_step("child_start", jnp.int32),
                 child_count=per_step("child_count", jnp.int32),
                 token=per_step("token", jnp.int32), alpha=per_step("alpha", jnp.float32),
                 order=order, vocab_size=vocab_size, search_steps=steps)


def _documents(token_arrays, vocab_size: int) -> list[np.ndarray]:
  """The corpus as a list of 1-D int64 documents, validated."""
  if isinstance(token_arrays, np.ndarray):
    if token_arrays.ndim not in (1, 2):
      raise ValueError(f"token_arrays: a {token_arrays.ndim}-D array; give one 1-D document, "
                       "a 2-D array of documents (rows) or an iterable of 1-D documents.")
    token_arrays = [token_arrays] if token_arrays.ndim == 1 else list(token_arrays)
  docs = []
  for k, doc in enumerate(token_arrays):
    doc = np.asarray(doc)
    if doc.ndim != 1 or (doc.size and not np.issubdtype(doc.dtype, np.integer)):
      raise ValueError(f"token_arrays[{k}]: shape {doc.shape}, dtype {doc.dtype}; each document "
                       "must be a 1-D array of integer token ids.")
    if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
      raise ValueError(f"token_arrays[{k}]: token ids span [{doc.min()}, {doc.max()}] outside "
                       f"[0, vocab_size={vocab_size}): tokenize with the verifier's tokenizer "
                       "or pass its vocab_size.")
    docs.append(doc.astype(np.int64))
  total = sum(d.size for d in docs)
  if total == 0:
    raise ValueError("token_arrays: the corpus is empty; give at least one non-empty document.")
  if total >= _MAX_TOKENS:
    raise ValueError(f"token_arrays: {total} tokens; int32 node ids allow fewer than 2^30, so "
                     "build from a subsample.")
  return docs


def _discount(counts: np.ndarray) -> float:
  """D = n1 / (n1 + 2 n2) from one order's count-of-counts (Ney et al. 1994; Chen & Goodman
  1999 §3), clipped
  so that a corpus with no count of 2 (D = 1) or no count of 1 (D = 0) stays usable."""
  n1, n2 = np.sum(counts == 1), np.sum(counts == 2)
  return float(np.clip(n1 / max(n1 + 2 * n2, 1), 0.1, 0.9))


def _continuation(node: np.ndarray, left: np.ndarray, num_nodes: int, vocab_size: int):
  """c(g) = N1+(• g): distinct left neighbours (0 = document start, t + 1 = token t) per node."""
  pairs = np.sort(node * (vocab_size + 1) + left)  # np.sort + diff: numpy 2's hashing unique
  pairs = pairs[np.r_[True, pairs[1:] != pairs[:-1]]]  # is several times slower here
  return np.bincount(pairs // (vocab_size + 1), minlength=num_nodes)


def build(token_arrays: Iterable[np.ndarray] | np.ndarray, *, order: int,
          vocab_size: int) -> NGramLM:
  """The order-`order` interpolated KN LM of one or more 1-D token sequences (documents; no
  n-gram crosses a document boundary). numpy only: one np.unique of (parent id, token) keys per
  level, whose sorted order is the CSR layout itself."""
  if isinstance(order, bool) or not isinstance(order, (int, np.integer)) or order < 1:
    raise ValueError(f"order={order!r}: the n-gram order must be an integer >= 1.")
  if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
    raise ValueError(f"vocab_size={vocab_size!r}: give the verifier's vocabulary size (>= 1).")
  order, v = int(order), int(vocab_size)
  docs = _documents(token_arrays, v)
  flat = np.concatenate(docs)
  lengths = np.array([d.size for d in docs])
  ends = np.cumsum(lengths)
  remaining = np.repeat(ends, lengths) - np.arange(flat.size)  # tokens left in the document
  starts = np.zeros(flat.size, bool)
  starts[(ends - lengths)[lengths > 0]] = True
  left = np.where(starts, 0, np.roll(flat, 1) + 1)  # left neighbour + 1; 0 = document start

  pos, node = np.arange(flat.size), flat  # ℓ-grams starting at pos; level-1 node id = token
  c = (np.bincount(flat, minlength=v) if order == 1
       else _continuation(node, left, v, v))
  d = _discount(c)
  total, seen = c.sum(), np.count_nonzero(c)
  out = {"unigram": np.maximum(c - d, 0) / total + d * seen / total / v}
  num_parents = v
  for ell in range(2, order + 1):
    keep = remaining[pos] >= ell
    if not keep.any():
      raise ValueError(f"order={order}: no document has {ell} tokens, so the corpus has no "
                       f"{ell}-gram; give longer documents or a lower order.")
    pos = pos[keep]
    # Sorted (parent, token) keys: each parent's children are contiguous and sorted by token.
    keys, node = np.unique(node[keep] * v + flat[pos + ell - 1], return_inverse=True)
    node = node.reshape(-1)
    parent, token = keys // v, keys % v
    c = (np.bincount(node, minlength=keys.size) if ell == order
         else _continuation(node, left[pos], keys.size, v))
    d = _discount(c)
    total = np.bincount(parent, weights=c, minlength=num_parents)
    kids = np.bincount(parent, minlength=num_parents)
    out[f"token_{ell}"] = token
    out[f"alpha_{ell}"] = np.maximum(c - d, 0) / total[parent]
    out[f"ctx_beta_{ell}"] = np.where(kids > 0, d * kids / np.maximum(total, 1), 1.0)
    out[f"child_start_{ell}"] = np.cumsum(kids) - kids
    out[f"child_count_{ell}"] = kids
    num_parents = keys.size
  return _from_arrays(out, order, v)


def _find_child(lm: NGramLM, i: int, parent: jax.Array, token: jax.Array):
  """(child node int32[...], found bool[...]) of `parent` (a level i+1 node) on `token`: a
  lower-bound binary search of lm.search_steps[i] halvings inside the parent's segment."""
  keys = lm.token[i]
  parent = jnp.clip(parent, 0, lm.child_start[i].shape[0] - 1)
  start = lm.child_start[i][parent]
  end = start + lm.child_count[i][parent]
  last = keys.shape[0] - 1

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) >> 1
    right = keys[jnp.clip(mid, 0, last)] < token
    live = lo < hi  # a finished search keeps its bounds
    return jnp.where(live & right, mid + 1, lo), jnp.where(live & ~right, mid, hi)

  lo, _ = jax.lax.fori_loop(0, lm.search_steps[i], halve, (start, end))
  child = jnp.clip(lo, 0, last)
  return child, (lo < end) & (keys[child] == token)


def log_prob(lm: NGramLM, context: jax.Array, token: jax.Array) -> jax.Array:
  """log p(token | context) f32[...] (natural log) under the interpolated KN LM.

  context int32[..., K], most recent token last, -1 = missing (say before a sequence starts):
  the last n-1 tokens are used, a shorter K counts as -1 on the left. token int32[...]; the
  leading dims broadcast. An order whose context holds a -1 (or an id outside [0, V)) backs off;
  a token outside [0, V) gets -inf. Jittable and vmappable; order ℓ costs ℓ-1 searches."""
  m, v = lm.order - 1, lm.vocab_size
  context, token = jnp.asarray(context, jnp.int32), jnp.asarray(token, jnp.int32)
  if context.ndim < 1:
    raise ValueError(f"context: shape {context.shape}; give int32[..., K] (K = {m} for order "
                     f"{lm.order}).")
  k = context.shape[-1]
  if k < m:
    context = jnp.pad(context, [(0, 0)] * (context.ndim - 1) + [(m - k, 0)], constant_values=-1)
  context = context[..., context.shape[-1] - m:]
  shape = jnp.broadcast_shapes(context.shape[:-1], token.shape)
  context, token = jnp.broadcast_to(context, shape + (m,)), jnp.broadcast_to(token, shape)
  known = (context >= 0) & (context < v)
  w = jnp.clip(token, 0, v - 1)
  p = lm.unigram[w]
  for ell in range(2, lm.order + 1):
    # Walk the trie along h = the ℓ-1 most recent tokens (level 1 is dense), then look up w.
    h = context[..., m - (ell - 1):]
    node, found = jnp.clip(h[..., 0], 0, v - 1), jnp.all(known[..., m - (ell - 1):], axis=-1)
    for j in range(1, ell - 1):
      node, hit = _find_child(lm, j - 1, node, h[..., j])
      found &= hit
    beta = jnp.where(found, lm.ctx_beta[ell - 2][node], 1.0)  # unseen context: p_ℓ = p_{ℓ-1}
    child, hit = _find_child(lm, ell - 2, node, w)
    p = jnp.where(found & hit, lm.alpha[ell - 2][child], 0.0) + beta * p
  in_range = (token >= 0) & (token < v)
  return jnp.where(in_range, jnp.log(p), -jnp.inf)


def _arrays(lm: NGramLM) -> dict:
  out = {"unigram": np.asarray(lm.unigram)}
  for i, ell in enumerate(range(2, lm.order + 1)):
    for name in ("ctx_beta", "child_start", "child_count", "token", "alpha"):
      out[f"{name}_{ell}"] = np.asarray(getattr(lm, name)[i])
  return out


def save(lm: NGramLM, path: str) -> None:
  """One .npz at exactly `path`: the trie arrays plus order and vocab_size."""
  with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a bare path
    np.savez(f, order=lm.order, vocab_size=lm.vocab_size, **_arrays(lm))


def load(path: str) -> NGramLM:
  """The NGramLM saved at `path`; ValueError naming the path when it is missing or corrupt."""
  try:
    with np.load(path) as f:
      arrays = {name: f[name] for name in f.files}
    order, v = int(arrays["order"]), int(arrays["vocab_size"])
    need = {f"{name}_{ell}" for ell in range(2, order + 1)
            for name in ("ctx_beta", "child_start", "child_count", "token", "alpha")}
    if order < 1 or arrays["unigram"].shape != (v,) or need - arrays.keys():
      raise ValueError(f"order {order}, unigram {arrays['unigram'].shape}, missing "
                       f"{sorted(need - arrays.keys())}")
  except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile) as e:
    raise ValueError(f"{path}: not a readable n-gram LM ({type(e).__name__}: {e}); rebuild it "
                     "with spec_jax.models.ngram.build and save.") from e
  return _from_arrays(arrays, order, v)


def check(lm: NGramLM, vocab_size: int, field: str = "refine.ngram") -> None:
  """ValueError naming `field` when the LM's vocabulary is not the drafter/verifier's."""
  if lm.vocab_size != vocab_size:
    raise ValueError(f"{field}: the n-gram LM was built for a vocabulary of {lm.vocab_size} "
                     f"tokens; the verifier has {vocab_size}: rebuild it with the verifier's "
                     "tokenizer.")
