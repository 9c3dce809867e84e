"""Cost model: the verifier's r(T) = cost(T tokens) / cost(1 token) and the drafter's c.

  python launch.py --config experiments/perf/config.py --workdir experiments/perf
  python launch.py --config experiments/perf/config.py:smoke --workdir /tmp/perf   # tiny, seconds

Program: spec_jax/programs/cost_model.py. SmolLM2-135M verifier (its GGUF) and the quickstart
drafter of the scratch recipe (common.SCRATCH_DRAFTER; a random drafter-s without it),
T ∈ {1, 2, 3, 5, 8, 13, 16, 32} at batch 1 and 8, float32. Writes results.json (rows: model,
T, batch_size, ms, r, c, roofline_ms, vs_roofline, memory_bandwidth_gb_s, device) and results.md.
Time on 2 CPU cores: ~2 min. Reference numbers: experiments/perf/results.md.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, repeats=7, drafter=common.SCRATCH_DRAFTER)
  config = common.base("cost_model")
  config.config_file = "experiments/perf/config.py" + (f":{arg}" if arg else "")
  config.verifier = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.drafter = common.model(size="drafter-s", checkpoint=args.drafter)
  config.cost = dict(tokens=(1, 2, 3, 5, 8, 13, 16, 32), batch_sizes=(1, 8), repeats=args.repeats,
                     position=128,     # the T tokens' first position (a mid-generation cache)
                     bandwidth_mb=512)  # size of the array the bandwidth is measured on
  if args.smoke:
    config.tokenizer = "bytes"
    config.verifier = common.model(size="test-tiny")
    config.drafter = common.model(size="test-tiny")
    config.cost.update(tokens=(1, 2, 5), batch_sizes=(1, 2), repeats=2, position=8,
                       bandwidth_mb=16)
  return config
