"""What a dispatch and a wait add to a timed forward: the verifier's forwards on 1 and γ + 1
tokens and its one-block feature drafter's forward, each timed one forward a call and as a
compiled loop of forwards (`timing.ForwardCall`, what `cost_model` times), all in one process,
taking turns (`timing.round_robin`, medians of --repeats), with r(γ + 1), c, the theoretical
speedup at each τ of configs/scale.py's SUITE_TAU and the break-even τ from each.

A decoding loop runs its forwards inside one compiled program; a call of one forward also pays
the host's dispatch and the wait for the result. Random weights (seeds 0 and 1), the models of
`configs/scale.py:<--arg>,cost`, a mid-generation cache (`cost.position`).

  python experiments/scale/forward_dispatch.py --arg preset=smollm2-135m --tokenizer smollm2 \
      --out DIR                                                           (2 CPU cores: ~10 s)
  python experiments/scale/forward_dispatch.py --arg gpu,dtype=float32 \
      --size smollm2-135m --tokenizer /tmp/vocab49152.json --out DIR      (gpu.sh costs)

Rows (DIR/results.json): model, T, timing ("one forward a call" / "compiled loop"), passes,
ms (per forward), ms_min, ms_max, memory_bandwidth_gb_s (`timing.MemoryReads` in the same
turns), device; then one row per timing and τ with r, c, theoretical_speedup and
break_even_tau (r(γ + 1) + γ·c).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

TIMINGS = {"one forward a call": 1, "compiled loop": None}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--arg", default="preset=smollm2-135m",
                      help="configs/scale.py's argument, without 'cost'")
  parser.add_argument("--size", default="", help="the verifier's model.size, if not the preset")
  parser.add_argument("--tokenizer", default="", help="config.tokenizer, if not 'bytes'")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
  args = parse_args(argv)  # before any work
  from spec_jax import cli  # noqa: PLC0415
  cli.set_xla_defaults()
  from configs import scale  # noqa: PLC0415
  config = scale.get_config(f"{args.arg},cost")
  if args.size:
    config.verifier.size, config.drafter.size = args.size, f"{args.size}:first=1:features=1"
  if args.tokenizer:
    config.tokenizer = args.tokenizer
  import jax  # noqa: PLC0415
  from spec_jax import loading  # noqa: PLC0415
  from spec_jax.data import tokenizer as tokenizer_lib  # noqa: PLC0415
  from spec_jax.decoding.drafters import features  # noqa: PLC0415
  from spec_jax.evaluation import metrics, report, timing  # noqa: PLC0415
  from spec_jax.models import llama  # noqa: PLC0415
  from spec_jax.programs import cost_model  # noqa: PLC0415
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  verifier = loading.load_model(config.verifier, tokenizer, seed=config.seed)
  drafter = cost_model._drafter(config, tokenizer)  # noqa: SLF001
  gamma = scale.SUITE_TAU[0][0]
  taus = [tau for g, tau in scale.SUITE_TAU if g == gamma]
  position = config.cost.position
  calls = {}
  for name, (cfg, params), tokens in (("verifier", verifier, (1, gamma + 1)),
                                      ("drafter", drafter, (1,))):
    for label, passes in TIMINGS.items():
      made = timing.forward_calls(features.timing_apply(cfg), params,
                                  lambda cfg=cfg: llama.init_cache(cfg, 1, position + gamma + 2),
                                  batch_size=1, tokens=tokens, position=position, passes=passes)
      calls.update({(name, t, label): call for t, call in made.items()})
  # The read bandwidth in the same turns: a slow spell of a shared machine shows in it.
  reads = timing.MemoryReads(config.cost.bandwidth_mb * 2**20)
  times = timing.round_robin({**calls, **reads.calls}, args.repeats, desc="forward calls")
  bandwidth_gb_s = round(reads.bandwidth(times) / 1e9, 2)
  device = timing.device_description()
  rows = [dict(model=name, T=t, timing=label, passes=times[key]["passes"],
               ms=round(1e3 * times[key]["median_s"], 4),
               ms_min=round(1e3 * times[key]["min_s"], 4),
               ms_max=round(1e3 * times[key]["max_s"], 4), memory_bandwidth_gb_s=bandwidth_gb_s,
               device=device, device_kind=jax.devices()[0].device_kind,
               size=config.verifier.size, dtype=config.verifier.dtype)
          for key in calls for name, t, label in [key]]
  for label in TIMINGS:
    ms = {(r["model"], r["T"]): r["ms"] for r in rows if r["timing"] == label}
    r_m, c = ms["verifier", gamma + 1] / ms["verifier", 1], ms["drafter", 1] / ms["verifier", 1]
    rows += [dict(model="theory", timing=label, gamma=gamma, tau=tau, r=round(r_m, 4),
                  c=round(c, 4), theoretical_speedup=round(metrics.theoretical_speedup(
                      tau, r_m=r_m, c=c, drafter_calls=gamma), 4),
                  break_even_tau=round(metrics.break_even_tau(
                      r_m=r_m, c=c, drafter_calls=gamma), 3), device=device) for tau in taus]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  report.write_results(str(out), rows, echo=False)
  lines = [f"{config.verifier.size} and its one-block feature drafter, {config.verifier.dtype}, "
           f"batch 1, {device}, medians of {args.repeats} (ms a forward); read bandwidth in "
           f"the same turns {bandwidth_gb_s} GB/s", "",
           "| timing | verifier T=1 | verifier T=" f"{gamma + 1} | drafter | passes (v / d) | "
           f"r({gamma + 1}) | c | " + " | ".join(f"theory at τ = {tau}" for tau in taus)
           + " | break-even τ |", "|---|---:|---:|---:|---|---:|---:|" + "---:|" * (len(taus) + 1)]
  for label in TIMINGS:
    get = {(r["model"], r["T"]): r for r in rows if r.get("timing") == label and "T" in r}
    theory = [r for r in rows if r["model"] == "theory" and r["timing"] == label]
    lines.append(f"| {label} | {get['verifier', 1]['ms']:.3f} | "
                 f"{get['verifier', gamma + 1]['ms']:.3f} | {get['drafter', 1]['ms']:.3f} | "
                 f"{get['verifier', 1]['passes']} / {get['drafter', 1]['passes']} | "
                 f"{theory[0]['r']:.3f} | {theory[0]['c']:.4f} | "
                 + " | ".join(f"{th['theoretical_speedup']:.3f}" for th in theory)
                 + f" | {theory[0]['break_even_tau']:.2f} |")
  text = "\n".join(lines) + "\n"
  (out / "results.md").write_text(text)
  (out / "command.json").write_text(json.dumps(sys.argv) + "\n")
  print(text, flush=True)
  return rows


if __name__ == "__main__":
  main()
