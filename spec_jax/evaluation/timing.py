"""Wall-clock measurement: compile first, then time; several methods take turns.

Every timed call blocks until its outputs are ready, so asynchronous dispatch never hides work,
and compilation is never timed: each function runs once untimed (or timed apart as compile_s)
before its measured calls, or is only compiled (`timed_pass(..., compile_only=True)`). On a
machine shared with other jobs a slow spell lands on whichever call runs during it, so methods
that are compared run in turns (`interleave`, `round_robin`) rather than one after the other.

Every function here that reads a clock takes it as a keyword (`clock`, the wall clock, default
time.perf_counter; `cpu_clock`, the process's CPU clock, default time.process_time), so tests
check the arithmetic on a fake clock whose readings are exact, whatever else the machine runs.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import tqdm


def device_description() -> str:
  """e.g. 'cpu (2 cores, x86_64)' or 'NVIDIA H100 80GB HBM3 x1': this process's devices, and
  on several processes, how many ('NVIDIA H100 80GB HBM3 x8 per process, 2 processes')."""
  devices = jax.local_devices()
  if devices[0].platform == "cpu":
    text = f"cpu ({os.cpu_count()} cores, {platform.machine()})"
  else:
    text = f"{devices[0].device_kind} x{len(devices)}"
  if jax.process_count() > 1:
    text += f" per process, {jax.process_count()} processes"
  return text


def _quiet(desc: str | None) -> bool:
  """No progress bar: none asked for (desc None), or a multi-host process other than 0."""
  return desc is None or jax.process_index() != 0


Clock = Callable[[], float]  # seconds since an arbitrary origin; only differences are read


def timed(fn: Callable[[], Any], *, clock: Clock = time.perf_counter) -> tuple[Any, float]:
  """(fn(), seconds), the clock stopped only once every output array is ready."""
  t0 = clock()
  out = jax.block_until_ready(fn())
  return out, clock() - t0


def timed_pass(fn: Callable[..., Any], inputs: Sequence[Any], *, desc: str | None = None,
               compile_only: bool = False, usage: dict | None = None,
               repeats: int = 1, clock: Clock = time.perf_counter,
               cpu_clock: Clock = time.process_time) -> tuple[list[Any], float]:
  """Compile on inputs[0] (untimed), then run fn(x, i) `repeats` times for every input, timed;
  the pass's seconds sum each input's median time (one slow call on a busy CPU no longer sets a
  baseline; the outputs of a deterministic fn are the same every time, the last is kept).

  The batch index i lets callers fold it into an rng. compile_only: fn takes a `compile_only`
  keyword (as `generate.generate` and `loop.speculative_generate` do) and compiles without
  decoding; otherwise the untimed warm-up is a whole call on inputs[0], its output discarded.
  usage: a dict that receives cpu_per_wall, the process's CPU seconds (every thread) per wall
  second over the timed calls (`cpu_per_wall`), read on `cpu_clock` and `clock`.
  Returns (outputs, total seconds).
  """
  if compile_only:
    fn(inputs[0], 0, compile_only=True)
  else:
    jax.block_until_ready(fn(inputs[0], 0))
  if repeats < 1:
    raise ValueError(f"timing repeats must be >= 1, got {repeats}.")
  outputs, seconds, cpu, wall = [], 0.0, 0.0, 0.0
  for i, x in enumerate(tqdm.tqdm(inputs, desc=desc, leave=False, disable=_quiet(desc))):
    times = []
    for _ in range(repeats):
      cpu0 = cpu_clock()
      out, s = timed(lambda: fn(x, i), clock=clock)
      cpu += cpu_clock() - cpu0
      times.append(s)
    outputs.append(out)
    seconds += statistics.median(times)
    wall += sum(times)
  if usage is not None:
    usage["cpu_per_wall"] = cpu_per_wall(cpu, wall)
  return outputs, seconds


def cpu_per_wall(cpu_s: float, wall_s: float) -> float | None:
  """Process CPU seconds per wall second of a timed region: about the cores the program kept
  busy. A pass that was paused, or starved by other jobs, reads far below what the same program
  reads on idle cores (e.g. 0.4 where an idle run reads 1.9 on 2 cores), so its wall time, and
  any speedup from it, is suspect."""
  return round(cpu_s / wall_s, 3) if wall_s > 0 else None


def seconds_per_step(outputs: Sequence[Any], seconds: float) -> float:
  """Wall time per forward call of an autoregressive pass: seconds / Σ output.steps (prefill
  counted as one call). The drafter's over the verifier's, at the same batch size, is c."""
  return seconds / max(sum(int(o.steps) for o in outputs), 1)


def interleave(calls: Sequence[Sequence[Callable[[], Any]]], *,
               warmups: Sequence[Callable[[], Any]] | None = None,
               on_turn: Callable[[int, int], None] | None = None,
               clock: Clock = time.perf_counter) -> list[list[tuple[Any, float]]]:
  """Run several methods' calls in turns: calls[k] is method k's list of calls (one per batch).

  Every warmup runs first, untimed (compilation; None: each method's first call). Then a method
  with n calls runs call j at turn ⌊(j + ½)·turns/n⌋, turns = the longest list, so a method with
  fewer (larger) batches runs at evenly spread turns. on_turn(turn, turns) runs before each turn.
  Returns, per method, [(output, seconds)] in its calls' order.
  """
  for warmup in warmups if warmups is not None else [c[0] for c in calls]:
    jax.block_until_ready(warmup())
  turns = max(len(c) for c in calls)
  results: list[list[tuple[Any, float]]] = [[] for _ in calls]
  for turn in range(turns):
    if on_turn is not None:
      on_turn(turn, turns)
    for method, method_calls in enumerate(calls):
      for j, call in enumerate(method_calls):
        if int((j + 0.5) * turns / len(method_calls)) == turn:
          results[method].append(timed(call, clock=clock))
  return results


def paired_passes(a: Callable[[Any, int], Any], b: Callable[[Any, int], Any],
                  inputs: Sequence[Any], repeats: int, *, desc: str | None = None,
                  clock: Clock = time.perf_counter) -> list[tuple[float, float]]:
  """`repeats` passes of two compiled functions over the same inputs, taking turns input by
  input: in pass k, a(x, i) and b(x, i) run back to back, a first when i + k is even, so a slow
  spell of a shared machine lands on both and neither always runs first. Returns, per pass,
  (a's seconds, b's seconds), each the sum over the inputs. Compile both before (an untimed
  call); nothing here compiles. desc: a progress bar's label (None: no bar)."""
  if repeats < 1:
    raise ValueError(f"paired passes need repeats >= 1, got {repeats}.")
  out = []
  bar = tqdm.tqdm(total=repeats * len(inputs), desc=desc, leave=False,
                  disable=_quiet(desc))
  for k in range(repeats):
    seconds = [0.0, 0.0]
    for i, x in enumerate(inputs):
      for which in ((0, 1) if (i + k) % 2 == 0 else (1, 0)):
        seconds[which] += timed(lambda: (a, b)[which](x, i), clock=clock)[1]
      bar.update()
    out.append((seconds[0], seconds[1]))
  bar.close()
  return out


def round_robin(fns: Mapping[str, Callable[[], Any]], repeats: int, *,
                clock: Clock = time.perf_counter, desc: str | None = None
                ) -> dict[str, dict[str, float]]:
  """Time each of `fns` (same inputs, closed over) once to compile, then `repeats` turns in which
  every fn runs once. Per name: compile_s (first call minus the median), median_s, min_s,
  max_s; for a fn with a `passes` attribute (`ForwardCall`: passes forwards a call) those three
  are per pass, and passes is given too. desc: a progress bar's label (None: no bar), counting
  the compiling calls one by one and then whole turns, updated between timed calls."""
  if repeats < 1:
    raise ValueError(f"repeats={repeats} must be >= 1.")
  names = list(fns)
  bar = tqdm.tqdm(total=len(names) * (1 + repeats), desc=desc, leave=False, unit="call",
                  disable=_quiet(desc))
  first = {}
  for name in names:
    first[name] = timed(fns[name], clock=clock)[1]
    bar.update()
  results = interleave([[fns[name]] * repeats for name in names], warmups=[], clock=clock,
                       on_turn=lambda turn, turns: bar.update(len(names) if turn else 0))
  bar.update(len(names))
  bar.close()
  out = {}
  for name, runs in zip(names, results):
    times = [s for _, s in runs]
    median = statistics.median(times)
    passes = getattr(fns[name], "passes", None)
    per = passes or 1
    out[name] = dict(compile_s=max(first[name] - median, 0.0), median_s=median / per,
                     min_s=min(times) / per, max_s=max(times) / per)
    if passes is not None:
      out[name]["passes"] = passes
  return out


# `settled_round_robin`: a reference slower than this many times its expected seconds marks a
# slow spell; the timing is repeated up to SETTLE_TRIES times in all, the first pause
# SETTLE_WAIT_S and each next one twice the last (15 + 30 + 60 s: spells come in clusters of
# about a minute on a shared VM, experiments/dyn/notes.md).
SETTLE_TOLERANCE = 1.5
SETTLE_TRIES = 4
SETTLE_WAIT_S = 15.0


def settled_round_robin(fns: Mapping[str, Callable[[], Any]], repeats: int, *, reference: str,
                        expected_s: float | None, tolerance: float | None = None,
                        tries: int | None = None, min_tries: int = 1,
                        wait_s: float | None = None, usage: dict | None = None,
                        clock: Clock = time.perf_counter,
                        sleep: Callable[[float], None] | None = None,
                        desc: str | None = None) -> dict[str, dict[str, float]]:
  """`round_robin` `min_tries` times, then again while fns[reference]'s median per forward is
  over tolerance × expected_s (at most `tries` timings in all), a pause before each next timing
  (wait_s, 2·wait_s, 4·wait_s, ...); returns the timing whose reference ran fastest, every fn's
  times from that one timing.

  A shared VM has slow spells of tens of seconds in which the same compiled forward runs ~3×
  slower at one token and ~2× at 33 (experiments/dyn/notes.md, "Slow spells"), so a ratio of two
  timings taken in one spell is off too, and taking turns does not help. A reference the caller
  knows from elsewhere (the verifier's one-token forward against the autoregressive pass's step
  in the same process) shows whether a timing ran in one; without one, min_tries timings spread
  over a minute or more keep one that ran outside a spell (a spell only slows a timing down).

  expected_s None: min_tries timings, nothing compared. On several processes (multi-host) every
  process must run the same programs, so there are min_tries timings there too. usage: a dict
  that receives tries, reference_vs_expected (the kept timing's reference over expected_s; None
  without one) and reference_spread (the slowest timing's reference over the kept one's).
  tolerance, tries, wait_s None: SETTLE_TOLERANCE, max(SETTLE_TRIES, min_tries), SETTLE_WAIT_S;
  sleep None: time.sleep; desc: each timing's progress bar label (None: no bar)."""
  tolerance = SETTLE_TOLERANCE if tolerance is None else tolerance
  tries = max(SETTLE_TRIES, min_tries) if tries is None else tries
  wait_s = SETTLE_WAIT_S if wait_s is None else wait_s
  sleep = time.sleep if sleep is None else sleep
  if min_tries < 1 or tries < min_tries:
    raise ValueError(f"settle tries={tries}, min_tries={min_tries}: need 1 <= min_tries <= "
                     f"tries.")
  if reference not in fns:
    raise ValueError(f"settle reference {reference!r} is not one of the timed calls "
                     f"{sorted(fns)}.")
  if expected_s is None or jax.process_count() > 1:
    tries = min_tries
  best, references = None, []
  while len(references) < tries:
    if references:
      sleep(wait_s * 2 ** (len(references) - 1))
    times = round_robin(fns, repeats, clock=clock, desc=desc)
    references.append(times[reference]["median_s"])
    if best is None or times[reference]["median_s"] < best[reference]["median_s"]:
      best = times
    if len(references) >= min_tries and (
        expected_s is None or best[reference]["median_s"] <= tolerance * expected_s):
      break
  if usage is not None:
    fastest = best[reference]["median_s"]
    usage["tries"] = len(references)
    usage["reference_vs_expected"] = (round(fastest / expected_s, 3) if expected_s else None)
    usage["reference_spread"] = round(max(references) / fastest, 3) if fastest > 0 else None
  return best


def kept_timing(fns: Mapping[str, Callable[[], Any]], repeats: int, *, reference: str,
                timings: int, pause_s: float | None = None, desc: str | None = None,
                clock: Clock = time.perf_counter,
                sleep: Callable[[float], None] | None = None) -> tuple[dict, dict]:
  """A program's timing with no step to compare with: `timings` round_robins of fns, pause_s
  apart and then doubling (None: SETTLE_WAIT_S), the one whose reference ran fastest kept
  (`settled_round_robin`; a slow spell only slows a timing down). Returns its times and the
  fields its rows carry: timings, and reference_spread (the slowest timing's reference over the
  kept one's: 1 when one timing, well over 1 when one ran in a spell)."""
  usage = {}
  times = settled_round_robin(fns, repeats, reference=reference, expected_s=None,
                              min_tries=timings, wait_s=pause_s, usage=usage, desc=desc,
                              clock=clock, sleep=sleep)
  return times, dict(timings=usage["tries"], reference_spread=usage["reference_spread"])


def time_call(fn: Callable[[], Any], repeats: int, *,
              clock: Clock = time.perf_counter) -> dict[str, float]:
  """Compile-and-run once, then time `repeats` calls. Returns compile_s, median_s, min_s, max_s."""
  return round_robin({"fn": fn}, repeats, clock=clock)["fn"]


# The most forwards one timed call runs (`ForwardCall`).
MAX_PASSES = 64


class ForwardCall:
  """One timed call of `passes` forwards on the same T new tokens per row, inside one compiled
  loop, each reading the cache the one before wrote (donated: updated in place). A decoding loop
  runs its forwards inside one program, with no dispatch or wait between them; so does this
  call, and `round_robin` reports its times per forward. passes None: set at the first call,
  after compiling, to the forwards that make a call last about `call_s` (1 .. MAX_PASSES), from
  one forward timed on the wall clock.

  The first call runs one forward twice before anything is timed: where the params are committed
  to a device (a checkpoint's) and the fresh cache is not, the cache the first forward returns is
  committed, and jit compiles the program again for it. Were it timed, that second compile would
  read as one slow forward and set passes to 1 (one forward a call, its dispatch and wait
  included)."""

  def __init__(self, program: Callable, params: Any, cache: Any, tokens: jax.Array,
               positions: jax.Array, passes: int | None, call_s: float):
    if passes is not None and passes < 1:
      raise ValueError(f"forward passes={passes} must be >= 1 (or None: as many as last "
                       f"{call_s} s, at most {MAX_PASSES}).")
    self.passes, self._warm = passes, False
    self._program, self._params, self._cache = program, params, cache
    self._tokens, self._positions, self._call_s = tokens, positions, call_s

  def _run(self, n: int):
    logits, self._cache = self._program(self._params, self._cache, self._tokens, self._positions,
                                        jnp.int32(n))
    return logits, self._cache

  def __call__(self):
    if not self._warm:
      jax.block_until_ready(self._run(1))  # compiles
      jax.block_until_ready(self._run(1))  # again for the committed cache it returns, if need be
      self._warm = True
    if self.passes is None:
      _, seconds = timed(lambda: self._run(1))
      self.passes = int(min(MAX_PASSES, max(1, math.ceil(self._call_s / max(seconds, 1e-9)))))
    return self._run(self.passes)


def forward_calls(apply_fn: Callable, params: Any, init_cache: Callable[[], Any], *,
                  batch_size: int, tokens: Sequence[int], position: int,
                  passes: int | None = None, call_s: float = 0.05) -> dict[int, ForwardCall]:
  """T -> a `ForwardCall` of forwards on T new tokens per row, for `round_robin`, which reports
  its times per forward (see `forward_timings` for the other arguments). passes: forwards per
  call (1: the forward alone, no loop around it), or None: as many as make a call last about
  call_s seconds."""
  if batch_size < 1 or not tokens or min(tokens) < 1:
    raise ValueError(f"forward_costs needs batch_size >= 1 and token counts >= 1, got "
                     f"batch_size={batch_size}, tokens={tuple(tokens)}.")

  def forward(params, cache, tokens, positions):
    logits, _, cache = apply_fn(params, tokens, positions, cache)
    return logits, cache

  def forwards(params, cache, tokens, positions, n):
    def more(_, carry):
      # The tokens pass a barrier with the cache, so XLA cannot hoist their work out of the
      # loop (a decoding loop's tokens change every step); work on the weights alone it may.
      tokens_, positions_, cache = jax.lax.optimization_barrier((tokens, positions, carry[1]))
      return forward(params, cache, tokens_, positions_)

    return jax.lax.fori_loop(1, n, more, forward(params, cache, tokens, positions))

  if passes == 1:  # one forward a call, nothing around it
    forwards = lambda params, cache, tokens, positions, n: forward(  # noqa: E731
        params, cache, tokens, positions)
  program = jax.jit(forwards, donate_argnums=1)  # n traced: one program for every count

  def make_call(t: int) -> ForwardCall:
    x = jnp.zeros((batch_size, t), jnp.int32)
    positions = jnp.broadcast_to(position + jnp.arange(t, dtype=jnp.int32), (batch_size, t))
    return ForwardCall(program, params, init_cache(), x, positions, passes, call_s)

  return {int(t): make_call(int(t)) for t in tokens}


def forward_costs(apply_fn: Callable, params: Any, init_cache: Callable[[], Any], *,
                  batch_size: int, tokens: Sequence[int], position: int,
                  repeats: int = 5, passes: int | None = None,
                  clock: Clock = time.perf_counter) -> dict[int, float]:
  """Median seconds of one forward on T new tokens per row, for every T in `tokens`
  (`forward_timings` for the spread)."""
  times = forward_timings(apply_fn, params, init_cache, batch_size=batch_size, tokens=tokens,
                          position=position, repeats=repeats, passes=passes, clock=clock)
  return {t: v["median_s"] for t, v in times.items()}


def forward_timings(apply_fn: Callable, params: Any, init_cache: Callable[[], Any], *,
                    batch_size: int, tokens: Sequence[int], position: int,
                    repeats: int = 5, passes: int | None = None,
                    clock: Clock = time.perf_counter,
                    desc: str | None = None) -> dict[int, dict[str, float]]:
  """`round_robin`'s seconds of one forward on T new tokens per row (median_s, min_s, max_s;
  compile_s) and the forwards each timed call ran (passes), for every T in `tokens`.

  apply_fn is the docs/design.md §2 forward apply(params, tokens[B,T], positions[B,T], cache)
  -> (logits, hidden, cache) (e.g. llama.make_apply(cfg)); init_cache() returns an empty cache for
  B = batch_size rows at the cache size the decoding loop uses, since attention reads every slot.
  The T tokens sit at positions position .. position+T-1 (position + max T must fit the cache)
  under the causal mask. The forwards of a call run in one compiled loop, each writing its K/V
  into the cache as inside a decoding loop (`ForwardCall`; passes None: as many as last ~50 ms),
  and the sizes take turns (`round_robin`, whose progress bar desc labels).
  """
  calls = forward_calls(apply_fn, params, init_cache, batch_size=batch_size, tokens=tokens,
                        position=position, passes=passes)
  times = round_robin({str(t): call for t, call in calls.items()}, repeats, clock=clock,
                      desc=desc)
  return {int(t): v for t, v in times.items()}


def verifier_cost_ratio(apply_fn: Callable, params: Any, init_cache: Callable[[], Any], *,
                        batch_size: int, m: int, position: int, repeats: int = 5,
                        passes: int | None = None, clock: Clock = time.perf_counter) -> float:
  """r(M) = median time of a verifier forward over M new tokens / that of 1 token
  (docs/design.md §3), measured by `forward_costs` (same arguments)."""
  if m < 1 or batch_size < 1:
    raise ValueError(f"verifier_cost_ratio needs m >= 1 and batch_size >= 1, got m={m}, "
                     f"batch_size={batch_size}.")
  if m == 1:
    return 1.0
  costs = forward_costs(apply_fn, params, init_cache, batch_size=batch_size, tokens=(1, m),
                        position=position, repeats=repeats, passes=passes, clock=clock)
  return costs[m] / costs[1]


class MemoryReads:
  """Calls that each read `nbytes` from memory `passes` times, from an array far beyond any cache:
  a jitted sum and a jitted GEMV (a decode step's own kind of read) over the same float32 array.
  On a shared VM either one can run well below the other in a given minute, so the bandwidth is
  the faster median (`bandwidth`). Timed in turns with the calls a roofline bounds
  (`timing.round_robin`), they see the same machine those calls do.

  One pass over 512 MiB takes ~0.13 ms on an HBM3e GPU, the same order as dispatching a call and
  waiting for it, so a single timed read reports a fraction of the bandwidth. A call therefore
  dispatches `passes` reads back to back and waits once, for all of them: the device queue stays
  full and one dispatch latency is spread over the passes. On a CPU one pass lasts ~20 ms, and on
  a shared VM single passes of one run spread ~2× (a stalled moment sets a whole timed call),
  while the decode calls they bound last seconds and average such moments out: a median of a
  few single passes can then read slower than the step itself, a roofline under the measured
  step. passes=None: 8 on the CPU (a call of ~0.15 s), 16 on accelerators."""

  def __init__(self, nbytes: int = 512 * 2**20, rows: int = 512, passes: int | None = None):
    if passes is None:
      passes = 8 if jax.default_backend() == "cpu" else 16
    if passes < 1:
      raise ValueError(f"MemoryReads passes={passes} must be >= 1.")
    n = max(int(nbytes) // (4 * rows), 1)
    self.x = jnp.ones((rows, n), jnp.float32)
    self.vector = jnp.ones((rows,), jnp.float32)
    self.nbytes = self.x.size * 4
    self.passes = passes
    total, gemv = jax.jit(jnp.sum), jax.jit(jnp.dot)
    self.calls = {
        "read_sum": lambda: [total(self.x) for _ in range(passes)],
        "read_gemv": lambda: [gemv(self.vector, self.x) for _ in range(passes)]}

  def bandwidth(self, times: Mapping[str, Mapping[str, float]]) -> float:
    """Bytes per second from `round_robin` results that include `self.calls`."""
    return self.nbytes * self.passes / min(times[name]["median_s"] for name in self.calls)


def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5, *,
                     passes: int | None = None, clock: Clock = time.perf_counter) -> float:
  """Bytes per second a jitted read of `nbytes` achieves (`MemoryReads`: the faster of a sum and
  a GEMV, `passes` reads per timed call, medians of `repeats`). The memory roofline of a decode
  step is the bytes it must read (the weights, then the KV cache) over this."""
  reads = MemoryReads(nbytes, passes=passes)
  return reads.bandwidth(round_robin(reads.calls, repeats, clock=clock))


def param_bytes(params: Any) -> int:
  """Bytes of every array in a parameter tree."""
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


def shard_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of placed arrays (or sharded ShapeDtypeStructs): the
  whole array where it has no sharding or one device holds it."""
  total = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    total += math.prod(shape) * x.dtype.itemsize
  return total


def decode_read_bytes(params: Any, nbytes: Callable[[Any], int] = param_bytes) -> int:
  """Bytes of a model's parameters one decode step must read: every array but the input
  embedding table of a model with its own LM head (`lm_head` beside `embed`: untied), of which
  the step gathers only its tokens' rows; a tied table is read whole by the LM head. The memory
  roofline's numerator (the KV cache aside). nbytes: a subtree's bytes (`param_bytes`; a
  sharded plan passes bytes per device)."""
  total = nbytes(params)
  if isinstance(params, Mapping) and "lm_head" in params and "embed" in params:
    total -= nbytes(params["embed"])
  return total
