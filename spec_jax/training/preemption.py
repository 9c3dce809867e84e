"""Stopping a training run on SIGTERM / SIGINT without losing its newest step.

A pod scheduler pre-empts with SIGTERM, a terminal stops with SIGINT. Either signal, while
`train.train_loop` runs, only sets a flag (`StopSignals`); the loop then stops dispatching, lets
the step in flight finish, checkpoints it, waits for the save to complete and raises `Preempted`
(a `SystemExit` with status 128 + signal number) after printing one line that names the step and
the command to resume. Nothing is interrupted mid-step, so the signal's timing does not matter:
a `KeyboardInterrupt` raised inside the step could land while the state's buffers are donated to
the next step, with nothing left to save. A `SystemExit`, so that the launcher and the programs
that train in-process (the experiments) end with that status instead of reporting an error.

A second signal while the step is saved is ignored (logged): the save finishes. Orbax writes a
step into a temporary directory and renames it when complete (a commit file on object stores),
so even a SIGKILL mid-save leaves the previous checkpoints as they were and no partial step.

Multi-host: every process must stop after the same step and save it together (orbax's save is a
collective). `StopVote` all-reduces the flag (max over processes) each step, one step late on
accelerators so that the host keeps dispatching ahead; every process reads the same vote at the
same step and stops there. A single process needs no collective and no distributed client.
(JAX's own `multihost_utils.reached_preemption_sync_point` listens for SIGTERM in C++, a handler
that the Python handlers here and in the launcher replace; it needs a distributed client and
does not cover SIGINT.)
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
  """A run stopped by a signal after saving `step`; exits with status 128 + signum."""

  def __init__(self, step: int, signum: int, message: str):
    super().__init__(128 + int(signum))
    self.step, self.signum, self.message = step, signum, message

  def __str__(self) -> str:
    return self.message


class StopSignals:
  """`with StopSignals() as stop:` SIGTERM and SIGINT set `stop.signum` (the first signal's
  number) instead of interrupting; the previous handlers come back on exit. Python delivers
  signals to the main thread only, so elsewhere nothing is installed (`installed` is False) and a
  signal behaves as it did before."""

  def __init__(self):
    self.signum: int | None = None
    self.installed = False
    self._previous: dict[int, object] = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in STOP_SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
      self.installed = True
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signum is None:
      self.signum = signum
      logging.warning("%s received: finishing the step in flight, then saving it.", name)
    else:
      logging.warning("%s received again: ignored while the newest step is saved.", name)


class StopVote:
  """`vote(flag) -> bool`: whether any process has flagged a stop, the same answer on every
  process. One process: `flag` itself. Several: the flags all-reduced (max) over the processes'
  devices; with `lag`, the vote dispatched by the previous call is read and this call's is left
  in flight (the reduction queues behind the dispatched train step; reading it at once would
  wait for that step, losing the host's lookahead). `multi=True` forces the collective (tests
  run it over one process's fake devices)."""

  def __init__(self, *, lag: bool, multi: bool | None = None):
    self.multi = jax.process_count() > 1 if multi is None else multi
    self.lag = lag
    self._pending = None
    if self.multi:
      mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("p",))
      self._in = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
      self._reduce = jax.jit(jnp.max, out_shardings=jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec()))

  def __call__(self, flag: bool) -> bool:
    if not self.multi:
      return flag
    local = np.full((jax.local_device_count(),), int(flag), np.int32)
    vote = self._reduce(jax.make_array_from_process_local_data(self._in, local))
    if self.lag:
      vote, self._pending = self._pending, vote
    # Replicated: every process reads its own copy.
    return vote is not None and bool(np.asarray(vote.addressable_data(0)))


def resume_command() -> str:
  """The command line to run again: the launcher's own (`python launch.py ...`) when this process
  is one; otherwise (a library call) a sentence saying to repeat the call."""
  if sys.argv and sys.argv[0].endswith("launch.py"):
    return shlex.join([sys.executable, *sys.argv])
  return "the same call (run() on the same config and workdir)"


def stop_message(signum: int | None, step: int, start: int, num_steps: int) -> str:
  """The one line a stopped run prints: the signal (None: another process of the job got it),
  the step saved (or that none finished since the run's start at `start`), and the command to
  resume."""
  name = signal.Signals(signum).name if signum else "Another process was signalled"
  if step > start:
    what = f"stopped after step {step} of {num_steps} and checkpointed it"
  else:
    what = (f"stopped before finishing a step past step {start} (nothing new to checkpoint; the "
            f"run restarts from step {start})")
  return f"{name}: {what}. Resume with: {resume_command()}"
