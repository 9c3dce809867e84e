"""results.md, overhead.json and accepted_tokens.png of the SD² steering experiment
(spec_jax/programs/steering_experiment.py).

Rows are evaluate rows tagged `drafter_name` (pretrained, distilled, steered, ...) and `domain`
(a key of config.domains: `in` is the training corpus, `out` another domain); results.json names
the drafter in `drafter` and moves the evaluate row's drafter path to `drafter_checkpoint`.
The models, data and training facts the text states come from the rows and the config.
"""

from __future__ import annotations

import numpy as np

from spec_jax.evaluation import experiment, metrics

# SD² Table 1 (k = 8 chain, τ with the bonus token, mean over 5 datasets, T = 1 unless noted):
# pretrained → distilled → steered.
PAPER = (("Vicuna-13B / Llama-160M, T = 1", 1.88, 2.45, 2.96),
         ("Qwen3-8B / Qwen3-0.6B, T = 1", 3.97, 4.07, 4.28),
         ("Vicuna-13B / Llama-160M, greedy", 2.36, 2.86, 3.27))
# The goals: steered vs distilled τ − 1 in domain at T = 1; steering's share of a round.
GOAL_GAIN = 0.20
GOAL_OVERHEAD = 0.05
_COLOURS = ("#888888", "#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd")


def drafter_names(config) -> list[str]:
  return ["pretrained", "distilled", *config.steered_runs]


def overhead(config, rows, measured: dict | None) -> dict | None:
  """{batch_size, steering_ms, round_ms, fraction}: the measured steering computation per
  commit (`measured`, the overhead run's row) beside the steered drafter's median round time
  in its evaluate rows (batch · τ / tokens_per_s)."""
  if not measured:
    return None
  rounds = [1000 * r["batch_size"] * r["block_efficiency"] / r["tokens_per_s"] for r in rows
            if r["drafter_name"] == "steered" and r["method"] == "sd" and r["tokens_per_s"]]
  round_ms = float(np.median(rounds)) if rounds else None
  steer_ms = measured["steering_ms"]
  return dict(batch_size=measured["batch_size"], steering_ms=steer_ms,
              round_ms=None if round_ms is None else round(round_ms, 2),
              fraction=None if not round_ms else round(steer_ms / round_ms, 4))


def models(config, rows) -> tuple[str, str]:
  """(verifier, pretrained drafter) as the rows measured them, else as the config names them."""
  tr = config.train
  return (experiment.measured(rows, "verifier", tr.verifier.checkpoint or tr.verifier.size),
          experiment.measured([r for r in rows if r["drafter_name"] == "pretrained"], "drafter",
                              tr.drafter.checkpoint or tr.drafter.size))


