"""Program `cost_model`: what one verifier call on T tokens costs, measured.

Speculative decoding pays for a verifier call on M = γ + 1 tokens (or a tree's M nodes) what
autoregressive decoding pays for one token only if r(M) = cost(M) / cost(1) = 1, which a memory-
bound accelerator comes close to and a CPU does not. The theory column of every results file
(τ / (r(M) + d·c), docs/design.md §3) uses r(M) measured in the same run; this program measures the
whole curve once, at each batch size, with the drafter's c and the memory roofline beside it.

Rows (results.json): model ("verifier" / "drafter"), T, batch_size, ms (one forward: the
median of `repeats` timed calls, the verifier's and every drafter's sizes taking turns in one
timing, so that c and r divide forwards timed together, each call `passes` forwards inside one
compiled loop as a decoding loop runs them, with no dispatch or wait between them
(`timing.ForwardCall`; `cost.passes`, 0: as many as make a call last ~50 ms, at most 64); a
cache of `position` + the largest T + 1 slots, the T tokens written from slot `position`: a
mid-generation cache), passes, ms_min and ms_max (the fastest and slowest call, per forward), r
(verifier: ms / ms at T = 1), c (drafter: its ms on T tokens / the verifier's on 1; the drafter
is timed on 1 token and on each width of `cost.tree_theory`'s calls), vocab (the rows of the
model's output layer), roofline_ms (the parameter bytes a call reads,
`timing.decode_read_bytes`, over the measured memory bandwidth: the floor of any call that reads
the weights once), vs_roofline = ms / roofline_ms, memory_bandwidth_gb_s, device, device_kind
(as JAX names it), dtype, xla_flags (XLA_FLAGS as the run saw it), preset (the verifier's size
when it is an architecture preset, else null), timings and reference_spread: each batch size is
timed `cost.timings` times (default 1), `cost.pause_s` seconds apart and then doubling (default
`timing.SETTLE_WAIT_S`), and the timing whose verifier one-token forward ran fastest is kept (a
shared machine's slow spells slow the one-token forward ~3× and bend r and c:
experiments/dyn/notes.md; on a shared VM, timings=3); reference_spread is the slowest timing's
one-token forward over the kept one's.
A drafter section without a checkpoint whose size makes a feature drafter of a variant's blocks
(`llama3.1-8b:layers=31:features=1`) is that drafter with random weights
(`presets.block_drafter`): its c is the cost of its shape, which is all c measures. Such a drafter
may carry `vocab=N`, an output layer of N rows (a reduced vocabulary, as EAGLE-3's and FR-Spec's
drafters have: the ids 0..N-1, which cost what any N ids do), and `cost.drafter_vocabs` (N, ...)
times it at each of those vocabularies in one run (0: the full one): drafter and theory rows
carry `vocab`, the rows of the drafter's output layer.

`cost.theory` ((γ, τ), ...): rows with model "theory" at every batch size where γ + 1 is among
the T: the theoretical speedup τ / (r(γ + 1) + γ·c) at a τ measured elsewhere (a feature
drafter drafts γ calls per round), for verifiers whose weights cannot give τ here, and
break_even_tau = r(γ + 1) + γ·c, the τ any drafter of that c needs to match autoregressive
decoding.

`cost.tree_theory` ((method entry, τ of the tree, τ of the chain), ...): rows with model
"tree_theory" at every batch size for a draft tree named as eval.methods names it (e.g.
"dyn:8-32@4") whose τ was measured elsewhere beside the chain's at the tree's depth L, on the same
prompts: the tree's theory τ / (r(M) + Σ_w c(w)), M the verifier's tokens per call (the tree's
nodes and its root: 33 for dyn:8-32), one drafter call per level on w tokens
(`TreeSpec.call_widths`: the root's 1, then each fed level; c(w): the drafter's forward on w
tokens over the verifier's on 1), its break-even τ, and the chain's theory τ / (r(L + 1) + L·c)
beside it (vs_chain: their ratio). The verifier is timed on every tree's M and L + 1 tokens and
the drafter on every call's width, besides `tokens` and 1.

Then the check of that theory (`cost.check`): speculative decoding at batch 1 of chain SD for
every γ in `gammas` and of every tree of `cost.tree_theory`, at every temperature in
`temperatures`, on `num_prompts` prompts of the data's prompt split, or with `prompts="random"`
of random token ids (seed `seed`; no corpus: random weights give τ ≈ 1 at T = 0, which checks
the theory's cost of a round, r(M) + Σ_w c(w), alone) (`prompt_tokens` tokens, `new_tokens` new
ones, stop tokens off), timed in turns with autoregressive decoding of the same prompts at the
same temperature and with the forward calls r and c come from (`timing.round_robin`, medians of
`repeats`; `cost.timings` timings, the one whose verifier one-token forward ran fastest kept).
Rows with model "speculative": method ("sd@γ" or the tree's entry), gamma (the depth),
verifier_tokens_per_call (M), temperature, batch_size, tau (block efficiency of those outputs),
r (r(M)), c (c(1)), d (drafter calls per round: the catch-up window's, then one per fed level),
drafter_c (Σ_w c(w) over those calls; d·c for a chain), ms (per prompt), ar_ms, speedup (ar_ms /
ms), theoretical_speedup (τ / (r + drafter_c)), speedup_vs_theory, timings and
reference_spread.
Also results.md and r_of_t.png (r(T) per batch size, the calls' range as error bars).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from spec_jax import checks, loading
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop, methods
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import features as features_lib
from spec_jax.evaluation import metrics, plots, report, timing
from spec_jax.models import draft_init, families, llama, presets


def run(config, workdir: str) -> list[dict]:
  c = config.cost
  if c.get("passes", 0) < 0:
    raise ValueError(f"cost.passes={c.passes} must be >= 1 (forwards per timed call), or 0 for "
                     f"as many as last ~50 ms.")
  checks.timings(c, "cost")
  if c.get("check") and c.check.get("prompts", "data") not in ("data", "random"):
    raise ValueError(f"cost.check.prompts={c.check.prompts!r} must be 'data' (the data's prompt "
                     f"split) or 'random' (random token ids, no corpus).")
  vocabs = tuple(c.get("drafter_vocabs") or ())
  size = draft_init.parse_size(config.drafter.size, "drafter.size")
  if vocabs and (config.drafter.checkpoint or not size.features or size.vocab is not None):
    raise ValueError(f"cost.drafter_vocabs={vocabs} times a random feature drafter at several "
                     f"vocabularies, but the drafter section is {config.drafter.size!r} with "
                     f"checkpoint {config.drafter.checkpoint!r}. Fix: a drafter.size with "
                     f"features=1 and no vocab=, no checkpoint; or cost.drafter_vocabs=().")
  if any(n < 0 for n in vocabs):
    raise ValueError(f"cost.drafter_vocabs={vocabs}: each is a number of output rows >= 1, or 0 "
                     f"for the full vocabulary.")
  passes = c.get("passes") or None
  trees = tree_entries(c.get("tree_theory", ()))
  for section in ("verifier", "drafter"):
    presets.check_dtype(config[section].dtype, f"{section}.dtype")
    if not config[section].checkpoint:
      families.check_size(draft_init.parse_size(config[section].size, f"{section}.size").variant,
                          f"{section}.size")
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  if size.features and not config.drafter.checkpoint and (vocabs or size.vocab):
    full = families.model_config(size.variant, vocab_size=tokenizer.vocab_size).vocab_size
    field, asked = (("cost.drafter_vocabs", vocabs) if vocabs
                    else ("drafter.size", (size.vocab,)))
    if max(asked) > full:
      raise ValueError(f"{field}: a drafter vocabulary of {max(asked)} tokens exceeds the "
                       f"verifier's {full}. Fix: at most {full}, or 0 for all of them.")
    if len({n or full for n in asked}) < len(asked):
      raise ValueError(f"{field}={asked} names one vocabulary twice (0 is all {full} tokens). "
                       f"Fix: each once.")
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed,
                                       field="verifier.checkpoint")
  drafters = [_drafter(config, tokenizer, vocab) for vocab in vocabs or (None,)]
  for d_cfg, _ in drafters:
    draft_init.check_feature_width(v_cfg, d_cfg, "drafter.size")
  bandwidth = timing.memory_bandwidth(c.bandwidth_mb * 2**20, c.repeats)
  device = timing.device_description()
  variant = draft_init.parse_size(config.verifier.size).variant
  labels = dict(device_kind=jax.devices()[0].device_kind, dtype=v_cfg.dtype, fused=v_cfg.fused,
                unrolled=v_cfg.unrolled, decode_unrolled=v_cfg.decode_unrolled,
                out_major=v_cfg.out_major, pallas=v_cfg.pallas, attn_kernel=v_cfg.attn_kernel,
                xla_flags=os.environ.get("XLA_FLAGS", ""), preset=(
      variant if variant in presets.PRESETS and not config.verifier.checkpoint else None))
  v_tokens = sorted({1, *c.tokens, *(t for _, spec, _, _ in trees
                                       for t in (spec.num_nodes, spec.depth + 1))})
  d_tokens = sorted({1, *(w for _, spec, _, _ in trees for w in spec.call_widths)})
  cache_size = c.position + max(v_tokens) + 1
  rows = []
  for batch_size in c.batch_sizes:
    models = [("verifier", v_cfg, v_params, v_tokens),
              *(("drafter", cfg, params, d_tokens) for cfg, params in drafters)]
    calls = {}  # (model, rows of its output layer, T): a timed call of forwards on T tokens
    for name, cfg, params, tokens in models:
      calls.update({(name, cfg.head_size, t): call for t, call in timing.forward_calls(
          features_lib.timing_apply(cfg), params,
          lambda cfg=cfg: llama.init_cache(cfg, batch_size, cache_size),
          batch_size=batch_size, tokens=tokens, position=c.position, passes=passes).items()})
    times, settle = _timed(calls, ("verifier", v_cfg.head_size, 1), c, c.repeats,
                           f"verifier and drafter calls, batch {batch_size}")
    costs = {}  # (model, rows of its output layer): {T: seconds a forward}
    for (name, head, t), v in times.items():
      costs.setdefault((name, head), {})[t] = v["median_s"]
    one = costs["verifier", v_cfg.head_size][1]
    for name, cfg, params, tokens in models:
      roofline_ms = 1e3 * timing.decode_read_bytes(params) / bandwidth
      for t in tokens:
        got = times[name, cfg.head_size, t]
        ms = 1e3 * got["median_s"]
        rows.append(dict(
            model=name, T=t, batch_size=batch_size, ms=round(ms, 3), passes=got["passes"],
            ms_min=round(1e3 * got["min_s"], 3), ms_max=round(1e3 * got["max_s"], 3),
            r=round(ms / 1e3 / one, 3) if name == "verifier" else None,
            c=round(ms / 1e3 / one, 4) if name == "drafter" else None, vocab=cfg.head_size,
            roofline_ms=round(roofline_ms, 3), vs_roofline=round(ms / roofline_ms, 3),
            memory_bandwidth_gb_s=round(bandwidth / 1e9, 2), device=device, **labels,
            **settle,
            checkpoint=(config.verifier if name == "verifier" else config.drafter).checkpoint))
    verifier = costs["verifier", v_cfg.head_size]
    for gamma, tau in c.get("theory", ()):  # τ measured elsewhere, r and c measured here
      if gamma + 1 not in verifier:
        continue
      r = verifier[gamma + 1] / verifier[1]
      for d_cfg, _ in drafters:
        cost_c = costs["drafter", d_cfg.head_size][1] / verifier[1]
        rows.append(dict(
            model="theory", gamma=gamma, tau=tau, T=gamma + 1, batch_size=batch_size,
            r=round(r, 3), c=round(cost_c, 4), d=gamma, vocab=d_cfg.head_size,
            theoretical_speedup=round(
                metrics.theoretical_speedup(tau, r_m=r, c=cost_c, drafter_calls=gamma), 4),
            break_even_tau=round(metrics.break_even_tau(r_m=r, c=cost_c, drafter_calls=gamma), 3),
            device=device, **labels))
    for entry, spec, tau, chain_tau in trees:
      r, chain_r = (verifier[t] / verifier[1] for t in (spec.num_nodes, spec.depth + 1))
      for d_cfg, _ in drafters:
        drafter = costs["drafter", d_cfg.head_size]
        drafting = sum(drafter[w] for w in spec.call_widths) / verifier[1]
        one = drafter[1] / verifier[1]
        tree = tau / (r + drafting)
        chain = metrics.theoretical_speedup(chain_tau, r_m=chain_r, c=one,
                                            drafter_calls=spec.depth)
        rows.append(dict(
            model="tree_theory", method=entry, tree=spec.describe(), gamma=spec.depth,
            tau=tau, chain_tau=chain_tau, T=spec.num_nodes, batch_size=batch_size,
            r=round(r, 3), c=round(one, 4), call_widths=list(spec.call_widths),
            drafter_c=round(drafting, 4), vocab=d_cfg.head_size,
            theoretical_speedup=round(tree, 4), break_even_tau=round(r + drafting, 3),
            chain_r=round(chain_r, 3), chain_theoretical_speedup=round(chain, 4),
            vs_chain=round(tree / chain, 4), device=device, **labels))
  if c.get("check"):  # with the first of the drafters
    rows += check_theory(config, tokenizer, (v_cfg, v_params), drafters[0], device,
                         passes=passes, trees=[entry for entry, *_ in trees])
  report.write_results(workdir, rows)
  _write_markdown(workdir, rows, report.launch_command(config, workdir), bandwidth, device)
  return rows


def _timed(calls: dict, reference: tuple, cost, repeats: int, desc: str) -> tuple[dict, dict]:
  """`timing.kept_timing` of calls at `cost.timings` and `cost.pause_s`, the reference the
  verifier's one-token forward."""
  timings, pause_s = checks.timings(cost, "cost")
  return timing.kept_timing(calls, repeats, reference=reference, timings=timings,
                            pause_s=pause_s, desc=desc)


