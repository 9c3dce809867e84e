"""A feature drafter (EAGLE, Li et al. 2024): a small decoder that reads, beside each token, the
verifier's final residual (or several of its layers: EAGLE-3, below) one position back, and
drafts chains and trees from there.

Shape letters (repo legend): B batch, P padded prompt length, M proposal nodes, A draft depth,
W level width, D the verifier's width, V vocabulary, S cache slots.

The drafter's input at position t is the pair (f_{t−1}, x_t): the verifier's final residual at
t − 1 (whose output was the law of x_t) and the token x_t; its output at t is the law of x_{t+1}
and a predicted feature f̂_t (its own final residual, trained to match f_t:
`training/features.py`). Its KV cache holds, at slot = position, pairs built from verified
features wherever they exist.

With L committed tokens (root x_{L−1}), a round
  propose  draws the depth-1 drafts from the law the last commit left (the pair at L − 1 used the
           true f_{L−2}). A chain then feeds (f̂, x) for each draft but the last, one call each,
           f̂ the feature the previous call predicted (slots L .. L + γ − 2). A tree grows level
           by level (`growth.grow`, every layout and the dynamic one): each node's pair carries
           its parent's predicted feature (the root's: the one the last commit left), and one
           call per level feeds a level's nodes with tree attention (`trees.tree_mask`) at
           position L − 1 + depth, in drafting slots after L − 1.
  commit   the verify call returned f at every node; with n drafts accepted along the path
           (`Verdict.path`; a chain's is 1..n) and y the correction/bonus token, it feeds the
           n + 1 pairs (f at the path's node of depth j, the token at depth j + 1), j = 0..n
           (the token at n + 1 is y), at slots L .. L + n in one call (rows with fewer accepted
           park the rest at slot S, which drops them) and keeps the output at L + n: the law of
           the next round's first drafts and its predicted feature. Stale drafting K/V after
           L + n are hidden by every later mask until overwritten.
So a round costs γ drafter calls (a tree: its depth), as an LM drafter's catch-up window + γ − 1
steps does. `init` prefills the prompt's pairs (f_{−1} = 0) and keeps the output at the last
prompt token. q is exactly the law each draft was drawn from, so every exact rule stays lossless.

Multi-layer features (EAGLE-3, Li et al. 2025; `cfg.feature_layers`, size `...:features=2+15+27`):
the verifier hands its residual at those depths (`verifier_layers`) at every prompt position and
scored node, and f is g = feature_fc([h_a / rms; h_b / rms; h_c / rms]) (`verifier_features`),
computed where the verifier's features are read (init, commit). A draft after the first reads
the drafter's own final residual f̂ as it is, in the same slot: the two spaces meet only in the
decoder's input fc([f / rms; e / rms]), which sees both at unit RMS. Nothing regresses f̂ onto g
(there is no fixed target in the drafter's output space); training on its own features
(`distill.feature_passes` >= 2, `training/features.py`) teaches the drafter to read f̂ there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import growth, lm, trees
from spec_jax.decoding.protocols import chain_proposal
from spec_jax.models import decoder, llama

# The verifier's residual depth a feature drafter reads: the final pre-norm residual.
FEATURE_LAYER = -1


def shift(features: jax.Array) -> jax.Array:
  """f32[B, T, D] → the features one position back (f_{t−1} at t; zeros at t = 0)."""
  return jnp.concatenate([jnp.zeros_like(features[:, :1]), features[:, :-1]], axis=1)


def verifier_features(cfg: llama.LlamaConfig, params, v_hidden) -> jax.Array:
  """The feature the drafter reads from the verifier's hidden states {depth: [..., D]} (the
  verifier's dtype): the final residual v_hidden[-1] as it is, or for a multi-layer drafter
  (cfg.feature_layers) f32 feature_fc([h_a / rms; h_b / rms; ...]). Each depth at unit RMS:
  the residual's scale grows by orders of magnitude with depth."""
  if not cfg.feature_layers:
    return v_hidden[FEATURE_LAYER]
  both = jnp.concatenate([decoder.unit_rms(v_hidden[d]) for d in cfg.feature_layers], axis=-1)
  return jnp.dot(both, params["feature_fc"]["kernel"].astype(jnp.float32))


