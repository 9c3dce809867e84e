"""Program `drafters_experiment`: the cost–acceptance frontier of drafters (issue "drafters that
pay"): drafters trained from scratch, verifier-initialised drafters (a subset of the verifier's
blocks, distilled) and reduced draft vocabularies, each measured by the evaluate program.

  python launch.py --config experiments/drafters/config.py --workdir experiments/drafters

1. Builds every entry of `drafters` into <workdir>/runs/train/<name>: kind 'scratch' with
   train_lm, 'vinit' and 'vocab' with distill (models/draft_init.py size options); a finished
   run is read back, an interrupted one resumes; its wall time goes to build.json.
2. Evaluates each drafter with the evaluate program on every domain's prompts (γ in `gammas` in
   domain, `out_gammas` out of domain; greedy and T = 1; batch 1) into
   <workdir>/runs/eval/<name>_<domain>, the autoregressive baseline measured in the same process.
3. Writes results.json, results.md (tables, the frontier, the default it picks, the goals) and
   frontier.png / speedup_vs_gamma.png. `render_only` reports what has finished.
"""

from __future__ import annotations

import copy
import json
import os
import time

from configs import common
from spec_jax import loading
from spec_jax.data.tokenizer import get_tokenizer
from spec_jax.evaluation import report, timing
from spec_jax.decoding.drafters import features
from spec_jax.models import llama
from spec_jax.programs import distill as distill_program
from spec_jax.programs import evaluate, general_data, train_lm

KINDS = ("scratch", "vinit", "features", "vocab")
ROW_KEYS = ("drafter", "kind", "params_m", "cost_ratio_c", "gamma", "temperature", "domain",
            "batch_size", "rule", "block_efficiency", "tau_se", "acceptance_rate", "speedup",
            "theoretical_speedup", "verifier_cost_ratio_r", "tokens_per_s", "ar_tokens_per_s",
            "identical_to_greedy", "dataset", "device", "build_s")


def check_config(config) -> None:
  """Every drafter entry names a known kind and what it needs, before anything runs; `order`
  lists every entry once, each base before its variants."""
  if sorted(config.order) != sorted(config.drafters):
    raise ValueError(f"order={tuple(config.order)} must list every entry of drafters "
                     f"({sorted(config.drafters)}) once.")
  carry, skip = tuple(config.get("carry", ()) or ()), tuple(config.get("skip", ()) or ())
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


def carried_rows(config) -> dict[str, list[dict]]:
  """{entry: its rows} for the entries in `carry`, read from the results.json `carry_from`
  (an earlier run whose trained drafters are gone): they are neither built nor measured again.
  ValueError naming the field when the file or an entry's rows are missing."""
  carry = tuple(config.get("carry", ()) or ())
  if not carry:
    return {}
  path = config.get("carry_from", "")
  if not path or not os.path.exists(path):
    raise ValueError(f"carry={carry} needs carry_from=<an earlier results.json>; got "
                     f"{path!r}, which does not exist.")
  with open(path, encoding="utf-8") as f:
    old = json.load(f)
  out = {n: [r for r in old if r["drafter"] == n] for n in carry}
  empty = [n for n, rows in out.items() if not rows]
  if empty:
    raise ValueError(f"carry_from={path!r} has no rows for {empty}: drop them from carry (they "
                     "are then built and measured).")
  return out


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


def _general_dataset(config, workdir: str) -> str:
  """The general-domain dataset's TFDS name, built once by the general_data program."""
  cfg = copy.deepcopy(config.general)
  cfg.program = "general_data"
  return general_data.run(cfg, os.path.join(workdir, "runs", "general_data"))["dataset"]


def _build_config(config, workdir: str, name: str):
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
    cfg.data.name = _general_dataset(config, workdir)
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


def build(config, workdir: str, name: str) -> dict | None:
  """{"dir", "build_s", "params_m"} of one drafter (None: not built, render_only)."""
  run_dir = _train_dir(workdir, name)
  steps = _steps(config, name)
  done = os.path.isdir(os.path.join(run_dir, "checkpoints", str(steps)))
  info_path = os.path.join(run_dir, "build.json")
  if not done:
    if config.render_only:
      return None
    cfg, run_fn = _build_config(config, workdir, name)
    t0 = time.perf_counter()
    result = run_fn(cfg, run_dir)
    with open(info_path, "w", encoding="utf-8") as f:
      json.dump({"build_s": round(time.perf_counter() - t0, 1),
                 "params_m": round(result["num_params"] / 1e6, 2), "steps": steps}, f)
  info = {}
  if os.path.exists(info_path):
    with open(info_path, encoding="utf-8") as f:
      info = json.load(f)
  return {"dir": run_dir, **info}


