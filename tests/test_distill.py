"""DistillSpec: the distill step, data sources, the `distill` program (resume, errors) and the
quality metrics of lossy decoding. Tiny models (test-tiny, byte vocabulary), CPU only."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from configs import distill as distill_config
from spec_jax import loading, parallel, testing
from spec_jax.training import distill_data
from spec_jax.data import pipeline
from spec_jax.data.tokenizer import ByteTokenizer
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding import loop
from spec_jax.decoding.acceptance import chain as chain_rules
from spec_jax.evaluation import quality
from spec_jax.models import draft_init, llama
from spec_jax.programs import distill as distill_program
from spec_jax.training import checkpoints, distill, divergences, metrics as metrics_lib, optim
from spec_jax.training import features as features_train, losses, train

T1 = sampling_lib.Sampling(1.0)


class Killed(BaseException):
  """Stands in for SIGKILL inside the process: nothing in the program may catch it."""


def smoke_config(data_dir, **train_overrides):
  config = distill_config.get_config("smoke")
  # One device here; the quickstart smoke test (test_programs.py) runs distill on 8 fake ones.
  config.mesh.data = 1
  config.data.data_dir = data_dir
  config.train.update(train_overrides)
  return config


@functools.partial(jax.jit, static_argnums=0)
def forward(cfg, params, tokens):
  """Logits f32[B, T, V] of a full causal forward (one compiled program per config)."""
  return llama.make_apply(cfg)(params, tokens, jnp.arange(tokens.shape[1])[None].repeat(
      tokens.shape[0], 0))[0]


def leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                    for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def pair():
  """A peaked teacher and a student that disagrees with it (both test-tiny, vocab 257)."""
  v_cfg, v_params = testing.tiny_model(seed=0, sharpness=4.0)
  d_cfg, d_params = testing.tiny_model(seed=1, sharpness=2.0)
  return v_cfg, v_params, d_cfg, d_params


# ---------------------------------------------------------------------------------------------
# The distill step.


def test_each_distill_step_draws_its_own_randomness_from_the_step(pair):
  """distill_step folds the step into the run's one key (as train_step does): a context_fn (SD²
  steering draws its staleness offset from it) sees a new key every step, and the same key at
  the same step of a resumed run. Eager calls, so the context sees concrete keys."""
  v_cfg, v_params, d_cfg, d_params = pair
  import optax  # noqa: PLC0415
  tx = optax.sgd(1e-3)
  state = train.TrainState(step=jnp.int32(0), params=d_params, opt_state=tx.init(d_params))
  seqs = np.asarray(jax.random.randint(jax.random.key(2), (2, 9), 0, 257), np.int32)
  batch = distill_data.make_batch(seqs, np.full((2,), 4), prompt_tokens=5)
  draws = []

  def context_fn(hidden, batch, rng):
    draws.append(int(jax.random.randint(rng, (), 0, 2**30)))
    return {}

  step = functools.partial(distill.distill_step, student_apply=llama.make_apply(d_cfg),
                           teacher_apply=llama.make_apply(v_cfg), tx=tx,
                           objective=distill.Objective("fkl", sampling=T1), context_fn=context_fn)
  first = state
  for _ in range(3):
    state, _ = step(state, batch, jax.random.key(7), v_params)
  step(first, batch, jax.random.key(7), v_params)  # step 0 again, as a resumed run would
  assert len(set(draws[:3])) == 3 and draws[3] == draws[0]


@pytest.mark.parametrize("name", [*sorted(divergences.DIVERGENCES), "xent"])
def test_one_distill_step_lowers_the_chosen_divergence(pair, name):
  v_cfg, v_params, d_cfg, d_params = pair
  objective = distill.Objective(name, beta=0.5, sampling=T1)
  train_cfg = distill_config.get_config("smoke").train
  train_cfg.update(lr=3e-3, warmup_steps=1, grad_clip=0.0, weight_decay=0.0)
  tx, _ = optim.make_optimizer(train_cfg)
  mesh = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
  abstract, shardings = train.abstract_state(functools.partial(llama.init_params, d_cfg), tx,
                                             jax.random.key(0), mesh)
  state = train.state_from_params(d_params, tx, abstract)
  v_sh = parallel.param_shardings(mesh, v_params)
  step = distill.jit_distill_step(llama.make_apply(d_cfg), llama.make_apply(v_cfg), tx,
                                  objective, shardings, v_sh, mesh)
  seqs = np.asarray(jax.random.randint(jax.random.key(2), (4, 17), 0, 257), np.int32)
  batch = distill_data.make_batch(seqs, np.full((4,), 8), prompt_tokens=9)
  v_before = jax.tree.map(np.array, v_params)
  # The loss a step reports is the loss of the params it starts from, so a second step on the
  # same batch reads the objective after the first update (no second compiled program).
  state, m1 = step(state, batch, jax.random.key(0), v_params)
  _, m2 = step(state, batch, jax.random.key(0), v_params)
  before, after = float(m1["loss"]), float(m2["loss"])
  logits, t_logits = forward(d_cfg, d_params, batch["inputs"]), forward(v_cfg, v_params,
                                                                         batch["inputs"])
  if name == "xent":
    want = float(losses.cross_entropy(logits, batch["targets"], batch["weights"])[0])
  else:
    want = float(divergences.divergence(name, t_logits, logits, batch["weights"], sampling=T1))
  assert before == pytest.approx(want, rel=1e-4)  # the step optimises the divergence asked for
  assert after < before - 1e-3 * abs(before), (name, before, after)
  assert leaves_equal(v_params, v_before)  # the teacher is never updated
  assert float(m1["weight_sum"]) == 32.0  # only the 4 × 8 response tokens count


# ---------------------------------------------------------------------------------------------
# Data sources.


class _Windows:
  """A stand-in for `distill_data.windows`: batch s is a fixed function of s."""

  def __init__(self, b=4, p=6, r=5):
    self.b, self.p, self.r = b, p, r

  def __getitem__(self, s):
    rng = np.random.default_rng(1000 + s)
    return rng.integers(0, 256, (self.b, self.p + self.r)).astype(np.int32)


def _onpolicy_data(params, cfg, seed, source="onpolicy", refresh_every=1):
  spec = distill_data.Spec(source=source, prompt_tokens=6, response_tokens=5, batch_size=4,
                           temperature=1.0, refresh_every=refresh_every, mix_with="fixed",
                           mix_lambda=0.5, seed=seed)
  gen = lambda params_, prompts, rng: distill_data.generate_responses(  # noqa: E731
      params_, cfg, prompts, rng, sampling=T1, response_tokens=5)
  return distill_data.DistillData(spec, _Windows(), drafter_generate=gen)


def test_onpolicy_generation_is_reproducible_from_its_seed(pair):
  _, _, d_cfg, d_params = pair
  first = _onpolicy_data(d_params, d_cfg, seed=3).get(0, d_params)
  again = _onpolicy_data(d_params, d_cfg, seed=3).get(0, d_params)
  other_seed = _onpolicy_data(d_params, d_cfg, seed=4).get(0, d_params)
  other_params = _onpolicy_data(d_params, d_cfg, seed=3).get(
      0, testing.perturbed(d_params, 0.5))
  for k in first:
    np.testing.assert_array_equal(first[k], again[k])
  assert not np.array_equal(first["targets"], other_seed["targets"])
  assert not np.array_equal(first["targets"], other_params["targets"])
  # Prompts are the windows' first P tokens; weights mark exactly the R = 5 response targets.
  np.testing.assert_array_equal(first["inputs"][:, :6], _Windows()[0][:, :6])
  np.testing.assert_array_equal(first["weights"].sum(1), 5)
  np.testing.assert_array_equal(first["weights"][:, :5], 0)


def test_onpolicy_refresh_and_mix(pair):
  _, _, d_cfg, d_params = pair
  other = testing.perturbed(d_params, 0.5)
  data = _onpolicy_data(d_params, d_cfg, seed=3, refresh_every=2)
  b0 = data.get(0, d_params)
  b1 = data.get(1, other)  # same refresh block: generated with the params of step 0
  fresh = _onpolicy_data(d_params, d_cfg, seed=3, refresh_every=2)
  fresh.get(0, d_params)
  np.testing.assert_array_equal(b1["targets"], fresh.get(1, d_params)["targets"])
  assert not np.array_equal(b0["targets"], b1["targets"])
  # 50/50 mix with fixed data: rows 0-1 generated, rows 2-3 the windows' own continuation.
  mix = _onpolicy_data(d_params, d_cfg, seed=3, source="mix").get(0, d_params)
  window = _Windows()[0]
  np.testing.assert_array_equal(mix["targets"][2:], window[2:, 1:])
  np.testing.assert_array_equal(mix["targets"][:2], b0["targets"][:2])


@pytest.fixture(scope="module")
def digits_dataset(data_dir):
  """A second local dataset whose text (digits only) no Shakespeare window can be mistaken for."""
  from spec_jax.training import general_data  # noqa: PLC0415
  text = "0123456789" * 40
  doc = dict(text=text, prompt="", response=text, source="digits")
  docs = {"train": [(f"d{i}", doc) for i in range(8)], "validation": [], "test": []}
  spec = general_data.Spec(seed=12345, topics=1, corpus_prompts=0)
  name = general_data.prepare(docs, spec, "digits", data_dir)
  return name, set(ByteTokenizer().encode("0123456789")) | {ByteTokenizer().eos_id}


def test_blend_takes_its_rows_of_every_batch_from_each_dataset(data_dir, digits_dataset):
  name, digits = digits_dataset
  tok = ByteTokenizer()
  kw = dict(prompt_tokens=6, response_tokens=5, seed=0, data_dir=data_dir)
  main = distill_data.windows("spec_jax_shakespeare", "train", tok, batch_size=3, **kw)
  other = distill_data.windows(name, "train", tok, batch_size=1, **kw)
  blended = distill_data.windows("spec_jax_shakespeare", "train", tok, batch_size=4,
                                 blend=((name, 0.25),), **kw)
  for s in (0, 5, 40):  # 40: past the digits' one epoch of 26 windows
    np.testing.assert_array_equal(blended[s], np.concatenate([main[s], other[s]]))
    assert set(blended[s][3].tolist()) <= digits
    assert not any(set(row.tolist()) <= digits for row in blended[s][:3])
  only = distill_data.windows("spec_jax_shakespeare", "train", tok, batch_size=4,
                              blend=((name, 1.0),), **kw)
  assert all(set(row.tolist()) <= digits for row in only[2])


def test_a_reduced_vocabulary_is_counted_on_the_blend(data_dir, digits_dataset):
  name, _ = digits_dataset
  tok = ByteTokenizer()
  config = testing.with_overrides(distill_config.get_config("smoke"), {
      "data.data_dir": data_dir, "data.blend": ((name, 0.75),), "train.batch_size": 4})
  counts = distill_data.blend_counts(config, tok)
  freq = lambda n: np.bincount(  # noqa: E731
      np.asarray(pipeline.token_stream(n, "train", tok, data_dir=data_dir)),
      minlength=tok.vocab_size) / len(pipeline.token_stream(n, "train", tok, data_dir=data_dir))
  np.testing.assert_allclose(counts, freq("spec_jax_shakespeare") + 3 * freq(name))
  # Digits are rare in Shakespeare; 3 rows of every 4 make them the most frequent tokens.
  top = set(np.argsort(-counts, kind="stable")[:10].tolist())
  assert top == set(ByteTokenizer().encode("0123456789"))


def test_verifier_data_are_cached_and_extended(tmp_path, pair, monkeypatch):
  v_cfg, v_params, _, _ = pair
  spec = distill_data.Spec(source="verifier", prompt_tokens=6, response_tokens=5, batch_size=4)
  calls = []

  def gen(prompts, rng):
    calls.append(1)
    return distill_data.generate_responses(v_params, v_cfg, prompts, rng, sampling=T1,
                                           response_tokens=5)

  make = functools.partial(distill_data.VerifierData, gen, _Windows(), spec=spec,
                           key={"v": "tiny"}, cache_dir=str(tmp_path))
  first = make(num_batches=2)
  assert len(calls) == 2 and len(list(tmp_path.iterdir())) == 1
  again = make(num_batches=2)  # from the cache: no generation
  longer = make(num_batches=3)  # only batch 2 is new
  assert len(calls) == 3
  for s in range(2):
    np.testing.assert_array_equal(first[s][0], again[s][0])
    np.testing.assert_array_equal(first[s][0], longer[s][0])
  np.testing.assert_array_equal(first[0][0][:, :6], _Windows()[0][:, :6])
  # A run killed while generating keeps the batches it finished (the cache is saved as it goes).
  monkeypatch.setattr(distill_data.VerifierData, "SAVE_EVERY_S", 0.0)

  def dies_at_5(prompts, rng):
    if len(calls) == 5:
      raise Killed()
    return gen(prompts, rng)
  with pytest.raises(Killed):
    distill_data.VerifierData(dies_at_5, _Windows(), spec=spec, key={"v": "tiny"},
                              cache_dir=str(tmp_path), num_batches=8)
  assert len(calls) == 5  # batches 3 and 4 were generated before the kill
  resumed = make(num_batches=6)
  assert len(calls) == 6  # only batch 5 was left
  np.testing.assert_array_equal(resumed[2][0], longer[2][0])


def test_a_verifier_pool_is_generated_in_batched_calls_and_cycled(tmp_path, pair):
  """data.verifier_batches / generate_batch / verifier_share: n generated batches, `per_call` of
  them per generation call (their prompts stacked), served as batch s mod n; with a share < 1
  the rest of each batch's rows are the corpus's own windows."""
  v_cfg, v_params, _, _ = pair
  spec = distill_data.Spec(source="verifier", prompt_tokens=6, response_tokens=5, batch_size=4,
                           verifier_batches=3, verifier_share=0.5, generate_batch=4)
  assert spec.verifier_rows == 2
  calls = []

  def gen(prompts, rng):
    calls.append(prompts.shape)
    return distill_data.generate_responses(v_params, v_cfg, prompts, rng, sampling=T1,
                                           response_tokens=5)

  pool = distill_data.VerifierData(gen, _Windows(), spec=spec, key={"v": "pool"},
                                   cache_dir=str(tmp_path), num_batches=3, rows=2, per_call=2)
  # 3 batches round up to 2 whole calls of 2 batches × 2 rows.
  assert calls == [(4, 6), (4, 6)] and pool.num_batches == 4
  for s in range(4):
    seqs, num_new = pool[s]
    assert seqs.shape == (2, 11) and (num_new == 5).all()
    np.testing.assert_array_equal(seqs[:, :6], _Windows()[s][:2, :6])  # its own batch's prompts
  np.testing.assert_array_equal(pool[5][0], pool[1][0])  # cycled
  assert not np.array_equal(pool[0][0][:, 6:], pool[1][0][:, 6:])
  # From the cache: no generation.
  again = distill_data.VerifierData(gen, _Windows(), spec=spec, key={"v": "pool"},
                                    cache_dir=str(tmp_path), num_batches=4, rows=2, per_call=2)
  assert len(calls) == 2
  np.testing.assert_array_equal(again[3][0], pool[3][0])
  data = distill_data.DistillData(spec, _Windows(), verifier_data=pool)
  seqs, num_new = data.responses(6)
  np.testing.assert_array_equal(seqs[:2], pool[2][0])
  np.testing.assert_array_equal(seqs[2:], _Windows()[6][2:])
  np.testing.assert_array_equal(num_new, [5, 5, 5, 5])


# ---------------------------------------------------------------------------------------------
# The program.


@pytest.fixture(scope="module")
def smoke_run(data_dir, tmp_path_factory):
  """One uninterrupted distill:smoke run (evaluated at steps 0 and 6), shared by the tests."""
  config = smoke_config(data_dir, eval_every=6)
  workdir = str(tmp_path_factory.mktemp("distill_smoke"))
  return config, workdir, distill_program.run(config, workdir)


def test_distill_smoke_end_to_end(smoke_run):
  config, workdir, out = smoke_run
  assert out["step"] == 6 and np.isfinite(out["train_loss"])
  rows = metrics_lib.read_jsonl(workdir)
  assert [r["step"] for r in rows] == list(range(7))  # step 0: the initial drafter's eval
  for key in ("eval/fkl", "eval/rkl", "eval/jsd", "eval/tvd", "eval/alpha", "eval/tau_T0",
              "eval/tau_T1", "eval/sd_alpha_T1", "eval/top1_agreement"):
    assert key in rows[0] and key in rows[-1], key
  assert rows[-1]["eval/fkl"] < rows[0]["eval/fkl"]  # it learned something
  assert 1.0 <= rows[-1]["eval/tau_T1"] <= 5.0
  assert {"train/loss", "train/alpha", "train/lr"} <= set(rows[-1])
  # The checkpoint holds the drafter alone, loadable the way evaluate loads drafters.
  cfg, params, meta = checkpoints.load_model(workdir)
  assert cfg == llama.model_config("test-tiny", vocab_size=257)
  assert jax.tree.structure(params) == jax.tree.structure(llama.param_shapes(cfg))
  assert meta["distill"] == {"divergence": "fkl", "beta": 0.5, "source": "onpolicy",
                             "verifier": "test-tiny"}
  from configs import common
  loaded_cfg, _ = loading.resolve_model(common.model(checkpoint=workdir), ByteTokenizer())
  assert loaded_cfg.vocab_size == 257
  # A finished run trains nothing and reports the saved metrics.
  again = distill_program.run(config, workdir,
                              step_hook=lambda s: pytest.fail(f"step {s} dispatched"))
  assert again["step"] == 6 and again["eval"]["fkl"] == pytest.approx(rows[-1]["eval/fkl"])
  # Another distill.freeze changes the optimizer state: refused with the field, before any step.
  assert meta["distill_freeze"] == {"freeze": ""}
  frozen = config.copy_and_resolve_references()
  frozen.distill.freeze = "embed"
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"other `distill` settings .*freeze: saved '', this run 'embed'"):
    distill_program.run(frozen, workdir, step_hook=lambda s: pytest.fail(f"step {s} dispatched"))


def test_resume_after_kill_matches_uninterrupted_run(smoke_run, tmp_path):
  """On-policy data refreshed every 2 steps, checkpoints every 2: a run killed at step 3 and
  resumed from its checkpoint at 2 ends bit-identical to one never interrupted (same params,
  same metrics log), because the lost on-policy data are regenerated from the same params."""
  config, full_dir, _ = smoke_run
  cut_dir = str(tmp_path / "cut")

  def kill_at_3(step):
    if step == 3:
      raise Killed()
  with pytest.raises(Killed):
    distill_program.run(config, cut_dir, step_hook=kill_at_3)
  resumed = []
  distill_program.run(config, cut_dir, step_hook=resumed.append)
  assert resumed == [3, 4, 5, 6]  # from the checkpoint at 2, not from 0
  assert leaves_equal(checkpoints.load_model(full_dir)[1], checkpoints.load_model(cut_dir)[1])
  assert metrics_lib.read_jsonl(cut_dir) == metrics_lib.read_jsonl(full_dir)


def _pool_config(data_dir, **data):
  """distill:smoke on a cycled pool of 2 verifier batches (6 steps: each batch used 3 times)."""
  config = smoke_config(data_dir, eval_every=0)
  config.data.update(source="verifier", verifier_batches=2, **data)
  return config


@pytest.fixture(scope="module")
def pool_runs(data_dir, tmp_path_factory):
  """(config, {name: workdir}, {name: TeacherCache | None}) of distill:smoke runs on a pool:
  with the teacher cache (`cached`: the pool's generation keeps the states), without it
  (`uncached`: teacher_cache_gib = 0, its pool file has no states), with it on that pool file
  (`plain_pool`: the teacher's pass fills it), and with it, killed at step 3 and resumed from
  the checkpoint at step 2 (`resumed`: the states come back from its pool file)."""
  made, dirs = {}, {}

  def run(name, config, **kwargs):
    dirs[name] = str(tmp_path_factory.mktemp(name))
    real = distill_program.teacher_cache

    def spy(*args, **kw):
      made[name] = real(*args, **kw)
      return made[name]
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(distill_program, "teacher_cache", spy)
      return distill_program.run(config, dirs[name], **kwargs)

  config = _pool_config(data_dir)
  run("cached", config)
  shared = str(tmp_path_factory.mktemp("plain_pool_cache"))
  run("uncached", _pool_config(data_dir, teacher_cache_gib=0, cache_dir=shared))
  run("plain_pool", _pool_config(data_dir, cache_dir=shared))

  def kill_at_3(step):
    if step == 3:
      raise Killed()
  with pytest.raises(Killed):
    run("resumed", config, step_hook=kill_at_3)
  first = made["resumed"]
  run("resumed", config)
  made["killed"] = first
  return config, dirs, made


def test_teacher_cache_runs_each_pool_batch_once_and_trains_as_without(pool_runs):
  """A cycled verifier pool: the teacher's states over each pool batch are kept from the pool's
  generation (no teacher pass at all), or where its pool file has none computed once per pool
  batch (2 passes for 6 steps); either way the drafter trains as when every step runs the
  whole teacher (the same updates up to float rounding: only where the states were computed
  differs)."""
  _, dirs, made = pool_runs
  assert made["uncached"] is None
  assert made["cached"].period == 2
  assert (made["cached"].computed, made["cached"].reused) == (0, 2)
  assert (made["plain_pool"].computed, made["plain_pool"].reused) == (2, 0)
  uncached = checkpoints.load_model(dirs["uncached"])[1]
  losses_of = lambda d: [r["train/loss"] for r in metrics_lib.read_jsonl(d) if "train/loss" in r]
  for name in ("cached", "plain_pool"):
    params = checkpoints.load_model(dirs[name])[1]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(uncached)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(losses_of(dirs[name]), losses_of(dirs["uncached"]), rtol=1e-4)


def test_teacher_cache_resumes_bit_identical(pool_runs):
  """Killed at step 3 (cache filled for both pool batches) and resumed at the checkpoint of
  step 2 with an empty cache: the states come back from the pool file as the generation kept
  them, so the run ends bit-identical to the uninterrupted one."""
  _, dirs, made = pool_runs
  assert made["killed"].reused == 2 and made["resumed"].reused == 2
  assert made["killed"].computed == 0 and made["resumed"].computed == 0
  assert leaves_equal(checkpoints.load_model(dirs["cached"])[1],
                      checkpoints.load_model(dirs["resumed"])[1])
  assert metrics_lib.read_jsonl(dirs["cached"]) == metrics_lib.read_jsonl(dirs["resumed"])


@pytest.mark.parametrize("student", ["plain", "features"])
def test_loss_index_makes_the_same_update(pair, student):
  """A batch with LOSS_INDEX (each row's response window) makes the update of the whole batch,
  with the teacher's whole forward and from a teacher cache, for a plain and a feature drafter
  (two passes): both laws at the window alone give the same loss, α and gradient. A window
  shifted by one position does not (the check can fail), and a row weighing more targets than
  the window is refused before any step."""
  v_cfg, v_params, d_cfg, d_params = pair
  layers = ()
  apply, context_fn = llama.make_apply(d_cfg, reduced_logits=True), None
  if student == "features":
    d_cfg, d_params = draft_init.select_layers(v_cfg, v_params, (1,))
    d_cfg, d_params = draft_init.feature_drafter(d_cfg, jax.tree.map(np.asarray, d_params))
    d_params = testing.perturbed(jax.tree.map(jnp.asarray, d_params), 0.3, 1)
    apply, context_fn = features_train.make_student(d_cfg, 0.5, passes=2)
    layers = (draft_init.FINAL,)
  objective = distill.Objective("jsd", beta=0.5, sampling=T1)
  tx, _ = optim.make_optimizer(distill_config.get_config("smoke").train)
  mesh = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
  abstract, shardings = train.abstract_state(functools.partial(llama.init_params, d_cfg), tx,
                                             jax.random.key(0), mesh)
  v_sh = parallel.param_shardings(mesh, v_params)
  body, head = draft_init.teacher_parts(d_cfg, v_cfg, layers)
  step = distill.jit_distill_step(apply, draft_init.restrict(d_cfg, v_cfg, layers), tx,
                                  objective, shardings, v_sh, mesh, context_fn, teacher_head=head)
  # Chat rows: prompts of 3-12 tokens, responses of up to 8 (data.response_tokens = 8), T = 16.
  seqs = np.asarray(jax.random.randint(jax.random.key(2), (4, 17), 1, 257), np.int32)
  batch = distill_data.make_batch(seqs, np.asarray([8, 7, 3, 4]),
                                  prompt_tokens=np.asarray([3, 9, 5, 12]))
  windowed = distill.loss_index(batch, 8)
  assert windowed[distill.LOSS_INDEX].shape == (4, 8)
  assert distill.LOSS_INDEX not in distill.loss_index(batch, 16)  # the whole row: unchanged
  cache = distill.TeacherCache(body, head, v_params, 1, teacher_shardings=v_sh, mesh=mesh)
  shifted = {**windowed, distill.LOSS_INDEX: np.minimum(windowed[distill.LOSS_INDEX] + 1, 15)}
  metrics = {}
  for name, b in (("whole", batch), ("window", windowed),
                  ("window_cached", cache.batch(0, windowed)), ("shifted", shifted)):
    _, m = step(train.state_from_params(d_params, tx, abstract), b, jax.random.key(0), v_params)
    metrics[name] = np.asarray([float(m[k]) for k in ("loss", "alpha", "grad_norm",
                                                       "weight_sum")])
  np.testing.assert_allclose(metrics["window"], metrics["whole"], rtol=1e-5)
  np.testing.assert_allclose(metrics["window_cached"], metrics["whole"], rtol=1e-5)
  assert not np.allclose(metrics["shifted"][:3], metrics["whole"][:3], rtol=1e-3)
  with pytest.raises(ValueError, match=r"Row 0 .* more than 6 positions "
                                       r"\(data.response_tokens=6\): its weights span 2..9"):
    distill.loss_index(batch, 6)


def test_frozen_params_never_move(pair):
  """distill.freeze='embed': the step leaves the token embedding exactly as loaded (no update,
  no moments) and trains the rest; without it the embedding moves. An unknown name is refused
  with the drafter's own names."""
  v_cfg, v_params, d_cfg, d_params = pair
  objective = distill.Objective("jsd", beta=0.5, sampling=T1)
  mesh = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
  v_sh = parallel.param_shardings(mesh, v_params)
  seqs = np.asarray(jax.random.randint(jax.random.key(2), (4, 17), 0, 257), np.int32)
  batch = distill_data.make_batch(seqs, np.full((4,), 8), prompt_tokens=9)
  config = distill_config.get_config("smoke")
  moved = {}
  for freeze in ("", "embed"):
    config.distill.freeze = freeze
    tx = optim.frozen(optim.make_optimizer(config.train)[0],
                      distill._frozen_names(config, d_cfg))
    abstract, shardings = train.abstract_state(functools.partial(llama.init_params, d_cfg), tx,
                                               jax.random.key(0), mesh)
    step = distill.jit_distill_step(llama.make_apply(d_cfg), llama.make_apply(v_cfg), tx,
                                    objective, shardings, v_sh, mesh)
    state, _ = step(train.state_from_params(d_params, tx, abstract), batch, jax.random.key(0),
                    v_params)
    after = jax.device_get(state.params)
    moved[freeze] = {k: not leaves_equal(after[k], d_params[k]) for k in after}
  assert moved[""] == {k: True for k in moved[""]}
  assert moved["embed"] == {k: k != "embed" for k in moved["embed"]}
  config.distill.freeze = "embed+head"
  with pytest.raises(ValueError, match=r"distill.freeze='embed\+head': \['head'\] not among "
                                       r"the drafter's top-level params \[.*'embed'"):
    distill._frozen_names(config, d_cfg)


def test_teacher_cache_step_never_runs_the_teachers_blocks(pair):
  """A batch carrying its teacher pass (TEACHER_HIDDEN) makes the same update as the whole
  teacher's forward, and it never reads the teacher's blocks: with their weights scrambled the
  update is unchanged. A cache that hands a batch another batch's pass raises."""
  v_cfg, v_params, d_cfg, d_params = pair
  objective = distill.Objective("jsd", beta=0.5, sampling=T1)
  train_cfg = distill_config.get_config("smoke").train
  tx, _ = optim.make_optimizer(train_cfg)
  mesh = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
  abstract, shardings = train.abstract_state(functools.partial(llama.init_params, d_cfg), tx,
                                             jax.random.key(0), mesh)
  v_sh = parallel.param_shardings(mesh, v_params)
  body, head = draft_init.teacher_parts(d_cfg, v_cfg)
  steps = {name: distill.jit_distill_step(llama.make_apply(d_cfg), llama.make_apply(v_cfg), tx,
                                          objective, shardings, v_sh, mesh, teacher_head=h)
           for name, h in (("whole", None), ("cached", head))}
  seqs = np.asarray(jax.random.randint(jax.random.key(2), (4, 17), 0, 257), np.int32)
  batch = distill_data.make_batch(seqs, np.full((4,), 8), prompt_tokens=9)
  cache = distill.TeacherCache(body, head, v_params, 2, teacher_shardings=v_sh, mesh=mesh)
  cached_batch = cache.batch(4, batch)
  assert set(cached_batch[distill.TEACHER_HIDDEN]) == {draft_init.FINAL}
  scrambled = {**v_params, "layers": jax.tree.map(lambda x: -3.0 * x, v_params["layers"])}
  params, metrics = {}, {}
  for name, step, teacher, b in (("whole", steps["whole"], v_params, batch),
                                 ("cached", steps["cached"], v_params, cached_batch),
                                 ("scrambled", steps["cached"], scrambled, cached_batch),
                                 ("whole_scrambled", steps["whole"], scrambled, batch)):
    state, m = step(train.state_from_params(d_params, tx, abstract), b, jax.random.key(0),
                    teacher)
    params[name] = jax.device_get(state.params)
    metrics[name] = np.asarray([float(m[k]) for k in ("loss", "alpha", "grad_norm")])
  # Gradients, not Adam's first update, are compared: that update is ±lr wherever a gradient
  # is nonzero, so float rounding of a near-zero gradient flips it.
  np.testing.assert_allclose(metrics["cached"], metrics["whole"], rtol=1e-5)
  assert leaves_equal(params["cached"], params["scrambled"])
  # The scrambled blocks do change a whole pass.
  assert not np.allclose(metrics["whole_scrambled"], metrics["whole"], rtol=1e-2)
  assert cache.batch(6, batch)[distill.TEACHER_HIDDEN] is cached_batch[distill.TEACHER_HIDDEN]
  assert cache.computed == 1
  other = distill_data.make_batch(seqs[::-1].copy(), np.full((4,), 8), prompt_tokens=9)
  with pytest.raises(RuntimeError, match="batch 2 is not pool batch 0"):
    cache.batch(2, other)


@pytest.mark.parametrize("overrides, message", [
    ({"distill.divergence": "kl"}, r"distill.divergence='kl' is not known; choose one of"),
    ({"distill.beta": 1.5}, r"distill.beta must be in \[0, 1\]"),
    ({"distill.temperature": 0.0}, r"distill.temperature=0 \(greedy\) has no gradient"),
    ({"data.source": "teacher"}, r"data.source='teacher' is not a data source"),
    ({"data.mix_lambda": 2.0}, r"data.mix_lambda must be in \[0, 1\]"),
    ({"data.verifier_share": 0.5}, r"data.verifier_share=0.5 needs data.source='verifier'"),
    ({"data.source": "verifier", "data.verifier_share": 0.0},
     r"data.verifier_share must be in \(0, 1\]"),
    ({"data.source": "verifier", "data.generate_batch": 12},
     r"data.generate_batch=12 must be a multiple of the 8 verifier rows"),
    ({"data.verifier_batches": -1}, r"data.verifier_batches must be an integer >= 0"),
    ({"data.teacher_cache_gib": -1.0}, r"data.teacher_cache_gib=-1.0 must be a number >= 0"),
    ({"data.blend": (("spec_jax_general/x", 0.01),)},
     r"data.blend gives 'spec_jax_general/x' the fraction 0.01, which is 0 of the 8 rows"),
    ({"data.blend": (("a", 0.75), ("b", 0.5))}, r"data.blend's fractions take 10 of the 8 rows"),
    ({"data.blend": ("spec_jax_general/x",)}, r"data.blend entry 'spec_jax_general/x' is not a"),
    ({"train.checkpoint_every": 3},
     r"train.checkpoint_every=3 must be a multiple of data.refresh_every=2"),
    ({"drafter.size": "test-tiny:vocab=64", "distill.top_p": 0.9, "distill.divergence": "jsd"},
     r"distill.top_p=0.9 with a reduced-vocabulary drafter .*Fix: --config.distill.top_p=1.0"),
])
def test_bad_config_is_named_before_anything_loads(tmp_path, overrides, message):
  config = testing.with_overrides(distill_config.get_config("smoke"), overrides)
  with pytest.raises(ValueError, match=message):
    distill_program.run(config, str(tmp_path))


def test_vocab_mismatch_names_both_models():
  config = distill_config.get_config("smoke")
  v_cfg = llama.model_config("test-tiny", vocab_size=300)
  with pytest.raises(ValueError, match=r"Drafter vocab_size=257 \(drafter.checkpoint=''.*"
                     r"verifier's vocab_size=300 \(verifier.checkpoint=''"):
    distill.check_vocab(v_cfg, llama.model_config("test-tiny"), config)


# ---------------------------------------------------------------------------------------------
# Lenient decoding and its quality cost.


def test_lenience_eps1_is_lossless_decoding_end_to_end(pair):
  # One lenience end to end (f_exp: the one with a pow); acceptance-level tests cover all three.
  lenience = "exp"
  v_cfg, v_params, d_cfg, d_params = pair
  prompts = generate_lib.pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8]], 8, 0)
  common = dict(sampling=T1, max_new_tokens=12, gamma=3)
  lossless = testing.lm_speculative(v_cfg, v_params, d_cfg, d_params, prompts, jax.random.key(5),
                                    decode=loop.DecodeConfig("speculative"), **common)
  lenient = testing.lm_speculative(
      v_cfg, v_params, d_cfg, d_params, prompts, jax.random.key(5),
      decode=loop.DecodeConfig("lenient", lenience=lenience, epsilon=1.0), **common)
  assert leaves_equal(lossless, lenient)  # tokens, lengths and every counter


