"""Program `evaluate`: autoregressive vs speculative decoding over a prompt set.

For every (temperature, batch_size) it measures, in one process on the same prompts:
  * autoregressive decoding of the verifier (the speedup baseline),
  * autoregressive decoding of the drafter (to measure c = drafter step time / verifier call time),
  * speculative decoding for every γ in `eval.gammas`,
and writes one row per setting to `results.json` (metric names from DESIGN.md §3), a markdown
table `results.md` and PNG plots (τ vs γ, speedup vs γ). Timings exclude compilation: each
setting runs once on the first batch to compile before the timed pass.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import tqdm

from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding import speculative
from spec_jax.evaluation import benchmark as bench
from spec_jax.evaluation import report, theory
from spec_jax.models import loading
from spec_jax.programs import generate as generate_program


# Speculative methods by name; each row of results.json names one. Draft trees (RSD, SpecInfer,
# SpecTr) join this list with their own loop.
METHODS = ("sd",)


def _batches(tokenizer, texts, batch_size, max_prompt_tokens):
  """Prompt batches of exactly batch_size rows (the last one padded by repeating its last prompt;
  padded rows are dropped from every count)."""
  out = []
  for start in range(0, len(texts), batch_size):
    chunk = texts[start:start + batch_size]
    real = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - real)
    out.append((generate_lib.encode_prompts(tokenizer, chunk, max_prompt_tokens,
                                            field="eval.max_prompt_tokens"), real))
  return out


def _timed_pass(fn, batches, desc):
  """Compile on the first batch, then run every batch once, timed. Returns (outputs, seconds)."""
  jax.block_until_ready(fn(batches[0][0], 0))
  outputs, seconds = [], 0.0
  for i, (prompts, _) in enumerate(tqdm.tqdm(batches, desc=desc, leave=False)):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(prompts, i))
    seconds += time.perf_counter() - t0
    outputs.append(out)
  return outputs, seconds


def _new_tokens(outputs, batches):
  rows = []
  for out, (_, real) in zip(outputs, batches):
    rows += out.new_tokens()[:real]
  return rows


def _sum_stat(outputs, batches, name):
  return np.concatenate([np.asarray(getattr(o.stats, name))[:real]
                         for o, (_, real) in zip(outputs, batches)])


def _ar_step_seconds(outputs, seconds):
  """Wall time per forward call of an autoregressive pass (prefill counted as one call)."""
  return seconds / max(sum(int(o.steps) for o in outputs), 1)


def run(config, workdir: str) -> list[dict]:
  ev = config.eval
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed,
                                       field="verifier.checkpoint")
  d_cfg, d_params = loading.load_model(config.drafter, tokenizer, seed=config.seed + 1,
                                       field="drafter.checkpoint")
  speculative.check_pair(v_cfg, d_cfg)
  unknown = sorted(set(ev.methods) - set(METHODS))
  if unknown:
    raise ValueError(f"eval.methods has unknown methods {unknown}; known: {list(METHODS)} "
                     "(autoregressive, the baseline, always runs).")
  texts = generate_program.read_prompts(config, tokenizer)[:ev.num_prompts]
  stop_ids = tokenizer.stop_ids if ev.stop_at_eos else ()
  device = bench.device_description()
  rows = []
  for temperature in ev.temperatures:
    sampling = sampling_lib.Sampling(float(temperature), int(ev.top_k), float(ev.top_p))
    for batch_size in ev.batch_sizes:
      batches = _batches(tokenizer, texts, batch_size, ev.max_prompt_tokens)
      rng = jax.random.key(config.seed)
      common = dict(sampling=sampling, max_new_tokens=ev.new_tokens, stop_ids=stop_ids)
      label = f"T={temperature:g} B={batch_size}"

      def ar(params, cfg):
        return lambda prompts, i: generate_lib.generate(
            params, prompts, jax.random.fold_in(rng, i), cfg=cfg, **common)

      ar_out, ar_s = _timed_pass(ar(v_params, v_cfg), batches, f"{label} autoregressive")
      ar_tokens = _new_tokens(ar_out, batches)
      n_ar = sum(len(t) for t in ar_tokens)
      ar_tps = n_ar / ar_s
      d_out, d_s = _timed_pass(ar(d_params, d_cfg), batches, f"{label} drafter-only")
      c = _ar_step_seconds(d_out, d_s) / _ar_step_seconds(ar_out, ar_s)
      base = dict(temperature=float(temperature), top_k=int(ev.top_k), top_p=float(ev.top_p),
                  batch_size=batch_size, num_prompts=len(texts), device=device,
                  seed=config.seed, dataset=config.data.name, cost_ratio_c=round(c, 4),
                  verifier=config.verifier.checkpoint or config.verifier.size,
                  drafter=config.drafter.checkpoint or config.drafter.size)
      rows.append(dict(base, method="autoregressive", gamma=None, new_tokens=n_ar,
                       block_efficiency=1.0, mean_accepted_tokens=0.0, acceptance_rate=None,
                       empirical_acceptance=None, per_position_acceptance=None,
                       verifier_calls=sum(int(o.steps) for o in ar_out), drafter_calls=0,
                       tokens_per_s=round(ar_tps, 2), speedup=1.0, theoretical_speedup=1.0,
                       speedup_vs_theory=None, verifier_tokens_per_call=1,
                       identical_to_greedy=True if sampling.greedy else None))
      for method, gamma in [(m, g) for m in ev.methods for g in ev.gammas]:
        spec = speculative.SpecConfig(gamma=int(gamma), rule=ev.rule, lenience=ev.lenience,
                                      epsilon=float(ev.epsilon))
        fn = lambda prompts, i: speculative.speculative_generate(  # noqa: E731
            v_params, d_params, prompts, jax.random.fold_in(rng, i), verifier_cfg=v_cfg,
            drafter_cfg=d_cfg, spec=spec, max_cache_len=ev.max_cache_len, **common)
        sd_out, sd_s = _timed_pass(fn, batches, f"{label} {method} γ={gamma}")
        sd_tokens = _new_tokens(sd_out, batches)
        n_sd = sum(len(t) for t in sd_tokens)
        calls = int(_sum_stat(sd_out, batches, "verifier_calls").sum())
        reached = _sum_stat(sd_out, batches, "reached").sum(0)
        accepted_at = _sum_stat(sd_out, batches, "accepted_at").sum(0)
        tau = n_sd / max(calls, 1)
        alpha = float(_sum_stat(sd_out, batches, "alpha_sum").sum() / max(reached.sum(), 1))
        tps = n_sd / sd_s
        theoretical = theory.expected_speedup(alpha, int(gamma), c) if alpha < 1 else (
            (gamma + 1) / (gamma * c + 1))
        measured = tps / ar_tps
        rows.append(dict(
            base, method=method, gamma=int(gamma), rule=spec.rule,
            lenience=spec.lenience if spec.rule == "lenient" else None,
            epsilon=spec.epsilon if spec.rule == "lenient" else None, new_tokens=n_sd,
            block_efficiency=round(tau, 4), mean_accepted_tokens=round(tau - 1, 4),
            acceptance_rate=round(alpha, 4),
            empirical_acceptance=round(float(accepted_at.sum() / max(reached.sum(), 1)), 4),
            per_position_acceptance=[round(float(a / max(r, 1)), 4)
                                     for a, r in zip(accepted_at, reached)],
            verifier_calls=calls, drafter_calls=calls * int(gamma),
            tokens_per_s=round(tps, 2), speedup=round(measured, 4),
            theoretical_speedup=round(float(theoretical), 4),
            speedup_vs_theory=round(measured / float(theoretical), 4),
            verifier_tokens_per_call=int(gamma) + 1,
            identical_to_greedy=(sd_tokens == ar_tokens) if sampling.greedy else None))
      print(report.markdown_table([r for r in rows if r["temperature"] == float(temperature)
                                   and r["batch_size"] == batch_size]), flush=True)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
    f.write(config.to_json_best_effort(indent=2))
  bench.write_results(workdir, rows)
  report.write_report(workdir, rows, title=config.get("title", "spec_jax evaluation"),
                      config_text=str(config))
  return rows
