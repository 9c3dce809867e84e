"""Program `rsd_experiment`: the RSD comparisons (Jeon et al. 2024) at small scale.

  python launch.py --config experiments/rsd/config.py --workdir experiments/rsd

Runs the `evaluate` program once per (part, dataset, temperature, shape) with the methods as
NAME:SHAPE@L entries, so every row of results.json carries τ, α, the measured speedup over
autoregressive decoding in the same process (results.json only: see rsd_report.speed_note), the
verifier tokens per call and the drafter calls per round:
  (a) fixed draft length: `fixed_methods` (`greedy_methods` at T = 0) at every L in
      `fixed_depths`, on every dataset in `datasets`, at every temperature in
      `fixed_temperatures`;
  (b) fixed verifier budget: for every width in `budget_widths` and budget B in `budgets`, the
      entries `budget_methods["K{width}_B{B}"]` (computed by the experiment's get_config) on
      `budget_datasets` at `budget_temperature`; entries part (a) decodes on the same prompts at
      the same temperature are read from its rows, not run again;
  (c) per-level acceptance: the chance that one tree level accepts one of k candidates under
      each rule, on the verifier's T = 1 continuations of each dataset's prompts
      (`level_acceptance`, evaluation/multidraft.py), run first; results.md explains SpecTr
      against SpecInfer from it.
The budget entries and every dataset's prompts (and the cache room of the largest draft) are
checked before any run. Each run is a harness run (evaluation/experiment.py) in
`<workdir>/runs/<name>`: a finished one is read back, so an interrupted experiment resumes, and
`render_only` reports what has finished without running anything. Writes results.json (every
decoding row), results.md (evaluation/rsd_report.py: tables, and whether the paper's orderings
hold), level_acceptance.json, tau_vs_depth.png and tau_vs_budget.png.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax

from spec_jax import checks, loading
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.evaluation import experiment, multidraft, rsd_report
from spec_jax.programs import evaluate


@dataclasses.dataclass(frozen=True)
class Setting:
  """One evaluate run of parts (a) and (b): its name (and directory under runs/), the dataset,
  temperature and eval.methods entries, and the tags its rows get."""
  name: str
  dataset: str
  temperature: float
  methods: tuple[str, ...]
  tags: dict


def dataset_config(config, dataset: str, temperature: float, methods):
  """The evaluate config of one run: the experiment's evaluate fields (experiment.
  program_config), on `dataset` (its prompt split from `prompt_splits` where one is named), at
  one temperature, with `methods`."""
  cfg = experiment.program_config(config, "evaluate")
  cfg.data.name = dataset
  if dataset in config.get("prompt_splits", {}):
    cfg.data.prompt_split = config.prompt_splits[dataset]
  cfg.eval.temperatures = (float(temperature),)
  cfg.eval.methods = tuple(methods)
  return cfg


def budget_methods(config, width: int, budget: int) -> tuple[str, ...]:
  """The eval.methods entries of one fixed-budget run, as the experiment's config computed them."""
  tag = f"K{width}_B{budget}"
  if tag not in config.budget_methods:
    raise ValueError(
        f"config.budget_methods has no entry {tag!r} (width {width}, budget {budget}); it holds "
        f"{sorted(config.budget_methods)}. get_config computes budget_methods from budgets and "
        "budget_widths: change those in the experiment's config file, not by --config overrides.")
  entries = tuple(config.budget_methods[tag])
  for entry in entries:
    if not isinstance(entry, str) or str(entry).count("@") != 1:
      raise ValueError(f"config.budget_methods[{tag!r}] has {entry!r}: each entry is "
                       "'NAME[:WIDTH]@L' (a method, its tree width, its depth).")
  return entries


def settings(config) -> list[Setting]:
  """Parts (a) and (b)'s runs in the order they run (bad budget entries raise first).

  One evaluate run per (T, L) or (width, B), so results come in as they finish; settings that
  share compiled shapes run back to back (the second dataset reuses the first one's programs).
  Part (b)'s temperature first, with every budget right after its fixed-L runs (the first
  width shares their shapes), so the rows the ordering claims need finish before the rest."""
  entries = {(w, b): budget_methods(config, w, b) for w in config.budget_widths
             for b in config.budgets}

  def measured_in_part_a(entry: str, dataset: str) -> bool:
    """Whether part (a) decodes the shape of a budget entry ("NAME[:WIDTH]@L") on the same
    prompts at the same temperature: part (b) then reads that row instead of running it again."""
    name, depth = entry.split("@")
    name, _, width = name.partition(":")
    return (config.budget_temperature in config.fixed_temperatures
            and dataset in config.datasets and int(depth) in config.fixed_depths
            and name in config.fixed_methods
            and (name == "sd" or int(width or config.eval.tree_width) == config.eval.tree_width))

  def fixed(t):
    methods = config.greedy_methods if t == 0 else config.fixed_methods
    return [Setting(f"fixed_length_L{depth}_{dataset}_T{t:g}", dataset, t,
                    tuple(f"{m}@{depth}" for m in methods), dict(part="fixed_length"))
            for depth in config.fixed_depths for dataset in config.datasets]

  def every_budget():
    t = config.budget_temperature
    out = []
    for width in config.budget_widths:
      for budget in config.budgets:
        for dataset in config.budget_datasets:
          todo = tuple(e for e in entries[width, budget] if not measured_in_part_a(e, dataset))
          if todo:
            out.append(Setting(f"fixed_budget_K{width}_B{budget}_{dataset}_T{t:g}", dataset, t,
                               todo, dict(part="fixed_budget", budget=budget,
                                          budget_width=width)))
    return out

  out = []
  temperatures = sorted(config.fixed_temperatures, key=lambda t: t != config.budget_temperature)
  for t in temperatures:
    out += fixed(t)
    if t == config.budget_temperature:
      out += every_budget()
  if config.budget_temperature not in temperatures:
    out += every_budget()
  return out


