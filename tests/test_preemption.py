"""Pre-emption: SIGTERM / SIGINT stop a training run after the step in flight, checkpointed.

The end-to-end tests start `launch.py` as a real subprocess (through a wrapper that only adds a
step hook: at step 20 it tells the test, which then sends the signal) and check what a pod
scheduler's pre-emption needs: a non-zero exit with one line naming the step and the command, a
checkpoint at that step, and a rerun that resumes there and ends where an uninterrupted run ends.

Planted bug: with PREEMPT_PLANT=ignore_signal in the environment, the wrapper makes the loop's
handler ignore the signal; the launcher tests must then fail (the run finishes with status 0).
`test_the_checks_fail_when_the_signal_is_ignored` keeps that demonstration in the suite, in
process (a cheaper run than a launcher's).
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import distill as distill_config
from configs import train_lm as train_lm_config
from spec_jax import parallel
from spec_jax.programs import distill as distill_program
from spec_jax.programs import train_lm
from spec_jax.training import checkpoints, metrics as metrics_lib, preemption, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AT = 20  # the step after which the signal is sent
STEPS = 24

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signal handlers run in the main thread only")

# launch.py with a step hook injected from outside (the programs take no hook from the command
# line): at step PREEMPT_AT it writes PREEMPT_MARKER and waits for PREEMPT_GO_ON, which the
# test creates once it has sent the signal, so the signal lands mid-run whatever the machine's
# speed. Everything else is the launcher's own path (flags, handlers, exit status).
WRAPPER = textwrap.dedent("""
    import os, runpy, sys, time
    from spec_jax.training import preemption, train
    if os.environ.get("PREEMPT_PLANT") == "ignore_signal":  # the planted bug
      preemption.StopSignals._handle = lambda self, signum, frame: None
    marker, go_on, at = (os.environ["PREEMPT_MARKER"], os.environ["PREEMPT_GO_ON"],
                         int(os.environ["PREEMPT_AT"]))
    real_loop = train.train_loop

    def hook(step):
      if step == at:
        open(marker, "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(go_on) and time.monotonic() < deadline:
          time.sleep(0.01)

    train.train_loop = lambda **kw: real_loop(**{**kw, "step_hook": hook})
    sys.argv = sys.argv[1:]
    runpy.run_path("launch.py", run_name="__main__")
""")


def _config(module, arg, overrides):
  config = module.get_config(arg)
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config


def _launch_and_signal(config_arg, overrides, workdir, tmp_path, sig):
  """launch.py --config=<config_arg> --config.<k>=<v>... sent `sig` once step AT is dispatched;
  returns (exit status, stderr)."""
  marker, go_on = tmp_path / "dispatched", tmp_path / "go_on"
  env = dict(os.environ, PYTHONUNBUFFERED="1", PREEMPT_MARKER=str(marker),
             PREEMPT_GO_ON=str(go_on), PREEMPT_AT=str(AT))
  args = [f"--config={config_arg}", *(f"--config.{k}={v}" for k, v in overrides.items()),
          f"--workdir={workdir}"]
  proc = subprocess.Popen([sys.executable, "-c", WRAPPER, "launch.py", *args], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300  # a hang guard (imports alone can take a minute under load)
    while not marker.exists():
      if proc.poll() is not None:
        pytest.fail(f"the run ended before step {AT}:\n{proc.communicate()[1][-3000:]}")
      assert time.monotonic() < deadline, f"step {AT} not reached in 300 s"
      time.sleep(0.02)
    proc.send_signal(sig)
    go_on.touch()
    _, err = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
  return proc.returncode, err


def check_stopped(status, stderr, workdir, step, sig, *, launcher=True):
  """What a stopped run must leave: status 128 + signal, one line naming the signal, the step and
  (from the launcher) the command to resume, and its newest checkpoint at that step."""
  assert status == 128 + sig, f"exit status {status}:\n{stderr[-3000:]}"
  lines = [line for line in stderr.splitlines() if "stopped after step" in line]
  assert len(lines) == 1, stderr[-3000:]
  assert lines[0].startswith(f"{sig.name}: stopped after step {step} of {STEPS} and "
                             "checkpointed it. Resume with: "), lines[0]
  if launcher:
    assert "launch.py --config=" in lines[0] and f"--workdir={workdir}" in lines[0], lines[0]
  assert "Traceback" not in stderr, stderr[-3000:]
  assert checkpoints._resolve(workdir)[1] == step


def check_resumed_like_uninterrupted(run, config, workdir, ref_dir, step):
  """The rerun starts after `step`; the final params and the metrics log (one row per step,
  log_every=1) equal an uninterrupted run's within float tolerance."""
  resumed = []
  out = run(config, workdir, step_hook=resumed.append)
  assert resumed == list(range(step + 1, STEPS + 1)) and out["step"] == STEPS
  run(config, ref_dir)
  for a, b in zip(*(jax.tree.leaves(checkpoints.load_model(d)[1]) for d in (workdir, ref_dir))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  rows, ref = metrics_lib.read_jsonl(workdir), metrics_lib.read_jsonl(ref_dir)
  assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
  for row, want in zip(rows, ref):
    assert row.keys() == want.keys()
    np.testing.assert_allclose([row[k] for k in row], [want[k] for k in row], rtol=1e-5)


TRAIN_LM = {"mesh.data": 1, "train.num_steps": STEPS, "train.checkpoint_every": 7,
            "train.eval_every": 0, "train.log_every": 1}


def test_sigterm_to_launch_train_lm_checkpoints_the_step_and_resumes(data_dir, tmp_path):
  overrides = {**TRAIN_LM, "data.data_dir": data_dir}
  workdir = str(tmp_path / "run")
  status, err = _launch_and_signal("configs/train_lm.py:smoke", overrides, workdir, tmp_path,
                                   signal.SIGTERM)
  check_stopped(status, err, workdir, AT, signal.SIGTERM)
  config = _config(train_lm_config, "smoke", overrides)
  check_resumed_like_uninterrupted(train_lm.run, config, workdir, str(tmp_path / "ref"), AT)


def _signal_at(step, sig):
  def hook(done):
    if done == step:
      os.kill(os.getpid(), sig)
  return hook


@pytest.mark.parametrize("source", ["fixed", "onpolicy"])
def test_sigint_stops_distill_after_the_step_and_it_resumes(data_dir, tmp_path, capsys, source):
  """distill (hence train_steering, which runs it) sent SIGINT at step AT. In process: the
  launcher's side of a stop is program-independent and covered above, and a second launcher
  would double this file's time (interpreter start and imports); what is distill's own is that
  its loop stops, saves with its manager and resumes, which this checks. On-policy rows come in
  blocks of 3 steps generated from the block's first params, and AT = 20 stops inside the block
  of steps 18-20 (the saved step is not a block start): the resumed run reads the block's rows
  back rather than generating them from step 20's params (at lr 0.05 those differ)."""
  overrides = {**TRAIN_LM, "data.data_dir": data_dir}
  if source == "onpolicy":
    overrides.update({"data.refresh_every": 3, "train.checkpoint_every": 6, "train.lr": 0.05})
  config = _config(distill_config, f"smoke,source={source}", overrides)
  workdir = str(tmp_path / "run")
  with pytest.raises(preemption.Preempted) as e:
    distill_program.run(config, workdir, step_hook=_signal_at(AT, signal.SIGINT))
  check_stopped(e.value.code, capsys.readouterr().err, workdir, AT, signal.SIGINT,
                launcher=False)
  check_resumed_like_uninterrupted(distill_program.run, config, workdir, str(tmp_path / "ref"),
                                   AT)


def test_the_checks_fail_when_the_signal_is_ignored(data_dir, tmp_path, monkeypatch):
  """The planted bug, in process: a handler that ignores SIGTERM lets the run finish (status 0,
  no checkpoint at the signalled step), and check_stopped says so."""
  monkeypatch.setattr(preemption.StopSignals, "_handle", lambda self, signum, frame: None)
  config = _config(train_lm_config, "smoke", {**TRAIN_LM, "data.data_dir": data_dir})
  workdir = str(tmp_path / "run")
  try:
    train_lm.run(config, workdir, step_hook=_signal_at(AT, signal.SIGTERM))
    status = 0
  except preemption.Preempted as e:
    status = e.code
  with pytest.raises(AssertionError, match="exit status 0"):
    check_stopped(status, "", workdir, AT, signal.SIGTERM, launcher=False)
  assert checkpoints._resolve(workdir)[1] == STEPS  # it ran to the end


# ---------------------------------------------------------------------------------------------
# The loop's stop path, on a toy state (no model).


def _toy():
  tx = optax.sgd(0.1)
  params = {"w": jnp.arange(4, dtype=jnp.float32)}
  state = train.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=tx.init(params))

  def step_fn(state, batch, rng):
    del batch, rng
    return state.replace(step=state.step + 1, params={"w": state.params["w"] + 1.0}), {
        "loss": jnp.float32(1.0)}
  sharding = parallel.batch_sharding(parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}))
  return state, step_fn, sharding


