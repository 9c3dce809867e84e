"""The experiment harness: named runs, one resume rule, carried rows, render_only, outputs.

An experiment (spec_jax/programs/<name>_experiment.py) is a list of named `Run`s plus a report
function; `run_experiment` does the rest:

  check(config, workdir)                    bad input, before anything runs or loads
  run_all(config, workdir, runs)            each run read back or run, in order
  report(config, collected, command)        -> Report(markdown, plots, extra_json)
  write_outputs(workdir, rows, report)      results.json, results.md, plots, other JSON files

Resume: a run lives in its directory (<workdir>/runs/<name> unless it names another) and is read
back when its results.json exists and `digest` of the config.json beside it equals the digest of
the config it would run now. The digest covers only the fields that change a run's result: the
config flattened to dotted keys, less the keys the run and its program declare ignorable, less
every leaf still at its default, less the top-level fields the program's config file does not
have (an experiment's own); and its `inputs` (e.g. the digest of the run that trained the
checkpoint it reads) must be the same. A field added to a program's config later, at its
default, so leaves every finished run's digest as it was. A run directory without config.json (results
committed before the harness wrote one) has no digest: it is read back under render_only and run
again otherwise.

A run that runs starts from nothing of another setting: a directory holding another setting's
state (its started.json, written when a run starts, or else its config.json and inputs.json name
another digest or other inputs) is set aside whole as <directory>.previous (one kept), its
data_cache (generated responses, keyed by their own content) carried over, so a changed run
neither resumes the old setting's checkpoints and row logs nor reads them back. A directory of
the same setting, killed half-way, is resumed as its program resumes.

`render_only` runs nothing: every run with a results.json is read back whatever its digest, the
others are listed in `Collected.missing` for the report to name.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import importlib
import json
import os
import shutil
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
from jax.experimental import multihost_utils
import ml_collections
from absl import logging

from spec_jax import parallel
from spec_jax.evaluation import report as report_lib

RESULTS = "results.json"
CONFIG = "config.json"
INPUTS = "inputs.json"
STARTED = "started.json"  # the identity of the run whose state a directory holds
CARRIED = ("data_cache",)  # kept when a directory of another setting is set aside


@dataclasses.dataclass(frozen=True)
class Run:
  """One named unit of an experiment: a program run on one config, in one directory.

  name: unique within the experiment; the default directory is <workdir>/runs/<name>.
  config: the config of the program it runs (config.program names it; the digest's defaults
    come from configs/<program>.py).
  tags: fields merged into every row it returns (e.g. which part of the experiment it is).
  fn(config, directory) -> rows: default spec_jax.programs.<config.program>.run. A dict result
    (a training program's summary) is one row, None none.
  ignore: dotted config keys (fnmatch patterns; a key also covers what is under it) that do not
    change its result, on top of the program's DIGEST_IGNORE.
  inputs: what else its result depends on, as JSON values: e.g. {"drafter": run_digest(the
    training run)} for a run that reads a checkpoint by path (the path stays the same when the
    training changes). Kept in <directory>/inputs.json; a change runs it again.
  """
  name: str
  config: ml_collections.ConfigDict
  tags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  directory: str | None = None
  fn: Callable[[ml_collections.ConfigDict, str], Any] | None = None
  ignore: tuple[str, ...] = ()
  inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Collected:
  """What run_all gathered: every finished run's rows in run order (tags and `run` merged in),
  the names of the runs render_only skipped, and each finished run's rows by name."""
  rows: list[dict]
  missing: list[str]
  by_run: dict[str, list[dict]]


@dataclasses.dataclass
class Report:
  """An experiment's outputs besides the rows: results.md's text, the plots (file name ->
  fn(path) drawing it) and other JSON files (file name -> object). `rows`, when set, is what
  results.json holds instead of every collected row (e.g. the decoding rows without the
  training runs' summaries)."""
  markdown: str
  plots: Mapping[str, Callable[[str], None]] = dataclasses.field(default_factory=dict)
  extra_json: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  rows: list[dict] | None = None


# ---------------------------------------------------------------------------------------------
# The digest.

def _plain(config) -> Any:
  """A config (ConfigDict, mapping, or the path of a config.json) as plain JSON values: tuples
  become lists, so a live config and the config.json it was saved as compare equal."""
  if isinstance(config, str):
    with open(config, encoding="utf-8") as f:
      return json.load(f)
  if isinstance(config, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
    return json.loads(config.to_json_best_effort())
  return json.loads(json.dumps(config, default=str))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{dotted key: leaf}; mappings are walked (an empty one has no leaves), anything else,
  lists included, is a leaf."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def _program_module(program: str):
  try:
    return importlib.import_module(f"spec_jax.programs.{program}")
  except ModuleNotFoundError as e:
    if e.name != f"spec_jax.programs.{program}":
      raise  # the program exists but one of its imports does not: not ours to hide
    return None


@functools.lru_cache(maxsize=None)
def _default_config(program: str) -> str:
  """configs/<program>.py get_config() as JSON text ('{}' when there is no such file)."""
  try:
    config_module = importlib.import_module(f"configs.{program}")
  except ModuleNotFoundError as e:
    if e.name not in ("configs", f"configs.{program}"):
      raise
    return "{}"
  get_config = getattr(config_module, "get_config", None)
  return json.dumps(_plain(get_config())) if get_config else "{}"


@functools.lru_cache(maxsize=None)
def _defaults(program: str) -> tuple[tuple[str, Any], ...]:
  """The program's defaults, flattened: configs/<program>.py get_config() (none when there is no
  such file) updated with the program module's optional digest_defaults()."""
  out = flatten(json.loads(_default_config(program)))
  module = _program_module(program)
  if module is not None and hasattr(module, "digest_defaults"):
    out.update(_plain(dict(module.digest_defaults())))
  return tuple(out.items())


def _ignored(key: str, patterns: Sequence[str]) -> bool:
  return any(key == p or key.startswith(p + ".") or fnmatch.fnmatchcase(key, p)
             for p in patterns)


def digest(config, *, program: str | None = None, ignore: Sequence[str] = ()) -> str:
  """sha256 (hex) of the fields of `config` that change a run's result.

  config: a ConfigDict, a mapping, or the path of a config.json. program: whose defaults and
  DIGEST_IGNORE apply (default config.program). The config is flattened to dotted keys; keys in
  `ignore` or the program module's DIGEST_IGNORE (a key covers everything under it; fnmatch
  patterns allowed) are dropped, and so is every leaf equal to its default (configs/<program>.py
  get_config(), updated with the module's optional digest_defaults(): dotted key -> value) and
  every key whose top-level section that default config lacks.
  """
  flat = flatten(_plain(config))
  program = program or flat.get("program")
  defaults, patterns = {}, list(ignore)
  if program:
    defaults = dict(_defaults(program))
    module = _program_module(program)
    patterns += list(getattr(module, "DIGEST_IGNORE", ()) or ())
  # A top-level section the program's config does not have is an experiment's own field (its
  # sweeps, notes, titles): the program never reads it. (A program without a config file has
  # no sections: every field counts.)
  sections = ({k.split(".", 1)[0] for k in defaults}
              | set(json.loads(_default_config(program))) if program else set())
  kept = {k: v for k, v in flat.items()
          if not _ignored(k, patterns) and not (k in defaults and defaults[k] == v)
          and (not sections or k.split(".", 1)[0] in sections)}
  return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def program_config(config, program: str) -> ml_collections.ConfigDict:
  """A copy of `config` with only the top-level fields configs/<program>.py's get_config() has,
  and `program` set: the config an experiment hands one run of that program, so that the
  experiment's own fields (its sweeps, notes, titles) never reach the run's digest."""
  keys = set(json.loads(_default_config(program)))
  out = ml_collections.ConfigDict({k: v for k, v in config.to_dict().items() if k in keys})
  out.program = program
  return out


# ---------------------------------------------------------------------------------------------
# Running.

def run_directory(workdir: str, run: Run) -> str:
  return run.directory or os.path.join(workdir, "runs", run.name)


def _as_rows(result) -> list[dict]:
  """A program's return value as rows of plain JSON values (what reading results.json back
  gives, so a fresh run and a resumed one report the same)."""
  rows = [] if result is None else [dict(result)] if isinstance(result, Mapping) else result
  return json.loads(json.dumps(list(rows), default=str))


def run_digest(run: Run) -> str:
  """The digest a run is resumed by (its config's, less its ignores); see `Run.inputs`."""
  return digest(run.config, program=run.config.get("program"), ignore=run.ignore)


def _finished(config, run: Run, directory: str) -> bool:
  """Whether the run's results.json can be read back (see the module docstring)."""
  if not os.path.exists(os.path.join(directory, RESULTS)):
    return False
  if config.get("render_only", False):
    return True
  saved = os.path.join(directory, CONFIG)
  if not os.path.exists(saved):
    return False
  inputs = os.path.join(directory, INPUTS)
  return (digest(saved, program=run.config.get("program"), ignore=run.ignore)
          == run_digest(run)
          and (_plain(inputs) if os.path.exists(inputs) else {}) == _plain(dict(run.inputs)))


def identity(run: Run) -> dict:
  """What a run's result depends on: its digest and its inputs (plain JSON)."""
  return {"digest": run_digest(run), "inputs": _plain(dict(run.inputs))}


def _held_identity(run: Run, directory: str) -> dict | None:
  """The identity of the run whose state `directory` holds: its started.json, else (a run
  finished before the harness wrote one) its config.json and inputs.json; None for neither."""
  started = os.path.join(directory, STARTED)
  if os.path.exists(started):
    with open(started, encoding="utf-8") as f:
      return json.load(f)
  saved = os.path.join(directory, CONFIG)
  if not os.path.exists(saved):
    return None
  inputs = os.path.join(directory, INPUTS)
  return {"digest": digest(saved, program=run.config.get("program"), ignore=run.ignore),
          "inputs": _plain(inputs) if os.path.exists(inputs) else {}}


def _set_aside(directory: str) -> None:
  """Move a directory of another setting to <directory>.previous (replacing an older one),
  carrying its CARRIED entries back into a fresh directory."""
  previous = directory.rstrip(os.sep) + ".previous"
  shutil.rmtree(previous, ignore_errors=True)
  os.replace(directory, previous)
  os.makedirs(directory)
  for name in CARRIED:
    if os.path.exists(os.path.join(previous, name)):
      os.replace(os.path.join(previous, name), os.path.join(directory, name))
  logging.warning("%s held a run of another setting: set aside as %s; running afresh.",
                  directory, previous)


def _execute(run: Run, directory: str) -> list[dict]:
  fn = run.fn or _program_module(run.config.program).run
  results = os.path.join(directory, RESULTS)
  if parallel.is_writer():
    held = _held_identity(run, directory) if os.path.isdir(directory) else None
    if held is not None and held != identity(run):
      _set_aside(directory)
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(results):
      # A result of unknown setting (no config.json beside it): out of the way, so a run
      # killed half-way is not read back as this one's.
      os.replace(results, results + ".previous")
    report_lib.write_json(os.path.join(directory, STARTED), identity(run))
  if jax.process_count() > 1:  # the others start once process 0 has set the directory up
    multihost_utils.sync_global_devices(f"experiment run {run.name}")
  os.makedirs(directory, exist_ok=True)
  rows = _as_rows(fn(run.config, directory))
  if parallel.is_writer():
    report_lib.write_text(os.path.join(directory, CONFIG), run.config.to_json_best_effort(indent=2))
    if run.inputs:
      report_lib.write_json(os.path.join(directory, INPUTS), _plain(dict(run.inputs)))
    elif os.path.exists(os.path.join(directory, INPUTS)):
      os.remove(os.path.join(directory, INPUTS))
    if not os.path.exists(results):
      report_lib.write_json(results, rows)
  return rows


def run_all(config, workdir: str, runs: Iterable[Run]) -> Collected:
  """Each run in order: read back when finished (module docstring), skipped and listed in
  `missing` under config.render_only, run otherwise.

  `runs` may be a generator, pulled one run at a time, so a later run can depend on an earlier
  one's output: each `yield` evaluates to the rows of the run it yielded ([] for one skipped
  under render_only), e.g. `rows = yield Run(...)`. Every row gets the run's tags and
  `run` = its name.
  """
  collected = Collected(rows=[], missing=[], by_run={})
  iterator = iter(runs)
  send = getattr(iterator, "send", None)
  rows = None
  while True:
    try:
      run = next(iterator) if send is None or rows is None else send(rows)
    except StopIteration:
      break
    if run.name in collected.by_run or run.name in collected.missing:
      raise ValueError(f"Two runs are named {run.name!r}: each run of an experiment needs its "
                       "own name (and directory).")
    directory = run_directory(workdir, run)
    if _finished(config, run, directory):
      rows = report_lib.load_rows(os.path.join(directory, RESULTS))
    elif config.get("render_only", False):
      collected.missing.append(run.name)
      rows = []  # what the generator gets back
      continue
    else:
      logging.info("Run %s in %s", run.name, directory)
      if parallel.is_writer():
        print(f"\n[{run.name}] {directory}", flush=True)
      rows = _execute(run, directory)
    for row in rows:
      row.update(run.tags)
      row["run"] = run.name
    collected.by_run[run.name] = rows
    collected.rows += rows
  return collected


def carried_rows(config, key: Callable[[dict], str]) -> dict[str, list[dict]]:
  """{k: its rows, each with carried=True} for every k in config.carry, read from the
  results.json at config.carry_from (rows whose key(row) is k). {} when carry is empty.
  Bad input (ValueError naming carry / carry_from): no such file, not a list of rows, a key
  with no rows."""
  carry = tuple(config.get("carry", ()) or ())
  if not carry:
    return {}
  path = str(config.get("carry_from", "") or "")
  if not os.path.isfile(path):
    raise ValueError(f"carry={list(carry)} takes rows from carry_from={path!r}, which is not a "
                     "file. Fix: --config.carry_from=<an earlier run's results.json>, or drop "
                     "carry to run those settings.")
  try:
    old = report_lib.load_rows(path)
  except ValueError as e:  # json.JSONDecodeError is one
    raise ValueError(f"carry_from={path!r} is not a readable results.json ({e}). Fix: point "
                     "carry_from at an earlier run's results.json.") from None

  def key_of(row):
    try:
      return key(row)
    except (KeyError, TypeError):  # a row of another kind: not carried
      return None
  out = {k: [dict(r, carried=True) for r in old if key_of(r) == k] for k in carry}
  empty = [k for k, rows in out.items() if not rows]
  if empty:
    raise ValueError(f"carry has {empty}, but carry_from={path!r} holds no rows for them. Fix: "
                     "drop them from carry, or point carry_from at a run that has them.")
  return out


# ---------------------------------------------------------------------------------------------
# Outputs.

def write_outputs(workdir: str, rows: Sequence[dict], report: Report) -> None:
  """<workdir>/results.json (rows), results.md, every plot (none when rows is empty: nothing to
  draw) and every extra_json file. Process 0 only in a multi-host run."""
  if not parallel.is_writer():
    return
  os.makedirs(workdir, exist_ok=True)
  report_lib.write_json(os.path.join(workdir, RESULTS), list(rows))
  report_lib.write_text(os.path.join(workdir, "results.md"), report.markdown)
  for name, obj in report.extra_json.items():
    report_lib.write_json(os.path.join(workdir, name), obj)
  if rows:
    for name, draw in report.plots.items():
      draw(os.path.join(workdir, name))


def measured(rows: Sequence[dict], key: str, fallback: str) -> str:
  """The distinct values of `key` in rows, sorted and joined (what the runs measured with, e.g.
  a model's checkpoint), or `fallback` (what the config names) when no row has one: report text
  states the facts of the rows it shows."""
  return ", ".join(sorted({str(r[key]) for r in rows if r.get(key)})) or fallback


def errorbar_plot(path: str, series: Mapping[Any, tuple[Sequence, Sequence, Sequence]], *,
                  xlabel: str, ylabel: str, title: str,
                  style: Callable[[str], dict] | None = None, hline: float | None = None,
                  hline_label: str | None = None, bars: bool = False,
                  figsize: tuple[float, float] | None = None, xticks: bool = True) -> None:
  """A PNG of one line (or, with `bars`, one bar per x) per series with ± error bars.

  series: label -> (xs, ys, errs), errs a standard error per point (None counts as 0); drawn
    in the mapping's order, each line's points sorted by x. A label may be a (panel, label)
    pair: one subplot per panel (in first-seen order), titled by it, `title` above them all.
  style(label) -> keyword arguments of the line (colour, linestyle, marker) or the bars.
  hline: a horizontal reference line (e.g. τ = 1) with `hline_label` in the legend.
  bars: the xs are categories (e.g. γ): side-by-side bars at each, every label in the same slot
    in every panel.
  xticks: ticks at the measured xs (False: matplotlib's own, for a continuous x such as c).
  matplotlib's Agg canvas (no display, no pyplot state), constrained layout with the legend
  outside the axes, 120 dpi.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  items = [((k if isinstance(k, tuple) else (None, k)), v) for k, v in series.items()]
  panels = list(dict.fromkeys(panel for (panel, _), _ in items)) or [None]
  labels = list(dict.fromkeys(label for (_, label), _ in items))
  xs_all = sorted({x for _, (xs, _, _) in items for x in xs})
  fig = Figure(figsize=figsize or ((8.4, 4.6) if len(panels) == 1
                                   else (4.2 * len(panels) + 1.2, 4.0)), layout="constrained")
  FigureCanvasAgg(fig)
  width = 0.8 / max(len(labels), 1)
  legend = {}
  for i, panel in enumerate(panels):
    ax = fig.add_subplot(1, len(panels), i + 1)
    for (p, label), (xs, ys, errs) in items:
      if p != panel:
        continue
      order = sorted(range(len(xs)), key=xs.__getitem__)
      x, y, e = ([seq[j] for j in order] for seq in (xs, ys, [v or 0.0 for v in errs]))
      kwargs = style(label) if style else {}
      if bars:
        slot = (labels.index(label) - (len(labels) - 1) / 2) * width
        handle = ax.bar([xs_all.index(v) + slot for v in x], y, width, yerr=e, capsize=3,
                        label=label, **kwargs)
      else:
        handle = ax.errorbar(x, y, yerr=e, label=label, capsize=2.5, elinewidth=0.8, **kwargs)
      legend.setdefault(label, handle)
    if hline is not None:
      legend.setdefault(hline_label or f"{hline:g}", ax.axhline(
          hline, color="gray", linestyle=":", linewidth=1.2))
    if bars:
      ax.set_xticks(range(len(xs_all)), [f"{v:g}" for v in xs_all])
    elif xs_all and xticks:
      ax.set_xticks(xs_all)  # the measured settings, not fractional ticks
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y" if bars else "both", alpha=0.3)
    if panel is not None:
      ax.set_title(panel, fontsize=9)
  if panels == [None]:
    fig.axes[0].set_title(title)
  else:
    fig.suptitle(title, fontsize=9)
  if legend:  # nothing measured yet: empty axes, no legend
    fig.legend(list(legend.values()), list(legend), fontsize=7, loc="outside right upper",
               handlelength=3)
  fig.savefig(path, dpi=120)


def compilation_cache(workdir: str) -> None:
  """Compiled programs persist across runs and restarts under <workdir>/runs/jax_cache (most of
  a small experiment's time is compiling), unless the caller already chose a cache (the tests
  share one through the environment)."""
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "runs", "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def run_experiment(config, workdir: str, *,
                   runs: Callable[[Any, str], Iterable[Run]],
                   report: Callable[[Any, Collected, str], Report],
                   check: Callable[[Any, str], None] | None = None) -> list[dict]:
  """check(config, workdir) (bad input, before anything runs or loads; it runs under
  render_only too, so a check that reads data skips that part there) -> the workdir and the
  compilation cache -> run_all(runs(config, workdir)) -> report(config, collected, the launch
  command) -> write_outputs -> results.md printed. Returns the rows results.json holds."""
  if check is not None:
    check(config, workdir)
  os.makedirs(workdir, exist_ok=True)
  compilation_cache(workdir)
  collected = run_all(config, workdir, runs(config, workdir))
  out = report(config, collected, report_lib.launch_command(config, workdir))
  rows = collected.rows if out.rows is None else out.rows
  write_outputs(workdir, rows, out)
  if parallel.is_writer():
    print(out.markdown)
  return rows
