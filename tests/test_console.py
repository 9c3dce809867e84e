"""The launcher's quiet console: a run prints its own output and the warnings a user can act on;
every log line (libraries' INFO and WARNING lines, the JAX platform probe, TFDS's build lines, the
programs' own INFO lines) goes to WORKDIR/log.txt, and --verbose puts them all back on the console.

The subprocess test runs the generate program's smoke config on prompts read from a corpus in a
fresh TFDS data dir, so TFDS really builds it: its "Variant folder ... has no dataset_info.json"
warnings, its INFO lines and its six build/shuffle bars are the library noise under test."""

import logging
import os
import re
import subprocess
import sys
import warnings

from spec_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# absl's format: "W1126 20:44:41.934102 140516098665344 file_utils.py:394] message".
ABSL_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ ([\w.-]+\.py):\d+\] (.*)$", re.M)
TFDS_BARS = ("Generating splits", "Shuffling ", "examples/s")


def _launch(tmp_path, name, *flags):
  """Console (stdout, stderr) and log file text of one launcher run in tmp_path/name."""
  workdir = tmp_path / name
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  result = subprocess.run(
      [sys.executable, "launch.py", "--config", "configs/generate.py:smoke",
       "--workdir", str(workdir), "--config.num_data_prompts=1", "--config.prompts=('To be',)",
       "--config.generation.max_new_tokens=2", f"--config.data.data_dir={tmp_path / name}_data",
       *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout, result.stderr, (workdir / cli.LOG_FILE).read_text()


def _library_lines(text: str) -> set[tuple[str, str]]:
  """(level, source file) of the absl-format lines in `text` that come from libraries."""
  ours = {"launch.py", *(f for _, _, files in os.walk(os.path.join(ROOT, "spec_jax"))
                         for f in files if f.endswith(".py"))}
  return {(level, source) for level, source, _ in _absl_lines(text) if source not in ours}


def _absl_lines(text: str) -> list[tuple[str, str, str]]:
  """(level, source file, message) of every absl-format line (progress bars redraw their line
  with carriage returns and cursor escapes, which a line logged under a bar follows)."""
  return ABSL_LINE.findall(re.sub(r"\r|\x1b\[[0-9;]*[A-Za-z]", "\n", text))


def test_console_is_quiet_the_log_keeps_everything_and_verbose_shows_it(tmp_path):
  out, err, log = _launch(tmp_path, "quiet")
  # The console: the program's output and the run's last line, nothing logged, no TFDS bar.
  assert "=== prompt: 'To be'" in out and "generate finished in" in out and "log.txt" in out
  assert not _absl_lines(out + err), (out + err)[-3000:]
  assert not any(bar in out + err for bar in TFDS_BARS), err[-3000:]
  # The log: TFDS's warnings and INFO lines, and ours (the launcher's, the data build's).
  assert "Variant folder" in log and "has no dataset_info.json" in log
  library = _library_lines(log)
  assert {("W", "file_utils.py"), ("I", "dataset_builder.py")} <= library, library
  assert "process 0/1, devices" in log and "Building spec_jax_shakespeare" in log
  assert "launch.py --config configs/generate.py:smoke" in log
  # The launcher's XLA defaults reach the run (the tests set them too: tests/conftest.py).
  assert "--xla_gpu_enable_triton_gemm=false" in os.environ["XLA_FLAGS"]
  assert f"XLA_FLAGS={os.environ['XLA_FLAGS']}\n" in log

  v_out, v_err, v_log = _launch(tmp_path, "verbose", "--verbose")
  # --verbose: every library line the quiet run logged is on the console, and the bars are back.
  assert library <= _library_lines(v_err), (library, v_err[-3000:])
  assert "process 0/1, devices" in v_err and "Variant folder" in v_err
  assert all(bar in v_err for bar in TFDS_BARS), v_err[-3000:]
  assert "=== prompt: 'To be'" in v_out
  # Nothing logged only with --verbose but the config it shows: the quiet log lost nothing.
  quiet_lines = {(level, source) for level, source, _ in _absl_lines(log)}
  verbose_lines = {(level, source) for level, source, message in _absl_lines(v_log)
                   if not message.startswith("config:")}
  assert verbose_lines <= quiet_lines, verbose_lines - quiet_lines


def _record(path, level, msg, args=None, name="absl"):
  return logging.LogRecord(name, level, path, 1, msg, args, None)


def test_console_filter_keeps_what_a_user_can_act_on():
  site = "/venv/lib/python3.11/site-packages/"
  probe = _record(site + "jax/_src/xla_bridge.py", logging.INFO,
                  "Unable to initialize backend '%s': %s", ("tpu", "libtpu.so not found"))
  variant = _record(site + "tensorflow_datasets/core/utils/file_utils.py", logging.WARNING,
                    "Variant folder %s has no %s", ("/tmp/d/x/1.0.0", "dataset_info.json"))
  orbax_info = _record(site + "orbax/checkpoint/checkpoint_manager.py", logging.INFO, "Saving")
  ours_info = _record(os.path.join(ROOT, "spec_jax/programs/distill.py"), logging.INFO,
                      "Distilling %s", ("LlamaConfig(vocab_size=257, d_model=32, ...)",))
  for record in (probe, variant, orbax_info, ours_info):
    assert not cli.on_console(record), record.getMessage()
  ours_warning = _record(os.path.join(ROOT, "spec_jax/training/checkpoints.py"), logging.WARNING,
                         "Checkpoint %s (step %d) is corrupt", ("/w/checkpoints/20", 20))
  fallback = _record(site + "jax/_src/xla_bridge.py", logging.WARNING,
                     "An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is "
                     "not installed. Falling back to cpu.")
  library_error = _record(site + "orbax/checkpoint/checkpoint_manager.py", logging.ERROR, "x")
  for record in (ours_warning, fallback, library_error):
    assert cli.on_console(record), record.getMessage()


def test_python_warnings_are_log_records_from_their_source():
  """A library's `warnings.warn` goes to the log only; ours reaches the console as well."""
  seen = []

  class Keep(logging.Handler):
    def emit(self, record):
      seen.append(record)

  logger = logging.getLogger("py.warnings")
  handler = Keep()
  logger.addHandler(handler)
  try:
    cli._log_warning(DeprecationWarning("old API"), DeprecationWarning,
                     "/venv/lib/python3.11/site-packages/flax/core.py", 7)
    cli._log_warning(UserWarning("check this"), UserWarning,
                     os.path.join(ROOT, "spec_jax", "parallel.py"), 9)
  finally:
    logger.removeHandler(handler)
  assert [r.getMessage() for r in seen] == ["DeprecationWarning: old API",
                                            "UserWarning: check this"]
  assert [cli.on_console(r) for r in seen] == [False, True]
  assert warnings.showwarning is not cli._log_warning  # only the launcher installs it
