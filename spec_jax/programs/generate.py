"""Program `generate`: sample continuations for prompts and print them.

Prompts come from `config.prompts` (a tuple of strings), `config.prompts_file` (one prompt per
line, `\\n` escapes allowed), or `config.num_data_prompts` prompts from `config.data.prompt_split`
(`spec_jax.data.prompts.read_prompts`, which evaluate and benchmark_hf share).
Writes `workdir/generations.jsonl`.
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
from spec_jax.decoding import sampling as sampling_lib


def run(config, workdir: str) -> list[dict]:
  os.makedirs(workdir, exist_ok=True)
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  gen = config.generation
  sampling = sampling_lib.Sampling.from_config(gen.sampling)
  cfg, params = loading.load_model(config.model, tokenizer, seed=config.seed)
  mesh = parallel.decode_mesh(config.mesh)
  if mesh is not None:
    parallel.check_decode_mesh(mesh, gen.batch_size, {"model": cfg.n_kv_heads},
                               "generation.batch_size")
    params = parallel.place_params(params, mesh)
  texts = prompts_lib.read_prompts(config, tokenizer)
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
    out = generate_lib.generate(params, prompts, jax.random.fold_in(rng, start), cfg=cfg,
                                sampling=sampling, max_new_tokens=gen.max_new_tokens,
                                stop_ids=stop_ids, mesh=mesh)
    new = out.new_tokens()
    seconds = time.perf_counter() - t0
    for i, ids in enumerate(new[:len(chunk)]):
      stopped = bool(ids) and ids[-1] in stop_ids
      rows.append(dict(prompt=texts[start + i],
                       completion=tokenizer.decode(ids[:-1] if stopped else ids),
                       new_tokens=len(ids), stopped=stopped, batch_seconds=seconds))
  if not parallel.is_writer():  # multi-host: every process decoded its rows; one writes
    return rows
  with open(os.path.join(workdir, "generations.jsonl"), "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  for row in rows:
    print(f"\n=== prompt: {row['prompt']!r}\n{row['completion']}")
  return rows
