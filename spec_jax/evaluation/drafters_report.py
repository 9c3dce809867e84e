"""The drafters experiment's rows and report (`programs/drafters_experiment.py`): its rows
assembled from the evaluate runs (one per drafter and domain; carried entries' rows; c and r from
the round-robin cost timing), results.md (the frontier at `frontier_gamma`, every row, the
default it picks, the goals) and the plots frontier.png and speedup_vs_gamma.png.
"""

from __future__ import annotations

from spec_jax.evaluation import experiment
from spec_jax.models import families

ROW_KEYS = ("drafter", "kind", "params_m", "cost_ratio_c", "gamma", "temperature", "domain",
            "batch_size", "rule", "block_efficiency", "tau_se", "acceptance_rate", "speedup",
            "theoretical_speedup", "verifier_cost_ratio_r", "tokens_per_s", "ar_tokens_per_s",
            "identical_to_greedy", "dataset", "device", "build_s")
NOISE_SE = 2.0  # a goal within this many standard errors of τ is flagged: the run cannot tell
# One colour per kind in the plots.
COLOURS = {"scratch": "#1f77b4", "vinit": "#d62728", "features": "#9467bd", "vocab": "#2ca02c"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">")


def train_run(name: str) -> str:
  return f"train_{name}"


def eval_run(name: str, domain: str) -> str:
  return f"eval_{name}_{domain}"


def sd_rows(config, name: str, domain: str, info: dict, got: list[dict]) -> list[dict]:
  """One evaluate run's SD rows as this experiment's (ROW_KEYS): the drafter's kind, its build
  (`info`: params_m, build_s) and the autoregressive tokens/s of the same (T, batch size)."""
  ar = {(r["temperature"], r["batch_size"]): r["tokens_per_s"] for r in got
        if r["method"] == "autoregressive"}
  return [{**{k: r.get(k) for k in ROW_KEYS}, "drafter": name,
           "kind": config.drafters[name]["kind"], "domain": domain,
           "rule": "greedy" if r["temperature"] == 0 else "speculative",
           "ar_tokens_per_s": ar.get((r["temperature"], r["batch_size"])),
           "params_m": info.get("params_m"), "build_s": info.get("build_s")}
          for r in got if r["method"] == "sd"]


def with_costs(rows: list[dict], costs: dict) -> list[dict]:
  """Rows with c and r(γ + 1) from the cost timing (`costs["drafters"][name]`: "c", "r": {γ:
  r}) as cost_ratio_c, verifier_cost_ratio_r, and the theory column recomputed from them;
  evaluate's in-run figures kept as *_run."""
  out = []
  for r in rows:
    got = costs.get("drafters", {}).get(r["drafter"])
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


def collect_rows(config, collected, previous: list[dict],
                 costs: dict) -> tuple[list[dict], list[str]]:
  """(the rows, the runs whose rows come from `previous`), entries in config.order: a carried
  entry's rows, else each domain's SD rows with `costs` applied; skipped entries have none. A run
  that render_only found missing takes the rows `previous` (the workdir's results.json) holds for
  it, as they are."""
  carried = experiment.carried_rows(config, lambda r: r["drafter"])
  rows, reread = [], []
  for name in config.order:
    if name in carried:
      rows += carried[name]
      continue
    if name in tuple(config.get("skip", ()) or ()):
      continue
    info = (collected.by_run.get(train_run(name)) or [{}])[0]
    for domain in config.domains:
      run = eval_run(name, domain)
      if run in collected.missing:
        old = [r for r in previous if (r["drafter"], r["domain"]) == (name, domain)
               and not r.get("carried")]
        rows += old
        reread += [run] if old else []
      else:
        rows += with_costs(sd_rows(config, name, domain, info, collected.by_run.get(run, [])),
                           costs)
  return rows, reread


def pick_default(rows: list[dict]) -> dict | None:
  """The in-domain batch-1 row with the best measured speedup (every row is lossless)."""
  cands = [r for r in rows if r["domain"] == "in" and r["speedup"] is not None]
  return max(cands, key=lambda r: r["speedup"], default=None)


def _fmt(x, spec=".2f"):
  return "–" if x is None else format(x, spec)


def _verdict(r: dict | None, goal: float) -> str:
  """'met' / 'not met' by τ's point estimate, and whether the goal lies within NOISE_SE
  standard errors of it (the measurement cannot tell then)."""
  if r is None:
    return "not met"
  tau, se = r["block_efficiency"], r.get("tau_se") or 0.0
  verdict = "met" if tau >= goal else "not met"
  return verdict + (f", within {NOISE_SE:g} SE" if abs(tau - goal) < NOISE_SE * se else "")


