"""The main job: SmolLM2 generation, then a drafter trained on Shakespeare and saved.

  python launch.py --config configs/quickstart.py --workdir runs/quickstart
  python launch.py --config configs/quickstart.py:smoke --workdir /tmp/qs   # tiny, for tests

Time on 2 CPU cores: ~1 min for generation (GGUF load + compile), ~5 min of drafter training
(300 steps of drafter-s, 8 x 128 tokens). A second run reuses the trained drafter.
Output: runs/quickstart/generate/generations.jsonl, runs/quickstart/drafter/ (checkpoints,
metrics.jsonl, TensorBoard events), runs/quickstart/quickstart.json.
"""

from configs import common
from configs import generate as generate_config
from configs import train_lm as train_lm_config


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, drafter_steps=300)
  config = common.base("quickstart")
  sub = "smoke" if args.smoke else None
  config.generate = generate_config.get_config(sub or "new_tokens=40")
  config.drafter = train_lm_config.get_config(
      sub or f"size=drafter-s,steps={args.drafter_steps},batch=8,seq_len=128")
  if not args.smoke:
    config.drafter.train.update(eval_every=100, checkpoint_every=100, log_every=10)
  return config
