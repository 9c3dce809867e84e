"""Measurement and results of the peer benchmark (`programs/benchmark_hf`): spec_jax (OURS)
against HF transformers (PEER) on the same weights and prompts, greedy.

A `Method` is one measured row. What its numbers mean is declared on it, never read off its
method name: `drafts` (a drafter proposes tokens, so τ is measured), `speculative` (spec_jax's
loop, whose statistics give τ and α), `gamma_bound` (drafting may stop before γ). `measure`
times the methods in turns; `make_rows` gives results.json's rows, `summarize` the speedups
(summary.json) and `markdown` results.md's table.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from typing import Callable

from spec_jax.evaluation import metrics, timing

OURS, PEER = "spec_jax", "transformers"


@dataclasses.dataclass
class Method:
  """One measured row: `fn(batch) -> (new token lists, extra)` over `batches`, after an untimed
  `warmup(batch)` (spec_jax compiles there; transformers gets a short call). `extra` is the
  verifier's forward calls, or (the loop's output, verifier calls) for a speculative method.

  drafts       a drafter proposes tokens: the row's τ (block_efficiency) is measured, 1.0
               otherwise; a method that does not draft, at batch 1, is its system's greedy output
  speculative  spec_jax's loop: τ and α from its statistics, as every program computes them
  gamma_bound  γ is an upper bound (drafting stops early on low confidence): the table shows ≤γ
  label        the table's method column ("" shows `method`)
  """
  system: str
  method: str
  batch_size: int
  gamma: int | None
  schedule: str | None
  fn: Callable
  warmup: Callable
  batches: list
  drafts: bool = False
  speculative: bool = False
  gamma_bound: bool = False
  label: str = ""
  rows: list = dataclasses.field(default_factory=list)
  seconds: float = 0.0
  extras: list = dataclasses.field(default_factory=list)


def measure(methods: list[Method]) -> None:
  """Warm every method up, then time one batch at a time, round-robin over the methods
  (`timing.interleave`): on a machine shared with other jobs a slow spell then hits every method
  alike instead of whichever ran during it. A method with fewer batches (larger batch size) runs
  at evenly spread turns. Fills each method's rows, extras and seconds (summed over batches)."""
  results = timing.interleave(
      [[functools.partial(m.fn, batch) for batch in m.batches] for m in methods],
      warmups=[functools.partial(m.warmup, m.batches[0]) for m in methods],
      on_turn=lambda turn, turns: print(f"[benchmark_hf] turn {turn + 1}/{turns}", flush=True))
  for m, runs in zip(methods, results):
    for (new, extra), seconds in runs:
      m.seconds += seconds
      m.rows += new
      m.extras.append(extra)


def greedy_outputs(methods: list[Method]) -> dict[str, list]:
  """system -> its greedy batch-1 output (one token list per prompt): PEER's is the common
  reference every row is compared with, each system's own tells float differences between the
  systems apart from algorithm errors."""
  return {m.system: m.rows for m in methods if not m.drafts and m.batch_size == 1}


def make_rows(methods: list[Method], *, num_prompts: int, new_tokens: int,
              prompt_tokens: int) -> list[dict]:
  """results.json's rows, one per measured method. RuntimeError when a method emitted other
  than new_tokens per prompt (EOS stopping left on: the rows would not compare)."""
  own = greedy_outputs(methods)
  reference = own[PEER]
  versions = {p: importlib.metadata.version(p) for p in ("torch", "transformers", "jax")}
  device = timing.device_description()
  out = []
  for m in methods:
    n = sum(len(r) for r in m.rows)
    if n != num_prompts * new_tokens:
      raise RuntimeError(f"{m.system} {m.method} emitted {n} tokens, expected "
                         f"{num_prompts * new_tokens}: EOS stopping was not disabled.")
    if m.speculative:  # τ and α as every program computes them (docs/design.md §3)
      sd_metrics = metrics.summarize([o for o, _ in m.extras])
      tau, alpha = sd_metrics["block_efficiency"], round(sd_metrics["acceptance_rate"], 4)
      calls = sum(c for _, c in m.extras)
    else:  # transformers' first assisted call both prefills and verifies: every call verifies
      calls = sum(m.extras)
      tau, alpha = n / max(calls, 1), None
    tps = n / m.seconds
    out.append(dict(
        system=m.system, method=m.method, batch_size=m.batch_size, gamma=m.gamma,
        schedule=m.schedule, tokens_per_s=round(tps, 2), ms_per_token=round(1000 / tps, 2),
        identical_to_greedy=m.rows == reference, identical_to_own_greedy=m.rows == own[m.system],
        prompts_differing_from_greedy=sum(x != y for x, y in zip(m.rows, reference)),
        block_efficiency=round(tau, 3) if m.drafts else 1.0,
        acceptance_rate=alpha, verifier_calls=calls, new_tokens=n, num_prompts=num_prompts,
        prompt_tokens=prompt_tokens, seconds=round(m.seconds, 3), device=device,
        versions=versions))
  return out


