"""Tree acceptance rules: which path of a draft tree the verifier keeps, and the token it adds.

Shape letters (repo legend): B batch rows (independent), M tree nodes (node 0 = root),
V vocabulary, A = max_depth (deepest level), C = max_candidates (most candidates examined at one
step).

Tree layout (`drafters/trees.py` builds it, `protocols.Proposal` carries it): per row, nodes
level by level; among the children of one parent, the order they were drawn in. Per node i:
  tokens  int32[B, M]   token at node i (node 0: the last committed token)
  parent  int32[B, M]   parent index, -1 at the root
  depth   int32[B, M]   0 at the root, parent's depth + 1 below
  valid   bool[B, M]    False for padding; a valid node has a valid parent
  p       f32[B, M, V]  verifier law of the token FOLLOWING node i's path (after temperature/
                        top-k/top-p; one-hot at T = 0)
  q       f32[B, M, V]  exact law node i's children were drawn from (unused at leaves)

Verification walks down from the root keeping an *active set* of nodes that all carry the
accepted token path so far (initially {0}). At each step the candidates are the valid children
of every active node, in node-index order, and p, q are read at the first active node. For
trees whose siblings are distinct (RSD) one node is active; for K i.i.d. chains (SpecInfer,
SpecTr), laid out as K separate branches, two chains may share a prefix, so several nodes can be
active, and the candidates at the next step are the next tokens of all chains still matching:
i.i.d. draws from q, as the with-replacement rules need. After token y is accepted, the active
set becomes the candidates carrying y. A step that accepts nothing (or has no candidates) ends
the walk with a correction (or bonus) token drawn from the step's final residual law; after A
accepted tokens the bonus is drawn from p at the active node.

All arithmetic is float32 on the laws as given; rules are pure, jittable, static-shaped, vmapped
over B. Randomness: one uniform per (row, depth, candidate slot) and one categorical per row, so
a row's result depends only on its own inputs and position in the batch.
"""

from __future__ import annotations


import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding.acceptance.chain import positive_int
from spec_jax.decoding.acceptance.kseq import kseq_residual, kseq_rho
from spec_jax.decoding.acceptance.residuals import MIN_RESIDUAL_MASS
from spec_jax.decoding.protocols import Verdict
from spec_jax.decoding.sampling import sample, uniform

TREE_RULES = ("rrs_without", "rrs_with", "kseq", "greedy")

# ---------------------------------------------------------------------------------------------
# The walk.

@flax.struct.dataclass
class _Walk:
  """The state of one row's walk (t5x-style named loop state). A = max_depth."""
  depth: jax.Array      # int32[]: steps taken; the next step examines depth + 1
  active: jax.Array     # bool[M]: nodes carrying the accepted token path (never empty)
  live: jax.Array       # bool[]: every step so far accepted a candidate
  accepted: jax.Array   # int32[]: n, tokens accepted
  stop_c: jax.Array     # f32[]: the stop step's residual scale c (recursive rules)
  stop_k: jax.Array     # int32[]: the stop step's candidate count k (K-SEQ)
  stop_rho: jax.Array   # f32[]: the stop step's ρ (K-SEQ)
  last: jax.Array       # int32[]: node of the last accepted candidate (0: none yet)
  reached: jax.Array    # bool[A]
  alpha: jax.Array      # f32[A]
  num_candidates: jax.Array  # int32[A]


