"""Training layer: losses, optimizer, train step, checkpoints, metrics, and the train_lm program.

Program runs use the smoke config (test-tiny model, byte tokenizer, 8 x 32 tokens) on a 1-device
mesh and the real Shakespeare pipeline, built once into a temporary data dir. The persistent
compilation cache set up in conftest.py lets the several short runs share compiled steps.
"""

import functools
import glob
import math
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys
import textwrap
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import common as configs_common
from configs import train_lm as train_lm_config
from spec_jax import parallel
from spec_jax.data import pipeline
from spec_jax.data.tokenizer import ByteTokenizer
from spec_jax.models import llama
from spec_jax.programs import train_lm
from spec_jax.training import checkpoints, losses, metrics as metrics_lib, optim, train

REPO = pathlib.Path(__file__).resolve().parents[1]



def smoke_config(data_dir, **train_overrides):
  config = train_lm_config.get_config("smoke")
  config.mesh.data = 1  # one device: the sharded path has its own tests (test_parallel.py)
  config.data.data_dir = data_dir
  config.train.update(train_overrides)
  return config


def one_device_setup(train_cfg, seed=0, model="test-tiny"):
  cfg = llama.model_config(model)
  tx, schedule = optim.make_optimizer(train_cfg)
  mesh = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
  init_fn = functools.partial(llama.init_params, cfg)
  abstract, shardings = train.abstract_state(init_fn, tx, jax.random.key(seed), mesh)
  state = train.init_state(init_fn, tx, jax.random.key(seed), shardings)
  step = train.jit_train_step(llama.make_apply(cfg), tx, shardings, mesh)
  return cfg, tx, schedule, mesh, abstract, shardings, state, step


def leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


class Killed(BaseException):
  """Stands in for SIGKILL inside the process: nothing in the program may catch it."""


# ---------------------------------------------------------------------------------------------
# Losses and optimizer.


def test_cross_entropy_matches_hand_computation():
  logits = jnp.log(jnp.array([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]], jnp.float32))
  targets = jnp.array([[0, 2]])
  loss, m = losses.cross_entropy(logits, targets, jnp.array([[1.0, 1.0]]))
  np.testing.assert_allclose(loss, -(np.log(0.7) + np.log(0.8)) / 2, rtol=1e-6)
  assert float(m["accuracy"]) == 1.0
  np.testing.assert_allclose(m["perplexity"], np.exp(float(loss)), rtol=1e-6)
  # Weights: a zero-weight token does not count; wrong predictions lower accuracy.
  loss, m = losses.cross_entropy(logits, jnp.array([[1, 2]]), jnp.array([[0.0, 1.0]]))
  np.testing.assert_allclose(loss, -np.log(0.8), rtol=1e-6)
  assert float(m["weight_sum"]) == 1.0 and float(m["accuracy"]) == 1.0
  loss, m = losses.cross_entropy(logits, jnp.array([[1, 2]]), jnp.array([[1.0, 1.0]]))
  assert float(m["accuracy"]) == 0.5
  loss, _ = losses.cross_entropy(logits, targets, jnp.zeros((1, 2)))
  assert float(loss) == 0.0  # all-zero weights: no NaN


def test_a_log_window_weighs_token_means_by_the_steps_tokens():
  """Two steps of 10 and 90 response tokens at losses 1 and 3 log 2.8, not 2.0; perplexity is
  exp of that; norms and counts are plain means over the steps."""
  window = [dict(loss=1.0, alpha=0.5, perplexity=math.e, grad_norm=2.0, weight_sum=10.0),
            dict(loss=3.0, alpha=0.9, perplexity=math.e ** 3, grad_norm=4.0, weight_sum=90.0)]
  row = train.window_means(window)
  assert row["loss"] == pytest.approx(2.8) and row["alpha"] == pytest.approx(0.86)
  assert row["perplexity"] == pytest.approx(math.exp(2.8))
  assert row["grad_norm"] == 3.0 and row["weight_sum"] == 50.0
  assert train.window_means([dict(loss=1.0), dict(loss=3.0)])["loss"] == 2.0  # no counts


