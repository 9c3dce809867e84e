"""Dynamic draft trees against the chain (program: specbench_experiment).

  python launch.py --config configs/distill.py:data=sharegpt,steps=200 \
      --workdir runs/sharegpt_fixed                                  # the drafter, first
  python launch.py --config experiments/dyn/config.py --workdir experiments/dyn
  python launch.py --config experiments/dyn/config.py:smoke --workdir /tmp/dyn   # tiny, for tests
  python launch.py --config experiments/dyn/config.py:suite --workdir experiments/dyn/suite_t1

The task suite's program (experiments/specbench/config.py,
spec_jax/programs/specbench_experiment.py) on its `chat` category, with a ShareGPT feature drafter
(`drafter.checkpoint`, distilled by the first command) drafting the chain `sd` and the trees at the
same depth L = γ = 4: EAGLE-2's dynamic tree `dyn:K-M` at four budgets M = 8, 16, 32, 64 verified
tokens (K = 2, 4, 8, 8 nodes expanded per level; EAGLE-2 verifies ~60), and RSD's stochastic-beam
tree `rsd_s:4` (16 nodes: the budget of dyn:4-16, drawn without the rerank), greedy and at T = 1,
batch 1. Every method is exact at both temperatures (spec_jax/decoding/drafters/dyn.py proves dyn's
T > 0 rule; tests/test_dyn.py checks it). results.md sets each tree beside the chain: τ / τ(sd),
the verifier tokens per call, the measured cost r of that call in one-token steps, the drafter cost
c, the calls per round with the tokens each feeds and their cost Σ_w c(w), the theoretical
speedup τ / (r + Σ_w c(w)) and the measured one, so the best budget for the machine can be read
off (r grows fast with the tokens per call on a CPU, slowly on a GPU).

`:suite`: the dynamic tree at M = 32 (dyn:8-32) beside the chain on every category of the task
suite at T = 1, with the task suite's drafter (the main job's, `runs/quickstart/drafter`): does a
tree carry the default drafter to the issue's τ ≥ 1.6 at T = 1 everywhere, and at what speed.

Time on 2 CPU cores: about 5 min per method and temperature at 16 prompts × 96 new tokens (the
autoregressive baseline included), ~50-60 min in all, plus the drafter's distillation (~12 s per
step at batch 8 × 256 tokens on a slow 2-core VM); `:suite` ~30 min on a VM that decodes
SmolLM2 at ~45 tokens/s. Measured rows: experiments/dyn/results.md, experiments/dyn/suite_t1/.
"""

from configs import common
from experiments.specbench import config as specbench
from spec_jax.data import suite

SHAREGPT_DRAFTER = "runs/sharegpt_fixed"  # configs/distill.py:data=sharegpt's feature drafter
METHODS = ("sd", "dyn:2-8", "dyn:4-16", "dyn:8-32", "dyn:8-64", "rsd_s:4")


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, suite=False)
  config = specbench.get_config("smoke" if args.smoke else None)
  config.config_file = "experiments/dyn/config.py" + (f":{arg}" if arg else "")
  config.title = "Dynamic draft trees against the chain: SmolLM2-135M-Instruct, ShareGPT drafter"
  config.suite.categories = ("chat",)
  config.eval.methods = METHODS
  if args.smoke:
    config.title = "Dynamic draft trees (smoke: tiny random models)"
    config.eval.methods = ("sd", "dyn:2-4")
    config.suite.categories = ("math",)
  elif args.suite:  # the task suite's categories and drafter (specbench's defaults), T = 1
    config.title = ("A dynamic draft tree on every task category at T = 1: SmolLM2-135M-Instruct,"
                    " the main job's drafter")
    config.suite.categories = suite.CATEGORIES
    config.eval.update(methods=("sd", "dyn:8-32"), temperatures=(1.0,))
  else:
    config.drafter.checkpoint = SHAREGPT_DRAFTER
    config.drafter_about = ("a feature drafter distilled on ShareGPT (`configs/distill.py:"
                            "data=sharegpt`)")
  return config
