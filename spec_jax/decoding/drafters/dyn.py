"""The dynamic draft tree `dyn` (EAGLE-2, Li et al. 2024, "EAGLE-2: faster inference of language
models with dynamic draft trees"), registered in `decoding.methods` over every drafter that feeds a
level of nodes with tree attention: a language model, a feature drafter (EAGLE), a steered
drafter. How it grows, with static shapes: `growth.py`.

Entry `dyn:K-M@L` (eval.methods; generate's method): at each of L levels the K best frontier nodes
are expanded by their K best children, the K best of those K·K are the next frontier, and the M
best nodes of all levels are verified in one call of M + 1 tokens (the root's included).
`dyn:K@L` keeps M = K·L (the budget of the other trees at width K); `dyn@L` takes K from
eval.tree_width. A drafter call per level (the root's, then L − 1 frontiers of K nodes).

Temperature 0: "best" is the path's log-probability under the drafter, as in EAGLE-2, and the
tree is verified greedily (the output is the verifier's greedy output).

Temperature > 0: "best" is the perturbed path value of stochastic beam search (Kool et al. 2019):
a node's children are its law's Gumbel-top-K conditioned on the node's own value, so the tree is
a sample, and recursive rejection sampling without replacement (`rrs_without`, RSD's rule) is
exact on it. The argument, in the exponential-race form of the Gumbel process (a value G is the
time e^{−G}; a node's children are independent Exp(q(x)) clocks started at its time):
  1. Siblings. The i-th child of node u arrives after a gap whose law depends only on the
     identities of u's earlier children (the mass left), and its identity is a draw from q_u
     without those, independent of the gap (memorylessness). So u's children, in arrival order,
     are an ordered sample without replacement from q_u, and each child's value is known before
     its identity is drawn.
  2. Selections are stopping rules. Reveal nodes best first (earliest time first): pop the
     earliest slot, draw its identity, then open its first child and its next sibling. The
     frontier of level d is the first K pops at level d (the K best of the K·K candidates are
     the K best of the whole level, since a node's value equals its best child's); the kept tree
     is the first M pops among the pool. Both compare values only, ties broken by pool index
     (parents before children, siblings in draw order). So whether a node is drafted, expanded
     or kept is decided by pops before it, before its identity is drawn.
  3. The rule. At node u, RRS examines u's kept children c_1, c_2, ... (a prefix of u's arrival
     order) and is exact if, given all the walk saw before examining c_j (the accepted path, the
     rejected candidates, the existence of c_j), c_j is distributed as q_u without c_1..c_{j−1};
     and the same below an accepted c_j. Everything the walk saw was popped before c_j (the
     path's nodes and the rejected candidates have larger values), and c_j's identity is drawn
     at its pop independently of all of it (1, 2). By induction over depth the emitted tokens
     follow the verifier's law.
  The final top-M rerank across levels keeps this, because it is the same kind of stopping
  rule: the nodes whose values depend on c_j's identity (its subtree, and the subtrees of its
  later siblings) all have values below c_j's, so they never decide whether c_j is kept. It
  would break exactness to rank by the unperturbed path log-probability at T > 0 (φ of c_j reads
  q(c_j), its own identity; the T = 0 tree verified by the sampling rule is the planted bug of
  tests/test_dyn.py), or to break ties by token. Values that round to the same float32 (a bound
  far below a node's children, `gumbel.perturbed_top_k`) are ordered by their exact excess within
  a parent; across parents they fall back to pool order, a tie of probability ~float32
  resolution. tests/test_dyn.py checks the emitted law by chi-square at T = 1 and at T = 0.8
  with top-k.
"""

from __future__ import annotations

from spec_jax.decoding import methods
from spec_jax.decoding.drafters import standard, trees


def shape(ints: tuple[int, ...], depth: int, opts, width: int) -> trees.TreeSpec:
  """dyn's TreeSpec from the entry's K-M numbers (module docstring); ValueError naming
  eval.methods for a shape it cannot draft."""
  del opts
  if len(ints) > 2:
    raise ValueError(f"eval.methods entry dyn:{'-'.join(map(str, ints))}@{depth}: dyn takes K-M "
                     "(K nodes expanded per level, M nodes verified), e.g. dyn:4-16@4.")
  k = ints[0] if ints else width
  kept = ints[1] if len(ints) > 1 else k * depth
  if k < 1:
    raise ValueError(f"eval.methods entry dyn:{k}-{kept}@{depth}: K (nodes expanded per level) "
                     "must be >= 1, e.g. dyn:4-16@4.")
  return trees.TreeSpec("dynamic", depth, width=k, kept=kept, rule="rrs_without", name="dyn")


_build = standard.builder("dyn")


def build(source: methods.Source, spec: trees.TreeSpec, opts) -> methods.Built:
  """The drafter of the checkpoint (`standard.model_drafter`) growing `spec` dynamically."""
  cfg = source.d_cfg
  vocab = len(cfg.head_ids) if cfg.head_ids else cfg.vocab_size  # what it can draft
  if spec.width > vocab:
    raise ValueError(f"eval.methods entry dyn:{spec.width}-{spec.kept}@{spec.depth} expands "
                     f"K={spec.width} children per node, more than the drafter's {vocab} tokens "
                     "it drafts from. Fix: a smaller K.")
  return _build(source, spec, opts)


methods.register(methods.Method(
    "dyn", "EAGLE-2's dynamic tree (Li et al. 2024): K nodes expanded per level, the M best of "
    "all levels verified; drawn by stochastic beam search at T > 0",
    build=build, shape=shape, grammar="K-M", kinds=("lm", "steered"), example="dyn:4-16@4"))