def test_lr_schedule_warmup_and_end():
  f = optim.lr_schedule(2.0, num_steps=10, warmup_steps=4, end_lr_frac=0.1)
  # Warmup: lr * (step + 1) / warmup, peak at the last warmup step.
  np.testing.assert_allclose([float(f(s)) for s in range(4)], [0.5, 1.0, 1.5, 2.0], rtol=1e-6)
  np.testing.assert_allclose(float(f(4)), 2.0, rtol=1e-6)  # cosine starts at the peak
  np.testing.assert_allclose(float(f(7)), 0.2 + 1.8 * 0.5, rtol=1e-6)  # halfway through decay
  np.testing.assert_allclose([float(f(10)), float(f(50))], [0.2, 0.2], rtol=1e-6)
  # Monotone decay, and the traced (jnp) path equals the host (numpy) path.
  vals = [float(f(s)) for s in range(4, 11)]
  assert all(a >= b for a, b in zip(vals, vals[1:]))
  np.testing.assert_allclose([float(jax.jit(f)(jnp.int32(s))) for s in range(12)],
                             [float(f(s)) for s in range(12)], rtol=1e-6)


def test_weight_decay_mask_only_kernels():
  cfg = llama.model_config("test-tiny", tie_embeddings=False, qkv_bias=True)
  mask = optim.decay_mask(llama.param_shapes(cfg))
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
  decayed = sorted(k for k, v in flat.items() if v)
  assert all("kernel" in k for k in decayed)
  for name in ("['lm_head']['kernel']", "['layers']['gate']['kernel']",
               "['layers']['attn']['q']['kernel']"):
    assert name in decayed
  for name in ("['embed']['embedding']", "['final_norm']['scale']",
               "['layers']['attn_norm']['scale']", "['layers']['attn']['q']['bias']"):
    assert flat[name] is False

  # Behaviour: with zero gradients Adam's step is 0, so only decay moves params.
  train_cfg = train_lm_config.get_config("smoke").train
  train_cfg.update(weight_decay=0.5, lr=0.1, warmup_steps=1)
  tx, _ = optim.make_optimizer(train_cfg)
  params = jax.jit(functools.partial(llama.init_params, cfg))(jax.random.key(0))

  @jax.jit
  def update_with_zero_grads(params):
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    return jax.tree.map(lambda p, u: p + u, params, updates)
  new = update_with_zero_grads(params)
  np.testing.assert_allclose(new["lm_head"]["kernel"], params["lm_head"]["kernel"] * (1 - 0.05),
                             rtol=1e-6)
  for path in (("embed", "embedding"), ("final_norm", "scale")):
    a, b = new, params
    for k in path:
      a, b = a[k], b[k]
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(new["layers"]["attn"]["q"]["bias"],
                                params["layers"]["attn"]["q"]["bias"])


def test_loss_decreases_on_repetitive_corpus():
  train_cfg = train_lm_config.get_config("smoke").train
  train_cfg.update(num_steps=40, warmup_steps=2, lr=1e-2)
  *_, state, step = one_device_setup(train_cfg)
  text = np.frombuffer(b"the cat sat on the mat. " * 40, np.uint8).astype(np.int32)
  rng = jax.random.key(1)
  losses_seen = []
  for s in range(40):
    start = (s * 7) % 200
    window = np.stack([text[start + 9 * b:start + 9 * b + 33] for b in range(8)])
    batch = {"inputs": window[:, :-1], "targets": window[:, 1:],
             "weights": np.ones((8, 32), np.float32)}
    state, m = step(state, batch, rng)
    losses_seen.append(float(m["loss"]))
  assert losses_seen[0] > np.log(257) - 0.5  # starts near uniform
  assert np.mean(losses_seen[-5:]) < 0.4 * losses_seen[0], losses_seen
  assert int(state.step) == 40


def test_nonfinite_update_is_caught_in_the_step_that_made_it():
  # lr = inf: step 0's loss is still finite (old params) but the update is not; param_norm
  # (after the update) must flag it in that same step.
  train_cfg = train_lm_config.get_config("smoke").train
  train_cfg.update(lr=float("inf"), grad_clip=0.0)
  *_, state, step = one_device_setup(train_cfg)
  batch = {"inputs": np.ones((8, 32), np.int32), "targets": np.ones((8, 32), np.int32),
           "weights": np.ones((8, 32), np.float32)}
  _, m = step(state, batch, jax.random.key(0))
  m = jax.device_get(m)
  assert np.isfinite(m["loss"]) and not np.isfinite(m["param_norm"])
  with pytest.raises(train.NonFiniteError, match=r"step 1\b.*param_norm.*lower train\.lr"):
    train.check_finite(1, m)


