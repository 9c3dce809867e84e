"""Train state, jitted train/eval steps, and the host loop shared by training programs.

Shapes: B batch, T tokens. A batch is {"inputs": int32[B,T], "targets": int32[B,T],
"weights": float32[B,T]} (spec_jax.data.pipeline.lm_batches).

Step numbering: `state.step` counts applied updates. The update that takes state.step from s to
s + 1 reads batch s and rng fold_in(rng, s); its metrics are logged at step s + 1, and a
checkpoint at step s + 1 holds the state after it. So a run resumed from checkpoint s replays
exactly the steps an uninterrupted run would have taken.
"""

from __future__ import annotations

import functools
import math
import signal
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence

import flax.struct
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from spec_jax import parallel
from spec_jax.training import losses, preemption


@flax.struct.dataclass
class TrainState:
  """step int32[] (updates applied), params (pytree), opt_state (optax state for params)."""
  step: jax.Array
  params: Any
  opt_state: Any


class NonFiniteError(FloatingPointError):
  """A train step produced NaN/Inf; raised by the host loop before anything is saved."""


def _positions(tokens_BxT: jax.Array) -> jax.Array:
  # Packed windows: positions restart at 0 in every row, not at document boundaries (documents
  # are separated by EOS and attend across it, as in GPT-style packed training).
  return jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1], dtype=jnp.int32), tokens_BxT.shape)


def loss_fn(params, batch: Mapping[str, jax.Array], *, apply_fn) -> tuple[jax.Array, dict]:
  """Mean token cross-entropy of `apply_fn(params, inputs[B,T], positions[B,T])`."""
  logits_BxTxV, _, _ = apply_fn(params, batch["inputs"], _positions(batch["inputs"]))
  return losses.cross_entropy(logits_BxTxV, batch["targets"], batch["weights"])


def train_step(state: TrainState, batch: Mapping[str, jax.Array], rng: jax.Array, *,
               apply_fn: Callable, tx: optax.GradientTransformation,
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One AdamW update on one batch. Pure: jit it once (`jit_train_step`).

  rng is the run's base key; the step is folded in here so each step's randomness is a function
  of (seed, step) alone and a resumed run draws the same numbers. The Llama forward has no
  dropout today, so the key is unused, but keeping it in the signature lets stochastic
  objectives (sampled distillation targets) share this loop.

  Metrics (f32[]): loss, accuracy, perplexity, weight_sum, grad_norm (before clipping),
  param_norm (after the update: a non-finite update shows up in the step that made it).
  """
  rng = jax.random.fold_in(rng, state.step)
  del rng  # see docstring
  grad_fn = jax.value_and_grad(functools.partial(loss_fn, apply_fn=apply_fn), has_aux=True)
  (_, metrics), grads = grad_fn(state.params, batch)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {**metrics, "grad_norm": optax.tree.norm(grads),
             "param_norm": optax.tree.norm(params)}
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch: Mapping[str, jax.Array], *, apply_fn: Callable
              ) -> dict[str, jax.Array]:
  """Weighted sums over one batch (f32[]): nll_sum, correct_sum, weight_sum. Sums, not means,
  so that batches with different token counts combine exactly (`summarize_eval`)."""
  logits_BxTxV, _, _ = apply_fn(params, batch["inputs"], _positions(batch["inputs"]))
  _, m = losses.cross_entropy(logits_BxTxV, batch["targets"], batch["weights"])
  return {"nll_sum": m["loss"] * m["weight_sum"], "correct_sum": m["accuracy"] * m["weight_sum"],
          "weight_sum": m["weight_sum"]}


def summarize_eval(sums: Mapping[str, float]) -> dict[str, float]:
  """Summed eval_step outputs -> {loss, accuracy, perplexity, tokens}."""
  w = max(float(sums["weight_sum"]), 1e-8)
  loss = float(sums["nll_sum"]) / w
  return {"loss": loss, "accuracy": float(sums["correct_sum"]) / w,
          "perplexity": math.exp(min(loss, 700.0)), "tokens": float(sums["weight_sum"])}


# ---------------------------------------------------------------------------------------------
# Initialisation and jitting with shardings.


# Step metrics that are means over the step's weighted tokens: a log window weighs each step's
# by its weight_sum (steps of chat rows or rows cut at a stop token hold different counts).
TOKEN_MEANS = ("loss", "accuracy", "alpha", "aux_loss")


def window_means(window: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """One logged row from the steps of a log window: token means (`TOKEN_MEANS`) weighted by
  each step's weight_sum when every step has one, perplexity as exp of that loss, every other
  metric (norms, weight_sum) the plain mean over steps."""
  out = {k: float(np.mean([m[k] for m in window])) for k in window[0]}
  weights = np.asarray([m.get("weight_sum", np.nan) for m in window], np.float64)
  if np.all(weights > 0):
    for k in TOKEN_MEANS:
      if k in out:
        out[k] = float(np.dot(weights, [m[k] for m in window]) / weights.sum())
    if "perplexity" in out:
      out["perplexity"] = math.exp(min(out["loss"], 700.0))
  return out


def abstract_state(init_params_fn: Callable[[jax.Array], Any], tx, rng: jax.Array,
                   mesh: jax.sharding.Mesh) -> tuple[TrainState, TrainState]:
  """(abstract TrainState of ShapeDtypeStructs with shardings, its shardings pytree).

  Shapes come from `jax.eval_shape`, so nothing is allocated; optimizer moments share their
  params' shapes and hence their shardings."""
  def init(rng):
    params = init_params_fn(rng)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  shapes = jax.eval_shape(init, rng)
  shardings = parallel.param_shardings(mesh, shapes)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, shardings)
  return abstract, shardings