def _rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[b, index[b, i]] for x[B, N, D] and index int32[B, I]."""
  return jnp.take_along_axis(x, index[..., None], axis=1)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[b, index[b]] for x[B, T, ...] and index int32[B]."""
  return jnp.take_along_axis(x, index.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class FeatureDrafter:
  """A feature drafter (`cfg.feature_width` > 0, `draft_init.feature_drafter`) of `shape`.
  Implements `protocols.Drafter`; state {"cache", "logits" f32[B, V], "feature" f32[B, D]}."""
  cfg: llama.LlamaConfig
  shape: trees.TreeSpec = trees.chain(4)

  def __post_init__(self):
    if not self.cfg.feature_width:
      raise ValueError("FeatureDrafter needs a feature drafter (cfg.feature_width > 0); an "
                       "ordinary language model drafts with lm.LMDrafter.")

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  @property
  def verifier_layers(self) -> tuple[int, ...]:
    return self.cfg.feature_layers or (FEATURE_LAYER,)

  def _apply(self):
    return llama.make_apply(self.cfg, (FEATURE_LAYER,))

  def _last(self, params, hidden: jax.Array, index: jax.Array):
    """(logits f32[B, V], feature f32[B, D]) of the drafter's output at index int32[B]; only
    that position goes through the output head."""
    feature = _at(hidden, index)
    return decoder.output_logits(self.cfg, params, feature), feature.astype(jnp.float32)

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden):
    b, p = prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    # A dynamic tree's drafting slots can reach past the proposal's M (`growth.extra_slots`).
    cache = llama.init_cache(self.cfg, b, size + growth.extra_slots(self.shape))
    _, hidden, cache = self._apply()(params, prompt_tokens, positions, cache,
                                     features=shift(verifier_features(self.cfg, params, v_hidden)))
    logits, feature = self._last(params, hidden[FEATURE_LAYER], prompt_lengths - 1)
    return {"cache": cache, "logits": logits, "feature": feature}

  def propose(self, params, state, tokens, lengths, rng, sampling: sampling_lib.Sampling):
    if not self.shape.is_chain:
      return self._tree(params, state, tokens, lengths, rng, sampling)
    apply = self._apply()
    root = _at(tokens, lengths - 1)

    def feed(i, x, carry):
      feature, cache = carry
      out, hidden, cache = apply(params, x[:, None], (lengths + i)[:, None], cache,
                                 features=feature[:, None])
      return out[:, 0], (hidden[FEATURE_LAYER][:, 0].astype(jnp.float32), cache)

    draft, q, valid, (_, cache) = lm.draw_chain(
        feed, state["logits"], (state["feature"], state["cache"]), self.shape.depth, rng,
        sampling, self.shape.stop)
    return chain_proposal(root, draft, q, valid), {**state, "cache": cache}

  def _tree(self, params, state, tokens, lengths, rng, sampling):
    """One call per level but the deepest (`growth.grow`); a node's pair carries its parent's
    predicted feature."""
    apply = self._apply()
    last = lengths - 1

    def feed(d, level_tokens, parent, anc, own, carry):
      cache, parent_features = carry                                    # [B, w_prev, D]
      positions = jnp.broadcast_to((last + d)[:, None], level_tokens.shape)
      out, hidden, cache = apply(params, level_tokens, positions, cache,
                                 trees.tree_mask(anc, last, cache.size), last[:, None] + own[None],
                                 features=_rows(parent_features, parent))
      return out, (cache, hidden[FEATURE_LAYER].astype(jnp.float32))

    carry = (state["cache"], state["feature"][:, None])
    proposal, (cache, _), _ = growth.grow(self.shape, feed, carry, _at(tokens, last),
                                          state["logits"], rng, sampling)
    return proposal, {**state, "cache": cache}

  def commit(self, params, state, proposal, verdict, lengths, v_hidden):
    n = verdict.num_accepted
    b, depth = verdict.path.shape
    j = jnp.arange(depth + 1, dtype=jnp.int32)[None]                      # [1, A + 1]
    # Pair j: the verifier's feature at the accepted path's node of depth j (the root at j = 0;
    # node j for a chain), and the token after it: the next accepted draft, or y at j = n.
    nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), verdict.path], axis=1)
    tokens = jnp.concatenate([jnp.take_along_axis(proposal.tokens, verdict.path, axis=1),
                              jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j == n[:, None], verdict.next_token[:, None], tokens)
    positions = lengths[:, None] + j
    cache = state["cache"]
    slots = jnp.where(j <= n[:, None], positions, cache.size)
    # The path's rows of every depth first ([B, A + 1, D] each): a multi-layer fc maps those.
    path_hidden = {d: _rows(v_hidden[d], nodes) for d in self.verifier_layers}
    _, hidden, cache = self._apply()(params, tokens, positions, cache, None, slots,
                                     features=verifier_features(self.cfg, params, path_hidden))
    logits, feature = self._last(params, hidden[FEATURE_LAYER], n)
    return {"cache": cache, "logits": logits, "feature": feature}


def timing_apply(cfg: llama.LlamaConfig):
  """apply(params, tokens, positions, cache) of a model for forward-call timing
  (`evaluation.timing.forward_calls`): a feature drafter gets zero features of its width (the
  cost of one call does not depend on their values)."""
  apply = llama.make_apply(cfg)
  if not cfg.feature_width:
    return apply

  def with_features(params, tokens, positions, cache=None):
    zeros = jnp.zeros((*tokens.shape, cfg.feature_width), jnp.float32)
    return apply(params, tokens, positions, cache, features=zeros)

  return with_features


def for_model(cfg: llama.LlamaConfig, shape: trees.TreeSpec = trees.chain(4)):
  """The drafter of a model config: a FeatureDrafter for a feature drafter, else an LMDrafter."""
  if cfg.feature_width:
    return FeatureDrafter(cfg, shape)
  return lm.LMDrafter(cfg, shape)
