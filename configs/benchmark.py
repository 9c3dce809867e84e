"""Benchmark: SmolLM2-135M greedy autoregressive decoding at batch 1 and 8, 128 new tokens.

  python launch.py --config configs/benchmark.py --workdir runs/benchmark
  python launch.py --config configs/benchmark.py:smoke --workdir /tmp/bench   # tiny model, seconds

Writes runs/benchmark/results.json (rows: method, batch_size, new_tokens, tokens_per_s,
ms_per_token, ms_per_step, prefill_ms, ms_per_decode_step, compile_s, device, and the memory
roofline measured in turns with the decode calls: memory_bandwidth_gb_s, roofline_ms_per_step,
vs_roofline, decode_vs_roofline; preset, dtype, device_kind). Architecture presets at their
published shapes with random weights: configs/scale.py.
Time: ~50 s on 2 CPU cores (measured); GPU not measured yet (`:gpu`, `:gpu,dtype=bfloat16`:
batch 1, 8 and 32).
Reference (2 idle CPU cores, medians of 3 runs of 5 repeats; experiments/perf/notes.md): batch 1: 17.6
ms/token (decode steps 17.1 ms, prefill 78 ms) = 1.33× the roofline (1.25–1.47 between runs);
batch 8: 3.89 ms/token. HF transformers greedy on the same machine and GGUF: 41.9 ms/token.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, new_tokens=128, repeats=5, gpu=False,
                          dtype="float32")
  config = common.base("benchmark")
  config.mesh = common.mesh(data=1)  # one device; --config.mesh.* to decode on several
  config.model = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.data = common.data()
  config.sampling = common.sampling()
  config.benchmark = dict(batch_sizes=(1, 8), new_tokens=args.new_tokens, prompt_tokens=64,
                          repeats=args.repeats,
                          prompts="data",  # or "random": random ids, no corpus (random weights)
                          loop="fixed")  # or "while": the loop that stops on stop tokens
  if args.gpu:  # the GPU rows: batch 1, 8 and 32 in `dtype`
    config.benchmark.batch_sizes = (1, 8, 32)
    config.model.dtype = args.dtype
  if args.smoke:
    config.tokenizer = "bytes"
    config.model = common.model(size="test-tiny")
    config.benchmark.new_tokens = 8
    config.benchmark.batch_sizes = (1, 2)
    config.benchmark.repeats = 1
  return config
