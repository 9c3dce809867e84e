"""Program `evaluate`: autoregressive vs speculative decoding over a prompt set.

For every (temperature, batch size) it measures, in one process on the same prompts, the
verifier's autoregressive decoding (the speedup baseline) and every run of `eval.methods` ×
`eval.gammas` (each entry `NAME[:SHAPE][@L]` names a registered method,
`spec_jax.decoding.methods`), through `spec_jax.evaluation.bench`: one row per run with τ, α,
per-position acceptance, tokens/s, the speedup, c, the measured r(M) and the theoretical speedup
τ / (r(M) + d·c) (a tree's calls at c(w) each for the w tokens they feed, s(w) timed once per
temperature and batch size). Writes results.json, results.md and PNG plots (τ and speedup vs γ).
Each prompt batch is padded to the smallest of `generate.bucket_widths(eval.max_prompt_tokens,
eval.prompt_buckets)` that holds its longest prompt (0: all to eval.max_prompt_tokens), so a
short batch's prefill stays short and a few compiled widths serve every batch.
Every field, method and option is validated, and the cache room of the actual prompts checked,
before any model loads. Each finished row goes to rows.jsonl as it completes; a rerun reads
finished rows back while the digest of the fields that change them (`row_digest`) matches. Every
row carries the autoregressive tokens/s its speedup divides by (baseline_tokens_per_s); a row read
back into a (T, B) whose baseline this process measured again is marked baseline="earlier", a
column of the report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from absl import logging

from spec_jax import loading, parallel
from spec_jax.data import prompts as prompts_lib
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop, methods
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.evaluation import bench, experiment, report, tables, timing
from spec_jax.training import checkpoints

CONSOLE_COLUMNS = ("method", "tree", "gamma", "block_efficiency", "tau_se", "acceptance_rate",
                   "tokens_per_s", "speedup", "paired_speedup", "theoretical_speedup")
ROWS = "rows.jsonl"  # every finished row as it completes: a rerun of the same config resumes
# Fields no row depends on: what only shapes the report. A run's digest (the harness's reuse rule,
# `evaluation.experiment.digest`) covers everything else, sweeps included.
DIGEST_IGNORE = ("title", "print_json", "eval.save_text")
# Within one workdir each row's key names its temperature, batch size, method, γ and ε, so the
# rows.jsonl log also leaves the sweep lists out: a rerun that adds a γ keeps the finished rows.
SWEEPS = ("eval.methods", "eval.gammas", "eval.temperatures", "eval.batch_sizes", "eval.epsilons")


def row_digest(config) -> str:
  """The digest rows.jsonl tags each row with: the run's digest less the sweeps, and what the
  verifier and drafter checkpoints hold (`checkpoints.identity`: a drafter trained further at
  the same path decodes again)."""
  base = experiment.digest(config, program="evaluate", ignore=SWEEPS)
  held = {f: checkpoints.identity(config[f].get("checkpoint", ""))
          for f in ("verifier", "drafter") if f in config}
  if not any(held.values()):
    return base
  return hashlib.sha256(json.dumps([base, held], sort_keys=True).encode()).hexdigest()


def digest_defaults() -> dict:
  """The method options' defaults (`methods.option_defaults`) as dotted eval keys."""
  return experiment.flatten({"eval": methods.option_defaults()})


def method_runs(ev) -> list[methods.Entry]:
  """Every run eval.methods × eval.gammas asks for, parsed (`methods.entries`)."""
  return methods.entries(ev)


def _samplings(ev) -> list[sampling_lib.Sampling]:
  out = []
  for t in ev.temperatures:
    if float(t) < 0:
      raise ValueError(f"eval.temperatures has {t}: a temperature must be >= 0 (0 = greedy).")
    try:
      out.append(sampling_lib.Sampling(float(t), int(ev.top_k), float(ev.top_p)))
    except ValueError as e:  # top_k / top_p: name the eval fields
      raise ValueError(str(e).replace("sampling.", "eval.")) from None
  return out


def decode_config(ev, entry: methods.Entry, epsilon: float) -> loop.DecodeConfig:
  """The verification knobs of one run: eval.rule for chains, eval.tree_rule for trees."""
  return loop.DecodeConfig(rule=ev.rule if entry.shape.is_chain else ev.tree_rule,
                           lenience=ev.lenience, epsilon=float(epsilon),
                           relaxed_top_k=int(ev.get("relaxed_top_k", 2)))