def test_lenient_law_matches_the_rule_and_quality_columns(pair):
  # π from quality.lenient_law must be the law the rule emits at a draft position: sample the
  # rule (γ = 1) and test the emitted token against π (chi-square), and against p (rejected).
  p = jnp.asarray([0.45, 0.3, 0.15, 0.1])
  q = jnp.asarray([0.1, 0.2, 0.3, 0.4])
  pi = np.asarray(quality.lenient_law(p, q, "lin", 0.5))
  n = 20000
  keys = jax.random.split(jax.random.key(9), n)

  @jax.jit
  @jax.vmap
  def emit(key):
    k_draft, k_rule = jax.random.split(key)
    x = jax.random.categorical(k_draft, jnp.log(q))[None, None].astype(jnp.int32)
    v = chain_rules.lenient(jnp.stack([p, p])[None], q[None, None], x, k_rule, lenience="lin",
                           epsilon=0.5)
    return jnp.where(v.num_accepted[0] == 1, x[0, 0], v.next_token[0])
  counts = np.bincount(np.asarray(emit(keys)), minlength=4)
  assert stats.chisquare(counts, pi * n).pvalue > 1e-3
  assert stats.chisquare(counts, np.asarray(p) * n).pvalue < 1e-6
  np.testing.assert_allclose(quality.lenient_law(p, q, "exp", 1.0), p, atol=1e-7)

  # Quality of real outputs: ε = 1 has TV ≈ 0; ε = 0.2 moves the law away from p.
  v_cfg, v_params, d_cfg, d_params = pair
  prompts = generate_lib.pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8]], 8, 0)
  out = testing.lm_speculative(v_cfg, v_params, d_cfg, d_params, prompts, jax.random.key(1),
                               sampling=T1, max_new_tokens=12)
  common = dict(verifier_cfg=v_cfg, drafter_cfg=d_cfg, sampling=T1)
  lossless = quality.summarize([quality.quality_sums(v_params, d_params, out, **common)])
  lossy = quality.summarize([quality.quality_sums(v_params, d_params, out, lenience="lin",
                                                  epsilon=0.2, **common)])
  assert abs(lossless["token_tv"]) < 1e-5 and lossy["token_tv"] > 0.05
  assert lossless["verifier_loglik"] == lossy["verifier_loglik"] < 0
  # The log-likelihood is the raw verifier's, by hand for row 0 (prompt 3 + 12 new tokens).
  row = quality.quality_sums(v_params, d_params, out, **common)
  toks = out.tokens[:1, :15]
  logp = jax.nn.log_softmax(forward(v_cfg, v_params, toks)[0])
  by_hand = sum(float(logp[t - 1, int(toks[0, t])]) for t in range(3, 15))
  assert row["tokens"][0] == 12 and row["loglik_sum"][0] == pytest.approx(by_hand, rel=1e-5)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(1), cfg=v_cfg, sampling=T1,
                             max_new_tokens=12)
  ar_q = quality.summarize([quality.quality_sums(v_params, None, ar, verifier_cfg=v_cfg,
                                                 drafter_cfg=None, sampling=T1)])
  assert ar_q["token_tv"] == 0.0 and ar_q["verifier_loglik"] < 0
  # Autoregressive rows run the verifier alone: the same raw log-likelihood, by hand.
  ar_row = quality.quality_sums(v_params, None, ar, verifier_cfg=v_cfg, drafter_cfg=None,
                                sampling=T1)
  toks = ar.tokens[:1, :15]
  logp = jax.nn.log_softmax(forward(v_cfg, v_params, toks)[0])
  by_hand = sum(float(logp[t - 1, int(toks[0, t])]) for t in range(3, 15))
  assert ar_row["tokens"][0] == 12 and ar_row["loglik_sum"][0] == pytest.approx(by_hand, rel=1e-5)
  with pytest.raises(ValueError, match="decode.epsilon must be in"):
    quality.quality_sums(v_params, d_params, out, lenience="lin", epsilon=0.0, **common)
