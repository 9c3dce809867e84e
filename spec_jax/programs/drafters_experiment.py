"""Program `drafters_experiment`: the cost–acceptance frontier of drafters (issue "drafters that
pay"): drafters trained from scratch, verifier-initialised drafters (a subset of the verifier's
blocks, distilled), feature drafters and reduced draft vocabularies, each measured by evaluate,
on the experiment harness (`spec_jax.evaluation.experiment`).

  python launch.py --config experiments/drafters/config.py --workdir experiments/drafters

The runs, entries in `order` (bases before their variants), each read back while its digest
matches so a killed experiment resumes:
  general_data       the general-domain dataset (program general_data), once, for entries with
                     data='general';
  train_<name>       the drafter built in <workdir>/runs/train/<name>: kind 'scratch' with
                     train_lm, 'vinit', 'features' and 'vocab' with distill (models/draft_init.py
                     size options); its rows: build_s (wall time), params_m, steps;
  eval_<name>_<dom>  evaluate on each domain's prompts (γ in `gammas` in domain, `out_gammas` out
                     of it) in <workdir>/runs/eval/<name>_<dom>, beside the autoregressive
                     baseline measured in the same process.
Then every built drafter's c and r(γ + 1) are timed round robin (`measure_costs`, cached in
runs/costs.json). `carry` takes entries' rows from the results.json at `carry_from`, `skip` leaves
entries out. `render_only` runs and times nothing; a run missing from runs/ reports the rows the
workdir's results.json holds for it. Rows, results.md, plots: evaluation/drafters_report.py.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import time

from configs import common
from spec_jax import checks, loading
from spec_jax.data.tokenizer import get_tokenizer
from spec_jax.decoding.drafters import features
from spec_jax.evaluation import drafters_report, experiment, report, timing
from spec_jax.models import llama
from spec_jax.programs import distill as distill_program
from spec_jax.programs import evaluate, train_lm

KINDS = ("scratch", "vinit", "features", "vocab")


def _carry_skip(config) -> tuple[tuple[str, ...], tuple[str, ...]]:
  return tuple(config.get("carry", ()) or ()), tuple(config.get("skip", ()) or ())


def check_config(config, workdir: str | None = None) -> None:
  """Every drafter entry names a known kind and what it needs, before anything runs; `order`
  lists every entry once, each base before its variants; carried rows exist."""
  del workdir
  batch_sizes = tuple(config.eval.eval.batch_sizes)
  if len(batch_sizes) != 1:
    raise ValueError(f"eval.eval.batch_sizes={batch_sizes}: the drafters' frontier compares "
                     "them at one batch size (a row per drafter, domain, T and γ). Fix: give one, "
                     "e.g. --config.eval.eval.batch_sizes=1, and run the experiment per size.")
  for name in ("scratch_steps", "distill_steps", "vocab_steps"):
    checks.integer(config[name], name, 1, " (training steps of the entries of that kind "
                   "without steps of their own)")
  checks.integer(config.get("cost_timings", 1), "cost_timings", 1,
                 " (timings of each drafter's c and r, the fastest kept; 3 on a shared machine)")
  if sorted(config.order) != sorted(config.drafters):
    raise ValueError(f"order={tuple(config.order)} must list every entry of drafters "
                     f"({sorted(config.drafters)}) once.")
  carry, skip = _carry_skip(config)
  unknown = [n for n in (*carry, *skip) if n not in config.drafters]
  if unknown:
    raise ValueError(f"carry / skip list {unknown}, which are not entries of drafters "
                     f"({sorted(config.drafters)}).")
  for name, spec in config.drafters.items():
    for dep in (spec.get("base"), spec.get("source")):
      if name not in (*carry, *skip) and dep in (*carry, *skip):
        how = "carried" if dep in carry else "skipped"
        raise ValueError(
            f"drafters.{name} starts from {dep!r}, which is {how} this run (no drafter to "
            f"start from). Fix: add {name!r} to carry or skip, or take {dep!r} out of it (then "
            "it is built).")
      if dep in config.drafters and list(config.order).index(dep) > list(config.order).index(name):
        raise ValueError(f"order: {dep!r} must come before {name!r}, which starts from it.")
  for name, spec in config.drafters.items():
    kind = spec.get("kind")
    if kind not in KINDS:
      raise ValueError(f"drafters.{name}.kind={kind!r}: choose one of {KINDS}.")
    if kind == "features" and ":features=1" not in str(spec.get("size", "")):
      raise ValueError(f"drafters.{name} (features) needs a feature drafter's size, e.g. "
                       "'smollm2-135m:layers=29:features=1'.")
    if kind in ("scratch", "vinit", "features") and not spec.get("size"):
      raise ValueError(f"drafters.{name} ({kind}) needs a size, e.g. 'drafter-s' or "
                       "'smollm2-135m:layers=0+29'.")
    if kind == "vocab" and (spec.get("base") not in config.drafters or not spec.get("vocab")):
      raise ValueError(f"drafters.{name} (vocab) needs base=<another entry> and vocab=N.")
    if spec.get("source") and spec["source"] not in config.drafters:
      raise ValueError(f"drafters.{name}.source={spec['source']!r} is not an entry.")
    if spec.get("data") not in (None, "", "general"):
      raise ValueError(f"drafters.{name}.data={spec['data']!r}: '' (the distill section's "
                       "corpus) or 'general' (the general_data program's dataset).")
  experiment.carried_rows(config, lambda r: r["drafter"])


def _train_dir(workdir: str, name: str) -> str:
  return os.path.join(workdir, "runs", "train", name)


def _steps(config, name: str) -> int:
  """An entry's training steps: its own `steps`, else its kind's."""
  spec = config.drafters[name]
  if spec.get("steps"):
    return int(spec["steps"])
  return int({"scratch": config.scratch_steps, "vinit": config.distill_steps,
              "features": config.distill_steps, "vocab": config.vocab_steps}[spec["kind"]])


def _data_of(config, name: str) -> str:
  """'general' or '' for an entry: its own, else its base's."""
  spec = config.drafters[name]
  if spec.get("data"):
    return spec["data"]
  return _data_of(config, spec["base"]) if spec.get("base") else ""


