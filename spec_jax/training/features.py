"""Training a feature drafter (EAGLE, Li et al. 2024; `decoding/drafters/features.py`) by
distillation.

Shapes: B batch, T tokens, D the verifier's width. The teacher's pass gives its final residual
f f32[B, T, D] beside its law p. The drafter's teacher-forced forward reads (f_{t−1}, x_t) at
each position t, exactly what it reads when drafting the first token of a round, and its output
at t is compared with p_t by the distillation objective (`training/distill`). Its own final
residual f̂_t is also regressed onto f_t (smooth L1 on unit-RMS vectors, EAGLE's feature loss,
weighted by `feature_weight`, over every position of the row): later drafts of a round read f̂ in
place of f, so f̂ has to stay in the verifier's feature space. With `passes` > 1 the drafter
also trains on its own predictions: pass k + 1 reads the features pass k predicted, and its law
is matched to p too (`distill.feature_passes`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from spec_jax.decoding.drafters import features as features_lib
from spec_jax.models import decoder, llama


def feature_loss(predicted: jax.Array, target: jax.Array,
                 valid: jax.Array | None = None) -> jax.Array:
  """f32[]: smooth L1 (Huber, δ = 1) between unit-RMS predicted and target features [B, T, D],
  summed over D / D and averaged over B, T, or over the positions where `valid` (bool[B, T]) is
  True: a chat row's padding after its response is not text the drafter will read."""
  diff = decoder.unit_rms(predicted) - decoder.unit_rms(target)
  huber = optax.huber_loss(diff, delta=1.0)
  if valid is None:
    return jnp.mean(huber)
  weight = valid.astype(huber.dtype)[..., None]
  return jnp.sum(huber * weight) / jnp.maximum(jnp.sum(weight) * huber.shape[-1], 1.0)


def feature_apply(params, inputs, positions, *, features, cfg: llama.LlamaConfig,
                  feature_weight: float, passes: int = 1, valid: jax.Array | None = None):
  """The drafter's teacher-forced forward: logits f32[B, T, V'] (V' the reduced vocabulary if
  any) of the first pass, {"aux_loss": feature_weight × feature_loss (mean over passes),
  "extra_logits": the laws of passes 2..passes}, None. Pass k + 1 reads the features pass k
  predicted (one position back), as the (k + 1)-th draft of a round does (EAGLE-3's
  training-time test, with every position of the row in the same pass)."""
  apply = llama.make_apply(cfg, (features_lib.FEATURE_LAYER,), reduced_logits=True)
  feed, laws, aux = features, [], 0.0
  for _ in range(passes):
    logits, hidden, _ = apply(params, inputs, positions, features=features_lib.shift(feed))
    feed = hidden[features_lib.FEATURE_LAYER]
    aux = aux + feature_weight * feature_loss(feed, features, valid) / passes
    laws.append(logits)
  return laws[0], {"aux_loss": aux, "extra_logits": laws[1:]}, None


def make_student(cfg: llama.LlamaConfig, feature_weight: float,
                 passes: int = 1) -> tuple[Callable, Callable]:
  """(student_apply, context_fn) for `distill.distill_step` / `eval_step`."""
  if feature_weight < 0:
    raise ValueError(f"distill.feature_weight={feature_weight} must be >= 0 (the weight of the "
                     "feature drafter's feature regression; 0 trains on the laws alone).")
  if passes < 1:
    raise ValueError(f"distill.feature_passes={passes} must be >= 1 (teacher-forced passes; "
                     "pass k + 1 reads the features pass k predicted).")
  student = functools.partial(feature_apply, cfg=cfg, feature_weight=float(feature_weight),
                              passes=int(passes))

  def context_fn(hidden, batch, rng):
    del rng
    # Positions up to a row's last weighted target: the padding after it is left out of the
    # feature regression (chat rows, rows cut at a stop token).
    t = jnp.arange(batch["weights"].shape[1])
    last = jnp.max(jnp.where(batch["weights"] > 0, t[None], -1), axis=1)
    return {"features": hidden[features_lib.FEATURE_LAYER], "valid": t[None] <= last[:, None]}

  return student, context_fn
