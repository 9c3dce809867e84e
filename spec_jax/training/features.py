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
is matched to p too (`distill.feature_passes`; EAGLE-3's training-time test). Pass j (from 0)
weighs decay^j (`distill.pass_decay`; EAGLE-3 uses 0.8), normalised to weights w_j summing to 1
(`pass_weights`): the feature loss is Σ_j w_j · loss_j, and the law terms, which distill sums
over passes, are passes · Σ_j w_j · objective_j, so decay = 1 (the default) is that plain sum.

A multi-layer drafter (EAGLE-3, `cfg.feature_layers`) reads g = feature_fc(the verifier's
layers), trained with it; f̂ has no fixed target in its space, so as in EAGLE-3 it learns from
the laws alone: `feature_weight` is ignored (logged), and it needs passes >= 2, the only thing
that trains what later drafts read.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

from absl import logging
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


def pass_weights(passes: int, decay: float = 1.0) -> tuple[float, ...]:
  """w_j = decay^j / Σ_i decay^i for the passes j = 0..passes − 1 (summing to 1)."""
  scale = [decay ** j for j in range(passes)]
  return tuple(s / sum(scale) for s in scale)


def feature_apply(params, inputs, positions, *, features, cfg: llama.LlamaConfig,
                  feature_weight: float, passes: int = 1, valid: jax.Array | None = None,
                  decay: float = 1.0, logit_index: jax.Array | None = None):
  """The drafter's teacher-forced forward: logits f32[B, T, V'] (V' the reduced vocabulary if
  any) of the first pass, {"aux_loss": feature_weight × feature_loss (weighted mean over passes),
  "extra_logits": the laws of passes 2..passes, and with decay != 1 "pass_weights": each pass's
  law's multiplier passes · w_j}, None. Pass k + 1 reads the features pass k predicted (one
  position back), as the (k + 1)-th draft of a round does (EAGLE-3's training-time test, with
  every position of the row in the same pass).

  features: the verifier's final residual f32[B, T, D], or for a multi-layer drafter its
  residual at each of cfg.feature_layers {depth: f32[B, T, D]} (no feature loss then).
  logit_index int32[B, K]: every pass's logits at those positions alone ([B, K, V']); the
  features and their loss keep every position."""
  apply = llama.make_apply(cfg, (features_lib.FEATURE_LAYER,), reduced_logits=True)
  multi = bool(cfg.feature_layers)
  feed = features_lib.verifier_features(cfg, params, features) if multi else features
  laws, aux = [], 0.0
  total = sum(decay ** j for j in range(passes))  # = passes at decay 1: the plain mean
  for j in range(passes):
    logits, hidden, _ = apply(params, inputs, positions, features=features_lib.shift(feed),
                              logit_index=logit_index)
    feed = hidden[features_lib.FEATURE_LAYER]
    if not multi:
      aux = aux + feature_weight * feature_loss(feed, features, valid) * decay ** j / total
    laws.append(logits)
  out = {"aux_loss": aux, "extra_logits": laws[1:]}
  if decay != 1.0:
    out["pass_weights"] = tuple(passes * w for w in pass_weights(passes, decay))
  return laws[0], out, None


def make_student(cfg: llama.LlamaConfig, feature_weight: float, passes: int = 1,
                 decay: float = 1.0) -> tuple[Callable, Callable]:
  """(student_apply, context_fn) for `distill.distill_step` / `eval_step`."""
  if not (feature_weight >= 0 and math.isfinite(feature_weight)):  # also NaN
    raise ValueError(f"distill.feature_weight={feature_weight} must be a finite number >= 0 (the weight of the "
                     "feature drafter's feature regression; 0 trains on the laws alone).")
  if passes < 1:
    raise ValueError(f"distill.feature_passes={passes} must be >= 1 (teacher-forced passes; "
                     "pass k + 1 reads the features pass k predicted).")
  if not (decay > 0 and math.isfinite(decay)):
    raise ValueError(f"distill.pass_decay={decay} must be a number > 0 (pass j weighs "
                     "pass_decay**j: 1 = every pass alike, EAGLE-3 uses 0.8).")
  layers = tuple(cfg.feature_layers)
  if layers and passes < 2:
    raise ValueError(f"distill.feature_passes={passes}: a multi-layer feature drafter (verifier "
                     f"depths {list(layers)}) has no feature loss, so only passes on its own "
                     "features train what its later drafts read. Fix: "
                     "--config.distill.feature_passes=3 (EAGLE-3's training-time test).")
  if layers and feature_weight:
    logging.warning("distill.feature_weight=%s is ignored: a multi-layer feature drafter trains "
                    "on the laws alone (EAGLE-3).", feature_weight)
  student = functools.partial(feature_apply, cfg=cfg, feature_weight=float(feature_weight),
                              passes=int(passes), decay=float(decay))

  def context_fn(hidden, batch, rng):
    del rng
    # Positions up to a row's last weighted target: the padding after it is left out of the
    # feature regression (chat rows, rows cut at a stop token).
    t = jnp.arange(batch["weights"].shape[1])
    last = jnp.max(jnp.where(batch["weights"] > 0, t[None], -1), axis=1)
    features = ({d: hidden[d] for d in layers} if layers
                else hidden[features_lib.FEATURE_LAYER])
    return {"features": features, "valid": t[None] <= last[:, None]}

  return student, context_fn
