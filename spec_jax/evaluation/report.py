"""Reports for evaluation runs: markdown tables, the metrics glossary and PNG plots.

Input is the list of flat rows that `benchmark.write_results` stores in `results.json`, one row
per setting (method, γ, temperature, batch size, ...), with metric keys named as in the glossary of
DESIGN.md §3. Every report prints the glossary entries of the columns it shows, because a bare
"acceptance length" is ambiguous (vLLM#13990, EAGLE#153).

Plots use matplotlib's Agg canvas directly (no pyplot), so they never need a display and never
touch the process-wide backend of a caller that has its own figures open.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any, Callable, Iterable, Sequence

from spec_jax.evaluation import theory

# One-line definitions, DESIGN.md §3 wording. The order is the order the glossary is printed in.
GLOSSARY: dict[str, str] = {
    "method": "decoding method: autoregressive (one verifier call per token), sd (chain "
              "speculative decoding with a draft model), rsd_c, specinfer, ...",
    "gamma": "γ, draft length: draft tokens proposed per verifier call (tree depth for tree "
             "methods); none for autoregressive",
    "temperature": "sampling temperature applied to both drafter and verifier; 0 is greedy",
    "top_k": "top-k truncation of the sampling distribution (0 = off)",
    "top_p": "nucleus (top-p) truncation of the sampling distribution (1 = off)",
    "batch_size": "prompts decoded together; rows keep their own lengths (ragged acceptance)",
    "num_prompts": "prompts in the evaluation set",
    "new_tokens": "total tokens emitted over all prompts",
    "block_efficiency": "τ, block efficiency: tokens emitted per verifier call, bonus/correction "
                        "token included (chain SD with i.i.d. acceptance: "
                        "τ = (1-α^{γ+1})/(1-α))",
    "mean_accepted_tokens": "mean accepted tokens: accepted draft tokens per verifier call, τ - 1",
    "acceptance_rate": "α, acceptance rate: mean over draft positions of Σ_x min(p(x), q(x)), "
                       "p the verifier's and q the drafter's distribution",
    "empirical_acceptance": "empirical accept fraction: accepted draft tokens / proposed draft "
                            "tokens",
    "per_position_acceptance": "per-position (conditional) acceptance: P(draft i accepted | "
                               "drafts 1..i-1 accepted), i = 1..γ",
    "verifier_calls": "verifier forward calls, prefill excluded",
    "drafter_calls": "drafter forward calls (one per draft step), prefill excluded",
    "tokens_per_s": "wall-clock tokens emitted per second, whole batch, compilation excluded",
    "speedup": "speedup: wall-clock tokens/s of the method over autoregressive decoding of the "
               "same verifier, measured in the same process",
    "cost_ratio_c": "c: drafter step time / verifier call time, measured",
    "theoretical_speedup": "theoretical speedup τ/(γc+1), with τ and c measured",
    "speedup_vs_theory": "measured speedup / theoretical speedup",
    "verifier_tokens_per_call": "cost at fixed budget: tokens fed to the verifier per call "
                                "(chain γ+1, tree node count)",
    "drafter_calls_per_round": "drafter forward calls per verification round (chain γ, tree "
                               "depth L: one call per level)",
    "tree": "draft tree shape: rsd_c b=branching per depth, rsd_s W=beam width, specinfer/spectr "
            "K=i.i.d. chains; L = depth",
    "identical_to_greedy": "exactness check: greedy speculative output equals the verifier's "
                           "greedy output token for token (none when sampling)",
    "lenience": "lossy lenience function (f_lin = p/ε, f_sq = p/ε², f_exp = p^ε); none is "
                "lossless",
    "epsilon": "ε, the lenience parameter",
    "verifier_loglik": "quality: mean log-likelihood per generated token under the raw verifier "
                       "(temperature 1, no truncation), teacher-forced on the generated text",
    "token_tv": "quality cost of lossy decoding: mean over generated positions of ½‖π - p‖₁, "
                "π the one-step law of the lenient rule, p the verifier's (0 when lossless)",
    "dataset": "prompt set",
    "drafter": "draft model",
    "seed": "random seed of the sampling rng",
    "device": "accelerator the timings were taken on",
}

# Table headers carry the paper symbol beside the glossary name.
_SYMBOLS = {"gamma": "γ", "temperature": "T", "block_efficiency": "τ",
            "mean_accepted_tokens": "τ-1", "acceptance_rate": "α", "cost_ratio_c": "c",
            "epsilon": "ε"}

DEFAULT_COLUMNS = ("method", "gamma", "temperature", "batch_size", "block_efficiency",
                   "acceptance_rate", "empirical_acceptance", "tokens_per_s", "speedup",
                   "theoretical_speedup", "speedup_vs_theory", "per_position_acceptance",
                   "verifier_loglik", "token_tv")

# Settings that get a table column (and split plot series) only when they vary across rows.
_EXTRA_SETTINGS = ("tree", "dataset", "drafter", "lenience", "epsilon", "top_k", "top_p", "seed",
                   "device")

# Settings and counts: printed with `g` (0.6, 4, 1000), not rounded like measured metrics.
_EXACT_KEYS = frozenset({"gamma", "temperature", "top_k", "top_p", "batch_size", "num_prompts",
                         "new_tokens", "verifier_calls", "drafter_calls",
                         "verifier_tokens_per_call", "drafter_calls_per_round", "seed",
                         "epsilon"})

_GROUP_KEYS = ("temperature", "batch_size")
_TAU_THEORY_LABEL = r"theory $(1-\alpha^{\gamma+1})/(1-\alpha)$, α measured"
_SPEEDUP_THEORY_LABEL = r"theory $\tau/(\gamma c+1)$"


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def format_value(value: Any, key: str | None = None) -> str:
  """Table text for one value: None as '–', lists as '0.71/0.62', 2–3 significant decimals."""
  if value is None:
    return "–"
  if isinstance(value, (list, tuple)):
    return "/".join(f"{float(v):.2f}" if _is_number(v) else "–" for v in value) or "–"
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, numbers.Integral):
    return str(int(value))
  if _is_number(value):
    value = float(value)
    if math.isnan(value) or math.isinf(value):
      return str(value)
    if key in _EXACT_KEYS:
      return f"{value:g}"
    magnitude = abs(value)
    if magnitude >= 100:
      return f"{value:.0f}"
    if magnitude >= 10:
      return f"{value:.1f}"
    if magnitude >= 0.01 or magnitude == 0:
      return f"{value:.2f}"
    return f"{value:.2g}"  # a tiny cost ratio must not print as 0.00
  # A '|' inside a cell would split the markdown row.
  return str(value).replace("|", "\\|")


def column_label(key: str) -> str:
  """Header text: the glossary name, with its symbol where the papers use one."""
  return f"{key} ({_SYMBOLS[key]})" if key in _SYMBOLS else key


def _sort_key(value: Any) -> tuple:
  # Numbers before strings before None, so mixed or missing values never raise in sorted().
  if _is_number(value):
    return (0, float(value), "")
  if value is None:
    return (2, 0.0, "")
  return (1, 0.0, str(value))


def _gamma(row: dict) -> Any:
  # Autoregressive rows carry gamma None or 0; both sort (and plot) as "no drafts".
  return row.get("gamma") or 0


def sort_rows(rows: Iterable[dict], method_order: Sequence[str] | None = None) -> list[dict]:
  """Rows sorted by (method, temperature, batch_size, γ).

  Methods keep `method_order`, then the order they first appear in, so autoregressive stays
  first when the evaluation ran it first.
  """
  rows = list(rows)
  order = list(method_order or ())
  for row in rows:
    if row.get("method") not in order:
      order.append(row.get("method"))
  return sorted(rows, key=lambda r: (order.index(r.get("method")),
                                     _sort_key(r.get("temperature")),
                                     _sort_key(r.get("batch_size")), _sort_key(_gamma(r))))


def group_rows(rows: Iterable[dict], keys: Sequence[str] = _GROUP_KEYS
               ) -> list[tuple[dict[str, Any], list[dict]]]:
  """[(group values, sorted rows)], one group per distinct value of `keys`, groups sorted."""
  rows = sort_rows(rows)
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
  ordered = sorted(groups, key=lambda values: tuple(_sort_key(v) for v in values))
  return [(dict(zip(keys, values)), groups[values]) for values in ordered]


def _varying(rows: Sequence[dict], key: str) -> bool:
  values = {json.dumps(r.get(key), sort_keys=True, default=str) for r in rows}
  return len(values) > 1


def default_columns(rows: Sequence[dict]) -> list[str]:
  """DEFAULT_COLUMNS present in some row, plus extra settings (lenience, seed...) that vary."""
  present = {k for row in rows for k in row}
  columns = [c for c in DEFAULT_COLUMNS if c in present]
  extras = [k for k in _EXTRA_SETTINGS if k in present and _varying(rows, k)]
  # Extra settings sit right after the method: they name the setting as much as γ does.
  at = 1 if columns[:1] == ["method"] else 0
  return columns[:at] + extras + columns[at:]


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None, *,
                   method_order: Sequence[str] | None = None) -> str:
  """A GitHub markdown table of `rows`, sorted by (method, temperature, batch_size, γ).

  Missing values print as '–'; numeric columns are right-aligned.
  """
  rows = sort_rows(rows, method_order)
  if not rows:
    return "_No rows._"
  columns = list(columns) if columns is not None else default_columns(rows)
  cells = [[format_value(row.get(c), c) for c in columns] for row in rows]
  numeric = [any(_is_number(row.get(c)) for row in rows) for c in columns]
  lines = ["| " + " | ".join(column_label(c) for c in columns) + " |",
           "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
  lines += ["| " + " | ".join(line) + " |" for line in cells]
  return "\n".join(lines)


def load_rows(path: str) -> list[dict]:
  """Rows from a results.json file, or from the results.json inside a workdir."""
  if os.path.isdir(path):
    path = os.path.join(path, "results.json")
  with open(path, encoding="utf-8") as f:
    rows = json.load(f)
  if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
    raise ValueError(f"{path} should hold a JSON list of row objects, got {type(rows).__name__}.")
  return rows


# ----------------------------------------------------------------------------------------------
# Plots


def _speculative_rows(rows: Iterable[dict]) -> list[dict]:
  """Rows that drafted: γ a positive number (autoregressive has None or 0)."""
  return [r for r in rows if _is_number(r.get("gamma")) and r["gamma"] > 0]


def tau_theory(row: dict) -> float | None:
  """Chain SD with i.i.d. acceptance (Leviathan et al. eq. 1): τ = (1-α^{γ+1})/(1-α)."""
  alpha, gamma = row.get("acceptance_rate"), row.get("gamma")
  if not (_is_number(alpha) and _is_number(gamma)) or math.isnan(alpha):
    return None
  return float(theory.expected_block_efficiency(min(alpha, 1.0), int(gamma)))


def _devices(rows: Iterable[dict]) -> list[str]:
  return sorted({str(r["device"]) for r in rows if r.get("device") is not None})


def _series_label(key: tuple, extras: Sequence[str]) -> str:
  method, temperature, *rest = key
  parts = [str(method), f"T={format_value(temperature, 'temperature')}"]
  parts += [f"{k}={format_value(v, k)}" for k, v in zip(extras, rest)]
  return ", ".join(parts)


def _mean_by_gamma(rows: Sequence[dict], value_fn: Callable[[dict], Any]
                   ) -> tuple[list[float], list[float]]:
  # Rows repeated at one γ (e.g. several seeds) are averaged into one point.
  by_gamma: dict[float, list[float]] = {}
  for row in rows:
    value = value_fn(row)
    if _is_number(value) and not math.isnan(value):
      by_gamma.setdefault(row["gamma"], []).append(float(value))
  gammas = sorted(by_gamma)
  return gammas, [sum(by_gamma[g]) / len(by_gamma[g]) for g in gammas]


def _plot_vs_gamma(rows: Sequence[dict], *, y_key: str, ylabel: str, title: str,
                   theory_fn: Callable[[dict], Any], theory_label: str,
                   baseline: float | None = None):
  """One subplot per batch size, one solid line per series and its theory dashed beside it."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.lines import Line2D

  rows = [r for r in _speculative_rows(rows) if _is_number(r.get(y_key))]
  if not rows:
    return None
  batch_sizes = sorted({r.get("batch_size") for r in rows}, key=_sort_key)
  all_gammas = sorted({r["gamma"] for r in rows})
  # Series are (method, temperature) plus any extra setting that varies, except seeds: rows that
  # differ only by seed are averaged rather than drawn as separate lines.
  extras = [k for k in _EXTRA_SETTINGS if k != "seed" and _varying(rows, k)]
  series_key = lambda r: (r.get("method"), r.get("temperature"), *(r.get(k) for k in extras))
  methods = list(dict.fromkeys(r.get("method") for r in rows))
  keys = sorted({series_key(r) for r in rows},
                key=lambda k: (methods.index(k[0]), *map(_sort_key, k[1:])))
  # The same series keeps its colour in every subplot.
  colors = {k: f"C{i % 10}" for i, k in enumerate(keys)}

  ncols = min(len(batch_sizes), 3)
  nrows = math.ceil(len(batch_sizes) / ncols)
  fig = Figure(figsize=(5.0 * ncols, 4.0 * nrows), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True).ravel()
  for unused in axes[len(batch_sizes):]:
    fig.delaxes(unused)
  legend: dict[str, Any] = {}  # label -> handle, one figure legend so no panel's data is hidden
  for ax, batch_size in zip(axes, batch_sizes):
    in_panel = [r for r in rows if r.get("batch_size") == batch_size]
    drew_theory = False
    for key in keys:
      series = [r for r in in_panel if series_key(r) == key]
      if not series:
        continue
      gammas, values = _mean_by_gamma(series, lambda r: r[y_key])
      ax.plot(gammas, values, marker="o", color=colors[key], label=_series_label(key, extras))
      gammas, values = _mean_by_gamma(series, theory_fn)
      if gammas:
        # A marker too, so a series measured at a single γ still shows its theory point.
        ax.plot(gammas, values, linestyle="--", marker="x", color=colors[key], alpha=0.7)
        drew_theory = True
    for handle, label in zip(*ax.get_legend_handles_labels()):
      legend.setdefault(label, handle)
    if drew_theory:
      # One legend entry for all the dashed lines; each dashed line has its series' colour.
      legend.setdefault(theory_label, Line2D([], [], color="gray", linestyle="--", marker="x",
                                             label=theory_label))
    if baseline is not None:
      legend["autoregressive"] = ax.axhline(baseline, color="gray", linestyle=":",
                                            linewidth=1.2, label="autoregressive")
    ax.set_title(f"batch_size = {format_value(batch_size, 'batch_size')}")
    ax.set_xlabel("gamma (γ): draft length")
    ax.set_ylabel(ylabel)
    # Ticks at the measured γ values, same range in every panel so panels compare by eye.
    ax.set_xticks(all_gammas)
    ax.set_xlim(all_gammas[0] - 0.5, all_gammas[-1] + 0.5)
    ax.grid(alpha=0.3)
  # Series first, in sorted order, then the theory and baseline keys.
  labels = [_series_label(k, extras) for k in keys]
  labels = [l for l in labels if l in legend] + [l for l in legend if l not in labels]
  fig.legend([legend[l] for l in labels], labels, loc="outside lower center",
             ncols=min(len(labels), 3), fontsize="small")
  devices = _devices(rows)
  fig.suptitle(title + (f" — {', '.join(devices)}" if devices else ""))
  return fig


