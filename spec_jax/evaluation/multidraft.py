"""Why the multi-draft rules accept different amounts: one tree level, k candidates, real laws.

At a tree node whose k children the drafter drew from its law q, with the verifier's law p
there, each verification rule accepts one of the children with probability
  SD           k = 1: β(p, q) = Σ_x min(p(x), q(x)) (every rule reduces to it);
  SpecInfer    k i.i.d. candidates, recursive rejection sampling with replacement (Miao et al.
               2024, `acceptance.tree` rule rrs_with): candidate i is tested against the residual
               the i − 1 rejections before it left, r_0 = p, r_{i+1} = norm((r_i − q)_+). That
               residual does not depend on which token was rejected, so
                   P = 1 − Π_{i<k} (1 − β(r_i, q));
  SpecTr       k i.i.d. candidates, K-SEQ (Sun et al. 2023, rule kseq): each accepted with
               min(1, p/(ρ q)), ρ ≥ 1 the smallest scale that keeps the emitted law exactly p:
                   P = 1 − (1 − β_ρ)^k,  β_ρ = Σ_x min(q(x), p(x)/ρ);
  RSD          k candidates without replacement (Gumbel-top-k; RSD-C's root, RSD-S's beam), with
               recursive rejection: x_i is tested against r_i with s_i = q renormalised over the
               tokens not drawn yet, r_{i+1} = norm((r_i − s_i)_+) (Jeon et al. 2024, rule
               rrs_without). P has no closed form: given the tokens rejected so far, the next
               rejection has probability 1 − β(r_i, s_i) exactly, so only which tokens were
               removed is sampled, `draws` paths per position (exact at k = 1).
All three are exact (they emit p); they differ only in how often a level accepts. A draft tree of
depth L multiplies one such probability per level, so a per-level gap grows with L.

`level_acceptance` takes laws; `analyse` teacher-forces a verifier and a drafter over texts
(e.g. the verifier's own samples) and averages over the generated positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from spec_jax.decoding.acceptance import kseq, residuals
from spec_jax.models import llama

RULES = ("sd", "specinfer", "spectr", "rsd")
# The differences `analyse` reports with their paired standard errors.
PAIRS = (("spectr", "specinfer"), ("rsd", "specinfer"))


def _miss_with_replacement(p, q, k: int):
  """Π_{i<k} (1 − β(r_i, q)), r_0 = p, r_{i+1} = residual_update(r_i, q)."""
  def step(carry, _):
    r, miss = carry
    beta = residuals.acceptance_rate(r, q)
    return (residuals.residual_update(r, q), miss * (1.0 - beta)), None
  (_, miss), _ = jax.lax.scan(step, (p, jnp.ones(p.shape[:-1], jnp.float32)), None, length=k)
  return miss


def _miss_without_replacement(p, q, k: int, rng, draws: int):
  """P(all k candidates rejected) for RSD's rule: Π_i (1 − β(r_i, s_i)) along a path of
  rejected candidates, averaged over `draws` paths. Given the tokens rejected so far, the chance
  that candidate i is rejected is exactly 1 − β(r_i, s_i), and a rejected candidate is x with
  probability (s_i − r_i)_+(x) / (1 − β(r_i, s_i)); only which tokens were removed from s is
  sampled (k = 1 is exact)."""
  def one(key):
    def step(carry, key_i):
      r, s, miss = carry
      beta = residuals.acceptance_rate(r, s)
      # The rejected candidate, by inverse CDF (one uniform per position, not one per token).
      # Nothing left to reject with (β = 1: miss is 0 from here on) gives token 0: any will do.
      cdf = jnp.cumsum(jnp.maximum(s - r, 0.0), axis=-1)
      u = jax.random.uniform(key_i, cdf.shape[:-1]) * cdf[..., -1]
      x = jnp.minimum(jnp.sum(cdf < u[..., None], axis=-1), cdf.shape[-1] - 1)
      return (residuals.residual_update(r, s), residuals.remove_token(s, x),
              miss * (1.0 - beta)), None
    init = (p, q, jnp.ones(p.shape[:-1], jnp.float32))
    (_, _, miss), _ = jax.lax.scan(step, init, jax.random.split(key, k))
    return miss
  return jnp.mean(jax.lax.map(one, jax.random.split(rng, draws)), axis=0)


@functools.partial(jax.jit, static_argnames=("k", "draws"))
def level_acceptance(p: jax.Array, q: jax.Array, rng: jax.Array, *, k: int,
                     draws: int = 16) -> dict[str, jax.Array]:
  """Per position, the probability that one level with k candidates accepts one, per rule (see
  the module docstring), plus SpecTr's ρ. p, q f32[..., V] (laws); k ≥ 1 static. Returns
  {"sd", "specinfer", "spectr", "rsd", "rho"}: f32[...] each ("sd" is β, the k = 1 value)."""
  p, q = p.astype(jnp.float32), q.astype(jnp.float32)
  rho = kseq.kseq_rho(p, q, jnp.full(p.shape[:-1], k, jnp.float32))
  beta_rho = jnp.sum(jnp.minimum(q, p / rho[..., None]), axis=-1)
  return {"sd": residuals.acceptance_rate(p, q),
          "specinfer": 1.0 - _miss_with_replacement(p, q, k),
          "spectr": 1.0 - (1.0 - beta_rho) ** k,
          "rsd": 1.0 - _miss_without_replacement(p, q, k, rng, draws),
          "rho": rho}


@functools.partial(jax.jit, static_argnames=("v_cfg", "d_cfg"))
def _laws(v_params, d_params, tokens, *, v_cfg, d_cfg):
  """The T = 1 laws of both models at every position of tokens [B, S] (predicting t + 1)."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  v_logits = llama.make_apply(v_cfg)(v_params, tokens, positions)[0]
  d_logits = llama.make_apply(d_cfg)(d_params, tokens, positions)[0]
  return jax.nn.softmax(v_logits.astype(jnp.float32)), jax.nn.softmax(d_logits.astype(jnp.float32))


