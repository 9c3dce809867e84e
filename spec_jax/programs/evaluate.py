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
from spec_jax.decoding import tree_speculative
from spec_jax.decoding import trees
from spec_jax.evaluation import benchmark as bench
from spec_jax.evaluation import quality, report, theory
from spec_jax.models import loading
from spec_jax.programs import generate as generate_program


# Speculative methods by name; each row of results.json names one. "sd" is the chain loop
# (speculative.py); the tree methods run in tree_speculative.py.
METHODS = ("sd", *trees.TREE_METHODS)


def parse_method(entry: str, depth: int | None, default_width: int):
  """One eval.methods entry → (method, draft depth, TreeSpec or None for a chain).

  Grammar: NAME[:SHAPE][@L]. SHAPE is K (chains for specinfer/spectr), W (rsd_s beam width) or
  b1-b2-... (rsd_c branching, padded with 1s to depth L); without it K = W = eval.tree_width and
  rsd_c branches eval.tree_width ways at the root only, so all tree methods spend the same
  1 + width·L verifier tokens per call. @L fixes the depth for this entry; otherwise the depth is
  each of eval.gammas in turn (`depth`)."""
  head, _, at = entry.partition("@")
  name, _, shape = head.partition(":")
  if name not in METHODS:
    raise ValueError(f"eval.methods entry {entry!r}: unknown method {name!r}; known: "
                     f"{list(METHODS)} (autoregressive, the baseline, always runs).")
  try:
    depth = int(at) if at else depth
    ints = tuple(int(x) for x in shape.split("-")) if shape else ()
  except ValueError:
    raise ValueError(f"eval.methods entry {entry!r} does not parse; write NAME[:SHAPE][@L], e.g. "
                     "'rsd_c:3-2@4', 'rsd_s:4', 'spectr:3@2', 'sd@6'.") from None
  if name == "sd":
    if shape:
      raise ValueError(f"eval.methods entry {entry!r}: chain SD takes no shape, only @γ.")
    return name, depth, None
  if name != "rsd_c" and len(ints) > 1:
    raise ValueError(f"eval.methods entry {entry!r}: {name} takes one width, got {shape!r}.")
  if name == "rsd_c":
    spec = trees.TreeSpec(name, depth=depth, branching=ints or (int(default_width),))
  else:
    spec = trees.TreeSpec(name, depth=depth, width=ints[0] if ints else int(default_width))
  return name, depth, spec


def method_runs(ev) -> list[tuple[str, str, int, object]]:
  """(label, method, depth, TreeSpec | None) for every run eval.methods × eval.gammas asks for
  (entries with @L run once). Shapes are validated here, before anything is loaded."""
  runs = []
  for entry in ev.methods:
    depths = [None] if "@" in entry else list(ev.gammas)
    for depth in depths:
      name, d, spec = parse_method(entry, depth, ev.tree_width)
      runs.append((entry.partition("@")[0], name, d, spec))
  return runs


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


def _quality(v_params, d_params, outputs, batches, **kwargs) -> dict:
  """verifier_loglik and token_tv (spec_jax.evaluation.quality) over the real rows."""
  return quality.summarize(
      {k: v[:real] for k, v in quality.quality_sums(v_params, d_params, out, **kwargs).items()}
      for out, (_, real) in zip(outputs, batches))


def _epsilons(ev, tree) -> tuple:
  """ε values to sweep for one run: eval.epsilons (if set) for lenient chain SD, else ε."""
  if tree is None and ev.rule == "lenient" and ev.get("epsilons"):
    return tuple(ev.epsilons)
  return (ev.epsilon,)


