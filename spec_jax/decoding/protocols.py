"""The types the speculative loop is written against (docs/design.md §2), and the one check of their
contract that both sides share (`check_layers`, defined with the model's residual depths in
`models/llama.py`). No algorithm.

Shape letters (the repo legend, `spec_jax/__init__.py`): B batch, M proposal nodes (root
included), A deepest draft level (a chain's γ, a tree's depth L), V vocabulary, S cache slots,
P padded prompt length, D model width.

One round of the loop (`loop.py`):

  proposal, d_state = drafter.propose(d_params, d_state, tokens, lengths, rng, sampling)
  logits, hidden, v_cache = verifier.score(v_params, v_cache, proposal, lengths)
  verdict = rule(probs_from_logits(logits, sampling), proposal, rng)
  v_cache = verifier.commit(v_cache, lengths, verdict)
  d_state = drafter.commit(d_params, d_state, proposal, verdict, lengths, hidden)

Node 0 of every proposal is the root: the last committed token (the previous round's
correction/bonus token, or the last prompt token), which the verifier has not scored yet. Its
output gives the law of depth-1 drafts. Nodes are laid out level by level; among the children of
one parent, in the order they were drawn (the order tree rules examine them in).
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.decoding import sampling as sampling_lib
from spec_jax.models import llama

# The one check of the contract both sides share, defined beside the residual depths it checks.
check_layers = llama.check_layers

# The sampling scheme of a proposal's siblings, which decides which rules stay exact on it
# (acceptance.check_fit). A chain has one child per node.
SCHEMES = ("chain", "without_replacement", "iid")


@flax.struct.dataclass
class Proposal:
  """A batch of draft trees with their exact laws.

  tokens  int32[B, M]  node tokens; node 0 is the root (last committed token)
  parent  int32[B, M]  parent node index, -1 at the root
  depth   int32[B, M]  0 at the root, parent's depth + 1 below
  valid   bool[B, M]   False for padding (a node that could not be drawn)
  q       f32[B, M, V] | None  the exact law node i's children were drawn from, after the same
                       temperature/top-k/top-p transform the verifier's p gets (zeros at leaves).
                       Losslessness rests on it (docs/design.md §6): never a one-hot stand-in for a
                       sampled draft. None: the drafter has no law, and only greedy may verify it.
  chain   static bool  parent = j − 1 for every node: chain rules use the [B, γ] fast path.
  scheme  static str   how siblings were drawn (SCHEMES).
  max_depth, max_candidates  static ints: A (deepest level) and C (most candidates examined at
                       one step) of the tree walk; 0 means the safe bound M − 1.
  """
  tokens: jax.Array
  parent: jax.Array
  depth: jax.Array
  valid: jax.Array
  q: jax.Array | None
  chain: bool = flax.struct.field(pytree_node=False, default=False)
  scheme: str = flax.struct.field(pytree_node=False, default="chain")
  max_depth: int = flax.struct.field(pytree_node=False, default=0)
  max_candidates: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def num_nodes(self) -> int:
    return self.tokens.shape[1]

  @property
  def depth_bound(self) -> int:
    """A: the deepest level (γ for a chain)."""
    return self.max_depth or self.num_nodes - 1

  @property
  def candidate_bound(self) -> int:
    """C: the most candidates the walk examines at one step (1 for a chain)."""
    return 1 if self.chain else (self.max_candidates or self.num_nodes - 1)

  @property
  def drafts(self) -> jax.Array:
    """int32[B, γ]: a chain's draft tokens x_1..x_γ (node j is x_j)."""
    return self.tokens[:, 1:]


def chain_proposal(root: jax.Array, drafts: jax.Array, q: jax.Array | None,
                   valid: jax.Array | None = None) -> Proposal:
  """A chain as a proposal: root int32[B], drafts int32[B, γ], q f32[B, γ, V] (q[:, i] the law
  x_{i+1} was drawn from) or None. q gets a zero row for the leaf so every node has one (pass
  q f32[B, γ + 1, V] with that row in place already to save the copy). valid bool[B, γ + 1]:
  a chain whose rows end early (`trees.TreeSpec.stop`: a row's valid nodes are a prefix);
  None: every node."""
  b, gamma = drafts.shape
  m = gamma + 1
  nodes = jnp.arange(m, dtype=jnp.int32)[None]
  if q is not None and q.shape[1] == gamma:
    q = jnp.concatenate([q.astype(jnp.float32), jnp.zeros((b, 1, q.shape[-1]), jnp.float32)], 1)
  return Proposal(tokens=jnp.concatenate([root[:, None], drafts], axis=1).astype(jnp.int32),
                  parent=jnp.broadcast_to(nodes - 1, (b, m)),
                  depth=jnp.broadcast_to(nodes, (b, m)),
                  valid=jnp.ones((b, m), bool) if valid is None else valid, q=q, chain=True,
                  scheme="chain",
                  max_depth=gamma, max_candidates=1)


