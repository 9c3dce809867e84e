"""Program `train_bpd`: train blockwise-parallel-decoding heads on a frozen verifier.

`run(config, workdir)` reads configs/train_bpd.py's sections: tokenizer, verifier (the model the
heads sit on), data (a corpus, packed windows of seq_len tokens; or data.name=spec_jax_sharegpt:
chat rows, `training/chat_data.py`, with the corpus's responses or the verifier's, data.source
fixed | verifier, the loss on response tokens only), bpd (num_heads, hidden,
own_projection, loss ce | fkl, decay, top_k, train_vocab: 0 or the loss over the N most frequent
tokens), train, mesh, seed. The verifier stays frozen: only the heads train (`training/bpd.py`).
Checkpoints hold the heads alone, with the verifier's config and tokenizer fingerprint and the
heads' config in their meta; the run resumes from its newest intact checkpoint, and SIGTERM /
SIGINT stop it after the step in flight, checkpointed (`train.train_loop`); metrics (per-head loss
and top-1 agreement with the verifier's greedy token; held-out top-1 / top-k) go to TensorBoard
and metrics.jsonl. `evaluate --config.drafter.checkpoint=WORKDIR`
decodes with the heads as a BPD drafter (on the verifier they were trained for).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable

from absl import logging
import jax
import numpy as np

from spec_jax import loading, parallel
from spec_jax.data import pipeline
from spec_jax.data.tokenizer import get_tokenizer
from spec_jax.models import bpd_heads, draft_init, llama
from spec_jax.programs import distill as distill_program
from spec_jax.training import bpd, chat_data, checkpoints, distill_data, optim, train
from spec_jax.training import metrics as metrics_lib


def check_config(config) -> tuple[bpd.Objective, int]:
  """(objective, num_heads), every bpd field checked before any model loads."""
  optim.check_train(config.train)
  pipeline.check_dataset(config.data.name, config.data.data_dir or None)
  b = config.bpd
  if int(b.num_heads) < 1:
    raise ValueError(f"bpd.num_heads={b.num_heads}: give at least one head (h >= 1).")
  if int(b.hidden) < 0:
    raise ValueError(f"bpd.hidden={b.hidden} must be >= 0 (0 = the verifier's width).")
  if int(b.get("train_vocab", 0)) < 0:
    raise ValueError(f"bpd.train_vocab={b.train_vocab} must be >= 0 (0: the loss over the whole "
                     "vocabulary; N: over the train split's N most frequent tokens).")
  dc = config.data
  source = str(dc.get("source", "fixed"))
  if chat_data.is_chat(dc.name):
    if source not in ("fixed", "verifier"):
      raise ValueError(f"data.source={source!r}: train_bpd trains on the corpus's responses "
                       "('fixed') or the verifier's ('verifier'); it has no drafter to generate "
                       "on-policy ones.")
    chat_data.check_config(dc, source == "verifier")
  elif source != "fixed":
    raise ValueError(f"data.source={source!r} needs chat data (data.name={chat_data.NAME!r}): "
                     f"the windows of {dc.name!r} train on their own text. Fix: data.source=fixed.")
  elif int(dc.seq_len) <= int(b.num_heads) + 1:
    raise ValueError(f"data.seq_len={dc.seq_len} leaves no target for the last of "
                     f"bpd.num_heads={b.num_heads} heads: use seq_len > num_heads + 1.")
  return bpd.Objective(str(b.loss), float(b.decay), int(b.top_k)), int(b.num_heads)


def run(config, workdir: str, *, step_hook: Callable[[int], None] | None = None) -> dict:
  """Train the heads for `config.train.num_steps` steps in `workdir`; returns the final metrics
  {"step", "train_loss", "eval", "steps_per_sec", "num_params"}."""
  objective, num_heads = check_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  tc = config.train
  tokenizer = get_tokenizer(config.tokenizer)
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed,
                                       field="verifier.checkpoint")
  v_cfg = dataclasses.replace(v_cfg, dtype=config.verifier.dtype)
  cfg = bpd_heads.BPDConfig.for_verifier(v_cfg, num_heads, int(config.bpd.hidden),
                                         bool(config.bpd.own_projection))
  mesh = parallel.make_mesh(config.mesh)
  v_shardings = parallel.param_shardings(mesh, v_params)
  v_params = parallel.put(v_params, v_shardings)
  v_apply = llama.make_apply(v_cfg, (-1,))
  tx, schedule = optim.make_optimizer(tc)
  rng = jax.random.key(config.seed)
  init_rng, train_rng = jax.random.split(rng)
  init_fn = functools.partial(bpd_heads.init_params, cfg, v_cfg=v_cfg, v_params=v_params)
  num_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(init_fn, init_rng)))
  logging.info("BPD: %d heads (%.2fM params) on %s, loss %s.", num_heads, num_params / 1e6,
               config.verifier.checkpoint or config.verifier.size, objective.loss)
  abstract, shardings = train.abstract_state(init_fn, tx, init_rng, mesh)

  manager = checkpoints.make_manager(workdir, max_to_keep=tc.keep_checkpoints)
  writer = metrics_lib.MetricsWriter(workdir)
  try:
    # The initial heads are computed eagerly (own_projection copies the verifier's projection;
    # a jitted init would bake it in as a constant).
    state, start = checkpoints.resume_or_start(
        manager, abstract,
        functools.partial(train.fresh_state, init_fn, tx, init_rng, shardings, abstract,
                          init_fn(init_rng)),
        num_steps=tc.num_steps, model_cfg=v_cfg, tokenizer=tokenizer, writer=writer,
        config=config, expected=("bpd", {"bpd": {k: v for k, v in dataclasses.asdict(cfg).items()
                                                 if k != "verifier_probe"}}))
    result = {"step": start, "train_loss": None, "eval": None, "steps_per_sec": None,
              "num_params": num_params}
    if start >= tc.num_steps:
      return result
    # The verifier's fingerprint travels with the heads (evaluate refuses another verifier).
    cfg = dataclasses.replace(cfg, verifier_probe=bpd_heads.verifier_probe(v_cfg, v_params))
    meta = checkpoints.make_meta(v_cfg, tokenizer, config, bpd=dataclasses.asdict(cfg))
    get_batch, eval_batches = _batches(config, tokenizer, workdir, v_params, v_cfg)
    batch_sh = parallel.batch_sharding(mesh)
    eval_fn = None
    if tc.eval_every and eval_batches:
      jitted_eval = bpd.jit_eval_step(cfg, v_cfg, v_apply, objective, shardings.params,
                                      v_shardings, mesh)
      eval_fn = functools.partial(_held_out, jitted_eval, v_params, eval_batches, batch_sh,
                                  num_heads)

    step = bpd.jit_bpd_step(cfg, v_cfg, v_apply, tx, objective, shardings, v_shardings, mesh,
                            _train_vocab(config, tokenizer, v_cfg))
    t0 = time.perf_counter()
    state, last, last_eval = train.train_loop(
        state=state, step_fn=lambda st, batch, r: step(st, batch, r, v_params),
        get_batch=get_batch, num_steps=tc.num_steps, rng=train_rng,
        batch_sharding=batch_sh, log_every=tc.log_every, eval_every=tc.eval_every,
        eval_fn=eval_fn, checkpoint_every=tc.checkpoint_every,
        save_fn=lambda s, st: checkpoints.save(manager, s, st, meta),
        wait_fn=manager.wait_until_finished, writer=writer,
        lr_fn=lambda s: float(schedule(s)), step_hook=step_hook)
    seconds = time.perf_counter() - t0
    steps_run = max(tc.num_steps - start, 0)
    result.update(step=int(jax.device_get(state.step)), train_loss=last.get("loss"),
                  eval=last_eval or None, steps_per_sec=steps_run / seconds if steps_run else None)
    return result
  finally:
    manager.wait_until_finished()
    manager.close()
    writer.close()


def _batches(config, tokenizer, workdir: str, v_params, v_cfg) -> tuple[Callable, list]:
  """(get_batch(s), held-out batches): packed windows of a corpus, or chat rows with weights on
  their responses (the corpus's, or the verifier's from `distill.train_data`: generated once
  and cached); the held-out batches are eval-split rows with the corpus's responses."""
  dc, tc = config.data, config.train
  n_eval = int(tc.eval_batches) if tc.eval_every else 0
  if not chat_data.is_chat(dc.name):
    common = dict(seq_len=dc.seq_len, batch_size=tc.batch_size, seed=config.seed,
                  data_dir=dc.data_dir or None, text_key=dc.text_key)
    train_ds = pipeline.lm_batches(dc.name, dc.train_split, tokenizer, **common)
    eval_ds = pipeline.lm_batches(dc.name, dc.eval_split, tokenizer, num_epochs=1,
                                  **common) if n_eval else []
    return train_ds.__getitem__, [eval_ds[i] for i in range(min(n_eval, len(eval_ds)))]
  p, o = int(dc.prompt_tokens), int(dc.response_tokens)
  spec = distill_data.Spec(
      source=str(dc.source), prompt_tokens=p, response_tokens=o, batch_size=int(tc.batch_size),
      temperature=float(dc.temperature), seed=int(config.seed),
      verifier_batches=int(dc.get("verifier_batches", 0)),
      generate_batch=int(dc.get("generate_batch", 0)))
  data = distill_program.train_data(config, spec, tokenizer, workdir, v_params=v_params,
                                    v_cfg=v_cfg)
  eval_ds = distill_data.windows(
      dc.name, dc.eval_split, tokenizer, prompt_tokens=p, response_tokens=o,
      batch_size=int(tc.batch_size), seed=config.seed, data_dir=dc.data_dir or None,
      num_epochs=1) if n_eval else []
  return data.get, [distill_data.make_batch(*chat_data.window_rows(eval_ds[i], p, o))
                    for i in range(min(n_eval, len(eval_ds)))]


