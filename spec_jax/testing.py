"""Tiny models and exact laws shared by the tests (and handy in notebooks)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from spec_jax.decoding import sampling as sampling_lib
from spec_jax.models import llama


def tiny_model(seed: int = 0, vocab_size: int = 257, sharpness: float = 1.0, **overrides):
  """A 'test-tiny' Llama with random params. `sharpness` scales the tied embedding so next-token
  laws range from near-uniform (1) to peaked (~10), which statistical tests need."""
  cfg = llama.model_config("test-tiny", vocab_size=vocab_size, **overrides)
  params = llama.init_params(cfg, jax.random.key(seed))
  if sharpness != 1.0:
    params = {**params, "embed": {"embedding": params["embed"]["embedding"] * sharpness}}
  return cfg, params


def perturbed(params, sigma: float, seed: int = 1):
  """params + sigma * N(0, 1) noise: a drafter that agrees with its verifier often, not always."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
      treedef, [x + sigma * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def naive_greedy(cfg, params, prompt: list[int], n: int, width: int = 64) -> list[int]:
  """Greedy continuation by re-running the full causal forward each step (no cache at all).
  The sequence is right-padded to a fixed `width` (causality makes the padding invisible), so
  every step reuses one compiled forward."""
  if len(prompt) + n > width:
    raise ValueError(f"prompt + n = {len(prompt) + n} exceeds width={width}.")
  apply = jax.jit(llama.make_apply(cfg))
  seq = list(prompt)
  for _ in range(n):
    x = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
    logits, _, _ = apply(params, x, jnp.arange(width)[None])
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


def exact_sequence_law(cfg, params, prompt: list[int], n: int,
                       sampling: sampling_lib.Sampling) -> dict[tuple[int, ...], float]:
  """Exact probability of every n-token continuation under `sampling`, by enumeration
  (vocab_size ** n sequences; keep both small)."""
  apply = jax.jit(llama.make_apply(cfg))
  law = {}
  for seq in itertools.product(range(cfg.vocab_size), repeat=n):
    x = jnp.asarray([list(prompt) + list(seq)], jnp.int32)
    logits, _, _ = apply(params, x, jnp.arange(x.shape[1])[None])
    probs = sampling_lib.probs_from_logits(logits[0, len(prompt) - 1:-1], sampling)
    law[seq] = float(np.prod([probs[i, t] for i, t in enumerate(seq)]))
  return law


def chi_square_pvalue(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float],
                      min_expected: float = 5.0) -> float:
  """Pearson chi-square goodness of fit of `samples` to `law`, pooling cells whose expected count
  is below `min_expected` into one cell. A sample outside the law's support gives p = 0."""
  counts = {}
  for s in samples:
    if law.get(s, 0.0) <= 0.0:
      return 0.0
    counts[s] = counts.get(s, 0) + 1
  n = len(samples)
  obs, exp, pool_obs, pool_exp = [], [], 0.0, 0.0
  for key, prob in law.items():
    if prob * n >= min_expected:
      obs.append(counts.get(key, 0))
      exp.append(prob * n)
    else:
      pool_obs += counts.get(key, 0)
      pool_exp += prob * n
  if pool_exp > 0:
    obs.append(pool_obs)
    exp.append(pool_exp)
  if len(obs) < 2:  # a single cell holds all samples, and all of them are in the support
    return 1.0
  exp = np.asarray(exp) * (n / np.sum(exp))  # guard float drift in the law's total
  return float(stats.chisquare(obs, exp).pvalue)
