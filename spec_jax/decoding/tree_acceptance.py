"""Tree acceptance rules: which path of a draft tree the verifier keeps, and the token it adds.

Shape legend: B batch rows (independent), M tree nodes (node 0 = root), V vocabulary,
D = max_depth (deepest level), C = max_candidates (most candidates examined at one step).

Tree layout (`trees.py` builds it): per row, nodes level by level; among the children of one
parent, the order they were drawn in. Per node i:
  tokens  int32[B, M]   token at node i (node 0: the last committed token)
  parent  int32[B, M]   parent index, -1 at the root
  depth   int32[B, M]   0 at the root, parent's depth + 1 below
  valid   bool[B, M]    False for padding; a valid node has a valid parent
  p       f32[B, M, V]  verifier law of the token FOLLOWING node i's path (after temperature/
                        top-k/top-p; one-hot at T = 0)
  q       f32[B, M, V]  exact law node i's children were drawn from (unused at leaves)

Verification walks down from the root keeping an *active set* A of nodes that all carry the
accepted token path so far (initially {0}). At each step the candidates are the valid children
of every node in A, in node-index order, and p, q are read at the first node of A. For trees
whose siblings are distinct (RSD) |A| = 1; for K i.i.d. chains (SpecInfer, SpecTr), laid out as K
separate branches, two chains may share a prefix, so A can hold several nodes, and the candidates
at the next step are the next tokens of all chains still matching: i.i.d. draws from q, as the
with-replacement rules need. After token y is accepted, A ← {candidates carrying y}. A step that
accepts nothing (or has no candidates) ends the walk with a correction (or bonus) token drawn
from the step's final residual law; after D accepted tokens the bonus is drawn from p at A.

All arithmetic is float32 on the laws as given; rules are pure, jittable, static-shaped, vmapped
over B. Randomness: one uniform per (row, depth, candidate slot) and one categorical per row, so
a row's result depends only on its own inputs and position in the batch.
"""

from __future__ import annotations


import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding.acceptance import _MIN_RESIDUAL_MASS, positive_int
from spec_jax.decoding.sampling import sample

RULES = ("rrs_without", "rrs_with", "kseq", "greedy")

# Bisection steps for SpecTr's ρ on [1, k]: 24 halvings reach float32 resolution for k ≤ 8.
# Any ρ the bisection returns is on the feasible side, so the emitted law stays exactly p; the
# remaining gap δ ≤ (k − 1)/2^24 to ρ* only costs acceptance, at most k·δ < 4e-6 for k ≤ 8.
_KSEQ_BISECTION_STEPS = 24


@flax.struct.dataclass
class TreeVerdict:
  """Result of verifying one draft tree per row.

  num_accepted    int32[B] in [0, D]: accepted draft tokens n (a round emits n + 1).
  next_token      int32[B]: the correction (after a rejection) or bonus (at a leaf / depth D).
  path            int32[B, D]: path[b, d] for d < n is the accepted node at depth d + 1; the
                  nodes form one root-to-node chain of the tree (the ancestors of the deepest
                  accepted node), so their K/V can be gathered as they are. 0 for d >= n.
  reached         bool[B, D]: the walk got to depth d + 1 and found a candidate there (so a
                  token at that depth was accepted or rejected). Per-depth acceptance rate =
                  (n > d) / reached.
  alpha           f32[B, D]: Σ_x min(p, q) at the step's active node, the glossary's acceptance
                  rate α of one draw (DESIGN §3); 0 where not reached (and for greedy with q=None).
  num_candidates  int32[B, D]: candidates at depth d + 1: valid children of the active set that
                  the draft law could have drawn (all valid children for greedy); the walk
                  examines them in order until one is accepted. 0 where the walk did not get there.
  """
  num_accepted: jax.Array
  next_token: jax.Array
  path: jax.Array
  reached: jax.Array
  alpha: jax.Array
  num_candidates: jax.Array


# ---------------------------------------------------------------------------------------------
# One step of each rule on [..., V] laws: the reference forms, for tests and analysis. The walk
# below runs recursive rejection in an equivalent scalar form (see `_verify_row`).

def _normalize_or(x: jax.Array, fallback: jax.Array, floor: float) -> jax.Array:
  """x / Σx, or `fallback` where Σx ≤ floor."""
  mass = jnp.sum(x, axis=-1, keepdims=True)
  return jnp.where(mass > floor, x / jnp.where(mass > floor, mass, 1.0), fallback)


