"""Evaluation measurement: metrics from hand-made loop stats, and the timing helpers' schedules
and arithmetic on fake clocks (exact readings, whatever else the machine runs)."""

import itertools
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
  # The standard error of τ = Σ tokens / Σ calls over the four real rows (10/4, 3/3, 7/2, 4/4):
  # residuals tokens − τ·calls, their sample variance, over Σ calls / √4; not the per-row τ's
  # (2.5, 1, 3.5, 1: sqrt(1.5) / 2 = 0.612).
  residuals = np.array([10, 3, 7, 4]) - 24 / 13 * np.array([4, 3, 2, 4])
  assert s["tau_se"] == pytest.approx(np.sqrt(np.sum(residuals ** 2) / 3) / (13 / 2))
  assert s["tau_se"] == pytest.approx(0.5306, abs=1e-4)
  assert metrics.emitted_tokens(outputs, reals) == 24
  assert metrics.token_lists(outputs, reals) == [list(range(10)), list(range(100, 103)),
                                                 list(range(7)), list(range(100, 104))]


def test_tau_se_is_the_spread_of_tau_over_repeated_prompt_sets():
  """tau_se against the law: 1,000 sets of 40 prompts, 30% of them cut by a stop token after one
  call (1-5 tokens), the rest 30 calls of Binomial(120, 0.5) tokens. The standard deviation of τ
  over the sets is what tau_se must estimate (within 10%); the per-row τ's standard error, the
  planted estimator, reads the short rows' spread and is 4× too large."""
  rng = np.random.default_rng(0)
  taus, ses, per_row = [], [], []
  for _ in range(1000):
    short = rng.random(40) < 0.3
    calls = np.where(short, 1, 30)
    tokens = np.where(short, rng.integers(1, 6, 40), rng.binomial(120, 0.5, 40))
    taus.append(tokens.sum() / calls.sum())
    ses.append(metrics.ratio_se(tokens, calls))
    per_row.append(np.std(tokens / calls, ddof=1) / np.sqrt(40))
  spread = np.std(taus, ddof=1)
  assert np.mean(ses) == pytest.approx(spread, rel=0.1)
  assert np.mean(per_row) > 2 * spread
  assert metrics.ratio_se([5], [2]) == 0.0 and metrics.ratio_se([4, 6], [2, 3]) == 0.0


def _paired_runs(rng) -> tuple[dict, dict]:
  """Rows of two methods on the same 40 prompts, each prompt with its own difficulty (its
  acceptance probability, shared by both methods; method b's is 0.3 higher, so τ_a / τ_b ≈ 0.7
  and (τ_a − 1) / (τ_b − 1) ≈ 0.55: a standard error that drops the ratio's factor is off by
  far more than the tolerance)."""
  p = rng.uniform(0.1, 0.6, 40)
  rows = []
  for shift in (0.0, 0.3):
    calls = rng.integers(10, 31, 40)
    tokens = calls + rng.binomial(3 * calls, np.minimum(p + shift, 1.0))
    rows.append(dict(prompt_new_tokens=tokens.tolist(), prompt_verifier_calls=calls.tolist(),
                     block_efficiency=tokens.sum() / calls.sum(),
                     tau_se=metrics.ratio_se(tokens, calls)))
  return rows[0], rows[1]