def _root_kind(config, name: str) -> str:
  """The kind of an entry, or of the entry its chain of bases starts from."""
  spec = config.drafters[name]
  return _root_kind(config, spec["base"]) if spec["kind"] == "vocab" else spec["kind"]


def build_config(config, workdir: str, name: str, general: str):
  """(the train_lm / distill config that builds entry `name`, its program's run function);
  `general`: the general-domain dataset's TFDS name."""
  spec = config.drafters[name]
  kind, steps = spec["kind"], _steps(config, name)
  if kind == "scratch":
    cfg = copy.deepcopy(config.scratch)
    cfg.model.size = spec["size"]
    cfg.train.update(num_steps=steps, warmup_steps=min(cfg.train.warmup_steps, max(steps // 10, 1)))
    return cfg, train_lm.run
  cfg = copy.deepcopy(config.distill)
  cfg.program = "distill"
  if _data_of(config, name) == "general":
    cfg.data.name = general
  if _root_kind(config, name) == "features":
    # Every position of a row trains a feature drafter (its input is the verifier's features
    # there), so rows are mostly response: the same tokens per step at little extra cost.
    cfg.data.update(prompt_tokens=int(config.features_prompt_tokens),
                    response_tokens=int(config.features_response_tokens))
  if kind in ("vinit", "features"):
    source = (_train_dir(workdir, spec["source"]) if spec.get("source")
              else cfg.verifier.checkpoint)
    cfg.drafter = common.model(size=spec["size"], checkpoint=source)
  else:
    cfg.drafter = common.model(size=f"{spec['base']}:vocab={int(spec['vocab'])}",
                               checkpoint=_train_dir(workdir, spec["base"]))
  cfg.train.update(num_steps=steps, warmup_steps=max(min(10, steps // 10), 1),
                   checkpoint_every=min(int(cfg.train.checkpoint_every), steps))
  return cfg, distill_program.run


def _build(train_fn, cfg, run_dir: str) -> dict:
  """One drafter's build: train_fn(cfg, run_dir), timed."""
  t0 = time.perf_counter()
  result = train_fn(cfg, run_dir)
  return {"build_s": round(time.perf_counter() - t0, 1),
          "params_m": round(result["num_params"] / 1e6, 2), "steps": int(cfg.train.num_steps)}


def eval_config(config, workdir: str, name: str, domain: str):
  """evaluate's config for entry `name` on `domain`'s prompts."""
  cfg = copy.deepcopy(config.eval)
  cfg.program = "evaluate"
  cfg.data.name = config.domains[domain]
  cfg.drafter = common.model(checkpoint=_train_dir(workdir, name))
  cfg.eval.gammas = tuple(config.gammas if domain == "in" else config.out_gammas)
  cfg.title = f"{config.title}: {name}, {domain} domain"
  return cfg


def eval_inputs(cfg, build: experiment.Run) -> dict:
  """What an evaluate run's result depends on beyond its digest (which covers its methods and
  sweeps): the drafter is a path, so its build's identity (digest and inputs) is named here and
  a rebuilt drafter measures again."""
  del cfg
  return dict(drafter=experiment.identity(build))


def build_inputs(config, name: str, built: dict) -> dict:
  """What a build reads by path beyond its digest: the identity of the entry it starts from
  (`source` of a vinit or features entry, `base` of a vocab entry), when this experiment builds
  that entry (`built`: name -> identity), so a changed base rebuilds every entry made from it."""
  spec = config.drafters[name]
  return {role: built[spec[role]] for role in ("source", "base")
          if spec.get(role) and spec[role] in built}


def measure_costs(config, workdir: str, names: dict) -> dict:
  """{"drafters": {name: {"ms", "verifier_ms", "c", "r": {γ: r(γ + 1)}, "passes",
  "verifier_passes", "timings", "reference_spread", "build"}}}: every built drafter's one-token
  forward against the verifier's 1- and (γ + 1)-token forwards, batch 1, the calls taking turns
  (`timing.round_robin`, median of `cost_repeats`; each call a compiled loop of `passes`
  forwards, `timing.ForwardCall`), each drafter in its own round with the verifier beside it;
  `cost_timings` such timings 15 s, 30 s, ... apart, the one whose verifier one-token forward ran
  fastest kept (`timing.kept_timing`: a shared VM's slow spells; "timings" and
  "reference_spread" record it). The evaluate runs' in-run c and r come from a handful of calls
  and scatter by ±40% here; this is the c and r the frontier uses.
  Cached in runs/costs.json with the identity of the build it timed ("build"; names: {name: that
  identity}), so a rebuilt drafter is timed again."""
  path = os.path.join(workdir, "runs", "costs.json")
  costs = _read_costs(workdir)
  # names: {name: its build's identity}; a drafter rebuilt since it was timed is timed again, and
  # so is one timed one forward a call (no "passes": a dispatch and a wait in every forward).
  todo = [n for n, ident in names.items()
          if costs["drafters"].get(n, {}).get("build") != ident
          or "passes" not in costs["drafters"][n]]
  if not todo:
    return costs
  ec = config.eval
  tokenizer = get_tokenizer(ec.tokenizer)
  v_cfg, v_params = loading.load_model(ec.verifier, tokenizer, seed=ec.seed,
                                       field="verifier.checkpoint")
  position = int(ec.data_prompt_tokens) + int(ec.eval.new_tokens) // 2
  gammas = sorted({int(g) for g in (*config.gammas, *config.out_gammas)})
  size = position + max(gammas) + 2

  def calls(cfg, params, tokens):
    return timing.forward_calls(features.timing_apply(cfg), params,
                                lambda: llama.init_cache(cfg, 1, size), batch_size=1,
                                tokens=tokens, position=position)

  v_calls = calls(v_cfg, v_params, (1, *[g + 1 for g in gammas]))
  for name in todo:
    d_cfg, d_params = loading.load_model(common.model(checkpoint=_train_dir(workdir, name)),
                                         tokenizer, field="drafter.checkpoint")
    fns = {f"v{t}": fn for t, fn in v_calls.items()}
    fns["d"] = calls(d_cfg, d_params, (1,))[1]
    times, settle = timing.kept_timing(fns, int(config.cost_repeats), reference="v1",
                                       timings=int(config.get("cost_timings", 1)))
    v1 = times["v1"]["median_s"]
    costs["drafters"][name] = {
        "ms": round(1e3 * times["d"]["median_s"], 3), "verifier_ms": round(1e3 * v1, 3),
        "c": round(times["d"]["median_s"] / v1, 4),
        "r": {str(g): round(times[f"v{g + 1}"]["median_s"] / v1, 3) for g in gammas},
        "passes": times["d"]["passes"], "verifier_passes": times["v1"]["passes"],
        **settle, "build": names[name]}
    report.write_json(path, costs)
  return costs


def _read_costs(workdir: str) -> dict:
  path = os.path.join(workdir, "runs", "costs.json")
  if not os.path.exists(path):
    return {"drafters": {}}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def runs(config, workdir: str):
  """Every entry not carried or skipped, in `order`: its build, then its evaluate runs; the
  general-domain data before the first entry that needs it; the cost timing at the end."""
  carry, skip = _carry_skip(config)
  general, built = None, {}  # built: name -> its build's identity
  for name in config.order:
    if name in (*carry, *skip):
      continue
    if _data_of(config, name) == "general" and general is None:
      cfg = copy.deepcopy(config.general)
      cfg.program = "general_data"
      got = yield experiment.Run("general_data", cfg)
      general = got[0]["dataset"] if got else ""  # render_only, not built: the builds are not run
    cfg, train_fn = build_config(config, workdir, name, general or "")
    build = experiment.Run(drafters_report.train_run(name), cfg,
                           directory=_train_dir(workdir, name),
                           fn=functools.partial(_build, train_fn),
                           inputs=build_inputs(config, name, built))
    if (yield build):
      built[name] = experiment.identity(build)
    for domain in config.domains:
      cfg = eval_config(config, workdir, name, domain)
      yield experiment.Run(drafters_report.eval_run(name, domain), cfg,
                           directory=os.path.join(workdir, "runs", "eval", f"{name}_{domain}"),
                           inputs=eval_inputs(cfg, build))
  if not config.render_only:
    measure_costs(config, workdir, built)


def _report(config, collected, command: str, *, workdir: str) -> experiment.Report:
  path = os.path.join(workdir, "results.json")
  previous = report.load_rows(path) if collected.missing and os.path.exists(path) else []
  rows, reread = drafters_report.collect_rows(config, collected, previous, _read_costs(workdir))
  return experiment.Report(
      markdown=drafters_report.render_markdown(config, rows, command, reread),
      plots=drafters_report.plots(config, rows), rows=rows)


def run(config, workdir: str) -> list[dict]:
  return experiment.run_experiment(config, workdir, runs=runs, check=check_config,
                                   report=functools.partial(_report, workdir=workdir))
