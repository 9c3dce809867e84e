"""The main job: SmolLM2 generation, a drafter trained on Shakespeare, a distilled copy of it,
then AR vs SD with both drafters.

  python launch.py --config configs/quickstart.py --workdir runs/quickstart
  python launch.py --config configs/quickstart.py:smoke --workdir /tmp/qs   # tiny, for tests

Time on 2 CPU cores (measured 2026-11-23 on idle cores, fresh workdir): 9 min 41 s in all:
generation, then 5.6 min of drafter training (300 steps of drafter-s, 8 x 128 tokens), 83 s for
the AR vs SD table, 86 s of distillation (DistillSpec, `distill_steps` steps of
`distill_divergence` on `distill_source` data, batch 8 × (32 + 48) tokens; see
experiments/distillspec/results.md for what each divergence and data source buys) and 56 s for
the distilled table (2026-11-21: 12 min 19 s). A second run reuses the trained drafters.
Reference: drafter eval loss 5.24 (accuracy 0.20); γ=4 τ with the drafter / the distilled
drafter (JSD[0.5], fixed data, 30 steps): greedy 1.42 / 1.43, T=1 1.39 / 1.64 (2026-11-23);
greedy SD output identical to AR.
Output: runs/quickstart/generate/generations.jsonl, runs/quickstart/drafter/ and
runs/quickstart/distilled/ (checkpoints, metrics.jsonl, TensorBoard events),
runs/quickstart/evaluate/ and runs/quickstart/evaluate_distilled/ (results.json, results.md,
PNGs), runs/quickstart/quickstart.json.
"""

from configs import common
from configs import distill as distill_config
from configs import evaluate as evaluate_config
from configs import generate as generate_config
from configs import train_lm as train_lm_config


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, drafter_steps=300, distill_steps=30,
                          distill_divergence="jsd", distill_source="fixed")
  config = common.base("quickstart")
  sub = "smoke" if args.smoke else None
  config.generate = generate_config.get_config(sub or "new_tokens=40")
  config.drafter = train_lm_config.get_config(
      sub or f"size=drafter-s,steps={args.drafter_steps},batch=8,seq_len=128")
  # drafter.checkpoint is set to the freshly trained drafter at run time.
  config.distill = distill_config.get_config(
      sub or f"steps={args.distill_steps},divergence={args.distill_divergence},"
      f"source={args.distill_source}")
  config.distill.eval.update(temperatures=(), at_start=False)  # the evaluate stage measures τ
  config.evaluate = evaluate_config.get_config(
      sub or "gammas=4,temperatures=0+1,num_prompts=4,new_tokens=48")
  config.evaluate.title = "quickstart: SmolLM2-135M verifier, freshly trained drafter"
  if args.smoke:
    config.distill.train.update(num_steps=4, eval_every=0, checkpoint_every=4)
  else:
    config.drafter.train.update(eval_every=100, checkpoint_every=100, log_every=10)
    config.distill.train.update(checkpoint_every=10)
  return config
