"""List the registered speculative methods: name, SHAPE grammar, the drafter checkpoints each
takes, whether it is greedy only, its options with their defaults, and a one-line summary.

  python launch.py --config configs/methods.py --workdir runs/methods

Writes runs/methods/methods.md (the same table). Time: a few seconds (no model loads).
The README's shorter methods table comes from the same registry; after registering a method,
rewrite it with
  python -m spec_jax.programs.methods --readme
"""

from configs import common


def get_config(arg=None):
  common.parse_arg(arg)  # takes no `:args`: any is refused by name
  return common.base("methods")