def test_a_second_signal_during_the_save_is_ignored_and_the_checkpoint_is_whole(tmp_path):
  """SIGTERM at step 3; SIGINT and SIGTERM again while step 3 is being saved: the save completes
  (an intact, verified checkpoint at 3), the run stops once, and the previous handlers are back."""
  state, step_fn, sharding = _toy()
  manager = checkpoints.make_manager(str(tmp_path))
  meta = {"format": checkpoints.FORMAT}
  before = {sig: signal.getsignal(sig) for sig in preemption.STOP_SIGNALS}
  saved = []

  def save_fn(step, st):
    checkpoints.save(manager, step, st, meta)
    saved.append(step)
    if step == 3:  # the stop's save is in flight: signal again, twice
      os.kill(os.getpid(), signal.SIGINT)
      os.kill(os.getpid(), signal.SIGTERM)

  def hook(step):
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)
  with pytest.raises(preemption.Preempted) as e:
    train.train_loop(state=state, step_fn=step_fn, get_batch=lambda s: {"x": np.zeros((8,))},
                     num_steps=10, rng=jax.random.key(0), batch_sharding=sharding,
                     log_every=0, checkpoint_every=100, save_fn=save_fn,
                     wait_fn=manager.wait_until_finished, step_hook=hook, show_progress=False)
  manager.close()
  assert (e.value.step, e.value.code) == (3, 128 + signal.SIGTERM) and saved == [3]
  assert {sig: signal.getsignal(sig) for sig in preemption.STOP_SIGNALS} == before
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.
                                                         SingleDeviceSharding(jax.devices()[0])),
                          state)
  restored, _ = checkpoints.restore_latest(str(tmp_path), abstract)  # verified against digests
  assert int(restored.step) == 3
  np.testing.assert_array_equal(restored.params["w"], np.arange(4) + 3.0)
  assert os.listdir(tmp_path / "checkpoints") == ["3"]  # no temporary folder left


