"""One measurement of speculative decoding against its autoregressive baseline, on the same
prompts in the same process, returning typed rows with one definition of every metric
(docs/design.md §3): evaluate, distillspec_experiment and every experiment built on evaluate
measure through here.

  work = bench.Workload(batches, sampling, new_tokens=64)
  base = bench.autoregressive(v_cfg, v_params, work)             # the speedup baseline
  c = bench.drafter_cost(built.cost, v_cfg, v_params, work, base)  # c of the method's drafter
  r = bench.verifier_cost_ratio(v_cfg, v_params, work, m, base)  # r(M) for M tokens per call
  s = bench.call_cost_ratios(built.cost, work, built.cost.widths,  # a tree's s(w) (chains: {1: 1})
                             v_cfg=v_cfg, v_params=v_params, base=base)
  row = bench.speculative(v_cfg, v_params, built, decode, work, base, c=c, r_m=r, ratios=s)

Timings exclude compilation (each pass first compiles one program per distinct batch shape,
decoding nothing, then runs every batch `repeats` times; per batch the median counts). Batches
are padded to one size by repeating their last prompt; `Workload.batches` carries each batch's
real rows and padded rows never count. Their prompt widths may differ (evaluate pads each batch
to its bucket width, `generate.bucket_widths`): each width is its own compiled program.
A speculative row's `speedup` divides by the baseline pass timed before it; with
`Workload.pairs` it also carries `paired_speedups`, from passes of both taking turns batch by
batch, which a slow spell of a shared machine hits alike. The cost ratios (c, r(M), s(w)) are
timed again after a pause where the verifier's one-token forward timed with them ran over 1.5×
the autoregressive pass's step (`timing.settled_round_robin`); rows carry the kept timings'
ratio as reference_vs_step.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Any, Sequence

import jax

from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop
from spec_jax.decoding import methods
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import features
from spec_jax.evaluation import metrics, quality, timing
from spec_jax.models import llama


@dataclasses.dataclass(frozen=True)
class Workload:
  """What every pass of one setting decodes.

  batches: [(Prompts, real rows)], all of one batch size (prompt widths may differ).
  sampling: the decoding law.
  new_tokens: per row. stop_ids: tokens that end a row (empty: decode new_tokens).
  seed: batch i decodes with fold_in(key(seed), i). repeats: timed runs per batch (median).
  max_cache_len: the speculative loop's cache bound (None: what the prompts need).
  pairs: after a speculative row's pass, this many more passes of it and of the autoregressive
  decoding taking turns batch by batch (`timing.paired_passes`), one speedup each (0: none)."""
  batches: Sequence[tuple[Any, int]]
  sampling: sampling_lib.Sampling
  new_tokens: int
  stop_ids: tuple[int, ...] = ()
  mesh: Any = None
  seed: int = 0
  repeats: int = 1
  max_cache_len: int | None = None
  pairs: int = 0

  @property
  def prompts(self) -> list:
    return [p for p, _ in self.batches]

  @property
  def reals(self) -> list[int]:
    return [r for _, r in self.batches]

  @property
  def batch_size(self) -> int:
    return int(self.batches[0][0].tokens.shape[0])

  @property
  def widths(self) -> list[int]:
    """The distinct padded prompt widths P of the batches, ascending."""
    return sorted({int(p.tokens.shape[1]) for p in self.prompts})

  @property
  def prompt_width(self) -> int:
    """The widest batch's P: the cache size the cost ratios (c, r(M)) are measured at."""
    return self.widths[-1]

  def key(self, i: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(self.seed), i)

  def common(self) -> dict:
    return dict(sampling=self.sampling, max_new_tokens=self.new_tokens, stop_ids=self.stop_ids,
                mesh=self.mesh)


