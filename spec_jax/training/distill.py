"""Distillation step: train the drafter (student) to match the frozen verifier (teacher).

Shapes: B batch, T tokens, V vocabulary (shared by both models). A batch is
{"inputs": int32[B,T], "targets": int32[B,T], "weights": float32[B,T]} where the sequence is a
prompt followed by a response and `weights` marks the response positions
(`spec_jax.training.distill_data`): the loss, like DistillSpec's, is averaged over response tokens.

Only the student is differentiated (`jax.value_and_grad` w.r.t. the student's params alone); the
teacher's params are a separate, non-donated argument of the jitted step, never part of the
TrainState, so they are never updated, never held twice and never saved with the student.

Objectives (config.distill.divergence): the divergences of `divergences.DIVERGENCES` between the
teacher's and the student's laws, or "xent", plain next-token cross-entropy on the batch's
tokens: the non-distilled baseline, trained through the same loop on the same data.

What is trained is a `Student`: its forward, what it reads from the teacher's pass and the
drafter it becomes for held-out decoding (`plain_student`: a Llama-family drafter trained whole).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spec_jax import parallel
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import features, lm
from spec_jax.models import draft_init, llama
from spec_jax.training import divergences, losses, optim, train
from spec_jax.training import features as features_train

XENT = "xent"
OBJECTIVES = (*divergences.DIVERGENCES, XENT)
TEACHER_HIDDEN = "teacher_hidden"  # a batch's teacher pass, {layer: [B,T,D]} (TeacherCache)
LOSS_INDEX = "loss_index"  # int32[B,K]: the positions whose targets carry weight (`loss_index`)


@dataclasses.dataclass(frozen=True)
class Objective:
  """What the student minimises. Static (hashable): it selects code, not values.

  divergence: a name in OBJECTIVES. beta: JSD[β]'s weight on the teacher (DistillSpec
  convention, see `divergences`). sampling: the temperature/top-k/top-p transform both laws get
  (temperature > 0: the greedy law has no gradient).
  """
  divergence: str = "fkl"
  beta: float = 0.5
  sampling: sampling_lib.Sampling = sampling_lib.Sampling(temperature=1.0)

  def __post_init__(self):
    if self.divergence not in OBJECTIVES:
      raise ValueError(f"distill.divergence={self.divergence!r} is not known; choose one of "
                       f"{list(OBJECTIVES)} ('{XENT}' = cross-entropy on the data, no teacher).")
    name = "tvd" if self.divergence == XENT else self.divergence  # xent still reports α
    divergences.check(name, self.beta, self.sampling)

  @classmethod
  def from_config(cls, cfg) -> "Objective":
    """From a config.distill section: divergence, beta, temperature, top_k, top_p."""
    return cls(divergence=str(cfg.divergence), beta=float(cfg.beta),
               sampling=sampling_lib.Sampling(float(cfg.temperature), int(cfg.top_k),
                                              float(cfg.top_p)))

  @property
  def metric_names(self) -> tuple[str, ...]:
    """Divergences that are finite for this sampling (KL is not, under truncation)."""
    s = self.sampling
    truncated = bool(s.top_k) or s.top_p < 1.0
    return tuple(n for n in divergences.DIVERGENCES if not (truncated and n in ("fkl", "rkl")))


def check_vocab(verifier_cfg: llama.LlamaConfig, drafter_cfg: llama.LlamaConfig,
                config=None) -> None:
  """ValueError naming verifier.checkpoint and drafter.checkpoint when the vocabularies differ:
  the divergence compares the two laws token id by token id (docs/design.md §6)."""
  if verifier_cfg.vocab_size == drafter_cfg.vocab_size:
    return
  names = ("", "")
  if config is not None:
    names = tuple(f" ({k}.checkpoint={config[k].checkpoint!r}, {k}.size={config[k].size!r})"
                  for k in ("verifier", "drafter"))
  raise ValueError(
      f"Drafter vocab_size={drafter_cfg.vocab_size}{names[1]} differs from the verifier's "
      f"vocab_size={verifier_cfg.vocab_size}{names[0]}. Distillation compares the two laws "
      "token by token: set drafter.checkpoint to a model trained with the verifier's tokenizer "
      "(config.tokenizer), or drafter.checkpoint='' to start from scratch with it.")


@dataclasses.dataclass(frozen=True)
class Student:
  """What a distillation run trains and how it drafts: distill's plain drafter (`plain_student`)
  or an SD²-steered one (`programs/train_steering.py`).

  cfg             the drafter's model config (checked on resume, saved in the meta)
  init_fn         rng -> params (from scratch)
  params          the starting params on the host (a loaded model), or None: init_fn
  apply           the teacher-forced forward the distill steps differentiate
  context_fn      None, or what `apply` reads from the teacher's pass (`distill_step`)
  teacher_layers  the verifier's residual depths context_fn needs
  drafter         TreeSpec -> a `protocols.Drafter` for the held-out τ
  wrap_tx         optimizer -> optimizer (e.g. freezing part of the params)
  meta            extra checkpoint metadata
  meta_section    the config section `meta` records (e.g. "steering"): resuming a checkpoint
                  whose meta says otherwise is refused with an error naming it; "": no check
  """
  cfg: llama.LlamaConfig
  init_fn: Callable
  params: Any
  apply: Callable
  drafter: Callable
  context_fn: Callable | None = None
  teacher_layers: tuple[int, ...] = ()
  wrap_tx: Callable = lambda tx: tx
  meta: dict = dataclasses.field(default_factory=dict)
  meta_section: str = ""


def plain_student(config, v_cfg, d_cfg, d_params) -> Student:
  """A Llama-family drafter trained whole (DistillSpec). A steered checkpoint (train_steering)
  contributes its drafter; its steering module is left out. A feature drafter (EAGLE,
  `draft_init.feature_drafter`) reads the teacher's final residual and also learns to predict
  it (`training/features.py`, weight distill.feature_weight), or reads several of its layers
  (EAGLE-3, size '...:features=2+15+27'); distill.feature_passes and distill.pass_decay set
  its training on its own predicted features."""
  if d_params is not None and "steering" in d_params:
    d_params = d_params["drafter"]
  asked = draft_init.parse_size(config.drafter.size, "drafter.size").feature_layers
  if asked and tuple(getattr(d_cfg, "feature_layers", ())) != asked:
    # A checkpoint's own config wins over size: never train another drafter than the one asked.
    raise ValueError(f"drafter.size={config.drafter.size!r} asks for a feature drafter reading "
                     f"verifier depths {list(asked)}, but drafter.checkpoint="
                     f"{config.drafter.checkpoint!r} gives one reading "
                     f"{list(getattr(d_cfg, 'feature_layers', ())) or 'the final residual'}. "
                     "Fix: drafter.size naming the checkpoint's own depths, or the verifier's "
                     "checkpoint to build from.")
  freeze = _frozen_names(config, d_cfg)
  wrap_tx = functools.partial(optim.frozen, names=freeze)
  # Frozen params change the optimizer state's structure: a run resumed with another freeze is
  # refused with the field (`checkpoints.check_saved_settings`), not in the restore.
  saved = dict(meta={"distill_freeze": {"freeze": "+".join(freeze)}}, meta_section="distill")
  if d_cfg.feature_width:
    draft_init.check_feature_width(v_cfg, d_cfg, "drafter.checkpoint")
    apply, context_fn = features_train.make_student(
        d_cfg, float(config.distill.get("feature_weight", 1.0)),
        int(config.distill.get("feature_passes", 1)),
        float(config.distill.get("pass_decay", 1.0)))
    drafter = features.FeatureDrafter(d_cfg)
    return Student(cfg=d_cfg, init_fn=functools.partial(llama.init_params, d_cfg),
                   params=d_params, apply=apply, context_fn=context_fn,
                   teacher_layers=drafter.verifier_layers, wrap_tx=wrap_tx,
                   drafter=functools.partial(features.FeatureDrafter, d_cfg), **saved)
  # A reduced vocabulary trains on its own rows against the teacher's law restricted to them.
  return Student(cfg=d_cfg, init_fn=functools.partial(llama.init_params, d_cfg), params=d_params,
                 apply=llama.make_apply(d_cfg, reduced_logits=True), wrap_tx=wrap_tx,
                 drafter=functools.partial(lm.LMDrafter, d_cfg), **saved)


def _frozen_names(config, d_cfg) -> tuple[str, ...]:
  """config.distill.freeze as top-level param names of the drafter; an unknown name is refused
  before anything loads."""
  value = config.distill.get("freeze", ())
  names = tuple(value.split("+")) if isinstance(value, str) else tuple(value)
  names = tuple(n for n in names if n)
  have = sorted(llama.param_shapes(d_cfg))
  bad = [n for n in names if n not in have]
  if bad:
    raise ValueError(f"distill.freeze={value!r}: {bad} not among the drafter's top-level "
                     f"params {have}. Fix: name some of those (e.g. 'embed'), or '' to train "
                     "every param.")
  return names


def _positions(tokens_BxT: jax.Array) -> jax.Array:
  # Distillation rows are one prompt + response each, starting at position 0.
  return jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1], dtype=jnp.int32), tokens_BxT.shape)


def loss_index(batch: Mapping[str, np.ndarray], window: int) -> dict:
  """The batch with LOSS_INDEX int32[B, K], K = window: each row's `window` consecutive
  positions from its first weighted target (moved left to stay in the row), so the step
  computes both laws there alone (`distill_step`). A row of a distillation batch weighs at most
  its response, data.response_tokens targets in a row: at prompt ≤ 128 and response ≤ 128
  tokens that halves the output layers and the divergence, most of a small drafter's step.
  Unchanged when window >= T. A weighted target outside its row's window raises (the loss
  would silently lose it)."""
  w = np.asarray(batch["weights"])
  t = w.shape[1]
  if window >= t:
    return dict(batch)
  start = np.minimum(np.argmax(w > 0, axis=1), t - window)
  index = start[:, None] + np.arange(window)[None]
  inside = np.zeros(w.shape, bool)
  np.put_along_axis(inside, index, True, axis=1)
  if np.any(w[~inside] != 0):
    row = int(np.nonzero(np.any((w != 0) & ~inside, axis=1))[0][0])
    raise ValueError(
        f"Row {row} of a distillation batch has weighted targets over more than {window} "
        f"positions (data.response_tokens={window}): its weights span "
        f"{np.flatnonzero(w[row]).min()}..{np.flatnonzero(w[row]).max()}. A data source must "
        "weigh at most its response tokens.")
  return {**batch, LOSS_INDEX: index.astype(np.int32)}


def _windowed(batch: Mapping[str, jax.Array], index: jax.Array) -> dict:
  """The batch's weights and targets at `index` [B,K] (its inputs keep every position)."""
  take = functools.partial(jnp.take_along_axis, indices=index, axis=1)
  return {**batch, "weights": take(batch["weights"]), "targets": take(batch["targets"])}


