"""Blockwise parallel decoding as a drafter: BPD heads (`models/bpd_heads.py`) on the verifier's
final residual, fed back through `commit` every round, so drafting costs no drafter model and no
extra verifier call.

Shape letters (repo legend): B batch, P padded prompt length, A = h heads, D the verifier's width,
V vocabulary, M = h + 1 proposal nodes.

State: x f32[B, D], the verifier's final pre-norm residual at the deepest accepted node of the
last verify call: the position whose output produced the round's correction/bonus token y (the
last committed token). At the prompt, the residual at position L − 2, whose output is the last
prompt token. `propose` drafts x_k (k = 1..h) from head k's law q_k, the token k positions after y:
argmax when greedy, else a draw from q_k. The drafts are drawn independently given x, and q_k is
exactly the law x_k came from, so every exact rule stays lossless (a head's draft ignores the
earlier drafts, which rejection sampling allows); greedy output equals the verifier's.

Params: {"heads": the stacked head params, "out": `bpd_heads.verifier_output(v_cfg, v_params)`}
(a view of the verifier's final norm and projection, passed again so the drafter stays a pure
function of its own params).
"""

from __future__ import annotations

import dataclasses

import jax

from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import hidden, trees
from spec_jax.models import bpd_heads


@dataclasses.dataclass(frozen=True)
class BPDDrafter:
  """Chain drafts of length h from BPD heads. Implements `protocols.Drafter`."""
  heads: bpd_heads.BPDConfig
  v_cfg: object  # the verifier's model config (its final norm, projection, soft-capping)
  gamma: int = 0  # draft length: the first γ heads (0 = all h)

  def __post_init__(self):
    if not 0 <= self.gamma <= self.heads.num_heads:
      raise ValueError(f"BPD draft length γ={self.gamma} needs γ heads; these are "
                       f"{self.heads.num_heads}.")

  @property
  def vocab_size(self) -> int:
    return self.heads.vocab_size

  @property
  def depth(self) -> int:
    return self.gamma or self.heads.num_heads

  @property
  def shape(self) -> trees.TreeSpec:
    return trees.chain(self.depth)

  @property
  def verifier_layers(self) -> tuple[int, ...]:
    return (-1,)

  def params(self, head_params, v_params) -> dict:
    """The drafter's params from trained heads and the verifier they were trained on."""
    bpd_heads.check(self.heads, head_params, self.v_cfg)
    return {"heads": head_params, "out": bpd_heads.verifier_output(self.v_cfg, v_params)}

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden):
    del params, prompt_tokens, size
    return hidden.prompt_state(v_hidden[-1], prompt_lengths)

  def logits(self, params, x: jax.Array) -> jax.Array:
    """f32[B, γ, V]: the first γ heads' logits at the residual x f32[B, D]."""
    heads = params["heads"]
    if self.depth < self.heads.num_heads:
      heads = jax.tree.map(lambda a: a[:self.depth], heads)
    return bpd_heads.head_logits(self.heads, heads, self.v_cfg, params["out"], x)

  def propose(self, params, x, tokens, lengths, rng, sampling: sampling_lib.Sampling):
    return hidden.draft_chain(tokens, lengths, self.logits(params, x), rng, sampling), x

  def commit(self, params, x, proposal, verdict, lengths, v_hidden):
    del params, x, proposal, lengths
    return hidden.accepted_state(v_hidden[-1], verdict)