def epsilons(ev, entry: methods.Entry) -> tuple:
  """ε values to sweep for one run: eval.epsilons (if set) for lenient chains, else eval.epsilon."""
  if entry.shape.is_chain and ev.rule == "lenient" and ev.get("epsilons"):
    return tuple(ev.epsilons)
  return (ev.epsilon,)


def check_config(config, workdir: str) -> tuple[list[methods.Entry], methods.Source]:
  """Every field evaluate reads, checked before any model loads (one error naming the field and
  the fix): the sweeps, the methods and their options, what each method needs of the drafter
  checkpoint, and every rule at every temperature. Returns the runs and the drafter source."""
  ev = config.eval
  loading.check_models(config, "verifier", "drafter")
  tokenizer_lib.check_name(config.tokenizer)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir!r} is a file; results go into a directory. Fix: pass "
                     "a directory path (it is created if missing).")
  for field in ("gammas", "temperatures", "batch_sizes"):
    if not tuple(ev[field]):
      raise ValueError(f"eval.{field} is empty: give at least one value.")
  for field, what in (("gammas", "a draft length"), ("batch_sizes", "a batch size")):
    for v in ev[field]:
      if int(v) < 1:
        raise ValueError(f"eval.{field} has {v}: {what} must be >= 1.")
  for name in ("num_prompts", "new_tokens", "max_prompt_tokens", "max_cache_len",
               "timing_repeats"):
    if int(ev.get(name, 1)) < 1:
      raise ValueError(f"eval.{name}={ev[name]} must be >= 1.")
  if int(ev.get("timing_pairs", 0)) < 0:
    raise ValueError(f"eval.timing_pairs={ev.timing_pairs} must be >= 0 (0: no paired passes).")
  generate_lib.bucket_widths(int(ev.max_prompt_tokens), _buckets(ev), "eval.prompt_buckets")
  for field, values in (("epsilon", [ev.epsilon]), ("epsilons", ev.get("epsilons", ()) or ())):
    for e in values:
      if not isinstance(e, (int, float)) or isinstance(e, bool) or not 0.0 < e <= 1.0:
        raise ValueError(f"eval.{field} has {e}: lenience ε must be in (0, 1] (1 = lossless).")
  entries = method_runs(ev)
  source = loading.drafter_source(config.drafter)
  for sampling in _samplings(ev):
    for entry in entries:
      methods.check(entry, source, sampling)
      for e in epsilons(ev, entry):
        try:
          decode_config(ev, entry, e).resolve(entry.shape, sampling)
        except ValueError as err:
          field = "eval.rule" if entry.shape.is_chain else "eval.tree_rule"
          raise ValueError(f"At eval.temperatures entry {sampling.temperature:g}: " + str(
              err).replace("decode.rule", field).replace("decode.", "eval.")) from None
  return entries, source


def check_room(ev, batches, entries) -> None:
  """The cache must hold the widest padded batch + eval.new_tokens + the widest proposal's
  overhang; the error names the numbers and the fields to change."""
  longest = max(p.tokens.shape[1] for p, _ in batches)
  overhang = max([e.shape.num_nodes - 1 for e in entries], default=0)
  total = longest + int(ev.new_tokens) + overhang
  if total > int(ev.max_cache_len):
    raise ValueError(
        f"The cache needs {total} slots (padded prompt {longest} tokens + eval.new_tokens="
        f"{ev.new_tokens} + {overhang} for the largest draft) but eval.max_cache_len="
        f"{ev.max_cache_len}. Fix: lower eval.new_tokens, eval.max_prompt_tokens or the "
        "largest γ / tree, or raise eval.max_cache_len if the model's context allows.")


def _buckets(ev) -> int:
  """eval.prompt_buckets, or its default where a config lacks it (both digest alike)."""
  return ev.get("prompt_buckets", generate_lib.SMALLEST_BUCKET)


def _batches(tokenizer, texts, batch_size, ev):
  """Prompt batches of exactly batch_size rows (the last one padded by repeating its last prompt;
  padded rows are dropped from every count), each padded to its bucket width."""
  out = []
  for start in range(0, len(texts), batch_size):
    chunk = texts[start:start + batch_size]
    real = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - real)
    out.append((generate_lib.encode_prompts(tokenizer, chunk, int(ev.max_prompt_tokens),
                                            "eval.max_prompt_tokens", _buckets(ev)), real))
  return out


