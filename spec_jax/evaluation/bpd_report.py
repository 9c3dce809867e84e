"""The BPD experiment's rows and report (`programs/bpd_experiment.py`): the rows assembled from
its runs (carried settings, evaluate's rows, the head analysis as bpd_oracle rows, the gains over
plain BPD), results.md (tables of τ ± SE, speedups and the refinements' gain per (dataset, heads,
temperature), the head analysis, the papers' numbers beside ours, the issue's goals checked on
the measured rows) and the plots tau_by_method.png, oracle_vs_k.png, entropy_repetition.png.
"""

from __future__ import annotations

import math
import re

from spec_jax.evaluation import experiment, glossary, metrics, tables

# Decoded BPD methods (evaluate's row names) and the oracle, in table order.
DECODED = ("bpd", "bpd_tree", "bpd_ngram", "bpd_ngram_beam", "bpd_neural")
REFINED = ("bpd_ngram", "bpd_ngram_beam", "bpd_neural")
NOISE_SE = 2.0  # a gain counts beyond noise when it exceeds this many standard errors
OUTPUTS = ("results.json", "results.md", "tau_by_method.png", "oracle_vs_k.png",
           "entropy_repetition.png")
# The papers' numbers (not reproduced here: their models and training budgets are far larger).
PAPERS = (
    ("Kim et al. 2024", "block efficiency gain of lattice rescoring (neural / n-gram LM) over "
     "plain BPD heads", "+5% to +21% (max +21.3%)"),
    ("Stern et al. 2018", "mean accepted block size, greedy BPD on machine translation, exact "
     "(no relaxed acceptance)", "~1.8 to 3"))
# Definitions of the columns this report adds to the glossary's (spec_jax.evaluation.glossary).
EXTRA_GLOSSARY = {
    "heads": "h: BPD heads (head k drafts the token k + 1 positions past the verifier's); "
             "drafts are h tokens deep",
    "p": "bpd_ngram: lattice paths kept (the p best of the k^h under the n-gram rescoring), "
         "verified as one prefix tree; bpd_ngram_beam: the beam width W kept at every level",
    "gain_over_bpd": "refinement gain: τ / τ of plain bpd (same dataset, h, T) − 1",
    "oracle_tau": "lattice oracle τ at k: the block efficiency if every round accepted the "
                  "longest prefix of the verifier's greedy continuation found among each head's "
                  "top-k (the best of the k^h lattice paths); at k = 1 it is greedy bpd's τ",
    "head_entropy": "mean entropy (nats) of each head's law over the continuation's positions",
    "repetition_rate": "how often consecutive heads' argmax drafts repeat a token",
    "topk_accuracy": "how often the verifier's greedy token is in head j's top-k",
}
METHOD_NOTES = (
    "- **bpd**: plain blockwise parallel decoding, each head's argmax (T = 0) or a draw from its "
    "law (T > 0), a chain of h verified in one call;",
    "- **bpd_tree**: a static tree from the heads' top-k lattice (Medusa-style: `tree` names "
    "the branching per depth), verified by the tree rules;",
    "- **bpd_ngram**: the p best lattice paths under (1 − w)·log q_heads + w·log p_ngram (Kim "
    "et al.'s global rescoring; the n-gram LM is counted on the dataset's train split), "
    "verified as one prefix tree; greedy only;",
    "- **bpd_ngram_beam**: a beam search over the lattice under the same score that keeps every "
    "level's W best prefixes as the draft tree (EAGLE-2-style dynamic tree; the same 1 + W·h "
    "verifier tokens as p = W paths, spent on the prefixes most likely to be accepted rather "
    "than on complete paths); greedy only;",
    "- **bpd_neural**: a chain whose per-head top-k is rescored left to right by a small LM "
    "(Kim et al.'s local neural rescoring);",
    "- **bpd_oracle**: no decoding; the lattice oracle τ at k = oracle_k from the head analysis,"
    " the ceiling of any rescoring of the top-k lattice.")


# -- the rows --------------------------------------------------------------------------------


def heads_key(dataset: str, h: int) -> str:
  """The key of a (dataset, h) setting: in config.heads_checkpoints, carry and run names."""
  return f"{dataset}_h{int(h)}"


def setting(row: dict) -> str:
  return heads_key(row["dataset"], row["heads"])


