"""Program `rsd_experiment`: the RSD comparisons (Jeon et al. 2024) at small scale.

  python launch.py --config experiments/rsd/config.py --workdir experiments/rsd

Runs the `evaluate` program once per (part, dataset, temperature, shape) with the methods as
NAME:SHAPE@L entries, so every row of results.json carries τ, α, the measured speedup over
autoregressive decoding in the same process (results.json only: `speed_note`), the verifier
tokens per call and the drafter calls per round:
  (a) fixed draft length: `fixed_methods` (`greedy_methods` at T = 0) at every L in
      `fixed_depths`, on every dataset in `datasets`, at every temperature in
      `fixed_temperatures`;
  (b) fixed verifier budget: for every width in `budget_widths` and budget B in `budgets`, the
      entries `budget_methods["K{width}_B{B}"]` (computed by the experiment's get_config) on
      `budget_datasets` at `budget_temperature`;
  (c) per-level acceptance: the chance that one tree level accepts one of k candidates under
      each rule, on the verifier's T = 1 continuations of each dataset's prompts
      (`level_acceptance`, evaluation/multidraft.py), cached in runs/level_acceptance_<d>.json
      and run first; results.md explains SpecTr against SpecInfer from it.
Every dataset's prompts (and the cache room of the largest draft) are checked before any run.
Each run lives in `<workdir>/runs/<part>_<tag>_<dataset>_T<t>`; a run whose results.json exists
is read back, not redone, so an interrupted experiment resumes, and `render_only` reports what
has finished without running anything. Writes <workdir>/results.json (every run's rows),
results.md (tables, and whether the paper's orderings hold) and tau_vs_depth.png,
tau_vs_budget.png.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Sequence

import jax

from spec_jax import loading
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.evaluation import glossary, multidraft, report, tables
from spec_jax.programs import evaluate

# The paper's claims this experiment checks (Jeon et al. 2024, §5): at a fixed draft length the
# order RSD-S ≥ RSD-C ≥ SpecTr ≥ SD in τ; at a fixed budget RSD-S is usually the best.
FIXED_ORDER = ("rsd_s", "rsd_c", "spectr", "sd")
# A difference of τ counts when it exceeds this many standard errors of the difference (~95%).
NOISE_SE = 2.0
# The standard error of τ the experiment is sized for (the bar, at T = 1).
TARGET_SE = 0.03

# results.md shows counts only. The wall-clock columns (speedup, tokens_per_s) stay in
# results.json: this experiment runs for hours on shared cores, paused and resumed, so a timed
# pass can include time it did not run (`speed_note`).
COLUMNS = ("method", "tree", "gamma", "block_efficiency", "tau_se", "acceptance_rate",
           "per_position_acceptance", "verifier_tokens_per_call", "drafter_calls_per_round",
           "identical_to_greedy")


def _run(config, workdir: str, dataset: str, temperature: float, methods, part: str,
         tag: str, missing: list[str] | None = None) -> list[dict]:
  """Rows of one evaluate run; a run whose results.json exists is read back, not redone (so an
  interrupted experiment resumes, and render_only reports whatever has finished; the names of
  the runs it skips go to `missing`)."""
  name = f"{part}_{tag}_{dataset}_T{temperature:g}"
  run_dir = os.path.join(workdir, "runs", name)
  done = os.path.join(run_dir, "results.json")
  if os.path.exists(done):
    rows = report.load_rows(done)
  elif config.render_only:
    if missing is not None:
      missing.append(name)
    return []
  else:
    rows = evaluate.run(_dataset_config(config, dataset, temperature, methods), run_dir)
  for row in rows:
    row.update(part=part)
  return rows


def _dataset_config(config, dataset: str, temperature: float, methods):
  """The evaluate config of one run: the experiment's, on `dataset` (its prompt split from
  `prompt_splits` where one is named), at one temperature, with `methods`."""
  cfg = copy.deepcopy(config)
  cfg.program = "evaluate"  # what the run's config.json records
  cfg.data.name = dataset
  if dataset in config.get("prompt_splits", {}):
    cfg.data.prompt_split = config.prompt_splits[dataset]
  cfg.eval.temperatures = (float(temperature),)
  cfg.eval.methods = tuple(methods)
  return cfg


def check_prompts(config) -> None:
  """Every dataset supplies eval.num_prompts prompts, and the largest draft of every run fits
  the cache with them: checked before the first run (hours before the last one starts)."""
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  entries = [f"{m}@{d}" for m in config.fixed_methods for d in config.fixed_depths]
  entries += [e for w in config.budget_widths for b in config.budgets
              for e in budget_methods(config, w, b)]
  for dataset in dict.fromkeys(tuple(config.datasets) + tuple(config.budget_datasets)):
    cfg = _dataset_config(config, dataset, 1.0, entries)
    evaluate.prompt_batches(cfg, tokenizer, evaluate.method_runs(cfg.eval))


def level_acceptance(config, workdir: str, dataset: str) -> dict | None:
  """Part (c): per-level acceptance of k candidates per rule (evaluation/multidraft.py) on the
  verifier's own T = 1 continuations of the dataset's prompts, cached in
  runs/level_acceptance_<dataset>.json (None under render_only before it exists)."""
  path = os.path.join(workdir, "runs", f"level_acceptance_{dataset}.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  if config.render_only:
    return None
  cfg = _dataset_config(config, dataset, 1.0, ("sd",))
  tokenizer = tokenizer_lib.get_tokenizer(cfg.tokenizer)
  _, all_batches = evaluate.prompt_batches(cfg, tokenizer, evaluate.method_runs(cfg.eval))
  batches = all_batches[cfg.eval.batch_sizes[0]]
  v_cfg, v_params = loading.load_model(cfg.verifier, tokenizer, seed=cfg.seed,
                                       field="verifier.checkpoint")
  d_cfg, d_params = loading.load_model(cfg.drafter, tokenizer, seed=cfg.seed + 1,
                                       field="drafter.checkpoint")
  rng = jax.random.key(cfg.seed)
  outputs = [generate_lib.generate(v_params, prompts, jax.random.fold_in(rng, i), cfg=v_cfg,
                                   sampling=sampling_lib.Sampling(1.0),
                                   max_new_tokens=int(cfg.eval.new_tokens))
             for i, (prompts, _) in enumerate(batches)]
  result = multidraft.analyse(v_params, v_cfg, d_params, d_cfg, outputs,
                              ks=tuple(config.level_ks), draws=int(config.level_draws),
                              seed=cfg.seed, real_rows=[real for _, real in batches],
                              desc=f"per-level acceptance, {dataset}")
  result.update(dataset=dataset, temperature=1.0,
                verifier=cfg.verifier.checkpoint or cfg.verifier.size,
                drafter=cfg.drafter.checkpoint or cfg.drafter.size)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  return result


def budget_methods(config, width: int, budget: int) -> tuple[str, ...]:
  """The eval.methods entries of one fixed-budget run, as the experiment's config computed them."""
  tag = f"K{width}_B{budget}"
  if tag not in config.budget_methods:
    raise ValueError(
        f"config.budget_methods has no entry {tag!r} (width {width}, budget {budget}); it holds "
        f"{sorted(config.budget_methods)}. get_config computes budget_methods from budgets and "
        "budget_widths: change those in the experiment's config file, not by --config overrides.")
  return tuple(config.budget_methods[tag])


