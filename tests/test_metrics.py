"""Evaluation measurement: metrics from hand-made loop stats, and the timing helpers' schedules."""

import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.evaluation import metrics, theory, timing
from spec_jax.models import llama


def _output(num_new, calls, reached, accepted_at, alpha_sum, candidates=None):
  """A loop output as the metrics read it: num_new, new_tokens() and per-row stats."""
  num_new = np.asarray(num_new, np.int32)
  stats = types.SimpleNamespace(
      verifier_calls=np.asarray(calls, np.int32), accepted=np.asarray(accepted_at).sum(1),
      reached=np.asarray(reached, np.int32), accepted_at=np.asarray(accepted_at, np.int32),
      alpha_sum=np.asarray(alpha_sum, np.float32))
  if candidates is not None:
    stats.candidates = np.asarray(candidates, np.int32)
  tokens = [list(range(100 * b, 100 * b + n)) for b, n in enumerate(num_new)]
  return types.SimpleNamespace(num_new=num_new, stats=stats, new_tokens=lambda: tokens)


def _padded_batches():
  """Two batches, γ = 3; the first is padded with one row whose counts must never count."""
  first = _output(num_new=[10, 3, 100], calls=[4, 3, 1],
                  reached=[[4, 3, 1], [3, 0, 0], [1, 1, 1]],
                  accepted_at=[[3, 1, 0], [0, 0, 0], [1, 1, 1]],
                  alpha_sum=[6.0, 0.9, 3.0], candidates=[9, 3, 50])
  second = _output(num_new=[7, 4], calls=[2, 4], reached=[[2, 2, 2], [4, 1, 0]],
                   accepted_at=[[2, 2, 1], [1, 0, 0]], alpha_sum=[5.5, 2.0],
                   candidates=[6, 5])
  return [first, second], [2, 2]


def test_summarize_padded_batches():
  outputs, reals = _padded_batches()
  s = metrics.summarize(outputs, reals)
  assert s["num_prompts"] == 4
  assert s["new_tokens"] == 24 and s["verifier_calls"] == 13
  # τ is a ratio of sums (24/13 = 1.846), not the mean of per-row τ (2.0); the padded row
  # (100 tokens in 1 call) would push it to 124/14.
  assert s["block_efficiency"] == pytest.approx(24 / 13)
  assert s["mean_accepted_tokens"] == pytest.approx(24 / 13 - 1)
  # α over examined positions (Σ reached = 22), not over calls·γ = 39.
  assert s["acceptance_rate"] == pytest.approx(14.4 / 22)
  assert s["empirical_acceptance"] == pytest.approx(10 / 22)
  assert s["per_position_acceptance"] == pytest.approx([6 / 13, 3 / 6, 1 / 3])
  assert s["candidates_per_call"] == pytest.approx(23 / 13)
  # Per-row τ = 2.5, 1, 3.5, 1: sample std sqrt(1.5), over sqrt(4) rows.
  assert s["tau_se"] == pytest.approx(np.sqrt(1.5) / 2)
  assert metrics.emitted_tokens(outputs, reals) == 24
  assert metrics.token_lists(outputs, reals) == [list(range(10)), list(range(100, 103)),
                                                 list(range(7)), list(range(100, 104))]


def test_summarize_without_reals_counts_every_row():
  outputs, _ = _padded_batches()
  s = metrics.summarize(outputs)
  assert s["num_prompts"] == 5 and s["new_tokens"] == 124 and s["verifier_calls"] == 14
  assert s["acceptance_rate"] == pytest.approx(17.4 / 25)


def test_summarize_undefined_ratios_and_optional_candidates():
  # Depth 2 never examined (every round rejected at depth 1): its acceptance is undefined, not 0.
  out = _output(num_new=[2, 1], calls=[2, 1], reached=[[2, 0], [1, 0]],
                accepted_at=[[0, 0], [0, 0]], alpha_sum=[0.5, 0.25])
  s = metrics.summarize([out])
  assert s["per_position_acceptance"] == [0.0, None]
  assert s["acceptance_rate"] == pytest.approx(0.75 / 3)
  assert s["candidates_per_call"] is None  # the chain loop's stats have no candidates
  assert s["block_efficiency"] == 1.0 and s["mean_accepted_tokens"] == 0.0
  single = metrics.summarize([out], [1])
  assert single["tau_se"] == 0.0 and single["num_prompts"] == 1
  # Nothing decoded at all: no call, no examined draft.
  empty = metrics.summarize([_output([0], [0], [[0, 0]], [[0, 0]], [0.0])])
  assert empty["block_efficiency"] is None and empty["acceptance_rate"] is None
  assert empty["mean_accepted_tokens"] is None


def test_summarize_bad_reals():
  outputs, _ = _padded_batches()
  with pytest.raises(ValueError, match="one real row count per batch"):
    metrics.summarize(outputs, [2])
  with pytest.raises(ValueError, match=r"reals\[0\]=4 must be in \[1, 3\]"):
    metrics.summarize(outputs, [4, 2])


def test_theoretical_speedup():
  # τ / (r(M) + d·c): 3 / (1.5 + 4·0.1). Constant verifier cost would give 3/1.4 = 2.14.
  assert metrics.theoretical_speedup(3.0, r_m=1.5, c=0.1, drafter_calls=4) == pytest.approx(
      3 / 1.9)
  # Autoregressive: τ = 1, r(1) = 1, no drafter.
  assert metrics.theoretical_speedup(1.0, r_m=1.0, c=0.3, drafter_calls=0) == 1.0
  with pytest.raises(ValueError, match="r_m"):
    metrics.theoretical_speedup(2.0, r_m=0.0, c=0.1, drafter_calls=2)
  with pytest.raises(ValueError, match="c="):
    metrics.theoretical_speedup(2.0, r_m=1.0, c=-0.1, drafter_calls=2)


