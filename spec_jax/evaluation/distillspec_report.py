"""results.md and the plots of the DistillSpec experiment (programs/distillspec_experiment.py).

Rows come in four parts (the `part` tag): `train` (one per trained drafter: divergence, source,
final train loss and α, held-out metrics, seconds), `grid` (chain SD of every drafter at every
eval temperature, batch eval.batch_size), `lenience` (lenient decoding over ε) and `speedup` (the
wall-clock table at eval.speedup_batch_size). Every decoding row is a `bench.Row` plus `drafter`
and `ar_verifier_loglik`. Every fact in the text comes from the config or the rows.
"""

from __future__ import annotations

import numpy as np

from spec_jax.evaluation import experiment, metrics

DIV_LABELS = {"fkl": "FKL", "rkl": "RKL", "jsd": "JSD[{beta:g}]", "tvd": "TVD", "xent": "CE"}
SRC_LABELS = {"fixed": "fixed data", "verifier": "verifier-generated",
              "onpolicy": "on-policy (drafter)", "mix": "50/50 on-policy + verifier"}
REFERENCES = {"baseline": "CE baseline (same steps, fixed data)",
              "start": "start drafter (no extra steps)"}


def split(rows):
  """(trained {name: row}, grid {(name, T): row}, lenience rows, speedup rows), in row order."""
  trained = {r["drafter"]: r for r in rows if r.get("part") == "train"}
  grid = {(r["drafter"], float(r["temperature"])): r for r in rows if r.get("part") == "grid"}
  return (trained, grid, [r for r in rows if r.get("part") == "lenience"],
          [r for r in rows if r.get("part") == "speedup"])


def best_distilled(grid, t: float, among=None) -> str | None:
  """The distilled drafter (neither baseline nor start) with the highest τ at temperature t."""
  rows = {n: r for (n, temp), r in grid.items() if temp == t and n not in REFERENCES
          and (among is None or n in among)}
  return max(rows, key=lambda n: rows[n]["block_efficiency"], default=None)


def div_label(config, divergence: str) -> str:
  """A divergence's name in the text, JSD with its β (config.beta)."""
  return DIV_LABELS[divergence].format(beta=config.beta)


def _fmt(x, digits=3):
  return "–" if x is None else f"{x:.{digits}f}"


def _model(section) -> str:
  """A model section as text: its checkpoint and size, or the size initialised at random."""
  return (f"{section.checkpoint} ({section.size})" if section.checkpoint
          else f"a random {section.size}")


def _mode(t: float) -> str:
  return "greedy" if t == 0 else f"T = {t:g}"


def _z(row, base) -> float:
  """(τ - τ_base) in standard errors of the difference: paired over the prompts both decoded
  where the rows carry per-prompt counts, else combined as if independent
  (`metrics.tau_diff_se`)."""
  se, _ = metrics.tau_diff_se(row, base)
  return (row["block_efficiency"] - base["block_efficiency"]) / max(se, 1e-9)


def _old_theory(rows) -> list[str]:
  """A note for displayed rows that carry no measured r(M): their theoretical speedup was
  computed with r = 1."""
  old = [r for r in rows if r.get("verifier_cost_ratio_r") is None]
  if not old:
    return []
  who = "These rows carry" if len(old) == len(rows) else f"{len(old)} of these rows carry"
  return [f"{who} no measured r(M): their theoretical speedup takes r = 1, "
          "(1-α^{γ+1})/((1-α)(1+γc)) from α for lossless rows and τ/(1+γc) for lenient ones.",
          ""]


def _grid_tables(config, grid) -> list[str]:
  """τ per (divergence, source) at each temperature, with the change against the baseline."""
  lines = []
  for t in [float(x) for x in config.eval.temperatures]:
    base = grid.get(("baseline", t))
    lines += [f"## τ at γ = {config.eval.gamma}, {_mode(t)}", "",
              "| divergence | " + " | ".join(SRC_LABELS[s] for s in config.sources) + " |",
              "|---|" + "---:|" * len(config.sources)]
    for d in config.divergences:
      cells = []
      for s in config.sources:
        r = grid.get((f"{d}_{s}", t))
        if not r:
          cells.append("–")
          continue
        gain = f" ({r['block_efficiency'] / base['block_efficiency'] - 1:+.1%})" if base else ""
        cells.append(f"{r['block_efficiency']:.3f}{gain}")
      lines.append(f"| {div_label(config, d)} | " + " | ".join(cells) + " |")
    for name, label in REFERENCES.items():
      r = grid.get((name, t))
      if r:
        lines.append(f"| {label} | {r['block_efficiency']:.3f} |"
                     + " |" * (len(config.sources) - 1))
    lines += ["", "(in brackets: change of τ relative to the CE baseline)", ""]
  return lines