def collect_rows(config, workdir: str
                 ) -> tuple[list[dict], dict[int, list[int]], list[str]]:
  """Every run's rows (each tagged with its part); width → budgets it ran for, for widths after
  the first (those run after the first width's and may not have finished); and under
  render_only, the runs that have not finished."""
  rows, extra_widths, missing = [], {}, []

  def measured_in_part_a(entry: str, dataset: str) -> bool:
    """Whether part (a) decodes the shape of a budget entry ("NAME[:WIDTH]@L") on the same
    prompts at the same temperature: part (b) then reads that row instead of running it again."""
    name, depth = entry.split("@")
    name, _, width = name.partition(":")
    return (config.budget_temperature in config.fixed_temperatures
            and dataset in config.datasets and int(depth) in config.fixed_depths
            and name in config.fixed_methods
            and (name == "sd" or int(width or config.eval.tree_width) == config.eval.tree_width))

  # Every budget's entries up front: a missing one fails before anything runs.
  entries = {(w, b): budget_methods(config, w, b) for w in config.budget_widths
             for b in config.budgets}

  def budget_runs(i, width):
    out = []
    for budget in config.budgets:
      for dataset in config.budget_datasets:
        todo = [e for e in entries[width, budget] if not measured_in_part_a(e, dataset)]
        if not todo:
          continue
        got = _run(config, workdir, dataset, config.budget_temperature, todo,
                   "fixed_budget", f"K{width}_B{budget}", missing)
        if got and i > 0:
          extra_widths.setdefault(width, []).append(budget)
        out += got
    return out

  def fixed_runs(temperature):
    methods = config.greedy_methods if temperature == 0 else config.fixed_methods
    return [row for depth in config.fixed_depths for dataset in config.datasets
            for row in _run(config, workdir, dataset, temperature,
                            [f"{m}@{depth}" for m in methods], "fixed_length", f"L{depth}",
                            missing)]

  # One evaluate run per (T, L) or (width, B), so results come in as they finish; settings that
  # share compiled shapes run back to back (the second dataset reuses the first one's programs).
  # Part (b)'s temperature first, with every budget right after its fixed-L runs (the first
  # width shares their shapes), so the rows the ordering claims need finish before the rest.
  temperatures = sorted(config.fixed_temperatures, key=lambda t: t != config.budget_temperature)
  every_budget = lambda: [row for i, width in enumerate(config.budget_widths)  # noqa: E731
                          for row in budget_runs(i, width)]
  for temperature in temperatures:
    rows += fixed_runs(temperature)
    if temperature == config.budget_temperature:
      rows += every_budget()
  if config.budget_temperature not in temperatures:
    rows += every_budget()
  return rows, extra_widths, missing


