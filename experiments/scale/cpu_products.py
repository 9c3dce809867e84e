"""One jitted float32 matrix product on the CPU, timed alone: the rates the CPU decode rows are
read against (experiments/scale/results.md, "batch 32" section).

For each weight [K, N], the product [T, K] × [K, N] at T = 1, 2, 4, 8 (the weight streamed by a
decode or verifier call) and the square [4096, 4096] × [4096, 16384] (the machine's matmul rate).
Medians of 20 calls after a compiling one (5 for the square product). Time nothing else meanwhile.

  JAX_PLATFORMS=cpu python experiments/scale/cpu_products.py
"""

import statistics
import time

import jax
import jax.numpy as jnp


def median_s(f, *args, calls: int) -> float:
  f(*args).block_until_ready()
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    f(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  product = jax.jit(lambda x, w: x @ w)
  for k, n in ((1024, 3072), (2048, 4096), (2048, 6144), (2048, 8192), (4096, 16384)):
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    cells = []
    for t in (1, 2, 4, 8, 32):
      x = jax.random.normal(jax.random.key(0), (t, k), jnp.float32)
      s = median_s(product, x, w, calls=20)
      cells.append(f"T={t} {s * 1e3:.2f} ms ({k * n * 4 / s / 1e9:.0f} GB/s of weight, "
                   f"{2 * t * k * n / s / 1e9:.0f} GFLOP/s)")
    print(f"[T, {k}] x [{k}, {n}]: " + "; ".join(cells))
  x = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (4096, 16384), jnp.float32)
  s = median_s(product, x, w, calls=5)
  print(f"[4096, 4096] x [4096, 16384]: {s * 1e3:.1f} ms, {2 * 4096 * 4096 * 16384 / s / 1e9:.0f} "
        "GFLOP/s")


if __name__ == "__main__":
  main()
