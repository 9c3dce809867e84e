"""Program `benchmark_sampling`: the cost of exact draws, against the pre-fix samplers, measured
in the same run (rows in `workdir/results.json`).

Rows per batch size B and vocabulary V (SmolLM2's 49,152 by default), median milliseconds of one
jitted call on a random law, the two methods taking turns (`timing.round_robin`):
  sample         `sampling.sample` (two-stage Gumbel-max, high-range noise) vs the pre-fix draw
                 (one low-range Gumbel per token, = `jax.random.categorical`'s noise);
  gumbel_top_k   `trees.gumbel_top_k` (top-down, k = 4) vs the pre-fix top-k of perturbed scores;
  law_check      the per-round check for broken laws on a γ = 4 chain's [B, 5, V] logits, fused
                 with the verifier law it checks as in the loop: `ms` is the law and the check,
                 `baseline_ms` the law alone.
`ratio` = new / baseline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax import checks
from spec_jax.decoding import sampling
from spec_jax.decoding.drafters import trees
from spec_jax.evaluation import report, timing


def _old_sample(key, probs):
  logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
  return sampling.first_argmax(logp + jax.random.gumbel(key, logp.shape, jnp.float32))


def _old_gumbel_top_k(key, scores, k):
  scores = scores - jax.nn.logsumexp(scores, axis=-1, keepdims=True)
  values, idx = jax.lax.top_k(scores + jax.random.gumbel(key, scores.shape, jnp.float32), k)
  return idx, values


def check_config(b) -> None:
  """The benchmark section's sizes, each named when no law could have it."""
  checks.integers(b.batch_sizes, "benchmark.batch_sizes")
  for name in ("vocab_size", "top_k", "repeats"):
    checks.integer(b[name], f"benchmark.{name}")
  if b.top_k > b.vocab_size:
    raise ValueError(f"benchmark.top_k={b.top_k} exceeds benchmark.vocab_size={b.vocab_size}: "
                     "gumbel_top_k draws that many distinct tokens.")


def run(config, workdir: str) -> list[dict]:
  b = config.benchmark
  check_config(b)
  device = timing.device_description()
  rows = []
  for batch_size in b.batch_sizes:
    logits = 3.0 * jax.random.normal(jax.random.key(config.seed), (batch_size, b.vocab_size))
    probs = jax.nn.softmax(logits, axis=-1)
    key = jax.random.key(config.seed + 1)
    pairs = {
        "sample": (jax.jit(sampling.sample), jax.jit(_old_sample), probs),
        "gumbel_top_k": (jax.jit(lambda k_, x: trees.gumbel_top_k(k_, x, b.top_k)),
                         jax.jit(lambda k_, x: _old_gumbel_top_k(k_, x, b.top_k)), logits),
    }
    for site, (new, old, x) in pairs.items():
      t = timing.round_robin({"new": lambda: new(key, x), "old": lambda: old(key, x)}, b.repeats)
      rows.append(dict(site=site, batch_size=batch_size, vocab_size=b.vocab_size,
                       ms=round(1e3 * t["new"]["median_s"], 4),
                       baseline_ms=round(1e3 * t["old"]["median_s"], 4),
                       ratio=round(t["new"]["median_s"] / t["old"]["median_s"], 3),
                       repeats=b.repeats, device=device))
    nodes = jnp.broadcast_to(logits[:, None], (batch_size, 5, b.vocab_size))
    s = sampling.Sampling(1.0)
    law = jax.jit(lambda z: sampling.probs_from_logits(z, s))
    check = jax.jit(lambda z: (lambda p: (p, sampling.law_status(z, p)))(law(z)))
    t = timing.round_robin({"check": lambda: check(nodes), "law": lambda: law(nodes)}, b.repeats)
    rows.append(dict(site="law_check", batch_size=batch_size, vocab_size=b.vocab_size,
                     ms=round(1e3 * t["check"]["median_s"], 4),
                     baseline_ms=round(1e3 * t["law"]["median_s"], 4),
                     ratio=round(t["check"]["median_s"] / t["law"]["median_s"], 3),
                     repeats=b.repeats, device=device))
  report.write_results(workdir, rows)
  for row in rows:
    print(row)
  return rows
