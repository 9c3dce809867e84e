"""Training BPD heads (`models/bpd_heads.py`) on a frozen verifier: steps and losses.

Shape letters (repo legend): B batch, T tokens, A = h heads, D the verifier's width, V vocabulary.

A batch is a packed window: inputs[B, T] and targets[B, T] = inputs shifted by one, weights[B, T].
The verifier runs forward once (no gradient) and gives, at every position t, its final residual
x_t (what the heads read) and its law p_t of the token at t + 1. Head k (k = 1..h) at t predicts
the token at t + 1 + k:
  "ce":  cross-entropy against the corpus token targets[t + k];
  "fkl": self-distillation, KL(p_{t+k} ‖ q_{k,t}): the verifier's own law for that token given the
         true prefix (Medusa-2's self-distillation; the heads learn what the verifier would say).
Positions with t + k ≥ T have no target and weigh 0. Head k's loss is weighted by decay^(k−1)
(Medusa: 0.8^k) and the total is normalised by the sum of those weights.
Held-out metrics per head: top-1 and top-k agreement with the verifier's greedy token argmax
p_{t+k} (its greedy continuation under teacher forcing) and the head's loss.

Training over a token subset (`bpd.train_vocab` = N, `vocab_ids` int[N] here): the heads' h
projections onto the 49,152-token vocabulary cost more than the verifier's whole forward on a
CPU. With `vocab_ids` the training step projects onto those N tokens only (the N most frequent
of the train split): q and the target law p are both renormalised over them ("fkl"), and corpus
targets outside them weigh 0 ("ce"). Top-1 agreement still compares with the verifier's greedy
token over the whole vocabulary, and the held-out evaluation (`eval_step`) and decoding always
use the whole vocabulary, so a subset that truncates too much shows there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from spec_jax import parallel
from spec_jax.models import bpd_heads
from spec_jax.training import train

OBJECTIVES = ("ce", "fkl")


@dataclasses.dataclass(frozen=True)
class Objective:
  """loss: "ce" (corpus tokens) or "fkl" (the verifier's own laws); decay: head k weighs
  decay^(k−1); top_k: the k of the held-out top-k agreement."""
  loss: str = "fkl"
  decay: float = 0.8
  top_k: int = 5

  def __post_init__(self):
    if self.loss not in OBJECTIVES:
      raise ValueError(f"bpd.loss={self.loss!r} is not one of {OBJECTIVES} ('ce': corpus "
                       "tokens, 'fkl': the verifier's own next-token laws).")
    if not 0.0 < self.decay <= 1.0:
      raise ValueError(f"bpd.decay={self.decay} must be in (0, 1] (head k weighs decay^(k-1)).")
    if self.top_k < 1:
      raise ValueError(f"bpd.top_k={self.top_k} must be >= 1.")


def _shift(x: jax.Array, k: int) -> jax.Array:
  """x[:, t + k] at position t (zeros past the end), along axis 1."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, k)
  return jnp.pad(x[:, k:], pad)


def _verifier_pass(v_apply: Callable, v_params, inputs: jax.Array):
  """(x f32[B, T, D], log p f32[B, T, V]) of the frozen verifier."""
  logits, hidden, _ = v_apply(v_params, inputs, train._positions(inputs))
  return (jax.lax.stop_gradient(hidden[-1].astype(jnp.float32)),
          jax.lax.stop_gradient(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)))


def head_terms(head_params, x, log_p, batch: Mapping[str, jax.Array], *, cfg, v_cfg, v_out,
               objective: Objective, with_topk: bool = True,
               vocab_ids: jax.Array | None = None) -> dict[str, jax.Array]:
  """Per head (leading axis A) and position: loss f32[A, B, T], weight f32[A, B, T], top-1 and
  (with_topk) top-k agreement with the verifier's greedy token f32[A, B, T]. The training step
  leaves top-k out: a top-k over the whole vocabulary per position is not free on a CPU. With
  `vocab_ids` int[N] (v_out then `bpd_heads.verifier_output(..., vocab_ids)`) the loss is taken
  over those N tokens only (module docstring)."""
  u = bpd_heads.head_states(head_params, x.astype(jnp.float32))           # [B, T, A, D]
  out = {k: [] for k in ("loss", "weight", "top1") + (("topk",) if with_topk else ())}
  weights = batch["weights"].astype(jnp.float32)
  greedy_all = jnp.argmax(log_p, axis=-1)                                 # [B, T]
  targets = batch["targets"]
  if vocab_ids is not None:
    sub = jnp.take(log_p, vocab_ids, axis=-1)                             # [B, T, N]
    log_p = sub - jax.nn.logsumexp(sub, axis=-1, keepdims=True)
    index = jnp.full((v_cfg.vocab_size,), -1, jnp.int32).at[vocab_ids].set(
        jnp.arange(vocab_ids.shape[0], dtype=jnp.int32))
    targets = index[targets]                                              # -1: outside
  for j in range(cfg.num_heads):
    k = j + 1
    w = _shift(weights, k)
    lq = jax.nn.log_softmax(bpd_heads.one_head_logits(
        cfg, head_params, v_cfg, v_out, u[:, :, j], j, vocab_ids), axis=-1)  # [B, T, V | N]
    if objective.loss == "ce":
      target = _shift(targets, k)
      w = w * (target >= 0)
      loss = -jnp.take_along_axis(lq, jnp.maximum(target, 0)[..., None], axis=-1)[..., 0]
    else:
      lp = _shift(log_p, k)
      loss = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)
    greedy = _shift(greedy_all, k)
    pred = jnp.argmax(lq, axis=-1)
    if vocab_ids is not None:
      pred = vocab_ids[pred]
    out["loss"].append(loss)
    out["weight"].append(w)
    out["top1"].append((pred == greedy).astype(jnp.float32))
    if with_topk:
      top = jax.lax.top_k(lq, objective.top_k)[1]
      if vocab_ids is not None:
        top = vocab_ids[top]
      out["topk"].append(jnp.any(top == greedy[..., None], axis=-1).astype(jnp.float32))
  return {k: jnp.stack(v) for k, v in out.items()}


