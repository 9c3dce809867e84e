"""The hand-written decoder layers (`models/pallas_layers.py`, `LlamaConfig.pallas`), run in
Pallas's interpreter on CPU: the same forward as XLA's layers for one-token decoding and for
chain- and tree-shaped verification calls (masks, scratch slots, a dropped write, hidden
states), so every decoding mode's exactness (its chi-square test on XLA's layers) carries over;
greedy decoding and greedy chain speculative decoding token for token; planted bugs that the
comparison catches; bad input. (A chi-square run of 3,000 rows through the interpreter takes
~8 minutes on 2 cores: the interpreter runs a kernel's programs one after another.) The kernels' Triton lowering for an H200 is checked by
experiments/scale/kernels.py (it needs the CUDA plugin, not installed here)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import parallel, testing
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding.drafters import lm
from spec_jax.decoding.drafters import trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import decoder, draft_init, families, gemma, llama, pallas_attention
from spec_jax.models import pallas_layers
from spec_jax.models import layers as L

S = 24  # cache slots


# A Gemma 3 of test-tiny's shape: q/k norm, a sliding-window layer (3 tokens, its own RoPE base)
# and a global one, norms after each sublayer, GELU.
GEMMA = dict(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
             d_ff=64, rope_theta=10_000.0, rope_local_theta=1_000.0, query_pre_attn_scalar=16.0,
             qk_norm=True, layer_windows=(3, 0))


def _model(dtype="float32", family="llama", **overrides):
  """test-tiny (or its Gemma twin), fused unless overridden, with weights spread enough that
  every term matters; unrolled=True: per-layer params."""
  base = llama.model_config("test-tiny") if family == "llama" else gemma.GemmaConfig(**GEMMA)
  cfg = dataclasses.replace(base, **{"fused": True, "dtype": dtype, "param_dtype": dtype,
                                     **overrides})
  params = testing.perturbed(decoder.init_params(dataclasses.replace(cfg, unrolled=False),
                                                 jax.random.key(0)), 0.05)
  return cfg, (L.unstack_layers(params, cfg.n_layers) if cfg.unrolled else params)


def _call(b, t, tree):
  """A call's inputs: a cache of random contents, T new tokens per row at random positions;
  `tree`: a random ancestor mask over the new tokens, written to scratch slots past the
  positions, one of them out of range (its write is dropped, as a parked padding write is)."""
  rng = np.random.default_rng(b * 10 + t)
  tokens = jnp.asarray(rng.integers(0, 257, (b, t)), jnp.int32)
  start = rng.integers(4, S - 2 * t - 1, (b,))
  positions = start[:, None] + np.arange(t)[None]
  mask = np.arange(S)[None, None, :] <= positions[:, :, None]
  slots = positions.copy()
  if tree:
    slots = start[:, None] + t + np.arange(t)[None]
    slots[0, -1] = S + 3  # dropped
    ancestors = np.tril(rng.random((b, t, t)) < 0.5) | np.eye(t, dtype=bool)[None]
    mask = np.broadcast_to(np.arange(S)[None, None, :] < start[:, None, None], (b, t, S)).copy()
    rows = np.arange(b)[:, None, None]
    keep = np.clip(slots, 0, S - 1)[:, None, :]
    mask[rows, np.arange(t)[None, :, None], keep] |= ancestors & (slots < S)[:, None, :]
  return tokens, jnp.asarray(positions, jnp.int32), jnp.asarray(mask), jnp.asarray(slots,
                                                                                  jnp.int32)


def _forwards(cfg, params, b, t, tree, hidden=(1, -1), option="pallas"):
  """(XLA layers' output, the kernels' output) of one call: logits, hidden, cache. option:
  the kernels' config field (`pallas`: the whole layers; `attn_kernel`: the attention)."""
  rng = np.random.default_rng(7)
  cache = L.init_cache(cfg, b, S)
  slot_pos = None if cache.pos is None else jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32),
                                                              (b, S))
  cache = L.KVCache(k=jnp.asarray(rng.normal(size=cache.k.shape), cfg.dtype),
                    v=jnp.asarray(rng.normal(size=cache.v.shape), cfg.dtype), pos=slot_pos)
  tokens, positions, mask, slots = _call(b, t, tree)
  outs = []
  for c in (cfg, dataclasses.replace(cfg, **{option: True})):
    apply = jax.jit(decoder.make_apply(c, hidden))
    outs.append(apply(params, tokens, positions, cache, mask, slots))
  return outs