def carried(config) -> tuple[str, ...]:
  """The settings "<dataset>_h<h>" whose rows the experiment reads from `carry_from`."""
  return tuple(config.get("carry", ()) or ())


def lattice_k(config, h: int) -> int:
  """The lattice's k for h heads: `top_k_per_heads[f"h{h}"]` if given, else `top_k`."""
  return int(config.top_k_per_heads.get(f"h{int(h)}", config.top_k))


def oracle_k(config, h: int) -> int:
  """The k of the bpd_oracle row for h heads: `oracle_k`, or the decoded lattice's k if 0."""
  return int(config.oracle_k) or lattice_k(config, h)


def eval_run(dataset: str, h: int, temperature: float) -> str:
  return f"eval_{heads_key(dataset, h)}_T{float(temperature):g}"


def analysis_run(dataset: str, h: int) -> str:
  return f"analysis_{heads_key(dataset, h)}"


def paths_kept(row: dict) -> int | None:
  """bpd_ngram's kept paths p, or bpd_ngram_beam's width W, from the row's tree description."""
  match = re.search(r"(?:p|W)=(\d+)", row.get("tree") or "")
  return int(match.group(1)) if match else None


def oracle_row(k: int, stats: dict) -> dict:
  """The bpd_oracle row of one head analysis (`bpd_analysis.analyse`'s dict, with its run's
  tags): the lattice oracle's τ at k, and the analysis."""
  keep = ("dataset", "heads", "heads_checkpoint", "heads_steps", "heads_data", "run")
  return dict(method="bpd_oracle", temperature=0.0, gamma=stats["heads"], oracle_k=int(k),
              block_efficiency=stats["oracle_tau"][str(k)], tau_se=None, speedup=None,
              tokens_per_s=None, theoretical_speedup=None, verifier_tokens_per_call=None,
              identical_to_greedy=None, oracle_tau=stats["oracle_tau"],
              head_entropy=stats["head_entropy"], repetition_rate=stats["repetition_rate"],
              topk_accuracy=stats["topk_accuracy"], num_prompts=stats["prompts"],
              new_tokens=stats["tokens"] * stats["prompts"],
              **{key: stats[key] for key in keep if key in stats})


def add_gains(rows: list[dict]) -> None:
  """gain_over_bpd and its standard error on every non-bpd BPD row: paired over the prompts both
  runs decoded where the rows carry per-prompt counts, else the runs taken as independent
  (conservative; `metrics.tau_ratio_se`)."""
  plain = {(r["dataset"], r["heads"], r["temperature"]): r for r in rows if r["method"] == "bpd"}
  for r in rows:
    b = plain.get((r["dataset"], r["heads"], r["temperature"]))
    if r["method"] in ("autoregressive", "bpd") or b is None or not b["block_efficiency"]:
      continue
    ratio = r["block_efficiency"] / b["block_efficiency"]
    r.update(gain_over_bpd=round(ratio - 1, 4), gain_se=round(metrics.tau_ratio_se(r, b)[0], 4))


def collect_rows(config, collected, previous: list[dict]) -> tuple[list[dict], list[str]]:
  """(the rows, the runs whose rows come from `previous`), in config order: each carried
  setting's rows, each evaluate run's rows (bpd_ngram(_beam) with its p), each head analysis as
  a bpd_oracle row, then the gains over plain BPD. A run that render_only found missing
  (collected.missing) takes the rows `previous` (the workdir's results.json) holds for it."""
  carry = experiment.carried_rows(config, setting)
  rows, reread = [], []

  def measured(name: str, old: list[dict]) -> list[dict]:
    if name not in collected.missing:
      return collected.by_run.get(name, [])
    reread.extend([name] if old else [])
    return old
  for dataset in config.datasets:
    for h in config.heads:
      key = heads_key(dataset, h)
      if key in carry:
        rows += carry[key]
        continue
      mine = [r for r in previous if not r.get("carried") and setting(r) == key]
      for t in config.temperatures:
        got = measured(eval_run(dataset, h, t), [
            r for r in mine if r["temperature"] == float(t) and r["method"] != "bpd_oracle"])
        rows += [dict(r, p=paths_kept(r)) if r["method"] in ("bpd_ngram", "bpd_ngram_beam")
                 else r for r in got]
      got = measured(analysis_run(dataset, h), [r for r in mine if r["method"] == "bpd_oracle"])
      rows += [r if r.get("method") == "bpd_oracle" else oracle_row(oracle_k(config, h), r)
               for r in got]
  add_gains(rows)
  return rows, reread