# ---------------------------------------------------------------------------------------------
# Checkpoints.


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """A workdir with checkpoints at steps 1 and 2 of a test-tiny model (no program run)."""
  workdir = str(tmp_path_factory.mktemp("ckpt"))
  train_cfg = train_lm_config.get_config("smoke").train
  cfg, tx, _, mesh, abstract, shardings, state, step = one_device_setup(train_cfg, seed=3)
  manager = checkpoints.make_manager(workdir)
  meta = checkpoints.make_meta(cfg, ByteTokenizer(), train_lm_config.get_config("smoke"))
  batch = {"inputs": np.ones((8, 32), np.int32), "targets": np.ones((8, 32), np.int32),
           "weights": np.ones((8, 32), np.float32)}
  for s in (1, 2):
    state, _ = step(state, batch, jax.random.key(0))
    checkpoints.save(manager, s, state, meta)
  manager.wait_until_finished()
  manager.close()
  return workdir, cfg, abstract, jax.device_get(state)


def test_load_model_round_trip(saved_run):
  workdir, cfg, abstract, state = saved_run
  for path in (workdir, os.path.join(workdir, "checkpoints"),
               os.path.join(workdir, "checkpoints", "2")):
    loaded_cfg, params, meta = checkpoints.load_model(path, cfg)
    assert loaded_cfg == cfg
    assert leaves_equal(params, state.params)
    assert meta["step"] == 2 and meta["tokenizer"]["fingerprint"] == "bytes-257"
    assert meta["tokenizer"]["vocab_size"] == 257 and meta["config"]["program"] == "train_lm"
  _, params1, meta1 = checkpoints.load_model(os.path.join(workdir, "checkpoints", "1"))
  assert meta1["step"] == 1 and not leaves_equal(params1, state.params)
  # restore_latest brings back the optimizer state too.
  restored, _ = checkpoints.restore_latest(workdir, abstract)
  assert int(restored.step) == 2 and leaves_equal(restored.opt_state, state.opt_state)


def test_checkpoint_missing_paths_have_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"does not exist.*train_lm workdir"):
    checkpoints.load_model(str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match=rf"No checkpoint found under {tmp_path}.*Fix"):
    checkpoints.load_model(str(tmp_path))
  assert checkpoints.restore_latest(str(tmp_path), None) is None  # fresh run: no error


def test_checkpoint_model_mismatch_is_named(saved_run):
  workdir, cfg, abstract, _ = saved_run
  other = llama.model_config("test-tiny", d_model=64)
  with pytest.raises(checkpoints.CheckpointError, match=r"d_model: checkpoint 32 vs requested 64"):
    checkpoints.load_model(workdir, other)
  with pytest.raises(checkpoints.CheckpointError, match=r"different model"):
    checkpoints.restore_latest(workdir, abstract, model_cfg=other)

  class OtherTok:
    name, vocab_size, fingerprint = "other", 300, "other-300"
    repr_fingerprint = fingerprint
  _, _, meta = checkpoints.load_model(workdir)
  with pytest.raises(checkpoints.CheckpointError, match=r"fingerprint bytes-257.*other-300"):
    checkpoints.check_tokenizer(meta, OtherTok(), workdir)


