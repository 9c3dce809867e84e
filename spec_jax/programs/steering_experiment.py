"""Program `steering_experiment`: SD² (Berdoz et al. 2026) at small scale: one pretrained
drafter as is, distilled, and steered by the verifier's hidden states.

  python launch.py --config experiments/steering/config.py --workdir experiments/steering

1. Trains `distilled` (program distill) and every entry of `steered_runs` (program
   train_steering) from `train.drafter.checkpoint` (the pretrained drafter) with the same data,
   objective and steps, each in <workdir>/runs/train/<name> (a finished run is read back, an
   interrupted one resumes).
2. Evaluates the pretrained, distilled and steered drafters with the evaluate program (chain SD
   at every γ of eval.eval.gammas, every temperature, with the autoregressive baseline measured
   in the same process) on every domain's prompts, each in <workdir>/runs/eval/<drafter>_<domain>.
3. Times the steering computation (the module's g → δ at commit) against the steered drafter's
   measured round time.
Writes results.json (rows: drafter, domain, temperature, gamma, block_efficiency, tau_se, ...),
results.md (τ and τ − 1 per drafter with the paper's numbers beside, the goal checks) and
accepted_tokens.png (τ − 1 with standard-error bars). `render_only` reports what has finished.
"""

from __future__ import annotations

import copy
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.evaluation import report
from spec_jax.models import steering
from spec_jax.programs import distill as distill_program
from spec_jax.programs import evaluate, train_steering
from spec_jax.training import checkpoints

# SD² Table 1 (k = 8 chain, τ with the bonus token, mean over 5 datasets, T = 1 unless noted):
# pretrained → distilled → steered.
PAPER = (("Vicuna-13B / Llama-160M, T = 1", 1.88, 2.45, 2.96),
         ("Qwen3-8B / Qwen3-0.6B, T = 1", 3.97, 4.07, 4.28),
         ("Vicuna-13B / Llama-160M, greedy", 2.36, 2.86, 3.27))


def _train_dir(workdir: str, name: str) -> str:
  return os.path.join(workdir, "runs", "train", name)


def train_all(config, workdir: str) -> dict[str, str | None]:
  """name → checkpoint dir of every drafter (None: not trained yet under render_only)."""
  drafters = {"pretrained": config.train.drafter.checkpoint or None}
  steps = int(config.train.train.num_steps)
  jobs = [("distilled", None)] + list(config.steered_runs.items())
  for name, overrides in jobs:
    run_dir = _train_dir(workdir, name)
    done = os.path.isdir(os.path.join(run_dir, "checkpoints", str(steps)))
    if not done and config.render_only:
      drafters[name] = None
      continue
    if not done:
      cfg = copy.deepcopy(config.train)
      if overrides is None:
        cfg.program = "distill"
        with cfg.unlocked():
          del cfg["steering"]
        distill_program.run(cfg, run_dir)
      else:
        cfg.steering.update(dict(overrides))
        train_steering.run(cfg, run_dir)
    drafters[name] = run_dir
  return drafters


def evaluate_all(config, workdir: str, drafters: dict) -> list[dict]:
  rows = []
  for name, ckpt in drafters.items():
    ablation = name not in ("pretrained", "distilled", "steered")
    for domain, dataset in config.domains.items():
      if ablation and domain not in config.ablation_domains:
        continue
      run_dir = os.path.join(workdir, "runs", "eval", f"{name}_{domain}")
      done = os.path.join(run_dir, "results.json")
      if os.path.exists(done):
        got = report.load_rows(done)
      elif config.render_only or (ckpt is None and name != "pretrained"):
        continue
      else:
        cfg = copy.deepcopy(config.eval)
        cfg.program = "evaluate"
        cfg.data.name = dataset
        cfg.tokenizer = config.train.tokenizer
        cfg.verifier = copy.deepcopy(config.train.verifier)
        cfg.drafter = copy.deepcopy(config.train.drafter)
        cfg.drafter.checkpoint = ckpt or ""
        cfg.title = f"{config.title}: {name}, {domain} domain"
        got = evaluate.run(cfg, run_dir)
      for r in got:
        r.update(drafter_name=name, domain=domain)
      rows += got
  return rows


