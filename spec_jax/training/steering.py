"""Training an SD² steering module (and optionally its drafter) by distillation with simulated
staleness (Berdoz et al. 2026, §3; `models/steering.py` has the module).

Shapes: B batch, T tokens, D the verifier's width. A batch is distill's
{"inputs", "targets", "weights"} (`training/distill_data`): weights[b, t] > 0 where the token
after position t is a response token.

At decoding time the drafter drafts γ tokens from one steering vector computed at the last
verified position, so the drafter at position t is steered by the verifier's features at
t − o for some o ∈ {1..γ} (o = 1 for the first draft of a round, γ for the last). Training
simulates that: one offset o ~ U{1..γ} per batch, δ_t = δ(g_{max(t − o, 0)}), and δ_t = 0 where
the next token is not a response token (the prompt is drafted unsteered at decoding time too: its
prefill carries no steering). The loss is any distillation objective (`training/distill`),
differentiated w.r.t. the steering module and the drafter (or the module alone, `frozen`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from spec_jax.models import llama, steering

# At evaluation the freshest features steer every position (o = 1, the round's first draft).
EVAL_OFFSET = 1


def stale_positions(num_tokens: int, offset) -> jax.Array:
  """int32[T]: the position whose features steer position t, max(t − offset, 0)."""
  return jnp.maximum(jnp.arange(num_tokens, dtype=jnp.int32) - offset, 0)


def steered_apply(params, inputs, positions, *, hidden: dict, weights, offset,
                  cfg: steering.SteeringConfig, drafter_apply: Callable,
                  logit_index: jax.Array | None = None):
  """The steered drafter's teacher-forced forward. params {"drafter", "steering"}; hidden
  {layer: f32[B, T, D]} the verifier's residuals over the same tokens; weights f32[B, T];
  offset int32[] → (logits f32[B, T, V], hidden, None) like any forward (logits [B, K, V] at
  logit_index int32[B, K] when given)."""
  g = steering.guidance(params["steering"], [hidden[l] for l in cfg.verifier_layers])
  g = g[:, stale_positions(inputs.shape[1], offset)]                   # [B, T, D]
  on = (weights > 0).astype(jnp.float32)[None, :, :, None]              # [1, B, T, 1]
  steer = {k: v * on for k, v in steering.deltas(cfg, params["steering"], g).items()}
  return drafter_apply(params["drafter"], inputs, positions, steer=steer,
                       logit_index=logit_index)


def make_student(cfg: steering.SteeringConfig, drafter_cfg: llama.LlamaConfig,
                 max_offset: int) -> tuple[Callable, Callable]:
  """(student_apply, context_fn) for `distill.distill_step` / `eval_step`: the offset is drawn
  from U{1..max_offset} per batch in training and fixed at EVAL_OFFSET in evaluation."""
  if max_offset < 1:
    raise ValueError(f"steering.max_offset={max_offset} must be >= 1 (the draft length γ the "
                     "module is trained for).")
  # A reduced-vocabulary drafter trains on its own rows (distill restricts the teacher to them).
  student = functools.partial(steered_apply, cfg=cfg, drafter_apply=llama.make_apply(
      drafter_cfg, reduced_logits=True))

  def context_fn(hidden, batch, rng):
    if rng is None:
      offset = jnp.int32(EVAL_OFFSET)
    else:
      offset = jax.random.randint(rng, (), 1, max_offset + 1, dtype=jnp.int32)
    return {"hidden": hidden, "weights": batch["weights"], "offset": offset}

  return student, context_fn


def init_fn(cfg: steering.SteeringConfig, drafter_cfg: llama.LlamaConfig) -> Callable:
  """rng → {"drafter": random drafter params, "steering": the no-op module}."""
  def init(rng):
    return {"drafter": llama.init_params(drafter_cfg, rng), "steering": steering.init_params(cfg)}
  return init


def optimizer(tx: optax.GradientTransformation, *, frozen: bool = False,
              lr_scale: float = 1.0) -> optax.GradientTransformation:
  """tx for the drafter (zero updates and no moments when `frozen`) and tx with its updates
  scaled by `lr_scale` for the steering module: W_g starts at zero and has to grow within the
  few hundred steps a CPU run affords, while the pretrained drafter needs only small moves."""
  if lr_scale <= 0:
    raise ValueError(f"steering.lr_scale={lr_scale} must be > 0.")
  module = tx if lr_scale == 1.0 else optax.chain(tx, optax.scale(lr_scale))
  if not frozen and lr_scale == 1.0:
    return tx
  return optax.multi_transform(
      {"drafter": optax.set_to_zero() if frozen else tx, "steering": module},
      {"drafter": "drafter", "steering": "steering"})