def render_markdown(config, rows, cost: dict | None, command_line: str,
                    missing=()) -> str:
  """τ per drafter, domain, T and γ with the steered drafter's gains, the goals, the paper."""
  sd = [r for r in rows if r["method"] == "sd"]
  names = drafter_names(config)
  tr, ev = config.train, config.eval
  verifier, pretrained = models(config, rows)
  md = [f"# {config.title}", "",
        f"Command: `{command_line}`. Verifier {verifier}; "
        f"pretrained drafter `{pretrained}`; distilled and steered drafters trained from it "
        f"with {tr.distill.divergence} on {tr.data.source} data of {tr.data.name}, "
        f"{tr.train.num_steps} steps of batch {tr.train.batch_size}. {ev.eval.num_prompts} "
        f"prompts × {ev.eval.new_tokens} new tokens per setting, batch {ev.eval.batch_sizes[0]}, "
        f"{'chain SD' if tuple(ev.eval.methods) == ('sd',) else ', '.join(ev.eval.methods)}. "
        f"Device: {rows[0]['device'] if rows else '?'}.", "",
        *([f"**Not finished yet: {len(missing)} runs** ({', '.join(missing)}); the command "
           "resumes them.", ""] if missing else []),
        "τ = tokens per verifier call (bonus included) ± its standard error over prompts; "
        "τ − 1 = accepted drafts per round; the gain columns compare τ − 1 with the distilled "
        "and the pretrained drafter's.", ""]
  by = {(r["drafter_name"], r["domain"], r["temperature"], r["gamma"]): r for r in sd}
  md += ["| domain | T | γ | " + " | ".join(f"τ {n}" for n in names)
         + " | steered vs distilled (τ−1) | steered vs pretrained (τ−1) |",
         "|---|---:|---:|" + "---:|" * len(names) + "---:|---:|"]
  verdicts = []
  for domain in config.domains:
    for t in ev.eval.temperatures:
      for g in ev.eval.gammas:
        cells = []
        for n in names:
          r = by.get((n, domain, float(t), int(g)))
          cells.append("–" if r is None else
                       f"{r['block_efficiency']:.3f} ± {r.get('tau_se') or 0:.3f}")
        gains = []
        st = by.get(("steered", domain, float(t), int(g)))
        for base in ("distilled", "pretrained"):
          b = by.get((base, domain, float(t), int(g)))
          if st is None or b is None or b["block_efficiency"] <= 1.0:
            gains.append("–")
            continue
          gain = (st["block_efficiency"] - 1) / (b["block_efficiency"] - 1) - 1
          gains.append(f"{100 * gain:+.1f}%")
          verdicts.append((domain, float(t), int(g), base, gain, st, b))
        md.append(f"| {domain} | {float(t):g} | {int(g)} | " + " | ".join(cells) + " | "
                  + " | ".join(gains) + " |")
  md += ["", "## Goals", ""]
  for domain, t, g, base, gain, st, b in verdicts:
    # The gain is R − 1 with R = (τ_st − 1) / (τ_b − 1): its standard error by the delta
    # method, paired over the prompts both runs decoded where the rows carry per-prompt counts,
    # else the runs taken as independent, √(se_st² + R² se_b²) / (τ_b − 1).
    se, _ = metrics.tau_ratio_se(st, b, offset=1.0)
    if domain == "in" and t == 1.0 and base == "distilled":
      md.append(f"- In domain, T = 1, γ = {g}: steered vs distilled τ − 1 {100 * gain:+.1f}% "
                f"(± {100 * se:.1f}%); goal ≥ +{100 * GOAL_GAIN:.0f}%: "
                f"{'met' if gain >= GOAL_GAIN else 'not met'}.")
    if domain == "out" and base == "pretrained":
      md.append(f"- Out of domain, T = {t:g}, γ = {g}: steered vs pretrained τ − 1 "
                f"{100 * gain:+.1f}% (± {100 * se:.1f}%); goal no loss: "
                f"{'met' if gain >= -se else 'not met'}.")
  if cost:
    met = cost["fraction"] is not None and cost["fraction"] <= GOAL_OVERHEAD
    md.append(f"- Steering overhead at batch {cost['batch_size']}: "
              f"{cost['steering_ms']:.3f} ms per round against a measured round of "
              f"{cost['round_ms']} ms ({100 * (cost['fraction'] or 0):.2f}%); goal ≤ "
              f"{100 * GOAL_OVERHEAD:.0f}%: {'met' if met else 'not met'}.")
  md += ["", "## The paper (SD² Table 1, τ at k = 8, mean of 5 datasets)", "",
         "| setting | pretrained | distilled | steered |", "|---|---:|---:|---:|"]
  md += [f"| {s} | {a:.2f} | {b:.2f} | {c:.2f} |" for s, a, b, c in PAPER]
  md += ["", "![accepted tokens](accepted_tokens.png)", ""]
  return "\n".join(md) + "\n"


def plot_series(config, rows) -> dict:
  """accepted_tokens.png's bars: (panel "domain D (dataset), T = t", drafter) -> (γs, τ − 1,
  standard errors), panels in (domain, T) order, drafters in `drafter_names` order."""
  series = {}
  for domain in config.domains:
    for t in config.eval.eval.temperatures:
      panel = (f"domain {domain} ({config.domains[domain].replace('spec_jax_', '')}), "
               f"T = {float(t):g}")
      for n in drafter_names(config):
        sel = sorted((r for r in rows if r["method"] == "sd" and r["drafter_name"] == n
                      and r["domain"] == domain and r["temperature"] == float(t)),
                     key=lambda r: r["gamma"])
        if sel:
          series[panel, n] = ([r["gamma"] for r in sel],
                              [r["block_efficiency"] - 1 for r in sel],
                              [r.get("tau_se") or 0.0 for r in sel])
  return series


def report(config, collected: experiment.Collected, command_line: str) -> experiment.Report:
  """results.md, accepted_tokens.png, overhead.json; results.json holds the evaluate rows."""
  rows = [r for r in collected.rows if "domain" in r]
  measured = collected.by_run.get("overhead")
  cost = overhead(config, rows, measured[0] if measured else None)
  names = drafter_names(config)
  verifier, pretrained = models(config, rows)

  def draw(path):
    experiment.errorbar_plot(
        path, plot_series(config, rows), xlabel="draft length γ",
        ylabel="τ − 1 (accepted drafts per round)", bars=True,
        title=f"verifier {verifier}, pretrained drafter {pretrained} (bars: ± standard error "
              "over prompts)",
        style=lambda n: dict(color=_COLOURS[names.index(n) % len(_COLOURS)]))
  # results.json: `drafter` names the drafter, its path moves to `drafter_checkpoint`.
  out = [{**{k: v for k, v in r.items() if k != "drafter_name"}, "drafter": r["drafter_name"],
          "drafter_checkpoint": r["drafter"]} for r in rows]
  return experiment.Report(
      # Unfinished training shows as its unfinished evaluations; finished evaluations of a
      # drafter whose training run is not here (results kept without checkpoints) report as is.
      markdown=render_markdown(config, rows, cost, command_line,
                               [m for m in collected.missing if not m.startswith("train_")]),
      plots={"accepted_tokens.png": draw},
      extra_json={"overhead.json": cost} if cost else {}, rows=out)
