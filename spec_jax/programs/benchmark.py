"""Program `benchmark`: decoding throughput of a model, rows in `workdir/results.json`.

Each row: method, batch_size, new_tokens, tokens_per_s, ms_per_token (= 1000 / tokens_per_s,
i.e. wall time per emitted token over the batch), ms_per_step (wall time per emitted token of
one row, prefill included: the per-token latency a user of one row sees), prefill_ms (the same
call with one new token: prefill and the first token, the time to first token) and
ms_per_decode_step ((call − prefill call) / (new_tokens − 1): one decode step, the time per
output token), compile_s, device, and the memory roofline: memory_bandwidth_gb_s
(`timing.MemoryReads`: the faster of a sum and a GEMV over 512 MiB, 16 reads per timed call
on accelerators so that dispatch does not hide the bandwidth, 8 on a CPU so that one stalled
moment does not set a call's time), roofline_ms_per_step
(the parameter bytes a step reads on one device, `timing.decode_read_bytes`: every weight once,
an untied input embedding's gathered rows aside, one device's shard of each on a mesh (`mesh`,
its axis sizes; null on one device), / bandwidth), roofline_ms_per_token (per step /
batch), vs_roofline = ms_per_step / roofline_ms_per_step and decode_vs_roofline =
ms_per_decode_step / roofline_ms_per_step; preset (model.size when it is an architecture preset,
`models/presets.py`, else null), dtype, device_kind (the device kind as JAX names it) and
xla_flags (XLA_FLAGS as the run saw it, launch.py's defaults included: `cli.XLA_DEFAULTS`). Every
call generates exactly `new_tokens` per row (stop tokens are ignored) from prompts of the
configured split, or (`benchmark.prompts="random"`) from `prompt_tokens` random token ids of a
fixed seed, which need no corpus: what random weights decode does not depend on the text.
`benchmark.loop` ("fixed", the default, or "while"; the row's `loop`): a decode loop of exactly
new_tokens − 1 steps, or the while loop that decoding with stop tokens runs, whose condition a
GPU reads back to the host every step (`generate.generate(fixed_steps=)`). The
timed region is the whole jitted generate call. The memory reads, the prefill calls and the full
calls run in turns (`timing.round_robin`, medians of `repeats`), so all of them see the same
machine: on a shared VM the measured read bandwidth moves by 10-40% between minutes and
processes, and a roofline measured apart from the decode it bounds moves the ratio as much.
`benchmark.timings` (default 1) such timings, `benchmark.pause_s` seconds apart and then doubling
(default `timing.SETTLE_WAIT_S`), keep the one whose first batch size's call ran fastest: a
shared VM's slow spells slow a decode step down ~3× and leave its memory reads as they are
(experiments/dyn/notes.md; there, timings=3). Rows carry timings and reference_spread (the
slowest timing's call of the first batch size over the kept one's).
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

from spec_jax import checks, loading, parallel
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.evaluation import report, timing
from spec_jax.models import draft_init, families, presets


def run(config, workdir: str) -> list[dict]:
  b = config.benchmark
  presets.check_dtype(config.model.dtype, "model.dtype")
  checks.integers(b.batch_sizes, "benchmark.batch_sizes")
  for name in ("new_tokens", "prompt_tokens", "repeats"):
    if name in b:
      checks.integer(b[name], f"benchmark.{name}")
  checks.integer(config.seed, "seed", 0)
  timings, pause_s = checks.timings(b, "benchmark")
  if b.get("prompts", "data") not in ("data", "random"):
    raise ValueError(f"benchmark.prompts={b.prompts!r}: 'data' (the data's prompt split) or "
                     "'random' (random token ids, no corpus).")
  if b.get("loop", "fixed") not in ("fixed", "while"):
    raise ValueError(f"benchmark.loop={b.loop!r}: 'fixed' (a loop of new_tokens − 1 steps) or "
                     "'while' (the loop that stops on stop tokens, its condition read per step).")
  variant = draft_init.parse_size(config.model.size, "model.size").variant
  if not config.model.checkpoint:
    families.check_size(variant, "model.size")
  preset = variant if variant in presets.PRESETS and not config.model.checkpoint else None
  mesh = parallel.decode_mesh(config.mesh)
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  cfg, params = loading.load_model(config.model, tokenizer, seed=config.seed)
  if mesh is not None:
    for batch_size in b.batch_sizes:
      parallel.check_decode_mesh(mesh, batch_size, {"model": cfg.n_kv_heads},
                                 f"benchmark.batch_sizes entry {batch_size}: the batch size")
    params = parallel.place_params(params, mesh)
  texts = _prompt_texts(config, tokenizer)
  sampling = sampling_lib.Sampling.from_config(config.sampling)
  device = timing.device_description()
  reads = timing.MemoryReads()
  calls = dict(reads.calls)
  for batch_size in b.batch_sizes:
    prompts = (_random_prompts(config, min(cfg.vocab_size, tokenizer.vocab_size), batch_size)
               if texts is None else generate_lib.encode_prompts(
                   tokenizer, texts[:batch_size], b.prompt_tokens,
                   field="benchmark.prompt_tokens"))

    def call(prompts=prompts, new_tokens=b.new_tokens):
      return generate_lib.generate(params, prompts, jax.random.key(config.seed), cfg=cfg,
                                   sampling=sampling, max_new_tokens=new_tokens, mesh=mesh,
                                   fixed_steps=b.get("loop", "fixed") == "fixed").tokens

    calls[batch_size] = call
    calls[batch_size, "prefill"] = functools.partial(call, new_tokens=1)
  times, settle = timing.kept_timing(calls, b.repeats, reference=b.batch_sizes[0],
                                     timings=timings, pause_s=pause_s, desc="benchmark")
  bandwidth = reads.bandwidth(times)
  # Per device: on a mesh each device reads its own shard of the weights from its own memory.
  roofline_step_ms = 1e3 * timing.decode_read_bytes(params, timing.shard_bytes) / bandwidth
  rows = []
  for batch_size in b.batch_sizes:
    t, prefill = times[batch_size], times[batch_size, "prefill"]
    tokens_per_s = batch_size * b.new_tokens / t["median_s"]
    step_ms = 1000 * t["median_s"] / b.new_tokens
    decode_ms = (1000 * (t["median_s"] - prefill["median_s"]) / (b.new_tokens - 1)
                 if b.new_tokens > 1 else None)
    rows.append(dict(
        method="autoregressive", sampling="greedy" if sampling.greedy else str(sampling),
        batch_size=batch_size, new_tokens=b.new_tokens, prompt_tokens=b.prompt_tokens,
        tokens_per_s=round(tokens_per_s, 2), ms_per_token=round(1000 / tokens_per_s, 3),
        ms_per_step=round(step_ms, 3), prefill_ms=round(1000 * prefill["median_s"], 2),
        ms_per_decode_step=None if decode_ms is None else round(decode_ms, 3),
        compile_s=round(t["compile_s"], 2), repeats=b.repeats, device=device,
        memory_bandwidth_gb_s=round(bandwidth / 1e9, 2),
        roofline_ms_per_step=round(roofline_step_ms, 6),
        roofline_ms_per_token=round(roofline_step_ms / batch_size, 6),
        vs_roofline=round(step_ms / roofline_step_ms, 3),
        decode_vs_roofline=None if decode_ms is None else round(decode_ms / roofline_step_ms, 3),
        mesh=None if mesh is None else dict(mesh.shape),
        loop=b.get("loop", "fixed"), fused=cfg.fused, unrolled=cfg.unrolled,
        decode_unrolled=cfg.decode_unrolled, out_major=cfg.out_major, pallas=cfg.pallas,
        attn_kernel=cfg.attn_kernel, **settle,
        model=config.model.checkpoint or config.model.size, preset=preset, dtype=cfg.dtype,
        device_kind=jax.devices()[0].device_kind, xla_flags=os.environ.get("XLA_FLAGS", "")))
  base = rows[0]["tokens_per_s"]
  for row in rows:  # throughput gain of batching, against batch_sizes[0] measured in this run
    row["throughput_vs_first_batch_size"] = round(row["tokens_per_s"] / base, 3)
  report.write_results(workdir, rows)
  return rows


def _prompt_texts(config, tokenizer) -> list[str] | None:
  """The data's prompts for the largest batch, or None for random prompts."""
  b, d = config.benchmark, config.data
  if b.get("prompts", "data") == "random":
    return None
  from spec_jax.data import pipeline  # noqa: PLC0415 (random prompts need no corpus or TFDS)
  return pipeline.load_prompts(d.name, d.prompt_split, tokenizer, num=max(b.batch_sizes),
                               prompt_tokens=b.prompt_tokens, seed=config.seed,
                               data_dir=d.data_dir or None, text_key=d.text_key)


def _random_prompts(config, vocab_size: int, batch_size: int) -> generate_lib.Prompts:
  """batch_size full-length prompts of random token ids below vocab_size (seed config.seed)."""
  ids = np.random.default_rng(config.seed).integers(
      0, vocab_size, (batch_size, config.benchmark.prompt_tokens))
  return generate_lib.pad_prompts(ids.tolist(), config.benchmark.prompt_tokens, 0,
                                  "benchmark.prompt_tokens")
