"""Mesh, shardings and sharded training on the 8 fake CPU devices of conftest.py.

A module-wide persistent compilation cache lets tests that build the same mesh share compiled
steps (the sharded train step is the slow compile here).
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import train_lm as train_lm_config
from spec_jax import parallel
from spec_jax.models import decoder, llama, presets
from spec_jax.training import optim, train


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  old = {k: getattr(jax.config, k) for k in keys}
  jax.config.update(keys[0], str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update(keys[1], 0)
  jax.config.update(keys[2], 0)
  yield
  for k, v in old.items():
    jax.config.update(k, v)


def test_fake_devices_present():
  assert jax.device_count() == 8, "conftest.py should force 8 CPU devices"


@pytest.mark.parametrize("spec, shape", [
    (dict(data=-1, fsdp=1, tensor=1), (8, 1, 1)),
    (dict(data=-1, fsdp=2, tensor=1), (4, 2, 1)),
    (dict(data=2, fsdp=-1, tensor=2), (2, 2, 2)),
    (dict(data=4, fsdp=2, tensor=1), (4, 2, 1)),
    (dict(data=1, fsdp=1, tensor=1), (1, 1, 1)),  # divides 8: uses the first device
])
def test_make_mesh_shapes(spec, shape):
  mesh = parallel.make_mesh(spec)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert tuple(mesh.shape[a] for a in mesh.axis_names) == shape
  assert mesh.devices.size == np.prod(shape)


def test_make_mesh_errors():
  with pytest.raises(ValueError, match=r"needs a multiple of 3 devices but there are 8.*Fix"):
    parallel.make_mesh(dict(data=3, fsdp=1, tensor=1))
  with pytest.raises(ValueError, match=r"needs a multiple of 16 devices"):
    parallel.make_mesh(dict(data=-1, fsdp=4, tensor=4))
  with pytest.raises(ValueError, match=r"at most one axis may be -1"):
    parallel.make_mesh(dict(data=-1, fsdp=-1, tensor=1))
  with pytest.raises(ValueError, match=r">= 1 or -1"):
    parallel.make_mesh(dict(data=0, fsdp=1, tensor=1))


def test_param_sharding_rule():
  rule = parallel.param_sharding_rule
  assert rule((257, 32), 2, 1) == P(None, "fsdp")  # 257 is odd: the next largest dim
  assert rule((256, 32), 2, 1) == P("fsdp", None)
  assert rule((32,), 2, 1) == P("fsdp")
  assert rule((3,), 2, 1) == P(None)
  assert rule((), 2, 1) == P()
  assert rule((256, 32), 1, 1) == P(None, None)
  # Scanned layer axis (leading) is never sharded, even when it is the largest.
  assert rule((64, 32, 4, 8), 2, 1, skip_leading=True) == P(None, "fsdp", None, None)
  # Tensor takes the largest remaining divisible dim, kernels only.
  assert rule((4, 32, 64), 2, 2, skip_leading=True) == P(None, "tensor", "fsdp")
  assert rule((32,), 2, 2) == P("fsdp")
  assert rule((6, 4), 4, 3) == P("tensor", "fsdp")


def test_param_shardings_of_model_are_valid():
  mesh = parallel.make_mesh(dict(data=2, fsdp=2, tensor=2))
  shapes = llama.param_shapes(llama.model_config("test-tiny"))
  shardings = parallel.param_shardings(mesh, shapes)
  flat = dict(jax.tree_util.tree_leaves_with_path(shardings))
  for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
    spec = flat[path].spec
    if "layers" in jax.tree_util.keystr(path):
      assert spec[0] is None
    for dim, axis in zip(leaf.shape, spec):
      if axis is not None:
        assert dim % mesh.shape[axis] == 0
  assert shardings["embed"]["embedding"].spec == P(None, "fsdp")  # [257, 32]: 257 is odd
  assert shardings["layers"]["attn"]["q"]["kernel"].spec == P(None, "fsdp", None, "tensor")
  assert shardings["layers"]["gate"]["kernel"].spec == P(None, "tensor", "fsdp")  # [L, 32, 64]
  assert shardings["final_norm"]["scale"].spec == P("fsdp")


def test_decode_param_rule_keeps_each_product_on_its_own_shards():
  """Decoding's placement (`parallel.decode_param_rule`) on the 70B shapes over fsdp 2 × tensor
  4: the model width over 'fsdp', heads / feed-forward over 'tensor', the vocabulary over both;
  vectors whole; a dim that does not divide stays whole; other params follow the training rule;
  the unrolled layout's per-layer params as the stacked ones."""
  cfg = presets.config("llama3.1-70b", dtype="bfloat16")
  mesh = parallel.make_mesh(dict(data=1, fsdp=2, tensor=4))
  specs = jax.tree.map(lambda s: s.spec, parallel.decode_param_shardings(
      mesh, decoder.param_shapes(cfg)))
  layers = specs["layers"]
  assert layers["attn"]["q"]["kernel"] == P(None, "fsdp", "tensor", None)   # [L, D, N, H]
  assert layers["attn"]["k"]["kernel"] == P(None, "fsdp", "tensor", None)   # [L, D, K, H]
  assert layers["attn"]["o"]["kernel"] == P(None, "tensor", None, "fsdp")   # [L, N, H, D]
  assert layers["gate"]["kernel"] == P(None, "fsdp", "tensor")              # [L, D, F]
  assert layers["down"]["kernel"] == P(None, "tensor", "fsdp")              # [L, F, D]
  assert layers["attn_norm"]["scale"] == P() and specs["final_norm"]["scale"] == P()
  assert specs["embed"]["embedding"] == P(("fsdp", "tensor"), None)         # [V, D]
  assert specs["lm_head"]["kernel"] == P(None, ("fsdp", "tensor"))          # [D, V]
  rule = parallel.decode_param_rule
  assert rule(["layers", "attn", "k", "kernel"], (16, 64, 1, 8), 2, 4) == P(None, "fsdp", None,
                                                                            None)  # K = 1
  assert rule(["embed", "embedding"], (2 * 257, 64), 2, 4) == P("fsdp", None)  # 514 = 2 · 257
  assert rule(["layers_3", "gate_up", "kernel"], (64, 2, 96), 2, 4) == P("fsdp", None, "tensor")
  assert rule(["layers", "attn", "qkv", "bias"], (16, 12, 8), 2, 4) == P(None, "tensor", None)
  assert rule(["heads", "proj", "kernel"], (64, 32), 2, 4) == parallel.param_sharding_rule(
      (64, 32), 2, 4)
  assert rule(["heads", "proj", "bias"], (32,), 2, 4) == P()


