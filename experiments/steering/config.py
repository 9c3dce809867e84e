"""SD² at small scale: the quickstart drafter as pretrained, distilled, and steered by the
SmolLM2 verifier's hidden states (program: steering_experiment).

  python launch.py --config experiments/steering/config.py --workdir experiments/steering
  python launch.py --config experiments/steering/config.py:smoke --workdir /tmp/steering  # tiny
  python launch.py --config experiments/steering/config.py --workdir experiments/steering \
      --config.render_only=True   # report the runs that have finished, run nothing

Program: spec_jax/programs/steering_experiment.py. Trains, from the same pretrained drafter
(`pretrained`, the quickstart's drafter-s) on the same data for the same steps: `distilled`
(the distill program) and the steered drafters of `steered_runs` (train_steering: merged
injection with the drafter trained, the module alone on the frozen drafter, simple injection);
then evaluates every drafter with the evaluate program on in-domain (Shakespeare) and
out-of-domain (Python code) prompts at γ ∈ eval.gammas, greedy and T = 1. Every run lives in
<workdir>/runs/ and is read back when finished, so a killed experiment resumes.
Needs the scratch quickstart drafter (common.SCRATCH_DRAFTER, runs/quickstart_scratch/drafter).
Time on 2 CPU cores: ~1.5 h (training ~4 min per drafter when idle, evaluation ~4-7 min per
drafter and domain); GPU not measured. Smoke: tiny random models, 1 domain, seconds of training.
Reference numbers: experiments/steering/results.md; follow-up runs: experiments/steering/notes.md.
"""

from configs import common
from configs import evaluate as evaluate_config
from configs import train_steering as steering_config


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, steps=100)
  config = common.base("steering_experiment")
  config.config_file = "experiments/steering/config.py" + (f":{arg}" if arg else "")
  config.title = "SD²: steering a pretrained drafter with the verifier's hidden states"
  config.render_only = False
  # Training: DistillSpec's best recipe here (JSD[0.5] on the corpus's own continuations,
  # experiments/distillspec) for the distilled and the steered drafters alike, so steering is
  # the only difference. max_offset 8 covers the largest γ evaluated.
  config.train = steering_config.get_config(
      "smoke" if args.smoke else f"divergence=jsd,source=fixed,steps={args.steps},"
      f"drafter={common.SCRATCH_DRAFTER}")
  config.train.steering.max_offset = 8
  config.train.eval.update(temperatures=(), at_start=False)  # τ comes from the evaluate runs
  config.train.train.update(checkpoint_every=config.train.train.num_steps)
  # name -> steering overrides; each trains from `pretrained` like `distilled`.
  config.steered_runs = dict(
      steered=dict(mode="merged", freeze_drafter=False),
      steered_frozen=dict(mode="merged", freeze_drafter=True),
      steered_simple=dict(mode="simple", freeze_drafter=False),
      steered_lr10=dict(mode="merged", freeze_drafter=False, lr_scale=10.0))
  # Evaluation: one evaluate run per (drafter, domain).
  config.eval = evaluate_config.get_config(
      "smoke" if args.smoke else "gammas=4+8,temperatures=0+1,num_prompts=24,new_tokens=48")
  config.eval.eval.update(batch_sizes=(4,) if not args.smoke else (2,))
  # results.json's `domain`: in (the training corpus) and out (another domain).
  config.domains = {"in": "spec_jax_shakespeare", "out": "spec_jax_pystdlib"}
  config.ablation_domains = ("in",)  # where the steered_runs besides `steered` are evaluated
  config.overhead_batch = 4   # batch size of the steering-overhead timing
  if args.smoke:
    config.train.train.update(num_steps=4, checkpoint_every=4, eval_every=0)
    config.steered_runs = dict(steered=dict(mode="merged", freeze_drafter=False))
    config.domains = {"in": "spec_jax_shakespeare"}
    config.eval.eval.update(gammas=(2,), temperatures=(1.0,), num_prompts=2, new_tokens=8)
  return config