def test_paired_tau_difference_se_is_the_spread_of_the_difference_over_prompt_sets():
  """Two methods on the same prompts (`_paired_runs`), 1,000 prompt sets. The standard deviation
  of τ_a − τ_b over the sets is what the paired standard error must estimate (within 10%);
  combining the two runs' tau_se as if independent (the planted estimator, what the reports used
  before) reads the prompts' difficulty and is over 2× too large. The same for the ratio
  τ_a / τ_b (BPD's gain over plain BPD) and (τ_a − 1) / (τ_b − 1) (steering's gain)."""
  rng = np.random.default_rng(0)
  got = {"diff": [], "ratio": [], "offset": []}
  ses = {"diff": [], "ratio": [], "offset": []}
  independent = []
  for _ in range(1000):
    a, b = _paired_runs(rng)
    ta, tb = a["block_efficiency"], b["block_efficiency"]
    got["diff"].append(ta - tb)
    got["ratio"].append(ta / tb)
    got["offset"].append((ta - 1) / (tb - 1))
    for name, (se, was_paired) in (("diff", metrics.tau_diff_se(a, b)),
                                   ("ratio", metrics.tau_ratio_se(a, b)),
                                   ("offset", metrics.tau_ratio_se(a, b, offset=1.0))):
      assert was_paired
      ses[name].append(se)
    independent.append(metrics.tau_diff_se(dict(tau_se=a["tau_se"]), b)[0])
  for name in got:
    assert np.mean(ses[name]) == pytest.approx(np.std(got[name], ddof=1), rel=0.1), name
  assert np.mean(independent) > 2 * np.std(got["diff"], ddof=1)
  # Rows without per-prompt counts (written before them), or of different prompt sets: their
  # standard errors combined as if independent.
  assert metrics.tau_diff_se(dict(tau_se=0.3), dict(tau_se=0.4)) == (pytest.approx(0.5), False)
  assert metrics.tau_ratio_se(dict(block_efficiency=2.0, tau_se=0.3),
                              dict(block_efficiency=1.0, tau_se=0.2)) == (
                                  pytest.approx(2 * np.hypot(0.15, 0.2)), False)
  short = dict(prompt_new_tokens=[3, 4], prompt_verifier_calls=[1, 2], tau_se=0.3)
  assert metrics.tau_diff_se(short, dict(b, tau_se=0.4)) == (pytest.approx(0.5), False)
  with pytest.raises(ValueError, match="one entry per prompt"):
    metrics.paired_ratio_diff_se([1, 2], [1, 1], [1, 2, 3], [1, 1, 1])


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
  # The break-even τ is the round's cost: at that τ the theory is 1.
  assert metrics.break_even_tau(r_m=1.5, c=0.1, drafter_calls=4) == pytest.approx(1.9)
  assert metrics.theoretical_speedup(1.9, r_m=1.5, c=0.1, drafter_calls=4) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="r_m"):
    metrics.break_even_tau(r_m=-1.0, c=0.1, drafter_calls=2)
  # A round whose calls cost different amounts (a tree's): τ over r(M) + their sum.
  assert metrics.round_speedup(3.0, r_m=1.5, drafting=0.4) == pytest.approx(
      metrics.theoretical_speedup(3.0, r_m=1.5, c=0.1, drafter_calls=4))
  with pytest.raises(ValueError, match="drafting="):
    metrics.round_speedup(3.0, r_m=1.5, drafting=-0.1)


def test_chain_prediction_matches_leviathan_at_r_one():
  assert metrics.chain_block_efficiency(0.8, 5) == pytest.approx(3.68928)
  for alpha, gamma, c in [(0.6, 2, 0.1), (0.8, 5, 0.05), (0.9, 10, 0.2)]:
    assert metrics.chain_speedup(alpha, gamma, c=c) == pytest.approx(
        float(theory.expected_speedup(alpha, gamma, c)))
  # A verifier call over γ + 1 tokens that costs 1.3 one-token calls.
  assert metrics.chain_speedup(0.8, 5, c=0.05, r_m=1.3) == pytest.approx(3.68928 / 1.55)


class _Clocks:
  """A fake wall clock and CPU clock that move only when a fake call works: `work(s, cores)` is
  s wall seconds with `cores` cores busy (0: sleeping, paused or starved by other jobs). The
  durations below are binary fractions, so every sum, median and ratio is exact."""

  def __init__(self):
    self.wall, self.cpu = 0.0, 0.0

  def wall_clock(self) -> float:
    return self.wall

  def cpu_clock(self) -> float:
    return self.cpu

  def work(self, seconds: float, cores: float = 1.0):
    self.wall += seconds
    self.cpu += cores * seconds


def _stopwatch(durations):
  """A wall clock for calls a test cannot reach into (a jitted forward): `timing.timed` reads it
  at a call's start and stop, and the k-th timed call lasts durations[k]."""
  clocks, lasts, reads = _Clocks(), iter(durations), itertools.count()

  def clock():
    if next(reads) % 2:  # a stop reading
      clocks.work(next(lasts))
    return clocks.wall
  return clock


