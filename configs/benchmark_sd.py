"""Benchmark: speculative vs autoregressive decoding, SmolLM2-135M verifier + quickstart drafter.

  python launch.py --config configs/benchmark_sd.py --workdir runs/benchmark_sd

Greedy and temperature 1, γ ∈ {2, 4, 6}, batch 1 and 8, 8 prompts from the Shakespeare test split,
128 new tokens (stop tokens ignored so every row generates the same count). Rows in
runs/benchmark_sd/results.json (see configs/evaluate.py). Needs the quickstart drafter
(runs/quickstart/drafter); point --config.drafter.checkpoint elsewhere for another.
Time on 2 CPU cores: 15 min 48 s (measured 2026-11-21); GPU not measured yet.
Reference (2 CPU cores, quickstart drafter): greedy batch 1, γ=2: τ 1.39, α 0.31, c 0.10,
speedup 0.73× (theory 1.17×); T=1 batch 1, γ=2: τ 1.43, speedup 0.69×. Full table in README.
"""

from configs import evaluate


def get_config(arg=None):
  config = evaluate.get_config(arg)
  config.title = "benchmark_sd: SmolLM2-135M verifier, quickstart drafter"
  if not config.tokenizer == "bytes":  # not the smoke variant
    config.eval.update(gammas=(2, 4, 6), temperatures=(0.0, 1.0), batch_sizes=(1, 8),
                       num_prompts=8, new_tokens=128)
    config.num_data_prompts = 8
  return config