def _max_differences(cfg, params, b, t, tree, option="pallas"):
  (logits, hidden, cache), (p_logits, p_hidden, p_cache) = _forwards(cfg, params, b, t, tree,
                                                                     option=option)
  diff = lambda x, y: float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))  # noqa: E731
  return dict(logits=diff(logits, p_logits), hidden=max(diff(hidden[k], p_hidden[k])
                                                         for k in hidden),
              k=diff(cache.k, p_cache.k), v=diff(cache.v, p_cache.v))


# Cases with two layers also check that a kernel offsets its loads by the layer (and, in Gemma,
# carries the pending norm across layers); the rest take one layer, to compile faster.
CASES = {
    # head_dim 32: each head's columns split over programs (RoPE pairs kept together).
    "decode-split-heads": (dict(head_dim=32), 2, 1, False),
    "gemma3-tree": (dict(family="gemma"), 2, 5, True),
    # Gemma 2: attention logits soft-capped, no q/k norm, no windows.
    "gemma2-chain": (dict(family="gemma", qk_norm=False, layer_windows=(),
                          attn_logit_softcap=2.0, n_layers=1), 2, 3, False),
    "tree": (dict(), 2, 5, True),
    # Widths no power of two divides whole, as the real shapes have (SmolLM2: G = 3 query heads
    # a kv head, N = 9, D = 576): masked tiles at every edge; with Qwen3's q/k norm and
    # Qwen2's q/k/v bias.
    "odd-widths-qk-norm-bias": (dict(n_heads=6, n_kv_heads=2, d_model=48, d_ff=72, qk_norm=True,
                                     qkv_bias=True, n_layers=1), 3, 2, True),
}


@pytest.mark.parametrize("case", CASES)
def test_kernels_equal_xla_layers_float32(case):
  overrides, b, t, tree = CASES[case]
  cfg, params = _model(**overrides)
  diffs = _max_differences(cfg, params, b, t, tree)
  # Logits of this model reach ~±5: the two differ by float32 rounding (summation order).
  assert max(diffs.values()) < 2e-5, diffs


def test_feature_drafter_on_the_kernels():
  """A feature drafter (EAGLE: fc of the verifier's features and the embeddings before the
  layers) on the kernels: the same drafting call as on XLA's layers."""
  cfg, params = _model(feature_width=24, n_layers=1)
  rng = np.random.default_rng(5)
  cache = L.init_cache(cfg, 2, S)
  tokens, positions, mask, slots = _call(2, 3, False)
  features = jnp.asarray(rng.normal(size=(2, 3, 24)), jnp.float32)
  outs = [jax.jit(decoder.make_apply(c, (-1,)))(params, tokens, positions, cache, mask, slots,
                                               features=features)
          for c in (cfg, dataclasses.replace(cfg, pallas=True))]
  np.testing.assert_allclose(outs[1][0], outs[0][0], atol=2e-5)
  np.testing.assert_allclose(outs[1][1][-1], outs[0][1][-1], atol=2e-5)


def test_a_token_that_sees_nothing_stays_finite():
  """A parked padding token (its write dropped, its mask empty) attends to nothing: zeros, not
  0 / 0, so its logits stay finite (XLA's softmax spreads it evenly); the other rows agree."""
  cfg, params = _model(n_layers=1)
  rng = np.random.default_rng(3)
  cache = L.init_cache(cfg, 2, S)
  cache = L.KVCache(k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
                    v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32))
  tokens, positions, mask, slots = _call(2, 1, False)
  mask = mask.at[0].set(False)
  slots = slots.at[0].set(S + 1)
  outs = [jax.jit(decoder.make_apply(c))(params, tokens, positions, cache, mask, slots)[0]
          for c in (cfg, dataclasses.replace(cfg, pallas=True))]
  assert bool(jnp.all(jnp.isfinite(outs[1])))
  np.testing.assert_allclose(outs[1][1], outs[0][1], atol=2e-5)