def test_interleave_spreads_turns_and_keeps_call_order():
  log, clocks = [], _Clocks()

  def make(name, seconds=0.0):
    def call():
      log.append(name)
      clocks.work(seconds)
      return name
    return call

  turns = []
  results = timing.interleave(
      [[make("a0", 0.25), make("a1", 0.5), make("a2", 0.75), make("a3", 1.0)],
       [make("b0", 2.0), make("b1", 4.0)]],
      warmups=[make("wa", 8.0), make("wb", 8.0)], on_turn=lambda t, n: turns.append((t, n)),
      clock=clocks.wall_clock)
  # Warm-ups first; b's two calls land at turns ⌊0.5·4/2⌋ = 1 and ⌊1.5·4/2⌋ = 3.
  assert log == ["wa", "wb", "a0", "a1", "b0", "a2", "a3", "b1"]
  assert turns == [(0, 4), (1, 4), (2, 4), (3, 4)]
  assert [[out for out, _ in r] for r in results] == [["a0", "a1", "a2", "a3"], ["b0", "b1"]]
  # Each call's own seconds; the warm-ups' 16 s are never timed.
  assert results == [[("a0", 0.25), ("a1", 0.5), ("a2", 0.75), ("a3", 1.0)],
                     [("b0", 2.0), ("b1", 4.0)]]


def test_paired_passes_take_turns_and_alternate_who_runs_first():
  log, clocks = [], _Clocks()

  def make(name, seconds):
    def call(x, i):
      log.append(f"{name}{i}")
      clocks.work(seconds * x)
      return x
    return call

  passes = timing.paired_passes(make("a", 1.0), make("b", 0.5), [1.0, 2.0, 4.0], 2,
                                clock=clocks.wall_clock)
  # Pass 0: a first on even inputs; pass 1: the other way round. Nothing untimed runs.
  assert log == ["a0", "b0", "b1", "a1", "a2", "b2", "b0", "a0", "a1", "b1", "b2", "a2"]
  assert passes == [(7.0, 3.5), (7.0, 3.5)]
  with pytest.raises(ValueError, match="repeats >= 1"):
    timing.paired_passes(make("a", 1.0), make("b", 1.0), [1.0], 0)


def test_round_robin_and_timed_pass_compile_first():
  calls, clocks = {"x": 0, "y": 0}, _Clocks()
  # Each fn's first call (compilation) then its 3 turns.
  lasts = {"x": iter([1.0, 0.25, 0.5, 0.125]), "y": iter([0.5, 0.75, 0.75, 0.25])}

  def fn(name):
    def call():
      calls[name] += 1
      clocks.work(next(lasts[name]))
      return jnp.ones(3) * calls[name]
    return call

  times = timing.round_robin({"x": fn("x"), "y": fn("y")}, repeats=3, clock=clocks.wall_clock)
  assert calls == {"x": 4, "y": 4}  # one compile call each, then 3 turns
  assert set(times["x"]) == {"compile_s", "median_s", "min_s", "max_s"}
  # compile_s = first call − median, floored at 0 (y's first call ran faster than its median).
  assert times == {"x": dict(compile_s=0.75, median_s=0.25, min_s=0.125, max_s=0.5),
                   "y": dict(compile_s=0.0, median_s=0.75, min_s=0.25, max_s=0.75)}
  calls["z"], lasts["z"] = 0, iter([2.0, 0.5, 0.25])
  assert timing.time_call(fn("z"), 2, clock=clocks.wall_clock) == dict(
      compile_s=1.625, median_s=0.375, min_s=0.25, max_s=0.5)
  # The default clock is the real one: any call takes a non-negative time.
  assert timing.timed(lambda: jnp.ones(2))[1] >= 0
  seen, clocks = [], _Clocks()
  outputs, seconds = timing.timed_pass(
      lambda x, i: seen.append((x, i)) or clocks.work(x / 8) or x * 2, [5, 6, 7],
      clock=clocks.wall_clock, cpu_clock=clocks.cpu_clock)
  assert seen == [(5, 0), (5, 0), (6, 1), (7, 2)] and outputs == [10, 12, 14]
  assert seconds == (6 + 7 + 5) / 8  # the untimed warm-up's 5/8 s left out
  seen = []  # compile_only: the warm-up asks fn to compile, not to run
  outputs, _ = timing.timed_pass(lambda x, i, **kw: seen.append((x, i, kw)) or x * 2, [5, 6],
                                 compile_only=True)
  assert seen == [(5, 0, {"compile_only": True}), (5, 0, {}), (6, 1, {})] and outputs == [10, 12]
  seen, clocks = [], _Clocks()  # repeats: every input timed 3 times, each input's median summed
  lasts = iter([64.0, 0.5, 0.125, 0.25, 0.375, 0.375, 0.875])  # the warm-up, then 2 × 3 calls
  outputs, seconds = timing.timed_pass(
      lambda x, i: seen.append((x, i)) or clocks.work(next(lasts)) or x * 2, [5, 6], repeats=3,
      clock=clocks.wall_clock, cpu_clock=clocks.cpu_clock)
  assert seen == [(5, 0)] * 4 + [(6, 1)] * 3 and outputs == [10, 12]
  assert seconds == 0.25 + 0.375
  with pytest.raises(ValueError, match="repeats must be >= 1"):
    timing.timed_pass(lambda x, i: x, [1], repeats=0)
  steps = [types.SimpleNamespace(steps=np.int32(3)), types.SimpleNamespace(steps=np.int32(5))]
  assert timing.seconds_per_step(steps, 4.0) == 0.5