# -- results.md ------------------------------------------------------------------------------


def _label(r: dict) -> str:
  """A method as the plots and tables name it: bpd_ngram carries its kept paths, bpd_ngram_beam
  its beam width."""
  if r["method"] == "bpd_ngram_beam":
    return f"bpd_ngram_beam W={r['p']}"
  return f"bpd_ngram p={r['p']}" if r["method"] == "bpd_ngram" else r["method"]


def _order(r: dict) -> tuple:
  methods = ("autoregressive", *DECODED, "bpd_oracle")
  return (r["heads"], methods.index(r["method"]) if r["method"] in methods else len(methods),
          r.get("p") or 0)


def _tau(r: dict) -> str:
  se = r.get("tau_se")
  return f"{r['block_efficiency']:.2f}" + (f" ± {se:.2f}" if se is not None else "")


def _gain(r: dict) -> str:
  g = r.get("gain_over_bpd")
  if g is None:
    return "–"
  return f"{100 * g:+.1f}%" + (f" ± {100 * r['gain_se']:.1f}" if r.get("gain_se") else "")


def _shape(r: dict) -> str:
  if r["method"] == "bpd_oracle":
    return f"best of the top-{r['oracle_k']} lattice's k^h paths"
  if r["method"] == "bpd_neural":
    return f"chain γ={r['gamma']}, heads' top-k rescored"
  return "–" if r["method"] == "autoregressive" else r.get("tree") or f"chain γ={r['gamma']}"


TABLE = ("heads", "method", "shape", "block_efficiency", "gain_over_bpd", "speedup",
         "tokens_per_s", "theoretical_speedup", "verifier_tokens_per_call", "identical_to_greedy")


def results_table(rows: list[dict]) -> list[str]:
  """One (dataset, T)'s rows, every h, the autoregressive baseline of each run first."""
  head = [glossary.column_label(c) + (" ± tau_se" if c == "block_efficiency" else "")
          for c in TABLE]
  lines = ["| " + " | ".join(head) + " |", "|---:|---|---|" + "---:|" * (len(TABLE) - 3)]
  for r in sorted(rows, key=_order):
    cells = [str(r["heads"]), _label(r), _shape(r), _tau(r), _gain(r)]
    cells += [tables.format_value(r.get(c), c) for c in TABLE[5:]]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def _by(rows, **where) -> list[dict]:
  return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def goal_lines(config, rows: list[dict]) -> list[str]:
  """The issue's two goals (config.goal_tau, config.goal_gain), checked on the measured rows
  (never on the oracle)."""
  goal_tau, goal_gain = float(config.goal_tau), float(config.goal_gain)
  out, met, total = [], 0, 0
  for dataset in config.datasets:
    for h in config.heads:
      greedy = [r for r in _by(rows, dataset=dataset, heads=h, temperature=0.0)
                if r["method"] in DECODED]
      if not greedy:
        continue
      in_domain = greedy[0].get("heads_data") == dataset
      best = max(greedy, key=lambda r: r["block_efficiency"])
      plain = next((r for r in greedy if r["method"] == "bpd"), None)
      ok = best["block_efficiency"] >= goal_tau
      if in_domain:
        total += 1
        met += ok
      out.append(
          f"- {dataset}, h = {h} (heads trained on {greedy[0].get('heads_data') or 'unknown'}"
          f"{', in domain' if in_domain else ', not in domain: not counted'}): plain bpd τ "
          f"{_tau(plain) if plain else '–'}, best decoded {_label(best)} τ {_tau(best)}: "
          f"τ ≥ {goal_tau:g} {'met' if ok else 'not met'}.")
  lines = [f"**Greedy in-domain τ ≥ {goal_tau:g}** (any decoded BPD method, T = 0): met in "
           f"{met} of {total} in-domain settings.", "", *out, ""]
  out, met, total = [], 0, 0
  for dataset in config.datasets:
    for h in config.heads:
      for t in config.temperatures:
        refined = [r for r in _by(rows, dataset=dataset, heads=h, temperature=float(t))
                   if r["method"] in REFINED and r.get("gain_over_bpd") is not None]
        if not refined:
          continue
        best = max(refined, key=lambda r: r["gain_over_bpd"])
        ok = best["gain_over_bpd"] >= goal_gain
        total += 1
        met += ok
        z = best["gain_over_bpd"] / (best.get("gain_se") or math.inf)
        noise = (" (above plain bpd beyond noise)" if z > NOISE_SE else
                 " (below plain bpd beyond noise)" if z < -NOISE_SE else
                 " (within noise of plain bpd)")
        out.append(f"- {dataset}, h = {h}, T = {float(t):g}: best refinement {_label(best)} "
                   f"{_gain(best)}{noise}: ≥ +{100 * goal_gain:g}% "
                   f"{'met' if ok else 'not met'}.")
  lines += [f"**Refinement ≥ +{100 * goal_gain:g}% τ over plain bpd** (bpd_ngram(_beam) or "
            f"bpd_neural, same dataset, h and T): met in {met} of {total} settings. ± is the "
            f"standard error of the ratio; 'beyond noise' when the gain is more than "
            f"{NOISE_SE:g} of them from 0.", "", *out, ""]
  return lines