def _token_metrics(teacher_logits, student_logits, batch, objective: Objective) -> dict:
  """Held-out means over the response tokens: every finite divergence, α = Σ min(p, q) (the
  acceptance rate of speculative sampling at objective.sampling), top-1 agreement (argmax p =
  argmax q: the acceptance test of greedy decoding) and the student's cross-entropy. For a
  reduced-vocabulary student p is the teacher's law cut to its tokens and renormalised, and the
  means run over positions whose next token is among them (`draft_init.restrict`, `map_batch`):
  α then overstates decoding's, up to a factor 1 / p(its tokens); evaluate measures that one."""
  w = batch["weights"]
  all_d = divergences.all_per_token(teacher_logits, student_logits, sampling=objective.sampling,
                                    beta=objective.beta)
  out = {n: divergences.masked_mean(all_d[n], w) for n in objective.metric_names}
  out["alpha"] = divergences.masked_mean(all_d["alpha"], w)
  agree = jnp.argmax(teacher_logits, -1) == jnp.argmax(student_logits, -1)
  out["top1_agreement"] = divergences.masked_mean(agree.astype(jnp.float32), w)
  out["xent"] = losses.cross_entropy(student_logits, batch["targets"], w)[0]
  return out


def distill_loss(student_params, teacher_log_p: jax.Array, batch: Mapping[str, jax.Array], *,
                 student_apply: Callable, objective: Objective) -> tuple[jax.Array, dict]:
  """(loss f32[], {"loss", "alpha"}): the objective averaged over the response tokens.

  teacher_log_p f32[B,T,V] is the teacher's log-law (`divergences.log_law`), computed once
  outside the differentiated function. A student whose forward returns {"aux_loss": f32[],
  "extra_logits": [f32[B,T,V], ...]} in place of its hidden states adds that term and the
  objective on each extra law (their sum reported as aux_loss; "loss" stays the first law's).
  With "pass_weights" (a multiplier per law, first law first: `features.feature_apply` at
  distill.pass_decay != 1) each law's objective is weighted by it, the first law's too (the
  first's unweighted value stays "loss"; aux_loss holds the others' weighted terms).
  Only α rides along as a metric: on 2 CPU cores every
  extra pass over the [B, T, 49k] logits costs ~0.1-0.3 s, as much as a drafter layer; the full
  set of metrics is computed on held-out data (`eval_step`)."""
  logits, aux, _ = student_apply(student_params, batch["inputs"], _positions(batch["inputs"]))
  w = batch["weights"]
  log_q = divergences.log_law(logits, objective.sampling)
  if objective.divergence == XENT:
    loss = losses.cross_entropy(logits, batch["targets"], w)[0]
  else:
    loss = divergences.masked_mean(divergences.DIVERGENCES[objective.divergence](
        teacher_log_p, log_q, objective.beta), w)
  alpha = divergences.masked_mean(
      divergences.acceptance_rate(teacher_log_p, jax.lax.stop_gradient(log_q)), w)
  metrics = {"loss": loss, "alpha": alpha}
  if isinstance(aux, dict):
    # A student's own extra terms (a feature drafter, training/features): a loss, and further
    # teacher-forced laws of the same tokens to match with the same objective.
    weights = aux.get("pass_weights")
    extra = aux.get("aux_loss", 0.0)
    for j, more in enumerate(aux.get("extra_logits", ()), 1):
      term = divergences.masked_mean(divergences.DIVERGENCES[objective.divergence](
          teacher_log_p, divergences.log_law(more, objective.sampling), objective.beta), w)
      extra = extra + (term if weights is None else weights[j] * term)
    if "aux_loss" in aux or aux.get("extra_logits"):
      loss = (loss if weights is None else weights[0] * loss) + extra
      metrics["aux_loss"] = extra
  return loss, metrics