def test_settled_round_robin_times_again_after_a_slow_spell():
  """A timing whose reference ran over tolerance × expected_s is repeated after a pause, and the
  timing kept is the one whose reference ran fastest, every fn's times from it: in a spell the
  reference runs 3× slower and the other fn 1.5×, so a ratio from a spell is off."""
  clocks, waits = _Clocks(), []
  spells = []  # per timing: the reference's seconds in it (1.0: no spell)

  def make(name):
    def call():
      ref = spells[0]
      clocks.work(ref if name == "ref" else {1.0: 4.0, 3.0: 6.0, 4.0: 10.0}[ref])
    return call

  fns = {"ref": make("ref"), "x": make("x")}

  def sleep(seconds):
    waits.append(seconds)
    spells.pop(0)

  def settle(schedule, **kw):
    spells[:] = schedule
    waits.clear()
    usage = {}
    times = timing.settled_round_robin(fns, 3, reference="ref", usage=usage, sleep=sleep,
                                       clock=clocks.wall_clock, **kw)
    return times["x"]["median_s"] / times["ref"]["median_s"], usage, list(waits)

  # Two timings in a spell, then one out of it: the third is kept, after two pauses, the second
  # twice the first.
  assert settle([3.0, 3.0, 1.0], expected_s=1.0, wait_s=7.0) == (
      4.0, dict(tries=3, reference_vs_expected=1.0, reference_spread=3.0), [7.0, 14.0])
  # A spell through every try: the fastest reference's timing is kept, not the last one.
  assert settle([3.0, 4.0], expected_s=1.0, tries=2) == (
      2.0, dict(tries=2, reference_vs_expected=3.0, reference_spread=1.333),
      [timing.SETTLE_WAIT_S])
  # Within tolerance at once: one timing, no pause.
  assert settle([1.0], expected_s=0.75) == (
      4.0, dict(tries=1, reference_vs_expected=1.333, reference_spread=1.0), [])
  assert settle([3.0], expected_s=1.0, tolerance=4.0)[1:] == (
      dict(tries=1, reference_vs_expected=3.0, reference_spread=1.0), [])
  # Nothing to compare against: one timing.
  assert settle([3.0, 1.0], expected_s=None) == (
      2.0, dict(tries=1, reference_vs_expected=None, reference_spread=1.0), [])
  # Nothing to compare against, min_tries timings: the one out of a spell is kept, wherever it
  # comes (not the first, not the last), and the spread shows the spell.
  assert settle([3.0, 1.0, 4.0], expected_s=None, min_tries=3, wait_s=2.0) == (
      4.0, dict(tries=3, reference_vs_expected=None, reference_spread=4.0), [2.0, 4.0])
  # min_tries first, then more while the reference is still slow.
  assert settle([3.0, 3.0, 1.0], expected_s=1.0, min_tries=2, wait_s=1.0) == (
      4.0, dict(tries=3, reference_vs_expected=1.0, reference_spread=3.0), [1.0, 2.0])
  with pytest.raises(ValueError, match=r"tries=0, min_tries=1: need 1 <= min_tries <= tries"):
    timing.settled_round_robin(fns, 3, reference="ref", expected_s=1.0, tries=0)
  with pytest.raises(ValueError, match=r"tries=2, min_tries=3: need"):
    timing.settled_round_robin(fns, 3, reference="ref", expected_s=None, tries=2, min_tries=3)
  with pytest.raises(ValueError, match="reference 'v' is not one of the timed calls"):
    timing.settled_round_robin(fns, 3, reference="v", expected_s=1.0)


