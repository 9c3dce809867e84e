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


def make_optimizer(train_cfg) -> tuple[optax.GradientTransformation, Any]:
  """(tx, schedule) from a `common.train()` section.

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