def _settings(config, rows) -> list[tuple[str, int]]:
  """(dataset, h) pairs with rows, in config order."""
  have = {(r["dataset"], r["heads"]) for r in rows}
  return [(d, h) for d in config.datasets for h in config.heads if (d, h) in have]


def _oracles(config, rows: list[dict]) -> list[dict]:
  """The bpd_oracle rows (one per analysed (dataset, h)), in config order."""
  return [r for d, h in _settings(config, rows) for r in _by(rows, method="bpd_oracle",
                                                             dataset=d, heads=h)]


def analysis_lines(config, rows: list[dict]) -> list[str]:
  oracles = _oracles(config, rows)
  if not oracles:
    return ["_No head analysis has finished._", ""]
  ks = [str(k) for k in config.analysis_ks]
  lines = ["| dataset | h | head_entropy (nats, per head) | repetition_rate | top-1 accuracy | "
           "top-k accuracy (k of the oracle row) | "
           f"oracle_tau at k = {' / '.join(ks)} | bpd τ (T = 0, measured) |",
           "|---|---:|---|---:|---|---|---|---:|"]
  for r in oracles:
    plain = next(iter(_by(rows, method="bpd", dataset=r["dataset"], heads=r["heads"],
                          temperature=0.0)), None)
    lines.append(
        f"| {r['dataset']} | {r['heads']} | {tables.format_value(r['head_entropy'])} | "
        f"{r['repetition_rate']:.2f} | {tables.format_value(r['topk_accuracy'].get('1'))} | "
        f"k = {r['oracle_k']}: {tables.format_value(r['topk_accuracy'].get(str(r['oracle_k'])))} | "
        + " / ".join(f"{r['oracle_tau'][x]:.2f}" if x in r["oracle_tau"] else "–" for x in ks)
        + f" | {_tau(plain) if plain else '–'} |")
  return lines + [
      "", f"{oracles[0]['num_prompts']} prompts (the evaluate runs' own) × "
      f"{config.new_tokens} tokens of the verifier's greedy continuation. The oracle at k = 1 "
      "replays greedy BPD on these prompts, so it should equal the measured bpd τ at T = 0; "
      "its growth with k is the room a rescoring of the top-k lattice has.", ""]


def paper_lines(config, rows: list[dict]) -> list[str]:
  gains = [r["gain_over_bpd"] for r in rows if r["method"] in REFINED
           and r["temperature"] == 0.0 and r.get("gain_over_bpd") is not None]
  taus = [r["block_efficiency"] for r in _by(rows, method="bpd", temperature=0.0)]
  ours = (f"{100 * min(gains):+.1f}% to {100 * max(gains):+.1f}% (max {100 * max(gains):+.1f}%)"
          if gains else "–", f"τ {min(taus):.2f} to {max(taus):.2f}" if taus else "–")
  steps = " / ".join(str(n) for n in sorted({r["heads_steps"] for r in rows
                                             if r.get("heads_steps") is not None})
                     ) or str(config.train_steps)
  device = next((r["device"] for r in rows if r.get("device")), "?")
  lines = ["| paper | quantity | the paper | ours (greedy) |", "|---|---|---|---|"]
  lines += [f"| {p} | {q} | {v} | {o} |" for (p, q, v), o in zip(PAPERS, ours)]
  return lines + [
      "", "The papers' columns are the numbers they report, on their own (far larger) models "
      "and training budgets; not reproduced here. Our heads train for only "
      f"{steps} steps on {device}, so absolute τ is far below; compare the direction and "
      "size of the refinement gains, not the levels. Stern et al.'s mean accepted block size "
      "counts the verifier's own token, like τ.", ""]


