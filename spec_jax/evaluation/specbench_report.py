"""results.md and the plot of the task suite (spec_jax/programs/specbench_experiment.py).

Rows are evaluate rows (evaluation/bench.py Row) tagged `category`, `part`, `max_new_tokens`
and `drafter_source`; the generate run's rows (chat_turn2's first answers, part `turn1`) are
kept out of results.json. Per (batch size, temperature) results.md has a Spec-Bench-style table
(categories × methods: τ ± its standard error and the speedup over the same run's
autoregressive pass, plus the mean over categories), the per-position acceptance, the exactness
check of every greedy row, and the published anchors beside our numbers (PAPER_TAU,
SPEC_BENCH_TAU, each with where it comes from). tau_by_category.png draws τ ± SE per category
and method. Every fact the text states is read from the config or the rows.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from spec_jax.evaluation import experiment, glossary, tables

SUITE, TURN1 = "suite", "turn1"  # the `part` tags of the evaluate and generate runs
AR = "autoregressive"

# What each category's prompts are (spec_jax/data/suite.py), for results.md.
CATEGORY_ABOUT = {
    "chat": "ShareGPT test first user turns (multi-turn conversation, turn 1)",
    "chat_turn2": "ShareGPT second user turns after the verifier's own greedy first answer "
                  "(MT-bench's turn 2)",
    "code": "HumanEval prompts after \"Complete the code I provided.\"",
    "translation": "translation requests (ShareGPT's, and Shakespeare into modern English)",
    "summarization": "\"Summarize:\" over Shakespeare passages and stdlib module docstrings",
    "math": "seeded, templated grade-school word problems (GSM8K-style)",
    "qa": "a question answered from a given stdlib source passage (RAG-style)",
    "shakespeare": "continue a Shakespeare passage",
    "python": "continue stdlib Python code",
}

# τ, mean tokens per verifier call (bonus token included), greedy, batch 1, as the EAGLE-3
# paper's Table 1 reports it: Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of
# Large Language Models via Training-Time Test", arXiv:2503.01840v3, temperature 0. Read from
# quotations of that table in stored notes (the paper itself was not readable here); the
# Vicuna-13B MT-bench values (EAGLE-2 4.83, EAGLE-3 6.65) appear in two independent quotations,
# and LLaMA-3.1-8B's EAGLE-3 MT-bench τ 6.13 is also the paper's figure cited in
# sgl-project/sglang PR #4247. Tasks: MT-bench, HumanEval, GSM8K.
PAPER = "EAGLE-3 paper (arXiv:2503.01840v3), Table 1, T = 0"
PAPER_TASKS = (("MT-bench", ("chat", "chat_turn2")), ("HumanEval", ("code",)),
               ("GSM8K", ("math",)))
PAPER_TAU = (
    ("Vicuna-13B", "EAGLE-3", (6.65, 7.54, 6.29)),
    ("Vicuna-13B", "EAGLE-2", (4.83, 5.41, 4.79)),
    ("Vicuna-13B", "Medusa", (2.59, 2.78, 2.64)),
    ("LLaMA-Instruct-3.1-8B", "EAGLE-3", (6.13, 6.74, 6.23)),
    ("LLaMA-Instruct-3.3-70B", "EAGLE-3", (5.63, 6.52, 6.15)),
)
# Spec-Bench's leaderboard, "#Mean Accepted Tokens" over its six categories (multi-turn
# conversation, translation, summarization, QA, math, RAG), one A100, greedy, FP16, batch 1:
# hemingkx/Spec-Bench, Leaderboard.md at commit fd2c1cd7 (2025-04-22), "Leaderboard on A100".
# SpS is chain SD with a small draft model (ours: sd), PLD prompt lookup (ours: lookup).
SPEC_BENCH = "Spec-Bench leaderboard (hemingkx/Spec-Bench Leaderboard.md @ fd2c1cd7, A100)"
SPEC_BENCH_TAU = (
    ("Vicuna-7B-v1.3", {"EAGLE-2": 4.34, "Medusa": 2.31, "SpS": 2.28, "PLD": 1.75}),
    ("Vicuna-13B-v1.3", {"EAGLE-3": 5.71, "EAGLE-2": 4.43, "Medusa": 2.39, "SpS": 2.19,
                         "PLD": 1.67}),
    ("Vicuna-33B-v1.3", {"EAGLE-2": 4.05, "Medusa": 2.33, "SpS": 2.01, "PLD": 1.54}),
)
SPEC_BENCH_METHODS = ("EAGLE-3", "EAGLE-2", "Medusa", "SpS", "PLD")
OURS_FOR = {"SpS": "sd", "PLD": "lookup"}  # Spec-Bench's method -> ours

GLOSSARY_KEYS = ("method", "gamma", "temperature", "batch_size", "num_prompts", "new_tokens",
                 "block_efficiency", "tau_se", "per_position_acceptance", "tokens_per_s",
                 "speedup", "paired_speedup", "paired_speedups", "identical_to_greedy",
                 "reference_vs_step")


def method_key(row: dict, shaped: frozenset = frozenset()) -> str:
  """A row's column: its method, marked when BPD heads drafted a method the LM drafter also
  runs (e.g. sd from the heads); a method of several shapes in one run (`shaped`) is named by
  its tree (dyn:4-16 and dyn:8-32: `dyn K=4 M=16 L=4`), a chain by its depth (`sd@1`)."""
  m = row["method"]
  key = (row.get("tree") or f"{m}@{row.get('gamma')}") if m in shaped else m
  return f"{key} (BPD heads)" if row.get("drafter_source") == "bpd" and not m.startswith(
      "bpd") else key


def shaped_methods(rows) -> frozenset:
  """Methods whose rows carry more than one shape (tree, or a chain's depth): their columns
  are per shape."""
  trees: dict[str, set] = {}
  for r in rows:
    if r["method"] != AR:
      trees.setdefault(r["method"], set()).add((r.get("tree"), r.get("gamma")))
  return frozenset(m for m, t in trees.items() if len(t) > 1)


def settings(rows) -> list[tuple[int, float]]:
  """(batch size, temperature) of every table, batch 1 first."""
  return sorted({(int(r["batch_size"]), float(r["temperature"])) for r in rows})


def grid(rows, batch_size: int, temperature: float) -> dict[str, dict[str, dict]]:
  """category -> method column -> row, at one (batch size, temperature); the autoregressive
  row of the main (LM drafter) run under AR."""
  out, shaped = {}, shaped_methods(rows)
  for r in rows:
    if int(r["batch_size"]) != batch_size or float(r["temperature"]) != temperature:
      continue
    if r["method"] == AR and r.get("drafter_source") == "bpd":
      continue  # the BPD runs' own baselines only serve their speedups
    out.setdefault(r["category"], {})[method_key(r, shaped)] = r
  return out


def speedup_of(row: dict) -> float:
  """A row's speedup: the median of its paired passes where it has them, else its one pass's."""
  paired = row.get("paired_speedup")
  return row["speedup"] if paired is None else paired


def paired_range(row: dict) -> tuple[float, float] | None:
  """(lowest, highest) of a row's paired speedups; None without paired passes."""
  runs = row.get("paired_speedups")
  return (min(runs), max(runs)) if runs else None


def mean_over(cells: Sequence[dict]) -> tuple[float, float | None, float]:
  """(mean τ, its standard error, mean speedup) over categories: the unweighted mean of the
  categories' values (Spec-Bench's overall pools every decoding step instead: `pooled_tau`),
  SE = √(Σ SE²) / n as if the categories were independent prompt sets (some share source
  passages or first turns, so it is a lower bound)."""
  n = len(cells)
  tau = sum(r["block_efficiency"] for r in cells) / n
  ses = [r.get("tau_se") for r in cells]
  se = None if any(s is None for s in ses) else math.sqrt(sum(s * s for s in ses)) / n
  return tau, se, sum(speedup_of(r) for r in cells) / n


def _bound(x: float) -> str:
  """A paired range's end: two decimals, three where two would print 1.00 for a pass that was
  not exactly as fast as autoregressive decoding (the verdicts read the unrounded values)."""
  return f"{x:.3f}" if f"{x:.2f}" == "1.00" and x != 1.0 else f"{x:.2f}"


def _cell(tau: float, se: float | None, speedup: float,
          spread: tuple[float, float] | None = None) -> str:
  return (f"{tau:.2f}" + (f" ± {se:.2f}" if se is not None else "") + f" · {speedup:.2f}×"
          + (f" [{_bound(spread[0])}, {_bound(spread[1])}]" if spread else ""))


def row_cell(r: dict) -> str:
  """τ ± SE · speedup, with the paired passes' range where the row has them."""
  return _cell(r["block_efficiency"], r.get("tau_se"), speedup_of(r), paired_range(r))


def paired_verdicts(config, rows, batch_size: int, temperature: float) -> list[str]:
  """Per method with paired passes: the categories where every paired pass ran faster than
  autoregressive decoding, those where every one ran slower, and the rest (unresolved)."""
  cells = grid(rows, batch_size, temperature)
  cats = [c for c in config.suite.categories if c in cells]
  lines = []
  for m in columns(config, rows):
    spans = {c: paired_range(cells[c][m]) for c in cats if m in cells[c]}
    spans = {c: s for c, s in spans.items() if s}
    if not spans:
      continue
    n = {len(cells[c][m]["paired_speedups"]) for c in spans}
    faster = [c for c, (lo, _) in spans.items() if lo > 1.0]
    slower = [c for c, (_, hi) in spans.items() if hi < 1.0]
    rest = [c for c in spans if c not in faster and c not in slower]
    lines.append(
        f"- **{m}** ({'/'.join(map(str, sorted(n)))} paired passes per category): faster than "
        f"autoregressive decoding in every pass in {len(faster)} of {len(spans)} categories"
        + (f" ({', '.join(faster)})" if faster else "") + f"; slower in every pass in "
        f"{len(slower)}" + (f" ({', '.join(slower)})" if slower else "")
        + f"; unresolved in {len(rest)}" + (f" ({', '.join(rest)})" if rest else "") + ".")
  return lines


def columns(config, rows) -> list[str]:
  """Method columns: eval.methods' order (by name), then BPD's, then any other."""
  shaped = shaped_methods(rows)
  names = [str(m).partition("@")[0].partition(":")[0]
           for m in (*config.eval.methods, *config.get("bpd_methods", ()))]
  # A method of several shapes: its shapes in the order the rows list them, where its name is.
  by_shape = {m: list(dict.fromkeys(method_key(r, shaped) for r in rows if r["method"] == m))
              for m in shaped}
  names = [k for m in names for k in by_shape.get(m, [m])]
  seen = {method_key(r, shaped) for r in rows if r["method"] != AR}
  return [m for m in dict.fromkeys(names) if m in seen] + sorted(seen - set(names))


def suite_table(config, rows, batch_size: int, temperature: float) -> list[str]:
  """The Spec-Bench-style table at one setting: a row per category (the autoregressive
  tokens/s, then τ ± SE · speedup per method) and the mean over categories."""
  cells = grid(rows, batch_size, temperature)
  methods = columns(config, rows)
  cats = [c for c in config.suite.categories if c in cells]
  md = ["| category | AR tokens/s | " + " | ".join(methods) + " |",
        "|---|---:|" + "---:|" * len(methods)]
  for c in cats:
    ar = cells[c].get(AR)
    line = [c, tables.format_value(ar["tokens_per_s"]) if ar else "–"]
    line += [row_cell(r) if r else "–" for r in (cells[c].get(m) for m in methods)]
    md.append("| " + " | ".join(line) + " |")
  means = []
  for m in methods:
    have = [cells[c][m] for c in cats if m in cells[c]]
    means.append("–" if not have else _cell(*mean_over(have))
                 + ("" if len(have) == len(cats) else f" ({len(have)} of {len(cats)})"))
  md.append("| **mean** | | " + " | ".join(means) + " |")
  return md


def position_table(config, rows, batch_size: int, temperature: float) -> list[str]:
  """Per-position acceptance (P(draft i accepted | 1..i-1 accepted)) per category and method."""
  cells = grid(rows, batch_size, temperature)
  methods = columns(config, rows)
  md = ["| category | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
  for c in (c for c in config.suite.categories if c in cells):
    md.append(f"| {c} | " + " | ".join(
        tables.format_value((cells[c].get(m) or {}).get("per_position_acceptance"))
        for m in methods) + " |")
  return md


def exactness_line(rows) -> str:
  """Whether every greedy speculative row reproduced the verifier's greedy output."""
  greedy = [r for r in rows if float(r["temperature"]) == 0.0 and r["method"] != AR]
  shaped = shaped_methods(rows)
  bad = [f"{r['category']}/{method_key(r, shaped)}/B={r['batch_size']}" for r in greedy
         if r.get("identical_to_greedy") is not True]
  if not greedy:
    return "No greedy rows yet."
  if not bad:
    return (f"Exactness: all {len(greedy)} greedy speculative rows are identical to the "
            "verifier's greedy output, token for token.")
  return (f"**Exactness: {len(bad)} of {len(greedy)} greedy rows differ from the verifier's "
          f"greedy output**: {', '.join(bad)}.")


def tree_table(config, rows, batch_size: int, temperature: float) -> list[str]:
  """Every tree row beside the chain (`sd`) of its category: τ and its ratio to the chain's,
  the verifier tokens per call, the measured cost of that call r (in one-token steps), the
  drafter's cost ratio c, its calls per round with the tokens each feeds, their cost Σ_w c(w)
  (`drafter_c`), the verifier's one-token forward in those timings over the autoregressive step
  (`reference_vs_step`: over 1.5, they ran in a slow spell), the theoretical speedup
  τ / (r + Σ_w c(w)) and the measured speedup, each over the same run's autoregressive pass.
  Empty without tree rows."""
  cells = grid(rows, batch_size, temperature)
  md = []
  for c in (c for c in config.suite.categories if c in cells):
    for key, r in cells[c].items():
      if not r.get("tree") or r["method"] == AR:
        continue
      chain = column(cells[c], "sd", r.get("gamma"))
      ratio = (r["block_efficiency"] / chain["block_efficiency"]) if chain else None
      md.append("| " + " | ".join([
          c, key, row_cell(r),
          tables.format_value(ratio), str(r.get("verifier_tokens_per_call")),
          tables.format_value(r.get("verifier_cost_ratio_r")),
          tables.format_value(r.get("cost_ratio_c")), calls_cell(r),
          tables.format_value(r.get("drafter_c")),
          tables.format_value(r.get("reference_vs_step")),
          tables.format_value(r.get("theoretical_speedup")),
          tables.format_value(speedup_of(r) / speedup_of(chain) if chain else None)]) + " |")
  if not md:
    return []
  return ["| category | tree | τ ± SE · speedup | τ / τ(sd) | tokens per call | r | c | "
          "drafter calls per round (tokens each) | Σ c(w) | reference / AR step | "
          "theoretical speedup | speedup / sd's |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *md]


def calls_cell(row: dict) -> str:
  """d, with the tokens each call feeds where a tree's calls differ: '4 (1+8+8+8)'."""
  widths = row.get("call_widths")
  calls = str(row.get("drafter_calls_per_round"))
  return f"{calls} ({'+'.join(map(str, widths))})" if widths else calls


def column(cells: dict, method: str, gamma) -> dict | None:
  """One category's row of `method`: its own column, or `method@gamma` where the run has it
  at several depths (`method_key`)."""
  return cells.get(method) or cells.get(f"{method}@{gamma}")


def pooled_tau(cells: Sequence[dict]) -> float:
  """τ over several categories' rows as Spec-Bench and EAGLE count it over a benchmark: every
  decoding step pooled, Σ tokens / Σ verifier calls (not the mean of the categories' τ)."""
  return sum(r["new_tokens"] for r in cells) / sum(r["verifier_calls"] for r in cells)


def _ours(rows, method: str, cats: Sequence[str], gamma=None) -> float | None:
  """Our τ of `method` (at depth `gamma` where it ran at several) pooled over `cats` (those
  measured, `pooled_tau`), greedy, at the smallest batch."""
  cells = grid(rows, min([int(r["batch_size"]) for r in rows], default=1), 0.0)
  have = [row for row in (column(cells.get(c, {}), method, gamma) for c in cats) if row]
  return pooled_tau(have) if have else None


def anchor_lines(config, rows) -> list[str]:
  """Our greedy τ (smallest batch) beside the published ones (module constants, with their
  sources: greedy, batch 1)."""
  fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
  verifier = experiment.measured(rows, "verifier", config.verifier.checkpoint
                                 or config.verifier.size)
  methods = columns(config, rows)
  b = min([int(r["batch_size"]) for r in rows], default=1)
  md = ["## Published anchors (τ, greedy)", "",
        "Theirs are 7B-70B targets with drafters trained on ShareGPT (and UltraChat for "
        f"EAGLE-3), batch 1 on GPUs; ours is a {config.verifier.size} verifier (`{verifier}`) "
        f"with {config.get('drafter_about') or 'its drafter'}, at batch {b}, on the rows "
        "above. τ is the same count in both (tokens "
        "per verifier call, the bonus token included), so the distance is the drafters' "
        "and the tree budgets' (EAGLE-2/3's evaluation scripts verify trees of up to 60 "
        "tokens per call: `--total-token` in SafeAILab/EAGLE). MT-bench's "
        "column pools our chat and chat_turn2 rounds (its turns 1 and 2), as EAGLE pools a "
        "benchmark's steps.", "",
        f"### Per task: {PAPER}", "",
        "| target | method | " + " | ".join(f"{t} (ours: {'+'.join(c)})"
                                             for t, c in PAPER_TASKS) + " |",
        "|---|---|" + "---:|" * len(PAPER_TASKS)]
  for target, method, taus in PAPER_TAU:
    md.append(f"| {target} | {method} | " + " | ".join(map(fmt, taus)) + " |")
  for m in methods:
    md.append(f"| {config.verifier.size} (ours) | {m} | " + " | ".join(
        fmt(_ours(rows, m, cats)) for _, cats in PAPER_TASKS) + " |")
  names = SPEC_BENCH_METHODS
  md += ["", f"### Mean over categories: {SPEC_BENCH}", "",
         "Spec-Bench's mean accepted tokens over its six categories beside ours over our "
         "categories, both pooled over every decoding step (Σ tokens / Σ verifier calls; SpS, a "
         "small draft model, ~ our sd; PLD, prompt lookup, ~ our lookup).", "",
         "| target | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
  for target, taus in SPEC_BENCH_TAU:
    md.append(f"| {target} | " + " | ".join(fmt(taus.get(n)) for n in names) + " |")
  cats = tuple(config.suite.categories)
  md.append(f"| {config.verifier.size} (ours) | " + " | ".join(
      fmt(_ours(rows, OURS_FOR[n], cats, config.eval.gammas[0])) if n in OURS_FOR else "–"
      for n in names) + " |")
  return md + [""]


def _counts(rows, key: str) -> str:
  """'16' when every category has the same value of `key` (from its AR rows), else per category."""
  per = {r["category"]: r[key] for r in rows if r["method"] == AR}
  values = sorted(set(per.values()))
  if len(values) <= 1:
    return tables.format_value(values[0] if values else None, key)
  return ", ".join(f"{c} {v:g}" for c, v in per.items())


def render_markdown(config, rows, command_line: str, missing: Sequence[str] = ()) -> str:
  """results.md: models, command and sizes; the runs not finished; per (batch size, T) the
  suite table and per-position acceptance; exactness; anchors; the plot; the glossary."""
  verifier = experiment.measured(rows, "verifier", config.verifier.checkpoint
                                 or config.verifier.size)
  drafter = experiment.measured([r for r in rows if r.get("drafter_source") != "bpd"],
                                "drafter", config.drafter.checkpoint or config.drafter.size)
  devices = experiment.measured(rows, "device", "?")
  md = [f"# {config.title}", "",
        f"Verifier `{verifier}` ({config.verifier.size}), drafter `{drafter}`"
        + (f" ({config.drafter_about})" if config.get("drafter_about") else "")
        + (f", BPD heads `{config.bpd_checkpoint}`" if config.get("bpd_checkpoint") else "")
        + f". Command: `{command_line}`. Prompts per category: {_counts(rows, 'num_prompts')} "
        f"(suite.split {config.suite.split}, seed {config.suite.seed}), up to "
        f"{config.eval.new_tokens} new tokens each, γ = {', '.join(map(str, config.eval.gammas))}"
        f", device: {devices}.", ""]
  if config.get("note"):
    md += [config.note, ""]
  if missing:
    md += [f"**Not finished yet: {len(missing)} runs** ({', '.join(missing)}); the command "
           "resumes them.", ""]
  md += ["Cells: τ ± its standard error over prompts · speedup over the autoregressive pass "
         "of the same run (same process, same prompts). Mean: the unweighted mean over the "
         "categories (standard error √(Σ SE²)/n). Where a row has paired passes "
         "(eval.timing_pairs: the method and autoregressive decoding taking turns batch by "
         "batch), its speedup is their median and [lowest, highest] follows it.", ""]
  for b, t in settings(rows):
    verdicts = paired_verdicts(config, rows, b, t)
    md += [f"## Batch {b}, T = {t:g}", "", *suite_table(config, rows, b, t), "",
           *([f"Paired passes (batch {b}, T = {t:g}):", "", *verdicts, ""] if verdicts else []),
           f"Per-position acceptance (batch {b}, T = {t:g}):", "",
           *position_table(config, rows, b, t), ""]
    trees = tree_table(config, rows, b, t)
    if trees:
      md += [f"Trees against the chain (batch {b}, T = {t:g}; sd at the same γ; r and c "
             "measured in this run):", "", *trees, ""]
  md += [exactness_line(rows), ""]
  md += anchor_lines(config, rows)
  paired = any(paired_range(r) for r in rows)
  md += ["## Plot", "", "![τ by category](tau_by_category.png)", ""]
  if paired:
    md += ["![speedup by category](speedup_by_category.png)", ""]
  md += ["## Categories", ""]
  md += [f"- **{c}**: {CATEGORY_ABOUT.get(c, c)}" for c in config.suite.categories]
  md += ["", "## Glossary", "", *glossary.markdown_lines(
      k for k in GLOSSARY_KEYS if paired or not k.startswith("paired_"))]
  return "\n".join(md) + "\n"


def _panels(config, rows, cell) -> dict[str, dict[str, dict[str, tuple]]]:
  """A bar chart's data: panel 'T = t' (batch 1, else the smallest batch) -> method -> category
  -> cell(row), for the speculative rows where cell(row) is not None."""
  if not rows:
    return {}
  b = min(int(r["batch_size"]) for r in rows)
  out = {}
  for t in sorted({float(r["temperature"]) for r in rows}):
    for c, by in grid(rows, b, t).items():
      for m, r in by.items():
        value = cell(r) if m != AR else None
        if value is not None:
          out.setdefault(f"T = {t:g}, batch {b}", {}).setdefault(m, {})[c] = value
  order = columns(config, rows)
  return {p: {m: by[m] for m in order if m in by} for p, by in out.items()}


def plot_panels(config, rows) -> dict[str, dict[str, dict[str, tuple[float, float]]]]:
  """The τ chart's data (`_panels`): method -> category -> (τ, SE)."""
  return _panels(config, rows, lambda r: (r["block_efficiency"], r.get("tau_se") or 0.0))


def _paired_cell(row: dict) -> tuple | None:
  span = paired_range(row)
  if not span:
    return None
  mid = speedup_of(row)
  return mid, (mid - span[0], span[1] - mid)


def speedup_panels(config, rows) -> dict[str, dict[str, dict[str, tuple]]]:
  """The speedup chart's data (`_panels`), for the rows with paired passes: method -> category
  -> (median paired speedup, (its distance down to the lowest pass, up to the highest))."""
  return _panels(config, rows, _paired_cell)


def bar_plot(path: str, panels: Mapping[str, Mapping[str, Mapping[str, tuple]]],
             categories: Sequence[str], *, ylabel: str, title: str,
             hline: float | None = None) -> None:
  """A PNG of grouped bars with error bars: one subplot per panel, the categories along x in
  the given order (strings, which experiment.errorbar_plot's bars do not take), one bar per
  method at each. A cell is (height, error): ± error, or (down, up) for an uneven bar.
  matplotlib's Agg canvas, constrained layout, legend outside, 120 dpi."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  labels = list(dict.fromkeys(m for by in panels.values() for m in by))
  fig = Figure(figsize=(max(6.0, 0.9 * len(categories) + 2.0), 3.6 * max(len(panels), 1)),
               layout="constrained")
  FigureCanvasAgg(fig)
  width = 0.8 / max(len(labels), 1)
  handles = {}
  for i, (panel, by) in enumerate(panels.items()):
    ax = fig.add_subplot(len(panels), 1, i + 1)
    for m, cells in by.items():
      xs = [k for k, c in enumerate(categories) if c in cells]
      slot = (labels.index(m) - (len(labels) - 1) / 2) * width
      errs = [cells[categories[x]][1] for x in xs]
      errs = [[e[0] if isinstance(e, tuple) else e for e in errs],
              [e[1] if isinstance(e, tuple) else e for e in errs]]
      handles.setdefault(m, ax.bar(
          [x + slot for x in xs], [cells[categories[x]][0] for x in xs], width,
          yerr=errs, capsize=2, label=m,
          color=f"C{labels.index(m) % 10}"))
    if hline is not None:
      ax.axhline(hline, color="gray", linestyle=":", linewidth=1.0)
    ax.set_xticks(range(len(categories)), list(categories), rotation=20, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(panel, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
  fig.suptitle(title, fontsize=10)
  if handles:
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="outside right upper")
  fig.savefig(path, dpi=120)


def report(config, collected: experiment.Collected, command_line: str) -> experiment.Report:
  """The experiment's Report: results.md and tau_by_category.png over the evaluate rows, which
  results.json holds (the first answers stay in their run's results.json)."""
  rows = [r for r in collected.rows if r.get("part") == SUITE]
  cats = [c for c in config.suite.categories if any(r["category"] == c for r in rows)]
  plots = {"tau_by_category.png": lambda path: bar_plot(
      path, plot_panels(config, rows), cats, hline=1.0,
      ylabel="τ (tokens per verifier call)",
      title="τ ± standard error over prompts, per category and method")}
  speed = speedup_panels(config, rows)
  if speed:
    plots["speedup_by_category.png"] = lambda path: bar_plot(
        path, speed, cats, hline=1.0, ylabel="speedup over autoregressive",
        title="speedup: median of the paired passes, bars from the lowest to the highest")
  return experiment.Report(
      markdown=render_markdown(config, rows, command_line, collected.missing),
      plots=plots, rows=rows)
