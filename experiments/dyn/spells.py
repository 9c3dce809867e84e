"""Slow spells of the machine, as a time series: the dyn suite's verifier forwards and a memory
read, one after another for a while, and the spans in which the one-token forward ran slow.

  python experiments/dyn/spells.py --seconds 300 --out /tmp/spells.json
  python experiments/dyn/spells.py --seconds 420 --settle-ms 31.6   # r(33) timed as evaluate does

Each turn times, once each and in this order, the verifier's one-token and 33-token forwards at
the suite's cache size for chat (its widest prompt bucket, 512, + 96 new tokens + 33, halfway
through the new tokens: what `bench.verifier_cost_ratio` times for r(33)) and a GEMV read of
512 MiB (`timing.MemoryReads`). One forward a call (`passes=1`), so a turn takes ~0.16 s on 2
cores. Prints each series' median over turns out of a spell and in one (one-token forward over
1.6× its median), r(33) in both, and the spells over 3 s; --out writes every turn.

--settle-ms S: instead, r(33) timed over and over as evaluate times it
(`timing.settled_round_robin`: median of 5 turns of `ForwardCall` loops, timed again after a
pause while the one-token forward runs over 1.5 × S ms; S: the autoregressive step, 31.6 ms in
the suite's chat run). Prints each timing (its tries, the kept reference over S, r(33) of the
first try and of the kept one) and how many were timed again.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from spec_jax import cli  # noqa: E402

if __name__ == "__main__":  # run as a script: as the launcher does, before jax loads
  cli.set_malloc_defaults()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seconds", type=float, default=300.0, help="how long to keep timing")
  parser.add_argument("--out", default="", help="a JSON file for every turn's times (ms)")
  parser.add_argument("--settle-ms", type=float, default=0.0,
                      help="time r(33) as evaluate does against this autoregressive step (ms)")
  args = parser.parse_args(argv)
  if args.seconds <= 0:
    parser.error(f"--seconds={args.seconds} must be > 0.")

  import jax  # noqa: PLC0415  (after the malloc settings)

  from experiments.dyn import config as dyn_config  # noqa: PLC0415
  from spec_jax import loading  # noqa: PLC0415
  from spec_jax.data import tokenizer as tokenizer_lib  # noqa: PLC0415
  from spec_jax.decoding.drafters import features  # noqa: PLC0415
  from spec_jax.evaluation import timing  # noqa: PLC0415
  from spec_jax.models import llama  # noqa: PLC0415

  config = dyn_config.get_config("suite")
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer)
  prompt, new = 512, int(config.eval.new_tokens)
  if args.settle_ms > 0:
    return settle(timing, v_cfg, v_params, llama, features, prompt, new, args)
  calls = timing.forward_calls(features.timing_apply(v_cfg), v_params,
                               lambda: llama.init_cache(v_cfg, 1, prompt + new + 33),
                               batch_size=1, tokens=(1, 33), position=prompt + new // 2,
                               passes=1)
  fns = {"v1": calls[1], "v33": calls[33],
         "read": timing.MemoryReads(passes=1).calls["read_gemv"]}
  for fn in fns.values():  # compile, and once more for a committed cache
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
  rows, start = [], time.perf_counter()
  while time.perf_counter() - start < args.seconds:
    row = {"t": round(time.perf_counter() - start, 2)}
    for name, fn in fns.items():
      row[name] = round(1e3 * timing.timed(fn)[1], 2)
    rows.append(row)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f)

  found = summarize(rows, list(fns))
  print(f"{len(rows)} turns over {rows[-1]['t']:.0f} s; {found['in_spell']} in a spell "
        f"(one-token forward over {found['limit']:.1f} ms)")
  for label, med in found["medians"].items():
    print(f"{label}: one-token {med['v1']:.1f} ms, 33-token {med['v33']:.1f} ms, "
          f"r(33) {med['v33'] / med['v1']:.2f}, 512 MiB read {med['read']:.1f} ms")
  longer = [f"{a:.0f}-{b:.0f} s" for a, b in found["spells"] if b - a > 3]
  print(f"spells over 3 s: {', '.join(longer) or 'none'}; "
        f"{len(found['spells']) - len(longer)} shorter")


# A turn is in a spell when its one-token forward ran over this many times the median turn's.
SPELL_FACTOR = 1.6


def summarize(rows: list[dict], names: list[str]) -> dict:
  """The turns (dicts: t, the turn's start in seconds, and each name's ms) read as spells: limit
  (ms: SPELL_FACTOR × the median one-token forward, "v1"), in_spell (turns over it), medians
  ({"out of a spell" / "in a spell": {name: median ms}}, a group only where it has turns) and
  spells ([(start s, end s)]: runs of turns over the limit, each ending at the first turn back
  under it, or at the last turn)."""
  limit = SPELL_FACTOR * statistics.median(r["v1"] for r in rows)
  groups = {"out of a spell": [r for r in rows if r["v1"] <= limit],
            "in a spell": [r for r in rows if r["v1"] > limit]}
  medians = {label: {n: statistics.median(r[n] for r in group) for n in names}
             for label, group in groups.items() if group}
  spells, begun = [], None
  for r in rows:
    if r["v1"] > limit and begun is None:
      begun = r["t"]
    elif r["v1"] <= limit and begun is not None:
      spells.append((begun, r["t"]))
      begun = None
  if begun is not None:
    spells.append((begun, rows[-1]["t"]))
  return dict(limit=limit, in_spell=len(groups["in a spell"]), medians=medians, spells=spells)


def settle(timing, v_cfg, v_params, llama, features, prompt: int, new: int, args) -> None:
  """--settle-ms: settled r(33) timings for args.seconds, each try's r(33) recorded."""
  calls = {str(t): call for t, call in timing.forward_calls(
      features.timing_apply(v_cfg), v_params,
      lambda: llama.init_cache(v_cfg, 1, prompt + new + 33), batch_size=1, tokens=(1, 33),
      position=prompt + new // 2).items()}
  tries, plain = [], timing.round_robin

  def recorded(fns, *a, **kw):  # every try's r(33), the kept one among them
    times = plain(fns, *a, **kw)
    tries.append(times["33"]["median_s"] / times["1"]["median_s"])
    return times

  timing.round_robin = recorded
  out, start = [], time.perf_counter()
  while time.perf_counter() - start < args.seconds:
    tries.clear()
    usage = {}
    times = timing.settled_round_robin(calls, 5, reference="1", expected_s=args.settle_ms / 1e3,
                                       usage=usage)
    out.append(dict(t=round(time.perf_counter() - start), tries=usage["tries"],
                    reference=usage["reference_vs_expected"], first_r=round(tries[0], 2),
                    kept_r=round(times["33"]["median_s"] / times["1"]["median_s"], 2)))
    print(out[-1], flush=True)
  timing.round_robin = plain
  again = [o for o in out if o["tries"] > 1]
  print(f"{len(out)} timings, {len(again)} timed again; r(33) of the first try "
        f"{min(o['first_r'] for o in out)}-{max(o['first_r'] for o in out)}, kept "
        f"{min(o['kept_r'] for o in out)}-{max(o['kept_r'] for o in out)}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f)


if __name__ == "__main__":
  sys.exit(main())