def best_within_budget(rows, budget: int) -> dict[tuple[str, str], dict]:
  """Per (dataset, method): the row with the highest τ among shapes with ≤ budget nodes."""
  best = {}
  for r in rows:
    if r["method"] == "autoregressive" or r["verifier_tokens_per_call"] > budget:
      continue
    key = (r["dataset"], r["method"])
    if key not in best or r["block_efficiency"] > best[key]["block_efficiency"]:
      best[key] = r
  return best


def compare(a: dict, b: dict) -> str:
  """'>' when row a's τ exceeds row b's by more than NOISE_SE standard errors of the difference,
  '<' when it falls short by more, '≈' (within noise) otherwise. The standard errors are over
  prompts and combined as if independent (both rows decode the same prompts, so this is
  conservative)."""
  d = a["block_efficiency"] - b["block_efficiency"]
  se = math.hypot(a.get("tau_se") or 0.0, b.get("tau_se") or 0.0)
  if d > NOISE_SE * se:
    return ">"
  if d < -NOISE_SE * se:
    return "<"
  return "≈"


def order_verdict(ordered: list[dict]) -> tuple[str, str]:
  """(verdict, pairwise signs) for the claim τ(ordered[0]) ≥ τ(ordered[1]) ≥ ...: 'does not
  hold' when some neighbour pair is reversed beyond noise, 'holds' when the point estimates are
  in order and none is, 'within noise' when they are out of order only within noise."""
  signs = [compare(a, b) for a, b in zip(ordered, ordered[1:])]
  taus = [r["block_efficiency"] for r in ordered]
  if "<" in signs:
    verdict = "does not hold"
  elif all(a >= b for a, b in zip(taus, taus[1:])):
    verdict = "holds"
  else:
    verdict = "within noise"
  return verdict, " ".join(signs)


def _tau(r: dict) -> str:
  se = r.get("tau_se")
  return f"{r['block_efficiency']:.2f}" + (f" ± {se:.2f}" if se is not None else "")