def tree_entries(entries) -> list[tuple]:
  """`cost.tree_theory`'s entries as (entry, TreeSpec, τ, chain τ); ValueError naming the field
  for one that does not parse or a τ below 1, before any model loads."""
  out = []
  for item in entries:
    if isinstance(item, str) or len(item) != 3:
      raise ValueError(f"cost.tree_theory entry {item!r} must be (method entry, τ of the tree, τ "
                       "of the chain at its depth), e.g. ('dyn:8-32@4', 1.76, 1.44).")
    entry, tau, chain_tau = item
    if "@" not in str(entry):
      raise ValueError(f"cost.tree_theory entry {entry!r} needs its depth: NAME:SHAPE@L, e.g. "
                       "'dyn:8-32@4'.")
    parsed = methods.parse(entry, None, field="cost.tree_theory")
    if "lm" not in parsed.method.kinds or not parsed.method.needs_model:
      raise ValueError(f"cost.tree_theory entry {entry!r}: {parsed.method.name} does not draft "
                       "with a feature drafter; name a tree that does, e.g. 'dyn:8-32@4'.")
    if not (float(tau) >= 1 and float(chain_tau) >= 1):
      raise ValueError(f"cost.tree_theory entry {entry!r}: τ={tau}, chain τ={chain_tau}; each "
                       "is tokens per verifier call, >= 1.")
    out.append((str(entry), parsed.shape, float(tau), float(chain_tau)))
  return out