def _verify_row(p, q, tokens, parent, depth, valid, u, *, rule, max_depth, max_candidates,
                kseq_rho_override):
  """One row: p, q f32[M, V] (q may be None for greedy), tokens/parent/depth/valid [M],
  u f32[A, C]. Returns (n, law f32[V] (unnormalised; for greedy the law whose argmax is next),
  path int32[A], reached bool[A], alpha f32[A], num_candidates int32[A]).

  Recursive rejection sampling runs in scalar form. After j rejections at one step,
      r_j = max(0, p − c_j q) / Z_j,    Z_j = Σ_x max(0, p(x) − c_j q(x)),    c_0 = 0,
  and r_{j+1} = norm(max(0, r_j − s_j)) gives c_{j+1} = c_j + Z_j / W_j, where s_j = q on the
  tokens not yet removed, over their mass W_j (W_j = 1 with replacement). Tokens removed
  without replacement fit the same formula: x was rejected only if r_j(x) < s_j(x), so its
  residual is 0 from then on, as max(0, p(x) − c q(x)) stays for every larger c. A candidate
  then costs one read-only pass over V for Z (and, without replacement, an O(1) update of the
  remaining draft mass plus its sum) instead of rewriting and renormalising r and s.
  """
  m, v = p.shape
  big_d, c_max = max_depth, max_candidates
  safe_parent = jnp.maximum(parent, 0)
  recursive = rule in ("rrs_without", "rrs_with")
  without = rule == "rrs_without"

  def step(w: _Walk) -> _Walk:
    d, active = w.depth, w.active
    head = jnp.argmax(active)                   # first active node (the set is never empty)
    p_h = p[head]
    q_h = None if q is None else q[head]
    # Children of any active node. The depth test is redundant for a well-formed tree; it keeps
    # a malformed one from being walked out of order.
    cand_mask = valid & (parent >= 0) & active[safe_parent] & (depth == d + 1)
    cand = jnp.nonzero(cand_mask, size=c_max, fill_value=m)[0]
    in_slot = cand < m
    x_c = jnp.where(in_slot, tokens[jnp.minimum(cand, m - 1)], 0)
    rho = jnp.float32(1.0)
    c = jnp.float32(0.0)
    if rule == "greedy":
      y = jnp.argmax(p_h).astype(jnp.int32)
      match = in_slot & (x_c == y)
      acc = jnp.any(match)
      k = jnp.sum(in_slot)
      slot = jnp.argmax(match)                  # the first candidate carrying y
    else:
      # A candidate the drafter law gives zero probability cannot have been drawn from it
      # (padding from an exhausted support); every sampling rule skips it, so the rule is the
      # same rule run on the other candidates and stays exact.
      drawable = in_slot & (q_h[x_c] > 0)
      k = jnp.sum(drawable)
      # Slots after the last drawable candidate are left alone (none at all: no slot is tried).
      last_slot = jnp.where(k > 0, c_max - jnp.argmax(drawable[::-1]), 0)
      if rule == "kseq":
        rho = (kseq_rho(p_h, q_h, k) if kseq_rho_override is None
               else jnp.float32(kseq_rho_override))

      def try_candidate(inner):
        j, c, z, w_mass, s_mass, acc, y = inner
        x = x_c[j]
        if rule == "kseq":
          # Accept with min(1, p(x) / (ρ q(x))), in order; p and q stay fixed (Alg. K-SEQ).
          take = drawable[j] & (u[d, j] * rho * q_h[x] < p_h[x])
          return j + 1, c, z, w_mass, s_mass, take, jnp.where(take, x, y)
        # Accept with min(1, r(x)/s(x)): u · s(x) < r(x) with r(x) = max(0, p − c q)(x) / Z and
        # s(x) = S(x)/W, where S is q with the removed tokens zeroed (a duplicate of a rejected
        # token has S(x) = 0 and is skipped).
        s_x = s_mass[x] if without else q_h[x]
        ok = drawable[j] & (s_x > 0)
        take = ok & (u[d, j] * s_x * z < jnp.maximum(0.0, p_h[x] - c * q_h[x]) * w_mass)
        reject = ok & ~take
        # r ← norm(max(0, r − s)) (SpecInfer Alg. 2; RSD Alg. 3), s ← s(· | · ≠ x) without
        # replacement. A residual below MIN_RESIDUAL_MASS is rounding noise (r ≈ s): keep r.
        c_new = c + z / w_mass
        z_new = jnp.sum(jnp.maximum(0.0, p_h - c_new * q_h))
        moved = reject & (z_new > MIN_RESIDUAL_MASS)
        c, z = jnp.where(moved, c_new, c), jnp.where(moved, z_new, z)
        if without:
          s_mass = s_mass.at[x].set(jnp.where(reject, 0.0, s_x))
          # The remaining mass is summed again (not W − S(x)), so it stays exact when the
          # rejected tokens held nearly all of it. Nothing left: later candidates are skipped.
          w_mass = jnp.where(reject, jnp.sum(s_mass), w_mass)
        return j + 1, c, z, w_mass, s_mass, take, jnp.where(take, x, y)

      one = jnp.float32(1.0)
      init = (jnp.int32(0), jnp.float32(0.0), one, one, q_h if without else one,
              jnp.bool_(False), jnp.int32(0))
      # Stop at the first acceptance or after the last real candidate (under vmap: once every
      # row has), so a typical step costs a candidate or two, not C.
      j_end, c, _, _, _, acc, y = jax.lax.while_loop(
          lambda inner: (inner[0] < last_slot) & ~inner[5], try_candidate, init)
      slot = j_end - 1                          # the loop stops right after an acceptance

    tried = k > 0
    alpha = w.alpha
    if q is not None:
      alpha = alpha.at[d].set(jnp.where(tried, jnp.sum(jnp.minimum(p_h, q_h)), 0.0))
    # On a stop the active set is left as it is, so its first node is where the walk ended;
    # remember what the final law needs (the residual's c, or K-SEQ's k and ρ) and compute it
    # once, after.
    node = cand[jnp.clip(slot, 0, c_max - 1)]
    return _Walk(depth=d + 1, active=jnp.where(acc, cand_mask & (tokens == y), active),
                 live=acc, accepted=w.accepted + acc.astype(jnp.int32),
                 last=jnp.where(acc, node, w.last),
                 stop_c=jnp.where(acc, w.stop_c, c), stop_k=jnp.where(acc, w.stop_k, k),
                 stop_rho=jnp.where(acc, w.stop_rho, rho), reached=w.reached.at[d].set(tried),
                 alpha=alpha, num_candidates=w.num_candidates.at[d].set(k.astype(jnp.int32)))

  init = _Walk(depth=jnp.int32(0), active=jnp.arange(m) == 0, live=jnp.bool_(True),
               accepted=jnp.int32(0), stop_c=jnp.float32(0.0), stop_k=jnp.int32(0),
               stop_rho=jnp.float32(1.0), last=jnp.int32(0),
               reached=jnp.zeros((big_d,), bool),
               alpha=jnp.zeros((big_d,), jnp.float32),
               num_candidates=jnp.zeros((big_d,), jnp.int32))
  # Depth by depth until a step stops the walk or A tokens are accepted (under vmap: until
  # every row has stopped). Rows that stopped early keep zeros in the per-depth stats.
  w = jax.lax.while_loop(lambda w: (w.depth < big_d) & w.live, step, init)
  n, live, stop_c, stop_k, stop_rho = w.accepted, w.live, w.stop_c, w.stop_k, w.stop_rho
  # The walk read p and q at the first active node; every active node carries the same tokens.
  last = jnp.argmax(w.active).astype(jnp.int32)
  p_last = p[last]
  # All A accepted (live): the bonus comes from p at depth A. Otherwise the stop step's final
  # law: the recursive residual max(0, p − c q) (c = 0: p itself when there was no candidate),
  # K-SEQ's residual, or greedy's p.
  if recursive:
    law = jnp.where(live, p_last, jnp.maximum(0.0, p_last - stop_c * q[last]))
  elif rule == "kseq":
    law = jnp.where(live, p_last, kseq_residual(p_last, q[last], stop_rho, stop_k))
  else:
    law = p_last

  # Path = the last accepted candidate and its ancestors: one concrete chain of the tree. With
  # i.i.d. chains sharing a prefix, the ancestors carry the accepted tokens but need not be the
  # candidates accepted at their depths (those may sit on other chains with the same prefix).
  path = jnp.zeros((big_d,), jnp.int32)
  cur = w.last
  for d in reversed(range(big_d)):  # static A
    on_path = d < n
    path = path.at[d].set(jnp.where(on_path, cur, 0))
    cur = jnp.where(on_path, safe_parent[cur], cur)
  return n, law, path, w.reached, w.alpha, w.num_candidates


