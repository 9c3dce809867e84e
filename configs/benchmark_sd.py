"""Benchmark: speculative vs autoregressive decoding, SmolLM2-135M verifier + quickstart drafter.

  python launch.py --config configs/benchmark_sd.py --workdir runs/benchmark_sd

Greedy and temperature 1, γ ∈ {2, 4, 6}, batch 1 and 8, 8 prompts from the Shakespeare test split,
128 new tokens (stop tokens ignored so every row generates the same count). Rows in
runs/benchmark_sd/results.json (see configs/evaluate.py). Needs the quickstart drafter
(runs/quickstart/drafter); point --config.drafter.checkpoint elsewhere for another.
Time: ~16 min on 2 CPU cores; the same grid (batch 1 and 8, 3 timed passes) 3.6 min on one
H100 (experiments/gpu/results.md). `configs/benchmark_sd.py:gpu` and `:gpu,dtype=bfloat16`
(batch 1, 8, 32; trees through --config.eval.methods, e.g. "('sd','rsd_c')"), with
`configs/benchmark.py:gpu` and `configs/benchmark_hf.py:gpu` for the AR and transformers rows on
the same device, have not been run yet.
Reference (2 CPU cores, drafter-s of `configs/quickstart.py:recipe=scratch`): greedy batch 1, γ=2:
τ 1.39, α 0.31, c 0.10, speedup 0.73× (theory 1.17×); T=1 batch 1, γ=2: τ 1.43, speedup 0.69×.
Full table: experiments/perf/notes.md; with the feature drafter on one H100:
experiments/gpu/benchmark_sd.md.
"""

from configs import common, evaluate


def get_config(arg=None):
  # gpu / dtype are this config's own arguments; the rest go to configs/evaluate.py.
  items = [i for i in (arg or "").split(",") if i]
  own = common.parse_arg(",".join(i for i in items if i.partition("=")[0] in ("gpu", "dtype")),
                         gpu=False, dtype="float32")
  config = evaluate.get_config(",".join(i for i in items
                                        if i.partition("=")[0] not in ("gpu", "dtype")) or None)
  config.title = "benchmark_sd: SmolLM2-135M verifier, quickstart drafter"
  config.print_json = True  # a benchmark prints its rows (results.json) as one JSON document
  if not config.tokenizer == "bytes":  # not the smoke variant
    config.eval.update(gammas=(2, 4, 6), temperatures=(0.0, 1.0), batch_sizes=(1, 8),
                       num_prompts=8, new_tokens=128)
    config.num_data_prompts = 8
  if own.gpu:  # the GPU rows: batch 1, 8 and 32 on one accelerator, in `dtype`
    config.eval.update(batch_sizes=(1, 8, 32), num_prompts=32)
    config.num_data_prompts = 32
    config.verifier.dtype = config.drafter.dtype = own.dtype
  return config
