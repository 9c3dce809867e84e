"""A `protocols.Verifier` from any model with the forward contract (docs/design.md §2).

Shape letters (repo legend): B batch, P padded prompt length, M proposal nodes, A draft depth,
V vocabulary, D model width, S cache slots.

Cache layout: slot = absolute position for committed tokens. In a round with L_b committed
tokens, proposal node j is scored at slot L_b − 1 + j and position L_b − 1 + depth_j (the root,
node 0, is the last committed token at its own slot). A chain is scored with the plain causal
mask (slot = position); a tree node sees the committed prefix and its own ancestors. `commit`
gathers a tree's accepted path into slots L_b .. L_b + n − 1, where the next round expects it; a
chain's accepted drafts already sit there.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from spec_jax.decoding.drafters import trees
from spec_jax.decoding.protocols import Proposal, Verdict, check_layers
from spec_jax.models import llama


@dataclasses.dataclass(frozen=True)
class ModelVerifier:
  """Scores proposals with `make_apply(cfg, hidden_layers)`, a function with the forward contract
  apply(params, tokens[B,T], positions[B,T], cache, mask[B,T,S] | None, slots[B,T] | None)
      -> (logits f32[B,T,V], hidden {layer: [B,T,D]}, cache),
  and `init_cache(cfg, batch, size)`. `cfg` is any hashable model config with vocab_size and
  n_layers; Llama-family models are `lm_verifier(cfg)`."""
  cfg: object
  make_apply: Callable
  init_cache: Callable
  hidden_layers: tuple[int, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "hidden_layers", check_layers(
        self.hidden_layers, self.num_layers,
        "verifier hidden_layers (the drafter's verifier_layers)"))

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  @property
  def num_layers(self) -> int:
    return self.cfg.n_layers

  def _apply(self):
    return self.make_apply(self.cfg, self.hidden_layers)

  def init(self, params, prompt_tokens, size: int):
    """Prefill the padded prompt → (cache of `size` slots, hidden {layer: [B, P, D]})."""
    b, p = prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    _, hidden, cache = self._apply()(params, prompt_tokens, positions,
                                     self.init_cache(self.cfg, b, size))
    return cache, hidden

  def score(self, params, cache, proposal: Proposal, lengths):
    """Logits f32[B, M, V] and hidden {layer: [B, M, D]} at every node, in one forward call."""
    last = (lengths - 1)[:, None]
    positions = last + proposal.depth
    if proposal.chain:  # slot = position, plain causal mask
      return self._apply()(params, proposal.tokens, positions, cache)
    m = proposal.num_nodes
    anc = trees.ancestor_matrix(proposal.parent, proposal.depth_bound)
    mask = trees.tree_mask(anc, last[:, 0], cache.k.shape[2])
    slots = last + jnp.arange(m, dtype=jnp.int32)[None]
    return self._apply()(params, proposal.tokens, positions, cache, mask, slots)

  def commit(self, cache, lengths, verdict: Verdict):
    if verdict.chain:  # the accepted drafts are in place already
      return cache
    return trees.move_path(cache, lengths, verdict.path, verdict.num_accepted)


def lm_verifier(cfg: llama.LlamaConfig, hidden_layers=()) -> ModelVerifier:
  """A Llama-family verifier returning the residual stream at `hidden_layers` (pass a drafter's
  `verifier_layers`)."""
  return ModelVerifier(cfg, llama.make_apply, llama.init_cache, tuple(hidden_layers))