def _check_inputs(p, q, tokens, parent, depth, valid, rule, max_depth, max_candidates):
  """Static checks (shapes, rule, sizes); ValueError naming the problem and the fix."""
  if rule not in TREE_RULES:
    raise ValueError(f"decode.rule={rule!r} is not a tree acceptance rule; choose one of "
                     f"{TREE_RULES}.")
  for name, value in (("max_depth", max_depth), ("max_candidates", max_candidates)):
    positive_int(value, f"verify_tree: {name}")
  if p.ndim != 3:
    raise ValueError(f"verify_tree: p must be f32[B, M, V] (verifier law per node), got "
                     f"shape {p.shape}.")
  if q is None:
    if rule != "greedy":
      raise ValueError(f"rule {rule!r} needs q, the exact draft law at every node (docs/design.md §6); "
                       "only 'greedy' may run with q=None.")
  elif q.shape != p.shape:
    if q.ndim == 3 and q.shape[:2] == p.shape[:2]:
      # docs/design.md §6: a drafter/verifier vocabulary mismatch must fail loudly or be mapped.
      raise ValueError(f"Verifier vocabulary {p.shape[2]} != drafter vocabulary {q.shape[2]}; "
                       "map draft ids and q into the verifier vocabulary first.")
    raise ValueError(f"verify_tree: q{q.shape} must have p's shape {p.shape} ([B, M, V]).")
  b, m = p.shape[:2]
  for name, x in (("tokens", tokens), ("parent", parent), ("depth", depth), ("valid", valid)):
    if x.shape != (b, m):
      raise ValueError(f"verify_tree: {name}{x.shape} must be [B, M] = {(b, m)} to match p.")
  if m < 2:
    raise ValueError(f"verify_tree: the tree has M={m} node(s); it needs the root and at least "
                     "one draft node.")
  if max_candidates > m - 1:
    raise ValueError(f"verify_tree: max_candidates={max_candidates} exceeds the {m - 1} draft "
                     "nodes of the tree.")