def test_attention_split_over_programs_equals_xla_layers(monkeypatch):
  """Tiles small enough that the cache's 24 slots split over three attention programs (blocks
  of 4 slots, 8 slots a program; the o product combines them) and every product loops over
  many small blocks: still XLA's layers (Gemma 3's tree call: windows and pending norms too)."""
  monkeypatch.setattr(pallas_attention, "TILES", pallas_attention.Tiles(tile=64, split=8))
  overrides, b, t, tree = CASES["gemma3-tree"]
  cfg, params = _model(**overrides)
  diffs = _max_differences(cfg, params, b, t, tree)
  assert max(diffs.values()) < 2e-5, diffs


def test_narrow_column_blocks_equal_xla_layers(monkeypatch):
  """Two output columns a program (`Tiles.columns`, under a 32-byte sector of a weight row):
  every product and every q/k/v half spread over more programs, with masked edges at the odd
  widths, q/k norm and bias: still XLA's layers. A width no power of two is refused."""
  overrides, b, t, tree = CASES["odd-widths-qk-norm-bias"]
  cfg, params = _model(**overrides)
  kernels = dataclasses.replace(cfg, pallas=True)
  tokens, positions, mask, slots = _call(b, t, tree)
  cache = L.init_cache(cfg, b, S)

  def program():
    return str(jax.jit(decoder.make_apply(kernels)).trace(params, tokens, positions, cache, mask,
                                                          slots).jaxpr)

  assert "grid=(6, 1)" in program()  # the down product: 48 columns, 8 a program
  monkeypatch.setattr(pallas_attention, "TILES", pallas_attention.Tiles(columns=2))
  assert "grid=(24, 1)" in program()  # 2 a program
  diffs = _max_differences(cfg, params, b, t, tree)
  assert max(diffs.values()) < 2e-5, diffs
  with pytest.raises(ValueError, match="columns=3"):
    pallas_attention.Tiles(columns=3)


@pytest.mark.parametrize("case", ["odd-widths-qk-norm-bias", "gemma3-tree"])
def test_a_contraction_shared_by_programs_equals_xla_layers(case, monkeypatch):
  """`Tiles.depth`: the o and down products' contraction shared by five programs (uneven runs
  of 1-wide blocks: 72 and 48 of them at the odd widths), each writing a float32 partial sum
  that the kernel reading the stream next adds up with the residual (Gemma: before its norm),
  and XLA after the last layer: still XLA's layers (runs that leave blocks out, or a partial
  sum left out of the total: `test_planted_bugs_fail_the_comparison`)."""
  overrides, b, t, tree = CASES[case]
  cfg, params = _model(**overrides)
  monkeypatch.setattr(pallas_attention, "TILES", pallas_attention.Tiles(tile=64, depth=5))
  kernels = dataclasses.replace(cfg, pallas=True)
  tokens, positions, mask, slots = _call(b, t, tree)
  program = str(jax.jit(decoder.make_apply(kernels)).trace(
      params, tokens, positions, L.init_cache(cfg, b, S), mask, slots).jaxpr)
  if case.startswith("odd"):
    # o and down (48 columns, 8 a program), in the GPU's branch and the interpreter's.
    assert program.count("grid=(6, 1, 5)") == 4
  diffs = _max_differences(cfg, params, b, t, tree)
  assert max(diffs.values()) < 2e-5, diffs


def test_a_tile_setting_set_between_programs_is_traced_anew(monkeypatch):
  """A sweep sets `pallas_attention.TILES` between programs (experiments/scale/pallas_tiles.py):
  a program traced after the change cuts its kernels the new way, though the model's forward of
  that config and shapes was traced before (`decoder.make_apply` reuses such traces)."""
  overrides, b, t, tree = CASES["gemma3-tree"]
  cfg, params = _model(**overrides, attn_kernel=True)
  cache = L.init_cache(cfg, b, S)
  tokens, positions, mask, slots = _call(b, t, tree)

  def program():
    return str(jax.jit(decoder.make_apply(cfg)).trace(params, tokens, positions, cache, mask,
                                                      slots).jaxpr)

  whole = program()
  assert program() == whole  # (the same setting: the same program)
  monkeypatch.setattr(pallas_attention, "TILES", pallas_attention.Tiles(tile=64, split=8))
  split = program()
  assert "grid=(2, 10, 1)" in whole and "grid=(2, 10, 3)" in split  # 24 slots: 3 programs


