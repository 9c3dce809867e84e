"""Llama forward contract: cache, slots, masks, hidden states, variants."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from spec_jax import loading, parallel, testing
from spec_jax.data.tokenizer import ByteTokenizer
from spec_jax.models import draft_init, gemma, layers, llama


def _full(cfg, params, tokens):
  """The logits (numpy) of one cacheless forward over tokens int[B, T]."""
  pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  return np.asarray(testing.jitted_apply(cfg)(params, tokens, pos)[0])


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_embeddings": False,
                                           "n_kv_heads": 1, "rope_theta": 1e6}])
def test_incremental_decode_matches_full_forward(overrides):
  cfg, params = testing.tiny_model(seed=1, **overrides)
  if overrides.get("qkv_bias"):  # random biases so the bias path matters
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 if "bias" in jax.tree_util.keystr(p) else x, params)
  tokens = jax.random.randint(jax.random.key(2), (3, 12), 0, cfg.vocab_size)
  full = _full(cfg, params, tokens)
  apply = jax.jit(llama.make_apply(cfg))
  cache = llama.init_cache(cfg, 3, 16)
  pos = jnp.broadcast_to(jnp.arange(12), (3, 12))
  out, _, cache = apply(params, tokens[:, :5], pos[:, :5], cache)
  chunks = [out]
  for t in range(5, 12, 2):  # two tokens at a time, like a short verification call
    out, _, cache = apply(params, tokens[:, t:t + 2], pos[:, t:t + 2], cache)
    chunks.append(out)
  np.testing.assert_allclose(jnp.concatenate(chunks, 1), full, atol=2e-5)


@pytest.mark.parametrize("t", [1, 3])
def test_small_cache_products_equal_the_library_products(t, monkeypatch, fresh_programs):
  """A call over a small cache attends to it on a GPU with broadcast products reduced in place
  (`layers.SMALL_CACHE_BYTES`, here made a CPU's choice too), elsewhere with einsum's matrix
  products: the same logits and new K/V, and each program really takes its path."""
  cfg, params = testing.tiny_model(seed=5)
  rng = np.random.default_rng(5)
  cache = llama.init_cache(cfg, 2, 16)
  cache = layers.KVCache(k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
                         v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32), pos=None)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, t)), jnp.int32)
  pos = jnp.broadcast_to(10 + jnp.arange(t), (2, t))
  mask = jnp.broadcast_to(jnp.arange(16)[None, None] < 10 + jnp.arange(t)[None, :, None] + 1,
                          (2, t, 16))
  outs, programs = [], []
  for platforms in (("cpu",), ()):  # reduced in place on this CPU, then matrix products
    monkeypatch.setattr(layers, "SMALL_CACHE_PLATFORMS", platforms)
    jax.clear_caches()  # the forward's trace is reused across programs of the same shapes
    apply = jax.jit(llama.make_apply(cfg))
    programs.append(apply.lower(params, tokens, pos, cache, mask).as_text())
    outs.append(apply(params, tokens, pos, cache, mask))
  assert programs[0].count("dot_general") < programs[1].count("dot_general")
  np.testing.assert_allclose(outs[0][0], outs[1][0], atol=2e-5)
  np.testing.assert_allclose(outs[0][2].k, outs[1][2].k, atol=1e-6)


def test_stale_slots_are_masked_and_overwritten():
  """Rejected drafts leave K/V behind; the causal mask hides them until they are overwritten."""
  cfg, params = testing.tiny_model(seed=3)
  apply = jax.jit(llama.make_apply(cfg))
  tokens = jnp.array([[5, 6, 7, 8, 9, 10]])
  pos = jnp.arange(6)[None]
  cache = llama.init_cache(cfg, 1, 8)
  _, _, cache = apply(params, tokens, pos, cache)      # writes slots 0..5
  other = jnp.array([[100, 101]])                      # "accepted" tokens differ from slots 3..4
  logits, _, _ = apply(params, other, pos[:, 3:5], cache)
  want = _full(cfg, params, jnp.array([[5, 6, 7, 100, 101]]))[:, 3:5]
  np.testing.assert_allclose(logits, want, atol=2e-5)


def test_custom_slots_and_tree_mask():
  """Two sibling branches written to scratch slots, each seeing the prefix and its own node."""
  cfg, params = testing.tiny_model(seed=4)
  apply = jax.jit(llama.make_apply(cfg))
  prefix = np.asarray([[3, 4, 5]], np.int32)
  cache = llama.init_cache(cfg, 1, 12)
  _, _, cache = apply(params, prefix, np.arange(3, dtype=np.int32)[None], cache)
  siblings = np.asarray([[20, 30]], np.int32)
  slots = np.asarray([[8, 9]], np.int32)               # scratch region past the sequence
  positions = np.asarray([[3, 3]], np.int32)           # same depth
  mask = np.zeros((1, 2, 12), bool)
  mask[:, :, :3] = True
  mask[0, 0, 8] = mask[0, 1, 9] = True
  logits, _, _ = apply(params, siblings, positions, cache, mask, slots)
  for i, tok in enumerate([20, 30]):
    want = _full(cfg, params, np.asarray([[3, 4, 5, tok]], np.int32))[0, -1]
    np.testing.assert_allclose(logits[0, i], want, atol=2e-5)


def test_out_of_range_slots_drop_writes():
  cfg, params = testing.tiny_model(seed=5)
  cache = llama.init_cache(cfg, 1, 4)
  slots = np.asarray([[4]], np.int32)  # one past the cache's 4 slots
  _, _, cache2 = jax.jit(llama.make_apply(cfg))(params, np.asarray([[1]], np.int32),
                                                np.asarray([[0]], np.int32), cache, None, slots)
  assert not np.any(np.asarray(cache2.k))


def test_hidden_layers():
  cfg, params = testing.tiny_model(seed=6)
  tokens = np.asarray([[1, 2, 3]], np.int32)
  pos = np.arange(3, dtype=np.int32)[None]
  _, hidden, _ = jax.jit(llama.make_apply(cfg, hidden_layers=(0, 1, -1)))(params, tokens, pos)
  np.testing.assert_allclose(hidden[0], np.asarray(params["embed"]["embedding"])[tokens],
                             atol=1e-6)
  assert hidden[-1].shape == (1, 3, cfg.d_model)
  assert not np.allclose(hidden[1], hidden[0]) and not np.allclose(hidden[-1], hidden[1])
  with pytest.raises(ValueError, match="hidden layer 5"):  # at trace time, before any compile
    jax.jit(llama.make_apply(cfg, hidden_layers=(5,)))(params, tokens, pos)


def test_variants_and_param_count():
  cfg = llama.model_config("smollm2-135m")
  assert 134e6 < cfg.num_params < 135e6  # SmolLM2-135M: 134.5M parameters
  small = llama.model_config("drafter-s", vocab_size=1000)
  shapes = llama.param_shapes(small)
  assert sum(x.size for x in jax.tree.leaves(shapes)) == small.num_params
  with pytest.raises(ValueError, match="Unknown model size 'huge'.*drafter-s"):
    llama.model_config("huge")
  with pytest.raises(ValueError, match="multiple of n_kv_heads"):
    llama.model_config("test-tiny", n_kv_heads=3)



@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_decode_unrolled_is_the_scanned_model_without_a_layer_loop(family):
  """`decode_unrolled` writes out the layer scan of the calls with a cache over the same stacked
  params: the same logits and cache (prefill, then a 3-token decoding call) as the scan, no
  `while` in the cached calls' program, and training's uncached call keeps the loop. Unequal
  head counts, random biases and (Gemma) per-layer windows and RoPE make a wrong layer index
  show; a flag that is ignored keeps the loop."""
  if family == "llama":
    cfg, params = testing.tiny_model(seed=1, qkv_bias=True, n_kv_heads=1, n_layers=3)
  else:
    # Gemma 3 of test-tiny's shape: q/k norm, sliding-window layers (3 tokens, their own RoPE
    # base) around a global one.
    cfg = gemma.GemmaConfig(vocab_size=257, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                            head_dim=8, d_ff=64, rope_theta=10_000.0, rope_local_theta=1_000.0,
                            query_pre_attn_scalar=16.0, qk_norm=True, layer_windows=(3, 0, 3))
    params = testing.perturbed(llama.init_params(cfg, jax.random.key(1)), 0.05)
  new_cfg = dataclasses.replace(cfg, decode_unrolled=True)
  tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  outs, whiles = [], []
  for c in (cfg, new_cfg):
    apply = jax.jit(llama.make_apply(c))
    cache = llama.init_cache(c, 2, 16)
    first, _, cache = apply(params, tokens[:, :6], pos[:, :6], cache)
    step, _, cache = apply(params, tokens[:, 6:], pos[:, 6:], cache)
    outs.append((first, step, cache.k, cache.v))
    whiles.append([apply.lower(params, tokens[:, 6:], pos[:, 6:], cache).as_text().count(
                       "stablehlo.while"),
                   apply.lower(params, tokens, pos).as_text().count("stablehlo.while")])
  for a, b in zip(*outs):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
  assert whiles[0][0] >= 1 and whiles[1][0] == 0  # cached call: the scan is gone
  assert whiles[1][1] == whiles[0][1] >= 1  # training's call keeps it
  assert draft_init.parse_size("test-tiny:fused=1:decode_unrolled=1").decode_unrolled == 1
  for bad in ("test-tiny:decode_unrolled=2", "test-tiny:unrolled=1:decode_unrolled=1"):
    with pytest.raises(ValueError, match="model.size.*decode_unrolled=1"):
      draft_init.parse_size(bad)
  loaded, _ = loading.resolve_model(common.model(size="test-tiny:decode_unrolled=1"),
                                    ByteTokenizer(), field="model.checkpoint")
  assert loaded.decode_unrolled and not loaded.unrolled


def _layout(cfg, params, layout):
  if "fused" in layout:
    cfg, params = dataclasses.replace(cfg, fused=True), layers.fuse_params(params)
  if "unrolled" in layout:
    cfg = dataclasses.replace(cfg, unrolled=True)
    params = layers.unstack_layers(params, cfg.n_layers)
  if "out_major" in layout:
    cfg, params = dataclasses.replace(cfg, out_major=True), layers.out_major_params(params)
  return cfg, params


@pytest.mark.parametrize("layout", ["fused", "unrolled", "fused+unrolled",
                                    "fused+unrolled+out_major"])
def test_fused_and_unrolled_layouts_are_the_same_model(layout):
  """`fused` (q/k/v and gate/up as one product each), `unrolled` (layers written out, each
  with its own params) and `out_major` (o and down weights stored output axis first) compute
  the same model from the same weights: logits, hidden residuals and SD² steering deltas,
  through the cache too; the conversions are inverses and give what such a model initialises.
  Unequal head counts (4 query heads, 1 key/value head), random biases and per-layer deltas
  make a wrong split order, layer index or axis order show."""
  cfg, params = testing.tiny_model(seed=1, qkv_bias=True, n_kv_heads=1, n_layers=3)
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + jax.random.normal(jax.random.key(len(jax.tree_util.keystr(p))), x.shape)
      * 0.1 if "bias" in jax.tree_util.keystr(p) else x, params)
  new_cfg, new = _layout(cfg, params, layout)
  shapes = llama.param_shapes(new_cfg)
  assert jax.tree.map(lambda x: x.shape, new) == jax.tree.map(lambda x: x.shape, shapes)
  if "fused" in layout:
    block = new["layers_1"] if "unrolled" in layout else new["layers"]
    assert "qkv" in block["attn"] and "q" not in block["attn"]
    assert "gate_up" in block and "up" not in block
  if "unrolled" in layout:
    assert "layers" not in new and sorted(k for k in new if k.startswith("layers_")) == [
        "layers_0", "layers_1", "layers_2"]
  if "out_major" in layout:
    block = new["layers_1"] if "unrolled" in layout else new["layers"]
    assert block["attn"]["o"]["kernel"].shape == (cfg.d_model, cfg.n_heads, cfg.head_dim)
    assert block["down"]["kernel"].shape == (cfg.d_model, cfg.d_ff)
  back = new
  if "out_major" in layout:
    back = layers.out_minor_params(back)
  if "unrolled" in layout:
    back = layers.stack_layers(back, cfg.n_layers)
  if "fused" in layout:
    back = layers.unfuse_params(back, new_cfg)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
  keys = jax.random.split(jax.random.key(3), 2)
  steer = {"up": 0.3 * jax.random.normal(keys[0], (cfg.n_layers, 2, cfg.d_ff)),
           "residual": 0.3 * jax.random.normal(keys[1], (cfg.n_layers, 2, cfg.d_model))}
  outs = []
  for c, p in ((cfg, params), (new_cfg, new)):
    apply = jax.jit(llama.make_apply(c, hidden_layers=(0, 2, -1)))
    full, hidden, _ = apply(p, tokens, pos, steer=steer)
    cache = llama.init_cache(c, 2, 16)
    _, _, cache = apply(p, tokens[:, :6], pos[:, :6], cache)
    step, _, _ = apply(p, tokens[:, 6:], pos[:, 6:], cache)
    outs.append((full, hidden, step))
  (full, hidden, step), (full2, hidden2, step2) = outs
  np.testing.assert_allclose(full2, full, atol=1e-5)
  np.testing.assert_allclose(step2, step, atol=1e-5)
  for layer in hidden:
    np.testing.assert_allclose(hidden2[layer], hidden[layer], atol=1e-5)
  for option in ("fused", "unrolled", "out_major"):
    assert getattr(draft_init.parse_size(f"test-tiny:{option}=1"), option) == 1
    with pytest.raises(ValueError, match=f"model.size.*{option}=1"):
      draft_init.parse_size(f"test-tiny:{option}=2")


def test_out_major_weights_are_the_transposed_ones_and_stay_on_one_device():
  """An out-major model (`LlamaConfig.out_major`) draws the transpose of the usual layout's
  weights from the same key (a random model is the same model in either layout), loading sets
  it, and a decoding mesh that splits weights refuses it in one line, while one that splits
  only the batch takes it."""
  cfg = llama.model_config("test-tiny", n_layers=2)
  major = dataclasses.replace(cfg, out_major=True)
  drawn = llama.init_params(major, jax.random.key(4))
  want = layers.out_major_params(llama.init_params(cfg, jax.random.key(4)))
  assert jax.tree.structure(drawn) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(drawn), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  assert drawn["layers"]["attn"]["o"]["kernel"].shape == (2, 32, 4, 8)
  loaded, _ = loading.resolve_model(common.model(size="test-tiny:out_major=1"),
                                    ByteTokenizer(), field="model.checkpoint")
  assert loaded.out_major and not loaded.fused
  with pytest.raises(ValueError, match=r"out_major=1.*fsdp × tensor = 2.*drop :out_major=1"):
    parallel.check_kernels_on_mesh(parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 1}),
                                   {"model": major})
  parallel.check_kernels_on_mesh(parallel.make_mesh({"data": 2, "fsdp": 1, "tensor": 1}),
                                 {"model": major})
