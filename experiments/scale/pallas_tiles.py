"""The decode step on the hand-written kernels (`spec_jax/models/pallas_layers.py`) for several
tile choices (`pallas_attention.Tiles`), beside XLA's fused layers, in one process on one GPU.

The kernels' tiles were chosen without a GPU; this is the sweep that picks them with one short
run. Each setting changes one field of the default `Tiles()`; beside them run XLA's fused layers
and the same with one attention kernel a layer (`attn_kernel`). Every program decodes `--steps`
greedy tokens in one compiled loop (the benchmark's fixed decode loop without sampling or stop
tokens) from a random 64-token context, random weights (seed 0), and the programs are timed
round-robin (medians of `--repeats`). Rows: ms a step, the memory roofline (parameter bytes
over the read bandwidth measured in the same run, `timing.memory_bandwidth`), × roofline and
× XLA's fused layers, and how far each setting's greedy tokens agree with XLA's fused layers on the same device
(`tokens_agree`: steps before the first differing token; `top_logit_diff`: the largest
difference of the chosen token's logit over those steps), so a kernel that lowers to Triton
differently from the interpreter the tests run shows as a row that disagrees, not as a fast one.
A program that fails to compile gets a row with its error instead of ending the sweep.

  python experiments/scale/pallas_tiles.py --out experiments/scale/gpu_bars/pallas-tiles
  python experiments/scale/pallas_tiles.py --size smollm2-135m --dtype bfloat16 --batch 8 ...
  python experiments/scale/pallas_tiles.py --budget_s 150   # the settings compiled by then

`bash experiments/scale/gpu.sh kernels` runs it after its steps, and `bars` the column, depth
and split settings. 1-2 s of compiling a setting on an H200 (135M shape). On CPU the kernels
run in Pallas's interpreter: the numbers mean nothing there (tests/test_pallas_layers.py runs it
so, on test-tiny, to keep it working).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

# One field of Tiles() changed per setting: what a GPU run should tell apart first.
SETTINGS = ("default", "columns=4", "columns=2", "programs=64", "programs=128", "programs=512",
            "tile=4096", "tile=16384", "num_warps=2", "num_warps=8", "num_stages=1",
            "num_stages=3", "depth=4", "depth=16", "depth=32", "split=32")
CONTEXT = 64


def parse_setting(text: str):
  """'default' or 'field=value' → Tiles; ValueError naming the field."""
  from spec_jax.models import pallas_attention  # noqa: PLC0415
  if text == "default":
    return pallas_attention.Tiles()
  field, _, value = text.partition("=")
  names = [f.name for f in dataclasses.fields(pallas_attention.Tiles)]
  if field not in names or not value.isdigit() or int(value) < 1:
    raise ValueError(f"--settings: {text!r} is not 'default' or FIELD=N with FIELD one of "
                     f"{', '.join(names)} and N >= 1.")
  return dataclasses.replace(pallas_attention.Tiles(), **{field: int(value)})


def decode_loop(cfg, steps: int):
  """jitted (params, cache, token[B], position) → ((tokens[B, steps], top logits[B, steps]),
  cache): `steps` greedy steps, each step's token and its logit."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from spec_jax.models import decoder  # noqa: PLC0415
  apply = decoder.make_apply(cfg)

  def run(params, cache, token, position):
    def step(carry, i):
      token, cache = carry
      positions = jnp.full((token.shape[0], 1), position + i, jnp.int32)
      logits, _, cache = apply(params, token[:, None], positions, cache)
      logits = logits[:, 0].astype(jnp.float32)
      token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      return (token, cache), (token, jnp.max(logits, axis=-1))
    (_, cache), (tokens, tops) = jax.lax.scan(step, (token, cache), jnp.arange(steps))
    return (tokens.T, tops.T), cache

  return jax.jit(run, donate_argnums=1)


def agreement(tokens, tops, ref_tokens, ref_tops) -> tuple[int, float]:
  """(steps before the first token that differs from the reference in any row, the largest
  |top logit − the reference's| over those steps; 0.0 when the first step differs)."""
  import numpy as np  # noqa: PLC0415
  same = np.all(np.asarray(tokens) == np.asarray(ref_tokens), axis=0)
  agree = int(np.argmin(same)) if not same.all() else int(same.size)
  diff = np.abs(np.asarray(tops, np.float64) - np.asarray(ref_tops, np.float64))[:, :agree]
  return agree, float(diff.max()) if agree else 0.0


