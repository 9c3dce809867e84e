"""The single launcher: `python launch.py --config configs/X.py[:args] --workdir DIR [--config.a.b=v]`.

Dispatches on `config.program` to `spec_jax.programs.<program>.run(config, workdir)`.
"""

import gc
import importlib
import sys
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from spec_jax import cli  # no jax: --help and --dry_run stay instant

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
    "verbose", False, "Show every log line on the console (without it they go to WORKDIR/log.txt "
    "only), the resolved config, and full tracebacks on errors (without it, a bad input ends "
    "with one line naming the field and the fix).")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Print the resolved config (file, its ':args' and every --config.* "
    "override) and exit without running anything; --workdir may be left out.")
flags.mark_flags_as_required(["config"])


def _parse_flags(argv: list[str]) -> list[str]:
  if any(a in ("--help", "-h", "--helpfull", "-?") for a in argv[1:]):
    print(cli.help_text(flags.FLAGS.main_module_help(), __doc__))
    sys.exit(0)
  try:
    cli.check_override_keys(argv)
  except app.UsageError as e:
    print(f"FATAL {e}", file=sys.stderr)
    sys.exit(1)
  try:
    rest = flags.FLAGS(argv)
    if _CONFIG.value is not None:
      _CONFIG.value.keys()  # a config file that failed to load raises at its first read
  except (flags.Error, OSError) as e:
    if "--verbose" in argv:
      raise
    print(f"FATAL {cli.flag_error(e, argv)}", file=sys.stderr)
    sys.exit(1)
  return rest


def main(argv):
  try:
    _run(argv)
  except app.UsageError as e:  # absl would print the whole usage text above the one line
    if _VERBOSE.value:
      raise
    print(f"FATAL {e}", file=sys.stderr)
    sys.exit(1)


def _run(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}. Fix: flags take --name=value, "
                         "config fields --config.a.b=value (`python launch.py --help`).")
  if _DRY_RUN.value:  # before jax is even imported
    print(_CONFIG.value)
    return
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (where checkpoints, metrics and results go); "
                         "--dry_run prints the resolved config without one.")
  cli.check_workdir(_WORKDIR.value)
  # Log lines go to WORKDIR/log.txt (and the console with --verbose); before jax probes platforms.
  pending_log = cli.route_logs(_VERBOSE.value)
  xla_flags = cli.set_xla_defaults()  # before jax starts a backend
  malloc = cli.set_malloc_defaults()
  import jax
  from spec_jax import parallel
  parallel.maybe_initialize_distributed(
      _DISTRIBUTED.value, coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  cli.open_log(pending_log, _WORKDIR.value, jax.process_index())
  logging.info("launch.py %s", " ".join(sys.argv[1:]))
  logging.info("XLA_FLAGS=%s", xla_flags)
  logging.info("malloc: %s", ", ".join(malloc) or "the C library's defaults")
  config = _CONFIG.value
  if "program" not in config:
    raise app.UsageError("The config has no 'program' field; set config.program to one of "
                         f"{cli.programs()}.")
  if config.program not in cli.programs():
    raise app.UsageError(f"config.program={config.program!r} is not a program; choose one of "
                         f"{cli.programs()}.")
  logging.info("process %d/%d, devices: %s", jax.process_index(), jax.process_count(),
               jax.devices())
  cli.check_same_config_everywhere(config)
  if _VERBOSE.value:
    logging.info("config:\n%s", config)
  previous = None  # the workdir's config.json before this run, if it had one
  if jax.process_index() == 0 and not config.get("render_only", False):
    # The resolved config, for the record (printed only with --verbose); a render_only run
    # reports a workdir's finished runs and leaves the config they were made with in place.
    previous = cli.record_config(_WORKDIR.value, config)
  module = importlib.import_module(f"spec_jax.programs.{config.program}")
  if not _VERBOSE.value:
    cli.hide_library_bars()
  cli.interrupt_on_stop_signals()  # outside training: the loop installs its own (training/preemption.py)
  # What the imports built lives as long as the process: out of the garbage collector's walks,
  # which tracing would otherwise pay for in every full collection (docs/design.md §8).
  gc.collect()
  gc.freeze()
  t0 = time.perf_counter()
  try:
    module.run(config, _WORKDIR.value)
    if jax.process_index() == 0:
      print(cli.summary(config.program, _WORKDIR.value, time.perf_counter() - t0))
  except KeyboardInterrupt:
    if _VERBOSE.value:
      raise
    print("Interrupted outside the training loop (nothing new to checkpoint); rerun the same "
          "command to resume from the newest checkpoint.", file=sys.stderr)
    sys.exit(130)
  except cli.USER_ERRORS as e:
    cli.restore_config(_WORKDIR.value, previous)  # a refused run loses nothing
    if _VERBOSE.value:
      raise
    # A bad input: its message names the field and the fix; the traceback adds nothing.
    print(f"Error ({type(e).__name__}): {e}\n(--verbose shows the traceback)", file=sys.stderr)
    cli.exit_now(1)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
