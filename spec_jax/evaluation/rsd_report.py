"""results.md and the plots of the RSD experiment (spec_jax/programs/rsd_experiment.py).

Rows are evaluate rows tagged `part` (fixed_length, fixed_budget, level_acceptance) and, for
part (b), `budget` and `budget_width`; part (c)'s rows are evaluation/multidraft.py's `analyse`
results, one per dataset. Every fact the text states (models, tree width, prompts, budgets,
temperatures) is read from the config or the rows.
"""

from __future__ import annotations

from typing import Sequence

from spec_jax.evaluation import experiment, glossary, metrics, tables

# The paper's claims this experiment checks (Jeon et al. 2024, §5): at a fixed draft length the
# order RSD-S ≥ RSD-C ≥ SpecTr ≥ SD in τ; at a fixed budget RSD-S is usually the best.
FIXED_ORDER = ("rsd_s", "rsd_c", "spectr", "sd")
# A difference of τ counts when it exceeds this many standard errors of the difference (~95%).
NOISE_SE = 2.0
LEVEL = "level_acceptance"  # part (c)'s `part` tag

# results.md shows counts only. The wall-clock columns (speedup, tokens_per_s) stay in
# results.json: this experiment runs for hours on shared cores, paused and resumed, so a timed
# pass can include time it did not run (`speed_note`).
COLUMNS = ("method", "tree", "gamma", "block_efficiency", "tau_se", "acceptance_rate",
           "per_position_acceptance", "verifier_tokens_per_call", "drafter_calls_per_round",
           "identical_to_greedy")


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
  '<' when it falls short by more, '≈' (within noise) otherwise. Both rows decode the same
  prompts: the difference's standard error is paired over them where the rows carry per-prompt
  counts, else their standard errors combined as if independent (conservative;
  `metrics.tau_diff_se`)."""
  d = a["block_efficiency"] - b["block_efficiency"]
  se, _ = metrics.tau_diff_se(a, b)
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
  t = next(lv["temperature"] for lv in levels.values())
  md = [f"## (c) Why the rules differ: one tree level with k candidates (T = {t:g})", "",
        "The chance that one level of a draft tree accepts one of its k candidate tokens, per "
        f"rule, averaged over the positions of the verifier's own T = {t:g} continuations of the "
        "same prompts (both models teacher-forced; `evaluation/multidraft.py`, checked against "
        "the tree rules' acceptance frequencies in tests/test_multidraft.py). SD is k = 1, "
        "Σ min(p, q). SpecInfer tests i.i.d. candidates by recursive rejection: each later "
        "candidate against the residual norm((r − q)+) the rejections before it left. SpecTr "
        "(K-SEQ) accepts each i.i.d. candidate with min(1, p/(ρq)), with ρ ≥ 1 the smallest scale "
        "that keeps the emitted law exactly p. RSD draws its candidates without replacement and "
        "tests them recursively. ± is the standard error over prompts.", ""]
  for dataset, lv in levels.items():
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
      if r["dataset"] == dataset and r["temperature"] == lv["temperature"] and r["method"] in (
          "specinfer", "spectr"):
        pairs.setdefault(r["gamma"], {})[r["method"]] = r
    measured = [f"L = {depth}: SpecInfer {_tau(by['specinfer'])}, SpecTr {_tau(by['spectr'])} "
                f"({compare(by['specinfer'], by['spectr'])})"
                for depth, by in sorted(pairs.items()) if len(by) == 2]
    if measured:
      md += ["", f"Measured τ at fixed L (part (a), T = {t:g}; '>' / '<' beyond noise, '≈' "
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


def _models(config, rows) -> str:
  """'Verifier `V` (size), drafter `D` (size, how it was trained).', as the rows measured."""
  verifier = experiment.measured(rows, "verifier",
                                 config.verifier.checkpoint or config.verifier.size)
  drafter = experiment.measured(rows, "drafter", config.drafter.checkpoint or config.drafter.size)
  about = f", {config.drafter_about}" if config.get("drafter_about") else ""
  return (f"Verifier `{verifier}` ({config.verifier.size}), drafter `{drafter}` "
          f"({config.drafter.size}{about}).")


def _part_a(config, rows) -> list[str]:
  """Part (a): one table per (dataset, T), then the ordering check."""
  w = int(config.eval.tree_width)
  note, rows = speed_note(rows), [r for r in rows if r["part"] == "fixed_length"]
  md = ["## (a) Fixed draft length L", "",
        f"Tree methods use K = W = {w} (RSD-C b = ({w}, 1, ..., 1)), i.e. {w}L + 1 verifier "
        f"tokens per call; SD uses L + 1. At T = 0 SpecInfer/SpecTr draw K identical greedy "
        f"chains, so they equal SD; RSD-C is a top-{w} tree and RSD-S a beam search. "
        + note, ""]
  for dataset in config.datasets:
    for temperature in config.fixed_temperatures:
      sel = [r for r in rows if r["dataset"] == dataset and r["temperature"] == temperature]
      if not sel:
        continue
      # Every (T, L) run measured its own autoregressive baseline; show the first one.
      ar = [r for r in sel if r["method"] == "autoregressive"][:1]
      sel = ar + [r for r in sel if r["method"] != "autoregressive"]
      md += [f"### {dataset}, T = {temperature:g}", "",
             tables.markdown_table(sel, COLUMNS, method_order=("autoregressive",
                                                               *config.fixed_methods)), ""]
  lines, counts, trees_win = ordering_checks(rows)
  total = sum(counts.values())
  return md + [
      "### Does RSD-S ≥ RSD-C ≥ SpecTr ≥ SD (τ) hold at fixed L?", "",
      f"τ ± its standard error over prompts. pairs: each neighbour pair, '>' / '<' when the "
      f"difference exceeds {NOISE_SE:g} standard errors, '≈' within noise. verdict: 'does not "
      "hold' when a pair is reversed beyond noise, 'holds' when the point estimates are in "
      "order and none is, 'within noise' otherwise. At T = 0 SpecTr's K chains are all the "
      "drafter's argmax chain, i.e. SD's, so the greedy claim is RSD-S ≥ RSD-C ≥ SD.", "",
      *lines, "",
      f"The order holds in {counts['holds']} of {total} settings, is out of order only within "
      f"noise in {counts['within noise']} and does not hold in {counts['does not hold']}; "
      f"every tree method beats SD beyond noise in {trees_win} of {total}.", ""]


def _part_b(config, rows) -> list[str]:
  """Part (b): per budget dataset, the best τ of each method within each budget B."""
  t, first = config.budget_temperature, config.budget_widths[0]
  # Widths after the first run after the first width's runs: say which budgets they reached.
  extra = {w: [b for b in config.budgets if any(r.get("budget_width") == w and r["budget"] == b
                                                for r in rows)]
           for w in config.budget_widths[1:]}
  md = [f"## (b) Fixed verifier budget B (tokens per call), T = {t:g}", "",
        "Best τ of each method over every shape measured at this temperature with at most B "
        f"nodes (part (a)'s shapes included; shape in brackets): trees of width K = W = {first} "
        "as deep as B allows, SD with γ = B − 1"
        + "".join(f", plus width-{w} trees for B ∈ {{{', '.join(map(str, bs))}}}"
                  for w, bs in extra.items() if bs) + ". RSD-S verdict: 'holds' when it "
        f"has the best τ, 'within noise' when it is within {NOISE_SE:g} standard errors of the "
        "best, 'does not hold' otherwise.", ""]
  methods = list(config.fixed_methods)
  verdicts = {"holds": 0, "within noise": 0, "does not hold": 0}
  pool = [r for r in rows if r["temperature"] == t]
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
        verdicts[verdict] += 1
      md.append(f"| {b} | " + " | ".join(cells)
                + f" | {winner['method'] if winner else '–'} | {verdict} |")
    md.append("")
  # How many shapes each cell's maximum was taken over, at the largest budget.
  shapes = {m: max((sum(r["method"] == m and r["dataset"] == d
                        and r["verifier_tokens_per_call"] <= max(config.budgets) for r in pool)
                    for d in config.budget_datasets), default=0) for m in methods}
  md += [f"RSD-S has the best τ at {verdicts['holds']} budgets, is within noise of the best "
         f"at {verdicts['within noise']} and behind it beyond noise at "
         f"{verdicts['does not hold']}. Cells: τ ± standard error (shape). Each cell is the "
         "largest τ among its method's shapes within B (at the largest B: "
         + ", ".join(f"{m} {n}" for m, n in shapes.items()) + " shapes): the largest of noisy "
         "estimates is biased upwards, more for a method with more shapes, and the verdicts' "
         "standard errors do not account for that selection.", ""]
  se = [r["tau_se"] for r in pool if r.get("tau_se") is not None
        and r["method"] != "autoregressive"]
  if se:
    target = (f"; the experiment is sized for ≤ {config.target_se}"
              if config.get("target_se") else "")
    md += [f"Largest standard error of τ at T = {t:g}: {max(se):.3f} "
           f"(median {sorted(se)[len(se) // 2]:.3f}{target}).", ""]
  return md


def render_markdown(config, rows, command_line: str, levels=None,
                    missing: Sequence[str] = ()) -> str:
  """results.md: part (a)'s tables and ordering check, part (b)'s best-per-budget table, part
  (c)'s per-level acceptance (`levels`: dataset -> multidraft.analyse result), the plots and the
  glossary of the columns shown; `missing` (runs not finished) is listed first."""
  md = [f"# {config.title}", "",
        f"{_models(config, rows)} Command: `{command_line}`. "
        f"{config.eval.num_prompts} prompts × {config.eval.new_tokens} new tokens per setting, "
        f"batch {config.eval.batch_sizes[0]}, device: {rows[0]['device'] if rows else '?'}.", "",
        *([config.note, ""] if config.get("note") else []),
        *([f"**Not finished yet: {len(missing)} runs** ({', '.join(missing)}). Their rows are "
           "missing below, so part (b) shows only shapes measured so far; the command resumes "
           "them.", ""] if missing else []),
        *_part_a(config, rows),
        *_part_b(config, rows)]
  if levels:
    md += level_lines(levels, [r for r in rows if r["part"] == "fixed_length"])
  md += ["## Plots", "", "![τ vs L](tau_vs_depth.png) ![τ vs budget](tau_vs_budget.png)", "",
         "## Glossary", ""]
  md += glossary.markdown_lines(COLUMNS)
  return "\n".join(md) + "\n"


# One colour per method, one line style per temperature, one marker per dataset, so no two
# series look alike (matplotlib's 10-colour cycle repeats past 10 series).
_COLOURS = {"sd": "#444444", "specinfer": "#1f77b4", "spectr": "#2ca02c", "rsd_c": "#ff7f0e",
            "rsd_s": "#d62728"}
_MARKERS = ("o", "s", "^", "D")


def _short(dataset: str) -> str:
  return dataset.replace("spec_jax_", "")


def style(label: str, datasets: Sequence[str] = ("shakespeare", "pystdlib")) -> dict:
  """Line style of a series labelled 'method [T=t] dataset' (see plot_series)."""
  method, *rest = label.split(" ")
  name = next((w for w in rest if w in datasets), "")
  return dict(color=_COLOURS.get(method, "#9467bd"),
              linestyle="--" if "T=0" in rest else "-",
              marker=_MARKERS[min(datasets.index(name) if name in datasets else len(datasets),
                                  len(_MARKERS) - 1)])


def plot_series(config, rows) -> tuple[dict, dict]:
  """The series of tau_vs_depth.png (part a: τ vs L per method, temperature and dataset) and of
  tau_vs_budget.png (part b: the best τ within each budget per method and dataset), each
  label -> (xs, ys, standard errors), sorted by label."""
  depth = {}
  for r in rows:
    if r["part"] == "fixed_length" and r["method"] != "autoregressive":
      key = f"{r['method']} T={r['temperature']:g} {_short(r['dataset'])}"
      xs, ys, errs = depth.setdefault(key, ([], [], []))
      xs.append(r["gamma"])
      ys.append(r["block_efficiency"])
      errs.append(r.get("tau_se") or 0.0)
  pool = [r for r in rows if r["temperature"] == config.budget_temperature]
  budget = {}
  for dataset in config.budget_datasets:
    for b in config.budgets:
      best = best_within_budget([r for r in pool if r["dataset"] == dataset], b)
      for (_, m), r in best.items():
        xs, ys, errs = budget.setdefault(f"{m} {_short(dataset)}", ([], [], []))
        xs.append(b)
        ys.append(r["block_efficiency"])
        errs.append(r.get("tau_se") or 0.0)
  return dict(sorted(depth.items())), dict(sorted(budget.items()))


def report(config, collected: experiment.Collected, command_line: str) -> experiment.Report:
  """The experiment's Report: results.md, the two plots, level_acceptance.json (part (c)'s
  results, one per dataset); results.json holds the decoding rows."""
  rows = [r for r in collected.rows if r["part"] != LEVEL]
  levels = {r["dataset"]: {k: v for k, v in r.items() if k not in ("part", "run")}
            for r in collected.rows if r["part"] == LEVEL}
  levels = {d: levels[d] for d in config.datasets if d in levels}
  depth, budget = plot_series(config, rows)
  datasets = tuple(_short(d) for d in dict.fromkeys((*config.datasets,
                                                     *config.budget_datasets)))
  ylabel = "τ, block efficiency (tokens per verifier call)"

  def draw(series, xlabel, title):
    return lambda path: experiment.errorbar_plot(
        path, series, xlabel=xlabel, ylabel=ylabel, title=title,
        style=lambda label: style(label, datasets))
  return experiment.Report(
      markdown=render_markdown(config, rows, command_line, levels, collected.missing),
      plots={"tau_vs_depth.png": draw(
                 depth, "draft length L", f"Fixed draft length (K = W = "
                 f"{config.eval.tree_width}), τ ± standard error over prompts"),
             "tau_vs_budget.png": draw(
                 budget, "verifier tokens per call (budget B)",
                 f"Fixed budget, T = {config.budget_temperature:g} (best shape per method)")},
      extra_json={"level_acceptance.json": list(levels.values())},
      rows=rows)
