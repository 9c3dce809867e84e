"""What launch.py does besides dispatching (kept here so the launcher stays short): reject
unknown or mistyped `--config.*` overrides before anything runs, list programs and configs for
`--help`, check that every process of a multi-host job resolved the same config, keep the console
quiet (log lines go to the workdir's log file), set XLA's defaults before jax starts, turn stop
signals into Ctrl-C, and say at the end where a run's output is."""

from __future__ import annotations

import ast
import glob
import importlib.util
import logging
import logging.handlers
import os
import pkgutil
import signal
import sys
import warnings

from absl import logging as absl_logging
from absl.app import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What bad input raises; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
               FileExistsError, PermissionError)


# XLA flags every run gets unless XLA_FLAGS already names them. GPU: every weight product on
# cuBLAS, none in Triton GEMM fusions; the Llama 3.1 8B batch-1 decode step is 2× faster on an
# H200 that way (experiments/scale/results.md, "levers"). CPU and TPU builds parse xla_gpu_*
# flags and ignore them.
XLA_DEFAULTS = ("--xla_gpu_enable_triton_gemm=false",)

# Added too where the process has one CPU device (no fake devices): XLA:CPU orders each program's
# operations to hold the least memory instead of running independent ones side by side. On 2
# cores the scanned decode step of Qwen3 0.6B / 1.7B and Gemma 3 1B runs 1.3-1.7x faster with it
# (Llama 3.2 1B's and SmolLM2's as fast): each layer's weight slice is copied out of the stacked
# weights right before its product instead of all seven first, so a slice that fits the cache is
# read back from it (Llama 3.2 1B's MLP slices, 67 MB, do not). A preset's random initialisation
# holds far less too (Qwen3 0.6B written out: 4.2 -> 1.9 GB of temporaries;
# experiments/scale/results.md, "scheduling order"). Fake devices keep XLA's order, the one
# their collectives' thread pool below is sized for.
CPU_ONE_DEVICE_DEFAULTS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


# glibc malloc settings for the launcher's process (`set_malloc_defaults`), as mallopt(3) names
# them. XLA:CPU mallocs each call's temporary buffers and frees them when the call ends. Under
# glibc's defaults, whether the next call gets them back from the heap or from fresh pages (page
# faults, zeroing) depends on what the process allocated before: the mmap threshold moves with the
# sizes freed, and the heap's top is returned to the system once more than the trim threshold is
# free there. The same SmolLM2-135M one-token forward took 25 ms in one run and 91 ms in another
# that differed only in a config section read later (experiments/scale/results.md, "malloc").
# Fixed thresholds keep freed buffers of up to 32 MiB in the heap for the next call.
MALLOC_DEFAULTS = (("M_MMAP_THRESHOLD", -3, 32 << 20), ("M_TRIM_THRESHOLD", -1, 256 << 20))


def set_malloc_defaults(environ=None) -> list[str]:
  """Applies MALLOC_DEFAULTS with mallopt where the C library is glibc and the environment sets
  none of glibc's MALLOC_*_ tunables (a user's own setting wins); returns the names set."""
  environ = os.environ if environ is None else environ
  import platform  # noqa: PLC0415
  if platform.libc_ver()[0] != "glibc" or any(
      key.startswith("MALLOC_") or key == "GLIBC_TUNABLES" for key in environ):
    return []
  import ctypes  # noqa: PLC0415
  libc = ctypes.CDLL(None)
  return [name for name, param, value in MALLOC_DEFAULTS if libc.mallopt(param, value) == 1]


# Threads per fake CPU device (`--xla_force_host_platform_device_count`). XLA:CPU runs a program's
# independent operations concurrently on one shared thread pool, NPROC threads (the machine's
# cores when unset), and a collective blocks its thread until every device reaches it. A decoding
# round starts a collective alongside a while loop that holds others, so with a few threads all of
# them can wait in one collective while a device's turn at it sits queued behind them: a deadlock
# (docs/design.md §5, the CPU collectives trap).
CPU_THREADS_PER_FAKE_DEVICE = 4


def fake_cpu_devices(xla_flags: str) -> int:
  """The device count `--xla_force_host_platform_device_count` asks for (1 when unset)."""
  counts = [flag.split("=", 1)[1] for flag in xla_flags.split()
            if flag.startswith("--xla_force_host_platform_device_count=")]
  return int(counts[-1]) if counts and counts[-1].isdigit() else 1