def _student_with_context(student_apply: Callable, context_fn: Callable | None, teacher_hidden,
                          batch, rng) -> Callable:
  """The student's forward, given what it reads from the teacher's pass (SD² steering:
  `training/steering.py`) as keywords: context_fn(teacher_hidden, batch, rng) -> kwargs of
  student_apply. rng is None at evaluation (context_fn then picks its deterministic setting)."""
  if context_fn is None:
    return student_apply
  return functools.partial(student_apply,
                           **context_fn(jax.lax.stop_gradient(teacher_hidden), batch, rng))


def distill_step(state: train.TrainState, batch: Mapping[str, jax.Array], rng: jax.Array,
                 teacher_params, *, student_apply: Callable, teacher_apply: Callable,
                 tx: optax.GradientTransformation, objective: Objective,
                 context_fn: Callable | None = None, teacher_head: Callable | None = None
                 ) -> tuple[train.TrainState, dict[str, jax.Array]]:
  """One optimizer update of the student. Pure: jit it once (`jit_distill_step`).

  The teacher runs forward only, under stop_gradient (belt and braces: the gradient is taken
  w.r.t. the student's params alone anyway). A batch holding TEACHER_HIDDEN (its teacher pass,
  from a TeacherCache) runs only `teacher_head` on it (`draft_init.teacher_parts`). rng has the
  step folded in, like `train_step`; only a `context_fn` uses it (the objective is
  deterministic).
  A batch with LOSS_INDEX (`loss_index`) computes both laws and the objective at those
  positions alone (the same loss when every weighted target is among them); the student's
  context (`context_fn`) still reads the whole batch.
  Metrics (f32[]): loss, alpha (Σ min(p, q) on the batch's response tokens), weight_sum,
  grad_norm (before clipping), param_norm (after the update).
  """
  rng = jax.random.fold_in(rng, state.step)
  index = batch.get(LOSS_INDEX)
  at = {} if index is None else {"logit_index": index}
  if TEACHER_HIDDEN in batch:
    teacher_logits, teacher_hidden = teacher_head(teacher_params, batch[TEACHER_HIDDEN], **at)
  else:
    teacher_logits, teacher_hidden, _ = teacher_apply(teacher_params, batch["inputs"],
                                                      _positions(batch["inputs"]), **at)
  log_p = jax.lax.stop_gradient(divergences.log_law(teacher_logits, objective.sampling))
  student = _student_with_context(student_apply, context_fn, teacher_hidden, batch, rng)
  if index is not None:
    student = functools.partial(student, logit_index=index)
    batch = _windowed(batch, index)
  grad_fn = jax.value_and_grad(
      functools.partial(distill_loss, student_apply=student, objective=objective),
      has_aux=True)
  (_, metrics), grads = grad_fn(state.params, log_p, batch)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {**metrics, "weight_sum": jnp.sum(batch["weights"].astype(jnp.float32)),
             "grad_norm": optax.tree.norm(grads), "param_norm": optax.tree.norm(params)}
  return train.TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(student_params, teacher_params, batch: Mapping[str, jax.Array], *,
              student_apply: Callable, teacher_apply: Callable, objective: Objective,
              context_fn: Callable | None = None) -> dict[str, jax.Array]:
  """Weighted sums over one held-out batch ({name}_sum and weight_sum, f32[]), so batches with
  different token counts combine exactly (`summarize`)."""
  positions = _positions(batch["inputs"])
  teacher_logits, teacher_hidden, _ = teacher_apply(teacher_params, batch["inputs"], positions)
  student = _student_with_context(student_apply, context_fn, teacher_hidden, batch, None)
  student_logits, _, _ = student(student_params, batch["inputs"], positions)
  metrics = _token_metrics(teacher_logits, student_logits, batch, objective)
  weight_sum = jnp.sum(batch["weights"].astype(jnp.float32))
  out = {f"{k}_sum": v * weight_sum for k, v in metrics.items()}
  out["weight_sum"] = weight_sum
  return out


