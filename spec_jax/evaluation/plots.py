"""PNG plots of result rows: block efficiency τ and measured speedup against the draft length γ.

Rows are the flat dicts of results.json (spec_jax.evaluation.tables). Plots use matplotlib's Agg
canvas directly (no pyplot), so they never need a display and never touch the process-wide
backend of a caller that has its own figures open.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any, Callable, Iterable, Sequence

from spec_jax.evaluation import metrics, tables

_TAU_THEORY_LABEL = r"theory $(1-\alpha^{\gamma+1})/(1-\alpha)$, α measured"
_SPEEDUP_THEORY_LABEL = r"theory $\tau/(r(M)+dc)$"


def speculative_rows(rows: Iterable[dict]) -> list[dict]:
  """Rows that drafted: γ a positive number (autoregressive has None or 0)."""
  return [r for r in rows if tables.is_number(r.get("gamma")) and r["gamma"] > 0]


def tau_theory(row: dict) -> float | None:
  """Chain SD with i.i.d. acceptance (Leviathan et al. eq. 1): τ = (1-α^{γ+1})/(1-α); None for
  a tree's row (`tree` names its shape), which that formula does not describe."""
  alpha, gamma = row.get("acceptance_rate"), row.get("gamma")
  if row.get("tree") or not (tables.is_number(alpha) and tables.is_number(gamma)) or (
      math.isnan(alpha)):
    return None
  return metrics.chain_block_efficiency(min(alpha, 1.0), int(gamma))


def _devices(rows: Iterable[dict]) -> list[str]:
  return sorted({str(r["device"]) for r in rows if r.get("device") is not None})


def _series_label(key: tuple, extras: Sequence[str]) -> str:
  method, temperature, *rest = key
  parts = [str(method), f"T={tables.format_value(temperature, 'temperature')}"]
  parts += [f"{k}={tables.format_value(v, k)}" for k, v in zip(extras, rest)]
  return ", ".join(parts)


def _mean_by_gamma(rows: Sequence[dict], value_fn: Callable[[dict], Any], *,
                   errors: bool = False) -> tuple[list[float], list[float]]:
  """Rows repeated at one γ (e.g. several seeds) are averaged into one point; with `errors` the
  values are their standard errors, and the point's is the mean's, √(Σ SE²) / n."""
  by_gamma: dict[float, list[float]] = {}
  for row in rows:
    value = value_fn(row)
    if tables.is_number(value) and not math.isnan(value):
      by_gamma.setdefault(row["gamma"], []).append(float(value))
  gammas = sorted(by_gamma)
  if errors:
    return gammas, [math.sqrt(sum(v * v for v in by_gamma[g])) / len(by_gamma[g])
                    for g in gammas]
  return gammas, [sum(by_gamma[g]) / len(by_gamma[g]) for g in gammas]


def _models(rows: Sequence[dict]) -> str:
  """'verifier V, drafter D' of the rows (each listed once), for figure titles."""
  parts = []
  for key in ("verifier", "drafter"):
    names = sorted({str(r[key]) for r in rows if r.get(key)})
    if names:
      parts.append(f"{key} {', '.join(names)}")
  return "; ".join(parts)