def prompt_batches(config, tokenizer, entries) -> tuple[list[str], dict[int, list]]:
  """(the eval.num_prompts prompt texts, batch size -> [(Prompts, real rows)]), the cache room
  each run needs checked: all before any model loads."""
  ev = config.eval
  extra = int(config.get("num_data_prompts", 0))
  texts = prompts_lib.take(
      prompts_lib.read_prompts(config, tokenizer, num_data_prompts=max(int(ev.num_prompts), extra)
                               if extra else None), int(ev.num_prompts), "eval.num_prompts")
  all_batches = {b: _batches(tokenizer, texts, b, ev) for b in ev.batch_sizes}
  for batches in all_batches.values():
    check_room(ev, batches, entries)
  return texts, all_batches


class _RowLog:
  """Finished rows in <workdir>/rows.jsonl, each under a key naming its run and tagged with the
  config's digest: a rerun whose rows would come out the same reads them back; any other config
  starts afresh (the old file is kept as rows.jsonl.previous). Every process reads it; process 0
  alone writes it (in a multi-host run each process times its own passes: one log, one timing)."""

  def __init__(self, workdir: str, config):
    self.path = os.path.join(workdir, ROWS)
    self.digest = row_digest(config)
    self.done = {}
    if os.path.exists(self.path):
      with open(self.path, encoding="utf-8") as f:
        for line in f:
          try:
            record = json.loads(line)
          except json.JSONDecodeError:  # a line cut short by a kill
            continue
          if record.get("config") == self.digest:
            self.done[record["key"]] = record["row"]
    if not parallel.is_writer():
      return
    if not self.done and os.path.exists(self.path):
      os.replace(self.path, self.path + ".previous")
    elif self.done:
      with open(self.path, "rb+") as f:  # a line cut by a kill must not swallow the next record
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
          f.write(b"\n")

  def add(self, key: str, row: dict) -> None:
    self.done[key] = row
    if not parallel.is_writer():
      return
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"key": key, "config": self.digest, "row": row}) + "\n")


def _load(config, tokenizer, source, entries, mesh):
  """The verifier and the drafter checkpoint into `source` (placed on the mesh), before any
  decoding: every batch size must fit the mesh."""
  ev = config.eval
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed,
                                       field="verifier.checkpoint")
  loading.load_source(source, config.drafter, tokenizer, v_cfg, v_params, seed=config.seed,
                      data_dir=config.data.get("data_dir") or None,
                      load_drafter=methods.needs_model(entries))
  if mesh is not None:
    heads = {"verifier": v_cfg.n_kv_heads}
    if source.d_cfg is not None:
      heads["drafter"] = source.d_cfg.n_kv_heads
    for batch_size in ev.batch_sizes:
      parallel.check_decode_mesh(mesh, batch_size, heads,
                                 batch_field=f"eval.batch_sizes entry {batch_size}: the batch size")
    source.v_params = parallel.place_params(v_params, mesh)
    if source.d_params is not None:
      source.d_params = parallel.place_params(source.d_params, mesh)
  return source


def _against(row: dict, ar_row: dict) -> dict:
  """A read-back row, marked baseline="earlier" when its speedup divides by another
  autoregressive pass than `ar_row` (rows from before baseline_tokens_per_s existed keep what
  they were logged with)."""
  base = row.get("baseline_tokens_per_s")
  if base is not None and base != ar_row.get("tokens_per_s"):
    return dict(row, baseline="earlier")
  return row


def _save_text(workdir, texts, token_lists, tokenizer, **setting) -> None:
  """eval.save_text: append each prompt's speculative continuation to texts.jsonl (process 0)."""
  if not parallel.is_writer():
    return
  with open(os.path.join(workdir, "texts.jsonl"), "a", encoding="utf-8") as f:
    for prompt, ids in zip(texts, token_lists):
      f.write(json.dumps({**setting, "prompt": prompt, "completion": tokenizer.decode(ids)})
              + "\n")


