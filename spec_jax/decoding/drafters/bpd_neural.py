"""BPD heads with local neural rescoring (Kim et al. 2024, "Exploring and Improving Drafts in
Blockwise Parallel Decoding", §5): a small LM rescores each head's top-k candidates left to right,
conditioned on the refined prefix.

Shape letters (repo legend): B batch, A = γ ≤ h draft positions, K candidates per head, V
vocabulary, S cache slots.

Position i (i = 1..γ) drafts from the law
    q_i ∝ exp( (1 − a)·log q_head_i(x) + a·log p_LM(x | committed, x_1..x_{i−1}) )  on x ∈ top-k(q_head_i),
then the drafting temperature/top-k/top-p transform (a = `weight`; 0 restricts the head to its
top k, whose argmax is the plain head's). x_i is drawn from q_i (argmax when greedy) and q_i is
kept as the exact law x_i came from, so every chain rule stays exact: q_i may depend on the earlier
drafts, as any drafter's does. Greedy output equals the verifier's greedy output.

State: (x f32[B, D], the verifier's final residual at the last accepted node (`bpd.py`), the LM's
KV cache (`lm.py`: the catch-up window then one LM call per draft but the last)). The LM runs γ
small calls per round: its cost is a drafter cost, unlike plain BPD's.

Params: {"heads", "out" (`BPDDrafter.params`), "lm": the rescoring LM's params}.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from spec_jax.decoding import methods
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import bpd, hidden, lm, trees
from spec_jax.decoding.protocols import chain_proposal
from spec_jax.models import bpd_heads, llama


def rescore(head_logits: jax.Array, lm_logits: jax.Array, top_k: int, weight: float) -> jax.Array:
  """f32[B, V]: (1 − a)·log q_head + a·log p_LM on the head's top-k tokens, −inf elsewhere."""
  head = jax.nn.log_softmax(head_logits.astype(jnp.float32), axis=-1)
  kth = jax.lax.top_k(head, top_k)[0][..., -1:]
  mixed = head if weight == 0 else (
      (1.0 - weight) * head + weight * jax.nn.log_softmax(lm_logits.astype(jnp.float32), -1))
  return jnp.where(head >= kth, mixed, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class NeuralRescoredBPD(bpd.HeadsDrafter):
  """A chain of γ ≤ h drafts from BPD heads, each head's top-k rescored by a small LM given the
  refined prefix (module docstring). Implements `protocols.Drafter`."""
  heads: bpd_heads.BPDConfig
  v_cfg: object                # the verifier's model config
  lm_cfg: llama.LlamaConfig    # the rescoring LM (a train_lm / distill checkpoint's config)
  gamma: int = 0               # draft length (0 = all h heads)
  top_k: int = 4               # K candidates per head
  weight: float = 0.5          # a: the LM's share of the score

  def __post_init__(self):
    if not 0 <= self.gamma <= self.heads.num_heads:
      raise ValueError(f"BPD draft length γ={self.gamma} needs γ heads; these are "
                       f"{self.heads.num_heads}.")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
      raise ValueError(f"bpd.top_k={self.top_k!r} must be an integer >= 1.")
    if not 0.0 <= float(self.weight) <= 1.0:
      raise ValueError(f"bpd.rescorer_weight={self.weight} must be in [0, 1] (0 = the heads "
                       "alone, 1 = the rescoring LM alone on the heads' top k).")
    if self.lm_cfg.vocab_size != self.heads.vocab_size:
      raise ValueError(f"bpd.rescorer: the rescoring LM has a vocabulary of "
                       f"{self.lm_cfg.vocab_size} tokens, the verifier {self.heads.vocab_size}. "
                       "Fix: a rescorer trained with the verifier's tokenizer.")
    if self.lm_cfg.feature_width:
      raise ValueError("bpd.rescorer: the rescoring LM is a feature drafter, which drafts only "
                       "beside a verifier's features, not alone. Fix: a language-model drafter, "
                       "e.g. --config.eval.bpd.rescorer.checkpoint="
                       "runs/quickstart_scratch/drafter.")

  @property
  def shape(self) -> trees.TreeSpec:
    return trees.chain(self.depth)

  def _bpd(self) -> bpd.BPDDrafter:
    return bpd.BPDDrafter(self.heads, self.v_cfg, gamma=self.depth)

  def _lm(self) -> lm.LMDrafter:
    return lm.LMDrafter(self.lm_cfg, trees.chain(self.depth))

  def params(self, head_params, v_params, lm_params) -> dict:
    return {**self._bpd().params(head_params, v_params), "lm": lm_params}

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden):
    x = hidden.prompt_state(v_hidden[-1], prompt_lengths)
    return x, self._lm().init(params["lm"], prompt_tokens, prompt_lengths, size, v_hidden)

  def propose(self, params, state, tokens, lengths, rng, sampling: sampling_lib.Sampling):
    x, cache = state
    heads = self._bpd().logits(params, x)                               # [B, A, V]
    lm_logits, root, cache = self._lm()._catch_up(params["lm"], cache, tokens, lengths)
    apply = llama.make_apply(self.lm_cfg)
    last = lengths - 1
    drafts, laws = [], []
    for i in range(self.depth):  # γ ≤ h is small and static: unrolled
      mixed = rescore(heads[:, i], lm_logits, self.top_k, float(self.weight))
      q = sampling_lib.probs_from_logits(mixed, sampling)
      draft = (jnp.argmax(mixed, axis=-1).astype(jnp.int32) if sampling.greedy
               else sampling_lib.sample(jax.random.fold_in(rng, i), q))
      drafts.append(draft)
      laws.append(q)
      if i + 1 < self.depth:  # the last draft is never fed (the verifier decides what follows)
        lm_logits, _, cache = apply(params["lm"], draft[:, None], (last + 1 + i)[:, None], cache)
        lm_logits = lm_logits[:, 0]
    laws.append(jnp.zeros_like(laws[-1]))                               # the leaf's row
    return chain_proposal(root, jnp.stack(drafts, 1), jnp.stack(laws, 1)), (x, cache)

  def commit(self, params, state, proposal, verdict, lengths, v_hidden):
    del params, proposal, lengths
    # The chain's accepted drafts already sit in the LM cache (`lm.py`).
    return hidden.accepted_state(v_hidden[-1], verdict), state[1]