def test_chain_prediction_matches_leviathan_at_r_one():
  assert metrics.chain_block_efficiency(0.8, 5) == pytest.approx(3.68928)
  for alpha, gamma, c in [(0.6, 2, 0.1), (0.8, 5, 0.05), (0.9, 10, 0.2)]:
    assert metrics.chain_speedup(alpha, gamma, c=c) == pytest.approx(
        float(theory.expected_speedup(alpha, gamma, c)))
  # A verifier call over γ + 1 tokens that costs 1.3 one-token calls.
  assert metrics.chain_speedup(0.8, 5, c=0.05, r_m=1.3) == pytest.approx(3.68928 / 1.55)


def test_interleave_spreads_turns_and_keeps_call_order():
  log = []
  make = lambda name: (lambda: log.append(name) or name)  # noqa: E731
  turns = []
  results = timing.interleave(
      [[make("a0"), make("a1"), make("a2"), make("a3")], [make("b0"), make("b1")]],
      warmups=[make("wa"), make("wb")], on_turn=lambda t, n: turns.append((t, n)))
  # Warm-ups first; b's two calls land at turns ⌊0.5·4/2⌋ = 1 and ⌊1.5·4/2⌋ = 3.
  assert log == ["wa", "wb", "a0", "a1", "b0", "a2", "a3", "b1"]
  assert turns == [(0, 4), (1, 4), (2, 4), (3, 4)]
  assert [[out for out, _ in r] for r in results] == [["a0", "a1", "a2", "a3"], ["b0", "b1"]]
  assert all(s >= 0 for r in results for _, s in r)


def test_round_robin_and_timed_pass_compile_first():
  calls = {"x": 0, "y": 0}

  def fn(name):
    def call():
      calls[name] += 1
      return jnp.ones(3) * calls[name]
    return call

  times = timing.round_robin({"x": fn("x"), "y": fn("y")}, repeats=3)
  assert calls == {"x": 4, "y": 4}  # one compile call each, then 3 turns
  assert set(times["x"]) == {"compile_s", "median_s", "min_s"}
  assert times["x"]["min_s"] <= times["x"]["median_s"]
  seen = []
  outputs, seconds = timing.timed_pass(lambda x, i: seen.append((x, i)) or x * 2, [5, 6, 7])
  assert seen == [(5, 0), (5, 0), (6, 1), (7, 2)] and outputs == [10, 12, 14] and seconds >= 0
  seen = []  # compile_only: the warm-up asks fn to compile, not to run
  outputs, _ = timing.timed_pass(lambda x, i, **kw: seen.append((x, i, kw)) or x * 2, [5, 6],
                                 compile_only=True)
  assert seen == [(5, 0, {"compile_only": True}), (5, 0, {}), (6, 1, {})] and outputs == [10, 12]
  seen = []  # repeats: every input timed 3 times, each input's median summed
  clock = iter([0.5, 0.1, 0.2, 0.3, 0.3, 0.9])
  monkey = timing.timed
  timing.timed = lambda f: (f(), next(clock))
  try:
    outputs, seconds = timing.timed_pass(lambda x, i: seen.append((x, i)) or x * 2, [5, 6],
                                         repeats=3)
  finally:
    timing.timed = monkey
  assert seen == [(5, 0)] * 4 + [(6, 1)] * 3 and outputs == [10, 12]
  assert seconds == pytest.approx(0.2 + 0.3)
  with pytest.raises(ValueError, match="repeats must be >= 1"):
    timing.timed_pass(lambda x, i: x, [1], repeats=0)
  steps = [types.SimpleNamespace(steps=np.int32(3)), types.SimpleNamespace(steps=np.int32(5))]
  assert timing.seconds_per_step(steps, 4.0) == 0.5


def test_timed_pass_reports_cpu_per_wall_so_a_stalled_pass_shows():
  """A pass that computes keeps a core busy (cpu_per_wall near 1 or more); one that waits
  (paused, starved: here sleeping) reads near 0."""
  def spin(x, i):
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:
      pass
    return x

  busy, idle = {}, {}
  timing.timed_pass(spin, [0, 1, 2], usage=busy)
  timing.timed_pass(lambda x, i: time.sleep(0.05) or x, [0, 1, 2], usage=idle)
  assert busy["cpu_per_wall"] > 0.5 > 0.2 > idle["cpu_per_wall"] >= 0
  assert timing.cpu_per_wall(3.0, 2.0) == 1.5 and timing.cpu_per_wall(1.0, 0.0) is None


def test_verifier_cost_ratio_runs_the_forward():
  cfg = llama.model_config("test-tiny")
  params = llama.init_params(cfg, jax.random.key(0))
  make_cache = lambda: llama.init_cache(cfg, 2, 24)  # noqa: E731
  assert timing.verifier_cost_ratio(llama.make_apply(cfg), params, make_cache, batch_size=2,
                                    m=1, position=10) == 1.0
  r = timing.verifier_cost_ratio(llama.make_apply(cfg), params, make_cache, batch_size=2, m=5,
                                 position=10, repeats=2)
  assert np.isfinite(r) and r > 0
  with pytest.raises(ValueError, match="m >= 1"):
    timing.verifier_cost_ratio(llama.make_apply(cfg), params, make_cache, batch_size=2, m=0,
                               position=10)