def residual_update(r: jax.Array, s: jax.Array) -> jax.Array:
  """r' = norm(max(0, r − s)): the verifier's law left after a candidate drawn from s was
  rejected (Leviathan et al. 2023, Alg. 1; applied recursively by SpecInfer and RSD). A residual
  with mass ≤ _MIN_RESIDUAL_MASS is rounding noise (r ≈ s, so rejection itself had probability
  below that floor); it falls back to r, as the chain rule falls back to p_n."""
  r = r.astype(jnp.float32)
  return _normalize_or(jnp.maximum(0.0, r - s.astype(jnp.float32)), r, _MIN_RESIDUAL_MASS)


def remove_token(s: jax.Array, x: jax.Array) -> jax.Array:
  """s(· | · ≠ x) = s with s(x) set to 0, renormalised: the law of the next sibling drawn
  without replacement (RSD, Jeon et al. 2024, Alg. 3). All zeros once s has no mass left, which
  makes every later candidate unreachable (skipped)."""
  s = jnp.where(jnp.arange(s.shape[-1]) == jnp.asarray(x)[..., None], 0.0, s.astype(jnp.float32))
  return _normalize_or(s, jnp.zeros_like(s), 0.0)


def _kseq_beta(p, q, rho):
  """β_{p,q}(ρ) = Σ_x min(q(x), p(x)/ρ): probability that one K-SEQ trial accepts."""
  return jnp.sum(jnp.minimum(q, p / rho[..., None]), axis=-1)


def _kseq_trials_factor(beta, k):
  """(1 − (1 − β)^k) / β = Σ_{i<k} (1 − β)^i, the expected number of trials made; k at β = 0."""
  miss = jnp.clip(1.0 - beta, 0.0, 1.0)
  safe = jnp.where(beta > 0, beta, 1.0)
  return jnp.where(beta > 0, (1.0 - jnp.power(miss, k)) / safe, k)


