"""Benchmark: the cost of exact sampling against the pre-fix samplers, batch 1 and 8, V = 49,152.

  python launch.py --config configs/benchmark_sampling.py --workdir runs/benchmark_sampling
  python launch.py --config configs/benchmark_sampling.py:smoke --workdir /tmp/bench_sampling

Writes runs/benchmark_sampling/results.json (rows: site, batch_size, vocab_size, ms, baseline_ms,
ratio = ms / baseline_ms, device). Time: ~30 s on 2 CPU cores.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, repeats=200)
  config = common.base("benchmark_sampling")
  config.benchmark = dict(batch_sizes=(1, 8), vocab_size=49152, top_k=4, repeats=args.repeats)
  if args.smoke:
    config.benchmark.update(vocab_size=300, repeats=3, batch_sizes=(2,))
  return config
