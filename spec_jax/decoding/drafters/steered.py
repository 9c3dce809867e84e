"""A pretrained drafter steered by the verifier (SD², `models/steering.py`): after every
verification the drafter reads the verifier's residual stream at the deepest accepted node and
turns it into per-layer deltas for the whole next round.

Shape letters (repo legend): B batch, P padded prompt length, M proposal nodes, D the verifier's
width, L drafter layers, X the injected width.

State: {"cache": the drafter's KV cache (as `lm.LMDrafter`), "steer": {injection: f32[L, B, X]}}.
  init    g from the verifier's residuals at the last prompt position (the prompt's own
          features: the first round drafts from there); the prompt prefill itself is unsteered,
          as in training, where positions whose next token is not a response token get δ = 0.
  propose the LMDrafter round (catch-up window, chain or tree) with the same δ in every call.
  commit  g at `verdict.last_node()`: the node whose verifier output produced the round's
          correction/bonus token, i.e. the freshest verified position; a tree's accepted node is
          the last accepted candidate (`Verdict.path`).
Params: {"drafter": the LM's params, "steering": `steering.init_params`}. The drafts' laws q are
the steered drafter's exact laws, so every exact rule stays lossless.
"""

from __future__ import annotations

import dataclasses

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
    return {"cache": cache, "steer": self._steer(params, v_hidden, prompt_lengths - 1)}

  def propose(self, params, state, tokens, lengths, rng, sampling: sampling_lib.Sampling):
    proposal, cache = self._lm.propose(params["drafter"], state["cache"], tokens, lengths, rng,
                                       sampling, steer=state["steer"])
    return proposal, {**state, "cache": cache}

  def commit(self, params, state, proposal, verdict, lengths, v_hidden):
    cache = self._lm.commit(params["drafter"], state["cache"], proposal, verdict, lengths,
                            v_hidden)
    return {"cache": cache, "steer": self._steer(params, v_hidden, verdict.last_node())}