def plot_tau_vs_gamma(rows: Sequence[dict]):
  """Figure of block efficiency τ vs γ, with the i.i.d. chain theory at the measured α dashed.

  Returns None when no row has γ > 0 and a block_efficiency.
  """
  return _plot_vs_gamma(rows, y_key="block_efficiency",
                        ylabel="block_efficiency (τ): tokens per verifier call",
                        title="Block efficiency τ vs draft length γ", theory_fn=tau_theory,
                        theory_label=_TAU_THEORY_LABEL)


def plot_speedup_vs_gamma(rows: Sequence[dict]):
  """Figure of measured speedup vs γ, theoretical_speedup dashed, autoregressive at 1.0.

  Returns None when no row has γ > 0 and a speedup.
  """
  return _plot_vs_gamma(rows, y_key="speedup",
                        ylabel="speedup: tokens/s over autoregressive",
                        title="Measured speedup vs draft length γ",
                        theory_fn=lambda r: r.get("theoretical_speedup"),
                        theory_label=_SPEEDUP_THEORY_LABEL, baseline=1.0)


_PLOTS = (("tau_vs_gamma", plot_tau_vs_gamma, "block_efficiency",
           ("gamma", "block_efficiency", "acceptance_rate")),
          ("speedup_vs_gamma", plot_speedup_vs_gamma, "speedup",
           ("gamma", "speedup", "theoretical_speedup")))


