"""Program `train_steering`: SD² (Berdoz et al. 2026), train a steering module that feeds the
verifier's hidden states into a pretrained drafter every round.

`run(config, workdir)` reads distill's sections (verifier, drafter, data, distill, train, eval,
mesh; configs/train_steering.py) plus `steering`:
  verifier_layers  the three verifier depths read (() = low/middle/high, SmolLM2: 3, 15, 27)
  mode             merged (δ into the drafter's SwiGLU up projection) | simple (residual add)
  max_offset       γ of the staleness simulation: o ~ U{1..max_offset} per batch
  freeze_drafter   True: train the module alone (the ablation); False: module and drafter
  lr_scale         the module's learning rate is train.lr × lr_scale
It is distillation (`programs/distill.py`) with a steered student: same data sources (fixed or
verifier-generated; on-policy sources would need steered generation and are refused), same
objectives, checkpoints, resume and metrics; the held-out τ decodes with the steered drafter.
The checkpoint holds params {"drafter", "steering"} and the module's config in its meta, so
`evaluate --config.drafter.checkpoint=WORKDIR` decodes with the steered drafter.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from configs import common
from spec_jax.decoding.drafters import steered
from spec_jax.models import steering
from spec_jax.programs import distill as distill_program
from spec_jax.training import checkpoints
from spec_jax.training import steering as steering_train

ON_POLICY = ("onpolicy", "mix")


def check_config(config) -> None:
  """Errors naming the field, before anything loads."""
  sc = config.steering
  if config.data.source in ON_POLICY:
    raise ValueError(
        f"data.source={config.data.source!r}: train_steering trains on fixed or verifier-"
        "generated data (on-policy responses would need the steered drafter to generate with "
        "the verifier in the loop). Fix: --config.data.source=verifier (the SD² recipe) or "
        "fixed.")
  if sc.mode not in steering.MODES:
    raise ValueError(f"steering.mode={sc.mode!r} is not known; choose one of "
                     f"{list(steering.MODES)}.")
  if not float(sc.get("lr_scale", 1.0)) > 0:  # also NaN
    raise ValueError(f"steering.lr_scale={sc.lr_scale} must be > 0 (the steering module's "
                     "learning rate is train.lr × lr_scale).")
  layers = tuple(sc.verifier_layers)
  if any(isinstance(v, bool) or not isinstance(v, int) for v in layers):
    raise ValueError(f"steering.verifier_layers={layers!r} must be verifier layer indices "
                     "(integers), or () for low/middle/high.")
  if int(sc.max_offset) < 1:
    raise ValueError(f"steering.max_offset={sc.max_offset} must be >= 1: the draft length γ "
                     "whose staleness training simulates.")


def steering_config(config, v_cfg, d_cfg) -> steering.SteeringConfig:
  layers = tuple(config.steering.verifier_layers) or steering.default_layers(v_cfg.n_layers)
  return steering.make_config(v_cfg, d_cfg, layers, config.steering.mode)


def steered_student(config, v_cfg, d_cfg, d_params) -> distill_program.Student:
  """The drafter (pretrained from drafter.checkpoint, or a steered checkpoint to continue) with
  a fresh steering module: W_hml = [I I I], W_g = 0, so step 0 drafts exactly as pretrained."""
  sc = config.steering
  s_cfg = steering_config(config, v_cfg, d_cfg)
  params = None
  if d_params is not None:
    if "steering" in d_params:  # continue a steered checkpoint
      steering.check_params(s_cfg, d_params["steering"],
                            f"drafter.checkpoint={config.drafter.checkpoint!r}")
      params = d_params
    else:
      params = {"drafter": d_params,
                "steering": jax.tree.map(np.asarray, steering.init_params(s_cfg))}
  apply, context_fn = steering_train.make_student(s_cfg, d_cfg, int(sc.max_offset))
  frozen = bool(sc.freeze_drafter)
  lr_scale = float(sc.get("lr_scale", 1.0))
  return distill_program.Student(
      cfg=d_cfg, init_fn=steering_train.init_fn(s_cfg, d_cfg), params=params, apply=apply,
      drafter=lambda shape: steered.SteeredDrafter(d_cfg, s_cfg, shape), context_fn=context_fn,
      teacher_layers=s_cfg.verifier_layers,
      wrap_tx=lambda tx: steering_train.optimizer(tx, frozen=frozen, lr_scale=lr_scale),
      meta={"steering": dataclasses.asdict(s_cfg),
            "steering_training": dict(max_offset=int(sc.max_offset), freeze_drafter=frozen,
                                      lr_scale=lr_scale)},
      meta_section="steering")


def check_drafter(path: str) -> None:
  """A pretrained drafter SD² can steer: a plain LM drafter, not a feature drafter (which reads
  the verifier's features where steering adds its deltas). Reads the checkpoint's meta only; a
  path that is not a checkpoint is left to the loader's own errors."""
  try:
    cfg = checkpoints.model_config_from_meta(checkpoints.read_meta(path), path)
  except Exception:  # noqa: BLE001  (not a readable checkpoint: the loader names it)
    return
  if getattr(cfg, "feature_width", 0):
    raise ValueError(
        f"drafter.checkpoint={path!r} is a feature drafter (it reads the verifier's features); "
        "SD² steers a plain LM drafter. Fix: --config.drafter.checkpoint="
        f"{common.SCRATCH_DRAFTER} (configs/quickstart.py:recipe=scratch,vocab=0) or another "
        "train_lm/distill drafter without features.")


def run(config, workdir: str, *, step_hook=None) -> dict:
  """Train `config.train.num_steps` steps in `workdir` (resuming); returns distill.run's dict."""
  check_config(config)
  if config.drafter.checkpoint:
    check_drafter(config.drafter.checkpoint)
  return distill_program.run(config, workdir, step_hook=step_hook, student_fn=steered_student)