def init_state(init_params_fn: Callable[[jax.Array], Any], tx, rng: jax.Array,
               shardings: TrainState) -> TrainState:
  """Materialise a fresh TrainState directly in its shardings: each device computes only its
  own shards (no full copy on one device first)."""
  def init(rng):
    params = init_params_fn(rng)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return jax.jit(init, out_shardings=shardings)(rng)


def state_from_params(params, tx, abstract: TrainState) -> TrainState:
  """A fresh TrainState (step 0, new optimizer) around given params (e.g. a loaded model), cast
  to the dtypes and placed in the shardings of `abstract` (from `abstract_state`). The params are
  an argument of the jitted init, not a closure: closed-over arrays would be baked into the HLO
  as constants (hundreds of MB for a real model)."""
  def init(params):
    params = jax.tree.map(lambda p, a: jnp.asarray(p, a.dtype), params, abstract.params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  return jax.jit(init, out_shardings=shardings)(params)


def fresh_state(init_params_fn: Callable[[jax.Array], Any], tx, rng: jax.Array,
                shardings: TrainState, abstract: TrainState, params=None) -> TrainState:
  """A run's step-0 state: around `params` (a loaded model) if given, else initialised."""
  if params is None:
    return init_state(init_params_fn, tx, rng, shardings)
  return state_from_params(params, tx, abstract)


def jit_train_step(apply_fn: Callable, tx, state_shardings: TrainState, mesh):
  """train_step jitted once: state in/out in its shardings and donated (the old params and
  moments are dead after the update, so XLA reuses their buffers instead of holding two copies),
  batch sharded over (data, fsdp), rng and metrics replicated."""
  rep = parallel.replicated(mesh)
  return jax.jit(
      functools.partial(train_step, apply_fn=apply_fn, tx=tx),
      in_shardings=(state_shardings, parallel.batch_sharding(mesh), rep),
      out_shardings=(state_shardings, rep),
      donate_argnums=(0,))


def jit_eval_step(apply_fn: Callable, param_shardings, mesh):
  rep = parallel.replicated(mesh)
  return jax.jit(functools.partial(eval_step, apply_fn=apply_fn),
                 in_shardings=(param_shardings, parallel.batch_sharding(mesh)),
                 out_shardings=rep)


def evaluate(eval_fn: Callable, params, batches: Iterable[Mapping[str, np.ndarray]],
             sharding) -> dict[str, float]:
  """Run eval_fn over host batches and summarize. Blocks on every batch (docs/design.md §5 trap: an
  unwaited stream of cross-device collectives can hang on CPU)."""
  totals = {"nll_sum": 0.0, "correct_sum": 0.0, "weight_sum": 0.0}
  for batch in batches:
    out = jax.device_get(eval_fn(params, parallel.shard_batch(batch, sharding)))
    for k in totals:
      totals[k] += float(out[k])
  return summarize_eval(totals)


# ---------------------------------------------------------------------------------------------
# Host loop.


def check_finite(step: int, metrics: Mapping[str, Any]) -> None:
  """Raise NonFiniteError naming the step and the first non-finite metric."""
  bad = {k: float(v) for k, v in metrics.items() if not np.all(np.isfinite(np.asarray(v)))}
  if bad:
    values = ", ".join(f"{k}={v}" for k, v in bad.items())
    raise NonFiniteError(
        f"Training diverged at step {step}: non-finite {values}. "
        "The state of this step was not checkpointed; the workdir's latest checkpoint is the last "
        "good one. Hints: lower train.lr (or raise train.warmup_steps), keep train.grad_clip on, "
        "and check the data (all-zero weights, token ids >= vocab_size).")


def _save_on_interrupt(state: TrainState, start: int, pending, read, save_fn) -> None:
  """A KeyboardInterrupt raised inside the loop (only where `StopSignals` could not be installed,
  off the main thread, or raised by code): checkpoint the newest state (its metrics checked
  finite first); nothing if no step finished, or if the interrupt hit while that state's buffers
  were being donated to the next step (the signal path, `preemption`, has no such gap)."""
  if save_fn is None or any(x.is_deleted() for x in jax.tree.leaves(state)):
    return
  done = int(jax.device_get(state.step))
  if done <= start:
    return
  if pending is not None and pending[0] == done:
    read(pending)
  logging.warning("Interrupted: saving step %d so that the run resumes from it.", done)
  save_fn(done, state)


def train_loop(*, state: TrainState, step_fn: Callable, get_batch: Callable[[int], Any],
               num_steps: int, rng: jax.Array, batch_sharding, log_every: int = 10,
               eval_every: int = 0,
               eval_fn: Callable[[TrainState], Mapping[str, float]] | None = None,
               checkpoint_every: int = 0, save_fn: Callable[[int, TrainState], None] | None = None,
               wait_fn: Callable[[], None] | None = None,
               writer=None, lr_fn: Callable[[int], float] | None = None,
               step_hook: Callable[[int], None] | None = None, show_progress: bool = True,
               ) -> tuple[TrainState, dict[str, float], dict[str, float]]:
  """Run steps state.step .. num_steps-1; return (state, train metrics averaged over the last
  log window, last eval metrics).

  Dispatch stays asynchronous: step t is dispatched before step t-1's metrics are read, so the
  host reads batches and logs while the device computes. Every metric is checked for NaN/Inf one
  step late, and always *before* a checkpoint or eval of the state that produced it, so a bad
  state is never saved.

  SIGTERM / SIGINT (`preemption`): the loop dispatches no further step, finishes the one in
  flight, logs its partial metrics window, saves it and waits for the save (`wait_fn`), then
  raises `preemption.Preempted` after printing the step and the command to resume. All processes
  of a multi-host job agree on that step (`preemption.StopVote`).

  get_batch(s) -> host batch for step s. eval_fn(state) -> {name: float} (logged as eval/*).
  save_fn(step, state) saves a checkpoint, possibly asynchronously; wait_fn() blocks until the
  saves are on disk. writer: a MetricsWriter. step_hook(completed_steps) runs after each dispatch
  (tests use it to simulate a kill or to send a signal).
  """
  start = int(jax.device_get(state.step))
  last: dict[str, float] = {}
  last_eval: dict[str, float] = {}
  pending: tuple[int, Any] | None = None  # (completed steps, device metrics) not yet read
  window: list[dict[str, float]] = []  # train metrics since the last log

  bar = tqdm.tqdm(total=num_steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                  disable=not show_progress or jax.process_index() != 0)

  # On CPU with several devices, two SPMD programs in flight can deadlock in their collectives'
  # rendezvous (docs/design.md §5; seen under load even with one step of lookahead), so each step is
  # read before the next is dispatched there. Accelerators keep one step of lookahead.
  one_in_flight = jax.devices()[0].platform == "cpu" and jax.device_count() > 1

  def log_window(done):
    nonlocal last
    last = window_means(window)
    scalars = {f"train/{k}": v for k, v in last.items()}
    if lr_fn is not None:
      scalars["train/lr"] = lr_fn(done - 1)  # the lr the last update used
    if writer is not None:
      writer.write_scalars(done, scalars)
    window.clear()

  def read(pending):
    nonlocal last
    done, metrics = pending
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    check_finite(done, metrics)
    if log_every:
      window.append(metrics)
    else:
      last = metrics
    bar.update(1)
    bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
    if log_every and (done % log_every == 0 or done == num_steps):
      log_window(done)

  done, saved = start, start  # newest finished step, newest step handed to save_fn
  vote = preemption.StopVote(lag=not one_in_flight)
  with preemption.StopSignals() as stop:
    try:
      for s in range(start, num_steps):
        if vote(stop.signum is not None):
          break
        batch = parallel.shard_batch(get_batch(s), batch_sharding)
        state, metrics = step_fn(state, batch, rng)
        done = s + 1
        if step_hook is not None:
          step_hook(done)
        if pending is not None:
          read(pending)
        pending = (done, metrics)
        if one_in_flight:
          read(pending)
          pending = None
        do_eval = eval_fn is not None and eval_every and (
            done % eval_every == 0 or done == num_steps)
        do_save = save_fn is not None and (
            (checkpoint_every and done % checkpoint_every == 0) or done == num_steps)
        if do_eval or do_save:
          if pending is not None:
            read(pending)  # sync point: this state's metrics must be finite first
          pending = None
          if do_eval:
            last_eval = dict(eval_fn(state))
            if writer is not None:
              writer.write_scalars(done, {f"eval/{k}": v for k, v in last_eval.items()})
          if do_save:
            save_fn(done, state)
            saved = done
          if writer is not None:
            writer.flush()
      else:
        if pending is not None:
          read(pending)
        if stop.signum is not None and wait_fn is not None:
          wait_fn()  # a signal during the last step: the final save completes before handlers go
        return state, last, last_eval
      # Stopped by a signal (on any process): the step in flight is finished, logged and saved.
      if pending is not None:
        read(pending)
      if window:
        log_window(done)
      if save_fn is not None and done > saved:
        save_fn(done, state)
      if wait_fn is not None:
        wait_fn()
      message = preemption.stop_message(stop.signum, done, start, num_steps)
      bar.close()
      print(message, file=sys.stderr, flush=True)
      raise preemption.Preempted(done, stop.signum or signal.SIGTERM, message)
    except KeyboardInterrupt:
      _save_on_interrupt(state, start, pending, read, save_fn)
      raise
    finally:
      bar.close()
      if writer is not None:
        writer.flush()