def _all_drafters(config, trained, grid) -> list[str]:
  """Every drafter's row; the speedup α predicts at one c and r(M) per temperature (the medians
  over its rows: passes timed at different times on a shared machine drift with its load)."""
  gamma = int(config.eval.gamma)
  held_t = config.base.distill.temperature
  lines = ["## All drafters", "",
           "| drafter | T | τ ± SE over prompts | τ / τ(CE baseline) | α | speedup predicted "
           f"from α (γ, common c and r(M)) | held-out α (T={held_t:g}, fixed data) | held-out "
           "TVD |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
  temps = sorted({t for _, t in grid})
  common = {}
  for t in temps:
    rows = [r for (_, temp), r in grid.items() if temp == t]
    rs = [r["verifier_cost_ratio_r"] for r in rows if r.get("verifier_cost_ratio_r")]
    common[t] = (float(np.median([r["cost_ratio_c"] for r in rows])),
                 float(np.median(rs)) if rs else None)
  for (name, t), r in sorted(grid.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    base = grid.get(("baseline", t))
    held = trained.get(name, {}).get("heldout", {})
    rel = f"{r['block_efficiency'] / base['block_efficiency']:.3f}" if base else "–"
    c, r_m = common[t]
    predicted = metrics.chain_speedup(min(r["acceptance_rate"], 0.999), gamma, c=c,
                                      r_m=r_m or 1.0)
    lines.append(f"| {name} | {t:g} | {r['block_efficiency']:.3f} ± {r.get('tau_se') or 0:.3f} "
                 f"| {rel} | {r['acceptance_rate']:.3f} | {predicted:.3f} | "
                 f"{_fmt(held.get('alpha'))} | {_fmt(held.get('tvd'))} |")
  measured = any(r_m for _, r_m in common.values())
  lines += ["", "common c: " + ", ".join(f"T = {t:g}: {c:.3f}" for t, (c, _) in common.items())
            + "; common r(M): " + (", ".join(
                f"T = {t:g}: " + (f"{r_m:.3f}" if r_m else "1 (not measured)")
                for t, (_, r_m) in common.items()) if measured
                else "1 (these rows carry no measured r(M))")
            + f". Measured batch-{config.eval.batch_size} tokens/s of every pass are in "
            "results.json.", ""]
  return lines


def _lenience_table(config, rows) -> list[str]:
  if not rows:
    return []
  lines = [f"## Lenient decoding ({_mode(float(config.lenience.temperature))}): τ against ε and "
           "its quality cost", "",
           "| drafter | lenience | ε | τ | speedup (measured) | theoretical τ/(r(M)+γc) | "
           "verifier log-lik / token | token TV ½‖π-p‖₁ |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['drafter']} | f_{r['lenience'] or 'lin'} | {r['epsilon'] or 1:g} | "
                 f"{r['block_efficiency']:.3f} | {r['speedup']:.3f} | "
                 f"{r['theoretical_speedup']:.3f} | {r['verifier_loglik']:.3f} | "
                 f"{r['token_tv']:.4f} |")
  lines += ["", f"Autoregressive sampling from the verifier "
            f"({_mode(float(config.lenience.temperature))}) on the same prompts: log-lik / token "
            f"{rows[0]['ar_verifier_loglik']:.3f}.", ""]
  return lines + _old_theory(rows)


def _speedup_table(config, rows) -> list[str]:
  if not rows:
    return []
  lines = [f"## Wall-clock speedup at batch {config.eval.speedup_batch_size} "
           f"({config.eval.speedup_prompts} prompts)", "",
           "| drafter | T | τ | speedup over autoregressive (measured) | theoretical "
           "τ/(r(M)+γc) | c | speedup vs CE baseline (measured / theory) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  base = {r["temperature"]: r for r in rows if r["drafter"] == "baseline"}
  for r in rows:
    b = base.get(r["temperature"])
    rel = (f"{r['speedup'] / b['speedup']:.3f} / "
           f"{r['theoretical_speedup'] / b['theoretical_speedup']:.3f}") if b else "–"
    lines.append(f"| {r['drafter']} | {r['temperature']:g} | {r['block_efficiency']:.3f} | "
                 f"{r['speedup']:.3f} | {r['theoretical_speedup']:.3f} | "
                 f"{r['cost_ratio_c']:.3f} | {rel} |")
  return lines + [""] + _old_theory(rows)


def _cost_note(ev, grid, speedup) -> str:
  """What a verifier call over γ + 1 tokens costs at the grid's batch size, from the rows."""
  rs = [r["verifier_cost_ratio_r"] for r in grid.values() if r.get("verifier_cost_ratio_r")]
  out = (f"- At batch {ev.batch_size} a verifier call over γ + 1 tokens costs r(M) = "
         f"{np.median(rs):.2f} one-token calls (median over the rows)" if rs else
         f"- r(M) at batch {ev.batch_size} is not measured in these rows")
  return out + (f"; the batch-{ev.speedup_batch_size} table is the fairer wall-clock comparison."
                if speedup else ".")


def findings(config, grid) -> list[str]:
  """Per temperature: the best distilled drafter against the baseline (and config.goal), the
  drafters more than 2 SE above it, on-policy against verifier data, the best divergence per
  data source."""
  out = []
  for t in [float(x) for x in config.eval.temperatures]:
    base = grid.get(("baseline", t))
    rows = {n: r for (n, temp), r in grid.items() if temp == t and n not in REFERENCES}
    if not base or not rows:
      continue
    best = best_distilled(grid, t)
    b, g = rows[best], base
    gain = b["block_efficiency"] / g["block_efficiency"] - 1
    how = "paired over prompts" if metrics.tau_diff_se(b, g)[1] else "combined as if independent"
    out.append(f"- {_mode(t)}: best distilled drafter `{best}` τ = {b['block_efficiency']:.3f} "
               f"vs CE baseline {g['block_efficiency']:.3f} ({gain:+.1%}, {_z(b, g):.1f} "
               f"standard errors of the difference, {how}); the ≥ {config.goal:.0%} goal is "
               f"{'met' if gain >= config.goal else 'not met'}. By α (Σ min(p, q) over the SD "
               f"run's positions, less noisy than τ): {b['acceptance_rate']:.3f} vs "
               f"{g['acceptance_rate']:.3f} "
               f"({b['acceptance_rate'] / g['acceptance_rate'] - 1:+.1%}).")
    better = [n for n in rows if _z(rows[n], g) > 2]
    out.append(f"  - distilled drafters with τ more than 2 standard errors above the baseline: "
               f"{', '.join(f'`{n}`' for n in sorted(better)) or 'none'} (of {len(rows)}).")
    for d in config.divergences:
      ver, onp = rows.get(f"{d}_verifier"), rows.get(f"{d}_onpolicy")
      if ver and onp:
        diff = onp["block_efficiency"] - ver["block_efficiency"]
        out.append(f"  - {div_label(config, d)}: on-policy {onp['block_efficiency']:.3f} vs "
                   f"verifier-generated {ver['block_efficiency']:.3f} ({diff:+.3f}).")
    per_src = {s: max((d for d in config.divergences if f"{d}_{s}" in rows),
                      key=lambda d: rows[f"{d}_{s}"]["block_efficiency"], default=None)
               for s in config.sources}
    out.append("  - best divergence per data source: " + ", ".join(
        f"{SRC_LABELS[s]} → {div_label(config, d)}" for s, d in per_src.items() if d))
  return out


def render_markdown(config, rows, command_line: str, plots=(), missing=(), reread=()) -> str:
  """results.md: τ per (divergence, source), every drafter's row, the lenience and wall-clock
  tables, findings computed from the numbers, the plots and the training runs. `missing`: runs
  not finished; `reread`: runs whose rows came from the workdir's earlier results.json."""
  trained, grid, lenience, speedup = split(rows)
  base, ev = config.base, config.eval
  lines = [f"# {config.title}", "",
           f"Produced by `{command_line}` (config: {config.config_file.split(':')[0]}). "
           f"Verifier {_model(base.verifier)}; every drafter starts from "
           f"{_model(base.drafter)} and trains "
           f"{base.train.num_steps} steps of batch {base.train.batch_size} × "
           f"({base.data.prompt_tokens} prompt + {base.data.response_tokens} response) tokens at "
           f"lr {base.train.lr:g}; the baseline trains the same steps with cross-entropy on the "
           f"fixed data. Evaluation: {ev.num_prompts} held-out prompts of the {base.data.name} "
           f"{ev.prompt_split} split ({ev.prompt_tokens} tokens), {ev.new_tokens} new tokens, "
           f"chain SD at γ = {ev.gamma}, batch {ev.batch_size}.", ""]
  if missing:
    lines += [f"**Not finished yet: {len(missing)} runs** ({', '.join(missing)}); the command "
              "resumes them.", ""]
  if reread:
    lines += [f"{len(reread)} runs are not in runs_dir ({config.runs_dir or '<workdir>/runs'}): "
              "their rows are read from the workdir's results.json.", ""]
  device = next((r["device"] for r in grid.values() if r.get("device")), "?")
  lines += [f"Device: {device}." + (f" {config.note}" if config.note else "") + " τ (tokens per "
            "verifier call) and α do not depend on timing; the theoretical speedup is "
            "τ / (r(M) + γc) with c = drafter step time / verifier step time and r(M) = the time "
            "of a verifier call over γ + 1 tokens / a one-token call, both measured.", ""]
  lines += _grid_tables(config, grid) + _all_drafters(config, trained, grid)
  lines += _lenience_table(config, lenience) + _speedup_table(config, speedup)
  lines += ["## How to read these numbers", "",
            f"- τ comes from {ev.num_prompts} prompts × {ev.new_tokens} tokens; its standard "
            "error over prompts is given, and differences of a few percent are within it. "
            "Greedy τ has heavy tails: a prompt whose continuation falls into a repetition loop "
            "is drafted almost perfectly by any drafter.",
            "- α (the mean of Σ min(p, q) over every drafted position, not over prompts) moves "
            "with the divergence more visibly than τ.", _cost_note(ev, grid, speedup), ""]
  lines += ["## Findings (computed from the numbers above)", ""] + findings(config, grid)
  for name in plots:
    lines += ["", f"![{name}]({name})"]
  lines += ["", "## Training runs", "",
            "| run | divergence | data | final train loss | train α | seconds (first to last "
            "logged step) |", "|---|---|---|---:|---:|---:|"]
  for name, r in trained.items():
    lines.append(f"| {name} | {div_label(config, r['divergence'])} | {SRC_LABELS[r['source']]} | "
                 f"{_fmt(r['train_loss'])} | {_fmt(r['train_alpha'])} | "
                 f"{_fmt(r['seconds'], 0)} |")
  return "\n".join(lines) + "\n"


def _tau_series(config, grid) -> dict:
  """(source panel, divergence or reference) -> (temperatures, τ, SE over prompts)."""
  series = {}
  for s in config.sources:
    panel = SRC_LABELS[s]
    for key, label in [*((f"{d}_{s}", div_label(config, d)) for d in config.divergences),
                       *REFERENCES.items()]:
      pts = sorted((t, r) for (n, t), r in grid.items() if n == key)
      if pts:
        series[(panel, label)] = ([t for t, _ in pts], [r["block_efficiency"] for _, r in pts],
                                  [r.get("tau_se") for _, r in pts])
  return series


def _style(config):
  """Line style per series label: one colour per divergence, the references grey and dashed."""
  colours = {div_label(config, d): f"C{i}" for i, d in enumerate(DIV_LABELS)}

  def style(label: str) -> dict:
    if label in REFERENCES.values():
      return dict(color="0.3" if label.startswith("CE") else "0.6", marker="s",
                  linestyle="--" if label.startswith("CE") else ":")
    return dict(color=colours[label], marker="o")
  return style


def plots(config, grid, lenience) -> dict:
  """tau_grid.png (τ ± SE against temperature, one panel per data source) and, with lenience
  rows, lenience_tradeoff.png (τ ± SE against ε) and lenience_quality.png (the verifier's
  log-likelihood of the text against ε, autoregressive sampling as the reference line)."""
  gamma, lt = config.eval.gamma, float(config.lenience.temperature)
  out = {"tau_grid.png": lambda path: experiment.errorbar_plot(
      path, _tau_series(config, grid), xlabel="temperature",
      ylabel=f"τ (tokens per verifier call), γ = {gamma}", style=_style(config),
      title=f"{config.title}: τ ± standard error over prompts")}
  if not lenience:
    return out
  groups = {}
  for r in lenience:
    groups.setdefault(f"{r['drafter']}, f_{r['lenience'] or 'lin'}", []).append(r)

  def series(key, err):
    return {label: ([r["epsilon"] or 1.0 for r in rs], [r[key] for r in rs],
                    [r.get(err) if err else None for r in rs]) for label, rs in groups.items()}
  out["lenience_tradeoff.png"] = lambda path: experiment.errorbar_plot(
      path, series("block_efficiency", "tau_se"), xlabel="ε (1 = lossless)",
      ylabel=f"τ, γ = {gamma}, {_mode(lt)}", title="Lenient decoding: τ ± standard error vs ε",
      style=lambda _: dict(marker="o"))
  out["lenience_quality.png"] = lambda path: experiment.errorbar_plot(
      path, series("verifier_loglik", None), xlabel="ε (1 = lossless)",
      ylabel="verifier log-likelihood per generated token",
      title="Lenient decoding: quality of the generated text vs ε",
      hline=lenience[0]["ar_verifier_loglik"],
      hline_label="autoregressive sampling from the verifier", style=lambda _: dict(marker="o"))
  return out


def report(config, rows, command_line: str, missing=(), reread=()) -> experiment.Report:
  """results.md and the plots; results.json holds `rows` (every part)."""
  _, grid, lenience, _ = split(rows)
  drawn = plots(config, grid, lenience)
  return experiment.Report(
      markdown=render_markdown(config, rows, command_line, list(drawn) if rows else (),
                               missing, reread),
      plots=drawn, rows=list(rows))