def kseq_rho(p: jax.Array, q: jax.Array, k: jax.Array,
             steps: int = _KSEQ_BISECTION_STEPS) -> jax.Array:
  """SpecTr's ρ for k i.i.d. candidates (Sun et al. 2023, §4, Alg. K-SEQ): the smallest
  ρ ∈ [1, k] with
      1 − (1 − β(ρ))^k ≤ ρ · β(ρ),        β(ρ) = Σ_x min(q(x), p(x)/ρ),
  the condition that makes the K-SEQ residual non-negative (see `kseq_residual`). The paper takes
  ρ* solving it with equality and finds it by bisection. The left side minus the right side is
  non-increasing in ρ (d(ρβ)/dρ = Σ_{ρq<p} q ≥ 0 and β decreases), it holds at ρ = k (Bernoulli:
  1 − (1−β)^k ≤ kβ) and ρβ(ρ) ≤ 1 − (1−β)^k at ρ = 1, so bisection brackets ρ*. Smaller ρ means a
  larger β and acceptance probability 1 − (1 − β)^k.

  p, q f32[..., V]; k [...] candidates (int or float). Returns f32[...] (1 where ρ = 1 is already
  feasible: k ≤ 1, p = q, or disjoint supports). The returned ρ is always on the feasible side.
  """
  p = p.astype(jnp.float32)
  q = q.astype(jnp.float32)
  k = jnp.asarray(k, jnp.float32)

  def feasible(rho):
    beta = _kseq_beta(p, q, rho)
    return 1.0 - jnp.power(jnp.clip(1.0 - beta, 0.0, 1.0), k) <= rho * beta

  def halve(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    ok = feasible(mid)
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  one = jnp.ones_like(k)
  _, hi = jax.lax.fori_loop(0, steps, halve, (one, jnp.maximum(k, 1.0)))
  return jnp.where(feasible(one), one, hi)


def kseq_residual(p: jax.Array, q: jax.Array, rho: jax.Array, k: jax.Array) -> jax.Array:
  """The law K-SEQ draws from when all k candidates were rejected (Sun et al. 2023, Alg. K-SEQ):
      p_res(x) = [p(x) − min(q(x), p(x)/ρ) · (1 − (1−β)^k)/β] / (1 − β)^k,   β = β_{p,q}(ρ).
  Candidate i (tried after i − 1 rejections, each with probability 1 − β) emits x with probability
  min(q(x), p(x)/ρ), so the accept branch emits min(q, p/ρ) · Σ_{i<k} (1−β)^i in all and the
  residual supplies the rest of p. We normalise by the sum instead of dividing by (1 − β)^k (the
  same number when ρ is feasible) and fall back to p when nothing is left. k = 0 gives p.
  p, q f32[..., V]; rho, k [...]. Returns f32[..., V]."""
  p = p.astype(jnp.float32)
  q = q.astype(jnp.float32)
  rho = jnp.asarray(rho, jnp.float32)
  k = jnp.asarray(k, jnp.float32)
  m = jnp.minimum(q, p / rho[..., None])
  trials = _kseq_trials_factor(jnp.sum(m, axis=-1), k)
  return _normalize_or(jnp.maximum(0.0, p - m * trials[..., None]), p, _MIN_RESIDUAL_MASS)


# ---------------------------------------------------------------------------------------------
# The walk.

def _verify_row(p, q, tokens, parent, depth, valid, u, *, rule, max_depth, max_candidates,
                kseq_rho_override):
  """One row: p, q f32[M, V] (q may be None for greedy), tokens/parent/depth/valid [M],
  u f32[D, C]. Returns (n, law f32[V] (unnormalised; for greedy the law whose argmax is next),
  path int32[D], reached bool[D], alpha f32[D], num_candidates int32[D]).

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

  def step(carry):
    d, active, live, n, stop_c, stop_k, stop_rho, reached, alpha, num_cand = carry
    head = jnp.argmax(active)                   # first node of A (A is never empty)
    p_h = p[head]
    q_h = None if q is None else q[head]
    # Children of any node in A. The depth test is redundant for a well-formed tree; it keeps a
    # malformed one from being walked out of order.
    cand_mask = valid & (parent >= 0) & active[safe_parent] & (depth == d + 1)
    cand = jnp.nonzero(cand_mask, size=c_max, fill_value=m)[0]
    in_slot = cand < m
    x_c = jnp.where(in_slot, tokens[jnp.minimum(cand, m - 1)], 0)
    rho = jnp.float32(1.0)
    c = jnp.float32(0.0)
    if rule == "greedy":
      y = jnp.argmax(p_h).astype(jnp.int32)
      acc = jnp.any(in_slot & (x_c == y))
      k = jnp.sum(in_slot)
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
        j, c, z, w, s_mass, acc, y = inner
        x = x_c[j]
        if rule == "kseq":
          # Accept with min(1, p(x) / (ρ q(x))), in order; p and q stay fixed (Alg. K-SEQ).
          take = drawable[j] & (u[d, j] * rho * q_h[x] < p_h[x])
          return j + 1, c, z, w, s_mass, take, jnp.where(take, x, y)
        # Accept with min(1, r(x)/s(x)): u · s(x) < r(x) with r(x) = max(0, p − c q)(x) / Z and
        # s(x) = S(x)/W, where S is q with the removed tokens zeroed (a duplicate of a rejected
        # token has S(x) = 0 and is skipped).
        s_x = s_mass[x] if without else q_h[x]
        ok = drawable[j] & (s_x > 0)
        take = ok & (u[d, j] * s_x * z < jnp.maximum(0.0, p_h[x] - c * q_h[x]) * w)
        reject = ok & ~take
        # r ← norm(max(0, r − s)) (SpecInfer Alg. 2; RSD Alg. 3), s ← s(· | · ≠ x) without
        # replacement. A residual below _MIN_RESIDUAL_MASS is rounding noise (r ≈ s): keep r.
        c_new = c + z / w
        z_new = jnp.sum(jnp.maximum(0.0, p_h - c_new * q_h))
        moved = reject & (z_new > _MIN_RESIDUAL_MASS)
        c, z = jnp.where(moved, c_new, c), jnp.where(moved, z_new, z)
        if without:
          s_mass = s_mass.at[x].set(jnp.where(reject, 0.0, s_x))
          # The remaining mass is summed again (not W − S(x)), so it stays exact when the
          # rejected tokens held nearly all of it. Nothing left: later candidates are skipped.
          w = jnp.where(reject, jnp.sum(s_mass), w)
        return j + 1, c, z, w, s_mass, take, jnp.where(take, x, y)

      one = jnp.float32(1.0)
      init = (jnp.int32(0), jnp.float32(0.0), one, one, q_h if without else one,
              jnp.bool_(False), jnp.int32(0))
      # Stop at the first acceptance or after the last real candidate (under vmap: once every
      # row has), so a typical step costs a candidate or two, not C.
      _, c, _, _, _, acc, y = jax.lax.while_loop(
          lambda inner: (inner[0] < last_slot) & ~inner[5], try_candidate, init)

    tried = k > 0
    reached = reached.at[d].set(tried)
    num_cand = num_cand.at[d].set(k.astype(jnp.int32))
    if q is not None:
      alpha = alpha.at[d].set(jnp.where(tried, jnp.sum(jnp.minimum(p_h, q_h)), 0.0))
    # On a stop A is left as it is, so its first node is where the walk ended; remember what
    # the final law needs (the residual's c, or K-SEQ's k and ρ) and compute it once, after.
    stop_c, stop_k, stop_rho = (jnp.where(acc, a, b) for a, b in
                                ((stop_c, c), (stop_k, k), (stop_rho, rho)))
    active = jnp.where(acc, cand_mask & (tokens == y), active)
    return (d + 1, active, acc, n + acc.astype(jnp.int32), stop_c, stop_k, stop_rho, reached,
            alpha, num_cand)

  init = (jnp.int32(0), jnp.arange(m) == 0, jnp.bool_(True), jnp.int32(0), jnp.float32(0.0),
          jnp.int32(0), jnp.float32(1.0), jnp.zeros((big_d,), bool),
          jnp.zeros((big_d,), jnp.float32), jnp.zeros((big_d,), jnp.int32))
  # Depth by depth until a step stops the walk or D tokens are accepted (under vmap: until
  # every row has stopped). Rows that stopped early keep zeros in the per-depth stats.
  _, active, live, n, stop_c, stop_k, stop_rho, reached, alpha, num_cand = jax.lax.while_loop(
      lambda s: (s[0] < big_d) & s[2], step, init)
  last = jnp.argmax(active).astype(jnp.int32)  # deepest accepted node, or the root
  p_last = p[last]
  # All D accepted (live): the bonus comes from p at depth D. Otherwise the stop step's final
  # law: the recursive residual max(0, p − c q) (c = 0: p itself when there was no candidate),
  # K-SEQ's residual, or greedy's p.
  if recursive:
    law = jnp.where(live, p_last, jnp.maximum(0.0, p_last - stop_c * q[last]))
  elif rule == "kseq":
    law = jnp.where(live, p_last, kseq_residual(p_last, q[last], stop_rho, stop_k))
  else:
    law = p_last

  # Path = ancestors of the deepest accepted node, so it is one concrete chain even when the
  # active set held several i.i.d. chains with the same prefix.
  path = jnp.zeros((big_d,), jnp.int32)
  cur = last
  for d in reversed(range(big_d)):  # static D
    on_path = d < n
    path = path.at[d].set(jnp.where(on_path, cur, 0))
    cur = jnp.where(on_path, safe_parent[cur], cur)
  return n, law, path, reached, alpha, num_cand


def _check_inputs(p, q, tokens, parent, depth, valid, rule, max_depth, max_candidates):
  """Static checks (shapes, rule, sizes); ValueError naming the problem and the fix."""
  if rule not in RULES:
    raise ValueError(f"decode.rule={rule!r} is not a tree acceptance rule; choose one of "
                     f"{RULES}.")
  for name, value in (("max_depth", max_depth), ("max_candidates", max_candidates)):
    positive_int(value, f"verify_tree: {name}")
  if p.ndim != 3:
    raise ValueError(f"verify_tree: p must be f32[B, M, V] (verifier law per node), got "
                     f"shape {p.shape}.")
  if q is None:
    if rule != "greedy":
      raise ValueError(f"rule {rule!r} needs q, the exact draft law at every node (DESIGN §6); "
                       "only 'greedy' may run with q=None.")
  elif q.shape != p.shape:
    if q.ndim == 3 and q.shape[:2] == p.shape[:2]:
      # DESIGN §6: a drafter/verifier vocabulary mismatch must fail loudly or be mapped.
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
                max_depth: int, max_candidates: int) -> TreeVerdict:
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
  rule, max_depth (D: at most D tokens are accepted) and max_candidates (C: the most candidates
  at one step; extra ones are ignored, so pass `TreeSpec.max_candidates`) are static.
  Returns a `TreeVerdict`.
  """
  return _verify_tree(p, q, tokens, parent, depth, valid, rng, rule=rule, max_depth=max_depth,
                      max_candidates=max_candidates)


def _verify_tree(p, q, tokens, parent, depth, valid, rng, *, rule, max_depth, max_candidates,
                 kseq_rho_override=None) -> TreeVerdict:
  """`verify_tree` with a test knob: kseq_rho_override fixes K-SEQ's ρ (ρ = 1 is the planted
  bug DESIGN §6 names: it over-accepts and leaves a residual that would need negative mass)."""
  _check_inputs(p, q, tokens, parent, depth, valid, rule, max_depth, max_candidates)
  max_depth, max_candidates = int(max_depth), int(max_candidates)
  b = p.shape[0]
  rng_accept, rng_next = jax.random.split(rng)
  u = jax.random.uniform(rng_accept, (b, max_depth, max_candidates), jnp.float32)

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
  return TreeVerdict(num_accepted=n, next_token=next_token, path=path, reached=reached,
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