def test_kernels_close_to_xla_layers_bfloat16():
  """bfloat16: the same rounding points, but the softmax weights stay float32 here (XLA
  rounds them to bfloat16 before the value product): close, to bfloat16's precision."""
  cfg, params = _model("bfloat16", n_layers=1)
  diffs = _max_differences(cfg, params, 2, 3, True)
  assert diffs["logits"] < 0.1 and diffs["k"] < 0.05 and diffs["v"] < 0.05, diffs


def _plant_rope_sign(monkeypatch):
  real = pallas_layers._rope_pair  # noqa: SLF001
  monkeypatch.setattr(pallas_layers, "_rope_pair",
                      lambda lo, hi, cos, sin: real(lo, hi, cos, -sin))


def _plant_all_new_visible(monkeypatch):
  monkeypatch.setattr(pallas_attention, "_visible", lambda loaded: loaded > -1)


def _plant_norm_width(monkeypatch):
  real = pallas_layers._rms  # noqa: SLF001
  monkeypatch.setattr(pallas_layers, "_rms", lambda sumsq, width, eps: real(sumsq, width - 1, eps))


def _plant_no_window(monkeypatch):
  real = pallas_layers._layers  # noqa: SLF001
  monkeypatch.setattr(pallas_layers, "_layers", lambda cfg, *args, **kwargs: real(
      dataclasses.replace(cfg, layer_windows=()), *args, **kwargs))


def _plant_gain_offset(monkeypatch):
  monkeypatch.setattr(pallas_layers, "_gain", lambda gain, cfg: gain.astype(jnp.float32))


def _shared_contractions(monkeypatch):
  monkeypatch.setattr(pallas_attention, "TILES", pallas_attention.Tiles(tile=64, depth=5))


def _plant_blocks_left_out(monkeypatch):
  _shared_contractions(monkeypatch)
  real = pallas_layers._depth  # noqa: SLF001
  monkeypatch.setattr(pallas_layers, "_depth", lambda blocks, tiles: (
      lambda depth, per: (depth, per - 1))(*real(blocks, tiles)))


def _plant_partial_sum_left_out(monkeypatch):
  _shared_contractions(monkeypatch)
  real = pallas_layers._sum_partials  # noqa: SLF001
  monkeypatch.setattr(pallas_layers, "_sum_partials",
                      lambda h_ref, *args: real(h_ref.at[1:], *args))


@pytest.mark.parametrize("plant, family", [
    (_plant_rope_sign, "llama"), (_plant_all_new_visible, "llama"), (_plant_norm_width, "llama"),
    (_plant_blocks_left_out, "llama"), (_plant_partial_sum_left_out, "llama"),
    (_plant_no_window, "gemma"), (_plant_gain_offset, "gemma")])
def test_planted_bugs_fail_the_comparison(plant, family, monkeypatch, fresh_programs):
  """A sign flipped in RoPE, every cache slot and new token visible, RMSNorm over one element
  too few; with the o and down contractions shared by programs (`Tiles.depth`), a run of
  blocks no program takes, a partial sum left out of the total; in Gemma, the sliding window
  ignored, the norms' gain without its stored offset: each moves the kernels' output far past
  the tolerance above."""
  plant(monkeypatch)
  cfg, params = _model(family=family)
  diffs = _max_differences(cfg, params, 2, 5, True)
  assert max(diffs.values()) > 1e-3, diffs


@pytest.mark.parametrize("option, fused", [("pallas", True), ("attn_kernel", False)])
def test_greedy_decoding_equals_xla_layers(option, fused):
  """Autoregressive greedy decoding (a ragged batch with stop tokens) and greedy chain
  speculative decoding, verifier and drafter on the kernels (the whole layers, or the
  attention inside XLA's layers), emit the XLA layers' greedy output token for token."""
  v_cfg, v_params = testing.tiny_model(seed=0, sharpness=4.0, fused=fused)
  d_params = testing.perturbed(v_params, 0.1)  # agrees often, not always
  v_kernels = dataclasses.replace(v_cfg, **{option: True})
  reference = testing.greedy_reference(v_cfg, v_params)
  prompts, stops, want = reference
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_kernels,
                             sampling=Sampling(), max_new_tokens=14, stop_ids=stops)
  assert ar.new_tokens() == want
  drafter = lm.LMDrafter(v_kernels, trees.chain(3))
  testing.assert_greedy_equal(v_kernels, v_params, drafter, d_params, reference)