@dataclasses.dataclass(frozen=True)
class Baseline:
  """Autoregressive decoding of the verifier over a workload.

  outputs: one per batch. seconds: the timed pass. tokens: every real row's emitted tokens.
  tokens_per_s: Σ emitted / seconds. steps_s: seconds per forward call (c's denominator)."""
  outputs: list
  seconds: float
  tokens: list[list[int]]
  emitted: int
  tokens_per_s: float
  steps_s: float
  cpu_per_wall: float | None
  verifier_calls: int
  verifier_loglik: float


@dataclasses.dataclass
class Row:
  """One results row (glossary names, docs/design.md §3). The autoregressive baseline is the row
  with method 'autoregressive', τ = 1 and speedup 1."""
  method: str
  gamma: int | None
  temperature: float
  top_k: int
  top_p: float
  batch_size: int
  num_prompts: int
  device: str
  new_tokens: int
  block_efficiency: float | None
  mean_accepted_tokens: float | None
  acceptance_rate: float | None
  empirical_acceptance: float | None
  per_position_acceptance: list | None
  verifier_calls: int
  drafter_calls: int
  tokens_per_s: float
  cpu_per_wall: float | None
  speedup: float
  cost_ratio_c: float
  verifier_cost_ratio_r: float
  theoretical_speedup: float | None
  speedup_vs_theory: float | None
  verifier_tokens_per_call: int
  identical_to_greedy: bool | None
  verifier_loglik: float
  token_tv: float | None = None
  tau_se: float | None = None
  candidates_per_call: float | None = None
  drafts_per_call: float | None = None
  drafter_calls_per_round: float | None = None
  rule: str | None = None
  tree: str | None = None
  lenience: str | None = None
  epsilon: float | None = None
  relaxed_top_k: int | None = None
  prompt_widths: list | None = None  # the batches' distinct padded prompt widths P, ascending
  baseline_tokens_per_s: float | None = None  # the autoregressive pass `speedup` divides by
  baseline: str | None = None  # "earlier": that pass is not the one in this row's table
  paired_speedup: float | None = None  # the median of paired_speedups
  paired_speedups: list | None = None  # one per paired pass (Workload.pairs)
  prompt_new_tokens: list | None = None  # per prompt, in order (metrics.tau_diff_se pairs rows)
  prompt_verifier_calls: list | None = None  # per prompt, in the same order
  drafter_c: float | None = None  # a round's drafting in one-token verifier calls: Σ call_costs
  call_widths: list | None = None  # a tree's: the tokens each drafter call of a round feeds
  call_costs: list | None = None  # a tree's: c(w) of each of those calls (c·s(w))
  reference_vs_step: float | None = None  # the cost timings' verifier forward / the AR step

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


AUTOREGRESSIVE = "autoregressive"  # the baseline row's method


def is_baseline(row: dict) -> bool:
  """Whether a results row is the autoregressive baseline (τ = 1, speedup 1)."""
  return row.get("method") == AUTOREGRESSIVE


def _round(value, digits: int = 4):
  return None if value is None else round(float(value), digits)


def _loglik(v_cfg, v_params, outputs, work: Workload, law=None, **lenient) -> dict:
  """verifier_loglik and token_tv (`evaluation.quality`) over the real rows; `law` (cfg, params):
  the drafter model whose law token_tv compares (None: the verifier's own, tv = 0)."""
  d_cfg, d_params = law if law is not None else (None, None)
  return quality.summarize(
      {k: v[:real] for k, v in quality.quality_sums(
          v_params, d_params, out, verifier_cfg=v_cfg, drafter_cfg=d_cfg,
          sampling=work.sampling, **lenient).items()}
      for out, real in zip(outputs, work.reals))


def _timed_pass(fn, work: Workload, desc: str | None, usage: dict | None):
  """`timing.timed_pass` of fn(prompts, i, [compile_only=True]) over the workload's batches.
  timed_pass compiles on the first batch only; a batch of another shape (another bucket width)
  is another program, compiled here first so that no compilation lands in a timed call."""
  seen = {work.prompts[0].tokens.shape}
  for i, prompts in enumerate(work.prompts):
    if prompts.tokens.shape not in seen:
      seen.add(prompts.tokens.shape)
      fn(prompts, i, compile_only=True)
  return timing.timed_pass(fn, work.prompts, desc=desc, compile_only=True, usage=usage,
                           repeats=work.repeats)