def summarize(methods: list[Method], rows: list[dict], *, argmax: list[int], exports: dict,
              note: str) -> dict:
  """summary.json: spec_jax speculative's speedup at batch 1 over each transformers assisted
  schedule, spec_jax autoregressive's over transformers greedy, whether transformers greedy
  equals a plain argmax loop (`argmax`: the first prompt's tokens) and the goal per schedule."""
  tps = [(m, r["tokens_per_s"]) for m, r in zip(methods, rows)]
  greedy = {m.system: v for m, v in tps if not m.drafts and m.batch_size == 1}
  sd = next((v for m, v in tps if m.speculative and m.batch_size == 1), None)
  assisted = {m.schedule: v for m, v in tps if m.drafts and m.system == PEER}
  summary = dict(
      speedup_sd_vs_assisted={s: round(sd / v, 3) for s, v in assisted.items()} if sd else {},
      speedup_ar_vs_greedy=round(greedy[OURS] / greedy[PEER], 3),
      transformers_greedy_equals_argmax_loop=argmax == greedy_outputs(methods)[PEER][0],
      all_identical_to_greedy=all(r["identical_to_greedy"] for r in rows),
      goal="spec_jax speculative >= 1.5x transformers assisted at batch 1, identical output",
      exports={k: {f: v[f] for f in ("source", "out_dir", "bytes", "seconds")}
               for k, v in exports.items()},
      note=note)
  # Per assisted schedule: "constant" is γ as ours (the comparison), "default" is
  # transformers' own out-of-the-box schedule.
  summary["goal_met"] = {k: bool(v >= 1.5 and summary["all_identical_to_greedy"])
                         for k, v in summary["speedup_sd_vs_assisted"].items()}
  return summary


def markdown(methods: list[Method], rows: list[dict], summary: dict) -> str:
  """results.md: one table line per row (`rows[i]` measured from `methods[i]`), then the
  speedups."""
  lines = ["| system | method | batch | γ | tokens/s | ms/token | τ | identical to greedy |",
           "|---|---|---:|---|---:|---:|---:|---|"]
  for m, r in zip(methods, rows):
    gamma = f"≤{r['gamma']}" if m.gamma_bound else (r["gamma"] or "–")
    lines.append(f"| {r['system']} | {m.label or r['method']} | {r['batch_size']} | {gamma} | "
                 f"{r['tokens_per_s']:.1f} | {r['ms_per_token']:.1f} | "
                 f"{r['block_efficiency']:.2f} | {'yes' if r['identical_to_greedy'] else 'no'} |")
  speedups = ", ".join(f"{v:.2f}× vs assisted ({k})"
                       for k, v in summary["speedup_sd_vs_assisted"].items())
  lines += ["", f"spec_jax speculative decoding at batch 1: {speedups}; spec_jax autoregressive "
            f"{summary['speedup_ar_vs_greedy']:.2f}× transformers greedy. τ: tokens per "
            "verifier call (block efficiency). transformers greedy equals a plain argmax loop: "
            f"{summary['transformers_greedy_equals_argmax_loop']}."]
  return "\n".join(lines) + "\n"