# ----------------------------------------------------------------------------------------------
# The report


def _shared_settings(rows: Sequence[dict], shown: set[str]) -> dict[str, Any]:
  """Scalar keys with one value across all rows that no table column or heading shows."""
  keys = [k for row in rows for k in row]
  shared = {}
  for key in dict.fromkeys(keys):
    if key in shown or not all(key in r for r in rows) or _varying(rows, key):
      continue
    if not isinstance(rows[0][key], (list, tuple, dict)):
      shared[key] = rows[0][key]
  return shared


def write_report(workdir: str, rows: Sequence[dict], *, title: str,
                 config_text: str | None = None, command: str | None = None,
                 columns: Sequence[str] | None = None) -> dict[str, str]:
  """Write `results.md` and the PNG plots into `workdir`.

  results.md holds the title, the command, one table per (temperature, batch_size), the plots, the
  glossary of every metric shown and the config. Returns {"markdown": path, "tau_vs_gamma": path,
  "speedup_vs_gamma": path}, the plots only when drawn (they need rows with γ > 0).
  """
  os.makedirs(workdir, exist_ok=True)
  rows = sort_rows(rows)
  table_columns = [c for c in (columns or default_columns(rows)) if c not in _GROUP_KEYS]
  shown = set(table_columns) | set(_GROUP_KEYS)
  paths: dict[str, str] = {}

  lines = [f"# {title}", ""]
  if command:
    lines += ["Produced by:", "", "```sh", command, "```", ""]
  shared = _shared_settings(rows, shown)
  if shared:
    lines += ["Shared by all rows: " + ", ".join(
        f"{k} = {format_value(v, k)}" for k, v in shared.items()) + ".", ""]

  lines += ["## Results", ""]
  if not rows:
    lines += ["_No rows._", ""]
  for values, group in group_rows(rows):
    heading = ", ".join(f"{column_label(k)} = {format_value(v, k)}" for k, v in values.items())
    lines += [f"### {heading}", "", markdown_table(group, table_columns), ""]

  lines += ["## Plots", ""]
  for name, plot_fn, y_key, plotted in _PLOTS:
    fig = plot_fn(rows)
    if fig is None:
      reason = ("no rows with a draft length γ > 0" if not _speculative_rows(rows)
                else f"no rows with γ > 0 carry {y_key}")
      lines += [f"`{name}.png` skipped: {reason}.", ""]
      continue
    path = os.path.join(workdir, f"{name}.png")
    fig.savefig(path, dpi=110)
    paths[name] = path
    shown |= set(plotted)
    lines += [f"![{name}]({name}.png)", ""]

  lines += ["## Glossary", ""]
  lines += [f"- **{key}**: {text}" for key, text in GLOSSARY.items()
            if key in shown or key in shared]
  lines.append("")
  if config_text:
    lines += ["## Config", "", "```python", config_text.rstrip("\n"), "```", ""]

  path = os.path.join(workdir, "results.md")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))
  paths["markdown"] = path
  return paths
