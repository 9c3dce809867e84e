"""Program `generate`: sample continuations for prompts and print them.

Prompts come from `config.prompts` (a tuple of strings), `config.prompts_file` (one prompt per
line, `\\n` escapes allowed), or `config.num_data_prompts` prompts from `config.data.prompt_split`
(`spec_jax.data.prompts.read_prompts`, which evaluate and benchmark_hf share).
Writes `workdir/generations.jsonl`.

`config.method` other than "autoregressive" decodes with a registered method
(`spec_jax.decoding.methods`, `NAME[:SHAPE][@L]`, depth `config.gamma` unless @L) drafted from
`config.drafter` (a checkpoint of any kind the method takes, or a random model of
`drafter.size`), its options under their group (`config.lookup`, `config.bpd`, ...); each row then
also carries the prompt's τ (tokens per verifier call) and verifier calls.
"""

from __future__ import annotations

import json
import os
import time

import jax

from spec_jax import loading, parallel
from spec_jax.data import prompts as prompts_lib
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop, methods
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.evaluation import bench


def check_config(config, workdir: str) -> sampling_lib.Sampling:
  """Every field generate reads, checked before any model loads (one error naming the field and
  the fix); returns the sampling law."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir!r} is a file; results go into a directory. Fix: pass "
                     "a directory path (it is created if missing).")
  loading.check_models(config, "model", "drafter")
  tokenizer_lib.check_name(config.tokenizer)
  gen = config.generation
  for name in ("batch_size", "max_new_tokens", "max_prompt_tokens"):
    if int(gen[name]) < 1:
      raise ValueError(f"generation.{name}={gen[name]} must be >= 1.")
  try:
    sampling = sampling_lib.Sampling.from_config(gen.sampling)
  except ValueError as e:  # name the field as the user sets it
    raise ValueError(str(e).replace("sampling.", "generation.sampling.")) from None
  return sampling


def method_entry(config, sampling):
  """The parsed `config.method` and the drafter source it is checked against (None, None for
  autoregressive decoding): before any model loads."""
  method = config.get("method", bench.AUTOREGRESSIVE)
  if method == bench.AUTOREGRESSIVE:  # the verifier alone, no method
    return None, None
  entry = methods.parse(method, int(config.gamma), config, default_width=int(config.tree_width),
                        field="method", prefix="")
  source = loading.drafter_source(config.drafter)
  methods.check(entry, source, sampling, field="method",
                temperature_field="generation.sampling.temperature")
  return entry, source


def run(config, workdir: str) -> list[dict]:
  sampling = check_config(config, workdir)
  entry, source = method_entry(config, sampling)
  os.makedirs(workdir, exist_ok=True)
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  gen = config.generation
  texts = prompts_lib.read_prompts(config, tokenizer)  # a bad prompts_file fails before loading
  cfg, params = loading.load_model(config.model, tokenizer, seed=config.seed)
  mesh = parallel.decode_mesh(config.mesh)
  if mesh is not None:
    parallel.check_decode_mesh(mesh, gen.batch_size, {"model": cfg.n_kv_heads},
                               "generation.batch_size")
    params = parallel.place_params(params, mesh)
  decode = None if entry is None else _speculative(config, tokenizer, cfg, params, sampling,
                                                   mesh, entry, source)
  if config.get("chat", False):
    if not hasattr(tokenizer, "chat_prompt"):
      raise ValueError(f"chat=True but tokenizer {tokenizer.name!r} has no chat template; set "
                       "--config.chat=False.")
    texts_in = [tokenizer.chat_prompt(t) for t in texts]
  else:
    texts_in = texts
  stop_ids = tokenizer.stop_ids if gen.stop_at_eos else ()
  rows = []
  rng = jax.random.key(config.seed)
  for start in range(0, len(texts_in), gen.batch_size):
    chunk = texts_in[start:start + gen.batch_size]
    # Pad the batch to batch_size so every chunk reuses one compiled program.
    padded = chunk + [chunk[-1]] * (gen.batch_size - len(chunk))
    prompts = generate_lib.encode_prompts(tokenizer, padded, gen.max_prompt_tokens)
    t0 = time.perf_counter()
    key = jax.random.fold_in(rng, start)
    if decode is None:
      out = generate_lib.generate(params, prompts, key, cfg=cfg, sampling=sampling,
                                  max_new_tokens=gen.max_new_tokens, stop_ids=stop_ids, mesh=mesh)
    else:
      out = decode(prompts, key, stop_ids)
    new = out.new_tokens()
    seconds = time.perf_counter() - t0
    for i, ids in enumerate(new[:len(chunk)]):
      stopped = bool(ids) and ids[-1] in stop_ids
      row = dict(prompt=texts[start + i], completion=tokenizer.decode(ids[:-1] if stopped else ids),
                 new_tokens=len(ids), stopped=stopped, batch_seconds=seconds)
      if decode is not None:
        calls = int(out.stats.verifier_calls[i])
        row.update(method=config.method, verifier_calls=calls,
                   block_efficiency=round(len(ids) / calls, 4) if calls else None)
      rows.append(row)
  if not parallel.is_writer():  # multi-host: every process decoded its rows; one writes
    return rows
  with open(os.path.join(workdir, "generations.jsonl"), "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  for row in rows:
    tau = f" (τ = {row['block_efficiency']})" if row.get("block_efficiency") else ""
    print(f"\n=== prompt: {row['prompt']!r}{tau}\n{row['completion']}")
  return rows


def _speculative(config, tokenizer, v_cfg, v_params, sampling, mesh, entry, source):
  """(prompts, rng, stop_ids) -> the speculative loop's output with config.drafter and the
  method `entry` (built through the registry, as evaluate builds it)."""
  loading.load_source(source, config.drafter, tokenizer, v_cfg, v_params, seed=config.seed,
                      data_dir=config.data.get("data_dir") or None,
                      load_drafter=entry.method.needs_model)
  if mesh is not None and source.d_params is not None:
    source.d_params = parallel.place_params(source.d_params, mesh)
  built = methods.build(entry, source)
  verifier = verifier_lib.lm_verifier(v_cfg, built.drafter.verifier_layers)
  loop.check_pair(verifier, built.drafter)
  gen = config.generation

  def decode(prompts, rng, stop_ids):
    return loop.speculative_generate(
        v_params, built.params, prompts, rng, verifier=verifier, drafter=built.drafter,
        sampling=sampling, max_new_tokens=gen.max_new_tokens, stop_ids=stop_ids, mesh=mesh)

  return decode
