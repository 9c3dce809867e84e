"""Decoding on a mesh of the 8 fake CPU devices (conftest.py): the speculative loop (chains,
trees) and autoregressive generation with the batch over ('data', 'fsdp'), parameters placed for
decoding (`parallel.decode_param_rule`: weights stay put, activations move) and KV caches
sharded over rows and key/value heads ('tensor'). Sharded output equals single-device output
(greedy: token for token), stays lossless at T = 1, compiles once. The sharded train step is
tested in tests/test_parallel.py; that a round moves no weight, in tests/test_pod_plan.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import parallel, testing
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import features, hidden, lm, standard, trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import decoder, gemma, llama, presets

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40], [100, 101, 102], [7, 7],
           [1, 2], [3], [200, 201, 202, 203], [9, 9, 9]]
MESHES = {"data=2,fsdp=2,tensor=2": dict(data=2, fsdp=2, tensor=2),
          "data=8": dict(data=8, fsdp=1, tensor=1)}


def _pair(vocab_size=257):
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=vocab_size, sharpness=4.0)
  d_cfg, d_params = testing.tiny_model(seed=11, vocab_size=vocab_size, sharpness=4.0)
  return v_cfg, v_params, d_cfg, d_params


def _sd(pair, prompts, shape, *, mesh=None, sampling=Sampling(), n=10, seed=0):
  v_cfg, v_params, d_cfg, d_params = pair
  return loop.speculative_generate(
      v_params, d_params, prompts, jax.random.key(seed), verifier=verifier_lib.lm_verifier(v_cfg),
      drafter=lm.LMDrafter(d_cfg, shape), sampling=sampling, max_new_tokens=n, mesh=mesh)


@pytest.mark.parametrize("mesh_spec", list(MESHES), ids=list(MESHES))
def test_sharded_greedy_equals_single_device(mesh_spec):
  mesh = parallel.make_mesh(MESHES[mesh_spec])
  pair = _pair()
  prompts = generate_lib.pad_prompts(PROMPTS, 8, 0)
  v_cfg, v_params = pair[:2]
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=10)
  ar_sharded = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg,
                                     sampling=Sampling(), max_new_tokens=10, mesh=mesh)
  assert ar_sharded.new_tokens() == ar.new_tokens()
  assert len(ar_sharded.tokens.sharding.device_set) == 8
  # Single-device SD equals AR in tests/test_speculative.py and test_tree_speculative.py; here
  # every drafter kind on the mesh equals the same AR output.
  shapes = [trees.chain(3)]
  if mesh.shape["tensor"] > 1:  # one tree is enough: it shares everything else with the chain
    shapes.append(standard.tree("rsd_c", depth=2, branching=(2, 2)))
  for shape in shapes:
    sharded = _sd(pair, prompts, shape, mesh=mesh)
    assert sharded.new_tokens() == ar.new_tokens(), shape.describe()
    assert len(sharded.tokens.sharding.device_set) == 8
  # A drafter fed by the verifier's hidden states (no KV cache of its own) on the same mesh.
  hd = hidden.HiddenStateDrafter(v_cfg.vocab_size, v_cfg.d_model, gamma=3, layer=-1)
  out = loop.speculative_generate(v_params, hd.init_params(jax.random.key(3)), prompts,
                                  jax.random.key(0),
                                  verifier=verifier_lib.lm_verifier(v_cfg, hd.verifier_layers),
                                  drafter=hd, sampling=Sampling(), max_new_tokens=10, mesh=mesh)
  assert out.new_tokens() == ar.new_tokens()


def test_sharded_gemma_with_its_feature_drafter_equals_single_device():
  """A Gemma 3 verifier (q/k norms, a sliding-window layer, norms after each sublayer) and its
  one-block feature drafter (the fc over [features; embeddings], the tied vocabulary split over
  both model axes) on data 2 × fsdp 2 × tensor 2: greedy AR and greedy chain SD token for token
  as on one device, the SD again equal to AR. Run again 20 times, the sharded loop never
  deadlocks: its rounds start a collective beside a while loop that holds others, which starves
  XLA:CPU's thread pool at its default size (`cli.cpu_threads` sizes it; with NPROC=2 most such
  runs hang)."""
  v_cfg = gemma.GemmaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=8, d_ff=64, rope_theta=10_000.0, rope_local_theta=1_000.0,
                            query_pre_attn_scalar=16.0, qk_norm=True, layer_windows=(3, 0))
  v_params = testing.perturbed(decoder.init_params(v_cfg, jax.random.key(0)), 0.05)
  d_cfg = presets.block_drafter(v_cfg)
  d_params = testing.perturbed(decoder.init_params(d_cfg, jax.random.key(1)), 0.05)
  drafter = features.FeatureDrafter(d_cfg, trees.chain(3))
  verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, 0)
  mesh = parallel.make_mesh(MESHES["data=2,fsdp=2,tensor=2"])
  runs = {}
  for name, m in (("one device", None), ("mesh", mesh)):
    ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg,
                               sampling=Sampling(), max_new_tokens=10, mesh=m)
    sd = loop.speculative_generate(v_params, d_params, prompts, jax.random.key(0),
                                   verifier=verifier, drafter=drafter, sampling=Sampling(),
                                   max_new_tokens=10, mesh=m)
    runs[name] = (ar.new_tokens(), sd.new_tokens())
  assert runs["mesh"] == runs["one device"]
  assert runs["mesh"][1] == runs["mesh"][0]
  for _ in range(20):
    sd = loop.speculative_generate(v_params, d_params, prompts, jax.random.key(0),
                                   verifier=verifier, drafter=drafter, sampling=Sampling(),
                                   max_new_tokens=10, mesh=mesh)
    assert sd.new_tokens() == runs["mesh"][1]


def test_a_forward_traced_for_a_mesh_after_one_device_keeps_its_activation_layout():
  """`decoder.make_apply` reuses the trace of a forward seen before with the same config and
  shapes; one traced inside a decoding program on a mesh (`parallel.decoding_layout`) lays its
  activations out, though the same forward was traced without a layout first (a planted bug
  reusing that trace gathers the weights every round: tests/test_pod_plan.py)."""
  cfg, params = testing.tiny_model(seed=0)
  tokens = jnp.zeros((8, 3), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(3), (8, 3))

  def constraints():
    jaxpr = jax.jit(llama.make_apply(cfg)).trace(params, tokens, positions).jaxpr
    return str(jaxpr).count("sharding_constraint")

  assert constraints() == 0
  with parallel.decoding_layout(parallel.make_mesh(MESHES["data=2,fsdp=2,tensor=2"])):
    assert constraints() > 0
  assert constraints() == 0


def test_tensor_parallel_verifier_logits_equal_single_device():
  cfg, params = testing.tiny_model(seed=0)
  apply = jax.jit(llama.make_apply(cfg))
  tokens = jnp.asarray([PROMPTS[0], PROMPTS[6] + [1, 2, 3]], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
  want, _, _ = apply(params, tokens, positions)
  for spec in (dict(data=1, fsdp=1, tensor=2), dict(data=1, fsdp=4, tensor=2)):
    mesh = parallel.make_mesh(spec)
    placed = parallel.place_params(params, mesh)
    assert any(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
               for x in jax.tree.leaves(placed))
    got, _, _ = apply(placed, tokens, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_sharded_sampling_is_lossless():
  """T = 1 on a mesh: 2-token continuations of one prompt in 512 rows (64 per device) fit the
  verifier's enumerated law; a drafter law that ignores the transform does not."""
  pair = _pair(vocab_size=6)
  mesh = parallel.make_mesh(dict(data=4, fsdp=2, tensor=1))
  prompt = [1, 4, 2]
  s = Sampling(1.0, top_k=4)
  law = testing.exact_sequence_law(pair[0], pair[1], prompt, 2, s)
  prompts = generate_lib.pad_prompts([prompt] * 4096, 3, 0)
  out = _sd(pair, prompts, trees.chain(2), mesh=mesh, sampling=s, n=2)
  samples = [tuple(r) for r in out.new_tokens()]
  assert testing.chi_square_pvalue(samples, law) > 1e-3
  plain = testing.exact_sequence_law(pair[0], pair[1], prompt, 2, Sampling(1.0))
  assert testing.chi_square_pvalue(samples, plain) < 1e-3


