"""Program `distill`: DistillSpec (Zhou et al. 2024), train a drafter to match the verifier.

`run(config, workdir)` reads config sections verifier/drafter/data/distill/train/eval/mesh
(configs/distill.py). The verifier is loaded frozen and stays out of the TrainState and of every
checkpoint; the drafter starts from scratch (`drafter.checkpoint=''`) or from a train_lm (or
distill) checkpoint, and its checkpoints have train_lm's layout, so
`checkpoints.load_model(workdir)`, `evaluate --config.drafter.checkpoint=WORKDIR` and another
distill run can all load it. A run resumes from the newest intact checkpoint in
`<workdir>/checkpoints` (a finished run returns at once); SIGTERM / SIGINT stop it after the step
in flight, checkpointed (`train.train_loop`). Metrics go to TensorBoard events and
`<workdir>/metrics.jsonl`:
  train/loss, train/alpha (Σ min(p, q) on the batch's response tokens), grad/param norms, lr;
  eval/{fkl,rkl,jsd,tvd,alpha,top1_agreement,xent} on held-out windows (`eval.batches` batches of
  the eval split with their true continuations) and eval/tau_T{t}, eval/sd_alpha_T{t}: τ (tokens
  per verifier call) and α of speculative decoding at γ = eval.gamma on `eval.num_prompts`
  held-out prompts, for every temperature t in eval.temperatures.
With data.name=spec_jax_sharegpt the rows are chat turns (`training/chat_data.py`), the eval
split's included: held-out rows with the corpus's responses, τ on its chat prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import checks, loading, parallel
from spec_jax.data import pipeline
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.data.tokenizer import get_tokenizer
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.acceptance import chain
from spec_jax.decoding.drafters import trees
from spec_jax.evaluation import metrics as eval_metrics
from spec_jax.models import draft_init, llama
from spec_jax.training import chat_data, checkpoints, distill, distill_data, optim
from spec_jax.training import metrics as metrics_lib
from spec_jax.training import train
# What run() trains: the Student type and its default student_fn.
from spec_jax.training.distill import Student, plain_student


def _drafter(config, tokenizer) -> tuple[llama.LlamaConfig, Any]:
  """(model config, params or None): trained in float32 whatever the compute dtype (AdamW
  updates of bfloat16 weights lose their low bits), as in train_lm. A reduced vocabulary
  (`drafter.size=...:vocab=N`) keeps the N most frequent tokens of data.train_split (of the
  blend: `distill_data.blend_counts`)."""
  counts = lambda: distill_data.blend_counts(config, tokenizer)  # noqa: E731
  cfg, params = loading.resolve_model(config.drafter, tokenizer, field="drafter.checkpoint",
                                      token_counts=counts)
  cfg = dataclasses.replace(cfg, dtype=config.drafter.dtype, param_dtype="float32")
  if params is not None:
    # On the host: a checkpoint loads onto one device, and the jitted init that places the
    # state in the mesh's shardings refuses committed arrays on another device set.
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  return cfg, params


def check_config(config) -> tuple[distill.Objective, distill_data.Spec]:
  """Every section distill reads, checked before anything loads (one error naming the field
  and the fix); returns the objective and the data spec."""
  tc, dc = config.train, config.data
  optim.check_train(tc)
  loading.check_models(config, "verifier", "drafter")
  tokenizer_lib.check_name(config.tokenizer)
  pipeline.check_dataset(dc.name, dc.data_dir or None)
  check_eval(config.eval)
  objective = distill.Objective.from_config(config.distill)
  spec = distill_data.Spec.from_config(dc, tc.batch_size, config.seed)
  distill_data.check_schedule(tc, spec)
  distill_data.blend_rows(tc.batch_size, dc.get("blend", ()))
  chat_data.check_config(dc, spec.needs_verifier_data or spec.onpolicy_rows > 0)
  if config.drafter.size and draft_init.parse_size(config.drafter.size, "drafter.size").vocab:
    check_reduced_law(objective)
  gib = dc.get("teacher_cache_gib", 0.0)
  if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib >= 0:
    raise ValueError(f"data.teacher_cache_gib={gib!r} must be a number >= 0 (GiB of host memory "
                     "for the verifier's cached hidden states; 0 = no cache).")
  return objective, spec


def check_reduced_law(objective: distill.Objective) -> None:
  """A reduced-vocabulary drafter trains against the verifier's law cut to its tokens and
  renormalised, then transformed (`draft_init.restrict`): the law decoding accepts against for
  temperature and top-k, not for top-p, whose cut depends on the mass outside the set."""
  if objective.sampling.top_p < 1.0:
    raise ValueError(
        f"distill.top_p={objective.sampling.top_p} with a reduced-vocabulary drafter "
        "(drafter.size ...:vocab=N, or a drafter checkpoint with one): its target would be "
        "top-p of the law cut to its tokens, not decoding's top-p law cut to them. Fix: "
        "--config.distill.top_p=1.0 (temperature and top_k are exact).")


def check_eval(ec) -> None:
  """The `eval` section's values, each named when a run could not use it."""
  for name in ("batches", "num_prompts"):
    checks.integer(ec.get(name, 0), f"eval.{name}", 0, " (0 = none)")
  if "gamma" in ec:
    chain.validate_gamma(ec.gamma, field="eval.gamma")
  if "new_tokens" in ec:
    chain.positive_int(ec.new_tokens, "eval.new_tokens", " (tokens decoded a prompt)")
  for t in ec.get("temperatures", ()):
    try:
      sampling_lib.Sampling(float(t))
    except (TypeError, ValueError):
      raise ValueError(f"eval.temperatures={tuple(ec.temperatures)!r}: {t!r} is no temperature "
                       "(each a number >= 0, 0 = greedy).") from None