def evaluate_one(config, workdir: str, name: str, info: dict | None) -> list[dict]:
  """The SD rows of one drafter on every domain (evaluate runs read back when finished)."""
  rows = []
  for domain, dataset in config.domains.items():
    run_dir = os.path.join(workdir, "runs", "eval", f"{name}_{domain}")
    done = os.path.join(run_dir, "results.json")
    if os.path.exists(done):
      got = report.load_rows(done)
    elif config.render_only or info is None:
      continue
    else:
      cfg = copy.deepcopy(config.eval)
      cfg.program = "evaluate"
      cfg.data.name = dataset
      cfg.drafter = common.model(checkpoint=info["dir"])
      cfg.eval.gammas = tuple(config.gammas if domain == "in" else config.out_gammas)
      cfg.title = f"{config.title}: {name}, {domain} domain"
      got = evaluate.run(cfg, run_dir)
    ar = {(r["temperature"], r["batch_size"]): r["tokens_per_s"] for r in got
          if r["method"] == "autoregressive"}
    for r in got:
      if r["method"] != "sd":
        continue
      rows.append({
          **{k: r.get(k) for k in ROW_KEYS}, "drafter": name,
          "kind": config.drafters[name]["kind"], "domain": domain,
          "rule": "greedy" if r["temperature"] == 0 else "speculative",
          "ar_tokens_per_s": ar.get((r["temperature"], r["batch_size"])),
          "params_m": (info or {}).get("params_m"), "build_s": (info or {}).get("build_s")})
  return rows


def measure_costs(config, workdir: str, names: list[str]) -> dict:
  """{"verifier_ms": {T: ms}, "drafters": {name: {"ms", "c", "r": {γ: r(γ + 1)}}}}: every built
  drafter's one-token forward against the verifier's 1- and (γ + 1)-token forwards, batch 1,
  the calls taking turns (`timing.round_robin`, median of `cost_repeats`), each drafter in its
  own round with the verifier beside it. The evaluate runs' in-run c and r come from a handful
  of calls and scatter by ±40% here; this is the c and r the frontier uses. Cached in
  runs/costs.json (a drafter measured once is not measured again); it runs under render_only
  too (seconds per drafter)."""
  path = os.path.join(workdir, "runs", "costs.json")
  costs = {"drafters": {}}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      costs = json.load(f)
  todo = [n for n in names if n not in costs["drafters"]]
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
    times = timing.round_robin(fns, int(config.cost_repeats))
    v1 = times["v1"]["median_s"]
    costs["drafters"][name] = {
        "ms": round(1e3 * times["d"]["median_s"], 3), "verifier_ms": round(1e3 * v1, 3),
        "c": round(times["d"]["median_s"] / v1, 4),
        "r": {str(g): round(times[f"v{g + 1}"]["median_s"] / v1, 3) for g in gammas}}
    with open(path, "w", encoding="utf-8") as f:
      json.dump(costs, f, indent=2)
  return costs


def with_costs(rows: list[dict], costs: dict) -> list[dict]:
  """Rows with c and r(γ + 1) from `measure_costs` (cost_ratio_c, verifier_cost_ratio_r) and
  the theory column recomputed from them; evaluate's in-run figures kept as *_run."""
  out = []
  for r in rows:
    got = costs["drafters"].get(r["drafter"])
    r = dict(r)
    if got is not None:
      r["cost_ratio_c_run"], r["verifier_cost_ratio_r_run"] = (r["cost_ratio_c"],
                                                               r["verifier_cost_ratio_r"])
      r["theoretical_speedup_run"] = r["theoretical_speedup"]
      r["cost_ratio_c"] = got["c"]
      r["verifier_cost_ratio_r"] = got["r"].get(str(r["gamma"]))
      if r["verifier_cost_ratio_r"] is not None:
        r["theoretical_speedup"] = round(
            r["block_efficiency"] / (r["verifier_cost_ratio_r"] + r["gamma"] * got["c"]), 4)
    out.append(r)
  return out


def _fmt(x, spec=".2f"):
  return "–" if x is None else format(x, spec)


def _tau(r: dict | None) -> str:
  return "–" if r is None else f"{r['block_efficiency']:.2f} ± {r['tau_se'] or 0:.2f}"


def pick_default(rows: list[dict]) -> dict | None:
  """The in-domain batch-1 row with the best measured speedup (every row is lossless)."""
  cands = [r for r in rows if r["domain"] == "in" and r["speedup"] is not None]
  return max(cands, key=lambda r: r["speedup"], default=None)