def test_a_stop_right_after_a_scheduled_checkpoint_saves_that_step_once(capsys):
  """The signal comes during step 4, which the schedule checkpoints anyway: it is saved once (a
  second save of a step is an orbax error), waited for, and the partial metrics window (steps 4
  of a log_every=3 window) is logged at the step the run stopped at."""
  state, step_fn, sharding = _toy()
  saved, waits, logged = [], [], []

  class Writer:
    def write_scalars(self, step, scalars):
      logged.append((step, sorted(scalars)))

    def flush(self):
      pass
  with pytest.raises(preemption.Preempted) as e:
    train.train_loop(state=state, step_fn=step_fn, get_batch=lambda s: {"x": np.zeros((8,))},
                     num_steps=10, rng=jax.random.key(0), batch_sharding=sharding, log_every=3,
                     checkpoint_every=2, save_fn=lambda s, st: saved.append(s),
                     wait_fn=lambda: waits.append(len(saved)), writer=Writer(),
                     step_hook=_signal_at(4, signal.SIGTERM), show_progress=False)
  assert e.value.step == 4 and saved == [2, 4] and waits == [2]
  assert [step for step, _ in logged] == [3, 4] and logged[1][1] == ["train/loss"]
  assert "SIGTERM: stopped after step 4 of 10 and checkpointed it" in capsys.readouterr().err


def test_the_stop_vote_is_an_all_reduce_read_one_step_late():
  """Multi-host agreement, forced onto this process's 8 fake devices: the max of the flags,
  the same on every device; with lag (accelerators), the previous call's vote."""
  assert preemption.StopVote(lag=True, multi=False)(True) is True  # one process: the flag
  now = preemption.StopVote(lag=False, multi=True)
  assert now(False) is False and now(True) is True
  late = preemption.StopVote(lag=True, multi=True)
  assert [late(f) for f in (False, True, False, False)] == [False, False, True, False]