@flax.struct.dataclass
class Verdict:
  """What a rule decided for each row; one type for chain and tree rules.

  num_accepted    int32[B] in [0, A]: accepted draft tokens n (the round emits n + 1)
  next_token      int32[B]: the correction (after a rejection) or bonus token (all accepted)
  path            int32[B, A]: path[b, d] for d < n is the node at depth d + 1 of the root-to-
                  node chain that ends at the last accepted candidate; 0 for d >= n. A chain's
                  path is 1..n; with distinct siblings (RSD) every entry is the candidate
                  accepted at its depth. With i.i.d. chains sharing a prefix (SpecInfer, SpecTr)
                  an earlier depth's candidate may have been accepted on another chain carrying
                  the same tokens (same K/V and hidden states); path[n − 1] is always the
                  candidate accepted last.
  reached         bool[B, A]: the walk examined a candidate at depth d + 1
  alpha           f32[B, A]: Σ_x min(p, q) at the node examined at depth d + 1 (the glossary's α
                  of one draw); 0 where not reached or without q
  num_candidates  int32[B, A]: candidates at depth d + 1 when the walk reached it, every sibling
                  there whether tested before the accepted one or not (1 for chains)
  accept_prob     f32[B, A] | None: chain rules only, P(accept x_d | reached d) =
                  min(1, f(p(x))/q(x)) (1/0 for greedy); None for tree rules
  chain           static bool: the proposal was a chain, so accepted node d + 1 already sits at
                  slot L + d and caches need no move
  """
  num_accepted: jax.Array
  next_token: jax.Array
  path: jax.Array
  reached: jax.Array
  alpha: jax.Array
  num_candidates: jax.Array
  accept_prob: jax.Array | None = None
  chain: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def accepted(self) -> jax.Array:
    """bool[B, A]: the draft at depth d + 1 was accepted (d < n)."""
    return jnp.arange(self.path.shape[1])[None] < self.num_accepted[:, None]

  def last_node(self) -> jax.Array:
    """int32[B]: the deepest accepted node (the root when nothing was accepted): the node whose
    verifier output produced next_token, i.e. where feedback drafters read the hidden state."""
    n = self.num_accepted
    deepest = jnp.take_along_axis(self.path, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    return jnp.where(n > 0, deepest, 0).astype(jnp.int32)


class Rule(Protocol):
  """rule(p f32[B, M, V], proposal, rng) -> Verdict. p[b, i] is the verifier's law of the token
  following node i's path, after the same transform as q. Static knobs (lenience, ε) are bound
  with functools.partial; `acceptance.RULES` names every rule."""

  def __call__(self, p: jax.Array, proposal: Proposal, rng: jax.Array) -> Verdict: ...


class Drafter(Protocol):
  """A drafter is a static (hashable) object; its arrays travel in `params` and its state.

  shape            static `drafters.trees.TreeSpec`: the proposals it makes (chain or tree).
  vocab_size       V of its laws; must equal the verifier's.
  verifier_layers  static tuple of residual depths it wants from the verifier (l = input of
                   block l, -1 = the final pre-norm residual); () for none.
  init(params, prompt_tokens int32[B, P], prompt_lengths int32[B], size, v_hidden) -> state
      prefill; v_hidden {layer: f32[B, P, D]} is the verifier's residual stream over the prompt.
  propose(params, state, tokens int32[B, P + O], lengths int32[B], rng, sampling)
      -> (Proposal with M = shape.num_nodes, state)
  commit(params, state, proposal, verdict, lengths, v_hidden) -> state
      the feedback channel: lengths are the committed lengths before this round, v_hidden
      {layer: f32[B, M, D]} the verifier's residuals at every proposal node.
  The state is opaque to the loop.
  """
  shape: Any
  vocab_size: int
  verifier_layers: tuple[int, ...]

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden) -> Any: ...

  def propose(self, params, state, tokens, lengths, rng,
              sampling: sampling_lib.Sampling) -> tuple[Proposal, Any]: ...

  def commit(self, params, state, proposal: Proposal, verdict: Verdict, lengths,
             v_hidden) -> Any: ...


class Verifier(Protocol):
  """A verifier is static (hashable); `verifier.lm_verifier` builds one from any model with the
  forward contract.

  vocab_size, hidden_layers (static: the residual depths `score` returns), num_layers.
  init(params, prompt_tokens int32[B, P], size) -> (cache, hidden {layer: f32[B, P, D]})
  score(params, cache, proposal, lengths) -> (logits f32[B, M, V], hidden {layer: f32[B, M, D]},
      cache): node i at cache slot lengths − 1 + i, position lengths − 1 + depth_i.
  commit(cache, lengths, verdict) -> cache: the accepted path's K/V into slots L .. L + n − 1.
  """
  vocab_size: int
  hidden_layers: tuple[int, ...]

  def init(self, params, prompt_tokens, size: int) -> tuple[Any, dict]: ...

  def score(self, params, cache, proposal: Proposal, lengths) -> tuple[jax.Array, dict, Any]: ...

  def commit(self, cache, lengths, verdict: Verdict) -> Any: ...