def check_theory(config, tokenizer, verifier, drafter, device, *, passes: int | None,
                 trees=()) -> list[dict]:
  """Chain SD (and each tree entry of `trees`) at batch 1 against τ / (r(M) + Σ_w c(w)),
  everything timed in the same turns (see the module docstring). verifier, drafter: (cfg,
  params); passes: forwards per timed call (None: as many as last ~50 ms)."""
  k = config.cost.check
  (v_cfg, v_params), (d_cfg, d_params) = verifier, drafter
  if k.get("prompts", "data") == "random":
    ids = np.random.default_rng(config.seed).integers(
        0, min(v_cfg.vocab_size, tokenizer.vocab_size), (k.num_prompts, k.prompt_tokens))
    prompts = [generate_lib.pad_prompts([row], k.prompt_tokens, 0, "cost.check.prompt_tokens")
               for row in ids.tolist()]
  else:
    from spec_jax.data import pipeline  # noqa: PLC0415 (the check alone reads a corpus)
    d = config.data
    texts = pipeline.load_prompts(d.name, d.prompt_split, tokenizer, num=k.num_prompts,
                                  prompt_tokens=k.prompt_tokens, seed=config.seed,
                                  data_dir=d.data_dir or None, text_key=d.text_key)
    prompts = [generate_lib.encode_prompts(tokenizer, [t], k.prompt_tokens,
                                           field="cost.check.prompt_tokens") for t in texts]
  rng = jax.random.key(config.seed)
  entries = {entry: methods.parse(entry, None, field="cost.check")
             for entry in [*(f"sd@{gamma}" for gamma in k.gammas), *trees]}
  size = k.prompt_tokens + k.new_tokens + max(e.shape.num_nodes for e in entries.values()) + 1
  position = k.prompt_tokens + k.new_tokens // 2
  outputs = {}

  def decode(name, fn):
    def call():
      outputs[name] = [fn(p) for p in prompts]
      return [o.tokens for o in outputs[name]]
    return call

  # Autoregressive decoding at each temperature: a row's speedup divides by the same sampling.
  calls = {("ar", temperature): decode(("ar", temperature), (
      lambda p, temperature=temperature: generate_lib.generate(
          v_params, p, rng, cfg=v_cfg, sampling=sampling_lib.Sampling(float(temperature)),
          max_new_tokens=k.new_tokens))) for temperature in k.temperatures}
  source = methods.Source(kind="lm", v_cfg=v_cfg, v_params=v_params, d_cfg=d_cfg,
                          d_params=d_params)
  built = {entry: methods.build(parsed, source) for entry, parsed in entries.items()}
  for entry in entries:
    drafter, params = built[entry].drafter, built[entry].params
    verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
    for temperature in k.temperatures:
      calls["sd", entry, temperature] = decode(("sd", entry, temperature), (
          lambda p, drafter=drafter, params=params, verifier=verifier, temperature=temperature:
          loop.speculative_generate(
              v_params, params, p, rng, verifier=verifier, drafter=drafter,
              sampling=sampling_lib.Sampling(float(temperature)),
              max_new_tokens=k.new_tokens)))
  specs = [e.shape for e in entries.values()]
  for name, cfg, params, tokens in (
      ("v", v_cfg, v_params, (1, *(s.num_nodes for s in specs))),
      ("d", d_cfg, d_params, (1, *(w for s in specs for w in s.call_widths)))):
    forward = timing.forward_calls(features_lib.timing_apply(cfg), params,
                                   lambda cfg=cfg: llama.init_cache(cfg, 1, size), batch_size=1,
                                   tokens=sorted(set(tokens)), position=position,
                                   passes=passes)
    calls.update({(name, t): call for t, call in forward.items()})
  times, settle = _timed(calls, ("v", 1), config.cost, k.repeats,
                         "check: decoding and forwards in turns")
  ms = {key: 1e3 * t["median_s"] for key, t in times.items()}
  c = ms["d", 1] / ms["v", 1]
  rows = []
  for entry, parsed in entries.items():
    spec = parsed.shape
    r = ms["v", spec.num_nodes] / ms["v", 1]
    drafting = sum(ms["d", w] for w in spec.call_widths) / ms["v", 1]
    for temperature in k.temperatures:
      tau = metrics.summarize(outputs["sd", entry, temperature])["block_efficiency"]
      theory = tau / (r + drafting)
      sd_ms = ms["sd", entry, temperature] / len(prompts)
      ar_ms = ms["ar", temperature] / len(prompts)
      rows.append(dict(
          model="speculative", method=entry, gamma=spec.depth,
          verifier_tokens_per_call=spec.num_nodes,
          temperature=float(temperature), batch_size=1, num_prompts=len(prompts),
          new_tokens=k.new_tokens, tau=round(tau, 4), r=round(r, 3), c=round(c, 4),
          d=len(spec.call_widths), drafter_c=round(drafting, 4), ms=round(sd_ms, 2),
          ar_ms=round(ar_ms, 2),
          speedup=round(ar_ms / sd_ms, 4), theoretical_speedup=round(theory, 4),
          speedup_vs_theory=round(ar_ms / sd_ms / theory, 4), repeats=k.repeats,
          **settle, device=device, checkpoint=config.drafter.checkpoint))
  return rows