def parse_args(argv=None):
  """(flags, {setting text: Tiles}); a flag or a setting this script does not know is refused
  here, before any work."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="smollm2-135m", help="a family size or a preset")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--settings", default=",".join(SETTINGS),
                      help="comma-separated: default, or FIELD=N of pallas_attention.Tiles")
  parser.add_argument("--bandwidth_mb", type=int, default=512)
  parser.add_argument("--budget_s", type=float, default=0.0,
                      help="stop compiling settings (in --settings order) once this many "
                           "seconds have passed, and time the ones compiled; 0: no bound")
  parser.add_argument("--out", default=str(HERE / "gpu_bars" / "pallas-tiles"))
  args = parser.parse_args(argv)
  return args, {text: parse_setting(text) for text in args.settings.split(",")}


def main(argv=None) -> list[dict]:
  args, settings = parse_args(argv)  # before any work
  from spec_jax import cli  # noqa: PLC0415
  cli.set_xla_defaults()
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from spec_jax.evaluation import report, timing  # noqa: PLC0415
  from spec_jax.models import decoder, families, layers, pallas_attention  # noqa: PLC0415
  vocab = 257 if args.size == "test-tiny" else 49152
  cfg = families.model_config(args.size, vocab_size=vocab, dtype=args.dtype,
                              param_dtype=args.dtype)
  cfg = dataclasses.replace(cfg, fused=True)
  kernels_cfg = dataclasses.replace(cfg, pallas=True)  # refuses a family the kernels lack
  params = decoder.init_params(cfg, jax.random.key(0))
  size = CONTEXT + args.steps
  token = jnp.zeros((args.batch,), jnp.int32)

  def timed_call(run_cfg, tiles):
    run = decode_loop(run_cfg, args.steps)
    state = {"cache": layers.init_cache(cfg, args.batch, size)}

    def call():
      pallas_attention.TILES = tiles  # read when `run` is traced, on its first call
      # Every call decodes the same: it rewrites the same slots, which only it reads.
      state["out"], state["cache"] = run(params, state["cache"], token, CONTEXT)
      return state["out"]
    call.state = state
    return call

  # XLA's fused layers, then the same with one attention kernel a layer (`attn_kernel`: its
  # row checks that kernel on the GPU too), then the kernels' layers for each setting.
  calls = {"xla-fused": timed_call(cfg, pallas_attention.Tiles()),
           "xla-fused attn_kernel": timed_call(dataclasses.replace(cfg, attn_kernel=True),
                                               pallas_attention.Tiles())}
  calls.update({f"pallas {text}": timed_call(kernels_cfg, tiles)
                for text, tiles in settings.items()})
  # Compiling is most of the sweep's time: compile in order (XLA's layers first, always) while
  # the budget lasts, so a bounded run (gpu.sh) times what it compiled instead of being killed
  # before any row.
  start, compile_s, failed = time.perf_counter(), {}, {}
  for name in list(calls):
    if args.budget_s and compile_s and time.perf_counter() - start > args.budget_s:
      print(f"budget of {args.budget_s:.0f} s spent: {name} and later settings skipped",
            flush=True)
      break
    try:
      compile_s[name] = timing.timed(calls[name])[1]
    except Exception as e:  # noqa: BLE001  (a setting Triton refuses: its row says why)
      if name == "xla-fused":
        raise
      failed[name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
      print(f"{name} failed: {failed[name]}", flush=True)
      continue
    print(f"compiled {name} in {compile_s[name]:.1f} s", flush=True)
  calls = {n: c for n, c in calls.items() if n in compile_s}
  print(f"{len(calls)} programs, {args.steps} steps each; timing (round-robin, "
        f"{args.repeats} repeats)", flush=True)
  times = timing.round_robin(calls, args.repeats)
  pallas_attention.TILES = pallas_attention.Tiles()
  bandwidth = timing.memory_bandwidth(args.bandwidth_mb * 2**20, args.repeats)
  roofline_ms = 1000 * timing.decode_read_bytes(params) / bandwidth
  base_ms = 1000 * times["xla-fused"]["median_s"] / args.steps
  outputs = {name: jax.device_get(call.state["out"]) for name, call in calls.items()}
  rows = []
  for name, t in times.items():
    ms = 1000 * t["median_s"] / args.steps
    tiles = settings.get(name.removeprefix("pallas "))
    agree, top_diff = agreement(*outputs[name], *outputs["xla-fused"])
    rows.append(dict(
        run=name, size=args.size, dtype=args.dtype, batch_size=args.batch, steps=args.steps,
        layers="pallas" if tiles else name.replace(" ", "+"),
        tiles=None if tiles is None else dataclasses.asdict(tiles),
        ms_per_step=round(ms, 4), roofline_ms_per_step=round(roofline_ms, 5),
        vs_roofline=round(ms / roofline_ms, 3), vs_xla_fused=round(ms / base_ms, 3),
        tokens_agree=agree, top_logit_diff=float(f"{top_diff:.3g}"),
        compile_s=round(max(compile_s[name] - t["median_s"], 0.0), 2),
        memory_bandwidth_gb_s=round(bandwidth / 1e9, 1),
        device=timing.device_description(), device_kind=jax.devices()[0].device_kind,
        jax=jax.__version__))
  rows += [dict(run=name, size=args.size, dtype=args.dtype, batch_size=args.batch,
                steps=args.steps, error=error, device_kind=jax.devices()[0].device_kind,
                jax=jax.__version__) for name, error in failed.items()]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  report.write_results(str(out), rows, echo=False)
  lines = [f"| run | ms a step | × roofline ({roofline_ms:.3f} ms) | × XLA fused | compile s | "
           f"tokens as XLA's (of {args.steps}) | top logit diff |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  lines += [f"| {r['run']} | {r['ms_per_step']:.3f} | {r['vs_roofline']:.2f} | "
            f"{r['vs_xla_fused']:.2f} | {r['compile_s']:.0f} | {r['tokens_agree']} | "
            f"{r['top_logit_diff']:.2g} |" if "error" not in r
            else f"| {r['run']} | failed: {r['error']} | | | | | |" for r in rows]
  text = (f"{args.size} {args.dtype}, batch {args.batch}, {args.steps} steps, "
          f"{rows[0]['device']}, jax {jax.__version__}\n\n" + "\n".join(lines) + "\n")
  (out / "results.md").write_text(text)
  print(text, flush=True)
  (out / "command.json").write_text(json.dumps(sys.argv) + "\n")
  return rows


if __name__ == "__main__":
  main()
