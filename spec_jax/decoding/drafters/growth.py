"""Growing a draft tree with one drafter call per level, the same code for every drafter that can
feed a level of nodes with tree attention (`lm.LMDrafter`, the steered drafter through it, and
`features.FeatureDrafter`): the fixed layouts of `trees.TreeSpec` and the dynamic one (EAGLE-2).

Shape letters (repo legend): B batch, M proposal nodes (root included), W a level's width,
V vocabulary, R drafting slots (root included).

A drafter hands `grow` its law at the root and a `feed` function,
  feed(d, tokens int32[B, W], parent int32[B, W], anc bool[B, W, R], own int32[W], carry)
      -> (logits f32[B, W, V], carry),
one drafter call over the nodes of level d: node i at position L − 1 + d and cache slot
L − 1 + own[i], seeing the committed prefix and the drafting slots its ancestor-or-self row
anc[b, i] marks (`trees.tree_mask`, slot L − 1 + r for r < R). parent[b, i] indexes the
previous fed level (0: the root); a feature drafter reads its parent's predicted feature there.
carry is the drafter's own (its cache; a feature drafter's predicted features too).

Fixed layouts: node j is fed at slot L − 1 + j, every level but the deepest (`trees.expand`
grows each level; L calls with the root's).

Dynamic trees (EAGLE-2, Li et al. 2024, with static K, M and depth L; the `dyn` method):
  level 1    the K best children of the root;
  level d+1  the K best children of each of the K frontier nodes of level d: K·K candidates,
             whose K best are the next frontier, fed in one call (the deepest level is not fed);
  kept       the M best nodes of the whole pool (K + (L−1)·K² nodes), ties to the lower pool
             index. A node scores at least as much as its children and sits before them in
             the pool, so the kept nodes form a tree; they are laid out level by level, siblings
             in draw order (sorted pool indices), as the rules walk them.
  Scores: at T = 0 the path's log-probability under the drafter (EAGLE-2's), children the top K
  (beam search; greedy verification). At T > 0 the perturbed path values of stochastic beam
  search: a node's children are `perturbed_top_k` of φ + log q conditioned on the node's value,
  so siblings are an ordered sample without replacement from q and every selection above is a
  function of values only; why recursive rejection sampling stays exact on the kept tree is in
  `dyn.py`. Fed frontier nodes sit in drafting slots 1 + (d−1)·K + i, so R = 1 + (L−1)·K can
  exceed M + 1 (`extra_slots`); a drafter whose cache must follow the proposal's layout after the
  round (the LM's `commit` moves the accepted path by node index) calls `relayout`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import trees
from spec_jax.decoding.drafters.gumbel import perturbed_top_k
from spec_jax.decoding.protocols import Proposal

Feed = Callable[..., tuple[jax.Array, Any]]
NEG_INF = -jnp.inf


def draft_slots(spec: trees.TreeSpec) -> int:
  """R: the cache slots from the root on that growing `spec` writes (the root's included)."""
  if spec.is_dynamic:
    return 1 + (spec.depth - 1) * spec.width
  return spec.num_nodes


def extra_slots(spec: trees.TreeSpec) -> int:
  """Cache slots a drafter needs on top of the loop's size (which has room for M nodes)."""
  return max(0, draft_slots(spec) - spec.num_nodes)


def grow(spec: trees.TreeSpec, feed: Feed, carry, root: jax.Array, root_logits: jax.Array,
         rng: jax.Array, sampling: sampling_lib.Sampling):
  """Grow one tree of shape `spec` per row from root int32[B] whose drafter logits are
  root_logits f32[B, V]. Returns (proposal, carry, slot int32[B, M] | None): slot[b, j] is the
  drafting slot (from the root) node j was fed at, -1 for a node never fed; None for a fixed
  layout (node j was fed at slot j). q[b, j] is the exact law node j's children were drawn from
  (zeros where it has none drafted)."""
  if spec.is_chain:
    raise ValueError("growth.grow draws trees; a drafter draws its chains itself.")
  if spec.is_dynamic:
    return _grow_dynamic(spec, feed, carry, root, root_logits, rng, sampling)
  b = root.shape[0]
  m = spec.num_nodes
  offsets = spec.level_offsets
  logits = root_logits[:, None]                                         # [B, 1, V]
  levels = [trees.root_level(root)]
  anc = jax.nn.one_hot(jnp.zeros((b, 1), jnp.int32), m, dtype=bool)     # ancestor rows
  q_levels = []
  for d in range(1, spec.depth + 1):
    q = sampling_lib.probs_from_logits(logits, sampling)                # law at level d-1
    q_levels.append(q)
    level = trees.expand(spec, d, jax.random.fold_in(rng, d), logits, q, levels[-1],
                         offsets[d - 1], sampling)
    levels.append(level)
    if d < spec.depth:  # feed level d for its children's law (the deepest is never fed)
      own = offsets[d] + jnp.arange(spec.level_widths[d - 1], dtype=jnp.int32)
      parent = level.parent - offsets[d - 1]
      anc = trees.ancestor_rows(anc, parent, jnp.broadcast_to(own[None], parent.shape), m)
      logits, carry = feed(d, level.tokens, parent, anc, own, carry)
  q_levels.append(jnp.zeros((b, spec.level_widths[-1], q_levels[0].shape[-1]), jnp.float32))
  tree = trees.assemble(spec, levels)
  proposal = Proposal(tokens=tree.tokens, parent=tree.parent, depth=tree.depth, valid=tree.valid,
                      q=jnp.concatenate(q_levels, axis=1), chain=False, scheme=spec.scheme,
                      max_depth=spec.depth, max_candidates=spec.max_candidates)
  return proposal, carry, None


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[b, index[b, i], ...] for x[B, N, ...] and index int32[B, I]."""
  return jnp.take_along_axis(x, index.reshape(*index.shape, *([1] * (x.ndim - 2))), axis=1)


def _grow_dynamic(spec, feed, carry, root, root_logits, rng, sampling):
  """EAGLE-2's expansion and rerank (module docstring), static shapes throughout."""
  k, depth = spec.width, spec.depth
  b = root.shape[0]
  r = draft_slots(spec)
  noise = not sampling.greedy
  rows = jnp.arange(b)[:, None]
  # The pool, level by level (lists of [B, w] pieces): token, pool parent, score (the ranking
  # key: perturbed value at T > 0, path log-probability at T = 0), validity, drafting slot, depth.
  pool = {"token": [root[:, None].astype(jnp.int32)], "parent": [jnp.full((b, 1), -1, jnp.int32)],
          "score": [jnp.zeros((b, 1), jnp.float32)], "valid": [jnp.ones((b, 1), bool)],
          "slot": [jnp.zeros((b, 1), jnp.int32)], "depth": [jnp.zeros((b, 1), jnp.int32)]}
  # The last fed level (the frontier): pool index, path log-probability φ, value, validity.
  front = {"pool": jnp.zeros((b, 1), jnp.int32), "logp": jnp.zeros((b, 1), jnp.float32),
           "value": jnp.zeros((b, 1), jnp.float32), "valid": jnp.ones((b, 1), bool)}
  anc = jax.nn.one_hot(jnp.zeros((b, 1), jnp.int32), r, dtype=bool)     # over drafting slots
  logits = root_logits[:, None]                                         # [B, w, V]
  q_fed, size = [], 1
  for d in range(1, depth + 1):
    q = sampling_lib.probs_from_logits(logits, sampling)                # law at the frontier
    q_fed.append(q)
    logq = trees.log_law(logits, q, sampling)
    w = logq.shape[1]
    phi = jnp.where(front["valid"][..., None], front["logp"][..., None] + logq, NEG_INF)
    if noise:  # each frontier node's K best children, conditioned on the node's value
      _, tokens, values = perturbed_top_k(
          jax.random.fold_in(rng, d), phi[:, :, None, :], k,
          jnp.where(front["valid"], front["value"], NEG_INF)[:, :, None])
    else:
      values, tokens = jax.lax.top_k(phi, k)                            # [B, w, K]
    logp = jnp.take_along_axis(phi, tokens, axis=-1).reshape(b, w * k)
    tokens, values = tokens.reshape(b, w * k), values.reshape(b, w * k)
    valid = jnp.isfinite(values) & jnp.isfinite(logp)
    # A child never outscores its parent (so the kept nodes form a tree), whatever the rounding.
    cap = jnp.repeat(jnp.where(noise, front["value"], front["logp"]), k, axis=1)
    score = jnp.where(valid, jnp.minimum(values, cap), NEG_INF)
    slot = jnp.full((b, w * k), -1, jnp.int32)
    if d < depth:  # the next frontier: this level's K best (ties to the lower index), fed
      _, best = jax.lax.top_k(score, k)                                 # [B, K]
      own = 1 + (d - 1) * k + jnp.arange(k, dtype=jnp.int32)
      parent = best // k                                                # in the frontier
      anc = trees.ancestor_rows(anc, parent, jnp.broadcast_to(own[None], (b, k)), r)
      logits, carry = feed(d, _take(tokens, best), parent, anc, own, carry)
      slot = slot.at[rows, best].set(jnp.broadcast_to(own[None], (b, k)))
    pool["token"].append(tokens.astype(jnp.int32))
    pool["parent"].append(jnp.repeat(front["pool"], k, axis=1))
    pool["score"].append(score)
    pool["valid"].append(valid)
    pool["slot"].append(slot)
    pool["depth"].append(jnp.full((b, w * k), d, jnp.int32))
    if d < depth:
      front = {"pool": size + best, "logp": _take(logp, best), "value": _take(score, best),
               "valid": _take(valid, best)}
    size += w * k
  pool = {name: jnp.concatenate(parts, axis=1) for name, parts in pool.items()}
  # The M best of the pool, then in pool order: level by level, siblings in draw order.
  _, pick = jax.lax.top_k(pool["score"][:, 1:], spec.kept)
  nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.sort(pick + 1, axis=1)], axis=1)
  at = {name: _take(x, nodes) for name, x in pool.items()}                # [B, M]
  # A valid node's parent is kept (it ranks first): its proposal index is where it sits.
  match = nodes[:, None, :] == at["parent"][:, :, None]                   # [B, M, M]
  valid = at["valid"] & (jnp.any(match, axis=-1) | (nodes == 0))
  parent = jnp.where(nodes == 0, -1, jnp.where(valid, jnp.argmax(match, axis=-1), 0))
  depth_ = jnp.where(valid | (nodes == 0), at["depth"], 1)               # padding: under the root
  q = jnp.concatenate(q_fed, axis=1)                                      # [B, R, V]
  q = jnp.where((at["slot"] >= 0)[..., None], _take(q, jnp.maximum(at["slot"], 0)), 0.0)
  proposal = Proposal(tokens=at["token"], parent=parent.astype(jnp.int32),
                      depth=depth_.astype(jnp.int32), valid=valid, q=q, chain=False,
                      scheme=spec.scheme, max_depth=depth, max_candidates=spec.max_candidates)
  return proposal, carry, at["slot"]


def relayout(cache, last: jax.Array, slot: jax.Array):
  """Move each fed node's K/V from its drafting slot last + slot[b, j] to its proposal slot
  last + j, so that `trees.move_path` finds the accepted path by node index. A node never fed
  (slot -1) is a leaf of the dynamic tree: if it is accepted last, the next catch-up window
  rewrites the slot it moves to. cache: k, v [L, B, S, K, H] (and pos [B, S] for sliding-window
  models); last int32[B] (the root's slot); slot int32[B, M]."""
  b, m = slot.shape
  size = cache.k.shape[2]
  rows = jnp.arange(b)[:, None]
  src = jnp.clip(last[:, None] + jnp.maximum(slot, 0), 0, size - 1)
  dst = jnp.where(slot >= 0, last[:, None] + jnp.arange(m)[None], size)   # size = dropped write
  cache = cache.replace(k=cache.k.at[:, rows, dst].set(cache.k[:, rows, src], mode="drop"),
                        v=cache.v.at[:, rows, dst].set(cache.v[:, rows, src], mode="drop"))
  if getattr(cache, "pos", None) is not None:
    cache = cache.replace(pos=cache.pos.at[rows, dst].set(cache.pos[rows, src], mode="drop"))
  return cache
