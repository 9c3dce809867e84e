"""Chains that stop drafting when the drafter is unsure (`sd_stop`) against the fixed chain
(program: specbench_experiment).

  python launch.py --config experiments/stop/config.py --workdir experiments/stop
  python launch.py --config experiments/stop/config.py:suite --workdir experiments/stop/suite
  python launch.py --config experiments/stop/config.py:smoke --workdir /tmp/stop   # tiny, tests

The task suite's program (experiments/specbench/config.py) with the main job's drafter
(`runs/quickstart/drafter`, the suite's default) drafting chains of up to γ = 4: `sd` drafts all
four every round; `sd_stop:C` stops a row's drafting after a draft the drafter gave probability
below C % (HF transformers' assistant_confidence_threshold, 0.4 by default there) and the verifier
scores only the drafts made (spec_jax/decoding/drafters/standard.py, trees.TreeSpec.stop). Rows
carry `drafts_per_call` (draft tokens per verifier call) beside τ, so the trade is read off: a
shorter chain loses the tokens the drafter would have got right past an unsure draft and saves
the drafter calls and the verifier's width it would have spent. Both are exact (greedy output is
the verifier's; tests/test_sd_stop.py checks the sampled law).

Default: the threshold sweep C = 20, 40, 60, 80 on `chat` and `code`, greedy and at T = 1.
`:suite`: `sd` and `sd_stop` at the sweep's chosen threshold (STOP) on all nine categories, greedy
and at T = 1: does stopping make the greedy chain faster than autoregressive decoding in every
category (issue 38's bar, which the fixed chain misses in seven).
Time on 2 CPU cores where SmolLM2 decodes ~45 tokens/s: ~4 min per method and temperature per
category (16 prompts × 96 new tokens, the autoregressive baseline included), ~35 min for the
sweep, ~60 min for `:suite`. Measured rows: experiments/stop/results.md, experiments/stop/suite/.
"""

from configs import common
from experiments.specbench import config as specbench
from spec_jax.data import suite

SWEEP = ("sd", "sd_stop:20", "sd_stop:40", "sd_stop:60", "sd_stop:80")
STOP = "sd_stop:40"  # the suite's threshold (experiments/stop/results.md: the sweep)


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, suite=False)
  config = specbench.get_config("smoke" if args.smoke else None)
  config.config_file = "experiments/stop/config.py" + (f":{arg}" if arg else "")
  config.title = ("Chains that stop drafting when the drafter is unsure: SmolLM2-135M-Instruct, "
                  "the main job's drafter")
  config.suite.categories = ("chat", "code")
  config.eval.methods = SWEEP
  if args.smoke:
    config.title = "Chains that stop drafting (smoke: tiny random models)"
    config.eval.methods = ("sd", "sd_stop:40")
    config.suite.categories = ("math",)
  elif args.suite:
    config.title = ("A chain that stops drafting when unsure, on every task category: "
                    "SmolLM2-135M-Instruct, the main job's drafter")
    config.suite.categories = suite.CATEGORIES
    config.eval.methods = ("sd", STOP)
  return config
