"""The single launcher: `python launch.py --config configs/X.py[:args] --workdir DIR [--config.a.b=v]`.

Dispatches on `config.program` to `spec_jax.programs.<program>.run(config, workdir)`.
"""

import ast
import glob
import importlib
import importlib.util
import os
import pkgutil
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally with ':args' (e.g. configs/train_lm.py:smoke).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and results.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() first (multi-host pods).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "With --distributed: host:port of process 0 (default: "
    "$JAX_COORDINATOR_ADDRESS or the cluster's auto-detection).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "With --distributed: the number of processes (default: auto-detect).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "With --distributed: this process's index (default: auto-detect).")
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Print the resolved config at the start and full tracebacks on errors "
    "(without it, a bad input ends with one line naming the field and the fix).")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Print the resolved config (file, its ':args' and every --config.* "
    "override) and exit without running anything; --workdir may be left out.")
flags.mark_flags_as_required(["config"])
_ROOT = os.path.dirname(os.path.abspath(__file__))


# What bad input raises; anything else is a bug and keeps its traceback.
_USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                FileExistsError, PermissionError)


def _first_line(path: str) -> str:
  """The first line of a Python file's module docstring, read without importing it."""
  try:
    with open(path, encoding="utf-8") as f:
      doc = ast.get_docstring(ast.parse(f.read())) or ""
  except (OSError, SyntaxError):
    return ""
  return doc.strip().splitlines()[0] if doc.strip() else ""


def _help_text() -> str:
  """--help: usage, every program and config with its docstring's first line, then the flags."""
  lines = [__doc__.strip(), "", "Programs (config.program), spec_jax/programs/:"]
  for name in _programs():
    lines.append(f"  {name:24s} {_first_line(os.path.join(_ROOT, 'spec_jax', 'programs', name + '.py'))}")
  lines += ["", "Configs (--config FILE[:args]; each docstring holds its command, run time and "
            "a :smoke variant):"]
  files = sorted(glob.glob(os.path.join(_ROOT, "configs", "*.py")))
  files += sorted(glob.glob(os.path.join(_ROOT, "experiments", "*", "config.py")))
  for path in files:
    rel = os.path.relpath(path, _ROOT)
    if os.path.basename(path) not in ("__init__.py", "common.py"):
      lines.append(f"  {rel:34s} {_first_line(path)}")
  lines += ["", "Examples:",
            "  python launch.py --config configs/quickstart.py --workdir runs/quickstart",
            "  python launch.py --config configs/evaluate.py:gammas=4 --dry_run",
            "", "Flags:", flags.FLAGS.main_module_help()]
  return "\n".join(lines)


def _programs() -> list[str]:
  import spec_jax.programs
  return sorted(m.name for m in pkgutil.iter_modules(spec_jax.programs.__path__))


