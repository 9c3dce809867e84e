"""AdamW with linear warmup, cosine decay and global-norm clipping (config: `common.train`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def lr_schedule(lr: float, *, num_steps: int, warmup_steps: int, end_lr_frac: float):
  """lr(step) for step = number of updates already applied (0 for the first update).

    step <  warmup:      lr · (step + 1) / warmup         (the first update already moves; a
                                                          schedule starting at 0 wastes a step)
    warmup ≤ step < N:   end + (lr - end) · ½(1 + cos(π · (step - warmup) / (N - warmup)))
    step ≥ N:            end = end_lr_frac · lr

  The returned function takes a traced step (inside the optimizer) or a Python/numpy int (host
  logging, computed with numpy so that logging compiles nothing).
  """
  end = lr * end_lr_frac
  decay_steps = max(num_steps - warmup_steps, 1)

  def schedule(step):
    xp = np if isinstance(step, (int, np.integer, np.ndarray)) else jnp
    step = xp.asarray(step, xp.float32)
    warm = lr * (step + 1.0) / max(warmup_steps, 1)
    frac = xp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
    cosine = end + (lr - end) * 0.5 * (1.0 + xp.cos(xp.pi * frac))
    return xp.where(step < warmup_steps, warm, cosine)

  return schedule


def decay_mask(params: Any) -> Any:
  """True for leaves that get weight decay: matrix weights named 'kernel' (attention, MLP, an
  untied lm_head). Norm scales, biases and the token embedding are not decayed: decaying a
  norm's scale or a bias pulls it toward 0 rather than toward a simpler function, and embedding
  rows of rare tokens would shrink just for being rarely seen."""
  def one(path, leaf):
    del leaf
    name = getattr(path[-1], "key", str(path[-1]))
    return name == "kernel"

  return jax.tree_util.tree_map_with_path(one, params)


# `common.train()`'s fields: (integer?, lowest value, highest value or None, what it means); a
# field a section lacks is skipped. Reals must be finite; "<1" is a bound the value stays under.
_TRAIN_FIELDS = {
    "num_steps": (True, 1, None, ""),
    "batch_size": (True, 1, None, ""),
    "lr": (False, 0, None, "0 keeps the params as they are"),
    "end_lr_frac": (False, 0, 1, "the final learning rate as a fraction of lr"),
    "warmup_steps": (True, 0, None, ""),
    "weight_decay": (False, 0, None, ""),
    "b1": (False, 0, "<1", "Adam's first-moment decay"),
    "b2": (False, 0, "<1", "Adam's second-moment decay"),
    "grad_clip": (False, 0, None, "0 = no clipping"),
    "log_every": (True, 0, None, "0 = never"),
    "eval_every": (True, 0, None, "0 = never"),
    "eval_batches": (True, 0, None, ""),
    "checkpoint_every": (True, 0, None, "0 = at the end only"),
    "keep_checkpoints": (True, 1, None, "the newest ones, to resume from"),
}


def _fits(value, integer: bool, low, high) -> bool:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer) if integer
                                               else (int, float, np.integer, np.floating)):
    return False
  if not np.isfinite(value):
    return False
  above = value >= low
  below = high is None or (value < 1 if high == "<1" else value <= high)
  return bool(above and below)


def check_train(train_cfg, section: str = "train") -> None:
  """Refuses a `common.train()` section with a value no run could use (a negative step count,
  a NaN learning rate, b2 = 1), naming the field, before anything is loaded."""
  for name, (integer, low, high, meaning) in _TRAIN_FIELDS.items():
    if name not in train_cfg or _fits(train_cfg[name], integer, low, high):
      continue
    want = ("an integer" if integer else "a finite number") + f" >= {low}" + (
        "" if high is None else " and < 1" if high == "<1" else f" and <= {high}")
    raise ValueError(f"{section}.{name}={train_cfg[name]!r} must be {want}"
                     + (f" ({meaning})" if meaning else "") + ". Fix: such a value, or no override "
                     "(the config's default).")


def make_optimizer(train_cfg) -> tuple[optax.GradientTransformation, Any]:
  """(tx, schedule) from a `common.train()` section (the programs `check_train` it first).

  Clipping comes first so that AdamW's moments see the clipped gradient; the mask is a function
  of the params so the same tx serves any model.
  """
  schedule = lr_schedule(train_cfg.lr, num_steps=train_cfg.num_steps,
                         warmup_steps=train_cfg.warmup_steps, end_lr_frac=train_cfg.end_lr_frac)
  parts = []
  if train_cfg.grad_clip and train_cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(train_cfg.grad_clip))
  parts.append(optax.adamw(schedule, b1=train_cfg.b1, b2=train_cfg.b2,
                           weight_decay=train_cfg.weight_decay, mask=decay_mask))
  return optax.chain(*parts), schedule


def frozen(tx: optax.GradientTransformation, names: tuple[str, ...]
           ) -> optax.GradientTransformation:
  """tx on every param except the top-level subtrees `names` (e.g. "embed"), which get zero
  updates and no moments; tx's clipping and moments see the trained params alone. EAGLE keeps
  the target's token embedding frozen in its drafter: a few hundred steps of Adam would move
  the rows of the tokens a small pool holds and leave the others where pretraining put them."""
  names = tuple(names)
  if not names:
    return tx

  def labels(params):
    return {k: jax.tree.map(lambda _, k=k: "frozen" if k in names else "train", v)
            for k, v in params.items()}

  return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