def _tau(r: dict | None) -> str:
  return "–" if r is None else f"{r['block_efficiency']:.2f} ± {r['tau_se'] or 0:.2f}"


def _t(t: float) -> str:
  return "greedy" if t == 0 else f"T={t:g}"


def render_markdown(config, rows: list[dict], command_line: str, reread=()) -> str:
  """results.md; `reread`: the runs whose rows came from the workdir's earlier results.json."""
  names, ev = list(config.order), config.eval.eval
  carried = tuple(config.get("carry", ()) or ())
  temps = [float(t) for t in ev.temperatures]
  hot = temps[-1]  # the sampled temperature of the frontier's out-of-domain, theory and goals
  dist, verifier = config.distill, config.eval.verifier
  v_cfg = families.model_config(verifier.size.split(":")[0])
  md = [f"# {config.title}", "",
        f"Command: `{command_line}`. Device: {rows[0]['device'] if rows else '?'}. "
        f"{ev.num_prompts} prompts × {ev.new_tokens} new tokens per setting, batch "
        f"{'/'.join(str(b) for b in ev.batch_sizes)}, chain SD, lossless rules only (greedy "
        f"and speculative sampling). Scratch drafters: {config.scratch_steps} train_lm steps; "
        f"vinit: {config.distill_steps} distill steps ({dist.distill.divergence.upper()}"
        f"[{dist.distill.beta:g}], {dist.data.source} {dist.data.name} data) from "
        f"{verifier.checkpoint or verifier.size}'s blocks; reduced "
        f"vocabularies: {config.vocab_steps} more distill steps from their base.",
        "", "c = drafter cost per call / verifier cost per one-token call; r = verifier cost "
        "for γ + 1 tokens / for 1 (both: forward calls at batch 1 taking turns, median of "
        f"{config.cost_repeats}, runs/costs.json); theory = τ / (r + γ·c); speedup = SD "
        "tokens/s / AR tokens/s, measured in the same evaluate process (one timed pass per "
        "setting: expect ±10%). τ ± its standard error over prompts. params counts the whole "
        f"input embedding ({v_cfg.vocab_size * v_cfg.d_model / 1e6:.1f}M for "
        f"{verifier.checkpoint or verifier.size}'s), which a decode step only indexes."
        + (f" Feature drafters (EAGLE): distilled on rows of {config.features_prompt_tokens} "
           f"prompt + {config.features_response_tokens} response tokens, with the feature loss."
           if any(config.drafters[n]["kind"] == "features" for n in names) else "")
        + (f" Rows of {', '.join(carried)} are carried from `{config.carry_from}` (built and "
           "measured by an earlier run whose drafters are gone)." if carried else "")
        + (f" Reported from the earlier results.json (render_only; their run directories are "
           f"not in runs/): {', '.join(reread)}." if reread else ""), ""]
  by = {(r["drafter"], r["domain"], r["temperature"], r["gamma"]): r for r in rows}
  fg = int(config.frontier_gamma)
  head = ([f"τ {_t(t)}" for t in temps] + [f"τ {_t(hot)} out"]
          + [f"speedup {_t(t)}" for t in temps] + [f"theory {_t(hot)}"])
  md += [f"## The frontier at γ = {fg}", "",
         "| drafter | params (M) | build (s) | c | " + " | ".join(head) + " |",
         "|---" + "|---:" * (3 + len(head)) + "|"]
  for n in names:
    ins = [by.get((n, "in", t, fg)) for t in temps]
    s, o = by.get((n, "in", hot, fg)), by.get((n, "out", hot, fg))
    any_row = next((r for r in (*ins, o) if r is not None), None)
    if any_row is None:
      md.append(f"| {n} |" + " – |" * (3 + len(head)))
      continue
    md.append(f"| {n} | {_fmt(any_row['params_m'])} | {_fmt(any_row['build_s'], '.0f')} | "
              f"{_fmt(any_row['cost_ratio_c'], '.3f')} | "
              + " | ".join([*(_tau(r) for r in ins), _tau(o),
                            *(_fmt(r and r["speedup"]) for r in ins),
                            _fmt(s and s["theoretical_speedup"])]) + " |")
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
  md += ["", "## Goals and the default", "", *goal_lines(config, rows, by, fg, hot),
         "", "![frontier](frontier.png)", "", "![speedup vs gamma](speedup_vs_gamma.png)", ""]
  return "\n".join(md) + "\n"