def summarize(sums: Mapping[str, float]) -> dict[str, float]:
  """Summed eval_step outputs → token means {name: value, "tokens": Σ weights}."""
  w = max(float(sums["weight_sum"]), 1e-8)
  out = {k[:-len("_sum")]: float(v) / w for k, v in sums.items() if k != "weight_sum"}
  out["tokens"] = float(sums["weight_sum"])
  return out


def jit_distill_step(student_apply: Callable, teacher_apply: Callable, tx, objective: Objective,
                     state_shardings: train.TrainState, teacher_shardings, mesh,
                     context_fn: Callable | None = None, teacher_head: Callable | None = None):
  """distill_step jitted once: the student's state in/out in its shardings and donated (dead
  after the update), the teacher's params in theirs and *not* donated (reused every step),
  batch over (data, fsdp), rng and metrics replicated. teacher_head: for batches that carry
  their teacher pass (TEACHER_HIDDEN)."""
  rep = parallel.replicated(mesh)
  return jax.jit(
      functools.partial(distill_step, student_apply=student_apply, teacher_apply=teacher_apply,
                        tx=tx, objective=objective, context_fn=context_fn,
                        teacher_head=teacher_head),
      in_shardings=(state_shardings, parallel.batch_sharding(mesh), rep, teacher_shardings),
      out_shardings=(state_shardings, rep),
      donate_argnums=(0,))