def run(config, workdir: str) -> list[dict]:
  ev = config.eval
  entries, source = check_config(config, workdir)  # bad input fails before anything loads
  os.makedirs(workdir, exist_ok=True)
  if parallel.is_writer():
    report.write_text(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
  mesh = parallel.decode_mesh(config.mesh)
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  texts, all_batches = prompt_batches(config, tokenizer, entries)
  source = _load(config, tokenizer, source, entries, mesh)
  built = []  # every drafter built (and its shape checked) before any decoding
  for entry in entries:
    b = methods.build(entry, source)
    built.append(b if mesh is None else
                 dataclasses.replace(b, params=parallel.place_params(b.params, mesh)))
  stop_ids = tokenizer.stop_ids if ev.stop_at_eos else ()
  device, log, rows = timing.device_description(), _RowLog(workdir, config), []
  context = dict(seed=config.seed, dataset=prompts_lib.prompt_source(config),
                 verifier=config.verifier.checkpoint or config.verifier.size,
                 drafter=config.drafter.checkpoint or config.drafter.size)
  # r(M) per (batch size, M), measured once and shared by every temperature, and how its timing
  # ran against the first temperature's autoregressive step (a usage dict).
  r_ms, r_checks = {}, {}
  for sampling in _samplings(ev):
    for batch_size in ev.batch_sizes:
      label = f"T={sampling.temperature:g} B={batch_size}"
      jobs = [(e, b, eps) for e, b in zip(entries, built) for eps in epsilons(ev, e)]
      keys = [f"{label} {e.label} γ={e.depth} ε={eps}" for e, _, eps in jobs]
      ar_key = f"{label} autoregressive"
      if ar_key in log.done and all(k in log.done for k in keys):
        ar_row = log.done[ar_key]
        rows += [ar_row] + [_against(log.done[k], ar_row) for k in keys]
        logging.info("%s: every row read back from %s.", label, log.path)
        continue
      # A (T, B) with rows still to do measures its baseline again, in this process.
      work = bench.Workload(all_batches[batch_size], sampling, int(ev.new_tokens), stop_ids,
                            mesh, int(config.seed), int(ev.get("timing_repeats", 1)),
                            int(ev.max_cache_len), int(ev.get("timing_pairs", 0)))
      base = bench.autoregressive(source.v_cfg, source.v_params, work,
                                  desc=f"{label} autoregressive")
      # Per timed model ("drafter", "rescorer"), this (T, B): c, s(w), and how their timings ran
      # (usage dicts: reference_vs_step).
      costs, ratios, checks = {}, {}, {}
      for cost in (b.cost for b in built):
        if cost.model not in costs:
          c_use, s_use = {}, {}
          checks[cost.model] = (c_use, s_use)
          costs[cost.model] = bench.drafter_cost(cost, source.v_cfg, source.v_params, work, base,
                                                 desc=f"{label} {cost.model}-only", usage=c_use)
          # A tree's calls feed w tokens each: s(w) of every width any method's tree feeds.
          ratios[cost.model] = bench.call_cost_ratios(
              cost, work, {w for b in built if b.cost.model == cost.model for w in b.cost.widths},
              v_cfg=source.v_cfg, v_params=source.v_params, base=base, usage=s_use)
      ar_row = bench.baseline_row(base, work, device=device).as_dict()
      ar_row.update(context, cost_ratio_c=round(costs.get("drafter", 0.0), 4))
      rows.append(ar_row)
      log.add(ar_key, ar_row)
      for (entry, b, eps), key in zip(jobs, keys):
        if key in log.done:  # timed in an earlier process, against that process's baseline
          rows.append(dict(log.done[key], baseline="earlier"))
          logging.warning("%s %s: read back from %s; its speedup divides by an earlier "
                          "process's autoregressive pass (column baseline).", label, key,
                          log.path)
          continue
        m = entry.tokens_per_call
        if (batch_size, m) not in r_ms:
          r_use = {}
          r_ms[batch_size, m] = bench.verifier_cost_ratio(source.v_cfg, source.v_params, work, m,
                                                          base, usage=r_use)
          r_checks[batch_size, m] = r_use
        row, tokens = bench.speculative(
            source.v_cfg, source.v_params, b, decode_config(ev, entry, eps), work, base,
            c=costs[b.cost.model], r_m=r_ms[batch_size, m], ratios=ratios[b.cost.model],
            reference_vs_step=bench.worst_reference(*checks[b.cost.model],
                                                    r_checks[batch_size, m]),
            device=device,
            desc=f"{label} {entry.label} γ={entry.depth}")
        if ev.get("save_text", False) and parallel.is_writer():
          _save_text(workdir, texts, tokens, tokenizer, temperature=sampling.temperature,
                     batch_size=batch_size, method=entry.label, gamma=entry.depth)
        rows.append(dict(row.as_dict(), **context))
        log.add(key, rows[-1])
      shown = [r for r in rows if r["temperature"] == sampling.temperature
               and r["batch_size"] == batch_size]
      columns = [c for c in CONSOLE_COLUMNS if c not in ("tree", "paired_speedup")
                 or any(r.get(c) for r in shown)]
      table = f"\n{label}\n" + tables.markdown_table(shown, columns)
      if parallel.is_writer():  # multi-host: process 0's rows are the ones written
        print(table, flush=True)
      else:  # this process's own timings, in its own log only
        logging.info("%s", table)
  report.write_results(workdir, rows, echo=config.get("print_json", False))
  report.write_report(workdir, rows, title=config.get("title", "spec_jax evaluation"),
                      config_text=str(config))
  return rows