def test_round_robin_shows_progress_between_timed_calls(monkeypatch):
  log = []

  class Bar:  # records what round_robin asks of tqdm, in order with the calls
    def __init__(self, total, desc, leave, unit, disable):
      log.append(("bar", total, desc, disable))

    def update(self, n=1):
      log.append(("update", n))

    def close(self):
      log.append(("close",))

  monkeypatch.setattr(timing.tqdm, "tqdm", Bar)
  fns = {name: (lambda name=name: log.append(name)) for name in ("x", "y")}
  timing.round_robin(fns, repeats=2, desc="benchmark")
  updates = [entry[1] for entry in log if entry[0] == "update"]
  assert log[0] == ("bar", 6, "benchmark", False) and sum(updates) == 6
  # Compiling calls counted one by one, then whole turns; never inside a timed call's turn.
  assert [e if isinstance(e, str) else e[0] for e in log if e != ("update", 0)] == [
      "bar", "x", "update", "y", "update", "x", "y", "update", "x", "y", "update", "close"]
  log.clear()
  timing.round_robin(fns, repeats=1)
  assert log[0] == ("bar", 4, None, True)  # no label: no bar


def test_timed_pass_reports_cpu_per_wall_so_a_stalled_pass_shows():
  """cpu_per_wall: the process's CPU seconds per wall second over the timed calls, on fake
  clocks. A pass that computes keeps its cores busy (2 on XLA:CPU's two threads, 1 on one); one
  that waits (paused, starved, sleeping) reads 0; one stalled call in a pass pulls it down."""

  def usage(spells, repeats=1):
    """cpu_per_wall of a timed_pass whose call on input i works spells[i] = (seconds, cores)."""
    clocks, out, calls = _Clocks(), {}, []

    def fn(spell, i):
      calls.append(i)
      # The untimed warm-up (compilation: 8 s on one core) must not count.
      clocks.work(*((8.0, 1.0) if len(calls) == 1 else spell))
      return spell

    _, seconds = timing.timed_pass(fn, spells, usage=out, repeats=repeats,
                                   clock=clocks.wall_clock, cpu_clock=clocks.cpu_clock)
    assert seconds == sum(s for s, _ in spells)
    return out["cpu_per_wall"]

  assert usage([(0.25, 2.0), (0.5, 2.0)]) == 2.0
  assert usage([(0.25, 1.0)] * 3) == 1.0
  assert usage([(0.5, 0.0)] * 3) == 0.0
  assert usage([(0.25, 2.0), (0.75, 0.0)]) == 0.5  # one call of the pass stalled
  # Every repeat counts: CPU 3·(0.25·2 + 0.125·1.5) = 2.0625 s over 3·0.375 = 1.125 s of wall.
  assert usage([(0.25, 2.0), (0.125, 1.5)], repeats=3) == round(2.0625 / 1.125, 3)
  assert timing.cpu_per_wall(3.0, 2.0) == 1.5 and timing.cpu_per_wall(1.0, 0.0) is None
  assert timing.cpu_per_wall(1.0, 3.0) == 0.333