def test_a_setting_that_shapes_the_state_is_named_on_resume(saved_run):
  """A resume whose optimizer state has another structure (grad_clip 0 drops the clipping
  transform) or whose params have other shapes is refused before any array is read, naming the
  config fields that changed, not as a corrupt checkpoint whose fix is to delete it."""
  workdir, cfg, abstract, state = saved_run
  config = train_lm_config.get_config("smoke")
  config.train.grad_clip = 0.0
  clipless = one_device_setup(config.train, seed=3)[4]
  with pytest.raises(checkpoints.CheckpointError) as e:
    checkpoints.restore_latest(workdir, clipless, config=config, skip_corrupt=True)
  assert not isinstance(e.value, checkpoints.CorruptCheckpointError)
  assert re.search(r"checkpoints/2 holds optimizer state of another structure than this run "
                   r"builds \(this run builds opt_state/0/0/count \[\], which the checkpoint "
                   r"lacks\).*in: train\.grad_clip: saved 1\.0, this run 0\.0\. Fix: set back the "
                   r"one that shapes the state", str(e.value)), str(e.value)
  assert sorted(os.listdir(workdir)) == ["checkpoints"]  # nothing set aside as corrupt
  # Without a config to compare, the fix still names a fresh workdir.
  with pytest.raises(checkpoints.CheckpointError, match=r"Fix: pass a new --workdir"):
    checkpoints.restore_latest(workdir, clipless)
  # Params of other shapes, with no model config to check first.
  wide = one_device_setup(train_lm_config.get_config("smoke").train, model="test-tiny")[4]
  wide = wide.replace(params=jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype), wide.params))
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"holds model params of another structure.* is \[.*\] there and"):
    checkpoints.restore_latest(workdir, wide)
  # The same state restores as before.
  restored, _ = checkpoints.restore_latest(workdir, abstract, config=config)
  assert leaves_equal(restored.params, state.params)


def test_params_laid_out_by_another_version_are_not_called_corrupt(saved_run, monkeypatch):
  """load_model: params whose paths or shapes differ from what this version builds from the
  saved model config (a layout change between versions) are named as such, not as damage."""
  workdir = saved_run[0]
  real = llama.param_shapes

  def renamed(cfg):
    shapes = dict(real(cfg))
    shapes["renamed_" + next(iter(shapes))] = shapes.pop(next(iter(shapes)))
    return shapes
  monkeypatch.setattr(llama, "param_shapes", renamed)
  with pytest.raises(checkpoints.CheckpointError) as e:
    checkpoints.load_model(workdir)
  assert not isinstance(e.value, checkpoints.CorruptCheckpointError)
  assert re.search(r"checkpoints/2 holds params of another structure than its saved model config "
                   r"builds in this version of spec_jax \(this run builds renamed_.*written by "
                   r"another version, not damaged", str(e.value)), str(e.value)