def run(config, workdir: str) -> list[dict]:
  ev = config.eval
  runs = method_runs(ev)  # bad method entries fail before anything is loaded
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed,
                                       field="verifier.checkpoint")
  d_cfg, d_params = loading.load_model(config.drafter, tokenizer, seed=config.seed + 1,
                                       field="drafter.checkpoint")
  speculative.check_pair(v_cfg, d_cfg)
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
      ar_quality = _quality(v_params, None, ar_out, batches, verifier_cfg=v_cfg,
                            drafter_cfg=None, sampling=sampling)
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
                       identical_to_greedy=True if sampling.greedy else None,
                       verifier_loglik=round(ar_quality["verifier_loglik"], 4), token_tv=None))
      for (label_m, method, gamma, tree), epsilon in [(r, e) for r in runs
                                                      for e in _epsilons(ev, r[3])]:
        spec = speculative.SpecConfig(gamma=int(gamma), rule=ev.rule, lenience=ev.lenience,
                                      epsilon=float(epsilon))
        if tree is None:
          fn = lambda prompts, i: speculative.speculative_generate(  # noqa: E731
              v_params, d_params, prompts, jax.random.fold_in(rng, i), verifier_cfg=v_cfg,
              drafter_cfg=d_cfg, spec=spec, max_cache_len=ev.max_cache_len, **common)
        else:
          decode = tree_speculative.TreeDecode(tree, ev.tree_rule)
          fn = lambda prompts, i: tree_speculative.tree_generate(  # noqa: E731
              v_params, d_params, prompts, jax.random.fold_in(rng, i), verifier_cfg=v_cfg,
              drafter_cfg=d_cfg, decode=decode, max_cache_len=ev.max_cache_len, **common)
        sd_out, sd_s = _timed_pass(fn, batches, f"{label} {label_m} γ={gamma}")
        sd_tokens = _new_tokens(sd_out, batches)
        n_sd = sum(len(t) for t in sd_tokens)
        calls = int(_sum_stat(sd_out, batches, "verifier_calls").sum())
        reached = _sum_stat(sd_out, batches, "reached").sum(0)
        accepted_at = _sum_stat(sd_out, batches, "accepted_at").sum(0)
        tau = n_sd / max(calls, 1)
        alpha = float(_sum_stat(sd_out, batches, "alpha_sum").sum() / max(reached.sum(), 1))
        tps = n_sd / sd_s
        if tree is not None:  # no closed form for trees: τ measured, L drafter calls per round
          theoretical = tau / (gamma * c + 1)
        elif alpha < 1:
          theoretical = theory.expected_speedup(alpha, int(gamma), c)
        else:
          theoretical = (gamma + 1) / (gamma * c + 1)
        measured = tps / ar_tps
        lenient = tree is None and spec.rule == "lenient"
        # Quality cost of lossy decoding: the one-step law of the chain rule vs p (trees: their
        # rules are lossless, so only the log-likelihood is reported).
        sd_quality = _quality(v_params, d_params, sd_out, batches, verifier_cfg=v_cfg,
                              drafter_cfg=d_cfg, sampling=sampling,
                              **(dict(lenience=spec.lenience, epsilon=spec.epsilon) if lenient
                                 else {}))
        rows.append(dict(
            base, method=method, gamma=int(gamma),
            rule=spec.rule if tree is None else decode.rule_name(sampling),
            tree=None if tree is None else tree.describe(),
            lenience=spec.lenience if lenient else None,
            epsilon=spec.epsilon if lenient else None, new_tokens=n_sd,
            block_efficiency=round(tau, 4), mean_accepted_tokens=round(tau - 1, 4),
            acceptance_rate=round(alpha, 4),
            empirical_acceptance=round(float(accepted_at.sum() / max(reached.sum(), 1)), 4),
            per_position_acceptance=[round(float(a / max(r, 1)), 4)
                                     for a, r in zip(accepted_at, reached)],
            verifier_calls=calls, drafter_calls=calls * int(gamma),
            drafter_calls_per_round=int(gamma),
            tokens_per_s=round(tps, 2), speedup=round(measured, 4),
            theoretical_speedup=round(float(theoretical), 4),
            speedup_vs_theory=round(measured / float(theoretical), 4),
            verifier_tokens_per_call=int(gamma) + 1 if tree is None else tree.num_nodes,
            identical_to_greedy=(sd_tokens == ar_tokens) if sampling.greedy else None,
            verifier_loglik=round(sd_quality["verifier_loglik"], 4),
            token_tv=round(sd_quality["token_tv"], 5) if tree is None else None))
      print(report.markdown_table([r for r in rows if r["temperature"] == float(temperature)
                                   and r["batch_size"] == batch_size]), flush=True)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
    f.write(config.to_json_best_effort(indent=2))
  bench.write_results(workdir, rows)
  report.write_report(workdir, rows, title=config.get("title", "spec_jax evaluation"),
                      config_text=str(config))
  return rows