def render_markdown(config, rows: list[dict], command_line: str,
                    reread: list[str] = ()) -> str:
  """results.md; `reread`: the runs whose rows came from the workdir's earlier results.json
  (render_only, their run directories gone)."""
  decoded = [r for r in rows if r["method"] != "bpd_oracle"]
  steps = {heads_key(r["dataset"], r["heads"]): r.get("heads_steps") for r in rows}
  carry = carried(config)
  reused = [f"{k} → `{v}` (given" + (f", {steps[k]} steps)" if steps.get(k) else ")")
            for k, v in config.heads_checkpoints.items()
            if any(k == heads_key(d, h) for d in config.datasets for h in config.heads)
            and k not in carry]
  tc = config.train
  md = [f"# {config.title}", "",
        f"Command: `{command_line}`. Verifier {model_name(config.verifier)}; drafter: h BPD "
        "heads on the verifier's last residual (no drafter model), trained with the verifier "
        f"frozen for {config.train_steps} steps ({tc.bpd.loss}, batch {tc.train.batch_size} × "
        f"{tc.data.seq_len} tokens, lr {tc.train.lr:g}) on each dataset's train split"
        + (f", except {', '.join(reused)}" if reused else "") + ". Neural rescorer "
        f"{model_name(config.rescorer)} (weight {config.rescorer_weight:g}); n-gram weight "
        f"{config.ngram_weight:g}; lattice top-k {config.top_k}"
        + "".join(f" ({key[1:]} heads: {k})" for key, k in sorted(config.top_k_per_heads.items())
                  if int(key[1:]) in config.heads)
        + f". {config.num_prompts} prompts × "
        f"{config.new_tokens} new tokens per run, batch {config.batch_size}; device "
        f"{decoded[0]['device'] if decoded else '?'}.", "",
        "Speedup: wall-clock tokens/s over the verifier's autoregressive decoding measured in "
        "the same evaluate run (its row, `autoregressive`, opens each h's block), so it swings "
        "with the machine's load; τ is a count and compares across runs."
        + (f" {config.note}" if config.get("note") else ""),
        *(["", f"Carried, not rerun: the rows of {', '.join(carry)} are read from "
           f"`{config.carry_from}` (an earlier run of this experiment; its heads, and so the "
           "methods added since, are not in them)."] if carry else []),
        *(["", f"Reported from the earlier results.json (render_only; their run directories are "
           f"not in runs/): {', '.join(reread)}."] if reread else []),
        "", "## Results", ""]
  for dataset in config.datasets:
    for t in config.temperatures:
      sel = _by(rows, dataset=dataset, temperature=float(t))
      if sel:
        md += [f"### {dataset}, T = {float(t):g}", "", *results_table(sel), ""]
  if not rows:
    md += ["_No run has finished._", ""]
  md += ["Methods:", "", *METHOD_NOTES, "", "## Head analysis (Kim et al. 2024, §3)", "",
         *analysis_lines(config, rows), "## Goals of the issue, checked on the measured rows",
         "", *goal_lines(config, rows), "## Paper numbers beside ours", "",
         *paper_lines(config, rows), "## Plots", "",
         "![τ by method](tau_by_method.png)", "", "![oracle τ vs k](oracle_vs_k.png)", "",
         "![entropy and repetition](entropy_repetition.png)", "", "## Glossary", ""]
  md += glossary.markdown_lines(set(TABLE) | {"dataset", "temperature", "tau_se", "device"})
  md += [f"- **{k}**: {v}" for k, v in EXTRA_GLOSSARY.items()]
  return "\n".join(md) + "\n"