def check(config, workdir: str) -> None:
  """Every budget has its entries; under a run (not render_only) every dataset supplies
  eval.num_prompts prompts and the largest draft of every run fits the cache with them: checked
  before the first run (hours before the last one starts)."""
  for name in ("fixed_depths", "budgets", "budget_widths"):
    checks.integers(config[name], name, empty_ok=True)
  plan = settings(config)
  if config.render_only:
    return
  for s in plan:  # each run's evaluate fields, as evaluate itself checks them
    evaluate.check_config(dataset_config(config, s.dataset, s.temperature, s.methods), workdir)
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  entries = list(dict.fromkeys(e for s in plan for e in s.methods))
  for dataset in dict.fromkeys(tuple(config.datasets) + tuple(config.budget_datasets)):
    cfg = dataset_config(config, dataset, 1.0, entries)
    evaluate.prompt_batches(cfg, tokenizer, evaluate.method_runs(cfg.eval))


def level_acceptance(cfg, run_dir: str) -> dict:
  """Part (c)'s run: per-level acceptance of k ∈ cfg.level_ks candidates per rule
  (evaluation/multidraft.py, cfg.level_draws rejection paths for RSD) on the verifier's own
  T = 1 continuations of cfg.data's prompts."""
  del run_dir  # the harness writes the result there
  tokenizer = tokenizer_lib.get_tokenizer(cfg.tokenizer)
  _, all_batches = evaluate.prompt_batches(cfg, tokenizer, evaluate.method_runs(cfg.eval))
  batches = all_batches[cfg.eval.batch_sizes[0]]
  v_cfg, v_params = loading.load_model(cfg.verifier, tokenizer, seed=cfg.seed,
                                       field="verifier.checkpoint")
  d_cfg, d_params = loading.load_model(cfg.drafter, tokenizer, seed=cfg.seed + 1,
                                       field="drafter.checkpoint")
  rng = jax.random.key(cfg.seed)
  temperature = float(cfg.eval.temperatures[0])
  outputs = [generate_lib.generate(v_params, prompts, jax.random.fold_in(rng, i), cfg=v_cfg,
                                   sampling=sampling_lib.Sampling(temperature),
                                   max_new_tokens=int(cfg.eval.new_tokens))
             for i, (prompts, _) in enumerate(batches)]
  result = multidraft.analyse(v_params, v_cfg, d_params, d_cfg, outputs,
                              ks=tuple(cfg.level_ks), draws=int(cfg.level_draws),
                              seed=cfg.seed, real_rows=[real for _, real in batches],
                              desc=f"per-level acceptance, {cfg.data.name}")
  result.update(dataset=cfg.data.name, temperature=temperature,
                verifier=cfg.verifier.checkpoint or cfg.verifier.size,
                drafter=cfg.drafter.checkpoint or cfg.drafter.size)
  return result


def runs(config, workdir: str) -> Iterator[experiment.Run]:
  """Part (c) first (minutes, and it explains what the hours of parts (a) and (b) will show),
  then `settings`."""
  del workdir  # every run lives in the harness's default directory
  for dataset in config.datasets:
    cfg = dataset_config(config, dataset, 1.0, ("sd",))
    # Not an evaluate run: a program name of its own (no config file, no ignores), so every
    # field, level_ks and level_draws included, is in its digest.
    cfg.program = "rsd_level_acceptance"
    cfg.level_ks, cfg.level_draws = tuple(config.level_ks), int(config.level_draws)
    yield experiment.Run(f"{rsd_report.LEVEL}_{dataset}", cfg, fn=level_acceptance,
                         tags=dict(part=rsd_report.LEVEL), ignore=("title",))
  for s in settings(config):
    yield experiment.Run(s.name, dataset_config(config, s.dataset, s.temperature, s.methods),
                         tags=s.tags)


def run(config, workdir: str) -> list[dict]:
  return experiment.run_experiment(config, workdir, runs=runs, report=rsd_report.report,
                                   check=check)
