"""A small language model as drafter: chains and trees, with one catch-up window.

Shape letters (repo legend): B batch, P padded prompt length, M proposal nodes, A draft depth,
W level width, V vocabulary, S cache slots.

The drafter's state is its own KV cache (slot = absolute position for committed tokens). At the
start of a round, with L = lengths[b] committed tokens, the cache holds correct K/V for at least
tokens[0 .. L-3]. `propose` then
  1. feeds the catch-up window [tokens[L-2], tokens[L-1]]: re-writing L-2 is harmless (same
     token, same prefix, same K/V) and needed after a round whose last accepted draft was never
     fed (a fully accepted chain's last draft, a tree's leaf); L-1 is the previous round's
     correction/bonus token. Its logits give the law of the depth-1 drafts;
  2. a chain draws x_1..x_γ one drafter call each (the last draft is never fed: the verifier
     decides what follows it); a tree grows level by level (`growth.grow`), one call per level,
     each level attending to the committed prefix and its own ancestors (`trees.tree_mask`),
     node j at slot L − 1 + j, position L − 1 + depth_j (a dynamic tree's frontier is fed in
     drafting slots and moved to its nodes' slots after, `growth.relayout`).
`commit` moves a tree's accepted path into slots L .. L + n − 1 (`trees.move_path`); a chain's
accepted drafts already sit there. Stale K/V of rejected nodes stay hidden by the masks until
overwritten.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import growth, trees
from spec_jax.decoding.protocols import Proposal, chain_proposal
from spec_jax.models import llama


def draw_step(i, logits, *, rng, sampling: sampling_lib.Sampling):
  """(x int32[B], q f32[B, V]) for the i-th draft of a chain: the argmax (greedy) or a draw
  from q = the transformed law of logits f32[B, V], with rng folded by i."""
  probs = sampling_lib.probs_from_logits(logits, sampling)
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), probs
  return sampling_lib.sample(jax.random.fold_in(rng, i), probs), probs


def draw_chain(feed, logits, carry, gamma: int, rng, sampling: sampling_lib.Sampling,
               stop: float = 0.0):
  """A chain x_1..x_γ drawn one drafter call at a time: (drafts int32[B, γ], q f32[B, γ + 1, V],
  valid bool[B, γ + 1], carry). logits f32[B, V] is the law of x_1; feed(i, x int32[B], carry)
  -> (logits of x_{i+2}, carry) feeds the i-th draft (0-based). The last draft is never fed: the
  verifier decides what follows it. q[:, i] is the exact law x_{i+1} was drawn from (the leaf's
  row stays zero, the proposal's layout).

  stop > 0 (`trees.TreeSpec.stop`): a row stops after a draft whose probability under the
  drafter's softmax (of its logits, before any temperature) is below `stop`; its later nodes
  are invalid (token 0, q zero) and drafting ends when every row has stopped. Whether a row goes
  on depends on its own draws alone, so every exact rule stays exact on what it drafted (the
  loop verifies the drafted nodes only). Node 0 (the root) and x_1 are always valid."""
  b, v = logits.shape
  draw = functools.partial(draw_step, rng=rng, sampling=sampling)
  draft = jnp.zeros((b, gamma), jnp.int32)
  q = jnp.zeros((b, gamma + 1, v), jnp.float32)
  if not stop:
    def step(i, state):
      logits, carry, draft, q = state
      x, probs = draw(i, logits)
      logits, carry = feed(i, x, carry)
      return logits, carry, draft.at[:, i].set(x), q.at[:, i].set(probs)

    logits, carry, draft, q = jax.lax.fori_loop(0, gamma - 1, step, (logits, carry, draft, q))
    x, probs = draw(gamma - 1, logits)
    return (draft.at[:, gamma - 1].set(x), q.at[:, gamma - 1].set(probs),
            jnp.ones((b, gamma + 1), bool), carry)

  def confident(x, logits):
    own = jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), axis=-1),
                              x[:, None], axis=1)[:, 0]
    return own >= stop

  x, probs = draw(0, logits)
  valid = jnp.zeros((b, gamma + 1), bool).at[:, :2].set(True)
  init = (jnp.int32(0), x, confident(x, logits), carry, draft.at[:, 0].set(x),
          q.at[:, 0].set(probs), valid)

  def more(state):
    i, _, going = state[:3]
    return (i < gamma - 1) & jnp.any(going)

  def step(state):
    i, x, going, carry, draft, q, valid = state
    logits, carry = feed(i, x, carry)
    x, probs = draw(i + 1, logits)
    x = jnp.where(going, x, 0)
    draft = draft.at[:, i + 1].set(x)
    q = q.at[:, i + 1].set(jnp.where(going[:, None], probs, 0.0))
    valid = valid.at[:, i + 2].set(going)
    return i + 1, x, going & confident(x, logits), carry, draft, q, valid

  _, _, _, carry, draft, q, valid = jax.lax.while_loop(more, step, init)
  return draft, q, valid, carry


@dataclasses.dataclass(frozen=True)
class LMDrafter:
  """Any Llama-family model (trained from scratch, distilled, or a verifier's early layers) as a
  drafter of `shape` (a chain by default). Implements `protocols.Drafter`."""
  cfg: llama.LlamaConfig
  shape: trees.TreeSpec = trees.chain(4)
  verifier_layers: tuple[int, ...] = ()

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden) -> llama.KVCache:
    del prompt_lengths, v_hidden  # the prefill covers the padded prompt; the mask hides padding
    b, p = prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    # A dynamic tree's drafting slots can reach past the proposal's M (`growth.extra_slots`).
    cache = llama.init_cache(self.cfg, b, size + growth.extra_slots(self.shape))
    _, _, cache = llama.make_apply(self.cfg)(params, prompt_tokens, positions, cache)
    return cache

  def _catch_up(self, params, cache, tokens, lengths, steer=None):
    """Feed [tokens[L-2], tokens[L-1]] → (logits f32[B, V] at L-1, root int32[B], cache). With a
    one-token prompt (L = 1) there is no L-2: that write is parked at slot S, which drops it and
    hides it from every query (llama.split_mask)."""
    last = lengths - 1
    prev = jnp.maximum(last - 1, 0)
    root = jnp.take_along_axis(tokens, last[:, None], 1)[:, 0]
    window = jnp.stack([jnp.take_along_axis(tokens, prev[:, None], 1)[:, 0], root], axis=1)
    slots = jnp.stack([jnp.where(last >= 1, prev, cache.size), last], axis=1)
    logits, _, cache = llama.make_apply(self.cfg)(params, window, jnp.stack([prev, last], axis=1),
                                                  cache, None, slots, steer=steer)
    return logits[:, -1], root, cache

  def propose(self, params, cache, tokens, lengths, rng, sampling: sampling_lib.Sampling,
              steer=None, window_steer=None):
    """steer: optional per-layer deltas for every drafter call of the round (SD², see
    `drafters/steered.py`); None drafts unsteered. window_steer: the catch-up window's own
    per-token deltas ([L, B, 2, X]), `steer` when None."""
    logits, root, cache = self._catch_up(params, cache, tokens, lengths,
                                         steer if window_steer is None else window_steer)
    if self.shape.is_chain:
      return self._chain(params, cache, logits, root, lengths, rng, sampling, steer)
    return self._tree(params, cache, logits, root, lengths, rng, sampling, steer)

  def _chain(self, params, cache, logits, root, lengths, rng, sampling, steer=None):
    """x_1..x_γ, one drafter call each; q[:, i] is the exact law x_{i+1} was drawn from."""
    apply = llama.make_apply(self.cfg)
    last = lengths - 1

    def feed(i, x, cache):
      next_logits, _, cache = apply(params, x[:, None], (last + 1 + i)[:, None], cache,
                                    steer=steer)
      return next_logits[:, 0], cache

    # The last draft is never fed; the next round's catch-up window covers it.
    draft, q, valid, cache = draw_chain(feed, logits, cache, self.shape.depth, rng, sampling,
                                        self.shape.stop)
    return chain_proposal(root, draft, q, valid), cache

  def _tree(self, params, cache, logits, root, lengths, rng, sampling, steer=None):
    """Grow the tree level by level with tree attention (`growth.grow`): one drafter call per
    level but the deepest. q[b, j] is the exact law node j's children were drawn from (zeros
    where none were drafted). A dynamic tree's fed nodes are then moved to their node slots."""
    apply = llama.make_apply(self.cfg)
    last = lengths - 1

    def feed(d, tokens, parent, anc, own, cache):
      del parent  # an LM's node depends on its ancestors' tokens only, which its cache holds
      positions = jnp.broadcast_to((last + d)[:, None], tokens.shape)
      logits, _, cache = apply(params, tokens, positions, cache,
                               trees.tree_mask(anc, last, cache.size), last[:, None] + own[None],
                               steer=steer)
      return logits, cache

    proposal, cache, slot = growth.grow(self.shape, feed, cache, root, logits, rng, sampling)
    if slot is not None:
      cache = growth.relayout(cache, last, slot)
    return proposal, cache

  def commit(self, params, cache, proposal: Proposal, verdict, lengths, v_hidden):
    del params, proposal, v_hidden
    if verdict.chain:  # the accepted drafts are in place already
      return cache
    return trees.move_path(cache, lengths, verdict.path, verdict.num_accepted)
