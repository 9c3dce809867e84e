"""A pretrained drafter steered by the verifier (SD², `models/steering.py`): after every
verification the drafter reads the verifier's residual stream at the deepest accepted node and
turns it into per-layer deltas for the whole next round.

Shape letters (repo legend): B batch, P padded prompt length, M proposal nodes, D the verifier's
width, L drafter layers, X the injected width.

State: {"cache": the drafter's KV cache (as `lm.LMDrafter`), "steer": {injection: f32[L, B, X]}
the round's deltas, "prev": the same for the deltas the previous round drafted with}. The offsets
are training's (`training/steering.py`): the drafter at position t is steered by the verifier's
features at t − o, o = 1 for the first draft of a round (the root's position) up to γ.
  init    g at position L − 2, one before the root (the last prompt token), so the first round
          drafts at offsets 1..γ like every other; the prompt prefill itself is unsteered ("prev"
          zero), as in training, where positions whose next token is not a response token get
          δ = 0.
  propose the LMDrafter round with the same δ in every call, but for the catch-up window's first
          slot (L − 2), which is written again with the deltas it was drafted with ("prev"): the
          cache it already held when a draft there was fed, and no offset 0 where a last draft
          or a one-draft round left it unfed.
  commit  g at `verdict.last_node()`: the node whose verifier output produced the round's
          correction/bonus token, i.e. the freshest verified position, one before the next root;
          a tree's accepted node is the last accepted candidate (`Verdict.path`).
Params: {"drafter": the LM's params, "steering": `steering.init_params`}. The drafts' laws q are
the steered drafter's exact laws, so every exact rule stays lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import lm, trees
from spec_jax.models import llama, steering


def _at(hidden: dict, layers, index) -> dict:
  """{layer: f32[B, D]}: each layer's residual at node/position index int32[B]."""
  return {l: jnp.take_along_axis(hidden[l], index[:, None, None], axis=1)[:, 0] for l in layers}


@dataclasses.dataclass(frozen=True)
class SteeredDrafter:
  """A Llama-family drafter of `shape` steered by a `steering.SteeringConfig` module.
  Implements `protocols.Drafter`."""
  cfg: llama.LlamaConfig
  steering: steering.SteeringConfig
  shape: trees.TreeSpec = trees.chain(4)

  def __post_init__(self):
    width = self.cfg.d_ff if self.steering.mode == "merged" else self.cfg.d_model
    if (self.steering.drafter_layers, self.steering.width) != (self.cfg.n_layers, width):
      raise ValueError(
          f"The steering module injects into {self.steering.drafter_layers} layers of width "
          f"{self.steering.width} but the drafter has {self.cfg.n_layers} layers with "
          f"{'d_ff' if self.steering.mode == 'merged' else 'd_model'} = {width}. Fix: load the "
          "drafter the steering module was trained with (drafter.checkpoint).")

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  @property
  def verifier_layers(self) -> tuple[int, ...]:
    return self.steering.verifier_layers

  @property
  def _lm(self) -> lm.LMDrafter:
    return lm.LMDrafter(self.cfg, self.shape)

  def _steer(self, params, hidden: dict, index) -> dict:
    return steering.steer_from_hidden(self.steering, params["steering"],
                                      _at(hidden, self.verifier_layers, index))

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden):
    cache = self._lm.init(params["drafter"], prompt_tokens, prompt_lengths, size, v_hidden)
    steer = self._steer(params, v_hidden, jnp.maximum(prompt_lengths - 2, 0))
    return {"cache": cache, "steer": steer, "prev": jax.tree.map(jnp.zeros_like, steer)}

  def propose(self, params, state, tokens, lengths, rng, sampling: sampling_lib.Sampling):
    # {injection: f32[L, B, 2, X]}: the catch-up window's [L − 2, L − 1] slots.
    window = jax.tree.map(lambda a, b: jnp.stack([a, b], axis=2), state["prev"], state["steer"])
    proposal, cache = self._lm.propose(params["drafter"], state["cache"], tokens, lengths, rng,
                                       sampling, steer=state["steer"], window_steer=window)
    return proposal, {**state, "cache": cache}

  def commit(self, params, state, proposal, verdict, lengths, v_hidden):
    cache = self._lm.commit(params["drafter"], state["cache"], proposal, verdict, lengths,
                            v_hidden)
    return {"cache": cache, "steer": self._steer(params, v_hidden, verdict.last_node()),
            "prev": state["steer"]}