def test_verifier_cost_ratio_runs_the_forward():
  cfg = llama.model_config("test-tiny")
  params = llama.init_params(cfg, jax.random.key(0))
  make_cache = lambda: llama.init_cache(cfg, 2, 24)  # noqa: E731
  assert timing.verifier_cost_ratio(llama.make_apply(cfg), params, make_cache, batch_size=2,
                                    m=1, position=10) == 1.0
  # Calls in order: T = 1 and T = 5 once each (compilation), then 2 turns of both, one forward a
  # call. Medians 0.125 s and 0.375 s: r(5) = 3, whatever the compile calls took.
  clock = _stopwatch([1.0, 2.0, 0.125, 0.375, 0.125, 0.375])
  assert timing.verifier_cost_ratio(llama.make_apply(cfg), params, make_cache, batch_size=2, m=5,
                                    position=10, repeats=2, passes=1, clock=clock) == 3.0
  with pytest.raises(StopIteration):  # every one of the 6 timed calls read the clock
    clock(), clock()
  with pytest.raises(ValueError, match="m >= 1"):
    timing.verifier_cost_ratio(llama.make_apply(cfg), params, make_cache, batch_size=2, m=0,
                               position=10)


def test_forward_calls_run_their_passes_in_one_program_and_time_one_forward():
  """A timed forward call runs `passes` forwards inside one compiled loop, each on the cache the
  one before returned, and round_robin reports one forward's seconds (a call's over its passes),
  the compile apart. Timed one forward a call, a dispatch and a wait weigh on every forward, which
  a decoding loop's forwards do not pay."""
  def apply(params, tokens, positions, cache):  # the cache counts the forwards run on it
    return tokens * params + positions, None, cache + 1

  def calls(**kw):
    return timing.forward_calls(apply, jnp.int32(2), lambda: jnp.int32(0), batch_size=2,
                                tokens=(1, 3), position=5, **kw)

  three = calls(passes=3)
  logits, cache = three[3]()  # the first call warms up with two forwards, then runs its three
  assert logits.tolist() == [[5, 6, 7]] * 2 and int(cache) == 2 + 3
  assert int(three[3]()[1]) == 8 and int(three[1]()[1]) == 5  # each T its own cache
  assert three[1].passes == 3
  assert int(calls(passes=1)[1]()[1]) == 2 + 1  # the forward alone
  # passes None: after warming up, one forward timed sets the count that lasts call_s.
  quick = calls(call_s=0.0)
  assert int(quick[1]()[1]) == 4 and quick[1].passes == 1  # warm up 2, time one, then 1
  slow = calls(call_s=1e3)  # a microseconds forward: the most a call runs
  assert int(slow[1]()[1]) == 3 + timing.MAX_PASSES and slow[1].passes == timing.MAX_PASSES
  # Calls in order: T = 1 and 3 once each (compiling), then 2 turns of both, 4 forwards a call.
  clock = _stopwatch([3.0, 4.0, 0.5, 1.0, 0.75, 1.5])
  times = timing.round_robin({t: call for t, call in calls(passes=4).items()}, 2, clock=clock)
  assert times[1] == dict(compile_s=2.375, median_s=0.15625, min_s=0.125, max_s=0.1875, passes=4)
  assert times[3] == dict(compile_s=2.75, median_s=0.3125, min_s=0.25, max_s=0.375, passes=4)
  with pytest.raises(ValueError, match="passes=0 must be >= 1"):
    calls(passes=0)


def test_a_forward_call_times_no_compile_when_its_params_are_committed(monkeypatch):
  """A checkpoint's params are committed to a device and a fresh cache is not; the cache the
  first forward returns is, so jit compiles the program a second time for it. That compile must
  fall in the warm-up, not in the forward timed to set the passes (it read as one slow forward,
  and a feature drafter's c was timed one forward a call, its dispatch and wait included)."""
  def apply(params, tokens, positions, cache):
    return tokens * params + positions, None, cache + 1

  params = jax.device_put(jnp.int32(2), jax.devices()[0])
  call = timing.forward_calls(apply, params, lambda: jnp.zeros((), jnp.int32), batch_size=2,
                              tokens=(1,), position=5)[1]
  compiled, real = [], timing.timed

  def timed(fn, **kw):  # programs compiled during each timed forward
    before = call._program._cache_size()
    out = real(fn, **kw)
    compiled.append(call._program._cache_size() - before)
    return out

  monkeypatch.setattr(timing, "timed", timed)
  call()
  assert compiled == [0] and call._program._cache_size() == 2


