"""A drafter fed by the verifier: γ linear heads on the verifier's hidden state (the feedback
channel's smallest user, and the shape of Medusa / blockwise-parallel heads).

Shape letters (repo legend): B batch, P padded prompt length, A = γ heads, D the verifier's model
width, V vocabulary, M = γ + 1 proposal nodes.

After each verification the drafter keeps h f32[B, D], the verifier's residual stream (at
`layer`) at the deepest accepted node: the position whose output produced the round's
correction/bonus token y, the last committed token. Head k (k = 1..γ) maps h to the law of the
k-th token after y:  q_k = transform(h · W_k + b_k),  x_k ~ q_k  (argmax when greedy).
The drafts are drawn independently given h, and q_k is exactly the law x_k was drawn from, so
speculative sampling stays lossless (q_k may be any law; it need not condition on x_{<k}).
At the prompt, h is the residual at position L − 2, whose output is the last prompt token
(position 0 for a one-token prompt, a harmless approximation: q stays exact).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import trees
from spec_jax.decoding.protocols import chain_proposal


@dataclasses.dataclass(frozen=True)
class HiddenStateDrafter:
  """γ = `gamma` linear heads on the verifier's residual at `layer` (-1: the final one).
  Params: {"w": f32[γ, D, V], "b": f32[γ, V]}. Implements `protocols.Drafter`."""
  vocab_size: int
  d_model: int
  gamma: int
  layer: int = -1

  @property
  def shape(self) -> trees.TreeSpec:
    return trees.chain(self.gamma)

  @property
  def verifier_layers(self) -> tuple[int, ...]:
    return (self.layer,)

  def init_params(self, rng: jax.Array, scale: float = 0.02):
    w = scale * jax.random.normal(rng, (self.gamma, self.d_model, self.vocab_size), jnp.float32)
    return {"w": w, "b": jnp.zeros((self.gamma, self.vocab_size), jnp.float32)}

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden):
    del params, prompt_tokens, size
    return prompt_state(v_hidden[self.layer], prompt_lengths)

  def propose(self, params, h, tokens, lengths, rng, sampling: sampling_lib.Sampling):
    logits = jnp.einsum("BD,ADV->BAV", h, params["w"]) + params["b"][None]
    return draft_chain(tokens, lengths, logits, rng, sampling), h

  def commit(self, params, h, proposal, verdict, lengths, v_hidden):
    del params, h, proposal, lengths
    return accepted_state(v_hidden[self.layer], verdict)


# The pieces every drafter fed by the verifier's hidden state shares (this one, BPD heads).

def prompt_state(hidden: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
  """f32[B, D]: the residual hidden[B, P, D] at position L − 2, whose output is the last prompt
  token (position 0 for a one-token prompt: a harmless approximation, q stays exact)."""
  pos = jnp.maximum(prompt_lengths - 2, 0)
  return jnp.take_along_axis(hidden, pos[:, None, None], axis=1)[:, 0].astype(jnp.float32)


def accepted_state(hidden: jax.Array, verdict) -> jax.Array:
  """f32[B, D]: the residual hidden[B, M, D] of the verify call at the deepest accepted node,
  whose output produced the round's correction/bonus token."""
  node = verdict.last_node()                                           # int32[B]
  return jnp.take_along_axis(hidden, node[:, None, None], axis=1)[:, 0].astype(jnp.float32)


def draft_chain(tokens, lengths, logits: jax.Array, rng, sampling: sampling_lib.Sampling):
  """A chain proposal after the last committed token from independent per-position laws:
  logits f32[B, γ, V] → x_k = argmax (greedy) or a draw from q_k, with q the exact laws."""
  root = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
  q = sampling_lib.probs_from_logits(logits, sampling)                 # [B, γ, V]
  if sampling.greedy:
    drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    drafts = sampling_lib.sample(rng, q)
  return chain_proposal(root, drafts, q)