def _lower_for_triton(cfg):
  """Autoregressive decoding of `cfg` with random weights, lowered for an NVIDIA GPU (Pallas's
  Triton lowering runs here; no GPU or CUDA library is needed to lower)."""
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                        decoder.param_shapes(cfg))
  gpu = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"))
  key = jax.random.key(0)  # made outside the abstract mesh, where nothing can run (jax 0.11)
  with jax.sharding.use_abstract_mesh(gpu):
    generate_lib._generate_jit.trace(  # noqa: SLF001
        params, jax.ShapeDtypeStruct((1, 8), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
        key, cfg=cfg, sampling=Sampling(), max_new_tokens=2, stop_ids=(),
        fixed_steps=True).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("option", ["pallas", "attn_kernel"])
def test_a_head_size_triton_cannot_load_is_refused_with_the_fix(option):
  """Triton loads only power-of-two sizes, and the kernels load whole heads: head_dim = 16 lowers
  for a GPU (odd model and MLP widths too), head_dim = 20 fails in Triton's lowering, and the
  model config refuses it first, in one line naming the option to drop."""
  fused = dict(fused=True) if option == "pallas" else {}
  ok = llama.model_config("test-tiny", vocab_size=64, head_dim=16, d_model=48, d_ff=72,
                          n_heads=6, **fused, **{option: True})
  _lower_for_triton(ok)
  bad = dataclasses.replace(ok)
  object.__setattr__(bad, "head_dim", 20)  # past the config's check: what Triton would get
  with pytest.raises(ValueError, match="Triton lowering currently requires .* power of 2"):
    _lower_for_triton(bad)
  with pytest.raises(ValueError, match=f"{option}=1: .* head_dim=20 is not one. Fix: drop "
                                       f":{option}=1 from model.size"):
    llama.model_config("test-tiny", head_dim=20, **fused, **{option: True})


def test_bad_input_names_the_field():
  with pytest.raises(ValueError, match="model.size.*fused=1:pallas=1"):
    draft_init.parse_size("smollm2-135m:pallas=1")
  with pytest.raises(ValueError, match="model.size.*without unrolled"):
    draft_init.parse_size("smollm2-135m:fused=1:unrolled=1:pallas=1")
  with pytest.raises(ValueError, match="model.size.*without unrolled=1 or out_major=1"):
    draft_init.parse_size("smollm2-135m:fused=1:out_major=1:pallas=1")
  with pytest.raises(ValueError, match="pallas=1.*unfused layout"):
    llama.model_config("test-tiny", pallas=True)
  with pytest.raises(ValueError, match="pallas=1.*out-major layout.*drop :out_major=1"):
    llama.model_config("test-tiny", fused=True, out_major=True, pallas=True)
  assert families.model_config("gemma3-270m", fused=True, pallas=True).pallas
  assert draft_init.parse_size("smollm2-135m:fused=1:pallas=1").pallas == 1


@pytest.mark.parametrize("option, what", [("pallas", "its layers"),
                                          ("attn_kernel", "its attention")])
def test_kernels_are_refused_on_a_decoding_mesh(option, what):
  """On a decoding mesh of several devices, before compiling anything: one line naming the
  size option and the fix, for AR decoding and for speculative decoding's verifier."""
  cfg, params = testing.tiny_model(fused=True, **{option: True})
  mesh = parallel.make_mesh({"data": 2, "fsdp": 1, "tensor": 1})
  prompts = generate_lib.pad_prompts([[1, 2], [3, 4]], 2, pad_id=0)
  with pytest.raises(ValueError, match=f"The model runs {what} on hand-written kernels.*"
                                       f"mesh.data=1.*drop :{option}=1"):
    generate_lib.generate(params, prompts, jax.random.key(0), cfg=cfg, sampling=Sampling(),
                          max_new_tokens=2, mesh=mesh)
  with pytest.raises(ValueError, match=f"The verifier runs {what} on hand-written kernels"):
    testing.lm_speculative(cfg, params, cfg, params, prompts, jax.random.key(0), mesh=mesh,
                           sampling=Sampling(), max_new_tokens=2)


def test_fused_qkv_is_refused_on_a_tensor_axis_and_decodes_on_the_others():
  """A fused q/k/v weight's N+2K heads would split over 'tensor' out of line with their groups;
  over data and fsdp it decodes as on one device."""
  cfg, params = testing.tiny_model(fused=True)
  prompts = generate_lib.pad_prompts([[1, 2], [3, 4]], 2, pad_id=0)
  run = functools.partial(generate_lib.generate, params, prompts, jax.random.key(0), cfg=cfg,
                          sampling=Sampling(), max_new_tokens=3)
  tensor = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 2})
  with pytest.raises(ValueError, match=r"The model's q/k/v are one fused weight.*tensor=2.*"
                                       r"drop :fused=1"):
    run(mesh=tensor)
  with pytest.raises(ValueError, match="The verifier's q/k/v are one fused weight"):
    testing.lm_speculative(cfg, params, cfg, params, prompts, jax.random.key(0), mesh=tensor,
                           sampling=Sampling(), max_new_tokens=2)
  mesh = parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 1})
  assert run(mesh=mesh).new_tokens() == run().new_tokens()