def _batches(n, b=8, t=16, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    x = rng.integers(0, 257, size=(b, t + 1), dtype=np.int32)
    out.append({"inputs": x[:, :-1], "targets": x[:, 1:], "weights": np.ones((b, t), np.float32)})
  return out


def _setup(mesh_spec):
  train_cfg = train_lm_config.get_config("smoke").train
  cfg = llama.model_config("test-tiny")
  tx, _ = optim.make_optimizer(train_cfg)
  mesh = parallel.make_mesh(mesh_spec)
  init_fn = functools.partial(llama.init_params, cfg)
  _, shardings = train.abstract_state(init_fn, tx, jax.random.key(0), mesh)
  state = train.init_state(init_fn, tx, jax.random.key(0), shardings)
  step = train.jit_train_step(llama.make_apply(cfg), tx, shardings, mesh)
  return mesh, shardings, state, step


def _run(mesh_spec, batches):
  mesh, _, state, step = _setup(mesh_spec)
  losses = []
  for b in batches:
    state, m = step(state, parallel.shard_batch(b, parallel.batch_sharding(mesh)),
                    jax.random.key(1))
    losses.append(float(m["loss"]))  # blocks each step (docs/design.md §5 trap)
  return losses, jax.device_get(state.params), state


@pytest.fixture(scope="module")
def one_device_run():
  return _run(dict(data=1, fsdp=1, tensor=1), _batches(3))


@pytest.mark.parametrize("mesh_spec", [dict(data=4, fsdp=2, tensor=1),
                                       dict(data=2, fsdp=2, tensor=2)])
def test_sharded_train_step_matches_one_device(mesh_spec, one_device_run):
  results = {"one": one_device_run, "mesh": _run(mesh_spec, _batches(3))}
  np.testing.assert_allclose(results["mesh"][0], results["one"][0], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
               results["mesh"][1], results["one"][1])
  # The state really is sharded: the embedding table [257, 32] splits its width over fsdp.
  emb = results["mesh"][2].params["embed"]["embedding"]
  assert "fsdp" in emb.sharding.spec
  assert emb.addressable_shards[0].data.shape[1] < 32
  mu = results["mesh"][2].opt_state  # Adam moments follow their params' shardings
  assert any("fsdp" in getattr(x.sharding, "spec", ()) for x in jax.tree.leaves(mu) if x.ndim)


def test_train_loop_many_sharded_steps_does_not_hang():
  """> 40 steps of cross-device collectives through the host loop (docs/design.md §5 trap)."""
  mesh, _, state, step = _setup(dict(data=4, fsdp=2, tensor=1))
  batches = _batches(4, seed=1)
  state, last, _ = train.train_loop(
      state=state, step_fn=step, get_batch=lambda s: batches[s % 4], num_steps=48,
      rng=jax.random.key(0), batch_sharding=parallel.batch_sharding(mesh), log_every=8,
      show_progress=False)
  assert int(state.step) == 48 and np.isfinite(last["loss"])


def test_shard_batch_rejects_indivisible_batch():
  mesh = parallel.make_mesh(dict(data=4, fsdp=2, tensor=1))
  with pytest.raises(ValueError, match=r"Batch size 6 does not divide .* data\*fsdp = 8"):
    parallel.shard_batch({"inputs": np.zeros((6, 4), np.int32)}, parallel.batch_sharding(mesh))
  out = parallel.shard_batch({"inputs": np.arange(32).reshape(8, 4)}, parallel.batch_sharding(mesh))
  assert out["inputs"].sharding.spec == P(("data", "fsdp"))
  np.testing.assert_array_equal(out["inputs"], np.arange(32).reshape(8, 4))


def test_maybe_initialize_distributed(monkeypatch):
  import ml_collections
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append(1))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  config = ml_collections.ConfigDict({"program": "x"})
  assert parallel.maybe_initialize_distributed(config) is False and not calls
  config.distributed = True
  assert parallel.maybe_initialize_distributed(config) is True and calls == [1]
