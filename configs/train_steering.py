"""SD²: steer a pretrained drafter with the SmolLM2 verifier's hidden states (program:
train_steering).

  python launch.py --config configs/train_steering.py --workdir runs/steered
  python launch.py --config configs/train_steering.py:frozen --workdir runs/steered_frozen
  python launch.py --config configs/train_steering.py:smoke --workdir /tmp/steer   # tiny, tests
Arguments (`:key=value,...`): divergence (fkl, rkl, jsd, tvd), source (verifier, fixed), steps,
batch, drafter (the pretrained drafter: a train_lm/distill workdir of a plain LM drafter; default
the scratch quickstart drafter, common.SCRATCH_DRAFTER), mode (merged, simple),
offset (max_offset: the γ whose staleness is simulated), frozen (train the module alone), data,
lr, smoke. Any field can be overridden: --config.steering.verifier_layers="(3,15,27)".
Re-running the same command resumes from the newest checkpoint in the workdir. Evaluate with
  python launch.py --config configs/evaluate.py --workdir runs/eval_steered \
      --config.drafter.checkpoint=runs/steered

Expected time on 2 CPU cores: as configs/distill.py (the steering module adds one
[576 × L·d_ff] matmul per token; the verifier's features come from the teacher pass it already
runs), plus verifier-response generation for source=verifier (cached in data.cache_dir).
One H100: 2000 steps of a 4-block verifier-initialised drafter in 1.2 min with compilation
(experiments/gpu/results.md).
Reference: experiments/steering/results.md (pretrained vs distilled vs steered).

Smoke (CPU tests, seconds): test-tiny verifier and drafter, byte tokenizer, 6 steps of FKL on
8 × (8 + 8) tokens of the dataset's own continuations.
"""

from configs import common
from configs import distill as distill_config


def get_config(arg: str | None = None):
  arg_string = arg
  # SD²'s recipe: FKL on verifier-generated responses (T = 1), drafter trained with the module.
  arg = common.parse_arg(arg, divergence="fkl", source="verifier", steps=40, batch=8,
                         drafter=common.SCRATCH_DRAFTER, mode="merged", offset=4,
                         frozen=False, data="spec_jax_shakespeare", lr=1e-3, lr_scale=1.0,
                         smoke=False)
  config = distill_config.get_config(
      "smoke" + "".join(f",{k}={arg[k]}" for k in ("divergence", "source")
                        if k in common.given(arg_string)) if arg.smoke else
      f"divergence={arg.divergence},source={arg.source},steps={arg.steps},batch={arg.batch},"
      f"drafter={arg.drafter},data={arg.data},lr={arg.lr}")
  config.program = "train_steering"
  config.steering = dict(
      verifier_layers=(),       # () = low/middle/high depths (SmolLM2-135M: 3, 15, 27)
      mode=arg.mode,            # merged | simple
      max_offset=arg.offset,    # staleness o ~ U{1..max_offset}: the γ it is trained for
      freeze_drafter=arg.frozen,
      lr_scale=arg.lr_scale)    # the module's lr = train.lr × lr_scale (W_g starts at zero)
  if arg.smoke and "source" not in common.given(arg_string):
    config.data.source = "fixed"
  return config
