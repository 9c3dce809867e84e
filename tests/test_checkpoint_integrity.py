"""Checkpoint integrity: every checkpoint records digests of its arrays and meta; a corrupt one
is named (path, step, array), refused by the loaders evaluation and generation use, and skipped
by a training run, which resumes from the newest intact checkpoint and warns."""

import functools
import json
import logging
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from configs import common
from configs import train_lm as train_lm_config
from spec_jax import loading, parallel
from spec_jax.data.tokenizer import ByteTokenizer
from spec_jax.models import llama
from spec_jax.programs import train_lm
from spec_jax.training import checkpoints, integrity, optim, train

STEPS = 10  # checkpoints at 5 and 10


def leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                    for x, y in zip(la, lb))


def smoke_config(data_dir, **train_overrides):
  config = train_lm_config.get_config("smoke")
  config.mesh.data = 1
  config.data.data_dir = data_dir
  config.train.update(num_steps=STEPS, checkpoint_every=5, eval_every=0, log_every=1)
  config.train.update(train_overrides)
  return config


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
  """(config, workdir) of a train_lm:smoke run of 10 steps, checkpointed at 5 and 10; tests
  corrupt copies of it."""
  config = smoke_config(data_dir)
  workdir = str(tmp_path_factory.mktemp("trained"))
  train_lm.run(config, workdir)
  return config, workdir


def _copy(trained, tmp_path, name: str = "run") -> str:
  workdir = str(tmp_path / name)
  shutil.copytree(trained[1], workdir)
  return workdir


def _flip_a_byte(step_dir: str) -> None:
  """Flip the middle byte of the params item's largest data file (array values, not headers)."""
  files = [p for p in pathlib.Path(step_dir, "params").rglob("*")
           if p.is_file() and p.parent.name == "d"]
  path = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


def _edit_meta(step_dir: str, edit) -> None:
  path = os.path.join(step_dir, "meta", "metadata")
  with open(path, encoding="utf-8") as f:
    meta = json.load(f)
  edit(meta)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(meta, f)


def _abstract(config):
  cfg = llama.model_config(config.model.size, vocab_size=257)
  tx, _ = optim.make_optimizer(config.train)
  mesh = parallel.make_mesh(config.mesh)
  rng = jax.random.split(jax.random.key(config.seed))[0]
  return train.abstract_state(functools.partial(llama.init_params, cfg), tx, rng, mesh)[0]


def test_a_digest_changes_with_any_element_and_not_with_the_sharding():
  x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) / 7
  tree = {"x": x, "bf16": x.astype(jnp.bfloat16), "i8": jnp.arange(5, dtype=jnp.int8),
          "flag": jnp.array([True, False]), "step": jnp.int32(3)}
  base = integrity.array_digests({"params": tree})
  assert sorted(base) == ["params['bf16']", "params['flag']", "params['i8']", "params['step']",
                          "params['x']"]
  assert base["params['x']"].startswith("float32[16,8]:")
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  sharded = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
  assert integrity.array_digests({"params": {"x": sharded}})["params['x']"] == base["params['x']"]
  # One flipped bit anywhere (a position-dependent, odd weight: always seen), or two elements
  # swapped, change the digest.
  for index, bit in (((0, 0), 1), ((9, 5), 1 << 7), ((15, 7), 1 << 31)):
    y = np.asarray(x).copy()
    y.view(np.uint32)[index] ^= bit
    assert integrity.array_digests({"params": {"x": y}})["params['x']"] != base["params['x']"]
  swapped = np.asarray(x).copy()
  swapped[[0, 1]] = swapped[[1, 0]]
  assert integrity.array_digests({"params": {"x": swapped}})["params['x']"] != base["params['x']"]


