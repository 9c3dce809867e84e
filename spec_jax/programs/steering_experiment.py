"""Program `steering_experiment`: SD² (Berdoz et al. 2026) at small scale: one pretrained
drafter as is, distilled, and steered by the verifier's hidden states.

  python launch.py --config experiments/steering/config.py --workdir experiments/steering

Harness runs (evaluation/experiment.py: a finished run is read back, an interrupted experiment
resumes, `render_only` reports what has finished and runs nothing), in order:
1. `distilled` (program distill) and every entry of `steered_runs` (program train_steering),
   trained from `train.drafter.checkpoint` (the pretrained drafter) with the same data,
   objective and steps, each in <workdir>/runs/train/<name> (a run killed mid-training resumes
   from its checkpoint).
2. The pretrained, distilled and steered drafters evaluated with the evaluate program (chain SD
   at every γ of eval.eval.gammas, every temperature, with the autoregressive baseline measured
   in the same process) on every domain's prompts (the steered_runs other than `steered` on
   `ablation_domains` only), each in <workdir>/runs/eval/<drafter>_<domain>.
3. `overhead`: the steering computation (the module's g → δ at commit) timed at
   `overhead_batch`; results.md sets it against the steered drafter's measured round time.
Writes results.json (rows: drafter, domain, temperature, gamma, block_efficiency, tau_se, ...),
results.md (evaluation/steering_report.py: τ and τ − 1 per drafter with the paper's numbers
beside, the goal checks), overhead.json and accepted_tokens.png (τ − 1 ± standard error).
"""

from __future__ import annotations

import copy
import os
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from spec_jax.evaluation import experiment, steering_report
from spec_jax.models import steering
from spec_jax.programs import train_steering
from spec_jax.training import checkpoints


def train_config(config, overrides):
  """The training config of one drafter: program distill (overrides None: no steering module)
  or train_steering with the `steered_runs` entry's steering overrides."""
  cfg = copy.deepcopy(config.train)
  if overrides is None:
    cfg.program = "distill"
    with cfg.unlocked():
      del cfg["steering"]
  else:
    cfg.steering.update(dict(overrides))
  return cfg


def eval_config(config, name: str, domain: str, checkpoint: str):
  """The evaluate config of one (drafter, domain): config.eval on the domain's dataset, with the
  training run's tokenizer, verifier and drafter section, the drafter read from `checkpoint`."""
  cfg = copy.deepcopy(config.eval)
  cfg.program = "evaluate"
  cfg.data.name = config.domains[domain]
  cfg.tokenizer = config.train.tokenizer
  cfg.verifier = copy.deepcopy(config.train.verifier)
  cfg.drafter = copy.deepcopy(config.train.drafter)
  cfg.drafter.checkpoint = checkpoint
  cfg.title = f"{config.title}: {name}, {domain} domain"
  return cfg


def check(config, workdir: str) -> None:
  """Every training config's errors, before the first run starts."""
  del workdir
  batch_sizes = tuple(config.eval.eval.batch_sizes)
  if len(batch_sizes) != 1:
    raise ValueError(f"eval.eval.batch_sizes={batch_sizes}: the steering report compares the "
                     "drafters at one batch size. Fix: give one, e.g. "
                     "--config.eval.eval.batch_sizes=4, and run the experiment again per size.")
  for overrides in config.steered_runs.values():
    train_steering.check_config(train_config(config, overrides))


def steering_ms(cfg, run_dir: str) -> dict:
  """ms of one commit's steering computation (g from three verifier residuals → δ for every
  drafter layer, jitted, median of 50 calls) of the steered checkpoint `cfg.checkpoint` at
  batch `cfg.batch_size`."""
  del run_dir
  _, params, meta = checkpoints.load_model(cfg.checkpoint)
  s_cfg = checkpoints.steering_from_meta(meta)
  b = int(cfg.batch_size)
  hidden = {l: jnp.ones((b, s_cfg.d_verifier), jnp.float32) for l in s_cfg.verifier_layers}
  fn = jax.jit(lambda p, h: steering.steer_from_hidden(s_cfg, p, h))
  jax.block_until_ready(fn(params["steering"], hidden))
  times = []
  for _ in range(50):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params["steering"], hidden))
    times.append(time.perf_counter() - t0)
  return dict(batch_size=b, steering_ms=round(1000 * float(np.median(times)), 3))


def runs(config, workdir: str) -> Iterator[experiment.Run]:
  """Training, then evaluation, then the overhead timing (see the module docstring)."""
  def train_dir(name):
    return os.path.join(workdir, "runs", "train", name)
  # name -> (checkpoint, what built it: its training run's digest, so a retrained drafter is
  # evaluated and timed again although its path is the same).
  drafters = {"pretrained": (config.train.drafter.checkpoint, {})}
  for name, overrides in [("distilled", None), *config.steered_runs.items()]:
    train = experiment.Run(f"train_{name}", train_config(config, overrides),
                           directory=train_dir(name), tags=dict(trained=name))
    yield train
    drafters[name] = (train_dir(name), {"drafter": experiment.run_digest(train)})
  for name, (checkpoint, built) in drafters.items():
    ablation = name not in ("pretrained", "distilled", "steered")
    for domain in config.domains:
      if ablation and domain not in config.ablation_domains:
        continue
      yield experiment.Run(f"eval_{name}_{domain}", eval_config(config, name, domain, checkpoint),
                           directory=os.path.join(workdir, "runs", "eval", f"{name}_{domain}"),
                           tags=dict(drafter_name=name, domain=domain), ignore=("title",),
                           inputs=built)
  if "steered" in drafters:
    checkpoint, built = drafters["steered"]
    cfg = ml_collections.ConfigDict(dict(program="steering_overhead", checkpoint=checkpoint,
                                         batch_size=int(config.overhead_batch)))
    yield experiment.Run("overhead", cfg, fn=steering_ms, inputs=built)


def run(config, workdir: str) -> list[dict]:
  return experiment.run_experiment(config, workdir, runs=runs, report=steering_report.report,
                                   check=check)