def test_sharded_decoding_compiles_once(monkeypatch):
  monkeypatch.setattr(loop, "_generate_jit", jax.jit(chex.assert_max_traces(loop._generate, n=1),
                                                     static_argnames=loop.STATIC))
  mesh = parallel.make_mesh(dict(data=4, fsdp=1, tensor=2))
  pair = _pair()
  for seed, rows in ((0, PROMPTS[:4]), (1, PROMPTS[4:])):
    _sd(pair, generate_lib.pad_prompts(rows, 8, 0), trees.chain(2), mesh=mesh, seed=seed,
        sampling=Sampling(1.0))


def test_bad_meshes_name_the_axis_and_the_fix():
  pair = _pair()
  prompts = generate_lib.pad_prompts(PROMPTS[:3], 8, 0)
  with pytest.raises(ValueError, match=r"batch size = 3 does not divide over the mesh's batch axes "
                                       r"data\*fsdp = 2\*2 = 4.*--config.mesh.data"):
    _sd(pair, prompts, trees.chain(2), mesh=parallel.make_mesh(dict(data=2, fsdp=2, tensor=2)))
  with pytest.raises(ValueError, match=r"verifier has 2 key/value heads, which do not divide over "
                                       r"mesh.tensor = 4.*--config.mesh.tensor"):
    _sd(pair, generate_lib.pad_prompts(PROMPTS[:2], 8, 0), trees.chain(2),
        mesh=parallel.make_mesh(dict(data=2, fsdp=1, tensor=4)))
  assert parallel.decode_mesh(dict(data=1, fsdp=1, tensor=1)) is None
  assert parallel.decode_mesh(dict(data=-1, fsdp=1, tensor=1)).devices.size == 8


def test_evaluate_on_a_mesh(tmp_path):
  """`evaluate` takes --config.mesh.*: greedy SD on a data × tensor mesh still equals AR, and a
  batch size the mesh cannot split fails before any decoding, naming eval.batch_sizes."""
  from configs import evaluate as evaluate_config  # noqa: PLC0415
  from spec_jax.programs import evaluate  # noqa: PLC0415
  config = evaluate_config.get_config("smoke")
  config.eval.update(gammas=(2,), temperatures=(0.0,), batch_sizes=(2,), num_prompts=2)
  config.mesh.update(data=2, tensor=2)
  rows = evaluate.run(config, str(tmp_path / "ok"))
  sd = [r for r in rows if r["method"] != "autoregressive"]
  assert sd and all(r["identical_to_greedy"] for r in sd)
  config.eval.batch_sizes = (3,)
  with pytest.raises(ValueError, match=r"eval.batch_sizes entry 3: the batch size = 3 does not "
                                       r"divide over the mesh's batch axes"):
    evaluate.run(config, str(tmp_path / "bad"))