def _tau_eval(v_params, v_cfg, student: Student, prompts, eval_cfg, seed: int
              ) -> Callable[[Any], dict[str, float]]:
  """params → {tau_T{t}, sd_alpha_T{t}} from speculative decoding (γ = eval.gamma) of the
  held-out prompts (int32[n, P], or right-padded `generate.Prompts`: chat), one batched call
  per temperature: τ (block_efficiency) and α (acceptance_rate) as spec_jax.evaluation.metrics
  defines them for every program."""
  drafter = student.drafter(trees.chain(int(eval_cfg.gamma)))
  verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  if not isinstance(prompts, generate_lib.Prompts):
    prompts = generate_lib.Prompts(prompts, np.full((len(prompts),), prompts.shape[1], np.int32))
  batch = generate_lib.Prompts(jnp.asarray(prompts.tokens), jnp.asarray(prompts.lengths))

  def decode(params, temperature: float):
    # The one place distill calls the speculative loop.
    return loop.speculative_generate(
        v_params, params, batch, jax.random.key(seed), verifier=verifier, drafter=drafter,
        sampling=sampling_lib.Sampling(temperature), max_new_tokens=int(eval_cfg.new_tokens))

  def fn(params):
    out = {}
    for t in eval_cfg.temperatures:
      summary = eval_metrics.summarize([decode(params, float(t))])
      name = f"T{float(t):g}"
      out[f"tau_{name}"] = summary["block_efficiency"]
      out[f"sd_alpha_{name}"] = summary["acceptance_rate"]
    # A metric with nothing to average over (no round ran) is left out, not logged as 0.
    return {k: v for k, v in out.items() if v is not None}

  return fn


def _windows(config, spec: distill_data.Spec, tokenizer, split: str, **kwargs):
  dc = config.data
  return distill_data.windows(
      dc.name, split, tokenizer, prompt_tokens=spec.prompt_tokens,
      response_tokens=spec.response_tokens, data_dir=dc.data_dir or None, text_key=dc.text_key,
      **{"seed": config.seed, "batch_size": spec.batch_size, **kwargs})


