"""Program `bpd_experiment`: blockwise parallel decoding (Stern et al. 2018) and the draft
refinements of Kim et al. 2024 ("Exploring and Improving Drafts in Blockwise Parallel
Decoding") at small scale.

  python launch.py --config experiments/bpd/config.py --workdir experiments/bpd

For every dataset in `datasets` and head count h in `heads`:
  1. the heads: `heads_checkpoints[f"{dataset}_h{h}"]`, else train_bpd trains h heads on the
     dataset into <workdir>/runs/heads_<dataset>_h<h> (config: the `train` section);
  2. one `evaluate` run per temperature into <workdir>/runs/eval_<dataset>_h<h>_T<t>: plain BPD
     chains of h (rows `bpd`), the static lattice tree `tree` (rows `bpd_tree`), the n-gram
     rescored lattice paths bpd_ngram:P (greedy only) and the LM-rescored chains bpd_neural,
     beside the verifier's autoregressive baseline measured in the same process;
  3. the head analysis (spec_jax.evaluation.bpd_analysis) on the same prompts, cached in
     <workdir>/runs/analysis_<dataset>_h<h>/analysis.json: its lattice oracle τ at `oracle_k`
     becomes a `bpd_oracle` row (no decoding: an upper bound for any rescoring of the lattice).
Every finished piece is read back instead of redone (an evaluate run only while its config is
unchanged), so a killed experiment resumes, and `render_only` reports what has finished without
running anything. Writes results.json (rows named as in the glossary, plus heads, p, the gain
over plain BPD and the per-head analysis), results.md (tables, the papers' numbers, the issue's
goals checked on the measured rows) and tau_by_method.png, oracle_vs_k.png,
entropy_repetition.png.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re

from absl import logging
import jax
import ml_collections

from spec_jax import loading
from spec_jax.data import corpora
from spec_jax.data import prompts as prompts_lib
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding.drafters import bpd as bpd_drafter
from spec_jax.decoding.drafters import lattice
from spec_jax.evaluation import bpd_analysis, glossary, report, tables
from spec_jax.programs import evaluate, train_bpd

# Decoded BPD methods (evaluate's row names) and the oracle, in table order.
DECODED = ("bpd", "bpd_tree", "bpd_ngram", "bpd_neural")
REFINED = ("bpd_ngram", "bpd_neural")
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
         "verified as one prefix tree",
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
    "- **bpd_neural**: a chain whose per-head top-k is rescored left to right by a small LM "
    "(Kim et al.'s local neural rescoring);",
    "- **bpd_oracle**: no decoding; the lattice oracle τ at k = oracle_k from the head analysis,"
    " the ceiling of any rescoring of the top-k lattice.")


# -- configuration ---------------------------------------------------------------------------


def _heads_key(dataset: str, h: int) -> str:
  return f"{dataset}_h{int(h)}"


def heads_dir(config, workdir: str, dataset: str, h: int) -> tuple[str, bool]:
  """(the heads' train_bpd workdir, whether heads_checkpoints gave it)."""
  key = _heads_key(dataset, h)
  if key in config.heads_checkpoints:
    return str(config.heads_checkpoints[key]), True
  return os.path.join(workdir, "runs", f"heads_{key}"), False


def _newest_step(path: str | None) -> int | None:
  """The newest checkpoint step of a train_bpd workdir (None: none yet)."""
  ckpts = os.path.join(path, "checkpoints") if path else ""
  steps = [int(n) for n in os.listdir(ckpts) if n.isdigit()] if os.path.isdir(ckpts) else []
  return max(steps, default=None)


def train_config(config, dataset: str, h: int):
  """train_bpd's config for h heads on `dataset`: the `train` section with the shared fields."""
  cfg = copy.deepcopy(config.train)
  cfg.program = "train_bpd"
  cfg.seed, cfg.tokenizer = config.seed, config.tokenizer
  cfg.verifier = copy.deepcopy(config.verifier)
  cfg.data.name = dataset
  cfg.bpd.num_heads = int(h)
  steps = int(config.train_steps)
  # The section's warmup was sized for its own step count; never warm up past a tenth of ours.
  cfg.train.update(num_steps=steps,
                   warmup_steps=min(int(cfg.train.warmup_steps), max(steps // 10, 1)))
  return cfg


def eval_methods(config, h: int, temperature: float) -> tuple[str, ...]:
  """evaluate's eval.methods for one run: bpd_ngram verifies a deterministic set of paths (no
  exact law), so it runs at T = 0 only (evaluate refuses it otherwise)."""
  entries = [f"sd@{h}", f"{config.tree}@{h}"]
  if float(temperature) == 0.0:
    entries += [f"bpd_ngram:{int(p)}@{h}" for p in config.ngram_paths]
  return tuple(entries + [f"bpd_neural@{h}"])


def eval_config(config, dataset: str, h: int, temperature: float, heads: str):
  """evaluate's config for one (dataset, h, T) run with `heads` as the drafter."""
  cfg = copy.deepcopy(config.eval)
  cfg.program = "evaluate"  # what the run dir's config.json records
  cfg.seed, cfg.tokenizer = config.seed, config.tokenizer
  cfg.verifier = copy.deepcopy(config.verifier)
  # The heads' step in the title: a run's config.json then changes when the heads train on, so
  # the experiment decodes again instead of reading back rows of older heads.
  cfg.title = (f"{config.title}: {dataset}, h = {h} (step {_newest_step(heads)}), "
               f"T = {float(temperature):g}")
  cfg.data.name = dataset
  cfg.drafter.checkpoint = heads
  cfg.num_data_prompts = int(config.num_prompts)
  cfg.eval.update(methods=eval_methods(config, h, temperature), gammas=(int(h),),
                  temperatures=(float(temperature),), batch_sizes=(int(config.batch_size),),
                  num_prompts=int(config.num_prompts), new_tokens=int(config.new_tokens))
  cfg.eval.bpd.update(top_k=int(config.top_k), ngram=dataset,
                      ngram_weight=float(config.ngram_weight),
                      rescorer_weight=float(config.rescorer_weight))
  cfg.eval.bpd.rescorer = copy.deepcopy(config.rescorer)
  return cfg


# Values an error message suggests for an empty list field.
_EXAMPLES = dict(datasets=("spec_jax_shakespeare",), heads=(3,), temperatures=(0.0,),
                 analysis_ks=(1, 2, 4, 8), ngram_paths=(4, 16))


def check_config(config, workdir: str) -> None:
  """Every field, and every train / evaluate config the experiment will run, checked before
  anything trains or loads (one error naming the field and the fix)."""
  for field in ("datasets", "heads", "temperatures", "analysis_ks", "ngram_paths"):
    if not tuple(config[field]):
      raise ValueError(f"{field} is empty: give at least one value "
                       f"(e.g. --config.{field}=\"{tuple(_EXAMPLES[field])}\").")
  for d in config.datasets:
    if d not in corpora.NAMES:
      raise ValueError(f"datasets has {d!r}, which is not one of this repo's corpora "
                       f"{list(corpora.NAMES)}. Fix: --config.datasets=\"('spec_jax_shakespeare',)"
                       "\" or another of those names.")
  for h in config.heads:
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
      raise ValueError(f"heads has {h!r}: a BPD drafter needs an integer h >= 1 heads. Fix: "
                       "--config.heads=\"(3, 5)\".")
  for t in config.temperatures:
    if float(t) < 0:
      raise ValueError(f"temperatures has {t}: a temperature must be >= 0 (0 = greedy). Fix: "
                       "--config.temperatures=\"(0.0, 1.0)\".")
  for name in ("train_steps", "num_prompts", "new_tokens", "batch_size", "top_k"):
    if int(config[name]) < 1:
      raise ValueError(f"{name}={config[name]} must be >= 1.")
  if min(int(k) for k in config.analysis_ks) < 1 or config.oracle_k not in config.analysis_ks:
    raise ValueError(f"oracle_k={config.oracle_k} must be one of analysis_ks="
                     f"{tuple(config.analysis_ks)} (each >= 1). Fix: --config.oracle_k=4 with "
                     "analysis_ks=(1, 2, 4, 8).")
  k = int(config.top_k)
  for h in config.heads:
    for p in config.ngram_paths:
      if not 1 <= int(p) <= k ** h or k ** h > lattice.MAX_PATHS:
        raise ValueError(f"ngram_paths has {p}, but h = {h} heads with top_k={k} give "
                         f"{k ** h} lattice paths (at most {lattice.MAX_PATHS} are scored). Fix: "
                         f"ngram_paths entries in [1, {min(k ** h, lattice.MAX_PATHS)}], or "
                         "change top_k.")
  for key in config.heads_checkpoints:
    match = re.fullmatch(r"(.+)_h([1-9][0-9]*)", key)
    if not match or match.group(1) not in corpora.NAMES:
      raise ValueError(f"heads_checkpoints has the key {key!r}; keys are '<dataset>_h<heads>' "
                       "(e.g. 'spec_jax_shakespeare_h3') with a dataset of "
                       f"{list(corpora.NAMES)}.")
  for dataset in config.datasets:
    for h in config.heads:
      path, given = heads_dir(config, workdir, dataset, h)
      if given and not config.render_only:
        _check_heads(path, h, f"heads_checkpoints[{_heads_key(dataset, h)!r}]")
      if not given:
        train_bpd.check_config(train_config(config, dataset, h))
      for t in config.temperatures:
        cfg = eval_config(config, dataset, h, t, path)
        try:
          evaluate.check_config(cfg, _eval_dir(workdir, dataset, h, t),
                                evaluate.method_runs(cfg.eval))
        except ValueError as e:
          raise ValueError(f"The evaluate run for {dataset}, h = {h}, T = {float(t):g} "
                           f"(built from this config's tree, top_k, weights, num_prompts, "
                           f"new_tokens and `eval` section): {e}") from None


def _check_heads(path: str, h: int, field: str) -> None:
  """A given heads checkpoint exists, is a train_bpd checkpoint, and has at least h heads."""
  if not os.path.isdir(path):
    raise ValueError(f"{field}={path!r} does not exist. Fix: train it (configs/train_bpd.py) or "
                     "drop the entry so the experiment trains the heads itself.")
  b_cfg = loading.drafter_bpd(ml_collections.ConfigDict(dict(checkpoint=path)))
  if b_cfg is None or b_cfg.num_heads < h:
    raise ValueError(f"{field}={path!r} holds "
                     f"{'no BPD heads' if b_cfg is None else f'{b_cfg.num_heads} heads'}, not "
                     f"{h}. Fix: a train_bpd workdir with {h} heads, or drop the entry.")


# -- the runs --------------------------------------------------------------------------------


def _eval_dir(workdir: str, dataset: str, h: int, temperature: float) -> str:
  return os.path.join(workdir, "runs", f"eval_{dataset}_h{h}_T{float(temperature):g}")


def train_heads(config, workdir: str, dataset: str, h: int) -> str | None:
  """The heads' directory, trained first if needed (None: untrained under render_only)."""
  path, given = heads_dir(config, workdir, dataset, h)
  if given or (_newest_step(path) or 0) >= int(config.train_steps):
    return path
  if config.render_only:
    return None
  cfg = train_config(config, dataset, h)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    f.write(cfg.to_json_best_effort(indent=2))  # the record launch.py would have written
  logging.info("Training %d BPD heads on %s for %d steps in %s.", h, dataset,
               config.train_steps, path)
  train_bpd.run(cfg, path)
  return path


def _read_text(path: str) -> str | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return f.read()


def evaluate_heads(config, workdir: str, dataset: str, h: int, temperature: float,
                   heads: str | None) -> list[dict]:
  """evaluate's rows for one (dataset, h, T): read back when its results.json exists and its
  config is the one this experiment would run (under render_only: whenever it exists)."""
  run_dir = _eval_dir(workdir, dataset, h, temperature)
  done = os.path.join(run_dir, "results.json")
  cfg = eval_config(config, dataset, h, temperature, heads or "")
  same = _read_text(os.path.join(run_dir, "config.json")) == cfg.to_json_best_effort(indent=2)
  if os.path.exists(done) and (same or config.render_only):
    return report.load_rows(done)
  if config.render_only or heads is None:
    return []
  logging.info("Evaluating %s, h = %d, T = %g: %s into %s.", dataset, h, temperature,
               ", ".join(cfg.eval.methods), run_dir)
  return evaluate.run(cfg, run_dir)


def _prompt_ids(cfg, tokenizer) -> list[list[int]]:
  """The token ids of the prompts evaluate decodes with `cfg` (its own rules, in its order)."""
  ev = cfg.eval
  n = int(cfg.get("num_data_prompts", 0))
  texts = prompts_lib.take(
      prompts_lib.read_prompts(cfg, tokenizer,
                               num_data_prompts=max(int(ev.num_prompts), n) if n else None),
      int(ev.num_prompts), "num_prompts")
  return tokenizer.encode_batch(texts)


def analyse_heads(config, workdir: str, dataset: str, h: int, heads: str | None,
                  verifier: dict) -> dict | None:
  """bpd_analysis.analyse on the evaluate runs' prompts, cached in the run dir with the
  settings it was computed for (a change of any recomputes it). `verifier` caches the loaded
  verifier across calls."""
  path = os.path.join(workdir, "runs", f"analysis_{dataset}_h{h}", "analysis.json")
  key = dict(heads=heads, heads_step=_newest_step(heads), num_prompts=int(config.num_prompts),
             new_tokens=int(config.new_tokens), ks=[int(k) for k in config.analysis_ks],
             data_prompt_tokens=int(config.eval.data_prompt_tokens), seed=int(config.seed),
             verifier=_model_name(config.verifier), tokenizer=str(config.tokenizer))
  saved = _read_text(path)
  saved = json.loads(saved) if saved else None
  if saved is not None and (config.render_only or saved["key"] == key):
    return saved["analysis"]
  if config.render_only or heads is None:
    return None
  logging.info("Head analysis of %s (%s, h = %d, k in %s).", heads, dataset, h,
               tuple(config.analysis_ks))
  cfg = eval_config(config, dataset, h, 0.0, heads)
  tokenizer = tokenizer_lib.get_tokenizer(cfg.tokenizer)
  if not verifier:
    verifier.update(zip(("cfg", "params"), loading.load_model(
        cfg.verifier, tokenizer, seed=cfg.seed, field="verifier.checkpoint")))
  b_cfg = loading.drafter_bpd(cfg.drafter)
  _, head_params = loading.load_model(cfg.drafter, tokenizer, seed=cfg.seed + 1,
                                      field=f"heads of {dataset}, h = {h}")
  # What evaluate does with the heads: checks they were trained on this verifier.
  head_params = bpd_drafter.BPDDrafter(b_cfg, verifier["cfg"]).params(
      head_params, verifier["params"])["heads"]
  stats = bpd_analysis.analyse(b_cfg, head_params, verifier["cfg"], verifier["params"],
                               _prompt_ids(cfg, tokenizer), int(config.new_tokens),
                               ks=tuple(config.analysis_ks))
  stats = json.loads(json.dumps(stats))  # k keys as strings, as a reread gives them
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(dict(key=key, analysis=stats), f, indent=2)
  return stats


def _heads_record(heads: str | None) -> dict:
  """Where the heads come from: their directory, newest step and training corpus."""
  saved = _read_text(os.path.join(heads, "config.json")) if heads else None
  data = json.loads(saved).get("data", {}).get("name") if saved else None
  return dict(heads_checkpoint=heads, heads_steps=_newest_step(heads), heads_data=data)


def oracle_row(config, dataset: str, h: int, stats: dict) -> dict:
  """The bpd_oracle row: the lattice oracle's τ at oracle_k, with the whole analysis."""
  k = str(config.oracle_k)
  return dict(method="bpd_oracle", dataset=dataset, temperature=0.0, heads=h, gamma=h,
              oracle_k=int(k), block_efficiency=stats["oracle_tau"][k], tau_se=None,
              speedup=None, tokens_per_s=None, theoretical_speedup=None,
              verifier_tokens_per_call=None, identical_to_greedy=None,
              oracle_tau=stats["oracle_tau"], head_entropy=stats["head_entropy"],
              repetition_rate=stats["repetition_rate"], topk_accuracy=stats["topk_accuracy"],
              num_prompts=stats["prompts"], new_tokens=stats["tokens"] * stats["prompts"])


def _paths_kept(row: dict) -> int | None:
  match = re.match(r"p=(\d+)", row.get("tree") or "")
  return int(match.group(1)) if match else None


def add_gains(rows: list[dict]) -> None:
  """gain_over_bpd (and its standard error, prompts treated as independent between the two
  runs, which is conservative: both decode the same prompts) on every non-bpd BPD row."""
  plain = {(r["dataset"], r["heads"], r["temperature"]): r for r in rows if r["method"] == "bpd"}
  for r in rows:
    b = plain.get((r["dataset"], r["heads"], r["temperature"]))
    if r["method"] in ("autoregressive", "bpd") or b is None or not b["block_efficiency"]:
      continue
    ratio = r["block_efficiency"] / b["block_efficiency"]
    rel = math.hypot((r.get("tau_se") or 0.0) / r["block_efficiency"],
                     (b.get("tau_se") or 0.0) / b["block_efficiency"])
    r.update(gain_over_bpd=round(ratio - 1, 4), gain_se=round(ratio * rel, 4))


def collect_rows(config, workdir: str) -> list[dict]:
  """Every run's rows (training, decoding and analysing what has not finished yet)."""
  rows, verifier = [], {}
  for dataset in config.datasets:
    for h in config.heads:
      heads = train_heads(config, workdir, dataset, h)
      record = _heads_record(heads)
      for t in config.temperatures:
        for r in evaluate_heads(config, workdir, dataset, h, t, heads):
          r.update(dataset=dataset, heads=h, **record)
          if r["method"] == "bpd_ngram":
            r["p"] = _paths_kept(r)
          rows.append(r)
      stats = analyse_heads(config, workdir, dataset, h, heads, verifier)
      if stats is not None:
        rows.append(dict(oracle_row(config, dataset, h, stats), **record))
  add_gains(rows)
  return rows


# -- results.md ------------------------------------------------------------------------------


def _label(r: dict) -> str:
  """A method as the plots and tables name it: bpd_ngram carries its kept paths."""
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
  lines += [f"**Refinement ≥ +{100 * GOAL_GAIN:g}% τ over plain bpd** (bpd_ngram or bpd_neural, "
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
  k = str(config.oracle_k)
  lines = ["| dataset | h | head_entropy (nats, per head) | repetition_rate | top-1 accuracy | "
           f"top-{k} accuracy | oracle_tau at k = {' / '.join(ks)} | bpd τ (T = 0, measured) |",
           "|---|---:|---|---:|---|---|---|---:|"]
  for r in oracles:
    plain = next(iter(_by(rows, method="bpd", dataset=r["dataset"], heads=r["heads"],
                          temperature=0.0)), None)
    lines.append(
        f"| {r['dataset']} | {r['heads']} | {tables.format_value(r['head_entropy'])} | "
        f"{r['repetition_rate']:.2f} | {tables.format_value(r['topk_accuracy'].get('1'))} | "
        f"{tables.format_value(r['topk_accuracy'].get(k))} | "
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


def render_markdown(config, rows: list[dict], command_line: str) -> str:
  decoded = [r for r in rows if r["method"] != "bpd_oracle"]
  reused = [f"{k} → `{v}`" for k, v in config.heads_checkpoints.items()
            if any(k == _heads_key(d, h) for d in config.datasets for h in config.heads)]
  tc = config.train
  md = [f"# {config.title}", "",
        f"Command: `{command_line}`. Verifier {_model_name(config.verifier)}; drafter: h BPD "
        "heads on the verifier's last residual (no drafter model), trained with the verifier "
        f"frozen for {config.train_steps} steps ({tc.bpd.loss}, batch {tc.train.batch_size} × "
        f"{tc.data.seq_len} tokens, lr {tc.train.lr:g}) on each dataset's train split"
        + (f", except {', '.join(reused)} (given)" if reused else "") + ". Neural rescorer "
        f"{_model_name(config.rescorer)} (weight {config.rescorer_weight:g}); n-gram weight "
        f"{config.ngram_weight:g}; lattice top-k {config.top_k}. {config.num_prompts} prompts × "
        f"{config.new_tokens} new tokens per run, batch {config.batch_size}; device "
        f"{decoded[0]['device'] if decoded else '?'}.", "",
        "Speedup: wall-clock tokens/s over the verifier's autoregressive decoding measured in "
        "the same evaluate run (its row, `autoregressive`, opens each h's block); these 2 "
        "CPU cores were shared with other jobs, so speedups swing; τ is a count and compares.",
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


def _model_name(section) -> str:
  return section.checkpoint or section.size


# -- plots -----------------------------------------------------------------------------------

# One colour per method (bpd_ngram per kept paths), one per (dataset, h) in the analysis plots.
_COLOURS = {"bpd": "#444444", "bpd_tree": "#1f77b4", "bpd_ngram p=4": "#2ca02c",
            "bpd_ngram p=16": "#98df8a", "bpd_neural": "#ff7f0e", "bpd_oracle": "#d62728"}
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
               f"verifier {_model_name(config.verifier)}, drafter: h BPD heads "
               f"({config.train_steps} training steps), rescorer {_model_name(config.rescorer)}",
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
               f"Verifier {_model_name(config.verifier)}", fontsize=8)
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
  fig.suptitle(f"BPD heads on {_model_name(config.verifier)}, on the evaluate prompts' greedy "
               "continuations", fontsize=8)
  fig.savefig(path, dpi=110)


def run(config, workdir: str) -> list[dict]:
  check_config(config, workdir)
  os.makedirs(workdir, exist_ok=True)
  # Compiled decoding loops persist across runs and restarts (much of the time is compiling),
  # unless the caller already chose a cache (tests share one through the environment).
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "runs", "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  rows = collect_rows(config, workdir)
  with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
  md = render_markdown(config, rows, report.launch_command(config, workdir))
  with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
    f.write(md)
  plot_tau_by_method(config, rows, os.path.join(workdir, "tau_by_method.png"))
  plot_oracle_vs_k(config, rows, os.path.join(workdir, "oracle_vs_k.png"))
  plot_entropy_repetition(config, rows, os.path.join(workdir, "entropy_repetition.png"))
  print(md)
  methods = sorted({r["method"] for r in rows})
  summary = (f"bpd_experiment: {len(rows)} rows ({', '.join(methods) or 'none finished'}); "
             f"wrote {', '.join(OUTPUTS)} in {os.path.abspath(workdir)}")
  logging.info(summary)
  print(summary, flush=True)
  return rows