def _build(source: methods.Source, shape: trees.TreeSpec, opts: bpd.BPDOptions) -> methods.Built:
  """bpd_neural over the checkpoint's heads, with the rescoring LM of eval.bpd.rescorer (loaded
  once per source); its γ LM calls per round are the drafter cost (c: the LM's step)."""
  if not opts.rescorer:
    raise ValueError("eval.methods has bpd_neural but eval.bpd.rescorer is not set. Fix: a "
                     "model section, e.g. --config.eval.bpd.rescorer.checkpoint="
                     "runs/quickstart_scratch/drafter (a language-model drafter's train_lm "
                     "or distill workdir).")
  section = ml_collections.ConfigDict(dict(opts.rescorer))
  lm_cfg, lm_params = source.cached(("rescorer", section.to_json()), lambda: source.load_model(
      section, "eval.bpd.rescorer.checkpoint", 2))
  drafter = NeuralRescoredBPD(source.b_cfg, source.v_cfg, lm_cfg, gamma=shape.depth,
                              top_k=int(opts.top_k), weight=float(opts.rescorer_weight))
  params = {**bpd.heads_params(source), "lm": lm_params}
  return methods.Built(drafter, params, methods.Cost(calls=shape.depth, model="rescorer",
                                                     cfg=lm_cfg, params=lm_params), "bpd_neural")


def _check(source, shape, opts) -> None:
  del opts
  bpd.check_depth(source.b_cfg, shape)


methods.register(methods.Method(
    "bpd_neural", "a chain from BPD heads, each head's top k rescored by a small LM (Kim et al. "
    "2024, §5)", build=_build, shape=lambda ints, depth, opts, width: trees.chain(depth),
    kinds=("bpd",), options=bpd.BPDOptions, options_field="bpd", check=_check,
    example="bpd_neural@3"))