def render_markdown(config, rows: list[dict], command_line: str) -> str:
  names = list(config.order)
  carried = tuple(config.get("carry", ()) or ())
  md = [f"# {config.title}", "",
        f"Command: `{command_line}`. Device: {rows[0]['device'] if rows else '?'}. "
        f"{config.eval.eval.num_prompts} prompts × {config.eval.eval.new_tokens} new tokens per "
        f"setting, batch 1, chain SD, lossless rules only (greedy and speculative sampling). "
        f"Scratch drafters: {config.scratch_steps} train_lm steps; vinit: "
        f"{config.distill_steps} distill steps (JSD[0.5], fixed Shakespeare data) from SmolLM2's "
        f"blocks; reduced vocabularies: {config.vocab_steps} more distill steps from their base.",
        "", "c = drafter cost per call / verifier cost per one-token call; r = verifier cost "
        "for γ + 1 tokens / for 1 (both: forward calls at batch 1 taking turns, median of "
        f"{config.cost_repeats}, runs/costs.json); theory = τ / (r + γ·c); speedup = SD "
        "tokens/s / AR tokens/s, measured in the same evaluate process (one timed pass per "
        "setting: expect ±10%). τ ± its standard error over "
        "prompts. params counts the whole input embedding (28.3M for SmolLM2's), which a "
        "decode step only indexes."
        + (f" Feature drafters (EAGLE): distilled on rows of {config.features_prompt_tokens} "
           f"prompt + {config.features_response_tokens} response tokens, with the feature loss."
           if any(config.drafters[n]["kind"] == "features" for n in names) else "")
        + (f" Rows of {', '.join(carried)} are carried from `{config.carry_from}` (built and "
           "measured by an earlier run whose drafters are gone)." if carried else ""), ""]
  by = {(r["drafter"], r["domain"], r["temperature"], r["gamma"]): r for r in rows}
  fg = int(config.frontier_gamma)
  md += [f"## The frontier at γ = {fg}", "",
         "| drafter | params (M) | build (s) | c | τ greedy | τ T=1 | τ T=1 out "
         "| speedup greedy | speedup T=1 | theory T=1 |", "|---" + "|---:" * 9 + "|"]
  for n in names:
    g, s, o = (by.get((n, "in", 0.0, fg)), by.get((n, "in", 1.0, fg)),
               by.get((n, "out", 1.0, fg)))
    any_row = g or s or o
    if any_row is None:
      md.append(f"| {n} | – | – | – | – | – | – | – | – | – |")
      continue
    md.append(f"| {n} | {_fmt(any_row['params_m'])} | {_fmt(any_row['build_s'], '.0f')} | "
              f"{_fmt(any_row['cost_ratio_c'], '.3f')} | {_tau(g)} | {_tau(s)} | {_tau(o)} | "
              f"{_fmt(g and g['speedup'])} | {_fmt(s and s['speedup'])} | "
              f"{_fmt(s and s['theoretical_speedup'])} |")
  md += ["", "## Every row", "",
         "| drafter | domain | T | γ | c | r | τ | α | speedup | theory |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in sorted(rows, key=lambda r: (names.index(r["drafter"]), r["domain"], r["temperature"],
                                       r["gamma"])):
    md.append(f"| {r['drafter']} | {r['domain']} | {r['temperature']:g} | {r['gamma']} | "
              f"{_fmt(r['cost_ratio_c'], '.3f')} | {_fmt(r['verifier_cost_ratio_r'])} | "
              f"{r['block_efficiency']:.2f} ± {r['tau_se'] or 0:.2f} | "
              f"{_fmt(r['acceptance_rate'])} | {_fmt(r['speedup'])} | "
              f"{_fmt(r['theoretical_speedup'])} |")
  md += ["", "## Goals and the default", ""]
  best = pick_default(rows)
  if best is not None:
    md.append(f"- Best measured in-domain speedup: **{best['drafter']}** at γ = "
              f"{best['gamma']}, T = {best['temperature']:g}: {best['speedup']:.2f}× (τ "
              f"{best['block_efficiency']:.2f}, c {best['cost_ratio_c']:.3f}).")
  for n in names:
    s, o = by.get((n, "in", 1.0, fg)), by.get((n, "out", 1.0, fg))
    if s is None:
      continue
    r, c = s["verifier_cost_ratio_r"], s["cost_ratio_c"]
    need = None if r is None or c is None else r + fg * c
    md.append(f"- {n}: τ(γ={fg}, T=1, in) {s['block_efficiency']:.2f} (goal ≥ 2.0: "
              f"{'met' if s['block_efficiency'] >= 2.0 else 'not met'}); out of domain "
              f"{_fmt(o and o['block_efficiency'])} (goal ≥ 1.5: "
              f"{'met' if o and o['block_efficiency'] >= 1.5 else 'not met'}); SD beats AR "
              f"needs τ > r + {fg}c = {_fmt(need)}.")
  faster = [r for r in rows if r["speedup"] and r["speedup"] > 1.0]
  md.append(f"- Lossless settings where SD is faster than AR at batch 1: {len(faster)} of "
            f"{len(rows)}" + (": " + ", ".join(
                f"{r['drafter']} {r['domain']} T={r['temperature']:g} γ={r['gamma']} "
                f"({r['speedup']:.2f}×)" for r in sorted(faster, key=lambda r: -r["speedup"])[:8])
                if faster else "") + ".")
  md += ["", "![frontier](frontier.png)", "", "![speedup vs gamma](speedup_vs_gamma.png)", ""]
  return "\n".join(md) + "\n"