def ordering_checks(fixed_rows) -> tuple[list[str], dict[str, int], int]:
  """Table lines giving, per (dataset, T, L), τ ± SE of RSD-S, RSD-C, SpecTr, SD, the pairwise
  comparisons and whether RSD-S ≥ RSD-C ≥ SpecTr ≥ SD holds (`order_verdict`; at T = 0 SpecTr is
  SD, so RSD-S ≥ RSD-C ≥ SD); then the count of each verdict, and in how many settings every
  tree method beat SD beyond noise."""
  lines, counts, trees_win = [], {"holds": 0, "within noise": 0, "does not hold": 0}, 0
  groups = {}
  for r in fixed_rows:
    if r["method"] in FIXED_ORDER:
      groups.setdefault((r["dataset"], r["temperature"], r["gamma"]), {})[r["method"]] = r
  for (dataset, temp, depth), by in sorted(groups.items()):
    # Greedy SpecTr verifies K identical argmax chains, i.e. SD's chain: the claim at T = 0 is
    # RSD-S ≥ RSD-C ≥ SD and SpecTr's cell says so (the experiment does not run it greedy).
    needed = [m for m in FIXED_ORDER if temp != 0 or m != "spectr"]
    if not set(needed) <= set(by):
      continue
    ordered = [by[m] for m in needed]
    verdict, signs = order_verdict(ordered)
    counts[verdict] += 1
    trees_win += all(compare(r, ordered[-1]) == ">" for r in ordered[:-1])
    cells = [_tau(by[m]) if m in needed else "= sd (greedy)" for m in FIXED_ORDER]
    lines.append(f"| {dataset} | {temp:g} | {depth} | " + " | ".join(cells)
                 + f" | {signs} | {verdict} |")
  head = ["| dataset | T | L | " + " | ".join(f"τ {m}" for m in FIXED_ORDER)
          + " | pairs | verdict |", "|---|---:|---:|" + "---:|" * len(FIXED_ORDER) + "---|---|"]
  return head + lines, counts, trees_win


def _pm(values: dict, name: str, i: int) -> str:
  return f"{values[name][i]:.3f} ± {values[name + '_se'][i]:.3f}"


def _than(a: float, b: float, se: float) -> str:
  """'above' / 'below' / 'level with' for a against b, within NOISE_SE standard errors."""
  if a - b > NOISE_SE * se:
    return "above"
  if b - a > NOISE_SE * se:
    return "below"
  return "level with"


def level_lines(levels: dict, fixed_rows) -> list[str]:
  """Part (c) of results.md: the per-level acceptance table per dataset and what it explains
  about SpecTr against SpecInfer (and RSD), with the fixed-L τ of part (a) beside it."""
  md = ["## (c) Why the rules differ: one tree level with k candidates (T = 1)", "",
        "The chance that one level of a draft tree accepts one of its k candidate tokens, per "
        "rule, averaged over the positions of the verifier's own T = 1 continuations of the "
        "same prompts (both models teacher-forced; `evaluation/multidraft.py`, checked against "
        "the tree rules' acceptance frequencies in tests/test_multidraft.py). SD is k = 1, "
        "Σ min(p, q). SpecInfer tests i.i.d. candidates by recursive rejection: each later "
        "candidate against the residual norm((r − q)+) the rejections before it left. SpecTr "
        "(K-SEQ) accepts each i.i.d. candidate with min(1, p/(ρq)), with ρ ≥ 1 the smallest scale "
        "that keeps the emitted law exactly p. RSD draws its candidates without replacement and "
        "tests them recursively. ± is the standard error over prompts.", ""]
  for dataset, lv in levels.items():
    if not lv:
      continue
    md += [f"### {dataset} ({lv['rows']} prompts, {lv['positions']} positions)", "",
           "| k | SpecInfer | SpecTr | RSD (without replacement) | SpecTr's ρ |",
           "|---:|---:|---:|---:|---:|"]
    for i, k in enumerate(lv["k"]):
      md.append(f"| {k} | {_pm(lv, 'specinfer', i)} | {_pm(lv, 'spectr', i)} | "
                f"{_pm(lv, 'rsd', i)} | {lv['rho'][i]:.3f} |")
    i = len(lv["k"]) - 1
    k = lv["k"][i]

    def versus(name: str) -> str:
      d, se = lv[f"{name}_minus_specinfer"][i], lv[f"{name}_minus_specinfer_se"][i]
      return f"{_than(d, 0.0, se)} SpecInfer's by {d:+.4f} ± {se:.4f}"
    md += ["", f"With k = {k} candidates a level accepts with probability "
           f"{lv['specinfer'][i]:.3f} under SpecInfer, {lv['spectr'][i]:.3f} under SpecTr and "
           f"{lv['rsd'][i]:.3f} under RSD (k = 1, plain SD: {lv['sd'][0]:.3f}). Differences are "
           "paired over prompts (every rule sees the same positions), so they are far more "
           f"precise than the values: SpecTr is {versus('spectr')}, RSD is {versus('rsd')}.",
           "",
           "Why: both i.i.d. rules spend k draws from q. Recursive rejection (SpecInfer) gives the "
           "first candidate SD's full chance Σ min(p, q); each later one, still drawn from q, is "
           "tested against the residual of the rejections, which holds exactly the mass q "
           "under-covers, so q is a poor proposal for it and extra candidates add less and less. "
           "K-SEQ (SpecTr) treats the k candidates alike, each accepted with min(1, p/(ρq)), "
           f"with the smallest ρ that keeps the law exact (ρ ≈ {lv['rho'][i]:.2f} here): it gives "
           "up some of the first candidate's chance to make every later one count. Which spends "
           "the draws better depends on p and q; the table says which did here. RSD's "
           "candidates cannot repeat, so none is spent on a duplicate of a rejected token. A "
           "tree multiplies one such probability per level, and K i.i.d. chains keep k > 1 "
           "candidates below the root only while they share a prefix, so a per-level gap shows "
           "most at the root and compounds with depth."]
    pairs = {}
    for r in fixed_rows:
      if r["dataset"] == dataset and r["temperature"] == 1.0 and r["method"] in (
          "specinfer", "spectr"):
        pairs.setdefault(r["gamma"], {})[r["method"]] = r
    measured = [f"L = {depth}: SpecInfer {_tau(by['specinfer'])}, SpecTr {_tau(by['spectr'])} "
                f"({compare(by['specinfer'], by['spectr'])})"
                for depth, by in sorted(pairs.items()) if len(by) == 2]
    if measured:
      md += ["", "Measured τ at fixed L (part (a), T = 1; '>' / '<' beyond noise, '≈' "
             "within): " + "; ".join(measured) + "."]
    md.append("")
  return md