def _truncated_copy(saved_run, workdir: str) -> str:
  """A copy of the saved run whose step 2 has every data file of its params item cut in half, as
  a full disk or an unfinished copy leaves it; returns that step's folder."""
  import shutil  # noqa: PLC0415
  shutil.copytree(saved_run[0], workdir)
  step_dir = os.path.join(workdir, "checkpoints", "2")
  files = [f for f in glob.glob(os.path.join(step_dir, "params", "**", "*"), recursive=True)
           if os.path.isfile(f) and os.sep + "d" + os.sep in f]
  assert files
  for f in files:
    with open(f, "r+b") as fh:
      fh.truncate(os.path.getsize(f) // 2)
  return step_dir


def test_corrupt_checkpoint_has_clear_error(saved_run, tmp_path):
  workdir = str(tmp_path / "copy")
  step_dir = _truncated_copy(saved_run, workdir)
  with pytest.raises(checkpoints.CheckpointError,
                     match=rf"{step_dir} could not be read.*corrupt.*Fix: delete {step_dir}"):
    checkpoints.load_model(workdir)
  with pytest.raises(checkpoints.CheckpointError, match=r"could not be read"):
    checkpoints.restore_latest(workdir, saved_run[2])
  # The meta item too (the first thing read).
  with open(os.path.join(step_dir, "meta", "metadata"), "w") as fh:
    fh.write('{"format": 1, "mod')
  with pytest.raises(checkpoints.CheckpointError, match=r"could not be read"):
    checkpoints.load_model(step_dir)
  # The previous step is untouched and still loads, as the message promises.
  checkpoints.load_model(os.path.join(workdir, "checkpoints", "1"))


def test_the_launcher_shows_a_corrupt_checkpoint_as_one_error(saved_run, tmp_path):
  """What a user of launch.py sees for a truncated checkpoint: the error and the fix, then the
  pointer to --verbose; not a traceback for each of the restore's other reads that finished on
  orbax's closed event loop ("RuntimeError: Event loop is closed", or asyncio's "Task exception
  was never retrieved"; dozens of lines, before and after the error: `integrity.reading`)."""
  step_dir = _truncated_copy(saved_run, str(tmp_path / "copy"))
  proc = subprocess.run(
      [sys.executable, "launch.py", "--config=configs/generate.py:smoke",
       f"--workdir={tmp_path / 'generate'}", f"--config.model.checkpoint={tmp_path / 'copy'}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  shown = (proc.stdout + proc.stderr).strip().splitlines()
  assert proc.returncode == 1, shown[-40:]
  assert len(shown) == 2 and shown[0].startswith(
      f"Error (CorruptCheckpointError): Checkpoint {step_dir} could not be read"), shown[-40:]
  assert f"Fix: delete {step_dir}" in shown[0] and shown[1] == "(--verbose shows the traceback)"


def test_a_runtime_failure_while_restoring_does_not_blame_the_files(saved_run, monkeypatch):
  """A device, memory or cross-process failure during orbax's restore (here a gloo all-gather
  that lost its peer, as a multi-host load once did) is not corruption: the error says the
  files were not judged damaged, with no advice to delete them, and a resuming run moves
  nothing aside. Classifying it as corrupt (the plant: every exception) fails each check."""
  import orbax.checkpoint as ocp  # noqa: PLC0415
  workdir = saved_run[0]
  real = ocp.CheckpointManager.restore

  def flaky(self, step, args=None, **kwargs):
    if args is not None and "params" in args.keys():
      raise jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Connection closed by peer")
    return real(self, step, args=args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", flaky)
  for load in (lambda: checkpoints.load_model(workdir),
               lambda: checkpoints.restore_latest(workdir, saved_run[2], skip_corrupt=True)):
    with pytest.raises(checkpoints.CheckpointError) as e:
      load()
    assert not isinstance(e.value, checkpoints.CorruptCheckpointError)
    assert "Gloo AllGather failed" in str(e.value) and "not judged damaged" in str(e.value)
    assert "delete" not in str(e.value)
  assert not os.path.exists(os.path.join(workdir, "checkpoints_corrupt"))
  monkeypatch.undo()
  checkpoints.load_model(workdir)  # the same files load


# ---------------------------------------------------------------------------------------------
# Metrics.


def read_events(workdir):
  """{tag: [(step, value)]} for scalars, plus the set of all summary tags, from tfevents files
  (TFRecord framing: u64 length, u32 crc, payload, u32 crc)."""
  from tensorboardX.proto import event_pb2
  scalars, tags = {}, set()
  for path in sorted(glob.glob(os.path.join(workdir, "events.out.tfevents.*"))):
    data = pathlib.Path(path).read_bytes()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      if event.HasField("session_log") and event.session_log.status == 1:  # START: a purge
        tags.add(f"purge@{event.step}")
      for v in event.summary.value:
        tags.add(v.tag)
        if v.HasField("simple_value"):
          scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
  return scalars, tags


def test_metrics_writer_events_and_jsonl(tmp_path):
  workdir = str(tmp_path)
  config = train_lm_config.get_config("smoke")
  with metrics_lib.MetricsWriter(workdir) as w:
    w.write_hparams(config)
    w.write_scalars(5, {"train/loss": np.float32(2.5), "train/accuracy": 0.25})
    w.write_scalars(10, {"train/loss": jnp.asarray(2.0)})
    w.write_scalars(10, {"eval/loss": 2.25})  # same step: merged into one line
    w.write_scalars(15, {"train/loss": float("nan")})
  rows = metrics_lib.read_jsonl(workdir)
  assert rows == [{"step": 5, "train/loss": 2.5, "train/accuracy": 0.25},
                  {"step": 10, "train/loss": 2.0, "eval/loss": 2.25},
                  {"step": 15, "train/loss": "nan"}]
  scalars, tags = read_events(workdir)
  assert scalars["train/loss"][:2] == [(5, 2.5), (10, 2.0)]
  assert scalars["eval/loss"] == [(10, 2.25)]
  assert "_hparams_/experiment" in tags and "_hparams_/session_start_info" in tags
  assert any(t.startswith("config") for t in tags)

  # Resume: lines after the restored step go, later writes append.
  with metrics_lib.MetricsWriter(workdir) as w:
    w.truncate_after(10)
    w.write_scalars(15, {"train/loss": 1.5})
  assert [r["step"] for r in metrics_lib.read_jsonl(workdir)] == [5, 10, 15]
  assert metrics_lib.read_jsonl(workdir)[-1]["train/loss"] == 1.5
  # TensorBoard drops the old events after step 10 too (a purge marker at step 11).
  assert "purge@11" in read_events(workdir)[1]
  # A fresh start over a run killed before its first checkpoint keeps nothing of it.
  with metrics_lib.MetricsWriter(workdir) as w:
    w.truncate_after(-1)
  assert metrics_lib.read_jsonl(workdir) == [] and "purge@0" in read_events(workdir)[1]


# ---------------------------------------------------------------------------------------------
# The train_lm program.


def test_train_lm_smoke_writes_metrics_and_finishes_fast_when_done(data_dir, tmp_path):
  workdir = str(tmp_path)
  config = smoke_config(data_dir, num_steps=10, eval_every=5, checkpoint_every=5, log_every=5)
  out = train_lm.run(config, workdir)
  assert out["step"] == 10 and np.isfinite(out["train_loss"]) and np.isfinite(out["eval_loss"])
  assert out["train_loss"] < np.log(257)
  rows = metrics_lib.read_jsonl(workdir)
  assert [r["step"] for r in rows] == [5, 10]
  for key in ("train/loss", "train/accuracy", "train/perplexity", "train/grad_norm",
              "train/param_norm", "train/lr", "eval/loss", "eval/accuracy", "eval/perplexity"):
    assert key in rows[-1], key
  scalars, tags = read_events(workdir)
  assert [s for s, _ in scalars["train/loss"]] == [5, 10]
  assert "_hparams_/experiment" in tags
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "5"]
  cfg, params, meta = checkpoints.load_model(workdir)
  assert cfg == llama.model_config("test-tiny", vocab_size=257)
  assert meta["config"]["train"]["num_steps"] == 10

  # Running the finished workdir again trains nothing and reports the same numbers.
  def no_steps(step):
    raise AssertionError(f"a finished run dispatched step {step}")
  again = train_lm.run(config, workdir, step_hook=no_steps)
  assert again["step"] == 10 and again["eval_loss"] == pytest.approx(out["eval_loss"])
  assert again["train_loss"] == pytest.approx(out["train_loss"])
  # The same finished workdir under another learning rate is read back as trained, with a
  # warning naming the setting (a run that reads it would otherwise not know).
  relr = smoke_config(data_dir, num_steps=10, eval_every=5, checkpoint_every=5, log_every=5,
                      lr=0.5)
  warned = []
  with mock.patch.object(checkpoints.logging, "warning",
                         lambda msg, *args: warned.append(msg % args)):
    train_lm.run(relr, workdir, step_hook=no_steps)
  warned = [w for w in warned if "another config" in w]
  assert len(warned) == 1 and re.search(r"trained with another config \(train\.lr: saved",
                                        warned[0]), warned

  # A resume with a setting that shapes the optimizer state is refused naming it, losing nothing.
  clipless = smoke_config(data_dir, num_steps=10, eval_every=5, checkpoint_every=5, log_every=5,
                          grad_clip=0.0)
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"another structure.*train\.grad_clip: saved 1\.0, this run 0\.0"):
    train_lm.run(clipless, workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "5"]

  # model.checkpoint: a new run starts from these params (its saved config wins over
  # model.size). lr = 0 keeps them exactly, so the new checkpoint must equal the loaded one.
  tuned = smoke_config(data_dir, num_steps=1, lr=0.0, eval_every=0)
  tuned.model.update(checkpoint=workdir, size="drafter-m")
  train_lm.run(tuned, str(tmp_path / "tuned"))
  tuned_cfg, tuned_params, _ = checkpoints.load_model(str(tmp_path / "tuned"))
  assert tuned_cfg == cfg and leaves_equal(tuned_params, params)


def test_resume_after_kill_matches_uninterrupted_run(data_dir, tmp_path):
  """The issue's requirement: a run killed mid-way and resumed ends bit-identical to a run that
  was never interrupted (same batches by step index, rng folded by step, restored optimizer)."""
  # log_every=1: the killed run has logged steps 5 and 6 past its checkpoint at 4, which the
  # resumed run must replace rather than duplicate in metrics.jsonl.
  config = smoke_config(data_dir, num_steps=12, checkpoint_every=4, eval_every=0, log_every=1)
  full_dir, cut_dir = str(tmp_path / "full"), str(tmp_path / "cut")
  train_lm.run(config, full_dir)

  def kill_at_7(step):
    if step == 7:
      raise Killed()
  with pytest.raises(Killed):
    train_lm.run(config, cut_dir, step_hook=kill_at_7)
  assert sorted(os.listdir(os.path.join(cut_dir, "checkpoints"))) == ["4"]  # 7 > 4, < 8
  assert max(r["step"] for r in metrics_lib.read_jsonl(cut_dir)) > 4

  resumed_steps = []
  out = train_lm.run(config, cut_dir, step_hook=resumed_steps.append)
  assert resumed_steps == list(range(5, 13))  # resumed from step 4, not from 0
  assert out["step"] == 12
  _, full, _ = checkpoints.load_model(full_dir)
  _, cut, _ = checkpoints.load_model(cut_dir)
  assert leaves_equal(full, cut)
  # The optimizer state too, and the metrics log has each step once, equal to the full run's.
  assert leaves_equal(*(checkpoints.restore_latest(d, _abstract(config))[0].opt_state
                        for d in (full_dir, cut_dir)))
  assert metrics_lib.read_jsonl(cut_dir) == metrics_lib.read_jsonl(full_dir)


def _abstract(config):
  cfg = llama.model_config(config.model.size, vocab_size=257)
  tx, _ = optim.make_optimizer(config.train)
  mesh = parallel.make_mesh(config.mesh)
  rng = jax.random.split(jax.random.key(config.seed))[0]
  return train.abstract_state(functools.partial(llama.init_params, cfg), tx, rng, mesh)[0]


def test_resume_after_sigkill_in_a_subprocess(data_dir, tmp_path):
  """A real SIGKILL (no finally blocks, an async checkpoint possibly mid-write), then resume."""
  workdir = str(tmp_path / "run")
  script = textwrap.dedent(f"""
      import os, signal, sys
      os.environ["JAX_PLATFORMS"] = "cpu"
      import jax
      from configs import train_lm as c
      from spec_jax.programs import train_lm
      config = c.get_config("smoke")
      config.mesh.data = 1
      config.data.data_dir = {data_dir!r}
      config.train.update(num_steps=12, checkpoint_every=4, eval_every=0, log_every=2)
      kill_at = int(sys.argv[1])
      def hook(step):
        if step == kill_at:
          os.kill(os.getpid(), signal.SIGKILL)
      train_lm.run(config, {workdir!r}, step_hook=hook)
  """)
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  proc = subprocess.run([sys.executable, "-c", script, "9"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  # The async save of step 8 may or may not have finished when the kill came; an unfinished one
  # is left as a temporary folder that must be ignored (and cleaned up) on resume.
  left = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  assert left in (["4", "8"], ["4", "8.orbax-checkpoint-tmp"]), left
  config = smoke_config(data_dir, num_steps=12, checkpoint_every=4, eval_every=0, log_every=2)
  resumed = []
  train_lm.run(config, workdir, step_hook=resumed.append)
  assert resumed[0] == (9 if "8" in left else 5)
  assert not [d for d in os.listdir(os.path.join(workdir, "checkpoints")) if "tmp" in d]
  ref_dir = str(tmp_path / "ref")
  train_lm.run(config, ref_dir)
  assert leaves_equal(checkpoints.load_model(workdir)[1], checkpoints.load_model(ref_dir)[1])


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ctrl_c_in_a_subprocess_saves_a_checkpoint_to_resume_from(data_dir, tmp_path, stop):
  """A real SIGINT (what Ctrl-C sends) or SIGTERM (`kill`) mid-run, checkpoints otherwise only at
  the end: the process stops with the step it reached saved, exits with 128 + the signal's
  number and one line naming the step, and the rerun resumes there. SIGINT starts ignored, as in
  a background job (`cmd &`); the training loop's handlers must still catch it."""
  workdir = str(tmp_path / "run")
  script = textwrap.dedent(f"""
      import os, signal
      signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a background job inherits
      os.environ["JAX_PLATFORMS"] = "cpu"
      from configs import train_lm as c
      from spec_jax import cli
      from spec_jax.programs import train_lm
      cli.interrupt_on_stop_signals()  # what launch.py installs
      config = c.get_config("smoke")
      config.mesh.data = 1
      config.data.data_dir = {data_dir!r}
      config.train.update(num_steps=12, checkpoint_every=100, eval_every=0, log_every=2)
      def hook(step):
        if step == 6:
          os.kill(os.getpid(), signal.{stop})
      train_lm.run(config, {workdir!r}, step_hook=hook)
  """)
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  signum = getattr(signal, stop)
  assert proc.returncode == 128 + signum, proc.stderr[-3000:]
  assert f"{stop}: stopped after step 6 of 12 and checkpointed it" in proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["6"]
  resumed = []
  config = smoke_config(data_dir, num_steps=8, checkpoint_every=100, eval_every=0, log_every=2)
  train_lm.run(config, workdir, step_hook=resumed.append)
  assert resumed == [7, 8]


def test_nan_guard_raises_and_keeps_last_good_checkpoint(data_dir, tmp_path, monkeypatch):
  real = pipeline.lm_batches

  class Poisoned:
    """The real train batches, with NaN weights at step index 5 (the update to step 6)."""

    def __init__(self, ds):
      self.ds = ds

    def __len__(self):
      return len(self.ds)

    def __getitem__(self, s):
      batch = dict(self.ds[s])
      if s == 5:
        batch["weights"] = np.full_like(batch["weights"], np.nan)
      return batch

  def lm_batches(name, split, *args, **kwargs):
    ds = real(name, split, *args, **kwargs)
    return Poisoned(ds) if split == "train" else ds

  monkeypatch.setattr(pipeline, "lm_batches", lm_batches)
  workdir = str(tmp_path)
  # checkpoint_every=2: step 6, the bad one, is itself a checkpoint step.
  config = smoke_config(data_dir, num_steps=10, checkpoint_every=2, eval_every=0, log_every=1)
  with pytest.raises(train.NonFiniteError, match=r"diverged at step 6: non-finite .*loss=nan.*"
                     r"lower train\.lr.*check the data"):
    train_lm.run(config, workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
  cfg, params, meta = checkpoints.load_model(workdir)
  assert meta["step"] == 4
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))


def test_ctrl_c_saves_the_newest_state_then_stops():
  """A KeyboardInterrupt raised inside the loop (signals set a flag instead, tests/
  test_preemption.py; this is the path where no handler could be installed, off the main thread):
  the newest finished state is checked and saved, then the interrupt goes on; before any step
  finished nothing is saved."""
  tx = optax.sgd(0.1)
  params = {"w": jnp.zeros(())}
  state0 = train.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                            opt_state=tx.init(params))

  def step_fn(state, batch, rng):
    del batch, rng
    return state.replace(step=state.step + 1), {"loss": jnp.float32(1.0)}

  sharding = parallel.batch_sharding(parallel.make_mesh(configs_common.mesh(data=1)))

  def run(interrupt_at):
    saved = []

    def get_batch(s):  # Ctrl-C while the host fetches batch `interrupt_at`
      if s == interrupt_at:
        raise KeyboardInterrupt
      return {"x": np.zeros((8,), np.float32)}

    with pytest.raises(KeyboardInterrupt):
      train.train_loop(state=state0, step_fn=step_fn, get_batch=get_batch, num_steps=10,
                       rng=jax.random.key(0), batch_sharding=sharding, log_every=0,
                       checkpoint_every=100, save_fn=lambda s, st: saved.append(
                           (s, int(st.step))), show_progress=False)
    return saved

  assert run(3) == [(3, 3)]
  assert run(0) == []  # interrupted before the first step finished: nothing to save