def _plot_vs_gamma(rows: Sequence[dict], *, y_key: str, ylabel: str, title: str,
                   theory_fn: Callable[[dict], Any], theory_label: str,
                   baseline: float | None = None, err_key: str | None = None):
  """One subplot per batch size, one solid line per series (± the rows' `err_key`, a standard
  error, as error bars) and its theory dashed beside it."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.lines import Line2D

  rows = [r for r in speculative_rows(rows) if tables.is_number(r.get(y_key))]
  if not rows:
    return None
  batch_sizes = sorted({r.get("batch_size") for r in rows}, key=tables.sort_key)
  all_gammas = sorted({r["gamma"] for r in rows})
  # Series are (method, temperature) plus any extra setting that varies, except seeds: rows that
  # differ only by seed are averaged rather than drawn as separate lines.
  extras = [k for k in tables.EXTRA_SETTINGS if k != "seed" and tables.varying(rows, k)]
  series_key = lambda r: (r.get("method"), r.get("temperature"), *(r.get(k) for k in extras))
  methods = list(dict.fromkeys(r.get("method") for r in rows))
  keys = sorted({series_key(r) for r in rows},
                key=lambda k: (methods.index(k[0]), *map(tables.sort_key, k[1:])))
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
  single = len(all_gammas) == 1
  bar_width = 0.8 / max(len(keys), 1)
  for ax, batch_size in zip(axes, batch_sizes):
    in_panel = [r for r in rows if r.get("batch_size") == batch_size]
    drew_theory = False
    for key in keys:
      series = [r for r in in_panel if series_key(r) == key]
      if not series:
        continue
      gammas, values = _mean_by_gamma(series, lambda r: r[y_key])
      errors = None
      if err_key is not None:
        err_gammas, errs = _mean_by_gamma(series, lambda r: r.get(err_key), errors=True)
        if err_gammas == gammas:
          errors = errs
      if single:  # one γ: side-by-side bars, not lone points on an auto-zoomed axis
        offset = (keys.index(key) - (len(keys) - 1) / 2) * bar_width
        gammas = [g + offset for g in gammas]
        ax.bar(gammas, values, bar_width, color=colors[key], label=_series_label(key, extras))
      else:
        ax.plot(gammas, values, marker="o", color=colors[key], label=_series_label(key, extras))
      if errors is not None:
        ax.errorbar(gammas, values, yerr=errors, fmt="none", capsize=3, ecolor="black"
                    if single else colors[key])
      theory_gammas, values = _mean_by_gamma(series, theory_fn)
      gammas = gammas if single and theory_gammas else theory_gammas
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
    ax.set_title(f"batch_size = {tables.format_value(batch_size, 'batch_size')}")
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
  models = _models(rows)
  fig.suptitle(title + (f" — {', '.join(devices)}" if devices else "")
               + (f"\n{models}" if models else ""), fontsize="medium")
  return fig


def plot_tau_vs_gamma(rows: Sequence[dict]):
  """Figure of block efficiency τ vs γ, with the i.i.d. chain theory at the measured α dashed.

  Returns None when no row has γ > 0 and a block_efficiency.
  """
  return _plot_vs_gamma(rows, y_key="block_efficiency",
                        ylabel="block_efficiency (τ): tokens per verifier call",
                        title="Block efficiency τ vs draft length γ (± standard error over "
                        "prompts)", theory_fn=tau_theory, theory_label=_TAU_THEORY_LABEL,
                        err_key="tau_se")


def plot_speedup_vs_gamma(rows: Sequence[dict]):
  """Figure of measured speedup vs γ, theoretical_speedup dashed, autoregressive at 1.0.

  Returns None when no row has γ > 0 and a speedup.
  """
  return _plot_vs_gamma(rows, y_key="speedup",
                        ylabel="speedup: tokens/s over autoregressive",
                        title="Measured speedup vs draft length γ",
                        theory_fn=lambda r: r.get("theoretical_speedup"),
                        theory_label=_SPEEDUP_THEORY_LABEL, baseline=1.0)


def plot_r_of_t(curves: dict[str, Sequence[dict]], title: str):
  """Figure of r(T) = cost(T) / cost(1) against T, one line per entry of `curves` (label -> the
  cost_model rows of one verifier at one batch size: T, r, ms and, where recorded, ms_min and
  ms_max, drawn as error bars over the median at T = 1). None when no curve has rows."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
  from matplotlib.figure import Figure  # noqa: PLC0415
  from matplotlib.ticker import FuncFormatter, NullLocator  # noqa: PLC0415

  curves = {label: sorted(rows, key=lambda r: r["T"]) for label, rows in curves.items() if rows}
  if not curves:
    return None
  many = len(curves) > 6  # then the legend goes beside the axes, not over the curves
  fig = Figure(figsize=(11.5 if many else 6.5, 4.8), layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  for i, (label, rows) in enumerate(curves.items()):
    one = next((r["ms"] for r in rows if r["T"] == 1), None)
    ts, rs = [r["T"] for r in rows], [r["r"] for r in rows]
    # Ten colours, then the next ten dashed, then dotted: no two curves look alike.
    ax.plot(ts, rs, marker="o", color=f"C{i % 10}", linestyle=("-", "--", ":")[i // 10 % 3],
            label=label)
    if one and all(tables.is_number(r.get("ms_min")) for r in rows):
      ax.errorbar(ts, rs, yerr=[[max(r["r"] - r["ms_min"] / one, 0.0) for r in rows],
                                [max(r["ms_max"] / one - r["r"], 0.0) for r in rows]],
                  fmt="none", capsize=2, ecolor=f"C{i % 10}")
  ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
  ax.set_xscale("log", base=2)
  ticks = []  # every T, less one that would print over the one before (32 and 33)
  for t in sorted({r["T"] for rows in curves.values() for r in rows}):
    if not ticks or t >= 1.1 * ticks[-1]:
      ticks.append(t)
  ax.set_xticks(ticks, minor=False)
  ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
  ax.xaxis.set_minor_locator(NullLocator())
  ax.set_xlabel("T: tokens per verifier call")
  ax.set_ylabel("r(T) = cost(T) / cost(1)")
  ax.set_title(textwrap.fill(title, 70), fontsize="medium")
  ax.grid(alpha=0.3)
  if many:
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
  else:
    ax.legend(fontsize="small")
  return fig


# (file name, figure function, the key a row needs to be drawn, the keys the figure shows: their
# glossary entries go in the report).
PLOTS = (("tau_vs_gamma", plot_tau_vs_gamma, "block_efficiency",
          ("gamma", "block_efficiency", "acceptance_rate")),
         ("speedup_vs_gamma", plot_speedup_vs_gamma, "speedup",
          ("gamma", "speedup", "theoretical_speedup")))
