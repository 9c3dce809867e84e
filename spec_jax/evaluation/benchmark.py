"""Wall-clock measurement shared by the benchmark programs.

Timings exclude compilation: each measured function is called once to compile (that time is
reported separately), then `repeats` times, and the median is kept. Every call blocks until its
outputs are ready, so asynchronous dispatch never hides work.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import jax


def device_description() -> str:
  """e.g. 'cpu x2 cores (x86_64)' or 'NVIDIA H100 80GB HBM3 x1'."""
  devices = jax.local_devices()
  kind = devices[0].device_kind
  if devices[0].platform == "cpu":
    return f"cpu ({os.cpu_count()} cores, {platform.machine()})"
  return f"{kind} x{len(devices)}"


def time_call(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
  """Compile-and-run once, then time `repeats` calls. Returns compile_s, median_s, min_s."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  median = statistics.median(times)
  return dict(compile_s=max(first - median, 0.0), median_s=median, min_s=min(times))


def write_results(workdir: str, rows: list[dict]) -> str:
  """Write rows to `workdir/results.json` and print them as one JSON document."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "results.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
  print(json.dumps(rows, indent=2))
  return path
