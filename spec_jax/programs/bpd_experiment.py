"""Program `bpd_experiment`: blockwise parallel decoding (Stern et al. 2018) and the draft
refinements of Kim et al. 2024 ("Exploring and Improving Drafts in Blockwise Parallel
Decoding") at small scale, on the experiment harness (`spec_jax.evaluation.experiment`).

  python launch.py --config experiments/bpd/config.py --workdir experiments/bpd

For every dataset in `datasets` and head count h in `heads`, the runs (<workdir>/runs/<name>):
  heads_<dataset>_h<h>      train_bpd trains h heads on the dataset (the `train` section), unless
                            `heads_checkpoints[f"{dataset}_h{h}"]` gives them;
  eval_<dataset>_h<h>_T<t>  evaluate per temperature: plain BPD chains of h (rows `bpd`), the
                            lattice tree `tree` (`bpd_tree`), the n-gram rescored lattice paths
                            and beams (`ngram_paths`, `ngram_beams`; greedy only) and the
                            LM-rescored chains bpd_neural, beside the autoregressive baseline;
  analysis_<dataset>_h<h>   the head analysis (evaluation/bpd_analysis.py) on the same prompts;
                            its lattice oracle τ at oracle_k becomes a `bpd_oracle` row.
A finished run is read back while its digest matches, so a killed experiment resumes. `carry`
(keys "<dataset>_h<h>") takes those settings' rows from the results.json at `carry_from`.
`render_only` runs nothing; a run missing from runs/ reports the rows the workdir's results.json
holds for it. Rows, results.md and plots: `spec_jax.evaluation.bpd_report`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re

import ml_collections

from spec_jax import checks, loading
from spec_jax.data import corpora
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding.drafters import bpd as bpd_drafter
from spec_jax.decoding.drafters import lattice
from spec_jax.evaluation import bpd_analysis, bpd_report, experiment, report
from spec_jax.programs import evaluate, train_bpd

heads_key, lattice_k, oracle_k = bpd_report.heads_key, bpd_report.lattice_k, bpd_report.oracle_k


def heads_dir(config, workdir: str, dataset: str, h: int) -> tuple[str, bool]:
  """(the heads' train_bpd workdir, whether heads_checkpoints gave it)."""
  key = heads_key(dataset, h)
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


def eval_inputs(cfg) -> dict:
  """What an evaluate run's result depends on beyond its digest (which covers its methods and
  sweeps): the heads' checkpoint is a path, so the heads' newest step is named here, and
  further-trained heads decode again."""
  return dict(heads_step=_newest_step(cfg.drafter.checkpoint))


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
  checks.integers(config.get("ngram_beams", ()), "ngram_beams", empty_ok=True)
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
  settings = [heads_key(d, h) for d in config.datasets for h in config.heads]
  for key in bpd_report.carried(config):
    if key not in settings:
      raise ValueError(f"carry has {key!r}, which is not one of this config's settings "
                       "'<dataset>_h<heads>' (datasets × heads).")
  experiment.carried_rows(config, bpd_report.setting)
  for dataset in config.datasets:
    for h in config.heads:
      if heads_key(dataset, h) in bpd_report.carried(config):
        continue
      path, given = heads_dir(config, workdir, dataset, h)
      if given and not config.render_only:
        _check_heads(path, h, f"heads_checkpoints[{heads_key(dataset, h)!r}]")
      if not given:
        train_bpd.check_config(train_config(config, dataset, h))
      for t in config.temperatures:
        try:
          _check_eval(eval_config(config, dataset, h, t, path), workdir)
        except ValueError as e:
          raise ValueError(f"The evaluate run for {dataset}, h = {h}, T = {float(t):g} "
                           f"(built from this config's tree, top_k, weights, num_prompts, "
                           f"new_tokens and `eval` section): {e}") from None


def _check_eval(cfg, workdir: str) -> None:
  """evaluate's checks of one run's config. Heads not trained yet have no checkpoint to check
  the methods against: then the methods' grammar, and every other field on a plain chain."""
  if _newest_step(cfg.drafter.checkpoint) is None:
    evaluate.method_runs(cfg.eval)
    cfg = copy.deepcopy(cfg)
    cfg.drafter.checkpoint, cfg.eval.methods = "", ("sd",)
  evaluate.check_config(cfg, os.path.join(workdir, "runs"))


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


def _heads_record(heads: str | None) -> dict:
  """Where the heads come from: their directory, newest step and training corpus."""
  saved = os.path.join(heads, "config.json") if heads else ""
  data = None
  if os.path.exists(saved):
    with open(saved, encoding="utf-8") as f:
      data = json.load(f).get("data", {}).get("name")
  return dict(heads_checkpoint=heads, heads_steps=_newest_step(heads), heads_data=data)


def analysis_config(config, dataset: str, h: int, heads: str | None):
  """What one (dataset, h)'s head analysis depends on: the config its run's digest covers."""
  return ml_collections.ConfigDict(dict(
      dataset=dataset, num_heads=int(h), heads=heads or "", heads_step=_newest_step(heads),
      num_prompts=int(config.num_prompts), new_tokens=int(config.new_tokens),
      ks=[int(k) for k in config.analysis_ks], seed=int(config.seed),
      data_prompt_tokens=int(config.eval.data_prompt_tokens),
      verifier=bpd_report.model_name(config.verifier), tokenizer=str(config.tokenizer)))


def analyse_heads(analysis, run_dir: str, *, cfg, verifier: dict) -> list[dict]:
  """[bpd_analysis.analyse of the heads `cfg.drafter` names on the prompts evaluate decodes
  with `cfg`]. `verifier` caches the loaded verifier across settings."""
  del run_dir
  tokenizer = tokenizer_lib.get_tokenizer(cfg.tokenizer)
  texts, _ = evaluate.prompt_batches(cfg, tokenizer, evaluate.method_runs(cfg.eval))
  if not verifier:
    verifier.update(zip(("cfg", "params"), loading.load_model(
        cfg.verifier, tokenizer, seed=cfg.seed, field="verifier.checkpoint")))
  field = f"heads of {analysis.dataset}, h = {analysis.num_heads}"
  source = loading.load_source(loading.drafter_source(cfg.drafter, field=field), cfg.drafter,
                               tokenizer, verifier["cfg"], verifier["params"], seed=cfg.seed)
  # What evaluate does with the heads: checks they were trained on this verifier.
  heads = bpd_drafter.heads_params(source)["heads"]
  return [bpd_analysis.analyse(source.b_cfg, heads, verifier["cfg"], verifier["params"],
                               tokenizer.encode_batch(texts), int(analysis.new_tokens),
                               ks=tuple(analysis.ks))]


def runs(config, workdir: str):
  """The heads, evaluate and analysis runs of every setting not carried, in config order."""
  verifier = {}
  for dataset in config.datasets:
    for h in config.heads:
      key = heads_key(dataset, h)
      if key in bpd_report.carried(config):
        continue
      path, given = heads_dir(config, workdir, dataset, h)
      # Heads trained here: their training run's identity, so heads retrained with another
      # setting (to the same step) decode and are analysed again.
      trained = {}
      if not given:
        train = experiment.Run(f"heads_{key}", train_config(config, dataset, h), directory=path)
        trained = {"heads_run": experiment.identity(train)}
        yield train
      heads = path if given or _newest_step(path) is not None else None
      tags = dict(dataset=dataset, heads=h, **_heads_record(heads))
      for t in config.temperatures:
        cfg = eval_config(config, dataset, h, t, heads or "")
        yield experiment.Run(bpd_report.eval_run(dataset, h, t), cfg, tags=tags,
                             inputs={**eval_inputs(cfg), **trained})
      yield experiment.Run(bpd_report.analysis_run(dataset, h),
                           analysis_config(config, dataset, h, heads),
                           tags=tags, inputs=trained, fn=functools.partial(
                               analyse_heads, verifier=verifier,
                               cfg=eval_config(config, dataset, h, 0.0, heads or "")))


def _report(config, collected, command: str, *, workdir: str) -> experiment.Report:
  path = os.path.join(workdir, "results.json")
  previous = report.load_rows(path) if collected.missing and os.path.exists(path) else []
  rows, reread = bpd_report.collect_rows(config, collected, previous)
  return experiment.Report(markdown=bpd_report.render_markdown(config, rows, command, reread),
                           plots=bpd_report.plots(config, rows), rows=rows)


def run(config, workdir: str) -> list[dict]:
  rows = experiment.run_experiment(config, workdir, runs=runs, check=check_config,
                                   report=functools.partial(_report, workdir=workdir))
  methods = sorted({r["method"] for r in rows})
  print(f"bpd_experiment: {len(rows)} rows ({', '.join(methods) or 'none finished'}); wrote "
        f"{', '.join(bpd_report.OUTPUTS)} in {os.path.abspath(workdir)}", flush=True)
  return rows