def speed_note(rows) -> str:
  """Why results.md shows no speedups, with the span this run's rows measured."""
  speedups = [r["speedup"] for r in rows
              if r["method"] != "autoregressive" and r.get("speedup") is not None]
  span = f" (this run's: {min(speedups):.2f}–{max(speedups):.2f}×)" if speedups else ""
  return ("Measured speedups over autoregressive decoding are kept in results.json (`speedup`, "
          f"`tokens_per_s`){span} but not shown: the experiment runs for hours on shared CPU "
          "cores and is paused and resumed, so a timed pass can include time in which it did not "
          "run. τ is a count and is unaffected; the evaluate and benchmark programs measure "
          "speed on idle cores.")


def render_markdown(config, rows, extra_widths, command_line: str, levels=None,
                    missing: Sequence[str] = ()) -> str:
  """results.md: part (a)'s tables and ordering check, part (b)'s best-per-budget table, part
  (c)'s per-level acceptance (`levels`: dataset -> multidraft.analyse result, or None), the
  plots and the glossary of the columns shown; `missing` (runs not finished) is listed first."""
  fixed = [r for r in rows if r["part"] == "fixed_length"]
  md = [f"# {config.title}", "",
        "SmolLM2-135M-Instruct verifier, the quickstart drafter (drafter-s, 300 steps on "
        f"Shakespeare). Command: `{command_line}`. "
        f"{config.eval.num_prompts} prompts × {config.eval.new_tokens} new tokens per setting, "
        f"batch {config.eval.batch_sizes[0]}, device: {rows[0]['device'] if rows else '?'}.", "",
        *([config.note, ""] if config.get("note") else []),
        *([f"**Not finished yet: {len(missing)} runs** ({', '.join(missing)}). Their rows are "
           "missing below, so part (b) shows only shapes measured so far; the command resumes "
           "them.", ""] if missing else []),
        "## (a) Fixed draft length L", "",
        "Tree methods use K = W = 3 (RSD-C b = (3, 1, ..., 1)), i.e. 3L + 1 verifier tokens per "
        "call; SD uses L + 1. At T = 0 SpecInfer/SpecTr draw K identical greedy chains, so they "
        "equal SD; RSD-C is a top-3 tree and RSD-S a beam search. " + speed_note(rows), ""]
  for dataset in config.datasets:
    for temperature in config.fixed_temperatures:
      sel = [r for r in fixed if r["dataset"] == dataset and r["temperature"] == temperature]
      if not sel:
        continue
      # Every (T, L) run measured its own autoregressive baseline; show the first one.
      ar = [r for r in sel if r["method"] == "autoregressive"][:1]
      sel = ar + [r for r in sel if r["method"] != "autoregressive"]
      md += [f"### {dataset}, T = {temperature:g}", "",
             tables.markdown_table(sel, COLUMNS, method_order=("autoregressive",
                                                               *config.fixed_methods)), ""]
  lines, counts, trees_win = ordering_checks(fixed)
  total = sum(counts.values())
  md += ["### Does RSD-S ≥ RSD-C ≥ SpecTr ≥ SD (τ) hold at fixed L?", "",
         f"τ ± its standard error over prompts. pairs: each neighbour pair, '>' / '<' when the "
         f"difference exceeds {NOISE_SE:g} standard errors, '≈' within noise. verdict: 'does not "
         "hold' when a pair is reversed beyond noise, 'holds' when the point estimates are in "
         "order and none is, 'within noise' otherwise. At T = 0 SpecTr's K chains are all the "
         "drafter's argmax chain, i.e. SD's, so the greedy claim is RSD-S ≥ RSD-C ≥ SD.", "",
         *lines, "",
         f"The order holds in {counts['holds']} of {total} settings, is out of order only within "
         f"noise in {counts['within noise']} and does not hold in {counts['does not hold']}; "
         f"every tree method beats SD beyond noise in {trees_win} of {total}.", ""]

  md += ["## (b) Fixed verifier budget B (tokens per call), T = "
         f"{config.budget_temperature:g}", "",
         "Best τ of each method over every shape measured at this temperature with at most B "
         "nodes (part (a)'s shapes included; shape in brackets): trees of width K = W = 3 as deep "
         "as B allows, SD with γ = B − 1"
         + "".join(f", plus width-{w} trees for B ∈ {{{', '.join(map(str, bs))}}}"
                   for w, bs in extra_widths.items() if bs) + ". RSD-S verdict: 'holds' when it "
         f"has the best τ, 'within noise' when it is within {NOISE_SE:g} standard errors of the "
         "best, 'does not hold' otherwise.", ""]
  methods = list(config.fixed_methods)
  budget_verdicts = {"holds": 0, "within noise": 0, "does not hold": 0}
  pool = [r for r in rows if r["temperature"] == config.budget_temperature]
  for dataset in config.budget_datasets:
    md += [f"### {dataset}", "", "| B | " + " | ".join(methods) + " | best | RSD-S best? |",
           "|---:|" + "---|" * (len(methods) + 2)]
    for b in config.budgets:
      best = best_within_budget([r for r in pool if r["dataset"] == dataset], b)
      cells, winner = [], None
      for m in methods:
        r = best.get((dataset, m))
        if r is None:
          cells.append("–")
          continue
        shape = r["tree"] or f"γ={r['gamma']}"
        cells.append(f"{_tau(r)} ({shape})")
        if winner is None or r["block_efficiency"] > winner["block_efficiency"]:
          winner = r
      rsd_s = best.get((dataset, "rsd_s"))
      verdict = "–"
      if winner is not None and rsd_s is not None:
        verdict = ("holds" if rsd_s is winner else
                   "within noise" if compare(winner, rsd_s) == "≈" else "does not hold")
        budget_verdicts[verdict] += 1
      md.append(f"| {b} | " + " | ".join(cells)
                + f" | {winner['method'] if winner else '–'} | {verdict} |")
    md.append("")
  se = [r["tau_se"] for r in rows if r.get("tau_se") is not None and r["method"] != "autoregressive"
        and r["temperature"] == config.budget_temperature]
  md += [f"RSD-S has the best τ at {budget_verdicts['holds']} budgets, is within noise of the best "
         f"at {budget_verdicts['within noise']} and behind it beyond noise at "
         f"{budget_verdicts['does not hold']}. Cells: τ ± standard error (shape).", ""]
  if se:
    md += [f"Largest standard error of τ at T = {config.budget_temperature:g}: {max(se):.3f} "
           f"(median {sorted(se)[len(se) // 2]:.3f}; the experiment is sized for ≤ {TARGET_SE}).",
           ""]
  if levels and any(levels.values()):
    md += level_lines(levels, fixed)
  md += ["## Plots", "", "![τ vs L](tau_vs_depth.png) ![τ vs budget](tau_vs_budget.png)", "",
         "## Glossary", ""]
  md += glossary.markdown_lines(COLUMNS)
  return "\n".join(md) + "\n"