def test_a_flipped_byte_is_refused_by_loading_and_skipped_by_training(trained, tmp_path, caplog):
  """One byte flipped in the newest checkpoint's array data: the loaders that evaluation and
  generation use refuse it with one line naming the path and the fix; a training run resumes
  from the previous checkpoint, warns naming the corrupt one and moves it aside, and ends with
  the params the untouched checkpoint held."""
  config, _ = trained
  workdir = _copy(trained, tmp_path)
  step_dir = os.path.join(workdir, "checkpoints", str(STEPS))
  _, saved, _ = checkpoints.load_model(workdir)
  _flip_a_byte(step_dir)

  with pytest.raises(checkpoints.CorruptCheckpointError) as e:
    checkpoints.load_model(workdir)
  assert (e.value.path, e.value.step) == (step_dir, STEPS)
  assert e.value.what.startswith("params"), str(e.value)
  for load in (lambda: loading.resolve_model(common.model(checkpoint=workdir), ByteTokenizer(),
                                             field="drafter.checkpoint"),
               lambda: checkpoints.load_model(step_dir)):
    with pytest.raises(checkpoints.CheckpointError) as e:
      load()
    message = str(e.value)
    assert "\n" not in message and f"Checkpoint {step_dir} " in message
    assert f"Fix: delete {step_dir} so that the previous checkpoint " in message, message

  resumed = []
  with caplog.at_level(logging.WARNING):
    train_lm.run(config, workdir, step_hook=resumed.append)
  assert resumed == list(range(6, STEPS + 1))  # from the intact checkpoint at 5
  warnings = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
  assert len(warnings) == 1, warnings
  assert warnings[0].startswith(f"Checkpoint {step_dir} (step {STEPS}) is corrupt: array params")
  assert "Resuming from step 5" in warnings[0]
  assert os.listdir(os.path.join(workdir, "checkpoints_corrupt")) == [str(STEPS)]
  _, again, meta = checkpoints.load_model(workdir)  # the rewritten step 10, verified
  assert meta["step"] == STEPS and leaves_equal(again, saved)


def _zero_digest(name):
  def edit(meta):
    arrays = meta["integrity"]["arrays"]
    arrays[name] = arrays[name].split(":")[0] + ":" + "0" * 16  # same dtype and shape
  return edit


def test_the_faulty_array_or_meta_is_named_and_old_checkpoints_load_unverified(trained,
                                                                               tmp_path):
  config, _ = trained
  step = lambda workdir: os.path.join(workdir, "checkpoints", str(STEPS))  # noqa: E731
  restore = lambda workdir: checkpoints.restore_latest(workdir, _abstract(config))  # noqa: E731
  # A params array whose recorded digest differs.
  workdir = _copy(trained, tmp_path, "params")
  _edit_meta(step(workdir), _zero_digest("params['embed']['embedding']"))
  with pytest.raises(checkpoints.CorruptCheckpointError,
                     match=rf"step {STEPS}\): array params\['embed'\]\['embedding'\] differs "
                           r"from what was saved \(saved digest 0{16}, found [0-9a-f]{16}\)"):
    checkpoints.load_model(workdir)
  # Training verifies the optimizer state as well; an array with no digest is refused too.
  workdir = _copy(trained, tmp_path, "opt_state")
  with open(os.path.join(step(workdir), "meta", "metadata"), encoding="utf-8") as f:
    recorded = json.load(f)["integrity"]["arrays"]
  mu = next(k for k in recorded if k.startswith("train['opt_state']") and ".mu[" in k)
  _edit_meta(step(workdir), _zero_digest(mu))
  with pytest.raises(checkpoints.CorruptCheckpointError, match=rf"array {re.escape(mu)} differs"):
    restore(workdir)
  _edit_meta(step(workdir), lambda meta: meta["integrity"]["arrays"].pop(mu))
  with pytest.raises(checkpoints.CorruptCheckpointError, match="no digest was recorded for it"):
    restore(workdir)
  # The meta's own record (model, tokenizer, the run's config) is covered.
  workdir = _copy(trained, tmp_path, "meta")
  _edit_meta(step(workdir), lambda meta: meta["config"]["train"].update(lr=1.0))
  for load in (checkpoints.read_meta, checkpoints.load_model):
    with pytest.raises(checkpoints.CorruptCheckpointError,
                       match=rf"corrupt \(step {STEPS}\): meta differs from what was saved"):
      load(workdir)
  # A checkpoint written before digests existed loads, unverified.
  _edit_meta(step(workdir), lambda meta: meta.pop("integrity"))
  _, _, meta = checkpoints.load_model(workdir)
  assert "integrity" not in meta and meta["config"]["train"]["lr"] == 1.0
  assert int(restore(workdir)[0].step) == STEPS


def test_when_every_checkpoint_is_corrupt_nothing_is_moved_and_the_newest_is_named(trained,
                                                                                   tmp_path):
  config, _ = trained
  workdir = _copy(trained, tmp_path)
  for step in (5, STEPS):
    _flip_a_byte(os.path.join(workdir, "checkpoints", str(step)))
  with pytest.raises(checkpoints.CorruptCheckpointError) as e:
    checkpoints.restore_latest(workdir, _abstract(config), skip_corrupt=True)
  assert e.value.step == STEPS
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "5"]
  assert not os.path.exists(os.path.join(workdir, "checkpoints_corrupt"))