def verify_tree(p: jax.Array, q: jax.Array | None, tokens: jax.Array, parent: jax.Array,
                depth: jax.Array, valid: jax.Array, rng: jax.Array, *, rule: str,
                max_depth: int, max_candidates: int) -> Verdict:
  """Verify one draft tree per row (layout in the module docstring).

  Rules (each step examines the candidates x_1..x_k in order, with r = p, s = q at the first
  active node; "all rejected" includes k = 0, and then the next token is drawn from the final r):
    rrs_without  recursive rejection sampling without replacement (RSD, Jeon et al. 2024,
                 Alg. 3), for siblings drawn without replacement from q (Gumbel-top-k, SBS):
                 accept x_j w.p. min(1, r(x_j)/s(x_j)); on rejection r ← norm(max(0, r − s)),
                 s ← norm(s with s(x_j) = 0).
    rrs_with     the same with replacement (SpecInfer, Miao et al. 2024, Alg. 2), for i.i.d.
                 candidates: s stays q, r ← norm(max(0, r − q)).
    kseq         SpecTr K-SEQ (Sun et al. 2023), for i.i.d. candidates: ρ = `kseq_rho`
                 (bisection), accept x_j w.p. min(1, p(x_j) / (ρ q(x_j))), else draw from
                 `kseq_residual`.
    greedy       accept the candidate equal to argmax p (ties → lowest id); next token is
                 argmax p at the node where the walk stops. q and rng are unused (q may be None).
                 The output equals the verifier's greedy continuation.
  With the matching tree sampler, every sampling rule emits tokens whose law is exactly the
  verifier's (p, step by step). Siblings drawn without replacement but verified with rrs_with,
  or K-SEQ with ρ = 1, are not exact (the tests show it). I.i.d. candidates verified with
  rrs_without stay exact (a duplicate of a rejected token has s(x) = 0 and is skipped, and a
  non-duplicate i.i.d. draw is distributed exactly as s) but waste the duplicates, so they
  accept less than rrs_with. A candidate with q(x) = 0 is skipped by every sampling rule.

  p, q f32[B, M, V]; tokens, parent, depth int32[B, M]; valid bool[B, M]; rng a PRNG key.
  rule, max_depth (A: at most A tokens are accepted) and max_candidates (C: the most candidates
  at one step; extra ones are ignored, so pass `TreeSpec.max_candidates`) are static.
  Returns a `protocols.Verdict` (accept_prob None).
  """
  return _verify_tree(p, q, tokens, parent, depth, valid, rng, rule=rule, max_depth=max_depth,
                      max_candidates=max_candidates)