def jit_eval_step(student_apply: Callable, teacher_apply: Callable, objective: Objective,
                  student_shardings, teacher_shardings, mesh, context_fn: Callable | None = None):
  return jax.jit(
      functools.partial(eval_step, student_apply=student_apply, teacher_apply=teacher_apply,
                        objective=objective, context_fn=context_fn),
      in_shardings=(student_shardings, teacher_shardings, parallel.batch_sharding(mesh)),
      out_shardings=parallel.replicated(mesh))


class TeacherCache:
  """The teacher's pass over each batch of a cycled pool, computed at the batch's first step and
  reused at every later one (EAGLE trains on the target's hidden states stored once; the same
  saving): batch s is pool batch s mod `period`, and `batch(s, host_batch)` returns the batch
  with its TEACHER_HIDDEN, the hidden states of `draft_init.teacher_parts`' body, so the step
  runs only its head, the output layer (`jit_distill_step(..., teacher_head=cache.head)`). The
  body is a pure function of the batch's tokens, and `stored` hands back what it stored: a
  resumed run refills the same states.
  The tokens of a cached batch are kept and compared at each reuse: a batch that is not its pool
  batch raises instead of training on another batch's teacher. Host memory: `period` batches'
  hidden states (`bytes_per_batch`).

  `stored(key) -> {layer: [B,T,D]} | None` (an attribute, None by default): the states of pool
  batch `key` computed elsewhere (the generation that sampled the pool keeps them:
  distill_data.VerifierData.hidden), used in place of the body's pass. They must have the
  body's keys (`layers`), shapes and dtypes."""

  def __init__(self, body: Callable, head: Callable, teacher_params, period: int, *,
               teacher_shardings, mesh):
    self.head, self.period = head, int(period)
    self.stored: Callable[[int], dict | None] | None = None
    self.reused = 0  # pool batches whose states came from `stored` (tests, logs)
    self._params = teacher_params
    self._sharding = parallel.batch_sharding(mesh)
    self._pass = lambda params, tokens: body(params, tokens, _positions(tokens))
    self._body = jax.jit(self._pass, in_shardings=(teacher_shardings, self._sharding),
                         out_shardings=self._sharding)
    self._store: dict[int, tuple[np.ndarray, dict]] = {}
    self.computed = 0  # teacher passes run (tests, logs)
    probe = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    self.layers = tuple(jax.eval_shape(self._pass, teacher_params, probe))  # the body's keys

  def bytes_per_batch(self, batch_shape: tuple[int, int]) -> int:
    tokens = jax.ShapeDtypeStruct(batch_shape, jnp.int32)
    out = jax.eval_shape(self._body, self._params, tokens)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(out))

  def batch(self, s: int, batch: Mapping[str, np.ndarray]) -> dict:
    key = int(s) % self.period
    tokens = np.asarray(batch["inputs"])
    if key not in self._store:
      hidden = self.stored(key) if self.stored is not None else None
      if hidden is not None:
        self._check_stored(key, tokens, hidden)
        self.reused += 1
      else:
        hidden = self._body(self._params, parallel.shard_batch(tokens, self._sharding))
        hidden = {k: parallel.to_host(v) for k, v in hidden.items()}
        self.computed += 1
      self._store[key] = (tokens, hidden)
    kept, hidden = self._store[key]
    if not np.array_equal(kept, tokens):
      raise RuntimeError(f"TeacherCache: batch {s} is not pool batch {key} (its tokens differ); "
                         "this data source cannot reuse teacher passes.")
    return {**batch, TEACHER_HIDDEN: hidden}

  def _check_stored(self, key: int, tokens: np.ndarray, hidden: dict) -> None:
    want = jax.eval_shape(self._pass, self._params, jax.ShapeDtypeStruct(tokens.shape, jnp.int32))
    got = {k: (tuple(np.shape(v)), np.asarray(v).dtype) for k, v in hidden.items()}
    need = {k: (tuple(v.shape), v.dtype) for k, v in want.items()}
    if got != need:
      raise ValueError(f"TeacherCache: the stored states of pool batch {key} are {got}, the "
                       f"teacher's pass gives {need}; they cannot stand in for it.")
