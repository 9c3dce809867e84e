"""Program `bpd_experiment`: blockwise parallel decoding (Stern et al. 2018) and the draft
refinements of Kim et al. 2024 ("Exploring and Improving Drafts in Blockwise Parallel
Decoding") at small scale.

  python launch.py --config experiments/bpd/config.py --workdir experiments/bpd

For every dataset in `datasets` and head count h in `heads`:
  1. the heads: `heads_checkpoints[f"{dataset}_h{h}"]`, else train_bpd trains h heads on the
     dataset into <workdir>/runs/heads_<dataset>_h<h> (config: the `train` section);
  2. one `evaluate` run per temperature into <workdir>/runs/eval_<dataset>_h<h>_T<t>: plain BPD
     chains of h (rows `bpd`), the static lattice tree `tree` (rows `bpd_tree`), the n-gram
     rescored lattice paths bpd_ngram:P and beam trees bpd_ngram_beam:W (`ngram_paths`,
     `ngram_beams`; greedy only) and the LM-rescored chains bpd_neural,
     beside the verifier's autoregressive baseline measured in the same process;
  3. the head analysis (spec_jax.evaluation.bpd_analysis) on the same prompts, cached in
     <workdir>/runs/analysis_<dataset>_h<h>/analysis.json: its lattice oracle τ at the decoded
     lattice's k (`top_k`, or `top_k_per_heads["h<h>"]`; a fixed `oracle_k` if nonzero)
     becomes a `bpd_oracle` row (no decoding: an upper bound for any rescoring of the lattice).
Every finished piece is read back instead of redone (an evaluate run only while its config is
unchanged), so a killed experiment resumes, and `render_only` reports what has finished without
running anything. `carry` (keys "<dataset>_h<h>") takes those settings' rows from the
results.json at `carry_from` instead of running them (an earlier run whose heads or run
directories are gone); results.md says which rows were carried and from where. Writes
results.json (rows named as in the glossary, plus heads, p, the gain over plain BPD and the
per-head analysis), results.md (tables, the papers' numbers, the issue's goals checked on the
measured rows) and tau_by_method.png, oracle_vs_k.png, entropy_repetition.png.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re

from absl import logging
import jax
import ml_collections

from spec_jax import loading
from spec_jax.data import corpora
from spec_jax.data import prompts as prompts_lib
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding.drafters import bpd as bpd_drafter
from spec_jax.decoding.drafters import lattice
from spec_jax.evaluation import bpd_analysis, bpd_report, report
from spec_jax.programs import evaluate, train_bpd

# -- configuration ---------------------------------------------------------------------------


_heads_key = bpd_report.heads_key


def heads_dir(config, workdir: str, dataset: str, h: int) -> tuple[str, bool]:
  """(the heads' train_bpd workdir, whether heads_checkpoints gave it)."""
  key = _heads_key(dataset, h)
  if key in config.heads_checkpoints:
    return str(config.heads_checkpoints[key]), True
  return os.path.join(workdir, "runs", f"heads_{key}"), False


def _newest_step(path: str | None) -> int | None:
  """The newest checkpoint step of a train_bpd workdir (None: none yet)."""
  ckpts = os.path.join(path, "checkpoints") if path else ""
  steps = [int(n) for n in os.listdir(ckpts) if n.isdigit()] if os.path.isdir(ckpts) else []
  return max(steps, default=None)


def train_config(config, dataset: str, h: int):
  """train_bpd's config for h heads on `dataset`: the `train` section with the shared fields."""
  cfg = copy.deepcopy(config.train)
  cfg.program = "train_bpd"
  cfg.seed, cfg.tokenizer = config.seed, config.tokenizer
  cfg.verifier = copy.deepcopy(config.verifier)
  cfg.data.name = dataset
  cfg.bpd.num_heads = int(h)
  steps = int(config.train_steps)
  # The section's warmup was sized for its own step count; never warm up past a tenth of ours.
  cfg.train.update(num_steps=steps,
                   warmup_steps=min(int(cfg.train.warmup_steps), max(steps // 10, 1)))
  return cfg


def lattice_k(config, h: int) -> int:
  """The lattice's k for h heads: `top_k_per_heads[f"h{h}"]` if given, else `top_k`."""
  return int(config.top_k_per_heads.get(f"h{int(h)}", config.top_k))


def oracle_k(config, h: int) -> int:
  """The k of the bpd_oracle row for h heads: `oracle_k`, or the decoded lattice's k if 0."""
  return int(config.oracle_k) or lattice_k(config, h)


def eval_methods(config, h: int, temperature: float) -> tuple[str, ...]:
  """evaluate's eval.methods for one run: bpd_ngram(_beam) verifies a deterministic set of paths
  (no exact law), so it runs at T = 0 only (evaluate refuses it otherwise)."""
  entries = [f"sd@{h}", f"{config.tree}@{h}"]
  if float(temperature) == 0.0:
    entries += [f"bpd_ngram:{int(p)}@{h}" for p in config.ngram_paths]
    entries += [f"bpd_ngram_beam:{int(w)}@{h}" for w in config.get("ngram_beams", ())]
  return tuple(entries + [f"bpd_neural@{h}"])


def eval_config(config, dataset: str, h: int, temperature: float, heads: str):
  """evaluate's config for one (dataset, h, T) run with `heads` as the drafter."""
  cfg = copy.deepcopy(config.eval)
  cfg.program = "evaluate"  # what the run dir's config.json records
  cfg.seed, cfg.tokenizer = config.seed, config.tokenizer
  cfg.verifier = copy.deepcopy(config.verifier)
  # The heads' step in the title: a run's config.json then changes when the heads train on, so
  # the experiment decodes again instead of reading back rows of older heads.
  cfg.title = (f"{config.title}: {dataset}, h = {h} (step {_newest_step(heads)}), "
               f"T = {float(temperature):g}")
  cfg.data.name = dataset
  cfg.drafter.checkpoint = heads
  cfg.num_data_prompts = int(config.num_prompts)
  cfg.eval.update(methods=eval_methods(config, h, temperature), gammas=(int(h),),
                  temperatures=(float(temperature),), batch_sizes=(int(config.batch_size),),
                  num_prompts=int(config.num_prompts), new_tokens=int(config.new_tokens))
  cfg.eval.bpd.update(top_k=lattice_k(config, h), ngram=dataset,
                      ngram_weight=float(config.ngram_weight),
                      rescorer_weight=float(config.rescorer_weight))
  cfg.eval.bpd.rescorer = copy.deepcopy(config.rescorer)
  return cfg


# Values an error message suggests for an empty list field.
_EXAMPLES = dict(datasets=("spec_jax_shakespeare",), heads=(3,), temperatures=(0.0,),
                 analysis_ks=(1, 2, 4, 8), ngram_paths=(4, 16))


def check_config(config, workdir: str) -> None:
  """Every field, and every train / evaluate config the experiment will run, checked before
  anything trains or loads (one error naming the field and the fix)."""
  for field in ("datasets", "heads", "temperatures", "analysis_ks", "ngram_paths"):
    if not tuple(config[field]):
      raise ValueError(f"{field} is empty: give at least one value "
                       f"(e.g. --config.{field}=\"{tuple(_EXAMPLES[field])}\").")
  for d in config.datasets:
    if d not in corpora.NAMES:
      raise ValueError(f"datasets has {d!r}, which is not one of this repo's corpora "
                       f"{list(corpora.NAMES)}. Fix: --config.datasets=\"('spec_jax_shakespeare',)"
                       "\" or another of those names.")
  for h in config.heads:
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
      raise ValueError(f"heads has {h!r}: a BPD drafter needs an integer h >= 1 heads. Fix: "
                       "--config.heads=\"(3, 5)\".")
  for t in config.temperatures:
    if float(t) < 0:
      raise ValueError(f"temperatures has {t}: a temperature must be >= 0 (0 = greedy). Fix: "
                       "--config.temperatures=\"(0.0, 1.0)\".")
  for name in ("train_steps", "num_prompts", "new_tokens", "batch_size", "top_k"):
    if int(config[name]) < 1:
      raise ValueError(f"{name}={config[name]} must be >= 1.")
  for key, k in config.top_k_per_heads.items():
    if not re.fullmatch(r"h[1-9][0-9]*", key) or isinstance(k, bool) or not isinstance(k, int) \
        or k < 1:
      raise ValueError(f"top_k_per_heads has {key!r}: {k!r}; entries are 'h<heads>': k >= 1 "
                       "(e.g. --config.top_k_per_heads='{\"h5\": 8}').")
  if min(int(k) for k in config.analysis_ks) < 1 or int(config.oracle_k) < 0:
    raise ValueError(f"analysis_ks={tuple(config.analysis_ks)} must all be >= 1 and "
                     f"oracle_k={config.oracle_k} >= 0 (0: each h's decoded k).")
  for h in config.heads:
    k = lattice_k(config, h)
    if oracle_k(config, h) not in config.analysis_ks:
      raise ValueError(f"oracle_k={config.oracle_k} gives k = {oracle_k(config, h)} for h = {h}, "
                       f"which is not in analysis_ks={tuple(config.analysis_ks)}. Fix: add it "
                       "to analysis_ks, or set oracle_k to one of them.")
    for p in config.ngram_paths:
      most = lattice.max_paths(h, k)
      if not 1 <= int(p) <= most:
        raise ValueError(f"ngram_paths has {p}, but h = {h} heads with a top-{k} lattice give "
                         f"{most} scored lattice paths (k^h, at most {lattice.MAX_PATHS}). Fix: "
                         f"ngram_paths entries in [1, {most}], or raise top_k "
                         f"(top_k_per_heads['h{h}'] for h = {h} alone).")
  for key in config.heads_checkpoints:
    match = re.fullmatch(r"(.+)_h([1-9][0-9]*)", key)
    if not match or match.group(1) not in corpora.NAMES:
      raise ValueError(f"heads_checkpoints has the key {key!r}; keys are '<dataset>_h<heads>' "
                       "(e.g. 'spec_jax_shakespeare_h3') with a dataset of "
                       f"{list(corpora.NAMES)}.")
  for key in bpd_report.carried(config):
    if key not in [_heads_key(d, h) for d in config.datasets for h in config.heads]:
      raise ValueError(f"carry has {key!r}, which is not one of this config's settings "
                       "'<dataset>_h<heads>' (datasets × heads).")
  carried_rows(config)
  for dataset in config.datasets:
    for h in config.heads:
      if _heads_key(dataset, h) in bpd_report.carried(config):
        continue
      path, given = heads_dir(config, workdir, dataset, h)
      if given and not config.render_only:
        _check_heads(path, h, f"heads_checkpoints[{_heads_key(dataset, h)!r}]")
      if not given:
        train_bpd.check_config(train_config(config, dataset, h))
      for t in config.temperatures:
        cfg = eval_config(config, dataset, h, t, path)
        try:
          evaluate.check_config(cfg, _eval_dir(workdir, dataset, h, t),
                                evaluate.method_runs(cfg.eval))
        except ValueError as e:
          raise ValueError(f"The evaluate run for {dataset}, h = {h}, T = {float(t):g} "
                           f"(built from this config's tree, top_k, weights, num_prompts, "
                           f"new_tokens and `eval` section): {e}") from None


def _check_heads(path: str, h: int, field: str) -> None:
  """A given heads checkpoint exists, is a train_bpd checkpoint, and has at least h heads."""
  if not os.path.isdir(path):
    raise ValueError(f"{field}={path!r} does not exist. Fix: train it (configs/train_bpd.py) or "
                     "drop the entry so the experiment trains the heads itself.")
  b_cfg = loading.drafter_bpd(ml_collections.ConfigDict(dict(checkpoint=path)))
  if b_cfg is None or b_cfg.num_heads < h:
    raise ValueError(f"{field}={path!r} holds "
                     f"{'no BPD heads' if b_cfg is None else f'{b_cfg.num_heads} heads'}, not "
                     f"{h}. Fix: a train_bpd workdir with {h} heads, or drop the entry.")


# -- the runs --------------------------------------------------------------------------------


def _eval_dir(workdir: str, dataset: str, h: int, temperature: float) -> str:
  return os.path.join(workdir, "runs", f"eval_{dataset}_h{h}_T{float(temperature):g}")


def train_heads(config, workdir: str, dataset: str, h: int) -> str | None:
  """The heads' directory, trained first if needed (None: untrained under render_only)."""
  path, given = heads_dir(config, workdir, dataset, h)
  if given or (_newest_step(path) or 0) >= int(config.train_steps):
    return path
  if config.render_only:
    return None
  cfg = train_config(config, dataset, h)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    f.write(cfg.to_json_best_effort(indent=2))  # the record launch.py would have written
  logging.info("Training %d BPD heads on %s for %d steps in %s.", h, dataset,
               config.train_steps, path)
  train_bpd.run(cfg, path)
  return path


def _read_text(path: str) -> str | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return f.read()


def evaluate_heads(config, workdir: str, dataset: str, h: int, temperature: float,
                   heads: str | None) -> list[dict]:
  """evaluate's rows for one (dataset, h, T): read back when its results.json exists and its
  config is the one this experiment would run (under render_only: whenever it exists)."""
  run_dir = _eval_dir(workdir, dataset, h, temperature)
  done = os.path.join(run_dir, "results.json")
  cfg = eval_config(config, dataset, h, temperature, heads or "")
  same = _read_text(os.path.join(run_dir, "config.json")) == cfg.to_json_best_effort(indent=2)
  if os.path.exists(done) and (same or config.render_only):
    return report.load_rows(done)
  if config.render_only or heads is None:
    return []
  logging.info("Evaluating %s, h = %d, T = %g: %s into %s.", dataset, h, temperature,
               ", ".join(cfg.eval.methods), run_dir)
  return evaluate.run(cfg, run_dir)


def _prompt_ids(cfg, tokenizer) -> list[list[int]]:
  """The token ids of the prompts evaluate decodes with `cfg` (its own rules, in its order)."""
  ev = cfg.eval
  n = int(cfg.get("num_data_prompts", 0))
  texts = prompts_lib.take(
      prompts_lib.read_prompts(cfg, tokenizer,
                               num_data_prompts=max(int(ev.num_prompts), n) if n else None),
      int(ev.num_prompts), "num_prompts")
  return tokenizer.encode_batch(texts)


def analyse_heads(config, workdir: str, dataset: str, h: int, heads: str | None,
                  verifier: dict) -> dict | None:
  """bpd_analysis.analyse on the evaluate runs' prompts, cached in the run dir with the
  settings it was computed for (a change of any recomputes it). `verifier` caches the loaded
  verifier across calls."""
  path = os.path.join(workdir, "runs", f"analysis_{dataset}_h{h}", "analysis.json")
  key = dict(heads=heads, heads_step=_newest_step(heads), num_prompts=int(config.num_prompts),
             new_tokens=int(config.new_tokens), ks=[int(k) for k in config.analysis_ks],
             data_prompt_tokens=int(config.eval.data_prompt_tokens), seed=int(config.seed),
             verifier=bpd_report.model_name(config.verifier), tokenizer=str(config.tokenizer))
  saved = _read_text(path)
  saved = json.loads(saved) if saved else None
  if saved is not None and (config.render_only or saved["key"] == key):
    return saved["analysis"]
  if config.render_only or heads is None:
    return None
  logging.info("Head analysis of %s (%s, h = %d, k in %s).", heads, dataset, h,
               tuple(config.analysis_ks))
  cfg = eval_config(config, dataset, h, 0.0, heads)
  tokenizer = tokenizer_lib.get_tokenizer(cfg.tokenizer)
  if not verifier:
    verifier.update(zip(("cfg", "params"), loading.load_model(
        cfg.verifier, tokenizer, seed=cfg.seed, field="verifier.checkpoint")))
  b_cfg = loading.drafter_bpd(cfg.drafter)
  _, head_params = loading.load_model(cfg.drafter, tokenizer, seed=cfg.seed + 1,
                                      field=f"heads of {dataset}, h = {h}")
  # What evaluate does with the heads: checks they were trained on this verifier.
  head_params = bpd_drafter.BPDDrafter(b_cfg, verifier["cfg"]).params(
      head_params, verifier["params"])["heads"]
  stats = bpd_analysis.analyse(b_cfg, head_params, verifier["cfg"], verifier["params"],
                               _prompt_ids(cfg, tokenizer), int(config.new_tokens),
                               ks=tuple(config.analysis_ks))
  stats = json.loads(json.dumps(stats))  # k keys as strings, as a reread gives them
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(dict(key=key, analysis=stats), f, indent=2)
  return stats


def _heads_record(heads: str | None) -> dict:
  """Where the heads come from: their directory, newest step and training corpus."""
  saved = _read_text(os.path.join(heads, "config.json")) if heads else None
  data = json.loads(saved).get("data", {}).get("name") if saved else None
  return dict(heads_checkpoint=heads, heads_steps=_newest_step(heads), heads_data=data)


def oracle_row(config, dataset: str, h: int, stats: dict) -> dict:
  """The bpd_oracle row: the lattice oracle's τ at oracle_k(config, h), with the analysis."""
  k = str(oracle_k(config, h))
  return dict(method="bpd_oracle", dataset=dataset, temperature=0.0, heads=h, gamma=h,
              oracle_k=int(k), block_efficiency=stats["oracle_tau"][k], tau_se=None,
              speedup=None, tokens_per_s=None, theoretical_speedup=None,
              verifier_tokens_per_call=None, identical_to_greedy=None,
              oracle_tau=stats["oracle_tau"], head_entropy=stats["head_entropy"],
              repetition_rate=stats["repetition_rate"], topk_accuracy=stats["topk_accuracy"],
              num_prompts=stats["prompts"], new_tokens=stats["tokens"] * stats["prompts"])


def _paths_kept(row: dict) -> int | None:
  """bpd_ngram's kept paths p, or bpd_ngram_beam's width W, from the row's tree description."""
  match = re.search(r"(?:p|W)=(\d+)", row.get("tree") or "")
  return int(match.group(1)) if match else None


def add_gains(rows: list[dict]) -> None:
  """gain_over_bpd (and its standard error, prompts treated as independent between the two
  runs, which is conservative: both decode the same prompts) on every non-bpd BPD row."""
  plain = {(r["dataset"], r["heads"], r["temperature"]): r for r in rows if r["method"] == "bpd"}
  for r in rows:
    b = plain.get((r["dataset"], r["heads"], r["temperature"]))
    if r["method"] in ("autoregressive", "bpd") or b is None or not b["block_efficiency"]:
      continue
    ratio = r["block_efficiency"] / b["block_efficiency"]
    rel = math.hypot((r.get("tau_se") or 0.0) / r["block_efficiency"],
                     (b.get("tau_se") or 0.0) / b["block_efficiency"])
    r.update(gain_over_bpd=round(ratio - 1, 4), gain_se=round(ratio * rel, 4))


def carried_rows(config) -> dict[str, list[dict]]:
  """The rows of every `carry` setting, read from `carry_from` (bad input: ValueError naming the
  field)."""
  keys = bpd_report.carried(config)
  if not keys:
    return {}
  path = str(config.get("carry_from", "") or "")
  if not os.path.isfile(path):
    raise ValueError(f"carry={keys} takes rows from carry_from={path!r}, which is not a file. "
                     "Fix: --config.carry_from=<an earlier run's results.json>.")
  try:
    with open(path, encoding="utf-8") as f:
      rows = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"carry_from={path!r} is not a readable results.json ({e}).") from None
  out = {}
  for key in keys:
    out[key] = [r for r in rows if _heads_key(r["dataset"], r["heads"]) == key]
    if not out[key]:
      raise ValueError(f"carry has {key!r}, but carry_from={path!r} holds no rows for it. Fix: "
                       "drop it from carry, or point carry_from at a run that has it.")
  return out


def collect_rows(config, workdir: str) -> list[dict]:
  """Every run's rows (training, decoding and analysing what has not finished yet), and the
  carried settings' rows (`carried_rows`)."""
  rows, verifier = [], {}
  carried = carried_rows(config)
  for dataset in config.datasets:
    for h in config.heads:
      if _heads_key(dataset, h) in carried:
        rows += [dict(r, carried=True) for r in carried[_heads_key(dataset, h)]]
        continue
      heads = train_heads(config, workdir, dataset, h)
      record = _heads_record(heads)
      for t in config.temperatures:
        for r in evaluate_heads(config, workdir, dataset, h, t, heads):
          r.update(dataset=dataset, heads=h, **record)
          if r["method"] in ("bpd_ngram", "bpd_ngram_beam"):
            r["p"] = _paths_kept(r)
          rows.append(r)
      stats = analyse_heads(config, workdir, dataset, h, heads, verifier)
      if stats is not None:
        rows.append(dict(oracle_row(config, dataset, h, stats), **record))
  add_gains(rows)
  return rows


def run(config, workdir: str) -> list[dict]:
  check_config(config, workdir)
  os.makedirs(workdir, exist_ok=True)
  # Compiled decoding loops persist across runs and restarts (much of the time is compiling),
  # unless the caller already chose a cache (tests share one through the environment).
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "runs", "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  rows = collect_rows(config, workdir)
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
  md = bpd_report.render_markdown(config, rows, report.launch_command(config, workdir))
  with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
    f.write(md)
  bpd_report.plot_tau_by_method(config, rows, os.path.join(workdir, "tau_by_method.png"))
  bpd_report.plot_oracle_vs_k(config, rows, os.path.join(workdir, "oracle_vs_k.png"))
  bpd_report.plot_entropy_repetition(config, rows, os.path.join(workdir, "entropy_repetition.png"))
  # The console gets the goals; results.md has every table.
  print("\n".join(bpd_report.goal_lines(config, rows)), flush=True)
  methods = sorted({r["method"] for r in rows})
  summary = (f"bpd_experiment: {len(rows)} rows ({', '.join(methods) or 'none finished'}); "
             f"wrote {', '.join(bpd_report.OUTPUTS)} in {os.path.abspath(workdir)}")
  logging.info(summary)
  print(summary, flush=True)
  return rows