def loss_fn(head_params, x, log_p, batch, *, cfg, v_cfg, v_out, objective: Objective,
            vocab_ids: jax.Array | None = None):
  terms = head_terms(head_params, x, log_p, batch, cfg=cfg, v_cfg=v_cfg, v_out=v_out,
                     objective=objective, with_topk=False, vocab_ids=vocab_ids)
  w = terms["weight"]
  per_head = jnp.sum(terms["loss"] * w, axis=(1, 2)) / jnp.maximum(jnp.sum(w, axis=(1, 2)), 1e-8)
  decay = objective.decay ** jnp.arange(cfg.num_heads, dtype=jnp.float32)
  loss = jnp.sum(decay * per_head) / jnp.sum(decay)
  metrics = {"loss": loss}
  for j in range(cfg.num_heads):
    denom = jnp.maximum(jnp.sum(w[j]), 1e-8)
    metrics[f"head{j + 1}_loss"] = per_head[j]
    metrics[f"head{j + 1}_top1"] = jnp.sum(terms["top1"][j] * w[j]) / denom
  return loss, metrics


def bpd_step(state: train.TrainState, batch: Mapping[str, jax.Array], rng: jax.Array, v_params,
             *, cfg, v_cfg, v_apply: Callable, tx: optax.GradientTransformation,
             objective: Objective, vocab_ids=None
             ) -> tuple[train.TrainState, dict[str, jax.Array]]:
  """One optimizer update of the heads; the verifier runs forward only. Pure: jit once
  (`jit_bpd_step`). Metrics (f32[]): loss, head{k}_loss, head{k}_top1 (agreement with the
  verifier's greedy token on this batch), grad_norm, param_norm. `vocab_ids` (int[N] or None):
  the loss over those tokens only (module docstring)."""
  del rng  # deterministic objective
  x, log_p = _verifier_pass(v_apply, v_params, batch["inputs"])
  if vocab_ids is not None:
    vocab_ids = jnp.asarray(vocab_ids, jnp.int32)
  v_out = bpd_heads.verifier_output(v_cfg, v_params, vocab_ids)
  grad_fn = jax.value_and_grad(functools.partial(
      loss_fn, cfg=cfg, v_cfg=v_cfg, v_out=v_out, objective=objective, vocab_ids=vocab_ids),
      has_aux=True)
  (_, metrics), grads = grad_fn(state.params, x, log_p, batch)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "param_norm": optax.tree.norm(params)}
  return train.TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(head_params, v_params, batch: Mapping[str, jax.Array], *, cfg, v_cfg,
              v_apply: Callable, objective: Objective) -> dict[str, jax.Array]:
  """Weighted sums over one held-out batch, per head: head{k}_{loss,top1,topk}_sum and
  head{k}_weight_sum (f32[]), combined exactly across batches by `summarize`."""
  x, log_p = _verifier_pass(v_apply, v_params, batch["inputs"])
  terms = head_terms(head_params, x, log_p, batch, cfg=cfg, v_cfg=v_cfg,
                     v_out=bpd_heads.verifier_output(v_cfg, v_params), objective=objective)
  out = {}
  for j in range(cfg.num_heads):
    w = terms["weight"][j]
    for name in ("loss", "top1", "topk"):
      out[f"head{j + 1}_{name}_sum"] = jnp.sum(terms[name][j] * w)
    out[f"head{j + 1}_weight_sum"] = jnp.sum(w)
  return out


def summarize(sums: Mapping[str, float], num_heads: int) -> dict[str, float]:
  """Summed eval_step outputs → per-head means {head{k}_loss, head{k}_top1, head{k}_topk}."""
  out = {}
  for k in range(1, num_heads + 1):
    w = max(float(sums[f"head{k}_weight_sum"]), 1e-8)
    for name in ("loss", "top1", "topk"):
      out[f"head{k}_{name}"] = float(sums[f"head{k}_{name}_sum"]) / w
  out["loss"] = out["head1_loss"] if num_heads == 1 else sum(
      out[f"head{k}_loss"] for k in range(1, num_heads + 1)) / num_heads
  return out


def jit_bpd_step(cfg, v_cfg, v_apply: Callable, tx, objective: Objective, state_shardings,
                 v_shardings, mesh, vocab_ids=None):
  """bpd_step jitted once: the heads' state in/out in its shardings and donated, the verifier's
  params in theirs and not donated (reused every step), batch over (data, fsdp); `vocab_ids`
  (a host array or None) is baked in as a constant."""
  rep = parallel.replicated(mesh)
  return jax.jit(
      functools.partial(bpd_step, cfg=cfg, v_cfg=v_cfg, v_apply=v_apply, tx=tx,
                        objective=objective, vocab_ids=vocab_ids),
      in_shardings=(state_shardings, parallel.batch_sharding(mesh), rep, v_shardings),
      out_shardings=(state_shardings, rep), donate_argnums=(0,))


def jit_eval_step(cfg, v_cfg, v_apply: Callable, objective: Objective, head_shardings,
                  v_shardings, mesh):
  return jax.jit(
      functools.partial(eval_step, cfg=cfg, v_cfg=v_cfg, v_apply=v_apply, objective=objective),
      in_shardings=(head_shardings, v_shardings, parallel.batch_sharding(mesh)),
      out_shardings=parallel.replicated(mesh))
