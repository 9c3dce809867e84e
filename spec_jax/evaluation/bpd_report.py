"""results.md and plots of the BPD experiment (`programs/bpd_experiment.py`): tables of τ ± SE,
speedups and the refinements' gain over plain BPD per (dataset, heads, temperature), the head
analysis, the papers' numbers beside ours, the issue's goals checked on the measured rows, and
tau_by_method.png, oracle_vs_k.png, entropy_repetition.png (matplotlib, Agg).
"""

from __future__ import annotations

import math

from spec_jax.evaluation import glossary, tables

# Decoded BPD methods (evaluate's row names) and the oracle, in table order.
DECODED = ("bpd", "bpd_tree", "bpd_ngram", "bpd_ngram_beam", "bpd_neural")
REFINED = ("bpd_ngram", "bpd_ngram_beam", "bpd_neural")
# The goals: greedy in-domain τ ≥ 2.0; a refinement gaining ≥ 5% τ over plain BPD.
GOAL_TAU = 2.0
GOAL_GAIN = 0.05
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
  if r["method"] == "autoregressive":
    return "–"
  return r.get("tree") or f"chain γ={r['gamma']}"


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
  """The issue's two goals, checked on the measured rows (never on the oracle)."""
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
      ok = best["block_efficiency"] >= GOAL_TAU
      if in_domain:
        total += 1
        met += ok
      out.append(
          f"- {dataset}, h = {h} (heads trained on {greedy[0].get('heads_data') or 'unknown'}"
          f"{', in domain' if in_domain else ', not in domain: not counted'}): plain bpd τ "
          f"{_tau(plain) if plain else '–'}, best decoded {_label(best)} τ {_tau(best)}: "
          f"τ ≥ {GOAL_TAU:g} {'met' if ok else 'not met'}.")
  lines = [f"**Greedy in-domain τ ≥ {GOAL_TAU:g}** (any decoded BPD method, T = 0): met in "
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
        ok = best["gain_over_bpd"] >= GOAL_GAIN
        total += 1
        met += ok
        z = best["gain_over_bpd"] / (best.get("gain_se") or math.inf)
        noise = (" (above plain bpd beyond noise)" if z > NOISE_SE else
                 " (below plain bpd beyond noise)" if z < -NOISE_SE else
                 " (within noise of plain bpd)")
        out.append(f"- {dataset}, h = {h}, T = {float(t):g}: best refinement {_label(best)} "
                   f"{_gain(best)}{noise}: ≥ +{100 * GOAL_GAIN:g}% "
                   f"{'met' if ok else 'not met'}.")
  lines += [f"**Refinement ≥ +{100 * GOAL_GAIN:g}% τ over plain bpd** (bpd_ngram(_beam) or "
            "bpd_neural, "
            f"same dataset, h and T): met in {met} of {total} settings. ± is the standard error "
            f"of the ratio; 'beyond noise' when the gain is more than {NOISE_SE:g} of them "
            "from 0.", "", *out, ""]
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
  lines = ["| paper | quantity | the paper | ours (greedy) |", "|---|---|---|---|"]
  lines += [f"| {p} | {q} | {v} | {o} |" for (p, q, v), o in zip(PAPERS, ours)]
  return lines + [
      "", "The papers' columns are the numbers they report, on their own (far larger) models "
      "and training budgets; not reproduced here. Our heads train for only "
      f"{steps} steps on 2 CPU cores, so absolute τ is far below; compare the direction and "
      "size of the refinement gains, not the levels. Stern et al.'s mean accepted block size "
      "counts the verifier's own token, like τ.", ""]


def heads_key(dataset: str, h: int) -> str:
  """The key of a (dataset, h) head set in config.heads_checkpoints."""
  return f"{dataset}_h{int(h)}"


def carried(config) -> tuple[str, ...]:
  """The settings "<dataset>_h<h>" whose rows the experiment reads from `carry_from`."""
  return tuple(config.get("carry", ()) or ())


def render_markdown(config, rows: list[dict], command_line: str) -> str:
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

# One colour per method (bpd_ngram per kept paths), one per (dataset, h) in the analysis plots.
_COLOURS = {"bpd": "#444444", "bpd_tree": "#1f77b4", "bpd_ngram p=4": "#2ca02c",
            "bpd_ngram p=16": "#98df8a", "bpd_ngram_beam W=16": "#9467bd",
            "bpd_neural": "#ff7f0e", "bpd_oracle": "#d62728"}
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def _figure(width: float, height: float):
  """An Agg figure (no display, no pyplot state) with room for a legend outside the axes."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
  from matplotlib.figure import Figure  # noqa: PLC0415
  fig = Figure(figsize=(width, height), layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def _legend(fig, labels: list[str], colours: list[str]) -> None:
  from matplotlib.patches import Patch  # noqa: PLC0415
  if labels:  # render_only before any run finished: no legend
    fig.legend([Patch(color=c) for c in colours], labels, fontsize=7,
               loc="outside right upper")


def _short(dataset: str) -> str:
  return dataset.replace("spec_jax_", "")


def plot_tau_by_method(config, rows, path: str) -> None:
  """One panel per (dataset, h): τ ± SE of every method, grouped by temperature."""
  bpd_rows = [r for r in rows if r["method"] != "autoregressive"]
  panels = _settings(config, bpd_rows) or [None]
  labels = sorted({_label(r) for r in bpd_rows}, key=lambda s: (list(_COLOURS) + [s]).index(s))
  colours = [_COLOURS.get(s, _PALETTE[i % len(_PALETTE)]) for i, s in enumerate(labels)]
  temps = [float(t) for t in config.temperatures]
  fig = _figure(max(3.6 * len(panels), 6.0) + 1.8, 4.2)
  width = 0.8 / max(len(labels), 1)
  for i, panel in enumerate(panels):
    ax = fig.add_subplot(1, len(panels), i + 1)
    ax.set_ylabel("τ, block efficiency (tokens per verifier call)")
    ax.grid(axis="y", alpha=0.3)
    if panel is None:
      ax.set_title("no finished runs")
      continue
    for j, (label, colour) in enumerate(zip(labels, colours)):
      xs, ys, es = [], [], []
      for k, t in enumerate(temps):
        r = next((r for r in _by(bpd_rows, dataset=panel[0], heads=panel[1], temperature=t)
                  if _label(r) == label), None)
        if r is not None:
          xs.append(k + (j - (len(labels) - 1) / 2) * width)
          ys.append(r["block_efficiency"])
          es.append(r.get("tau_se") or 0.0)
      ax.bar(xs, ys, width, yerr=es, capsize=2.5, color=colour)
    ax.axhline(1.0, color="black", linewidth=0.6)  # autoregressive decoding
    ax.set_xticks(range(len(temps)), [f"T = {t:g}" for t in temps])
    ax.set_title(f"{_short(panel[0])}, h = {panel[1]}", fontsize=9)
  _legend(fig, labels, colours)
  fig.suptitle(f"τ per method ± standard error over prompts (black line: autoregressive)\n"
               f"verifier {model_name(config.verifier)}, drafter: h BPD heads "
               f"({config.train_steps} training steps), rescorer {model_name(config.rescorer)}",
               fontsize=8)
  fig.savefig(path, dpi=110)


def plot_oracle_vs_k(config, rows, path: str) -> None:
  """The lattice oracle's τ vs k per (dataset, h), dashed at plain bpd's measured greedy τ."""
  fig = _figure(8.4, 4.2)
  ax = fig.add_subplot()
  for i, r in enumerate(_oracles(config, rows)):
    colour = _PALETTE[i % len(_PALETTE)]
    ks = sorted(int(k) for k in r["oracle_tau"])
    ax.plot(ks, [r["oracle_tau"][str(k)] for k in ks], marker="o", color=colour,
            label=f"{_short(r['dataset'])}, h = {r['heads']}: oracle")
    plain = next(iter(_by(rows, method="bpd", dataset=r["dataset"], heads=r["heads"],
                          temperature=0.0)), None)
    if plain is not None:
      ax.axhline(plain["block_efficiency"], color=colour, linestyle="--", linewidth=1,
                 label=f"{_short(r['dataset'])}, h = {r['heads']}: bpd (measured)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
  ax.set_xlabel("k (candidates per head in the lattice)")
  ax.set_ylabel("oracle τ (tokens per verifier call)")
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:  # nothing analysed yet under render_only: no legend
    fig.legend(fontsize=7, loc="outside right upper")
  ax.set_title(f"Lattice oracle τ vs k (solid) and plain bpd's measured greedy τ (dashed). "
               f"Verifier {model_name(config.verifier)}", fontsize=8)
  fig.savefig(path, dpi=110)


def plot_entropy_repetition(config, rows, path: str) -> None:
  """Per-head entropy (bars per head, one colour per (dataset, h)) and the repetition rate."""
  oracles = _oracles(config, rows)
  fig = _figure(9.6, 3.8)
  left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  width = 0.8 / max(len(oracles), 1)
  labels, colours = [], []
  for i, r in enumerate(oracles):
    colour = _PALETTE[i % len(_PALETTE)]
    heads = range(1, len(r["head_entropy"]) + 1)
    left.bar([k + (i - (len(oracles) - 1) / 2) * width for k in heads], r["head_entropy"],
             width, color=colour)
    right.bar([i], [r["repetition_rate"]], 0.7, color=colour)
    labels.append(f"{_short(r['dataset'])}, h = {r['heads']}")
    colours.append(colour)
  most = max((len(r["head_entropy"]) for r in oracles), default=1)
  left.set_xticks(range(1, most + 1), [f"head {k}" for k in range(1, most + 1)])
  left.set_ylabel("mean entropy of the head's law (nats)")
  left.set_title("Per-head entropy", fontsize=9)
  right.set_xticks(range(len(labels)), labels, fontsize=7, rotation=20)
  right.set_ylim(0, 1)
  right.set_ylabel("consecutive heads' argmax drafts equal")
  right.set_title("Repetition rate in block drafts", fontsize=9)
  for ax in (left, right):
    ax.grid(axis="y", alpha=0.3)
  _legend(fig, labels, colours)
  fig.suptitle(f"BPD heads on {model_name(config.verifier)}, on the evaluate prompts' greedy "
               "continuations", fontsize=8)
  fig.savefig(path, dpi=110)
