"""Shared test set-up: fake CPU devices must be configured before jax is imported anywhere."""

import os
from importlib import metadata

# The 8 fake devices' collectives rendezvous between threads (cli.set_xla_defaults sizes their
# thread pool so they cannot deadlock); on 2 oversubscribed cores (two xdist workers plus the
# multi-host test's subprocesses) one can still wait longer than XLA's default 40 s before
# aborting the process, so the tests give it 10 minutes.
# XLA:CPU's classic fusion emitters instead of its MLIR ones: compiling is most of the suite's
# time, and they compile the tiny models' loops ~35% faster (measured 2026-11-24: six decoding
# loops 14.9 → 9.4 s); launched subprocesses (multi-host: TEST_XLA_FLAGS) use them too.
# Each program's machine code as one LLVM module instead of parallel split parts: two workers
# already keep both cores busy, and the split's threads only add overhead (measured 2026-11-28:
# four decoding loops, two processes at once, 2.8 → 2.2 s of compiling each).
# jaxlib 0.11's XLA has only the MLIR emitters and stops at start-up on the flag.
_CLASSIC_EMITTERS = ("--xla_cpu_use_fusion_emitters=false "
                     if tuple(map(int, metadata.version("jaxlib").split(".")[:2])) < (0, 11) else "")
TEST_XLA_FLAGS = (_CLASSIC_EMITTERS + "--xla_cpu_parallel_codegen_split_count=1 "
                  "--xla_cpu_collective_call_terminate_timeout_seconds=600 "
                  "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 " + TEST_XLA_FLAGS)
# The launcher's XLA defaults too, so that programs compiled in a test and in a launched
# subprocess share their persistent-cache entries (the cache keys hash XLA_FLAGS).
from spec_jax import cli  # noqa: E402  (no jax)
cli.set_xla_defaults()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most tests run tiny models, so compiling is most of their time: compile with little
# optimization (XLA backend -O0, no expensive LLVM passes; ~35% less compile time on the loop
# tests). Launched subprocesses inherit it. Tests whose run time dominates (a real SmolLM2, the
# far-tail sampling tests) are marked `optimized` and compile fully (`_optimization_level`).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Tests compare in float32; keep matmuls exact on CPU.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import atexit
import shutil
import tempfile

# Corpora and token caches built by program tests go to a throwaway dir, not the user's cache,
# removed when the process that made it (pytest itself, not an xdist worker) exits.
if "SPEC_JAX_DATA_DIR" not in os.environ:
  os.environ["SPEC_JAX_DATA_DIR"] = tempfile.mkdtemp(prefix="spec_jax_test_tfds_")
  atexit.register(shutil.rmtree, os.environ["SPEC_JAX_DATA_DIR"], ignore_errors=True)

# A persistent compilation cache shared by every test, xdist worker and launched subprocess: the
# programs' smoke runs compile the same steps many times. Entries are keyed by HLO, backend and
# jax version, so reuse across runs is safe. (XLA:CPU's rare worker crashes while compiling or
# serializing are rerun once: pytest.ini.)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "spec_jax_test_jax_cache_locked"))
# Only programs that took 0.1 s or more to compile are written (~500 entries instead of ~2,500
# in a cold run, 36 s less of pytest): the small ones (eager ops, key splits) compile again about
# as fast as an entry is read, and every write is a chance for XLA:CPU's rare crash in executable
# serialization (pytest.ini).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# A size bound turns on the cache's file lock (jax/_src/lru_cache.py, package filelock), held
# around every read and write. Unbounded, an entry is written in place without it, and a worker
# could read an entry another worker is still writing. 16 GiB never evicts. (XLA:CPU's rare
# worker crash while reading an entry, compilation_cache.get_executable_and_time, comes with
# the lock too: pytest.ini reruns it.)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 * 2**30))


import pytest  # noqa: E402  (after the environment above)


@pytest.fixture(scope="session")
def _shakespeare_dir(tmp_path_factory):
  """The Shakespeare corpus and its byte-tokenizer cache, built once per worker."""
  from spec_jax.data import pipeline  # imports jax: only once the environment is set
  from spec_jax.data.tokenizer import ByteTokenizer
  path = str(tmp_path_factory.mktemp("tfds_built"))
  pipeline.token_stream("spec_jax_shakespeare", "train", ByteTokenizer(), data_dir=path)
  return path


@pytest.fixture(scope="module")
def data_dir(_shakespeare_dir, tmp_path_factory):
  """A throwaway TFDS dir holding the Shakespeare corpus and its byte-tokenizer cache: a copy of
  the worker's built one (the files hold no paths), so a module may add datasets to it."""
  path = str(tmp_path_factory.mktemp("tfds"))
  shutil.copytree(_shakespeare_dir, path, dirs_exist_ok=True)
  return path


@pytest.fixture
def fresh_programs():
  """For a test that plants a bug inside a jitted program: the compiled programs of earlier
  tests (same static arguments, same jit cache entry) must not run in place of the planted one,
  nor the planted one later in place of theirs."""
  import jax  # noqa: PLC0415
  jax.clear_caches()
  yield
  jax.clear_caches()


# Seconds any one test may take before its worker is killed: ten times the slowest test's
# cold run on 2 cores, so no verdict depends on the machine's speed.
HANG_SECONDS = 600


@pytest.fixture(autouse=True)
def _hang_watchdog():
  """A test that hangs kills its worker after HANG_SECONDS, printing every thread's traceback,
  so pytest.ini's rerun runs it once more on a fresh worker instead of the suite waiting
  forever. XLA:CPU's cross-device collectives can deadlock (docs/design.md §5, the CPU
  collectives trap): a 48-step sharded training loop once hung in a cold-cache run, waiting on
  a step's metrics, and passed alone in 3 s."""
  import faulthandler  # noqa: PLC0415
  faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
  yield
  faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _optimization_level(request):
  """Full XLA optimization for tests marked `optimized` (see JAX_DISABLE_MOST_OPTIMIZATIONS
  above); the flag is read at each compile, so it can change between tests."""
  if request.node.get_closest_marker("optimized") is None:
    yield
    return
  import jax  # noqa: PLC0415
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


def pytest_collection_finish(session):
  """Python's cyclic garbage collector, tuned for tracing (docs/design.md §8): JAX's tracing and
  lowering allocate containers by the million, and with the default thresholds (700, 10, 10)
  the collector runs every few hundred of them and, now and then, walks every live object of
  the worker (jax, TensorFlow, every collected test module). After
  collection those objects are frozen out of the walks (`gc.freeze`) and the young generation
  holds 50,000 allocations: the decoding loop's tracing and lowering take ~15% less time;
  XLA's own compile is unchanged."""
  import gc  # noqa: PLC0415
  gc.collect()
  gc.freeze()
  gc.set_threshold(50_000, 20, 100)