def write_plots(config, rows: list[dict], workdir: str) -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  names = list(config.order)
  colours = {"scratch": "#1f77b4", "vinit": "#d62728", "features": "#9467bd",
             "vocab": "#2ca02c"}
  markers = ["o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">"]
  panels = [(d, t) for d, t in (("in", 0.0), ("in", 1.0), ("out", 1.0)) if d in config.domains]
  fig = Figure(figsize=(4.6 * len(panels) + 0.6, 4.4), layout="constrained")
  FigureCanvasAgg(fig)
  for i, (domain, t) in enumerate(panels):
    ax = fig.add_subplot(1, len(panels), i + 1)
    for j, n in enumerate(names):
      r = next((r for r in rows if (r["drafter"], r["domain"], r["temperature"], r["gamma"])
                == (n, domain, t, int(config.frontier_gamma))), None)
      if r is None or r["cost_ratio_c"] is None:
        continue
      ax.errorbar([r["cost_ratio_c"]], [r["block_efficiency"]], yerr=[r["tau_se"] or 0],
                  fmt=markers[j % len(markers)], color=colours[r["kind"]], capsize=3, label=n)
      ax.annotate(n, (r["cost_ratio_c"], r["block_efficiency"]), fontsize=7,
                  xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("c (drafter call / verifier call)")
    ax.set_ylabel(f"τ at γ = {int(config.frontier_gamma)} (± s.e.)")
    ax.set_title(f"{domain} domain ({config.domains[domain].replace('spec_jax_', '')}), T = {t:g}")
    ax.grid(alpha=0.3)
  handles, labels = fig.axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, fontsize=7, loc="outside right upper")
  fig.suptitle("Cost against acceptance (colour: scratch / verifier-initialised / feature "
               "drafter / reduced vocabulary)", fontsize=9)
  fig.savefig(os.path.join(workdir, "frontier.png"), dpi=110)

  fig = Figure(figsize=(11, 4.2), layout="constrained")
  FigureCanvasAgg(fig)
  for i, t in enumerate((0.0, 1.0)):
    ax = fig.add_subplot(1, 2, i + 1)
    for j, n in enumerate(names):
      pts = sorted((r["gamma"], r["speedup"]) for r in rows
                   if (r["drafter"], r["domain"], r["temperature"]) == (n, "in", t)
                   and r["speedup"] is not None)
      if pts:
        kind = config.drafters[n]["kind"]
        ax.plot(*zip(*pts), marker=markers[j % len(markers)], color=colours[kind], label=n,
                alpha=0.85)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks([int(g) for g in config.gammas])
    ax.set_xlabel("γ")
    ax.set_ylabel("speedup over AR (batch 1)")
    ax.set_title(f"in domain, T = {t:g}")
    ax.grid(alpha=0.3)
  handles, labels = fig.axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, fontsize=7, loc="outside right upper")
  fig.savefig(os.path.join(workdir, "speedup_vs_gamma.png"), dpi=110)


def run(config, workdir: str) -> list[dict]:
  check_config(config)
  carried = carried_rows(config)
  os.makedirs(workdir, exist_ok=True)
  rows, built = [], []
  skip = tuple(config.get("skip", ()) or ())
  for name in config.order:  # built and measured one by one, bases first
    if name in carried:
      rows += carried[name]
      continue
    if name in skip:  # neither built nor measured this run (results.md lists it empty)
      continue
    info = build(config, workdir, name)
    rows += evaluate_one(config, workdir, name, info)
    if info is not None:
      built.append(name)
  rows = with_costs(rows, measure_costs(config, workdir, built))
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
  md = render_markdown(config, rows, report.launch_command(config, workdir))
  with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
    f.write(md)
  if rows:
    write_plots(config, rows, workdir)
  print(md)
  return rows