def test_tile_sweep_runs_and_refuses_an_unknown_field(tmp_path, monkeypatch):
  """experiments/scale/pallas_tiles.py (the GPU loan's tile sweep) on test-tiny in the
  interpreter: a row per setting beside XLA's fused layers; a setting naming no field of
  Tiles is refused before any work."""
  from experiments.scale import pallas_tiles  # noqa: PLC0415
  with pytest.raises(ValueError, match="--settings: 'warps=2'.*num_warps"):
    pallas_tiles.main(["--settings", "default,warps=2", "--out", str(tmp_path)])
  rows = pallas_tiles.main(["--size", "test-tiny", "--steps", "2", "--repeats", "1",
                            "--settings", "default,num_warps=2", "--bandwidth_mb", "4",
                            "--out", str(tmp_path)])
  assert [r["run"] for r in rows] == ["xla-fused", "xla-fused attn_kernel", "pallas default",
                                      "pallas num_warps=2"]
  assert rows[3]["tiles"]["num_warps"] == 2 and rows[0]["vs_xla_fused"] == 1.0
  assert rows[1]["layers"] == "xla-fused+attn_kernel" and rows[1]["tiles"] is None
  # The kernels decode XLA's greedy tokens; a differing token is counted where it comes.
  assert all(r["tokens_agree"] == 2 and r["top_logit_diff"] < 1e-4 for r in rows)
  ref_tokens, ref_tops = np.array([[3, 4, 5], [6, 7, 8]]), np.zeros((2, 3))
  assert pallas_tiles.agreement(ref_tokens, ref_tops + 0.5, ref_tokens, ref_tops) == (3, 0.5)
  tokens = ref_tokens.copy()
  tokens[1, 1] = 0
  assert pallas_tiles.agreement(tokens, ref_tops, ref_tokens, ref_tops) == (1, 0.0)
  tokens[0, 0] = 0
  assert pallas_tiles.agreement(tokens, ref_tops, ref_tokens, ref_tops) == (0, 0.0)
  assert (tmp_path / "results.json").exists() and (tmp_path / "results.md").exists()
  assert pallas_attention.TILES == pallas_attention.Tiles()
  # A setting that fails to compile: a row with its error, the rest timed.
  real = pallas_tiles.decode_loop

  def refused(cfg, steps):
    run = real(cfg, steps)

    def compile_and_run(*args):  # the sweep sets the tiles just before the first call
      if cfg.pallas and pallas_attention.TILES.num_warps == 2:
        raise RuntimeError("planted\nsecond line")
      return run(*args)
    return compile_and_run
  monkeypatch.setattr(pallas_tiles, "decode_loop", refused)
  rows = pallas_tiles.main(["--size", "test-tiny", "--steps", "2", "--repeats", "1",
                            "--settings", "default,num_warps=2", "--bandwidth_mb", "4",
                            "--out", str(tmp_path)])
  assert [r["run"] for r in rows][-1] == "pallas num_warps=2"
  assert rows[-1]["error"] == "RuntimeError: planted" and "ms_per_step" in rows[-2]
  assert "failed: RuntimeError: planted" in (tmp_path / "results.md").read_text()
  monkeypatch.setattr(pallas_tiles, "decode_loop", real)
  # A budget spent before the second program: the first alone is timed.
  rows = pallas_tiles.main(["--size", "test-tiny", "--steps", "2", "--repeats", "1",
                            "--settings", "default", "--bandwidth_mb", "4", "--budget_s",
                            "1e-9", "--out", str(tmp_path)])
  assert [r["run"] for r in rows] == ["xla-fused"]