def set_xla_defaults(environ=None) -> str:
  """Appends each of XLA_DEFAULTS (and, without fake CPU devices, CPU_ONE_DEVICE_DEFAULTS) whose
  flag XLA_FLAGS does not set yet (so a user's own setting wins) and returns the resulting
  XLA_FLAGS; with fake CPU devices also sizes XLA:CPU's thread pool (NPROC, unless set) so their
  collectives cannot starve it. Call it before jax starts a backend."""
  environ = os.environ if environ is None else environ
  given = environ.get("XLA_FLAGS", "").split()
  named = {flag.split("=", 1)[0] for flag in given}
  devices = fake_cpu_devices(" ".join(given))
  defaults = XLA_DEFAULTS + (CPU_ONE_DEVICE_DEFAULTS if devices == 1 else ())
  added = [flag for flag in defaults if flag.split("=", 1)[0] not in named]
  environ["XLA_FLAGS"] = " ".join(given + added)
  if devices > 1 and "NPROC" not in environ:
    environ["NPROC"] = str(cpu_threads(devices))
  return environ["XLA_FLAGS"]


def cpu_threads(fake_devices: int) -> int:
  """XLA:CPU's pool size for this many fake devices: 4 threads each, or the cores this process
  may run on if more (XLA's own default, which also sizes its intra-op parallelism)."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return max(cores or 1, CPU_THREADS_PER_FAKE_DEVICE * fake_devices)


def programs() -> list[str]:
  import spec_jax.programs
  return sorted(m.name for m in pkgutil.iter_modules(spec_jax.programs.__path__))


def interrupt_on_stop_signals() -> None:
  """SIGTERM (`kill`, a scheduler's preemption) and SIGINT raise KeyboardInterrupt, as Ctrl-C does
  in a terminal, outside the training loop (which sets a stop flag instead:
  training/preemption.py), so a stop during loading or evaluation ends at once. SIGINT needs this
  too: a job started in the background (`cmd &`) inherits SIGINT ignored, and Python keeps it so."""
  def interrupt(signum, frame):
    del frame
    raise KeyboardInterrupt(signal.Signals(signum).name)
  signal.signal(signal.SIGTERM, interrupt)
  signal.signal(signal.SIGINT, interrupt)


def _config_arg(argv: list[str]) -> str | None:
  """The value of --config on a command line (`--config=X` or `--config X`), or None."""
  config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if config_arg is None and "--config" in argv[:-1]:
    config_arg = argv[argv.index("--config") + 1]
  return config_arg


def check_override_keys(argv: list[str]) -> None:
  """Reject `--config.a.b=v` for keys the config does not have, naming the key and its siblings.

  ml_collections would raise a bare AttributeError("'b'") from deep inside flag parsing.
  """
  config_arg = _config_arg(argv)
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
        raise UsageError(
            f"Unknown config key {key!r} (from --config.{key}): {where} has no field {part!r}. "
            f"Known fields there: {known}.")
      node = node[part]
      walked.append(part)
    _check_tuple_override(key, overrides[key], node)


def flag_error(error: Exception, argv: list[str]) -> str:
  """One line for a command line the flags refuse. A --config that does not load: ml_collections
  puts the config file's whole traceback into its flag error (an unknown ':arg'), or defers a
  missing file's error to the first read of the config; the cause is the last line."""
  config_arg = _config_arg(argv)
  text = str(error)
  if config_arg is None and "--config" in text:
    return ("--config is required: python launch.py --config configs/<name>.py[:args] "
            "--workdir DIR (`python launch.py --help` lists the configs).")
  if config_arg is None or not text.startswith(("flag --config=", "Configuration is not")):
    return text.splitlines()[0] if text else type(error).__name__
  if "No such file or directory" in text:
    return (f"--config={config_arg}: no such config file. Fix: a path to a config "
            "(`python launch.py --help` lists them), e.g. configs/evaluate.py:smoke.")
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  cause = lines[-1] if lines else type(error).__name__
  return f"--config={config_arg} does not load: {cause}"


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
    raise UsageError(
        f"--config.{key}={value}: {key} is a tuple of {want.__name__} (default {default}); "
        f"write it as a Python tuple of {want.__name__}s, e.g. --config.{key}=\"{default}\".")


def _first_line(path: str) -> str:
  """The first line of a Python file's module docstring, read without importing it."""
  try:
    with open(path, encoding="utf-8") as f:
      doc = ast.get_docstring(ast.parse(f.read())) or ""
  except (OSError, SyntaxError):
    return ""
  return doc.strip().splitlines()[0] if doc.strip() else ""


def help_text(flags_help: str, doc: str) -> str:
  """--help: usage, every program and config with its docstring's first line, then the flags."""
  lines = [doc.strip(), "", "Programs (config.program), spec_jax/programs/:"]
  for name in programs():
    path = os.path.join(ROOT, "spec_jax", "programs", name + ".py")
    lines.append(f"  {name:24s} {_first_line(path)}")
  lines += ["", "Configs (--config FILE[:args]; each docstring holds its command, run time and "
            "a :smoke variant):"]
  files = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
  files += sorted(glob.glob(os.path.join(ROOT, "experiments", "*", "config.py")))
  for path in files:
    rel = os.path.relpath(path, ROOT)
    if os.path.basename(path) not in ("__init__.py", "common.py"):
      lines.append(f"  {rel:34s} {_first_line(path)}")
  lines += ["", "Examples:",
            "  python launch.py --config configs/quickstart.py --workdir runs/quickstart",
            "  python launch.py --config configs/evaluate.py:gammas=4 --dry_run",
            "", "Flags:", flags_help]
  return "\n".join(lines)


CONFIG_FILE = "config.json"


def check_workdir(workdir: str) -> None:
  """UsageError unless `workdir` is a directory this process can write (created if missing)."""
  if os.path.basename(os.path.normpath(workdir)).startswith("-"):
    # `--workdir --dry_run` (a value forgotten, the next flag taken for it) would run the job
    # into a folder named after the flag.
    raise UsageError(f"--workdir={workdir!r} looks like a flag, not a folder: was the value "
                     "left out? Fix: --workdir=DIR (a folder name may not start with '-').")
  if os.path.isfile(workdir):
    raise UsageError(f"--workdir={workdir!r} is a file; results go into a directory. Fix: pass "
                     "a directory path (it is created if missing).")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise UsageError(f"--workdir={workdir!r} cannot be created ({e.strerror}). Fix: a directory "
                     "path you can write.") from None
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise UsageError(f"--workdir={workdir!r} is not writable. Fix: a directory path you can "
                     "write.")


def record_config(workdir: str, config) -> str | None:
  """Writes the resolved config to workdir/config.json, for the record; returns the text it
  replaced (None: there was none), which `restore_config` puts back when the run is refused."""
  path = os.path.join(workdir, CONFIG_FILE)
  previous = None
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      previous = f.read()
  os.makedirs(workdir, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(config.to_json_best_effort(indent=2))
  return previous


def restore_config(workdir: str, previous: str | None) -> None:
  """A refused run leaves the record of the runs before it: their config.json as it was."""
  if previous is not None:
    with open(os.path.join(workdir, CONFIG_FILE), "w", encoding="utf-8") as f:
      f.write(previous)


def summary(program: str, workdir: str, seconds: float) -> str:
  """The last line of every run: how long it took and what its workdir now holds."""
  names = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []
  shown = [n + ("/" if os.path.isdir(os.path.join(workdir, n)) else "") for n in names
           if not n.startswith("events.out.tfevents")]
  if len(shown) > 12:
    shown = shown[:12] + [f"... ({len(shown) - 12} more)"]
  return (f"\n{program} finished in {seconds / 60:.1f} min. Output in {os.path.abspath(workdir)}: "
          f"{', '.join(shown) or 'nothing'}")


# ---------------------------------------------------------------------------------------------
# The console and the log file. A run's console carries what the programs print (a header per
# stage, progress bars, tables) and the warnings and errors a user can act on; every log line,
# INFO included, goes to the workdir's log file, and `--verbose` shows them all on the console.

LOG_FILE = "log.txt"

# Library warnings that call for no action: every read-only checkpoint load and every first-use
# TFDS build print them.
_EXPECTED = ("read_only=True, setting save_interval_steps=0", "Given directory is read only",
             "Variant folder ")


def is_ours(path: str) -> bool:
  """Whether a log record's or a warning's source file is this repository's code (not a library;
  not a pseudo-file such as "<frozen importlib._bootstrap>")."""
  if not os.path.isabs(path) or "site-packages" in path or "dist-packages" in path:
    return False
  path = os.path.normpath(path)
  return path.startswith(ROOT + os.sep) or f"{os.sep}spec_jax{os.sep}" in path


def quiet_libraries(record: logging.LogRecord) -> bool:
  """Whether a quiet console may show `record` as far as libraries go: our code's records pass
  (`on_console` applies the level); of libraries' only warnings and errors, less the expected
  ones above and Python `warnings` (addressed to the developers of the code calling them)."""
  if is_ours(record.pathname):
    return True
  if record.levelno < logging.WARNING or record.name == "py.warnings":
    return False
  try:
    message = record.getMessage()  # the expected text may sit in the arguments
  except (TypeError, ValueError):
    message = str(record.msg)
  return not any(e in message for e in _EXPECTED)


def on_console(record: logging.LogRecord) -> bool:
  """The quiet console's filter: warnings and errors, ours and the libraries' that call for
  action; INFO lines (the JAX platform probe, orbax's checkpoint chatter, the model configs the
  programs log) are for the log file."""
  return record.levelno >= logging.WARNING and quiet_libraries(record)


def _log_warning(message, category, filename, lineno, file=None, line=None):
  """`warnings.showwarning` as a log record from the warning's own source file (so `is_ours`
  reads where it came from); a warning written to an explicit file stays there."""
  if file is not None:
    file.write(warnings.formatwarning(message, category, filename, lineno, line))
    return
  logger = logging.getLogger("py.warnings")
  logger.handle(logger.makeRecord("py.warnings", logging.WARNING, filename, lineno, "%s: %s",
                                  (category.__name__, message), None))


def route_logs(verbose: bool) -> logging.handlers.MemoryHandler:
  """Before jax is imported (its platform probe logs): the console (absl's handler) shows what
  `on_console` keeps, or everything with `verbose`; Python warnings become log records; every
  record is held for the log file, which `open_log` opens once the process index is known."""
  if not verbose:
    absl_logging.get_absl_handler().addFilter(on_console)
  warnings.showwarning = _log_warning
  # Holds records (no target yet, no size limit) until the log file opens.
  pending = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)
  logging.getLogger().addHandler(pending)
  return pending


def open_log(pending: logging.handlers.MemoryHandler, workdir: str,
             process_index: int = 0) -> str | None:
  """Append every log record, those held by `pending` first, to workdir/log.txt (process i > 0 of
  a multi-host run: log.process<i>.txt), in absl's format; returns its path. Where no file can
  be written there (the workdir is a file: the program names that error), the console shows
  everything instead and None is returned."""
  name = LOG_FILE if process_index == 0 else f"log.process{process_index}.txt"
  path = os.path.join(workdir, name)
  root = logging.getLogger()
  try:
    os.makedirs(workdir, exist_ok=True)
    target = logging.FileHandler(path, encoding="utf-8")
  except OSError:
    console = absl_logging.get_absl_handler()
    console.removeFilter(on_console)
    target, path = console, None
  else:
    target.setFormatter(absl_logging.PythonFormatter())
    root.addHandler(target)
  pending.setTarget(target)
  pending.flush()
  root.removeHandler(pending)
  return path


def hide_library_bars() -> None:
  """TFDS's build and shuffle bars (temporary paths, six per first-use corpus) off the console:
  what it built is logged (pipeline.py's "Building ... (first use)"). Call once the program is
  imported (every program that reads data has imported TFDS by then)."""
  tfds = sys.modules.get("tensorflow_datasets")
  if tfds is not None:
    tfds.disable_progress_bar()


def check_same_config_everywhere(config) -> None:
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


def exit_now(code: int) -> None:
  """Exit without the interpreter's teardown, after a user error has been reported. The program
  has unwound by then (its `finally` blocks closed checkpoints and writers); what teardown would
  add is noise: tensorstore callbacks of a failed checkpoint read print dozens of "Event loop is
  closed" tracebacks into the threads' closed asyncio loops."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
