"""The BPD heads' top-k lattice as a set of draft paths: every path's score under the heads and an
n-gram LM, the p best paths, and the prefix tree that verifies them in one call (Kim et al. 2024,
"Exploring and Improving Drafts in Blockwise Parallel Decoding", global rescoring; the lattice is
Stern et al. 2018's).

Shape letters (repo legend): B batch, A = h lattice positions (one per head), K candidates per
position (each head's top k), N = K^A paths, P kept paths, V vocabulary, O = n-gram order − 1
context tokens, M = 1 + P·A tree nodes.

Path j at position i takes candidate `path_index(K, A)[j, i]` of head i + 1. The search is
exhaustive (N ≤ MAX_PATHS), so the p best paths are exact for any score, an n-gram of any order
included (a beam search would be approximate for orders > 2). The kept paths merge into a prefix
tree laid out level by level (`trees` layout): node 1 + (d − 1)·P + j holds path j's token at
depth d, valid only where no better path shares its prefix of length d; a duplicate's children
hang under the first path with that prefix. Siblings are distinct tokens, at most min(P, K) of
them, so the greedy tree walk examines at most min(P, K) candidates per step.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding.drafters import trees

MAX_PATHS = 1 << 16  # K^A paths scored exhaustively per row


def check_shape(num_heads: int, top_k: int, paths: int, *, field: str = "bpd") -> None:
  """Raise ValueError naming the field when (h, k, p) is not a lattice search we can run."""
  for name, value in (("top_k", top_k), ("paths", paths)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{field}.{name}={value!r} must be an integer >= 1.")
  if top_k ** num_heads > MAX_PATHS:
    raise ValueError(f"{field}.top_k={top_k} with {num_heads} heads gives {top_k ** num_heads} "
                     f"lattice paths; at most {MAX_PATHS} are scored exhaustively. Fix: lower "
                     f"{field}.top_k or the draft depth.")
  if paths > top_k ** num_heads:
    raise ValueError(f"{field}.paths={paths} exceeds the lattice's k^h = {top_k}^{num_heads} = "
                     f"{top_k ** num_heads} paths. Fix: {field}.paths <= {top_k ** num_heads}.")


def path_index(top_k: int, num_heads: int) -> np.ndarray:
  """int32[K^A, A]: candidate index of every path at every position, lexicographic (path 0 takes
  every head's top-1)."""
  return np.asarray(list(itertools.product(range(top_k), repeat=num_heads)),
                    np.int32).reshape(-1, num_heads)


def top_k_lattice(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
  """(tokens int32[B, A, K], log-probs f32[B, A, K]): each head's k most likely tokens under its
  own normalised law, most likely first."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  values, tokens = jax.lax.top_k(logp, top_k)
  return tokens.astype(jnp.int32), values


def lattice_paths(lat: jax.Array, index: np.ndarray) -> jax.Array:
  """[B, N, A]: per-position values of every path (lat [B, A, K] tokens or log-probs)."""
  a = lat.shape[1]
  idx = jnp.asarray(index)                                             # [N, A]
  return lat[:, jnp.arange(a)[None, :], idx]                           # [B, N, A]


def history(tokens: jax.Array, lengths: jax.Array, size: int) -> jax.Array:
  """int32[B, O]: the last O = `size` committed tokens (most recent last), −1 before the start."""
  pos = lengths[:, None] - size + jnp.arange(size, dtype=jnp.int32)[None]
  got = jnp.take_along_axis(tokens, jnp.maximum(pos, 0), axis=1)
  return jnp.where(pos >= 0, got, -1).astype(jnp.int32)


def ngram_log_probs(lm, hist: jax.Array, paths: jax.Array) -> jax.Array:
  """f32[B, N, A]: log p_ngram(path token i | the O tokens before it), the committed history
  hist int32[B, O] followed by the path's own earlier tokens (paths int32[B, N, A])."""
  from spec_jax.models import ngram  # noqa: PLC0415  (only the n-gram refinement needs it)
  b, n, a = paths.shape
  o = hist.shape[1]
  full = jnp.concatenate([jnp.broadcast_to(hist[:, None], (b, n, o)), paths], axis=-1)
  contexts = jnp.stack([full[..., i:i + o] for i in range(a)], axis=2)   # [B, N, A, O]
  return ngram.log_prob(lm, contexts, paths)


def best_paths(scores: jax.Array, paths: jax.Array, num: int) -> tuple[jax.Array, jax.Array]:
  """(int32[B, P, A] the `num` best paths by scores f32[B, N], best first; their scores)."""
  top, idx = jax.lax.top_k(scores, num)
  return jnp.take_along_axis(paths, idx[..., None], axis=1), top


def prefix_tree(root: jax.Array, paths: jax.Array) -> trees.Tree:
  """The prefix tree of paths int32[B, P, A] under root int32[B] (module docstring layout)."""
  b, p, a = paths.shape
  js = jnp.arange(p, dtype=jnp.int32)
  toks, parents, depths, valids = [root[:, None]], [jnp.full((b, 1), -1, jnp.int32)], [
      jnp.zeros((b, 1), jnp.int32)], [jnp.ones((b, 1), bool)]
  canonical_prev = None
  for d in range(1, a + 1):
    same = jnp.all(paths[:, :, None, :d] == paths[:, None, :, :d], axis=-1)  # [B, P, P]
    canonical = jnp.argmax(same, axis=-1).astype(jnp.int32)            # first path with the prefix
    toks.append(paths[:, :, d - 1])
    parents.append(jnp.zeros((b, p), jnp.int32) if d == 1
                   else 1 + (d - 2) * p + canonical_prev)
    depths.append(jnp.full((b, p), d, jnp.int32))
    valids.append(canonical == js[None])
    canonical_prev = canonical
  cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
  return trees.Tree(tokens=cat(toks).astype(jnp.int32), parent=cat(parents),
                    depth=cat(depths), valid=cat(valids))


def rescored_tree(logits: jax.Array, root: jax.Array, hist: jax.Array, lm, *, top_k: int,
                  paths: int, weight: float) -> trees.Tree:
  """Global rescoring: the `paths` best lattice paths under
      score = Σ_i (1 − w) · log q_i(x_i) + w · log p_ngram(x_i | history, x_<i)
  (w = `weight`; w = 0 keeps the heads' own ranking), merged into a prefix tree.
  logits f32[B, A, V] the heads' logits, root int32[B] the last committed token, hist int32[B, O]
  the committed history the n-gram conditions on (None or w = 0: no n-gram)."""
  index = path_index(top_k, logits.shape[1])
  lat_tokens, lat_logp = top_k_lattice(logits, top_k)
  cand = lattice_paths(lat_tokens, index)                               # [B, N, A]
  score = lattice_paths(lat_logp, index)
  if lm is not None and weight > 0:
    score = (1.0 - weight) * score + weight * ngram_log_probs(lm, hist, cand)
  kept, _ = best_paths(jnp.sum(score, axis=-1), cand, paths)
  return prefix_tree(root, kept)


def shape(paths: int, depth: int) -> trees.TreeSpec:
  """The static layout of a kept-paths prefix tree: P nodes per level, depth A (the layout of
  P draft chains; only greedy verifies it, so the chains' sampling scheme never applies)."""
  return _PathsShape("specinfer", depth=depth, width=paths)


class _PathsShape(trees.TreeSpec):
  def describe(self) -> str:
    return f"p={self.width} best lattice paths L={self.depth}"

  @property
  def max_candidates(self) -> int:
    return self.width