# Verifier config fields added after pools were first cached: left out of a pool's key at
# these values, so the caches written before them still serve.
_KEY_DEFAULTS = {"feature_layers": (), "fused": False, "unrolled": False,
                 "decode_unrolled": False, "out_major": False, "pallas": False,
                 "attn_kernel": False}


def _pool(config, spec: distill_data.Spec) -> tuple[int, int]:
  """(batches, per_call) of the verifier pool: `data.verifier_batches` (0: one per step) rounded
  up to whole generation calls of `per_call` batches (distill_data.VerifierData)."""
  per_call = max(1, spec.generate_batch // spec.verifier_rows)
  n = spec.verifier_batches or config.train.num_steps
  return -(-n // per_call) * per_call, per_call


def pool_key(config, spec: distill_data.Spec, tokenizer, v_cfg) -> dict:
  """Everything a verifier pool's responses depend on: the key of its cache file
  (`distill_data.VerifierData`). A random-init verifier (tests) is named by its seed."""
  dc = config.data
  blend = tuple((str(n), float(w)) for n, w in dc.get("blend", ()))
  stop_ids = tokenizer.stop_ids if dc.stop_at_eos else ()
  key = dict(verifier=(config.verifier.checkpoint, config.verifier.size,
                       # fields at their defaults (feature_layers=(), the scanned, unfused
                       # layout) keep old caches' keys
                       {k: v for k, v in dataclasses.asdict(v_cfg).items()
                        if k not in _KEY_DEFAULTS or v != _KEY_DEFAULTS[k]},
                       None if config.verifier.checkpoint else config.seed),
             tokenizer=tokenizer.fingerprint,
             data=(dc.name, dc.train_split, dc.text_key, *blend),
             prompt_tokens=spec.prompt_tokens, response_tokens=spec.response_tokens,
             batch_size=spec.batch_size, seed=config.seed, temperature=spec.temperature,
             stop_ids=stop_ids)
  if held := checkpoints.identity(config.verifier.checkpoint):  # what the checkpoint holds:
    key.update(verifier_held=held)  # trained again at its path, it answers anew
  if chat_data.is_chat(dc.name):  # the rows' rules
    key.update(chat=chat_data.VERSION)
  _, per_call = _pool(config, spec)
  if spec.verifier_rows != spec.batch_size or per_call > 1:  # old caches keep their key
    key.update(rows=spec.verifier_rows, per_call=per_call)
  return key


def train_data(config, spec: distill_data.Spec, tokenizer, workdir: str, *, v_params, v_cfg,
               student: Student | None = None, hidden_layers=()) -> distill_data.DistillData:
  """Batches of the train split from config.data.source (verifier responses generated now,
  or read from the cache; on-policy ones later, from the live params of `student`).
  hidden_layers: the verifier's states the pool's generation keeps (the teacher cache's)."""
  dc = config.data
  blend = tuple((str(n), float(w)) for n, w in dc.get("blend", ()))
  train_windows = _windows(config, spec, tokenizer, dc.train_split, blend=blend)
  stop_ids = tokenizer.stop_ids if dc.stop_at_eos else ()
  gen = functools.partial(distill_data.generate_responses, sampling=spec.sampling,
                          response_tokens=spec.response_tokens, stop_ids=stop_ids)
  verifier_data = None
  if spec.needs_verifier_data:
    key = pool_key(config, spec, tokenizer, v_cfg)
    rows = spec.verifier_rows
    num_batches, per_call = _pool(config, spec)
    verifier_data = distill_data.VerifierData(
        lambda prompts, r: gen(v_params, v_cfg, prompts, r, hidden_layers=hidden_layers),
        train_windows, num_batches=num_batches, spec=spec, key=key,
        cache_dir=dc.cache_dir or os.path.join(workdir, "data_cache"), rows=rows,
        per_call=per_call, hidden_layers=hidden_layers)
  onpolicy = None if student is None else (
      lambda params, prompts, r: gen(params, student.cfg, prompts, r))
  return distill_data.DistillData(spec, train_windows, verifier_data=verifier_data,
                                  drafter_generate=onpolicy,
                                  block_dir=os.path.join(workdir, "onpolicy"))


def _eval_fn(config, spec: distill_data.Spec, tokenizer, objective: distill.Objective, *,
             v_params, v_cfg, student: Student, mesh, d_shardings, v_shardings
             ) -> Callable[[Any], dict[str, float]]:
  """state → held-out metrics: token means over `eval.batches` windows of the eval split with
  their true continuations (the same text for every run, so runs compare), then τ and α of
  speculative decoding on `eval.num_prompts` other eval windows' prompts."""
  ec, p, r = config.eval, spec.prompt_tokens, spec.response_tokens
  eval_windows = _windows(config, spec, tokenizer, config.data.eval_split, num_epochs=1)
  eval_batches = [distill_data.make_batch(*chat_data.window_rows(eval_windows[i], p, r))
                  for i in range(min(int(ec.batches), len(eval_windows)))]
  eval_batches = [draft_init.map_batch(student.cfg, b) for b in eval_batches]
  jitted = distill.jit_eval_step(student.apply,
                                 draft_init.restrict(student.cfg, v_cfg, student.teacher_layers),
                                 objective, d_shardings, v_shardings, mesh, student.context_fn)
  tau_fn = None
  if ec.temperatures and ec.num_prompts:
    prompt_ds = _windows(config, spec, tokenizer, config.data.eval_split,
                         batch_size=int(ec.num_prompts), seed=config.seed + 1)
    tau_fn = _tau_eval(v_params, v_cfg, student,
                       chat_data.prompts_of([prompt_ds[0]], int(ec.num_prompts), p), ec,
                       config.seed)
  batch_sh = parallel.batch_sharding(mesh)

  def eval_fn(state):
    totals: dict[str, float] = {}
    for batch in eval_batches:  # blocks per batch (docs/design.md §5 CPU trap)
      out = jax.device_get(jitted(state.params, v_params, parallel.shard_batch(batch, batch_sh)))
      for k, v in out.items():
        totals[k] = totals.get(k, 0.0) + float(v)
    result = distill.summarize(totals) if totals else {}
    if tau_fn is not None:
      result.update(tau_fn(state.params))
    return result

  return eval_fn


def teacher_cache(config, spec: distill_data.Spec, v_cfg, v_params, d_cfg, student: Student, *,
                  v_shardings, mesh) -> distill.TeacherCache | None:
  """A TeacherCache when every batch is a batch of the verifier pool (data.source = verifier,
  verifier_share = 1, no on-policy rows), the run cycles that pool (more steps than pool
  batches) and the pool's hidden states fit data.teacher_cache_gib; None otherwise (every step
  then runs the teacher's whole forward). A pool logs whether it runs cached. The pool's
  generation keeps the states (`train_data(..., hidden_layers=cache.layers)`); set
  `cache.stored = data.verifier_data.hidden` to use them."""
  gib = float(config.data.get("teacher_cache_gib", 0.0))
  if not (spec.source == "verifier" and spec.verifier_share == 1.0 and not spec.onpolicy_rows):
    return None  # batch s is not a function of s mod the pool size
  period, _ = _pool(config, spec)
  parts = draft_init.teacher_parts(d_cfg, v_cfg, student.teacher_layers)
  if gib <= 0 or period >= config.train.num_steps or parts is None:
    return None
  cache = distill.TeacherCache(*parts, v_params, period, teacher_shardings=v_shardings,
                               mesh=mesh)
  # A batch's inputs: prompt and response without the last position (distill_data.make_batch).
  need = period * cache.bytes_per_batch(
      (spec.batch_size, spec.prompt_tokens + spec.response_tokens - 1))
  if need > gib * 2**30:
    logging.warning("The teacher's hidden states of the %d pool batches need %.2f GiB, over "
                    "data.teacher_cache_gib=%g: every step runs the teacher's whole forward. "
                    "Fix: raise data.teacher_cache_gib.", period, need / 2**30, gib)
    return None
  logging.info("Teacher cache: the teacher's states over each of the %d pool batches (%.2f "
               "GiB), kept from the pool's generation (or one pass where it has none), reused "
               "for %d steps.", period, need / 2**30, config.train.num_steps)
  return cache


def run(config, workdir: str, *, step_hook: Callable[[int], None] | None = None,
        student_fn: Callable[..., Student] = plain_student) -> dict:
  """Distill `config.train.num_steps` steps in `workdir`; returns {"step", "train_loss",
  "train_alpha", "eval" (last eval metrics), "steps_per_sec", "num_params"}.

  step_hook(completed_steps) runs after each dispatched step (tests inject interruptions).
  student_fn(config, v_cfg, d_cfg, d_params) -> Student: what is trained (`plain_student`).
  """
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  tc, ec = config.train, config.eval
  objective, spec = check_config(config)  # nothing heavy is loaded for a typo
  tokenizer = get_tokenizer(config.tokenizer)
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed,
                                       field="verifier.checkpoint")
  d_cfg, d_params = _drafter(config, tokenizer)
  distill.check_vocab(v_cfg, d_cfg, config)
  if d_cfg.head_ids:
    check_reduced_law(objective)
  if spec.onpolicy_rows and d_cfg.feature_width:
    raise ValueError(
        f"data.source={spec.source!r} samples responses from the drafter alone, but "
        f"drafter.checkpoint={config.drafter.checkpoint!r} (size {config.drafter.size!r}) is a "
        "feature drafter, which drafts only beside the verifier's features. Fix: a language-"
        "model drafter (e.g. --config.drafter.checkpoint=runs/quickstart_scratch/drafter) or "
        "data.source='fixed' / 'verifier'.")
  student = student_fn(config, v_cfg, d_cfg, d_params)
  v_apply = draft_init.restrict(d_cfg, v_cfg, student.teacher_layers)
  tx, schedule = optim.make_optimizer(tc)
  tx = student.wrap_tx(tx)
  mesh = parallel.make_mesh(config.mesh)
  # The frozen verifier is sharded like any params (it is usually the larger model).
  v_shardings = parallel.param_shardings(mesh, v_params)
  v_params = parallel.put(v_params, v_shardings)
  logging.info("Distilling %s (%.2fM params) from %s (%.2fM) with %s on %s data.", d_cfg,
               d_cfg.num_params / 1e6, config.verifier.checkpoint or config.verifier.size,
               v_cfg.num_params / 1e6, objective, spec.source)

  rng = jax.random.key(config.seed)
  init_rng, train_rng = jax.random.split(rng)
  abstract, shardings = train.abstract_state(student.init_fn, tx, init_rng, mesh)
  manager = checkpoints.make_manager(workdir, max_to_keep=tc.keep_checkpoints)
  writer = metrics_lib.MetricsWriter(workdir)
  try:
    state, start = checkpoints.resume_or_start(
        manager, abstract,
        functools.partial(train.fresh_state, student.init_fn, tx, init_rng, shardings, abstract,
                          student.params),
        num_steps=tc.num_steps, model_cfg=d_cfg, tokenizer=tokenizer, writer=writer,
        config=config,
        expected=(student.meta_section, student.meta) if student.meta_section else None)
    if start >= tc.num_steps:
      return _finished_result(workdir, start, d_cfg)
    meta = checkpoints.make_meta(d_cfg, tokenizer, config, distill=dict(
        divergence=objective.divergence, beta=objective.beta, source=spec.source,
        verifier=config.verifier.checkpoint or config.verifier.size), **student.meta)

    models = dict(v_params=v_params, v_cfg=v_cfg, student=student)
    cache = teacher_cache(config, spec, v_cfg, v_params, d_cfg, student,
                          v_shardings=v_shardings, mesh=mesh)
    data = train_data(config, spec, tokenizer, workdir, **models,
                      hidden_layers=cache.layers if cache else ())
    if cache is not None:
      cache.stored = data.verifier_data.hidden
    eval_fn = None
    if tc.eval_every:
      eval_fn = _eval_fn(config, spec, tokenizer, objective, **models, mesh=mesh,
                         d_shardings=shardings.params, v_shardings=v_shardings)

    step = distill.jit_distill_step(
        student.apply, v_apply, tx, objective, shardings, v_shardings, mesh, student.context_fn,
        teacher_head=cache.head if cache else None)
    live = {"state": state}

    def step_fn(state, batch, rng):
      # Remember the newest state: on-policy data for the next step are drawn from its params
      # (the previous state's buffers are donated to this step and gone).
      state, metrics = step(state, batch, rng, v_params)
      live["state"] = state
      return state, metrics

    def get_batch(s):
      batch = draft_init.map_batch(
          d_cfg, data.get(s, live["state"].params if spec.onpolicy_rows else None))
      # Both laws only where a row's response can be: its first response_tokens targets.
      batch = distill.loss_index(batch, spec.response_tokens)
      return batch if cache is None else cache.batch(s, batch)

    if start == 0 and eval_fn is not None and ec.at_start:
      writer.write_scalars(0, {f"eval/{k}": v for k, v in eval_fn(state).items()})
    t0 = time.perf_counter()
    state, last, last_eval = train.train_loop(
        state=state, step_fn=step_fn, get_batch=get_batch, num_steps=tc.num_steps,
        rng=train_rng, batch_sharding=parallel.batch_sharding(mesh), log_every=tc.log_every,
        eval_every=tc.eval_every, eval_fn=eval_fn, checkpoint_every=tc.checkpoint_every,
        save_fn=lambda s, st: checkpoints.save(manager, s, st, meta),
        wait_fn=manager.wait_until_finished, writer=writer,
        lr_fn=lambda s: float(schedule(s)), step_hook=step_hook)
    seconds = time.perf_counter() - t0
    steps_run = max(tc.num_steps - start, 0)
    return {"step": int(jax.device_get(state.step)), "train_loss": last.get("loss"),
            "train_alpha": last.get("alpha"), "eval": dict(last_eval),
            "steps_per_sec": steps_run / seconds if steps_run else None,
            "num_params": d_cfg.num_params}
  finally:
    # An in-flight async save must complete even when training raised (NaN, interruption).
    manager.wait_until_finished()
    manager.close()
    writer.close()


def _finished_result(workdir: str, step: int, d_cfg: llama.LlamaConfig) -> dict:
  """run()'s result for a finished run, read back from metrics.jsonl (nothing recomputed)."""
  return {"step": step, "steps_per_sec": None, "num_params": d_cfg.num_params,
          **read_result(workdir)}


def read_result(workdir: str) -> dict:
  """{"train_loss", "train_alpha", "eval"} of the run in `workdir`, from its metrics.jsonl: the
  last logged training loss and α and the last held-out evaluation (None / {} if not logged)."""
  out = {"train_loss": None, "train_alpha": None, "eval": {}}
  path = os.path.join(workdir, metrics_lib.JSONL)
  for row in metrics_lib.read_jsonl(path) if os.path.exists(path) else []:  # later rows win
    if "train/loss" in row:
      out["train_loss"], out["train_alpha"] = row["train/loss"], row.get("train/alpha")
    if row.get("step") and any(k.startswith("eval/") for k in row):
      out["eval"] = {k[len("eval/"):]: v for k, v in row.items() if k.startswith("eval/")}
  return out
