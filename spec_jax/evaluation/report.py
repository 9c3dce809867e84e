"""Result files of an evaluation run: results.json rows, and results.md with tables and plots.

Rows are flat dicts, one per setting (method, γ, temperature, batch size, ...), metric keys named
as in the glossary (docs/design.md §3). `write_results` stores them, `load_rows` reads them back, and
`write_report` renders results.md from the pieces: tables (spec_jax.evaluation.tables), PNG plots
(plots) and the glossary entries of every metric shown (glossary).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any, Sequence

from spec_jax import parallel
from spec_jax.evaluation import glossary, plots, tables


def write_text(path: str, text: str) -> None:
  """Write a file whole or not at all (a temporary file renamed over it): a run killed while
  writing leaves the previous file, never a truncated one that later reads would choke on."""
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def write_json(path: str, obj: Any) -> None:
  """`obj` as indented JSON at `path`, atomically (`write_text`)."""
  write_text(path, json.dumps(obj, indent=2))


def write_results(workdir: str, rows: list[dict], echo: bool = True) -> str:
  """Write rows to `workdir/results.json` and, with `echo` (benchmarks), print them as one JSON
  document (process 0 only, in a multi-host run)."""
  path = os.path.join(workdir, "results.json")
  if not parallel.is_writer():
    return path
  os.makedirs(workdir, exist_ok=True)
  write_json(path, rows)
  if echo:
    print(json.dumps(rows, indent=2))
  return path


def load_rows(path: str) -> list[dict]:
  """Rows from a results.json file, or from the results.json inside a workdir."""
  if os.path.isdir(path):
    path = os.path.join(path, "results.json")
  with open(path, encoding="utf-8") as f:
    rows = json.load(f)
  if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
    raise ValueError(f"{path} should hold a JSON list of row objects, got {type(rows).__name__}.")
  return rows


def _shared_settings(rows: Sequence[dict], shown: set[str]) -> dict[str, Any]:
  """Scalar keys with one value across all rows that no table column or heading shows."""
  keys = [k for row in rows for k in row]
  shared = {}
  for key in dict.fromkeys(keys):
    if key in shown or not all(key in r for r in rows) or tables.varying(rows, key):
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
  "speedup_vs_gamma": path}, the plots only when drawn (they need rows with γ > 0). Only process 0
  writes in a multi-host run (the others return {}).
  """
  if not parallel.is_writer():
    return {}
  os.makedirs(workdir, exist_ok=True)
  rows = tables.sort_rows(rows)
  group_keys = tables.GROUP_KEYS
  table_columns = [c for c in (columns or tables.default_columns(rows)) if c not in group_keys]
  shown = set(table_columns) | set(group_keys)
  paths: dict[str, str] = {}

  lines = [f"# {title}", ""]
  if command:
    lines += ["Produced by:", "", "```sh", command, "```", ""]
  shared = _shared_settings(rows, shown)
  if shared:
    lines += ["Shared by all rows: " + ", ".join(
        f"{k} = {tables.format_value(v, k)}" for k, v in shared.items()) + ".", ""]

  lines += ["## Results", ""]
  if not rows:
    lines += ["_No rows._", ""]
  for values, group in tables.group_rows(rows, group_keys):
    heading = ", ".join(f"{glossary.column_label(k)} = {tables.format_value(v, k)}"
                        for k, v in values.items())
    lines += [f"### {heading}", "", tables.markdown_table(group, table_columns), ""]

  lines += ["## Plots", ""]
  for name, plot_fn, y_key, plotted in plots.PLOTS:
    fig = plot_fn(rows)
    if fig is None:
      reason = ("no rows with a draft length γ > 0" if not plots.speculative_rows(rows)
                else f"no rows with γ > 0 carry {y_key}")
      lines += [f"`{name}.png` skipped: {reason}.", ""]
      continue
    path = os.path.join(workdir, f"{name}.png")
    fig.savefig(path, dpi=110)
    paths[name] = path
    shown |= set(plotted)
    lines += [f"![{name}]({name}.png)", ""]

  lines += ["## Glossary", ""]
  lines += glossary.markdown_lines(shown | set(shared))
  lines.append("")
  if config_text:
    lines += ["## Config", "", "```python", config_text.rstrip("\n"), "```", ""]

  path = os.path.join(workdir, "results.md")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))
  paths["markdown"] = path
  return paths


def launch_command(config, workdir: str) -> str:
  """The launch.py command that reproduces a run: the one that ran, if launch.py ran it (less
  report-only overrides), else the one `config.config_file` names."""
  if os.path.basename(sys.argv[0]) == "launch.py":
    args = sys.argv[1:]
  else:
    args = ["--config", config.config_file, "--workdir", workdir]
  args = [a for a in args if not a.startswith(("--config.render_only", "--config.note"))]
  return shlex.join(["python", "launch.py", *args])