def _verify_tree(p, q, tokens, parent, depth, valid, rng, *, rule, max_depth, max_candidates,
                 kseq_rho_override=None) -> Verdict:
  """`verify_tree` with a test knob: kseq_rho_override fixes K-SEQ's ρ (ρ = 1 is the planted
  bug docs/design.md §6 names: it over-accepts and leaves a residual that would need negative mass)."""
  _check_inputs(p, q, tokens, parent, depth, valid, rule, max_depth, max_candidates)
  max_depth, max_candidates = int(max_depth), int(max_candidates)
  b = p.shape[0]
  rng_accept, rng_next = jax.random.split(rng)
  u = uniform(rng_accept, (b, max_depth, max_candidates))

  def row(p_, q_, tokens_, parent_, depth_, valid_, u_):
    return _verify_row(p_, q_, tokens_, parent_, depth_, valid_, u_, rule=rule,
                       max_depth=max_depth, max_candidates=max_candidates,
                       kseq_rho_override=kseq_rho_override)

  args = (p.astype(jnp.float32), None if q is None else q.astype(jnp.float32),
          tokens.astype(jnp.int32), parent.astype(jnp.int32), depth.astype(jnp.int32),
          valid.astype(bool), u)
  in_axes = (0, None if q is None else 0, 0, 0, 0, 0, 0)
  n, law, path, reached, alpha, num_cand = jax.vmap(row, in_axes=in_axes)(*args)
  if rule == "greedy":
    next_token = jnp.argmax(law, axis=-1).astype(jnp.int32)
  else:
    next_token = sample(rng_next, law)
  return Verdict(num_accepted=n, next_token=next_token, path=path, reached=reached,
                     alpha=alpha, num_candidates=num_cand)


# ---------------------------------------------------------------------------------------------
# Host-side structure check (tests and debugging of tree builders; never inside jit).

def check_tree(tokens, parent, depth, valid, *, max_depth: int, max_candidates: int) -> None:
  """Raise ValueError naming the first row/node that breaks the layout `verify_tree` assumes:
  root at node 0 (parent -1, depth 0, valid), parents earlier in the order and valid, depth =
  parent's depth + 1 ≤ max_depth, levels in order, and at most max_candidates candidates at any
  step (children of all nodes sharing one token path, which is what the walk examines)."""
  tokens, parent, depth, valid = (np.asarray(x) for x in (tokens, parent, depth, valid))
  for b in range(tokens.shape[0]):
    if parent[b, 0] != -1 or depth[b, 0] != 0 or not valid[b, 0]:
      raise ValueError(f"row {b}: node 0 must be the root (parent -1, depth 0, valid).")
    paths = {0: ()}
    groups: dict[tuple, int] = {}
    for i in range(1, tokens.shape[1]):
      if not valid[b, i]:
        continue
      a = int(parent[b, i])
      if not 0 <= a < i or not valid[b, a]:
        raise ValueError(f"row {b}, node {i}: parent {a} must be a valid node before it.")
      if depth[b, i] != depth[b, a] + 1 or depth[b, i] > max_depth:
        raise ValueError(f"row {b}, node {i}: depth {depth[b, i]} must be parent's depth + 1 "
                         f"and <= max_depth={max_depth}.")
      if depth[b, i] < depth[b, i - 1] and valid[b, i - 1]:
        raise ValueError(f"row {b}, node {i}: nodes must be laid out level by level.")
      paths[i] = paths[a] + (int(tokens[b, i]),)
      groups[paths[a]] = groups.get(paths[a], 0) + 1
      if groups[paths[a]] > max_candidates:
        raise ValueError(f"row {b}: more than max_candidates={max_candidates} candidates follow "
                         f"the token path {paths[a]}; raise max_candidates.")
