"""Peer benchmark: spec_jax vs HF transformers (greedy and assisted generation), same weights.

  python launch.py --config configs/quickstart.py:recipe=scratch,vocab=0 \
      --workdir runs/quickstart_scratch   # the drafter (common.SCRATCH_DRAFTER), once
  python launch.py --config configs/benchmark_hf.py --workdir runs/benchmark_hf
  python launch.py --config configs/benchmark_hf.py:smoke --workdir /tmp/bhf   # tiny, seconds

SmolLM2-135M-Instruct (from its GGUF) verifier and the scratch quickstart drafter (a plain LM over
the full vocabulary, as transformers' assisted generation needs), both exported to HF
directories under the workdir and loaded from there by both systems; 8 Shakespeare test prompts
of exactly 64 tokens, 64 new tokens each, greedy, EOS stopping off. Rows: transformers greedy
(batch 1, 8), transformers assisted generation (batch 1; its default schedule and constant γ),
spec_jax autoregressive and speculative decoding (batch 1, 8). Its default schedule stops drafting
below an assistant confidence of 0.4; transformers adapts that threshold during a generation only
when scikit-learn is installed, which requirements-test.txt leaves out, so it stays at 0.4 here
(`pip install scikit-learn` to measure the adaptive one). Writes results.json, summary.json
(speedups), results.md, and hf/verifier, hf/drafter.
Needs torch and transformers (requirements-test.txt). If other jobs share the cores, set
OMP_WAIT_POLICY=PASSIVE, or torch's spinning threads collapse (1.3 tokens/s instead of 7.8 seen).
Time on 2 CPU cores: ~4.5 min on idle cores (~11 min with two other long jobs running).
GPU: `configs/benchmark_hf.py:gpu` (and `:gpu,dtype=bfloat16`) runs both systems on the
accelerator at batch 1, 8 and 32; not run yet.
Reference (2 idle CPU cores; experiments/perf/notes.md has the table): spec_jax SD / transformers
assisted generation at batch 1, γ = 4: ~1.7x (its default schedule, τ 1.34) and ~1.9x
(constant γ, τ 1.39 in both), every row identical to transformers' greedy output; mostly the
autoregressive gap (spec_jax AR 1.67x transformers greedy; each system's SD / own AR 0.69x vs
0.59x-0.69x). Under load the ratios are unreliable.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, gamma=4, new_tokens=64, num_prompts=8,
                          drafter=common.SCRATCH_DRAFTER, gpu=False, dtype="float32")
  config = common.base("benchmark_hf")
  config.verifier = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.drafter = common.model(size="drafter-s", checkpoint=args.drafter)
  config.data = common.data()
  config.prompts = ()
  config.prompts_file = ""
  config.prompts_mix = False  # True: prompts_file adds to prompts and the data prompts
  config.num_data_prompts = args.num_prompts
  config.data_prompt_tokens = 80  # texts of up to 80 tokens, cut to exactly prompt_tokens ids
  config.note = ""  # free text copied to summary.json (e.g. "measured while other jobs ran")
  config.benchmark = dict(
      prompt_tokens=64, new_tokens=args.new_tokens, num_prompts=args.num_prompts,
      gamma=args.gamma,            # spec_jax γ = transformers' num_assistant_tokens ("constant")
      batch_sizes=(1, 8),          # spec_jax batch sizes; transformers greedy runs 1 and the max
      assisted_schedules=("default", "constant"),
      torch_threads=0,             # 0: all cores
      torch_device="cpu",          # where transformers runs ("cuda" on a GPU)
      torch_dtype="float32")       # transformers' dtype ("bfloat16" beside model.dtype=bfloat16)
  if args.gpu:  # the GPU rows: batch 1, 8 and 32 on one accelerator, both systems on it
    config.num_data_prompts = 32
    config.benchmark.update(num_prompts=32, batch_sizes=(1, 8, 32), torch_device="cuda",
                            torch_dtype=args.dtype)
    config.verifier.dtype = config.drafter.dtype = args.dtype
  if args.smoke:
    config.tokenizer = "bytes"
    config.verifier = common.model(size="test-tiny")
    config.drafter = common.model(size="test-tiny")
    config.prompts = ("To be, or not to be, that is", "Now is the winter of our discontent")
    config.num_data_prompts = 0
    config.benchmark.update(prompt_tokens=12, new_tokens=6, num_prompts=2, gamma=2,
                            batch_sizes=(1,), torch_threads=1)
  return config