def analyse(v_params, v_cfg: llama.LlamaConfig, d_params, d_cfg: llama.LlamaConfig, outputs,
            *, ks=(1, 2, 3), draws: int = 16, seed: int = 0, chunk: int = 64,
            real_rows=None, desc: str | None = None) -> dict:
  """Mean per-level acceptance per rule and k over the generated positions of `outputs`
  (generate outputs: tokens [B, S], prompt_lengths [B], lengths [B]), each with its standard
  error over rows (a row's positions are correlated; rows are independent samples).
  real_rows: per output, how many leading rows are real prompts (the rest batch padding).
  desc: a progress bar's label (None: no bar).

  Returns {"k": [...], "positions": n, "rows": m, "<rule>": [mean per k],
  "<rule>_se": [...], "rho": [mean ρ per k], "<a>_minus_<b>": [mean per k] and its "_se" for
  each pair in PAIRS (the standard error of the per-row differences: the rules see the same
  positions, so a difference is far more precise than either value)."""
  per_row = {name: {k: [] for k in ks} for name in (*RULES, "rho")}
  rng = jax.random.key(seed)
  positions = 0
  quiet = desc is None or jax.process_index() != 0  # one bar: process 0's
  for i, out in enumerate(tqdm.tqdm(outputs, desc=desc, disable=quiet, leave=False)):
    tokens = np.asarray(out.tokens)
    plens, lens = np.asarray(out.prompt_lengths), np.asarray(out.lengths)
    p_all, q_all = _laws(v_params, d_params, jnp.asarray(tokens), v_cfg=v_cfg, d_cfg=d_cfg)
    for b in range(tokens.shape[0] if real_rows is None else int(real_rows[i])):
      # The law at position t - 1 is the one token t was drawn from: generated t ∈ [plen, len).
      idx = np.arange(int(plens[b]) - 1, int(lens[b]) - 1)
      if idx.size == 0:
        continue
      positions += idx.size
      sums = {name: {k: 0.0 for k in ks} for name in per_row}
      for start in range(0, idx.size, chunk):
        sel = idx[start:start + chunk]
        pad = chunk - sel.size  # one compiled shape: pad with the last position, weight 0
        sel_p = np.concatenate([sel, np.full(pad, sel[-1])])
        weight = np.concatenate([np.ones(sel.size), np.zeros(pad)])
        p, q = p_all[b, sel_p], q_all[b, sel_p]
        for k in ks:
          rng, sub = jax.random.split(rng)
          acc = jax.device_get(level_acceptance(p, q, sub, k=int(k), draws=draws))
          for name in per_row:
            sums[name][k] += float(np.sum(np.asarray(acc[name]) * weight))
      for name in per_row:
        for k in ks:
          per_row[name][k].append(sums[name][k] / idx.size)
  result = {"k": [int(k) for k in ks], "positions": positions,
            "rows": len(per_row["sd"][ks[0]]), "draws": draws}
  for name, by_k in per_row.items():
    means = [float(np.mean(by_k[k])) if by_k[k] else float("nan") for k in ks]
    result[name] = [round(m, 4) for m in means]
    if name != "rho":
      result[f"{name}_se"] = [round(_se(by_k[k]), 4) for k in ks]
  for a, b in PAIRS:
    diffs = {k: np.subtract(per_row[a][k], per_row[b][k]) for k in ks}
    result[f"{a}_minus_{b}"] = [round(float(np.mean(diffs[k])), 5) if len(diffs[k]) else
                                float("nan") for k in ks]
    result[f"{a}_minus_{b}_se"] = [round(_se(diffs[k]), 5) for k in ks]
  return result


def _se(values) -> float:
  """Standard error of the mean over rows (0 for fewer than two)."""
  values = np.asarray(values, np.float64)
  return float(np.std(values, ddof=1) / np.sqrt(values.size)) if values.size > 1 else 0.0