def _ar_fn(cfg, params, work: Workload):
  """fn(prompts, i, [compile_only=True]): autoregressive decoding of batch i."""
  return lambda prompts, i, **kw: generate_lib.generate(
      params, prompts, work.key(i), cfg=cfg, **work.common(), **kw)


def _ar_pass(cfg, params, work: Workload, desc: str | None, usage: dict | None = None):
  return _timed_pass(_ar_fn(cfg, params, work), work, desc, usage)


def paired_speedups(v_cfg, v_params, fn, work: Workload, base: Baseline, emitted: int, *,
                    desc: str | None = None) -> list[float]:
  """`work.pairs` speedups of fn (a compiled speculative pass emitting `emitted` real tokens)
  over the verifier's autoregressive pass (`base`, compiled), each from one pass of both taking
  turns batch by batch (`timing.paired_passes`): the two see the same minute of the machine,
  where `speedup` divides by a baseline timed minutes earlier."""
  passes = timing.paired_passes(_ar_fn(v_cfg, v_params, work), fn, work.prompts, work.pairs,
                                desc=desc)
  return [round((emitted / s) / (base.emitted / s_ar), 4) for s_ar, s in passes]


def autoregressive(v_cfg, v_params, work: Workload, *, desc: str | None = None) -> Baseline:
  """The verifier's autoregressive pass: the baseline every speculative row divides by."""
  usage = {}
  outputs, seconds = _ar_pass(v_cfg, v_params, work, desc, usage)
  emitted = metrics.emitted_tokens(outputs, work.reals)
  return Baseline(outputs=outputs, seconds=seconds,
                  tokens=metrics.token_lists(outputs, work.reals), emitted=emitted,
                  tokens_per_s=emitted / seconds,
                  steps_s=timing.seconds_per_step(outputs, seconds),
                  cpu_per_wall=usage["cpu_per_wall"],
                  # One forward per emitted token of each prompt, the first the prefill's: in
                  # the speculative rows' units (per prompt, a call per round), so τ = 1 exactly.
                  verifier_calls=emitted,
                  verifier_loglik=_loglik(v_cfg, v_params, outputs, work)["verifier_loglik"])


def baseline_row(base: Baseline, work: Workload, *, device: str) -> Row:
  s = work.sampling
  return Row(method=AUTOREGRESSIVE, gamma=None, temperature=float(s.temperature),
             top_k=int(s.top_k), top_p=float(s.top_p), batch_size=work.batch_size,
             num_prompts=sum(work.reals), device=device, new_tokens=base.emitted,
             block_efficiency=1.0, mean_accepted_tokens=0.0, acceptance_rate=None,
             empirical_acceptance=None, per_position_acceptance=None,
             verifier_calls=base.verifier_calls, drafter_calls=0,
             tokens_per_s=round(base.tokens_per_s, 2), cpu_per_wall=base.cpu_per_wall,
             speedup=1.0, cost_ratio_c=0.0, verifier_cost_ratio_r=1.0, theoretical_speedup=1.0,
             speedup_vs_theory=None, verifier_tokens_per_call=1,
             identical_to_greedy=True if s.greedy else None,
             verifier_loglik=round(base.verifier_loglik, 4), prompt_widths=work.widths,
             baseline_tokens_per_s=round(base.tokens_per_s, 2))