def model_name(section) -> str:
  return section.checkpoint or section.size


# -- plots -----------------------------------------------------------------------------------

# One colour per method (bpd_ngram per kept paths); other labels take the palette's.
_COLOURS = {"bpd": "#444444", "bpd_tree": "#1f77b4", "bpd_ngram p=4": "#2ca02c",
            "bpd_ngram p=16": "#98df8a", "bpd_ngram_beam W=16": "#9467bd",
            "bpd_neural": "#ff7f0e", "bpd_oracle": "#d62728"}
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def _short(dataset: str) -> str:
  return dataset.replace("spec_jax_", "")


def _style(labels: list[str]):
  """label -> its colour (a method's own, else the palette's by first appearance)."""
  colours = {s: _COLOURS.get(s, _PALETTE[i % len(_PALETTE)]) for i, s in enumerate(labels)}
  return lambda label: dict(color=colours[label.split(": ")[0]],
                            linestyle="--" if label.endswith("(measured)") else "-")


def plots(config, rows: list[dict]) -> dict:
  """{file name: fn(path)} of the three plots, drawn by experiment.errorbar_plot."""
  about = (f"verifier {model_name(config.verifier)}, drafter: h BPD heads "
           f"({config.train_steps} training steps), rescorer {model_name(config.rescorer)}")
  # τ ± SE of every method per (dataset, h) panel, bars grouped by temperature.
  decoded = sorted((r for r in rows if r["method"] != "autoregressive"),
                   key=lambda r: (list(_COLOURS) + [_label(r)]).index(_label(r)))
  tau = {}
  for r in decoded:
    xs, ys, es = tau.setdefault((f"{_short(r['dataset'])}, h = {r['heads']}", _label(r)),
                                ([], [], []))
    xs.append(r["temperature"])
    ys.append(r["block_efficiency"])
    es.append(r.get("tau_se"))
  # The lattice oracle's τ against k, beside plain bpd's measured greedy τ (dashed).
  oracle = {}
  for r in _oracles(config, rows):
    name = f"{_short(r['dataset'])}, h = {r['heads']}"
    ks = sorted(int(k) for k in r["oracle_tau"])
    oracle[f"{name}: oracle"] = (ks, [r["oracle_tau"][str(k)] for k in ks], [None] * len(ks))
    for b in _by(rows, method="bpd", dataset=r["dataset"], heads=r["heads"], temperature=0.0):
      oracle[f"{name}: bpd (measured)"] = (ks, [b["block_efficiency"]] * len(ks),
                                           [b.get("tau_se")] * len(ks))
  # Each head's mean entropy per setting; the repetition rate in the legend.
  entropy = {f"{_short(r['dataset'])}, h = {r['heads']}: repetition "
             f"{r['repetition_rate']:.2f}": (list(range(1, len(r["head_entropy"]) + 1)),
                                             r["head_entropy"], [None] * len(r["head_entropy"]))
             for r in _oracles(config, rows)}
  labels = list(dict.fromkeys([label for _, label in tau] + [s.split(": ")[0] for s in oracle]
                              + [s.split(": ")[0] for s in entropy]))
  return {
      "tau_by_method.png": lambda path: experiment.errorbar_plot(
          path, tau, xlabel="temperature", bars=True, style=_style(labels),
          ylabel="τ, block efficiency (tokens per verifier call)", hline=1.0,
          hline_label="autoregressive", title=f"τ per method ± standard error over prompts; "
          f"{about}"),
      "oracle_vs_k.png": lambda path: experiment.errorbar_plot(
          path, oracle, xlabel="k (candidates per head in the lattice)",
          ylabel="oracle τ (tokens per verifier call)", style=_style(labels),
          title=f"Lattice oracle τ vs k (solid), plain bpd's measured greedy τ ± SE "
          f"(dashed)\nverifier {model_name(config.verifier)}"),
      "entropy_repetition.png": lambda path: experiment.errorbar_plot(
          path, entropy, xlabel="head", ylabel="mean entropy of the head's law (nats)",
          bars=True, style=_style(labels), title="Per-head entropy on the evaluate prompts' "
          "greedy continuations\n(legend: how often consecutive heads' argmax drafts repeat a "
          "token)"),
  }
