"""τ, α, per-position acceptance and the theoretical speedup, from the speculative loop's output.

Definitions are the glossary's (docs/design.md §3, spec_jax.evaluation.glossary); this is the one
place that computes them, for the evaluate and distill programs and the experiments.

Input: outputs of the speculative loop, one per prompt batch. Each has `num_new` int[B] (tokens
emitted per row, cut at EOS and at max_new_tokens), `new_tokens()` (the token lists) and `.stats`
with per-row counters:
  verifier_calls int[B]   verification rounds (prefill excluded)
  accepted int[B]         accepted draft tokens
  reached int[B, A]       rounds in which draft depth i was examined (A = γ, or the tree depth)
  accepted_at int[B, A]   rounds in which the draft at depth i was accepted
  alpha_sum f32[B]        Σ over examined positions of Σ_x min(p(x), q(x))
  candidates int[B]       (optional) draft candidates the rule examined
  drafted int[B]          (optional) valid draft nodes proposed
A batch padded to a fixed size (the last prompt repeated) passes its count of real rows in
`reals`; padded rows never count. Every ratio is a ratio of sums over all real rows (tokens over
calls), not a mean of per-row ratios, so a prompt counts by how long it decoded.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from spec_jax import parallel
from spec_jax.evaluation import theory


def _reals(outputs: Sequence[Any], reals: Sequence[int] | None) -> list[int]:
  sizes = [int(np.shape(o.num_new)[0]) for o in outputs]
  if reals is None:
    return sizes
  reals = [int(r) for r in reals]
  if len(reals) != len(outputs):
    raise ValueError(f"reals has {len(reals)} entries for {len(outputs)} outputs: give one real "
                     "row count per batch.")
  for i, (real, size) in enumerate(zip(reals, sizes)):
    if not 0 < real <= size:
      raise ValueError(f"reals[{i}]={real} must be in [1, {size}] (the batch's rows).")
  return reals


def _stacked(outputs, reals, get) -> np.ndarray:
  """get(output) over the real rows of every batch, concatenated along the batch axis."""
  return np.concatenate([parallel.to_host(get(o))[:r] for o, r in zip(outputs, reals)])


def _ratio(num: float, den: float) -> float | None:
  # None, not 0: a metric with nothing to average over (no draft examined) is undefined.
  return float(num) / float(den) if den else None


def token_lists(outputs: Sequence[Any], reals: Sequence[int] | None = None) -> list[list[int]]:
  """The emitted tokens of every real row, batches in order (padded rows dropped)."""
  reals = _reals(outputs, reals)
  return [tokens for o, r in zip(outputs, reals) for tokens in o.new_tokens()[:r]]


def emitted_tokens(outputs: Sequence[Any], reals: Sequence[int] | None = None) -> int:
  """Σ num_new over the real rows: tokens actually emitted (EOS cut included)."""
  reals = _reals(outputs, reals)
  return int(_stacked(outputs, reals, lambda o: o.num_new).sum())


def summarize(outputs: Sequence[Any], reals: Sequence[int] | None = None) -> dict[str, Any]:
  """Speculative decoding metrics over the real rows of `outputs` (see the module docstring).

  Returns a dict with glossary keys:
    num_prompts             real rows counted
    new_tokens              Σ num_new
    verifier_calls          Σ stats.verifier_calls
    block_efficiency        τ = new_tokens / verifier_calls
    tau_se                  standard error of τ over rows (`ratio_se`; 0 for one row)
    mean_accepted_tokens    τ − 1 (a last round cut inside its accepted drafts has no bonus)
    acceptance_rate         α = Σ alpha_sum / Σ reached
    empirical_acceptance    Σ accepted_at / Σ reached
    per_position_acceptance [accepted_at_i / reached_i for each depth i] (None if never reached)
    candidates_per_call     Σ candidates / verifier_calls (None when stats have no candidates)
    drafts_per_call         Σ drafted / verifier_calls (None when stats have no drafted)
    prompt_new_tokens       [num_new of each real row], in order
    prompt_verifier_calls   [verifier calls of each real row], in order (with the above: a
                            paired comparison of two runs over the same prompts, `tau_diff_se`)
  Ratios without a denominator (no call, no examined draft) are None. Nothing is rounded.
  """
  reals = _reals(outputs, reals)
  num_new = _stacked(outputs, reals, lambda o: o.num_new).astype(np.int64)
  calls = _stacked(outputs, reals, lambda o: o.stats.verifier_calls).astype(np.int64)
  reached = _stacked(outputs, reals, lambda o: o.stats.reached).astype(np.int64)  # [R, A]
  accepted_at = _stacked(outputs, reals, lambda o: o.stats.accepted_at).astype(np.int64)
  alpha_sum = _stacked(outputs, reals, lambda o: o.stats.alpha_sum).astype(np.float64)
  tau = _ratio(num_new.sum(), calls.sum())
  tau_se = ratio_se(num_new, calls)
  candidates = None
  if all(getattr(o.stats, "candidates", None) is not None for o in outputs):
    candidates = _ratio(_stacked(outputs, reals, lambda o: o.stats.candidates).sum(),
                        calls.sum())
  drafted = None
  if all(getattr(o.stats, "drafted", None) is not None for o in outputs):
    drafted = _ratio(_stacked(outputs, reals, lambda o: o.stats.drafted).sum(), calls.sum())
  return dict(
      num_prompts=len(num_new), new_tokens=int(num_new.sum()), verifier_calls=int(calls.sum()),
      block_efficiency=tau, tau_se=tau_se,
      mean_accepted_tokens=None if tau is None else tau - 1.0,
      acceptance_rate=_ratio(alpha_sum.sum(), reached.sum()),
      empirical_acceptance=_ratio(accepted_at.sum(), reached.sum()),
      per_position_acceptance=[_ratio(a, r) for a, r in zip(accepted_at.sum(0),
                                                             reached.sum(0))],
      candidates_per_call=candidates, drafts_per_call=drafted,
      prompt_new_tokens=num_new.tolist(), prompt_verifier_calls=calls.tolist())


def ratio_se(num: np.ndarray, den: np.ndarray) -> float:
  """Standard error of the ratio of sums R = Σ num / Σ den over n rows (the delta method: the
  rows' residuals num_i − R·den_i, sample variance over n − 1, divided by Σ den / √n). It is the
  error of τ as τ is computed, a ratio of sums: a row that ends early at a stop token (few
  calls, any τ of its own) weighs by its calls, as it does in τ, where the standard error of
  the per-row mean would weigh it as much as a full row. 0 for one row or no calls."""
  num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
  n, total = len(num), den.sum()
  if n < 2 or total <= 0:
    return 0.0
  residuals = num - (num.sum() / total) * den
  return float(math.sqrt(n * np.sum(residuals ** 2) / (n - 1)) / total)


def _influence(num: np.ndarray, den: np.ndarray) -> np.ndarray:
  """Each row's linearised contribution to R = Σ num / Σ den (mean zero): (num_i − R·den_i)
  over the mean den. `ratio_se` is its standard error of the mean."""
  total = den.sum()
  return (num - (num.sum() / total) * den) * (len(num) / total)


def paired_ratio_diff_se(num_a, den_a, num_b, den_b) -> float:
  """Standard error of R_a − R_b (R = Σ num / Σ den) when row i of a and row i of b come from
  the same prompt: the delta method on the per-prompt differences of the two influences, so a
  prompt that is easy (or hard) for both runs cancels out. Two runs of independent prompts
  would instead combine their `ratio_se` in quadrature, which overstates the error of a paired
  difference whenever the prompts' τ are positively correlated across runs."""
  arrays = [np.asarray(x, np.float64) for x in (num_a, den_a, num_b, den_b)]
  if len({len(x) for x in arrays}) != 1:
    raise ValueError(f"paired_ratio_diff_se: both runs need one entry per prompt, got lengths "
                     f"{[len(x) for x in arrays]}.")
  n = len(arrays[0])
  if n < 2 or arrays[1].sum() <= 0 or arrays[3].sum() <= 0:
    return 0.0
  diff = _influence(*arrays[:2]) - _influence(*arrays[2:])
  return float(math.sqrt(np.sum(diff ** 2) / (n * (n - 1))))


def _paired(a: dict, b: dict):
  """Both rows' per-prompt (tokens, calls) arrays when they carry them for as many prompts, else
  None."""
  keys = ("prompt_new_tokens", "prompt_verifier_calls")
  if all(r.get(k) for r in (a, b) for k in keys) and len(a[keys[0]]) == len(b[keys[0]]):
    return [np.asarray(r[k], np.float64) for r in (a, b) for k in keys]
  return None


def tau_ratio_se(a: dict, b: dict, offset: float = 0.0) -> tuple[float, bool]:
  """(standard error of (τ_a − offset) / (τ_b − offset), paired?), as `tau_diff_se`: the delta
  method on the per-prompt differences of the relative influences when both rows carry
  per-prompt counts, else the relative standard errors combined in quadrature. offset 1: the
  ratio of accepted tokens per call, τ − 1."""
  num, den = a["block_efficiency"] - offset, max(b["block_efficiency"] - offset, 1e-9)
  ratio = num / den
  arrays = _paired(a, b)
  if arrays is not None and len(arrays[0]) >= 2:
    rel = _influence(*arrays[:2]) / num - _influence(*arrays[2:]) / den
    n = len(rel)
    return float(abs(ratio) * math.sqrt(np.sum(rel ** 2) / (n * (n - 1)))), True
  return float(math.hypot((a.get("tau_se") or 0.0) / den,
                          ratio * (b.get("tau_se") or 0.0) / den)), False


def tau_diff_se(a: dict, b: dict) -> tuple[float, bool]:
  """(standard error of τ_a − τ_b, paired?) for two results rows: paired over prompts
  (`paired_ratio_diff_se`) when both carry prompt_new_tokens / prompt_verifier_calls for the
  same number of prompts (evaluate's rows of one prompt set do), else their tau_se combined as
  if independent (rows written before the per-prompt fields; conservative for shared prompts)."""
  arrays = _paired(a, b)
  if arrays is not None:
    return paired_ratio_diff_se(*arrays), True
  return float(math.hypot(a.get("tau_se") or 0.0, b.get("tau_se") or 0.0)), False


def theoretical_speedup(tau: float, *, r_m: float, c: float, drafter_calls: int) -> float:
  """Speedup over autoregressive decoding that τ predicts: τ / (r(M) + d·c)   (docs/design.md §3).

  One round costs one verifier call over M tokens (r(M) = its time / a one-token call's, measured)
  plus d drafter calls (c each, in one-token verifier calls) and emits τ tokens; autoregressive
  decoding emits 1 token per one-token call. With r = 1 and d = γ this is Leviathan et al.'s
  Thm 3.8 denominator γc + 1.
  """
  if tau < 0 or r_m <= 0 or c < 0 or drafter_calls < 0:
    raise ValueError(f"theoretical_speedup needs τ ≥ 0, r(M) > 0, c ≥ 0, d ≥ 0; got τ={tau}, "
                     f"r_m={r_m}, c={c}, drafter_calls={drafter_calls}.")
  return round_speedup(tau, r_m=r_m, drafting=drafter_calls * float(c))


def round_speedup(tau: float, *, r_m: float, drafting: float) -> float:
  """τ / (r(M) + drafting): the theoretical speedup of a round whose drafter calls cost
  `drafting` one-token verifier calls in all (d·c for a chain; Σ_w c(w) for a tree whose calls
  feed w tokens each, docs/design.md §3)."""
  if tau < 0 or r_m <= 0 or drafting < 0:
    raise ValueError(f"round_speedup needs τ ≥ 0, r(M) > 0, drafting ≥ 0; got τ={tau}, "
                     f"r_m={r_m}, drafting={drafting}.")
  return float(tau) / (float(r_m) + float(drafting))


def break_even_tau(*, r_m: float, c: float, drafter_calls: int) -> float:
  """The τ at which speculative decoding matches autoregressive decoding: r(M) + d·c, a round's
  cost in one-token verifier calls (`theoretical_speedup` is τ over it)."""
  return 1.0 / theoretical_speedup(1.0, r_m=r_m, c=c, drafter_calls=drafter_calls)


def chain_block_efficiency(alpha: float, gamma: int) -> float:
  """Closed-form τ of chain SD with i.i.d. acceptance α: (1 − α^{γ+1}) / (1 − α)."""
  return float(theory.expected_block_efficiency(alpha, int(gamma)))


def chain_speedup(alpha: float, gamma: int, *, c: float, r_m: float = 1.0) -> float:
  """Closed-form chain prediction from α alone: τ(α, γ) / (r(M) + γc), M = γ + 1. The gap to
  `theoretical_speedup(τ measured, ...)` is how far acceptance is from i.i.d."""
  return theoretical_speedup(chain_block_efficiency(alpha, gamma), r_m=r_m, c=c,
                             drafter_calls=int(gamma))
