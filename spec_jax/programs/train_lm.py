"""Train a Llama-family LM (a drafter) with next-token cross-entropy: `run(config, workdir)`.

Reads config sections base/model/data/train/mesh (configs/common.py). The run resumes from the
newest intact checkpoint in `<workdir>/checkpoints` (a finished run returns at once; a corrupt
newer one is set aside with a warning); metrics go to TensorBoard event files and
`<workdir>/metrics.jsonl`. SIGTERM / SIGINT stop it after the step in flight, checkpointed, with
exit status 128 + the signal and the command to resume (`train.train_loop`). The trained model is loaded elsewhere with
`spec_jax.training.checkpoints.load_model(workdir)`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable

from absl import logging
import jax

from spec_jax import loading, parallel
from spec_jax.data import pipeline
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.data.tokenizer import get_tokenizer
from spec_jax.models import draft_init, llama
from spec_jax.training import checkpoints, metrics as metrics_lib, optim, train


def check_config(config) -> None:
  """The fields train_lm reads, checked before anything loads (one error naming the field and
  the fix): the train section, the model's size and dtype, the tokenizer, the dataset."""
  optim.check_train(config.train)
  loading.check_models(config, "model")
  tokenizer_lib.check_name(config.tokenizer)
  pipeline.check_dataset(config.data.name, config.data.data_dir or None)


def _model(config, tokenizer) -> tuple[llama.LlamaConfig, Any]:
  """(model config, loaded params or None) from config.model (see `loading.resolve_model`; a
  reduced vocabulary, `size=...:vocab=N`, keeps the N most frequent tokens of the train split).
  Params are trained in float32 whatever the compute dtype: AdamW updates of bfloat16 weights
  lose most of their low bits."""
  data = config.data
  counts = lambda: draft_init.count_tokens(pipeline.token_stream(  # noqa: E731
      data.name, data.train_split, tokenizer, data_dir=data.data_dir or None,
      text_key=data.text_key), tokenizer.vocab_size)
  cfg, params = loading.resolve_model(config.model, tokenizer, token_counts=counts)
  cfg = dataclasses.replace(cfg, dtype=config.model.dtype, param_dtype="float32")
  if params is not None:
    params = jax.tree.map(lambda x: x.astype("float32"), params)
  return cfg, params


def run(config, workdir: str, *, step_hook: Callable[[int], None] | None = None) -> dict:
  """Train `config.train.num_steps` steps in `workdir`; returns final metrics
  {"step", "train_loss", "eval_loss", "eval_accuracy", "steps_per_sec", "num_params"}.

  step_hook(completed_steps) runs after each dispatched step (tests inject interruptions).
  """
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  tc = config.train
  check_config(config)  # before anything loads
  tokenizer = get_tokenizer(config.tokenizer)
  model_cfg, loaded_params = _model(config, tokenizer)
  init_fn = functools.partial(llama.init_params, model_cfg)
  # A reduced vocabulary trains on its own rows: targets mapped into it (`draft_init.map_batch`).
  apply_fn = llama.make_apply(model_cfg, reduced_logits=True)
  tx, schedule = optim.make_optimizer(tc)
  mesh = parallel.make_mesh(config.mesh)
  logging.info("Mesh %s; model %s with %.2fM params.", dict(mesh.shape), model_cfg,
               model_cfg.num_params / 1e6)

  rng = jax.random.key(config.seed)
  init_rng, train_rng = jax.random.split(rng)
  abstract, shardings = train.abstract_state(init_fn, tx, init_rng, mesh)

  manager = checkpoints.make_manager(workdir, max_to_keep=tc.keep_checkpoints)
  writer = metrics_lib.MetricsWriter(workdir)
  try:
    state, start = checkpoints.resume_or_start(
        manager, abstract,
        functools.partial(train.fresh_state, init_fn, tx, init_rng, shardings, abstract,
                          loaded_params),
        num_steps=tc.num_steps, model_cfg=model_cfg, tokenizer=tokenizer, writer=writer,
        config=config)
    if start >= tc.num_steps:
      return _finished_result(workdir, start, model_cfg)
    meta = checkpoints.make_meta(model_cfg, tokenizer, config)

    data = config.data
    common = dict(seq_len=data.seq_len, batch_size=tc.batch_size, seed=config.seed,
                  data_dir=data.data_dir or None, text_key=data.text_key)
    train_ds = pipeline.lm_batches(data.name, data.train_split, tokenizer, **common)
    eval_fn = None
    if tc.eval_every and tc.eval_batches:
      eval_ds = pipeline.lm_batches(data.name, data.eval_split, tokenizer, num_epochs=1, **common)
      n_eval = min(tc.eval_batches, len(eval_ds))
      jitted_eval = train.jit_eval_step(apply_fn, shardings.params, mesh)
      batch_sh = parallel.batch_sharding(mesh)
      eval_fn = lambda state: train.evaluate(  # noqa: E731
          jitted_eval, state.params,
          (draft_init.map_batch(model_cfg, eval_ds[i]) for i in range(n_eval)), batch_sh)

    step_fn = train.jit_train_step(apply_fn, tx, shardings, mesh)
    t0 = time.perf_counter()
    state, last, last_eval = train.train_loop(
        state=state, step_fn=step_fn,
        get_batch=lambda s: draft_init.map_batch(model_cfg, train_ds[s]), num_steps=tc.num_steps,
        rng=train_rng, batch_sharding=parallel.batch_sharding(mesh), log_every=tc.log_every,
        eval_every=tc.eval_every, eval_fn=eval_fn, checkpoint_every=tc.checkpoint_every,
        save_fn=lambda step, st: checkpoints.save(manager, step, st, meta),
        wait_fn=manager.wait_until_finished, writer=writer,
        lr_fn=lambda s: float(schedule(s)), step_hook=step_hook)
    seconds = time.perf_counter() - t0
    steps_run = max(tc.num_steps - start, 0)
    return {"step": int(jax.device_get(state.step)), "train_loss": last.get("loss"),
            "eval_loss": last_eval.get("loss"), "eval_accuracy": last_eval.get("accuracy"),
            "steps_per_sec": steps_run / seconds if steps_run else None,
            "num_params": model_cfg.num_params}
  finally:
    # Let an in-flight async save finish even when training raised (NaN, interruption): the
    # last good checkpoint must be complete on disk.
    manager.wait_until_finished()
    manager.close()
    writer.close()


def _finished_result(workdir: str, step: int, model_cfg: llama.LlamaConfig) -> dict:
  """run()'s result for a finished run, from its metrics.jsonl (nothing is recomputed)."""
  out = {"step": step, "train_loss": None, "eval_loss": None, "eval_accuracy": None,
         "steps_per_sec": None, "num_params": model_cfg.num_params}
  path = os.path.join(workdir, metrics_lib.JSONL)
  rows = metrics_lib.read_jsonl(path) if os.path.exists(path) else []
  for row in rows:  # later rows win
    if "train/loss" in row:
      out["train_loss"] = row["train/loss"]
    if "eval/loss" in row:
      out["eval_loss"], out["eval_accuracy"] = row["eval/loss"], row.get("eval/accuracy")
  return out
