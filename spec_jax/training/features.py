"""Training a feature drafter (EAGLE, Li et al. 2024; `decoding/drafters/features.py`) by
distillation.

Shapes: B batch, T tokens, D the verifier's width. The teacher's pass gives its final residual
f f32[B, T, D] beside its law p. The drafter's teacher-forced forward reads (f_{t−1}, x_t) at
each position t, exactly what it reads when drafting the first token of a round, and its output
at t is compared with p_t by the distillation objective (`training/distill`). Its own final
residual f̂_t is also regressed onto f_t (smooth L1 on unit-RMS vectors, EAGLE's feature loss,
weighted by `feature_weight`, over every position of the row): later drafts of a round read f̂ in
place of f, so f̂ has to stay in the verifier's feature space.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from spec_jax.decoding.drafters import features as features_lib
from spec_jax.models import decoder, llama


def feature_loss(predicted: jax.Array, target: jax.Array) -> jax.Array:
  """f32[]: smooth L1 (Huber, δ = 1) between unit-RMS predicted and target features [B, T, D],
  summed over D / D and averaged over B, T."""
  diff = decoder.unit_rms(predicted) - decoder.unit_rms(target)
  return jnp.mean(optax.huber_loss(diff, delta=1.0))


def feature_apply(params, inputs, positions, *, features, cfg: llama.LlamaConfig,
                  feature_weight: float):
  """The drafter's teacher-forced forward: logits f32[B, T, V'] (V' the reduced vocabulary if
  any), {"aux_loss": feature_weight × feature_loss}, None."""
  apply = llama.make_apply(cfg, (features_lib.FEATURE_LAYER,), reduced_logits=True)
  logits, hidden, _ = apply(params, inputs, positions, features=features_lib.shift(features))
  aux = feature_weight * feature_loss(hidden[features_lib.FEATURE_LAYER], features)
  return logits, {"aux_loss": aux}, None


def make_student(cfg: llama.LlamaConfig, feature_weight: float) -> tuple[Callable, Callable]:
  """(student_apply, context_fn) for `distill.distill_step` / `eval_step`."""
  if feature_weight < 0:
    raise ValueError(f"distill.feature_weight={feature_weight} must be >= 0 (the weight of the "
                     "feature drafter's feature regression; 0 trains on the laws alone).")
  student = functools.partial(feature_apply, cfg=cfg, feature_weight=float(feature_weight))

  def context_fn(hidden, batch, rng):
    del batch, rng
    return {"features": hidden[features_lib.FEATURE_LAYER]}

  return student, context_fn