def _check_override_keys(argv: list[str]) -> None:
  """Reject `--config.a.b=v` for keys the config does not have, naming the key and its siblings.

  ml_collections would raise a bare AttributeError("'b'") from deep inside flag parsing.
  """
  config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if config_arg is None and "--config" in argv[:-1]:
    config_arg = argv[argv.index("--config") + 1]
  overrides = dict(a[len("--config."):].partition("=")[::2] for a in argv
                   if a.startswith("--config."))
  if not config_arg or not overrides:
    return
  path, _, arg = config_arg.partition(":")
  try:
    spec = importlib.util.spec_from_file_location("_spec_jax_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception:  # let config_flags report problems with the file itself
    return
  for key in overrides:
    node, walked = config, []
    for part in key.split("."):
      if not hasattr(node, "keys") or part not in node:
        where = ".".join(walked) or "the top level"
        known = sorted(node.keys()) if hasattr(node, "keys") else []
        raise app.UsageError(
            f"Unknown config key {key!r} (from --config.{key}): {where} has no field {part!r}. "
            f"Known fields there: {known}.")
      node = node[part]
      walked.append(part)
    _check_tuple_override(key, overrides[key], node)


def _check_tuple_override(key: str, value: str, default) -> None:
  """A tuple field's override must hold elements of its default's type: ml_collections would
  parse `(2.5,)` into an int field as 2 and `abc` fail late with a bare error."""
  if not isinstance(default, tuple) or not default or not value:
    return
  want = type(default[0])
  try:
    parsed = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    parsed = value if want is str else None
  items = parsed if isinstance(parsed, (tuple, list)) else (parsed,)
  ok = parsed is not None and all(
      isinstance(x, want) and not (want is int and isinstance(x, bool))
      or (want is float and isinstance(x, int) and not isinstance(x, bool)) for x in items)
  if not ok:
    raise app.UsageError(
        f"--config.{key}={value}: {key} is a tuple of {want.__name__} (default {default}); "
        f"write it as a Python tuple of {want.__name__}s, e.g. --config.{key}=\"{default}\".")


def _parse_flags(argv: list[str]) -> list[str]:
  if any(a in ("--help", "-h", "--helpfull", "-?") for a in argv[1:]):
    print(_help_text())
    sys.exit(0)
  try:
    _check_override_keys(argv)
  except app.UsageError as e:
    print(f"FATAL {e}", file=sys.stderr)
    sys.exit(1)
  return flags.FLAGS(argv)


def _quiet_libraries(record) -> bool:
  """Keep INFO logs of our code; from orbax/tensorstore (hundreds of lines per checkpoint) only
  warnings and errors."""
  noisy = ("/orbax/", "/tensorstore/", "/etils/", "/tensorflow_datasets/")
  return record.levelno >= 30 or not any(part in record.pathname for part in noisy)


def _check_same_config_everywhere(config) -> None:
  """Multi-host: every process must run the same config (shapes, data and seeds must agree, or
  the collectives mismatch or hang). Compares a digest of the resolved config across processes."""
  import jax
  if jax.process_count() == 1:
    return
  import hashlib
  import numpy as np
  from jax.experimental import multihost_utils
  digest = hashlib.sha256(config.to_json(sort_keys=True).encode()).digest()
  mine = np.frombuffer(digest[:8], np.int32)
  first = multihost_utils.broadcast_one_to_all(mine)
  same = np.asarray(multihost_utils.process_allgather(np.array(np.all(mine == first))))
  if not same.all():
    bad = [i for i, ok in enumerate(np.ravel(same)) if not ok]
    print(f"FATAL The processes of this multi-host run disagree on the config: process(es) {bad} "
          "resolved a different config from process 0's. Fix: launch every process with the same "
          "--config and the same --config.* overrides.", file=sys.stderr)
    sys.exit(1)


def main(argv):
  logging.get_absl_handler().addFilter(_quiet_libraries)
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _DRY_RUN.value:  # before jax is even imported
    print(_CONFIG.value)
    return
  import jax
  from spec_jax import parallel
  parallel.maybe_initialize_distributed(
      _DISTRIBUTED.value, coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  config = _CONFIG.value
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (where checkpoints, metrics and results go); "
                         "--dry_run prints the resolved config without one.")
  if "program" not in config:
    raise app.UsageError("The config has no 'program' field; set config.program to one of "
                         f"{_programs()}.")
  if config.program not in _programs():
    raise app.UsageError(f"config.program={config.program!r} is not a program; choose one of "
                         f"{_programs()}.")
  logging.info("process %d/%d, devices: %s", jax.process_index(), jax.process_count(),
               jax.devices())
  _check_same_config_everywhere(config)
  if _VERBOSE.value:
    logging.info("config:\n%s", config)
  if jax.process_index() == 0 and not os.path.isfile(_WORKDIR.value):
    # The resolved config, for the record (printed only with --verbose).
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, "config.json"), "w", encoding="utf-8") as f:
      f.write(config.to_json_best_effort(indent=2))
  module = importlib.import_module(f"spec_jax.programs.{config.program}")
  try:
    module.run(config, _WORKDIR.value)
  except KeyboardInterrupt:
    if _VERBOSE.value:
      raise
    print("Interrupted (training programs checkpoint their newest step first; rerun the same "
          "command to resume).", file=sys.stderr)
    sys.exit(130)
  except _USER_ERRORS as e:
    if _VERBOSE.value:
      raise
    # A bad input: its message names the field and the fix; the traceback adds nothing.
    print(f"Error ({type(e).__name__}): {e}\n(--verbose shows the traceback)", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