def _train_vocab(config, tokenizer, v_cfg) -> np.ndarray | None:
  """int32[N]: the N = bpd.train_vocab most frequent tokens of data.train_split, the loss's
  token subset (`training/bpd.py`); None for 0 (the whole vocabulary)."""
  n = int(config.bpd.get("train_vocab", 0))
  if not n:
    return None
  if not n <= v_cfg.vocab_size:
    raise ValueError(f"bpd.train_vocab={n} exceeds the verifier's vocabulary of "
                     f"{v_cfg.vocab_size} tokens. Fix: 0 (all) or N <= {v_cfg.vocab_size}.")
  dc = config.data
  counts = distill_data.blend_counts(config, tokenizer) if chat_data.is_chat(dc.name) else (
      draft_init.count_tokens(pipeline.token_stream(
          dc.name, dc.train_split, tokenizer, data_dir=dc.data_dir or None,
          text_key=dc.text_key), v_cfg.vocab_size))
  ids = np.asarray(draft_init.top_ids(counts, n, "bpd.train_vocab"), np.int32)
  logging.info("BPD: the loss over the %d most frequent tokens (%.2f%% of the train split).",
               n, 100.0 * counts[ids].sum() / max(counts.sum(), 1))
  return ids


def _held_out(jitted_eval, v_params, batches, batch_sh, num_heads: int, state) -> dict:
  """Per-head held-out loss, top-1 and top-k agreement with the verifier's greedy token."""
  sums = None
  for batch in batches:
    out = jax.device_get(jitted_eval(state.params, v_params,
                                     parallel.shard_batch(batch, batch_sh)))
    sums = out if sums is None else {k: sums[k] + out[k] for k in out}
  return bpd.summarize(sums, num_heads)