def goal_lines(config, rows: list[dict], by: dict, fg: int, hot: float) -> list[str]:
  """The best measured default, each drafter against the goals (τ at γ = fg and T = hot:
  config.goal_tau_in in domain, config.goal_tau_out out of it), and where SD beats AR."""
  lines, best = [], pick_default(rows)
  if best is not None:
    lines.append(f"- Best measured in-domain speedup: **{best['drafter']}** at γ = "
                 f"{best['gamma']}, T = {best['temperature']:g}: {best['speedup']:.2f}× (τ "
                 f"{best['block_efficiency']:.2f}, c {best['cost_ratio_c']:.3f}).")
  goal_in, goal_out = float(config.goal_tau_in), float(config.goal_tau_out)
  for n in config.order:
    s, o = by.get((n, "in", hot, fg)), by.get((n, "out", hot, fg))
    if s is None:
      continue
    r, c = s["verifier_cost_ratio_r"], s["cost_ratio_c"]
    need = None if r is None or c is None else r + fg * c
    lines.append(
        f"- {n}: τ(γ={fg}, T={hot:g}, in) {_tau(s)} (goal ≥ {goal_in:.1f}: "
        f"{_verdict(s, goal_in)}); out of domain {_tau(o)} (goal ≥ {goal_out:.1f}: "
        f"{_verdict(o, goal_out)}); SD beats AR needs τ > r + {fg}c = {_fmt(need)}.")
  faster = sorted((r for r in rows if r["speedup"] and r["speedup"] > 1.0),
                  key=lambda r: -r["speedup"])
  lines.append(f"- Lossless settings where SD is faster than AR at batch 1: {len(faster)} of "
               f"{len(rows)}" + (": " + ", ".join(
                   f"{r['drafter']} {r['domain']} T={r['temperature']:g} γ={r['gamma']} "
                   f"({r['speedup']:.2f}×)" for r in faster[:8]) if faster else "") + ".")
  return lines


def plots(config, rows: list[dict]) -> dict:
  """{file name: fn(path)}: τ against c at frontier_gamma (a panel per domain and temperature),
  and the in-domain speedup against γ (a panel per temperature), by experiment.errorbar_plot."""
  names = list(config.order)
  temps = [float(t) for t in config.eval.eval.temperatures]
  fg = int(config.frontier_gamma)
  panels = [(d, t) for d, t in [*(("in", t) for t in temps), ("out", temps[-1])]
            if d in config.domains]
  frontier, speedup = {}, {}
  for domain, t in panels:
    panel = f"{domain} domain ({config.domains[domain].replace('spec_jax_', '')}), T = {t:g}"
    for n in names:
      r = next((r for r in rows if (r["drafter"], r["domain"], r["temperature"], r["gamma"])
                == (n, domain, t, fg)), None)
      if r is not None and r["cost_ratio_c"] is not None:
        frontier[(panel, n)] = ([r["cost_ratio_c"]], [r["block_efficiency"]], [r["tau_se"]])
  for t in temps:
    for n in names:
      pts = sorted((r["gamma"], r["speedup"]) for r in rows if r["speedup"] is not None
                   and (r["drafter"], r["domain"], r["temperature"]) == (n, "in", t))
      if pts:  # one timed pass per setting: no standard error to draw
        speedup[(f"in domain, T = {t:g}", n)] = ([g for g, _ in pts], [s for _, s in pts],
                                                 [None] * len(pts))

  def style(name: str) -> dict:
    return dict(color=COLOURS[config.drafters[name]["kind"]],
                marker=MARKERS[names.index(name) % len(MARKERS)])
  return {
      "frontier.png": lambda path: experiment.errorbar_plot(
          path, frontier, xlabel="c (drafter call / verifier call)",
          ylabel=f"τ at γ = {fg} (± s.e.)", style=lambda n: dict(style(n), linestyle="none"),
          title="Cost against acceptance (colour: scratch / verifier-initialised / feature "
          "drafter / reduced vocabulary)", xticks=False),
      "speedup_vs_gamma.png": lambda path: experiment.errorbar_plot(
          path, speedup, xlabel="γ", ylabel="speedup over AR (batch 1)", style=style,
          hline=1.0, hline_label="autoregressive", title="Measured speedup against γ"),
  }