# One colour per method, one line style per temperature, one marker per dataset, so no two
# series look alike (matplotlib's 10-colour cycle repeats past 10 series).
_COLOURS = {"sd": "#444444", "specinfer": "#1f77b4", "spectr": "#2ca02c", "rsd_c": "#ff7f0e",
            "rsd_s": "#d62728"}
_MARKERS = ("o", "s", "^", "D")


def _style(label: str) -> dict:
  """Line style of a series labelled 'method [T=t] dataset' (see write_plots)."""
  method, *rest = label.split(" ")
  datasets = ("shakespeare", "pystdlib")
  name = next((w for w in rest if w in datasets), "")
  return dict(color=_COLOURS.get(method, "#9467bd"),
              linestyle="--" if "T=0" in rest else "-",
              marker=_MARKERS[datasets.index(name) if name in datasets else len(datasets)])


def _plot(path: str, series: dict[str, tuple[list, list, list]], xlabel: str,
          title: str) -> None:
  """One line of τ per series label with ± standard-error bars, its legend outside the axes (Agg
  canvas: no display, no pyplot state)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(8.4, 4.6), layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  for label, (xs, ys, errs) in sorted(series.items()):
    order = sorted(range(len(xs)), key=xs.__getitem__)
    ax.errorbar([xs[i] for i in order], [ys[i] for i in order], yerr=[errs[i] for i in order],
                label=label, capsize=2.5, elinewidth=0.8, **_style(label))
  xs_all = sorted({x for xs, _, _ in series.values() for x in xs})
  if xs_all:
    ax.set_xticks(xs_all)  # the measured L or B, not fractional ticks
  ax.set_xlabel(xlabel)
  ax.set_ylabel("τ, block efficiency (tokens per verifier call)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if series:  # render_only before any run finished: empty axes, no legend
    fig.legend(fontsize=7, loc="outside right upper", handlelength=3)
  fig.savefig(path, dpi=120)


def write_plots(config, rows, workdir: str) -> None:
  """tau_vs_depth.png (part a: τ vs L per method, temperature and dataset) and
  tau_vs_budget.png (part b: the best τ within each budget per method)."""
  series = {}
  for r in rows:
    if r["part"] == "fixed_length" and r["method"] != "autoregressive":
      key = f"{r['method']} T={r['temperature']:g} {r['dataset'].replace('spec_jax_', '')}"
      xs, ys, errs = series.setdefault(key, ([], [], []))
      xs.append(r["gamma"])
      ys.append(r["block_efficiency"])
      errs.append(r.get("tau_se") or 0.0)
  _plot(os.path.join(workdir, "tau_vs_depth.png"), series, "draft length L",
        "Fixed draft length (K = W = 3), τ ± standard error over prompts")
  pool = [r for r in rows if r["temperature"] == config.budget_temperature]
  series = {}
  for dataset in config.budget_datasets:
    for b in config.budgets:
      best = best_within_budget([r for r in pool if r["dataset"] == dataset], b)
      for (_, m), r in best.items():
        xs, ys, errs = series.setdefault(f"{m} {dataset.replace('spec_jax_', '')}", ([], [], []))
        xs.append(b)
        ys.append(r["block_efficiency"])
        errs.append(r.get("tau_se") or 0.0)
  _plot(os.path.join(workdir, "tau_vs_budget.png"), series, "verifier tokens per call (budget B)",
        f"Fixed budget, T = {config.budget_temperature:g} (best shape per method)")


def run(config, workdir: str) -> list[dict]:
  os.makedirs(workdir, exist_ok=True)
  # Compiled decoding loops persist across runs and restarts (most of the time is compiling),
  # unless the caller already chose a cache (tests share one through the environment).
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "runs", "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  if not config.render_only:
    check_prompts(config)
  # Part (c) first: minutes, and it explains what the hours of part (a) and (b) will show.
  levels = {d: level_acceptance(config, workdir, d) for d in config.datasets}
  rows, extra_widths, missing = collect_rows(config, workdir)
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
  with open(os.path.join(workdir, "level_acceptance.json"), "w", encoding="utf-8") as f:
    json.dump([v for v in levels.values() if v], f, indent=2)
  md = render_markdown(config, rows, extra_widths, report.launch_command(config, workdir),
                       levels, missing)
  with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
    f.write(md)
  write_plots(config, rows, workdir)
  print(md)
  return rows