def _forward_calls(cfg, params, work: Workload, tokens, overhang: int) -> dict:
  """T -> `timing.ForwardCall` of cfg's forward on T new tokens per row, at the loop's cache size
  for the widest batch (prompt + new tokens + overhang) and halfway through the new tokens."""
  b, p = work.batch_size, work.prompt_width
  size = p + work.new_tokens + overhang
  return timing.forward_calls(features.timing_apply(cfg), params,
                              lambda: llama.init_cache(cfg, b, size), batch_size=b,
                              tokens=tokens, position=p + work.new_tokens // 2)


def _settled(calls: dict, reference: str, base: Baseline | None, usage: dict | None) -> dict:
  """`timing.settled_round_robin` of calls (median of 5 turns) whose `reference` is the
  verifier's one-token forward, expected to take at most the autoregressive pass's step: timed
  again after a pause while it takes over 1.5× that step (a slow spell of a shared machine; base
  None: one timing). usage receives tries and reference_vs_step."""
  got = {}
  times = timing.settled_round_robin(calls, 5, reference=reference,
                                     expected_s=base.steps_s if base is not None else None,
                                     usage=got)
  ratio = got["reference_vs_expected"]
  if got["tries"] > 1:
    logging.info("Cost timing of %s taken %d times (the verifier's one-token forward ran over "
                 "%.1f× the autoregressive step); kept: %.2f×.", "/".join(sorted(calls)),
                 got["tries"], timing.SETTLE_TOLERANCE, ratio)
  if ratio is not None and ratio > timing.SETTLE_TOLERANCE:
    logging.warning("The verifier's one-token forward ran %.2f× the autoregressive step in %d "
                    "timings of %s: the cost ratios are from a slow spell (reference_vs_step).",
                    ratio, got["tries"], "/".join(sorted(calls)))
  if usage is not None:
    usage.update(tries=got["tries"], reference_vs_step=ratio)
  return times


def worst_reference(*usages: dict) -> float | None:
  """The largest reference_vs_step of some cost timings' usage dicts (`_settled`): a row's, over
  the timings behind its c, r(M) and s(w); None where none compared one."""
  got = [u["reference_vs_step"] for u in usages if u.get("reference_vs_step") is not None]
  return max(got) if got else None


def feature_cost_ratio(v_cfg, v_params, d_cfg, d_params, work: Workload,
                       base: Baseline | None = None, usage: dict | None = None) -> float:
  """c of a feature drafter, which cannot decode alone (it reads the verifier's features): its
  one-token forward over the verifier's, timed taking turns (median of 5, each call a compiled
  loop of forwards: `timing.ForwardCall`), at the loop's cache size for the widest batch and
  halfway through the new tokens; again after a pause where the verifier's forward ran over
  1.5× base's step (`_settled`)."""
  calls = {"v": _forward_calls(v_cfg, v_params, work, (1,), 1)[1],
           "d": _forward_calls(d_cfg, d_params, work, (1,), 1)[1]}
  times = _settled(calls, "v", base, usage)
  return times["d"]["median_s"] / times["v"]["median_s"]


def drafter_cost(cost: methods.Cost, v_cfg, v_params, work: Workload, base: Baseline, *,
                 desc: str | None = None, usage: dict | None = None) -> float:
  """c: the one-token step of the model `cost` names over the verifier's (0 without one). A
  model that decodes alone is timed by its own autoregressive pass over the workload; a feature
  drafter by `feature_cost_ratio` (usage: its tries and reference_vs_step)."""
  if cost.model is None:
    return 0.0
  if cost.features:
    return feature_cost_ratio(v_cfg, v_params, cost.cfg, cost.params, work, base, usage)
  outputs, seconds = _ar_pass(cost.cfg, cost.params, work, desc)
  return timing.seconds_per_step(outputs, seconds) / base.steps_s


def call_cost_ratios(cost: methods.Cost, work: Workload, widths, *, v_cfg=None, v_params=None,
                     base: Baseline | None = None, usage: dict | None = None
                     ) -> dict[int, float]:
  """s(w) for 1 and each w of `widths` (a tree's `TreeSpec.call_widths`): the forward of the
  model `cost` names on w new tokens per row over its forward on 1, the widths timed taking turns
  (median of 5, each call a compiled loop of forwards: `timing.ForwardCall`), at the loop's cache
  size for the widest batch and halfway through the new tokens. c(w) = c·s(w); only {1: 1.0}
  (nothing timed) where every call feeds one token or there is no model. Given the verifier
  (v_cfg, v_params) and base, its one-token forward takes the turns too and the timing is
  repeated while it runs over 1.5× base's step (`_settled`; usage: tries, reference_vs_step)."""
  widths = sorted({1, *widths})
  if cost.model is None or widths == [1]:
    return {1: 1.0}
  calls = {str(w): call for w, call in
           _forward_calls(cost.cfg, cost.params, work, widths, max(widths)).items()}
  if v_cfg is not None and base is not None:
    calls["v"] = _forward_calls(v_cfg, v_params, work, (1,), max(widths))[1]
    times = _settled(calls, "v", base, usage)
  else:
    times = _settled(calls, "1", None, usage)  # no verifier reference: one timing
  return {w: times[str(w)]["median_s"] / times["1"]["median_s"] for w in widths}


def call_costs(cost: methods.Cost, c: float, ratios: dict[int, float] | None) -> list[float]:
  """The cost of each drafter call of a round in one-token verifier calls: c·s(w) for each width
  of a tree's calls (`Cost.widths`, s from `call_cost_ratios`), else c for each of the d calls.
  ValueError for a tree without its s(w): counting its calls at c each understates them."""
  if not cost.widths:
    return [c] * cost.calls
  missing = sorted({w for w in cost.widths if w not in (ratios or {})})
  if c and missing:
    raise ValueError(f"call_costs: no s(w) for the tree's call widths {missing}; time them with "
                     "bench.call_cost_ratios.")
  return [c * ratios[w] if c else 0.0 for w in cost.widths]


def verifier_cost_ratio(v_cfg, v_params, work: Workload, m: int, base: Baseline | None = None,
                        usage: dict | None = None) -> float:
  """r(M) of the verifier at this workload's batch size: its forward on M tokens over its forward
  on 1, taking turns (median of 5, `timing.ForwardCall` loops), with the loop's cache size (the
  widest batch's prompt + new tokens + the last round's overhang of M) and the M tokens halfway
  through the new tokens; again after a pause while the one-token forward runs over 1.5× base's
  step (`_settled`; usage: tries, reference_vs_step)."""
  if m < 1:
    raise ValueError(f"verifier_cost_ratio needs m >= 1, got m={m}.")
  if m == 1:
    return 1.0
  calls = {str(t): call for t, call in
           _forward_calls(v_cfg, v_params, work, (1, m), m).items()}
  times = _settled(calls, "1", base, usage)
  return times[str(m)]["median_s"] / times["1"]["median_s"]


def speculative(v_cfg, v_params, built: methods.Built, decode: loop.DecodeConfig,
                work: Workload, base: Baseline, *, c: float, r_m: float, device: str,
                ratios: dict[int, float] | None = None, reference_vs_step: float | None = None,
                desc: str | None = None) -> tuple[Row, list[list[int]]]:
  """One speculative run of `built` against `base` (same workload): its row and every real row's
  emitted tokens. c: the drafter's one-token cost; r_m: r(M); ratios: s(w) of a tree's call
  widths (`call_cost_ratios`), which its theoretical speedup τ / (r(M) + Σ_w c·s(w)) needs;
  reference_vs_step: `worst_reference` of the timings behind c, r_m and ratios."""
  drafter, shape = built.drafter, built.drafter.shape
  rule_name, _ = decode.resolve(shape, work.sampling)
  verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  loop.check_pair(verifier, drafter)
  fn = lambda prompts, i, **kw: loop.speculative_generate(  # noqa: E731
      v_params, built.params, prompts, work.key(i), verifier=verifier, drafter=drafter,
      decode=decode, max_cache_len=work.max_cache_len, **work.common(), **kw)
  usage = {}
  outputs, seconds = _timed_pass(fn, work, desc, usage)
  tokens = metrics.token_lists(outputs, work.reals)
  summary = metrics.summarize(outputs, work.reals)
  tau, calls, d = summary["block_efficiency"], summary["verifier_calls"], built.cost.calls
  per_call = call_costs(built.cost, c, ratios)
  drafting = sum(per_call)
  if getattr(shape, "stop", 0.0) and summary["drafts_per_call"] is not None:
    # Rows that stop drafting early: a round of k drafts costs k drafter calls (k − 1 feeds and
    # the commit); r(M) stays the full chain's, an upper bound (its calls score 2..γ + 1 tokens).
    d = round(summary["drafts_per_call"], 4)
    drafting = d * c
  theoretical = metrics.round_speedup(tau, r_m=r_m, drafting=drafting)
  tps = summary["new_tokens"] / seconds
  measured = tps / base.tokens_per_s
  paired = (paired_speedups(v_cfg, v_params, fn, work, base, summary["new_tokens"],
                            desc=desc and f"{desc} paired with autoregressive")
            if work.pairs else None)
  lenient = rule_name == "lenient"
  # The quality cost of a lossy rule: the chain rule's one-step law against p, where the drafts
  # follow a model's own law (trees' rules are lossless: only the log-likelihood is reported).
  compare = built.law is not None and rule_name != "top_k_relaxed"
  q = _loglik(v_cfg, v_params, outputs, work, built.law if compare else None,
              **(dict(lenience=decode.lenience, epsilon=decode.epsilon) if lenient else {}))
  s = work.sampling
  row = Row(
      method=built.row_method, gamma=shape.depth, temperature=float(s.temperature),
      top_k=int(s.top_k), top_p=float(s.top_p), batch_size=work.batch_size,
      num_prompts=summary["num_prompts"], device=device, new_tokens=summary["new_tokens"],
      block_efficiency=_round(tau), tau_se=_round(summary["tau_se"]),
      mean_accepted_tokens=_round(summary["mean_accepted_tokens"]),
      # α needs the drafter's law; a proposal without one (q = None) has none.
      acceptance_rate=(_round(summary["acceptance_rate"]) if built.exact_law else None),
      empirical_acceptance=_round(summary["empirical_acceptance"]),
      per_position_acceptance=[_round(a) for a in summary["per_position_acceptance"]],
      candidates_per_call=_round(summary["candidates_per_call"]),
      drafts_per_call=_round(summary["drafts_per_call"]),
      verifier_calls=calls, drafter_calls=round(calls * d), drafter_calls_per_round=d,
      tokens_per_s=round(tps, 2), cpu_per_wall=usage["cpu_per_wall"], speedup=round(measured, 4),
      cost_ratio_c=round(c, 4), verifier_cost_ratio_r=round(r_m, 4),
      drafter_c=round(drafting, 4),
      call_widths=list(built.cost.widths) if built.cost.widths else None,
      call_costs=[round(x, 4) for x in per_call] if built.cost.widths else None,
      theoretical_speedup=_round(theoretical),
      speedup_vs_theory=_round(measured / theoretical if theoretical else None),
      verifier_tokens_per_call=shape.num_nodes,
      identical_to_greedy=(tokens == base.tokens) if s.greedy else None,
      verifier_loglik=round(q["verifier_loglik"], 4),
      token_tv=round(q["token_tv"], 5) if compare and shape.is_chain else None,
      rule=rule_name, tree=None if shape.is_chain else shape.describe(),
      lenience=decode.lenience if lenient else None,
      epsilon=decode.epsilon if lenient else None,
      relaxed_top_k=decode.relaxed_top_k if rule_name == "top_k_relaxed" else None,
      prompt_widths=work.widths, baseline_tokens_per_s=round(base.tokens_per_s, 2),
      paired_speedup=round(statistics.median(paired), 4) if paired else None,
      paired_speedups=paired, prompt_new_tokens=summary["prompt_new_tokens"],
      prompt_verifier_calls=summary["prompt_verifier_calls"],
      reference_vs_step=reference_vs_step)
  return row, tokens
