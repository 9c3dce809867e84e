"""Markdown tables of result rows.

A row is one flat dict per setting (method, γ, temperature, batch size, ...) with metric keys
named as in the glossary (spec_jax.evaluation.glossary). Tables sort rows by (method,
temperature, batch_size, γ), label columns with their glossary name and symbol, and show an extra
setting (lenience, seed, device, ...) only when it varies across the rows.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any, Iterable, Sequence

from spec_jax.evaluation import glossary

DEFAULT_COLUMNS = ("method", "gamma", "temperature", "batch_size", "block_efficiency",
                   "acceptance_rate", "empirical_acceptance", "tokens_per_s", "speedup",
                   "verifier_cost_ratio_r", "theoretical_speedup", "speedup_vs_theory",
                   "per_position_acceptance", "verifier_loglik", "token_tv")

# Settings that get a table column (and split plot series) only when they vary across rows.
EXTRA_SETTINGS = ("tree", "dataset", "drafter", "lenience", "epsilon", "top_k", "top_p", "seed",
                  "device", "baseline")

# Reports give one table per distinct value of these; the values go in the heading.
GROUP_KEYS = ("temperature", "batch_size")

# Settings and counts: printed with `g` (0.6, 4, 1000), not rounded like measured metrics.
_EXACT_KEYS = frozenset({"gamma", "temperature", "top_k", "top_p", "batch_size", "num_prompts",
                         "new_tokens", "verifier_calls", "drafter_calls",
                         "verifier_tokens_per_call", "drafter_calls_per_round", "seed",
                         "epsilon"})


def is_number(value: Any) -> bool:
  """A real number that is not a bool (True is an int in Python, but not a measurement)."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def format_value(value: Any, key: str | None = None) -> str:
  """Table text for one value: None as '–', lists as '0.71/0.62' (of integers '1/8/8'), 2–3
  significant decimals."""
  if value is None:
    return "–"
  if isinstance(value, (list, tuple)):
    return "/".join(str(int(v)) if isinstance(v, numbers.Integral) and not isinstance(v, bool)
                    else f"{float(v):.2f}" if is_number(v) else "–" for v in value) or "–"
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, numbers.Integral):
    return str(int(value))
  if is_number(value):
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


def sort_key(value: Any) -> tuple:
  """Numbers before strings before None, so mixed or missing values never raise in sorted()."""
  if is_number(value):
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
                                     sort_key(r.get("temperature")),
                                     sort_key(r.get("batch_size")), sort_key(_gamma(r))))


def group_rows(rows: Iterable[dict], keys: Sequence[str] = GROUP_KEYS
               ) -> list[tuple[dict[str, Any], list[dict]]]:
  """[(group values, sorted rows)], one group per distinct value of `keys`, groups sorted."""
  rows = sort_rows(rows)
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
  ordered = sorted(groups, key=lambda values: tuple(sort_key(v) for v in values))
  return [(dict(zip(keys, values)), groups[values]) for values in ordered]


def varying(rows: Sequence[dict], key: str) -> bool:
  """Whether `key` takes more than one value (missing counts as None) across `rows`."""
  values = {json.dumps(r.get(key), sort_keys=True, default=str) for r in rows}
  return len(values) > 1


def default_columns(rows: Sequence[dict]) -> list[str]:
  """DEFAULT_COLUMNS present in some row, plus extra settings (lenience, seed...) that vary."""
  present = {k for row in rows for k in row}
  columns = [c for c in DEFAULT_COLUMNS if c in present]
  extras = [k for k in EXTRA_SETTINGS if k in present and varying(rows, k)]
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
  numeric = [any(is_number(row.get(c)) for row in rows) for c in columns]
  lines = ["| " + " | ".join(glossary.column_label(c) for c in columns) + " |",
           "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
  lines += ["| " + " | ".join(line) + " |" for line in cells]
  return "\n".join(lines)