# The attention kernel inside XLA's layers (`LlamaConfig.attn_kernel`): every layout (scanned:
# the layer index and, in Gemma 3, the window traced; unrolled; unfused), a long cache's splits
# combined by XLA.
ATTENTION_CASES = {
    "decode-split-heads": CASES["decode-split-heads"],
    "tree-unrolled": (dict(unrolled=True), 2, 5, True),
    "tree-unfused": (dict(fused=False), 2, 5, True),
    "gemma3-tree": CASES["gemma3-tree"],
    "gemma2-chain": CASES["gemma2-chain"],
    "odd-widths-qk-norm-bias": CASES["odd-widths-qk-norm-bias"],
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_kernel_equals_xla_layers(case):
  overrides, b, t, tree = ATTENTION_CASES[case]
  cfg, params = _model(**overrides)
  diffs = _max_differences(cfg, params, b, t, tree, option="attn_kernel")
  assert max(diffs.values()) < 2e-5, diffs


def test_attention_kernel_close_to_xla_layers_bfloat16():
  """bfloat16 (the GPU default), unrolled as the 8B bar runs it: close to XLA's layers, to
  bfloat16's precision (the kernel keeps the softmax weights float32)."""
  cfg, params = _model("bfloat16", unrolled=True)
  diffs = _max_differences(cfg, params, 2, 3, True, option="attn_kernel")
  assert diffs["logits"] < 0.1 and diffs["k"] < 0.05 and diffs["v"] < 0.05, diffs


def test_attention_kernel_split_cache_equals_xla_layers(monkeypatch):
  """The cache's 24 slots over three programs of 8, their outputs combined in XLA (Gemma 3's
  tree call, its window traced per layer)."""
  monkeypatch.setattr(pallas_attention, "TILES", pallas_attention.Tiles(tile=64, split=8))
  overrides, b, t, tree = CASES["gemma3-tree"]
  cfg, params = _model(**overrides)
  diffs = _max_differences(cfg, params, b, t, tree, option="attn_kernel")
  assert max(diffs.values()) < 2e-5, diffs


def _plant_first_layer(monkeypatch):
  real = pallas_attention.attention
  monkeypatch.setattr(pallas_attention, "attention", lambda cfg, q, k, v, ck, cv, layer, *args:
                      real(cfg, q, k, v, ck, cv, 0, *args))


def _plant_window_global(monkeypatch):
  real = pallas_attention.attention
  monkeypatch.setattr(pallas_attention, "attention", lambda *args: real(*args[:-1], 0))


@pytest.mark.parametrize("plant, family, split", [
    (_plant_first_layer, "llama", 0), (_plant_window_global, "gemma", 0),
    (_plant_all_new_visible, "llama", 0), (_plant_window_global, "gemma", 8)])
def test_attention_kernel_planted_bugs_fail(plant, family, split, monkeypatch, fresh_programs):
  """Every layer reading the first layer's cache; Gemma's window ignored (also over split
  programs); every slot visible: each fails the comparison above."""
  plant(monkeypatch)
  if split:
    monkeypatch.setattr(pallas_attention, "TILES", pallas_attention.Tiles(tile=64, split=split))
  cfg, params = _model(family=family)
  diffs = _max_differences(cfg, params, 2, 5, True, option="attn_kernel")
  assert max(diffs.values()) > 1e-3, diffs


def test_attention_kernel_bad_input_names_the_field():
  with pytest.raises(ValueError, match="model.size.*attn_kernel=1.*keep one of them"):
    draft_init.parse_size("smollm2-135m:fused=1:pallas=1:attn_kernel=1")
  with pytest.raises(ValueError, match="attn_kernel=1 with pallas=1"):
    llama.model_config("test-tiny", fused=True, pallas=True, attn_kernel=True)
  assert draft_init.parse_size("smollm2-135m:unrolled=1:attn_kernel=1").attn_kernel == 1