def _drafter(config, tokenizer, vocab: int | None = None):
  """(cfg, params) of the drafter section (module docstring: a random feature drafter of a
  variant's blocks when no checkpoint is given, with an output layer of `vocab` rows when given,
  0 the full vocabulary, else the size's `vocab=`)."""
  section = config.drafter
  size = draft_init.parse_size(section.size, "drafter.size")
  if section.checkpoint or not size.features:
    return loading.load_model(section, tokenizer, seed=config.seed + 1,
                              field="drafter.checkpoint")
  base = families.model_config(size.variant, vocab_size=tokenizer.vocab_size,
                               dtype=section.dtype, param_dtype=section.dtype)
  cfg = presets.block_drafter(base, draft_init.layer_subset(size, base.n_layers, "drafter.size"))
  cfg = dataclasses.replace(cfg, fused=bool(size.fused), unrolled=bool(size.unrolled),
                            decode_unrolled=bool(size.decode_unrolled),
                            out_major=bool(size.out_major), pallas=bool(size.pallas),
                            attn_kernel=bool(size.attn_kernel))
  rows = size.vocab if vocab is None else vocab
  if rows:  # the cost of an output layer of that many rows (checked in `run`): any ids cost alike
    cfg = dataclasses.replace(cfg, tie_embeddings=False, head_ids=tuple(range(rows)))
  return cfg, llama.init_params(cfg, jax.random.key(config.seed + 1))


