"""Draft trees in static-size padded arrays, and how the samplers (`gumbel.py`) grow them level by
level.

Shape letters (repo legend): B batch rows, M tree nodes (node 0 is the root: the last committed
token), W width of one level, V vocabulary, A depth (draft length L; a chain's γ), S cache slots.

Layout. Nodes are stored level by level: node 0, then the w_1 depth-1 nodes, then the w_2 depth-2
nodes, ... Level widths are static (fixed by the `TreeSpec`), so every shape is known at trace
time; a node that could not be drawn (a law with fewer non-zero tokens than requested children, a
beam that kept no child) is padding with `valid = False`. Among the children of one parent the
order is the order they were drawn in (decreasing perturbed log-probability for Gumbel-top-k and
stochastic beam search, chain index for i.i.d. chains), which is the order recursive rejection
sampling examines them in (`acceptance/tree.py`).

Layouts (`TreeSpec.layout`; the sibling-sampling scheme follows from the layout, the rule that
verifies it exactly is the spec's `rule`, and which paper method drafts it is the method registry's
business, `decoding.methods` / `drafters/standard.py`):
  chain      γ = depth draft tokens, one per level: chain speculative decoding (Leviathan et al.
             2023), verified on the chain rules' fast path.
  branching  constant branching b = (b_1..b_L): every node at depth d-1 gets b_d children, a
             Gumbel-top-b_d sample without replacement of its draft law (RSD-C, Jeon et al. 2024,
             §3.2).
  beam       stochastic beam search (Kool et al. 2019): beam width W, depth L; children are scored
             with truncated Gumbels and the top W of the whole level survive; parents that keep no
             child end early. At most W·L nodes (RSD-S, Jeon et al. 2024, §3.3).
  chains     K i.i.d. draft chains of length L from the root (SpecInfer's multi-draft proposal,
             verified with replacement, or SpecTr's with K-SEQ).
  dynamic    EAGLE-2's dynamic tree (`growth.py`, the `dyn` method): a pool of K children of each
             of the K best nodes per level, of which the M best of all levels are verified; its
             level widths differ per row (the proposal's parent and depth arrays say them).
At temperature 0 the samplers drop the noise: Gumbel-top-k becomes top-k, stochastic beam search
becomes beam search, and i.i.d. chains become K copies of the drafter's greedy chain.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.decoding import sampling as sampling_lib
# The samplers live in gumbel.py; trees.gumbel_top_k etc. stay importable from here.
from spec_jax.decoding.drafters.gumbel import (  # noqa: F401
    gumbel_top_k, perturbed_top_k, truncated_gumbel)

# Every layout and how it draws siblings (`protocols.SCHEMES`), which decides the rules that stay
# exact on it; the rule a spec asks for by default is the lossless one of its scheme.
LAYOUTS = {"chain": "chain", "branching": "without_replacement", "beam": "without_replacement",
           "chains": "iid", "dynamic": "without_replacement"}
SCHEME_RULES = {"chain": "speculative", "without_replacement": "rrs_without", "iid": "rrs_with"}

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """Static shape of a draft tree (a chain is the tree with one node per level).

  layout: one of LAYOUTS (module docstring).
  depth: L, draft tokens along a path (the tree's deepest level; a chain's γ).
  branching: "branching" only, b_1..b_L (a shorter tuple is padded with 1s up to `depth`).
  width: "beam" width W, the number of chains K for "chains", the expanded nodes per level K
    for "dynamic".
  kept: "dynamic" only, M: the draft nodes kept for the verifier (the root comes on top).
  stop: "chain" only, a confidence in (0, 1): a row stops drafting after a draft whose
    probability under the drafter's own softmax is below it, so a round drafts 1..γ tokens per
    row (`lm.draw_chain`), and the loop verifies only as many nodes as the longest live row
    drafted (`loop.py`). 0: always γ.
  rule: the rule that verifies it exactly under decode.rule="auto" (default: the lossless rule of
    its scheme, SCHEME_RULES); e.g. SpecTr's chains ask for "kseq".
  name: what `describe` calls it (the drafting method's name, e.g. "rsd_c"; default the layout).
  """
  layout: str
  depth: int
  branching: tuple[int, ...] = ()
  width: int = 1
  rule: str = ""
  name: str = ""
  kept: int = 0
  stop: float = 0.0

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(f"tree layout {self.layout!r} is unknown; choose one of {list(LAYOUTS)}.")
    if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
      raise ValueError(f"decode.gamma (draft tokens per round; a tree's depth L) must be an "
                       f"integer >= 1, got {self.depth!r}.")
    if self.layout == "branching":
      b = tuple(self.branching)
      if not b:
        raise ValueError("decode.branching is empty: RSD-C needs a branching vector b_1..b_L of "
                         "integers >= 1, e.g. (3, 2, 1).")
      if any(not isinstance(x, int) or x < 1 for x in b):
        raise ValueError(f"decode.branching={b} must hold integers >= 1 (children per node at "
                         "each depth).")
      if len(b) > self.depth:
        raise ValueError(f"decode.branching={b} has {len(b)} entries but the tree depth "
                         f"(decode.gamma) is {self.depth}; give at most one entry per depth.")
      object.__setattr__(self, "branching", b + (1,) * (self.depth - len(b)))
    elif self.layout == "chain":
      object.__setattr__(self, "width", 1)
    elif not isinstance(self.width, int) or self.width < 1:
      field = {"beam": "beam width W", "chains": "number of drafts K"}.get(
          self.layout, "expanded nodes per level K")
      raise ValueError(f"decode.width ({field}) must be an integer >= 1, got {self.width!r}.")
    if self.layout == "dynamic":
      pool = self.width + (self.depth - 1) * self.width ** 2
      kept = self.kept
      if isinstance(kept, bool) or not isinstance(kept, int) or not 1 <= kept <= pool:
        raise ValueError(
            f"eval.methods entry dyn:{self.width}-{self.kept}@{self.depth} keeps M={self.kept} "
            f"nodes, but K={self.width} over L={self.depth} levels drafts K + (L-1)*K*K = {pool}. "
            "Fix: 1 <= M <= that (e.g. M = K*L), or a larger K.")
    if self.stop:
      if self.layout != "chain":
        raise ValueError(f"a confidence stop ({self.stop}) drafts chains only, not the "
                         f"{self.layout} layout.")
      if isinstance(self.stop, bool) or not 0.0 < float(self.stop) < 1.0:
        raise ValueError(f"the drafting stop threshold must lie in (0, 1), got {self.stop!r}.")
    if not self.rule:
      object.__setattr__(self, "rule", SCHEME_RULES[self.scheme])
    if not self.name:
      object.__setattr__(self, "name", self.layout)

  @property
  def scheme(self) -> str:
    """How siblings are drawn (`protocols.SCHEMES`)."""
    return LAYOUTS[self.layout]

  @property
  def is_chain(self) -> bool:
    return self.layout == "chain"

  @property
  def is_dynamic(self) -> bool:
    """Its levels differ per row (`growth.py`): no static level widths, offsets or depths."""
    return self.layout == "dynamic"

  @property
  def level_widths(self) -> tuple[int, ...]:
    """w_1..w_L: nodes per level (root excluded)."""
    if self.is_dynamic:
      raise ValueError(f"{self.describe()} has per-row levels; `growth.grow` lays it out.")
    if self.layout == "branching":
      return tuple(math.prod(self.branching[:d + 1]) for d in range(self.depth))
    return (self.width,) * self.depth

  @property
  def level_offsets(self) -> tuple[int, ...]:
    """Index of the first node of each level 0..L (level 0 is the root, at 0)."""
    out = [0, 1]
    for w in self.level_widths[:-1]:
      out.append(out[-1] + w)
    return tuple(out)

  @property
  def num_nodes(self) -> int:
    """M: nodes including the root = the verifier's token budget per call."""
    if self.is_dynamic:
      return 1 + self.kept
    return 1 + sum(self.level_widths)

  @property
  def call_widths(self) -> tuple[int, ...]:
    """Tokens of each drafter call in a round, one call per level: the root's 1 (its catch-up
    window aside), then every level but the deepest (whose children are never drafted): w_1 ..
    w_{L-1}, a dynamic tree's frontiers of K nodes (`growth.grow`)."""
    widths = (self.width,) * self.depth if self.is_dynamic else self.level_widths
    return (1, *widths[:-1])

  @property
  def max_candidates(self) -> int:
    """Most children examined at one step of verification (one node's children, or for i.i.d.
    chains the children of every still-matching chain)."""
    if self.layout == "branching":
      return max(self.branching)
    if self.is_dynamic:  # a node keeps at most its K drafted children
      return min(self.width, self.kept)
    return self.width  # 1 for a chain

  def depths(self) -> tuple[int, ...]:
    """depth of every node (static)."""
    out = [0]
    for d, w in enumerate(self.level_widths):
      out += [d + 1] * w
    return tuple(out)

  def describe(self) -> str:
    if self.is_chain:
      return f"chain γ={self.depth}" + (f", stop below {self.stop:g}" if self.stop else "")
    if self.layout == "branching":
      return f"{self.name} b={'x'.join(map(str, self.branching))}"
    if self.is_dynamic:
      return f"{self.name} K={self.width} M={self.kept} L={self.depth}"
    return f"{self.name} {'W' if self.layout == 'beam' else 'K'}={self.width} L={self.depth}"


def chain(gamma: int, stop: float = 0.0) -> TreeSpec:
  """The shape of a γ-token chain (with `stop` > 0: of up to γ tokens, TreeSpec.stop)."""
  return TreeSpec("chain", depth=gamma, stop=stop)


@flax.struct.dataclass
class Tree:
  """A batch of draft trees (layout in the module docstring). All int32/bool [B, M]."""
  tokens: jax.Array   # token at each node; node 0 is the last committed token
  parent: jax.Array   # parent node index; -1 at the root
  depth: jax.Array    # 0 at the root
  valid: jax.Array    # False for padding nodes


@flax.struct.dataclass
class Level:
  """The newest level of a tree under construction (W = its width).

  parent: int32[B, W] node index of each node's parent;  tokens: int32[B, W];  valid: bool[B, W]
  logp:   f32[B, W]  path log-probability under the draft laws (stochastic beam search's φ)
  value:  f32[B, W]  perturbed path log-probability (SBS's G; the Gumbel value for RSD-C)
  """
  parent: jax.Array
  tokens: jax.Array
  valid: jax.Array
  logp: jax.Array
  value: jax.Array


def log_law(logits: jax.Array, q: jax.Array, sampling: sampling_lib.Sampling) -> jax.Array:
  """Scores children are ranked by: log q when sampling; the drafter's log-softmax at T = 0,
  where q is one-hot and ranking needs the logits themselves (top-k / beam search)."""
  if sampling.greedy:
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.where(q > 0, jnp.log(jnp.maximum(q, 1e-38)), NEG_INF)


def expand(spec: TreeSpec, level: int, rng: jax.Array, logits: jax.Array, q: jax.Array,
           prev: Level, prev_offset: int, sampling: sampling_lib.Sampling) -> Level:
  """Grow level `level` (1-based) from the previous one.

  logits, q f32[B, w_prev, V]: the drafter's logits and exact draft law at each node of the
  previous level (level 0 is the root, w_prev = 1); prev: that level; prev_offset: the node index
  of its first node. Returns the new level (its parents as absolute node indices)."""
  b, w_prev, v = q.shape
  logq = log_law(logits, q, sampling)
  noise = not sampling.greedy
  if spec.layout == "branching":
    k = spec.branching[level - 1]
    if noise:
      tokens, values = gumbel_top_k(rng, logq, k)                     # [B, w_prev, k]
    else:
      values, tokens = jax.lax.top_k(logq, k)
    local = jnp.broadcast_to(jnp.arange(w_prev)[:, None], (b, w_prev, k))
    flat = lambda x: x.reshape(b, w_prev * k)  # noqa: E731
    tokens, values, local = flat(tokens), flat(values), flat(local)
    step_logp = flat(jnp.take_along_axis(logq, tokens.reshape(b, w_prev, k), axis=-1))
  elif spec.layout == "beam":
    w = spec.width
    if w > w_prev * v:
      raise ValueError(f"decode.width={w} exceeds the {w_prev * v} candidates of a level.")
    cand_logp = jnp.where(prev.valid[..., None], prev.logp[..., None] + logq, NEG_INF)  # φ
    if noise:  # the top W of the whole level, each parent's children capped at its value
      local, tokens, values = perturbed_top_k(
          rng, cand_logp, w, jnp.where(prev.valid, prev.value, NEG_INF))
    else:      # plain beam search
      values, idx = jax.lax.top_k(cand_logp.reshape(b, w_prev * v), w)
      local, tokens = idx // v, (idx % v).astype(jnp.int32)
    step_logp = jnp.take_along_axis(logq.reshape(b, w_prev * v), local * v + tokens, axis=1)
  else:  # i.i.d. chains: K draws from the root, then one draw per chain and level
    k = spec.width
    if level == 1:
      local = jnp.zeros((b, k), jnp.int32)
    else:
      local = jnp.broadcast_to(jnp.arange(k)[None], (b, k))
    rows_logq = jnp.take_along_axis(logq, local[..., None], axis=1)     # [B, K, V]
    if noise:
      tokens = sampling_lib.sample(rng, jnp.take_along_axis(q, local[..., None], axis=1))
    else:
      tokens = jnp.argmax(rows_logq, axis=-1).astype(jnp.int32)
    step_logp = jnp.take_along_axis(rows_logq, tokens[..., None], axis=-1)[..., 0]
    values = step_logp
  local = local.astype(jnp.int32)
  parent_valid = jnp.take_along_axis(prev.valid, local, axis=1)
  valid = parent_valid & jnp.isfinite(values) & jnp.isfinite(step_logp)
  logp = jnp.take_along_axis(prev.logp, local, axis=1) + step_logp
  return Level(parent=local + prev_offset, tokens=tokens.astype(jnp.int32), valid=valid,
               logp=jnp.where(valid, logp, NEG_INF), value=jnp.where(valid, values, NEG_INF))


def root_level(root_tokens: jax.Array) -> Level:
  """Level 0: the root (the last committed token) of each row; root_tokens int32[B]."""
  b = root_tokens.shape[0]
  return Level(parent=jnp.full((b, 1), -1, jnp.int32), tokens=root_tokens[:, None].astype(jnp.int32),
               valid=jnp.ones((b, 1), bool), logp=jnp.zeros((b, 1), jnp.float32),
               value=jnp.zeros((b, 1), jnp.float32))


def assemble(spec: TreeSpec, levels: Sequence[Level]) -> Tree:
  """Concatenate levels 0..L into a Tree."""
  cat = lambda name: jnp.concatenate([getattr(l, name) for l in levels], axis=1)  # noqa: E731
  b = levels[0].tokens.shape[0]
  depth = jnp.broadcast_to(jnp.asarray(spec.depths(), jnp.int32)[None], (b, spec.num_nodes))
  return Tree(tokens=cat("tokens"), parent=cat("parent"), depth=depth, valid=cat("valid"))


def ancestor_rows(parent_rows: jax.Array, parents: jax.Array, own: jax.Array, m: int) -> jax.Array:
  """Ancestor-or-self sets of new nodes from their parents' sets.

  parent_rows bool[B, w_prev, M]: ancestor-or-self rows of the previous level;
  parents int32[B, W] (index into the previous level, local), own int32[B, W] the new nodes'
  absolute indices. Returns bool[B, W, M]."""
  rows = jnp.take_along_axis(parent_rows, parents[..., None], axis=1)
  return rows | jax.nn.one_hot(own, m, dtype=bool)


def ancestor_matrix(parent: jax.Array, max_depth: int) -> jax.Array:
  """bool[B, M, M]: anc[b, i, j] iff node j is node i or one of its ancestors; parent int32[B, M]
  (-1 at the root), max_depth static (A pointer jumps)."""
  b, m = parent.shape
  ptr = jnp.broadcast_to(jnp.arange(m)[None], (b, m))
  anc = jax.nn.one_hot(ptr, m, dtype=bool)
  for _ in range(max_depth):
    ptr = jnp.where(ptr >= 0, jnp.take_along_axis(parent, jnp.maximum(ptr, 0), axis=1), -1)
    anc = anc | jax.nn.one_hot(ptr, m, dtype=bool)  # one_hot(-1) is all False
  return anc


def tree_mask(anc_rows: jax.Array, base: jax.Array, size: int) -> jax.Array:
  """Attention mask bool[B, T, S] for T tree nodes whose ancestor-or-self rows are
  anc_rows bool[B, T, M], when node j sits at cache slot base[b] + j (the root at base = L - 1).
  A node sees the committed prefix (slots < base) and its own ancestors (and itself)."""
  m = anc_rows.shape[-1]
  slots = jnp.arange(size)[None, :]
  rel = slots - base[:, None]                                            # [B, S]
  in_tree = (rel >= 0) & (rel < m)
  tree_part = jnp.take_along_axis(anc_rows, jnp.clip(rel, 0, m - 1)[:, None, :].repeat(
      anc_rows.shape[1], axis=1), axis=2)
  return (slots < base[:, None])[:, None, :] | (in_tree[:, None, :] & tree_part)


def move_path(cache, lengths: jax.Array, path: jax.Array, num_accepted: jax.Array):
  """Gather the accepted path's K/V into place after a tree round. Node path[b, d] sat at slot
  L_b − 1 + path[b, d]; it moves to slot L_b + d for d < n_b. cache: any pytree-dataclass with
  k, v [L, B, S, K, H] (a Llama-family KV cache); lengths int32[B] before the round;
  path int32[B, A]. The gather reads every source before the scatter writes (functional update),
  and path[d] ≥ d + 1 by the level layout, so no source is clobbered either way."""
  b, depth = path.shape
  size = cache.k.shape[2]
  rows = jnp.arange(b)[:, None]
  last = (lengths - 1)[:, None]
  src = jnp.clip(last + path, 0, size - 1)
  d = jnp.arange(depth)[None]
  dst = jnp.where(d < num_accepted[:, None], last + 1 + d, size)        # size = dropped write
  cache = cache.replace(k=cache.k.at[:, rows, dst].set(cache.k[:, rows, src], mode="drop"),
                        v=cache.v.at[:, rows, dst].set(cache.v[:, rows, src], mode="drop"))
  if getattr(cache, "pos", None) is not None:  # sliding-window models: slot = position again
    cache = cache.replace(pos=cache.pos.at[rows, dst].set(dst, mode="drop"))
  return cache
