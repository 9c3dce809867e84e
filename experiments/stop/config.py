"""Chains that stop drafting when the drafter is unsure (`sd_stop`) against fixed chains
(program: specbench_experiment).

  python launch.py --config experiments/stop/config.py --workdir experiments/stop
  python launch.py --config experiments/stop/config.py:paired --workdir experiments/stop/paired
  python launch.py --config experiments/stop/config.py:smoke --workdir /tmp/stop   # tiny, tests

The task suite's program (experiments/specbench/config.py) on all nine categories, with the main
job's drafter (`runs/quickstart/drafter`, the suite's default), greedy and at T = 1, batch 1:
`sd` drafts γ = 4 tokens every round, `sd@1` one; `sd_stop:40` stops a row's drafting after a
draft the drafter gave probability below 0.40 (HF transformers' assistant_confidence_threshold
default), up to γ = 4, and the verifier scores only the drafts made
(spec_jax/decoding/drafters/standard.py, trees.TreeSpec.stop). Rows carry `drafts_per_call`
(draft tokens per verifier call) beside τ: a shorter chain loses the tokens the drafter would
have got right past an unsure draft and saves the drafter calls and the verifier width it would
have spent. All are exact (greedy output is the verifier's; tests/test_sd_stop.py checks the
sampled law). The question: does stopping make the greedy chain faster than autoregressive
decoding in every category (issue 38's bar, which `sd` at γ = 4 misses in seven)?
Time on 2 CPU cores where SmolLM2 decodes ~45 tokens/s: ~6 min per category (16 prompts × 96
new tokens, four timed passes per temperature), ~55 min for the nine. Measured rows:
experiments/stop/results.md and notes.md.

`:paired`: the greedy question settled on a shared machine: `sd` (γ = 4, the issue's setting)
and `sd@1`, greedy only, each row followed by three passes of it and of autoregressive decoding
taking turns prompt by prompt (`eval.timing_pairs=3`, `paired_speedups`); results.md then says
per method in which categories every pass ran faster, or slower, than autoregressive decoding.
~9 min per category on the 2 cores above, ~80 min for the nine (experiments/stop/paired/).
"""

from configs import common
from experiments.specbench import config as specbench
from spec_jax.data import suite

METHODS = ("sd", "sd@1", "sd_stop:40")


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, paired=False)
  config = specbench.get_config("smoke" if args.smoke else None)
  config.config_file = "experiments/stop/config.py" + (f":{arg}" if arg else "")
  config.title = ("Chains that stop drafting when the drafter is unsure, on every task category: "
                  "SmolLM2-135M-Instruct, the main job's drafter")
  config.suite.categories = suite.CATEGORIES
  config.eval.methods = METHODS
  if args.paired:
    config.title = ("Chains of four and of one draft against autoregressive decoding, greedy, "
                    "paired passes: SmolLM2-135M-Instruct, the main job's drafter")
    config.eval.update(methods=("sd", "sd@1"), temperatures=(0.0,), timing_pairs=3)
  if args.smoke:
    config.title = "Chains that stop drafting (smoke: tiny random models)"
    config.eval.methods = ("sd", "sd_stop:40")
    config.suite.categories = ("math",)
  return config
