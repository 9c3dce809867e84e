"""Head analysis for BPD (Kim et al. 2024, §3): what the heads' block drafts look like and how
good their top-k lattice could be.

For each prompt the verifier decodes N tokens greedily (G, its own continuation), then one
teacher-forced pass over prompt + G gives its final residual x_i at every position i; head k at
x_i proposes the token at i + 1 + k. Measured over the positions of the continuation:
  head_entropy[k]      mean entropy (nats) of head k's law;
  repetition_rate      how often consecutive heads' argmax drafts repeat a token (x_k = x_{k+1}),
                       the block-draft failure mode the paper points out;
  topk_accuracy[k][j]  how often G's token is in head j's top-k;
  oracle_tau[k]        block efficiency of an oracle that accepts, every round, the longest prefix
                       of G whose j-th token is in head j's top-k (the best path among the k^h of
                       the lattice), with the verifier's own token as the bonus. With k = 1 it is
                       exactly the τ of greedy BPD decoding with chains of h drafts.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import bpd_heads, llama


def _oracle_rounds(top: np.ndarray, seq: np.ndarray, start: int, new_tokens: int) -> int:
  """Rounds an oracle needs to emit `new_tokens` tokens after the prompt, doing what the BPD
  drafter does: with ℓ tokens committed (G[ℓ − 1] the round's root) the heads read x at
  max(ℓ − 2, 0) and head j + 1 proposes the token at ℓ + j; the oracle accepts the longest prefix
  of G found in the heads' candidates. top int[T, A, k]: each head's top-k ids per position."""
  h = top.shape[1]
  length, rounds = start, 0
  while length - start < new_tokens:
    i = max(length - 2, 0)
    n = 0
    while n < h and length + n < len(seq) and seq[length + n] in top[i, n]:
      n += 1
    length += n + 1
    rounds += 1
  return rounds


def analyse(cfg: bpd_heads.BPDConfig, head_params, v_cfg, v_params,
            prompts: Sequence[Sequence[int]], new_tokens: int,
            ks: Sequence[int] = (1, 2, 4, 8)) -> dict:
  """The head statistics above over `prompts` (token id lists), each continued greedily by the
  verifier for `new_tokens` tokens (no stop tokens). Returns plain Python numbers:
  {"head_entropy": [h], "repetition_rate": float, "topk_accuracy": {k: [h]},
   "oracle_tau": {k: float}, "tokens": N per prompt, "prompts": count}."""
  ks = tuple(int(k) for k in ks)
  if min(ks) < 1:
    raise ValueError(f"ks={ks}: a lattice keeps k >= 1 candidates per head.")
  h = cfg.num_heads
  apply = jax.jit(llama.make_apply(v_cfg, (-1,)))
  out_params = bpd_heads.verifier_output(v_cfg, v_params)
  heads_fn = jax.jit(lambda p, x: bpd_heads.head_logits(cfg, p, v_cfg, out_params, x))
  entropy, repeats, pairs, n_positions = np.zeros(h), 0.0, 0, 0
  hits = {k: np.zeros(h) for k in ks}
  counts = np.zeros(h)
  rounds = {k: 0 for k in ks}
  # One padded width for every prompt (and the teacher-forced pass), so nothing recompiles per
  # prompt length; right padding never reaches an earlier position of a causal model.
  width = max(len(ids) for ids in prompts)
  for ids in prompts:
    ids = list(ids)
    start = len(ids)
    greedy = generate_lib.generate(
        v_params, generate_lib.pad_prompts([ids], width, 0), jax.random.key(0), cfg=v_cfg,
        sampling=Sampling(), max_new_tokens=new_tokens).new_tokens()[0]
    seq = np.asarray(ids + greedy, np.int32)
    padded = np.zeros(width + new_tokens, np.int32)
    padded[:len(seq)] = seq
    _, hidden, _ = apply(v_params, jnp.asarray(padded)[None], jnp.arange(len(padded))[None])
    logits = np.asarray(heads_fn(head_params, hidden[-1][0]))[:len(seq)]  # [T, A, V]
    # Positions whose heads draft inside the continuation: the roots at ℓ − 1 ≥ start − 1.
    pos = np.arange(start - 2 if start >= 2 else 0, len(seq) - 1)
    top = logits.max(-1, keepdims=True)
    log_q = logits - top - np.log(np.sum(np.exp(logits - top), -1, keepdims=True))
    q = np.exp(log_q)
    n_positions += len(pos)
    entropy += -np.sum(q[pos] * log_q[pos], axis=-1).sum(axis=0)
    drafts = np.argmax(logits, axis=-1)                                   # [T, A]
    repeats += float(np.sum(drafts[pos, 1:] == drafts[pos, :-1]))
    pairs += len(pos) * (h - 1)
    order = np.argsort(-logits, axis=-1)[..., :max(ks)]                 # [T, A, max k]
    for j in range(h):
      target_at = np.arange(len(seq)) + 2 + j                            # token head j+1 drafts
      ok = target_at < len(seq)
      targets = np.where(ok, seq[np.minimum(target_at, len(seq) - 1)], -1)
      for k in ks:
        member = np.any(order[:, j, :k] == targets[:, None], axis=-1) & ok
        hits[k][j] += member[pos].sum()
      counts[j] += ok[pos].sum()
    for k in ks:
      rounds[k] += _oracle_rounds(order[..., :k], seq, start, new_tokens)
  total_new = new_tokens * len(prompts)
  return {
      "head_entropy": (entropy / max(n_positions, 1)).round(4).tolist(),
      "repetition_rate": round(repeats / max(pairs, 1), 4),
      "topk_accuracy": {k: (hits[k] / np.maximum(counts, 1)).round(4).tolist() for k in ks},
      "oracle_tau": {k: round(total_new / rounds[k], 4) for k in ks},
      "tokens": new_tokens, "prompts": len(prompts)}