def steering_overhead(config, drafters: dict, rows: list[dict]) -> dict | None:
  """ms of one commit's steering computation (g from three verifier residuals → δ for every
  drafter layer, jitted, median of 50) at `overhead_batch`, beside the steered drafter's mean
  round time at T = 1 (its evaluate rows: batch · τ / tokens_per_s)."""
  ckpt = drafters.get("steered")
  if ckpt is None:
    return None
  _, params, meta = checkpoints.load_model(ckpt)
  s_cfg = checkpoints.steering_from_meta(meta)
  b = int(config.overhead_batch)
  hidden = {l: jnp.ones((b, s_cfg.d_verifier), jnp.float32) for l in s_cfg.verifier_layers}
  fn = jax.jit(lambda p, h: steering.steer_from_hidden(s_cfg, p, h))
  jax.block_until_ready(fn(params["steering"], hidden))
  times = []
  for _ in range(50):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params["steering"], hidden))
    times.append(time.perf_counter() - t0)
  steer_ms = 1000 * float(np.median(times))
  rounds = [1000 * r["batch_size"] * r["block_efficiency"] / r["tokens_per_s"] for r in rows
            if r["drafter_name"] == "steered" and r["method"] == "sd" and r["tokens_per_s"]]
  round_ms = float(np.median(rounds)) if rounds else None
  return dict(batch_size=b, steering_ms=round(steer_ms, 3),
              round_ms=None if round_ms is None else round(round_ms, 2),
              fraction=None if not round_ms else round(steer_ms / round_ms, 4))


def _table_rows(rows):
  return [r for r in rows if r["method"] == "sd"]


def render_markdown(config, rows, overhead, command_line: str) -> str:
  sd = _table_rows(rows)
  names = ["pretrained", "distilled", *config.steered_runs]
  md = [f"# {config.title}", "",
        f"Command: `{command_line}`. Verifier {config.train.verifier.checkpoint or config.train.verifier.size}; "
        f"pretrained drafter `{config.train.drafter.checkpoint or config.train.drafter.size}`; "
        f"distilled and steered drafters trained from it with {config.train.distill.divergence} "
        f"on {config.train.data.source} data of {config.train.data.name}, "
        f"{config.train.train.num_steps} steps of batch {config.train.train.batch_size}. "
        f"{config.eval.eval.num_prompts} prompts × {config.eval.eval.new_tokens} new tokens per "
        f"setting, batch {config.eval.eval.batch_sizes[0]}, chain SD. Device: "
        f"{rows[0]['device'] if rows else '?'}.", "",
        "τ = tokens per verifier call (bonus included) ± its standard error over prompts; "
        "τ − 1 = accepted drafts per round; the gain columns compare τ − 1 with the distilled "
        "and the pretrained drafter's.", ""]
  by = {(r["drafter_name"], r["domain"], r["temperature"], r["gamma"]): r for r in sd}
  md += ["| domain | T | γ | " + " | ".join(f"τ {n}" for n in names)
         + " | steered vs distilled (τ−1) | steered vs pretrained (τ−1) |",
         "|---|---:|---:|" + "---:|" * len(names) + "---:|---:|"]
  verdicts = []
  for domain in config.domains:
    for t in config.eval.eval.temperatures:
      for g in config.eval.eval.gammas:
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
    se = np.hypot(st.get("tau_se") or 0, b.get("tau_se") or 0) / max(b["block_efficiency"] - 1,
                                                                     1e-9)
    if domain == "in" and t == 1.0 and base == "distilled":
      md.append(f"- In domain, T = 1, γ = {g}: steered vs distilled τ − 1 {100 * gain:+.1f}% "
                f"(± {100 * se:.1f}%); goal ≥ +20%: {'met' if gain >= 0.2 else 'not met'}.")
    if domain == "out" and base == "pretrained":
      md.append(f"- Out of domain, T = {t:g}, γ = {g}: steered vs pretrained τ − 1 "
                f"{100 * gain:+.1f}% (± {100 * se:.1f}%); goal no loss: "
                f"{'met' if gain >= -se else 'not met'}.")
  if overhead:
    md.append(f"- Steering overhead at batch {overhead['batch_size']}: "
              f"{overhead['steering_ms']:.3f} ms per round against a measured round of "
              f"{overhead['round_ms']} ms ({100 * (overhead['fraction'] or 0):.2f}%); goal ≤ 5%: "
              f"{'met' if overhead['fraction'] is not None and overhead['fraction'] <= 0.05 else 'not met'}.")
  md += ["", "## The paper (SD² Table 1, τ at k = 8, mean of 5 datasets)", "",
         "| setting | pretrained | distilled | steered |", "|---|---:|---:|---:|"]
  md += [f"| {s} | {a:.2f} | {b:.2f} | {c:.2f} |" for s, a, b, c in PAPER]
  md += ["", "![accepted tokens](accepted_tokens.png)", ""]
  return "\n".join(md) + "\n"