def test_memory_reads_spread_one_wait_over_several_passes():
  """A timed call of `MemoryReads` dispatches `passes` reads and waits once, and the bandwidth
  counts every pass: on a GPU one 512 MiB read lasts about as long as a dispatch and its wait, so
  a single read per call reported a fraction of the bandwidth."""
  reads = timing.MemoryReads(nbytes=64 * 4 * 16, rows=16, passes=4)
  assert reads.nbytes == 4096 and reads.passes == 4
  sums, gemvs = reads.calls["read_sum"](), reads.calls["read_gemv"]()
  assert len(sums) == len(gemvs) == 4
  assert all(float(s) == 1024.0 for s in sums)
  assert all(g.shape == (64,) and float(g[0]) == 16.0 for g in gemvs)
  # The faster median carries the bandwidth: 4 passes × 4,096 bytes in 0.25 s.
  times = {"read_sum": {"median_s": 0.5}, "read_gemv": {"median_s": 0.25}}
  assert reads.bandwidth(times) == 4 * 4096 / 0.25
  assert timing.MemoryReads(nbytes=4096, rows=16).passes == 8  # the CPU: ~0.15 s a call
  with pytest.raises(ValueError, match="passes=0 must be >= 1"):
    timing.MemoryReads(nbytes=4096, passes=0)
  assert timing.memory_bandwidth(4096, repeats=1, passes=2) > 0


def test_bench_times_its_cost_ratios_again_when_the_verifier_ran_slow(monkeypatch):
  """r(M), a feature drafter's c and a tree's s(w) are timed with the verifier's one-token
  forward, which must not run over 1.5× the autoregressive pass's step: an expected step of a
  nanosecond makes every timing look like a slow spell (timed SETTLE_TRIES times), one of a
  kilosecond never does (once); without a baseline nothing is compared (and s(w) is timed
  without the verifier)."""
  from spec_jax import testing  # noqa: PLC0415
  from spec_jax.decoding import generate as generate_lib  # noqa: PLC0415
  from spec_jax.decoding import methods  # noqa: PLC0415
  from spec_jax.decoding.sampling import Sampling  # noqa: PLC0415
  from spec_jax.evaluation import bench  # noqa: PLC0415
  v_cfg, v_params = testing.tiny_model(seed=0)
  d_cfg, d_params = testing.tiny_model(seed=1)
  work = bench.Workload([(generate_lib.pad_prompts([[5, 6, 7], [8, 9]], 8, 0), 2)],
                        Sampling(0.0), 6)
  monkeypatch.setattr(timing, "SETTLE_TRIES", 3)
  monkeypatch.setattr(timing, "SETTLE_WAIT_S", 0.0)
  timings = []
  real = timing.round_robin
  monkeypatch.setattr(timing, "round_robin",
                      lambda fns, *a, **kw: timings.append(sorted(fns)) or real(fns, *a, **kw))
  tree = methods.Cost(calls=3, model="drafter", cfg=d_cfg, params=d_params, widths=(1, 4, 4))
  measures = {
      "r": lambda base, use: bench.verifier_cost_ratio(v_cfg, v_params, work, 5, base, use),
      "c": lambda base, use: bench.feature_cost_ratio(v_cfg, v_params, d_cfg, d_params, work,
                                                      base, use),
      "s": lambda base, use: bench.call_cost_ratios(tree, work, tree.widths, v_cfg=v_cfg,
                                                    v_params=v_params, base=base, usage=use)[4]}
  names = {"r": ["1", "5"], "c": ["d", "v"], "s": ["1", "4", "v"]}
  for key, measure in measures.items():
    for steps_s, tries in ((1e-9, 3), (1e3, 1), (None, 1)):
      timings.clear()
      use = {}
      base = None if steps_s is None else types.SimpleNamespace(steps_s=steps_s)
      assert measure(base, use) > 0, key
      timed = [n for n in names[key] if key != "s" or n != "v" or steps_s is not None]
      assert timings == [timed] * tries, (key, steps_s)
      if steps_s is None:
        assert use == dict(tries=1, reference_vs_step=None), key
      else:
        assert use["tries"] == tries and (use["reference_vs_step"] > 1.5) == (tries == 3), key
  # A row's reference_vs_step: the largest over its timings, skipping those that compared none.
  assert bench.worst_reference({"reference_vs_step": 0.9}, {}, {"reference_vs_step": None},
                               {"reference_vs_step": 2.5}) == 2.5
  assert bench.worst_reference({}, {"reference_vs_step": None}) is None
