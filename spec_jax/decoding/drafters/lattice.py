"""The BPD heads' top-k lattice as a set of draft paths: every path's score under the heads and an
n-gram LM, the p best paths, and the prefix tree that verifies them in one call (Kim et al. 2024,
"Exploring and Improving Drafts in Blockwise Parallel Decoding", global rescoring; the lattice is
Stern et al. 2018's).

Shape letters (repo legend): B batch, A = h lattice positions (one per head), K candidates per
position (each head's top k), W partial paths kept per level, P kept paths, V vocabulary, O =
n-gram order − 1 context tokens, M = 1 + P·A tree nodes.

The search scores at most MAX_PATHS paths per level. While K^A ≤ MAX_PATHS it scores all K^A
paths at once, so the p best are exact for any score, an n-gram of any order included. Beyond
that it walks the lattice level by level, extending each kept prefix by the K candidates of the
next head and keeping the MAX_PATHS / K best prefixes by their prefix sums (a prefix's score is
final: each n-gram term depends only on the history and earlier path tokens): a beam search,
exact for the heads alone (w = 0) when p ≤ MAX_PATHS / K, approximate with an n-gram (a dropped
prefix could still end better under later terms).

The kept paths merge into a prefix tree laid out level by level (`trees` layout): node
1 + (d − 1)·P + j holds path j's token at depth d, valid only where no better path shares its
prefix of length d; a duplicate's children hang under the first path with that prefix. Siblings
are distinct tokens, at most min(P, K) of them, so the greedy tree walk examines at most
min(P, K) candidates per step. `beam_tree` lays out a beam search's levels (width P) the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding.drafters import trees

MAX_PATHS = 1 << 16  # paths scored per lattice level and row (beam width · K)


def check_shape(num_heads: int, top_k: int, paths: int, *, field: str = "bpd",
                beam: bool = False) -> None:
  """Raise ValueError naming the field when (h, k, p) is not a lattice search we can run (with
  `beam`, p is the beam tree's width)."""
  for name, value in (("top_k", top_k), ("paths", paths)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{field}.{name}={value!r} must be an integer >= 1.")
  if top_k > MAX_PATHS:
    raise ValueError(f"{field}.top_k={top_k} exceeds the {MAX_PATHS} paths scored per lattice "
                     f"level. Fix: {field}.top_k <= {MAX_PATHS}.")
  if beam:
    if paths * top_k > MAX_PATHS:
      raise ValueError(f"{field}.paths={paths} (the beam width) times {field}.top_k={top_k} "
                       f"exceeds the {MAX_PATHS} prefixes scored per lattice level. Fix: "
                       f"{field}.paths <= {MAX_PATHS // top_k}.")
    return
  most = max_paths(num_heads, top_k)
  if paths > most:
    raise ValueError(f"{field}.paths={paths} exceeds the {most} paths the search scores at the "
                     f"last level (k^h = {top_k}^{num_heads} = {top_k ** num_heads}, at most "
                     f"{MAX_PATHS}). Fix: {field}.paths <= {most}.")


def max_paths(num_heads: int, top_k: int) -> int:
  """How many full paths the search scores at its last level: min(k^h, MAX_PATHS / k · k)."""
  return min(top_k ** num_heads, MAX_PATHS // top_k * top_k)


def top_k_lattice(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
  """(tokens int32[B, A, K], log-probs f32[B, A, K]): each head's k most likely tokens under its
  own normalised law, most likely first."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  values, tokens = jax.lax.top_k(logp, top_k)
  return tokens.astype(jnp.int32), values


def history(tokens: jax.Array, lengths: jax.Array, size: int) -> jax.Array:
  """int32[B, O]: the last O = `size` committed tokens (most recent last), −1 before the start."""
  pos = lengths[:, None] - size + jnp.arange(size, dtype=jnp.int32)[None]
  got = jnp.take_along_axis(tokens, jnp.maximum(pos, 0), axis=1)
  return jnp.where(pos >= 0, got, -1).astype(jnp.int32)


def search(lat_tokens: jax.Array, lat_logp: jax.Array, hist: jax.Array | None, lm,
           weight: float, *, beam: int | None = None) -> tuple[jax.Array, jax.Array]:
  """(paths int32[B, N, A], scores f32[B, N]): the lattice paths the search scores at its last
  level (module docstring), each scored by
      Σ_i (1 − w) · log q_i(x_i) + w · log p_ngram(x_i | history, x_<i)
  lat_tokens / lat_logp [B, A, K] the lattice (`top_k_lattice`), hist int32[B, O] the committed
  history (most recent last, −1 before the start), w = `weight` (lm None or w = 0: the heads
  alone). `beam`: prefixes kept per level (default MAX_PATHS / K). When it keeps them all
  (K^(A − 1) ≤ beam) every path is scored at once, in one n-gram query: the level-by-level
  loop's A queries (each a chain of small binary searches) made a bpd_ngram p = 4 round ~1.5×
  slower on 2 CPU cores."""
  b, a, k = lat_tokens.shape
  beam = MAX_PATHS // k if beam is None else beam
  if k ** (a - 1) <= beam:
    index = jnp.asarray(np.indices((k,) * a).reshape(a, -1).T)          # [N, A], lexicographic
    paths = lat_tokens[:, jnp.arange(a)[None, :], index]                 # [B, N, A]
    step = lat_logp[:, jnp.arange(a)[None, :], index]
    if lm is not None and weight > 0:
      n, o = paths.shape[1], hist.shape[1]
      full = jnp.concatenate([jnp.broadcast_to(hist[:, None], (b, n, o)), paths], axis=-1)
      contexts = jnp.stack([full[..., i:i + o] for i in range(a)], axis=2)  # [B, N, A, O]
      step = (1.0 - weight) * step + weight * _ngram_log_prob(lm, contexts, paths)
    return paths, jnp.sum(step, axis=-1)
  paths = jnp.zeros((b, 1, 0), jnp.int32)
  scores = jnp.zeros((b, 1), jnp.float32)
  for i in range(a):
    paths, scores = _extend(paths, scores, lat_tokens[:, i], lat_logp[:, i], hist, lm, weight)
    if i < a - 1 and paths.shape[1] > beam:
      scores, keep = jax.lax.top_k(scores, beam)
      paths = jnp.take_along_axis(paths, keep[..., None], axis=1)
  return paths, scores


def _extend(paths, scores, tokens, logp, hist, lm, weight):
  """Every kept prefix paths int32[B, W, i] (scores f32[B, W]) extended by the K candidates
  tokens / logp [B, K] of the next head: (int32[B, W·K, i + 1], f32[B, W·K]), candidate j of
  prefix r at r·K + j."""
  b, w, i = paths.shape
  k = tokens.shape[-1]
  new = jnp.broadcast_to(tokens[:, None], (b, w, k))                      # [B, W, K]
  step = logp[:, None]                                                   # [B, 1, K]
  if lm is not None and weight > 0:
    context = jnp.concatenate([jnp.broadcast_to(hist[:, None], (b, w, hist.shape[1])),
                               paths], axis=-1)                          # [B, W, O + i]
    step = (1.0 - weight) * step + weight * _ngram_log_prob(lm, context[:, :, None], new)
  grown = jnp.concatenate([jnp.broadcast_to(paths[:, :, None], (b, w, k, i)), new[..., None]],
                          axis=-1)
  return grown.reshape(b, w * k, i + 1), (scores[:, :, None] + step).reshape(b, w * k)


def beam_tree(root: jax.Array, lat_tokens: jax.Array, lat_logp: jax.Array, hist, lm,
              weight: float, width: int) -> trees.Tree:
  """The draft tree of a beam search over the lattice that keeps every level's beam: level d
  holds the `width` best depth-d prefixes, by the same prefix score as `search`, among the
  extensions of level d − 1's (a dynamic tree in the manner of EAGLE-2, where `search` keeps
  full paths only). The p-best paths spend a tree's nodes on complete paths; this spends them
  level by level on the prefixes most likely to be accepted, so shallow levels, which decide
  most of τ, get more distinct candidates for the same 1 + W·A verifier tokens.
  Layout as `prefix_tree`'s: node 1 + (d − 1)·W + j, best first within a level; siblings are
  distinct (one head's top-k); nodes past the candidates a level has (level 1 when k < W)
  are padding with valid False. root int32[B], lattice [B, A, K], hist / lm / weight as in
  `search`. Deterministic, so greedy only."""
  b, a, k = lat_tokens.shape
  paths = jnp.zeros((b, 1, 0), jnp.int32)
  scores = jnp.zeros((b, 1), jnp.float32)
  toks, parents, depths, valids = [root[:, None]], [jnp.full((b, 1), -1, jnp.int32)], [
      jnp.zeros((b, 1), jnp.int32)], [jnp.ones((b, 1), bool)]
  for i in range(a):
    paths, scores = _extend(paths, scores, lat_tokens[:, i], lat_logp[:, i], hist, lm, weight)
    n = paths.shape[1]
    if n < width:  # only level 1 (n = K): pad with impossible candidates
      paths = jnp.pad(paths, ((0, 0), (0, width - n), (0, 0)))
      scores = jnp.pad(scores, ((0, 0), (0, width - n)), constant_values=-jnp.inf)
    scores, keep = jax.lax.top_k(scores, width)
    paths = jnp.take_along_axis(paths, keep[..., None], axis=1)
    toks.append(paths[:, :, -1])
    parents.append(jnp.zeros((b, width), jnp.int32) if i == 0
                   else (1 + (i - 1) * width + keep // k).astype(jnp.int32))
    depths.append(jnp.full((b, width), i + 1, jnp.int32))
    valids.append(jnp.isfinite(scores))
  cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
  return trees.Tree(tokens=cat(toks).astype(jnp.int32), parent=cat(parents),
                    depth=cat(depths), valid=cat(valids))


def _ngram_log_prob(lm, context, token):
  from spec_jax.models import ngram  # noqa: PLC0415  (only the n-gram refinement needs it)
  return ngram.log_prob(lm, context, token)


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
                  paths: int, weight: float, beam: bool = False) -> trees.Tree:
  """Global rescoring: the `paths` best lattice paths under
      score = Σ_i (1 − w) · log q_i(x_i) + w · log p_ngram(x_i | history, x_<i)
  (w = `weight`; w = 0 keeps the heads' own ranking; `search`), merged into a prefix tree; with
  `beam`, the beam tree of width `paths` under the same score (`beam_tree`).
  logits f32[B, A, V] the heads' logits, root int32[B] the last committed token, hist int32[B, O]
  the committed history the n-gram conditions on (None or w = 0: no n-gram)."""
  lat_tokens, lat_logp = top_k_lattice(logits, top_k)
  if beam:
    return beam_tree(root, lat_tokens, lat_logp, hist, lm, weight, paths)
  cand, score = search(lat_tokens, lat_logp, hist, lm, weight)
  kept, _ = best_paths(score, cand, paths)
  return prefix_tree(root, kept)


def shape(paths: int, depth: int, beam: bool = False) -> trees.TreeSpec:
  """The static layout of a kept-paths prefix tree (or, `beam`, a beam tree of width `paths`):
  P nodes per level, depth A (the layout of P draft chains; only greedy verifies it, so the
  chains' sampling scheme never applies)."""
  return (_BeamShape if beam else _PathsShape)("chains", depth=depth, width=paths,
                                                name="lattice")


class _PathsShape(trees.TreeSpec):
  def describe(self) -> str:
    return f"p={self.width} best lattice paths L={self.depth}"


class _BeamShape(_PathsShape):
  def describe(self) -> str:
    return f"lattice beam tree W={self.width} L={self.depth}"

  @property
  def max_candidates(self) -> int:
    return self.width