def write_plot(config, rows, path: str) -> None:
  """τ − 1 per drafter (bars, ± standard error), one panel per (domain, T), γ side by side."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  sd = _table_rows(rows)
  names = ["pretrained", "distilled", *config.steered_runs]
  panels = [(d, float(t)) for d in config.domains for t in config.eval.eval.temperatures]
  gammas = [int(g) for g in config.eval.eval.gammas]
  fig = Figure(figsize=(4.2 * len(panels) + 1.2, 4.0), layout="constrained")
  FigureCanvasAgg(fig)
  colours = ["#888888", "#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd"]
  width = 0.8 / len(names)
  for i, (domain, t) in enumerate(panels):
    ax = fig.add_subplot(1, len(panels), i + 1)
    for j, n in enumerate(names):
      ys, es, xs = [], [], []
      for k, g in enumerate(gammas):
        r = next((r for r in sd if (r["drafter_name"], r["domain"], r["temperature"],
                                    r["gamma"]) == (n, domain, t, g)), None)
        if r is not None:
          xs.append(k + (j - (len(names) - 1) / 2) * width)
          ys.append(r["block_efficiency"] - 1)
          es.append(r.get("tau_se") or 0)
      ax.bar(xs, ys, width, yerr=es, capsize=3, color=colours[j % len(colours)], label=n)
    ax.set_xticks(range(len(gammas)), [f"γ = {g}" for g in gammas])
    ax.set_title(f"domain {domain} ({config.domains[domain].replace('spec_jax_', '')}), "
                 f"T = {t:g}")
    ax.set_ylabel("τ − 1 (accepted drafts per round)")
    ax.grid(axis="y", alpha=0.3)
  # One legend for the figure, from the colour map (a panel may lack the ablations' bars).
  from matplotlib.patches import Patch
  fig.legend([Patch(color=colours[j % len(colours)]) for j in range(len(names))], names,
             fontsize=7, loc="outside right upper")
  fig.suptitle(f"verifier {config.train.verifier.checkpoint or config.train.verifier.size}, "
               f"pretrained drafter {config.train.drafter.checkpoint or config.train.drafter.size}"
               " (bars: ± standard error over prompts)", fontsize=9)
  fig.savefig(path, dpi=110)


def run(config, workdir: str) -> list[dict]:
  os.makedirs(workdir, exist_ok=True)
  # Validate every training config before the first run starts.
  for overrides in config.steered_runs.values():
    cfg = copy.deepcopy(config.train)
    cfg.steering.update(dict(overrides))
    train_steering.check_config(cfg)
  drafters = train_all(config, workdir)
  rows = evaluate_all(config, workdir, drafters)
  overhead = None if config.render_only else steering_overhead(config, drafters, rows)
  path = os.path.join(workdir, "overhead.json")
  if overhead is not None:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(overhead, f, indent=2)
  elif os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      overhead = json.load(f)
  # results.json: `drafter` names the drafter (pretrained, distilled, steered...), its path
  # moves to `drafter_checkpoint`.
  out = [{**{k: v for k, v in r.items() if k != "drafter_name"}, "drafter": r["drafter_name"],
          "drafter_checkpoint": r["drafter"]} for r in rows]
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(out, f, indent=2)
  md = render_markdown(config, rows, overhead, report.launch_command(config, workdir))
  with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
    f.write(md)
  write_plot(config, rows, os.path.join(workdir, "accepted_tokens.png"))
  print(md)
  return out
