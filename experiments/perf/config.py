"""Cost model: the verifier's r(T) = cost(T tokens) / cost(1 token) and the drafter's c.

  python launch.py --config experiments/perf/config.py --workdir experiments/perf
  python launch.py --config experiments/perf/config.py:smoke --workdir /tmp/perf   # tiny, seconds
  python launch.py --config experiments/perf/config.py:timings=3 --workdir /tmp/perf3
      # three timings per batch size, 15 and 30 s apart, the one outside a shared VM's slow
      # spells kept (rows: timings, reference_spread)

Program: spec_jax/programs/cost_model.py. SmolLM2-135M verifier (its GGUF) and the quickstart
drafter of the scratch recipe (common.SCRATCH_DRAFTER, which must exist; or
--config.drafter.checkpoint=DIR),
T ∈ {1, 2, 3, 5, 8, 13, 16, 32} at batch 1 and 8, float32; then the theory τ / (r(γ + 1) + γ·c)
checked against chain SD decoded in the same turns at batch 1 (γ ∈ {2, 4, 6}, T = 0 and 1, 2
Shakespeare test prompts × 128 new tokens, medians of 5). Writes results.json (rows: model, T,
batch_size, ms, r, c, roofline_ms, vs_roofline, memory_bandwidth_gb_s, device; the check's rows
have model "speculative") and results.md.
Time: ~5 min on 2 idle CPU cores (~3 min of it the check); ~2.5 min on one H100 with the
quickstart's feature drafter (experiments/gpu/cost_model.md).
Reference numbers: experiments/perf/results.md (measured / theory 0.965-1.052 at batch 1);
older benchmark and cost-model runs: experiments/perf/notes.md.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, repeats=7, timings=1,
                          drafter=common.SCRATCH_DRAFTER)
  config = common.base("cost_model")
  config.config_file = "experiments/perf/config.py" + (f":{arg}" if arg else "")
  config.verifier = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.drafter = common.model(size="drafter-s", checkpoint=args.drafter)
  config.cost = dict(tokens=(1, 2, 3, 5, 8, 13, 16, 32), batch_sizes=(1, 8), repeats=args.repeats,
                     position=128,     # the T tokens' first position (a mid-generation cache)
                     bandwidth_mb=512,  # size of the array the bandwidth is measured on
                     passes=0,         # forwards per timed call (0: as many as last ~50 ms)
                     # timings per batch size, the first pause between them (then doubling);
                     # the one whose verifier one-token forward ran fastest is kept
                     timings=args.timings, pause_s=15.0)
  config.data = common.data()  # the check's prompts: its prompt split
  # The theory checked against measured chain SD at batch 1 (empty to skip).
  config.cost.check = dict(gammas=(2, 4, 6), temperatures=(0.0, 1.0), num_prompts=2,
                           prompt_tokens=64, new_tokens=128, repeats=5)
  if args.smoke:
    config.tokenizer = "bytes"
    config.verifier = common.model(size="test-tiny")
    config.drafter = common.model(size="test-tiny")
    config.cost.update(tokens=(1, 2, 5), batch_sizes=(1, 2), repeats=2, position=8,
                       bandwidth_mb=16)
    config.cost.check.update(gammas=(2,), temperatures=(0.0, 1.0), num_prompts=1,
                             prompt_tokens=8, new_tokens=8, repeats=1)
  return config