def _write_markdown(workdir, rows, command, bandwidth, device) -> None:
  from spec_jax import parallel  # noqa: PLC0415
  if not parallel.is_writer():
    return
  batches = sorted({r["batch_size"] for r in rows if r["model"] != "speculative"})
  verifier = [r for r in rows if r["model"] == "verifier"]
  tokens = sorted({r["T"] for r in verifier})
  fig = plots.plot_r_of_t(
      {f"batch {b}": [r for r in verifier if r["batch_size"] == b] for b in batches},
      f"r(T) of the verifier on {device}, medians (error bars: the fastest and slowest call "
      "over the median at T = 1)")
  fig.savefig(os.path.join(workdir, "r_of_t.png"), dpi=110)
  lines = ["# Verifier cost ratio r(T) and drafter cost c", "",
           f"`{command}`", "",
           f"Device: {device}; memory bandwidth {bandwidth / 1e9:.1f} GB/s (the faster of a "
           "jitted sum and a GEMV over a large float32 array). ms: one forward, a timed call's "
           "time over the forwards it runs in one compiled loop (passes: "
           f"{_passes(rows, 'verifier')} for the verifier, {_passes(rows, 'drafter')} for the "
           "drafter). r(T) = ms of a forward on T tokens / ms of a forward on 1 token; roofline "
           "= the parameter bytes a forward reads (an untied input embedding's gathered rows "
           f"aside) / bandwidth. {_timings(verifier)} "
           "Plot: [r_of_t.png](r_of_t.png).", "",
           "| T | " + " | ".join(f"B={b} ms | B={b} r" for b in batches) + " |",
           "|---:|" + "---:|---:|" * len(batches)]
  for t in tokens:
    cells = []
    for b in batches:
      row = next(r for r in verifier if r["T"] == t and r["batch_size"] == b)
      cells += [f"{row['ms']:.2f}", f"{row['r']:.2f}"]
    lines.append(f"| {t} | " + " | ".join(cells) + " |")
  lines += ["", "c(w): the drafter's forward on w tokens over the verifier's on 1 (c = c(1)).", "",
            "| batch | verifier 1-token ms | roofline ms | × roofline | drafter vocabulary "
            "| drafter tokens w | drafter ms | c(w) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for b in batches:
    v = next(r for r in verifier if r["T"] == 1 and r["batch_size"] == b)
    for d in (r for r in rows if r["model"] == "drafter" and r["batch_size"] == b):
      lines.append(f"| {b} | {v['ms']:.2f} | {v['roofline_ms']:.2f} | {v['vs_roofline']:.2f} | "
                   f"{d['vocab']:,} | {d['T']} | {d['ms']:.2f} | {d['c']:.3f} |")
  theory = [r for r in rows if r["model"] == "theory"]
  if theory:
    lines += ["", "Theoretical speedup τ / (r(γ + 1) + γ·c) at a τ measured elsewhere "
              "(`cost.theory`), and the τ at which it is 1 (break-even τ = r(γ + 1) + γ·c):",
              "", "| batch | γ | τ | drafter vocabulary | r(γ + 1) | c | theory | break-even τ |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch_size']} | {r['gamma']} | {r['tau']:.2f} | {r['vocab']:,} | "
              f"{r['r']:.3f} | {r['c']:.3f} | {r['theoretical_speedup']:.3f} | "
              f"{r['break_even_tau']:.2f} |" for r in theory]
  trees = [r for r in rows if r["model"] == "tree_theory"]
  if trees:
    lines += ["", "Draft trees (`cost.tree_theory`): the theory τ / (r(M) + Σ_w c(w)), one drafter "
              "call per level on w tokens (the root's 1, then each fed level), its break-even τ, "
              "and the chain's theory τ / (r(L + 1) + L·c) at the same depth L, each at the τ "
              "measured for it beside the other:", "",
              "| batch | tree | τ | drafter vocabulary | r(M) | drafter calls w | Σ c(w) | theory | "
              "break-even τ | chain τ | r(L + 1) | chain theory | tree / chain |",
              "|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch_size']} | {r['method']} (M = {r['T']}) | {r['tau']:.2f} | "
              f"{r['vocab']:,} | {r['r']:.3f} | {'+'.join(map(str, r['call_widths']))} | "
              f"{r['drafter_c']:.3f} | {r['theoretical_speedup']:.3f} | "
              f"{r['break_even_tau']:.2f} | {r['chain_tau']:.2f} | {r['chain_r']:.3f} | "
              f"{r['chain_theoretical_speedup']:.3f} | {r['vs_chain']:.3f} |" for r in trees]
  checked = [r for r in rows if r["model"] == "speculative"]
  if checked:
    lines += ["", "## The theory against measured speedups: batch 1", "",
              f"{checked[0]['num_prompts']} prompts × {checked[0]['new_tokens']} new tokens, "
              "decoded in turns with autoregressive decoding and the forward calls r and c "
              f"come from (medians of {checked[0]['repeats']}); theory = τ / (r(M) + Σ_w c(w)) "
              "(a chain's: τ / (r(γ + 1) + γ·c)).",
              "", "| method | tokens per call M | T | τ | r(M) | Σ c(w) | SD ms | AR ms | speedup | "
              "theory | measured / theory |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['verifier_tokens_per_call']} | {r['temperature']:g} | "
              f"{r['tau']:.3f} | "
              f"{r['r']:.3f} | {r['drafter_c']:.3f} | {r['ms']:.0f} | {r['ar_ms']:.0f} | "
              f"{r['speedup']:.3f} | {r['theoretical_speedup']:.3f} | "
              f"{r['speedup_vs_theory']:.3f} |" for r in checked]
  with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


def _passes(rows: list[dict], model: str) -> str:
  """The forwards per timed call of `model`'s rows: one count, or their range."""
  counts = sorted({r["passes"] for r in rows if r["model"] == model})
  return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def _timings(rows: list[dict]) -> str:
  """A sentence on how many timings each batch size took (`cost.timings`) and how far apart
  their verifier one-token forwards ran."""
  count = max((r.get("timings") or 1) for r in rows)
  if count == 1:
    return ("One timing at each batch size (`cost.timings`: several, seconds to a minute apart, "
            "keep a shared machine's slow spells out).")
  spreads = sorted(r["reference_spread"] for r in rows if r["T"] == 1)
  return (f"{count} timings at each batch size; kept: the one whose verifier one-token forward "
          f"ran fastest (the slowest one's over it: {spreads[0]:.2f}"
          + (f"-{spreads[-1]:.2f}" if spreads[-1] != spreads[0] else "") + ").")
