"""Feature drafters (EAGLE; `models/draft_init.feature_drafter`, `decoding/drafters/features.py`,
`training/features.py`): after the prompt and after every verification the drafter's law for the
next first draft is exactly its teacher-forced law over the committed text with the verifier's
features (the cache holds the right pairs at the right slots), greedy SD equals the verifier's
greedy output token for token, sampled SD is lossless (chi-square; a planted bug that reports
another law fails it), distill trains one and evaluate decodes with it, bad input names the
field."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import distill as distill_config
from configs import evaluate as evaluate_config
from configs import train_lm as train_lm_config
from experiments.perf import config as perf_config
from spec_jax import testing
from spec_jax.decoding import acceptance
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import features, trees
from spec_jax.decoding.sampling import Sampling, probs_from_logits
from spec_jax.models import draft_init, hf_export, llama
from spec_jax.programs import distill as distill_program
from spec_jax.programs import cost_model, evaluate, train_lm
from spec_jax.training import distill, divergences
from spec_jax.training import features as features_train

PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 8], [6, 1, 2, 9]]


def _models(vocab_size=16, sharpness=2.0, sigma=0.3, layers=(1,), seed=1):
  """(v_cfg, v_params, d_cfg, d_params): a tiny verifier and a feature drafter made of its
  `layers`, every drafter weight perturbed by N(0, sigma²); a small vocabulary so that even
  greedy drafts are accepted sometimes, not always."""
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=vocab_size, sharpness=sharpness)
  d_cfg, d_params = draft_init.select_layers(v_cfg, jax.tree.map(np.asarray, v_params), layers)
  d_cfg, d_params = draft_init.feature_drafter(d_cfg, d_params)
  d_params = testing.perturbed(jax.device_put(d_params), sigma, seed)
  return v_cfg, v_params, d_cfg, d_params


def _teacher_forced_law(v_cfg, v_params, d_cfg, d_params, seq: list[int],
                        width: int = 40) -> np.ndarray:
  """The drafter's law f32[V] of the token after `seq`, teacher-forced over the whole text with
  the verifier's features (training's forward: pairs (f_{t−1}, x_t)). The text is padded to
  `width` so that one compiled forward serves every length; both models are causal, so the
  padding after the text leaves its last position's law unchanged."""
  x = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
  return np.asarray(_teacher_forced_laws(v_cfg, d_cfg, v_params, d_params, x))[len(seq) - 1]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _teacher_forced_laws(v_cfg, d_cfg, v_params, d_params, x):
  positions = jnp.arange(x.shape[1])[None]
  _, hidden, _ = llama.make_apply(v_cfg, (-1,))(v_params, x, positions)
  logits, _, _ = features_train.feature_apply(d_params, x, positions, features=hidden[-1],
                                              cfg=d_cfg, feature_weight=0.0)
  return jax.nn.softmax(logits[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_next_first_draft_law_is_the_teacher_forced_law(temperature):
  """Drive init / propose / score / rule / commit by hand on a ragged batch: after the prompt
  and after each round, the law the drafter keeps for the next round's first draft equals the
  teacher-forced law over the committed text (a wrong feature, token or slot in the commit
  window changes it). The prefill and the round are jitted once each (every round has the same
  shapes); the host keeps the text."""
  v_cfg, v_params, d_cfg, d_params = _models()
  gamma = 3
  drafter = features.FeatureDrafter(d_cfg, trees.chain(gamma))
  verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  sampling = Sampling(temperature)
  rule = acceptance.RULES["greedy" if sampling.greedy else "speculative"]
  width, size = 8, 40

  @jax.jit
  def prefill(v_params, d_params, prompt_tokens, prompt_lengths):
    v_cache, v_hidden = verifier.init(v_params, prompt_tokens, size)
    state = drafter.init(d_params, prompt_tokens, prompt_lengths, size, v_hidden)
    return state, v_cache, jax.nn.softmax(state["logits"])

  @jax.jit
  def one_round(v_params, d_params, state, v_cache, tokens, lengths, rng):
    proposal, state = drafter.propose(d_params, state, tokens, lengths, rng, sampling)
    logits, hidden, v_cache = verifier.score(v_params, v_cache, proposal, lengths)
    verdict = rule(probs_from_logits(logits, sampling), proposal, jax.random.fold_in(rng, 1))
    v_cache = verifier.commit(v_cache, lengths, verdict)
    state = drafter.commit(d_params, state, proposal, verdict, lengths, hidden)
    return (state, v_cache, jax.nn.softmax(state["logits"]), proposal.tokens,
            verdict.num_accepted, verdict.next_token)

  prompts = generate_lib.pad_prompts(PROMPTS, width, pad_id=0)
  state, v_cache, laws = prefill(v_params, d_params, prompts.tokens, prompts.lengths)
  seqs = [list(p) for p in PROMPTS]
  counts = set()
  for step in range(6):
    for b, seq in enumerate(seqs):
      np.testing.assert_allclose(np.asarray(laws)[b],
                                 _teacher_forced_law(v_cfg, v_params, d_cfg, d_params, seq),
                                 atol=2e-5, err_msg=f"round {step}, row {b}")
    tokens = np.asarray([s + [0] * (size - len(s)) for s in seqs], np.int32)
    lengths = np.asarray([len(s) for s in seqs], np.int32)
    state, v_cache, laws, drafted, num_accepted, next_token = one_round(
        v_params, d_params, state, v_cache, tokens, lengths, jax.random.key(step))
    drafted, num_accepted, next_token = map(np.asarray, (drafted, num_accepted, next_token))
    for b, seq in enumerate(seqs):
      n = int(num_accepted[b])
      counts.add(n)
      seq += [int(t) for t in drafted[b, 1:n + 1]] + [int(next_token[b])]
  assert len(counts) > 1  # rounds accepted different numbers of drafts


def test_greedy_feature_sd_equals_verifier_greedy():
  v_cfg, v_params, d_cfg, d_params = _models()
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=16)
  drafter = features.FeatureDrafter(d_cfg, trees.chain(3))
  out = loop.speculative_generate(
      v_params, d_params, prompts, jax.random.key(0),
      verifier=verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers), drafter=drafter,
      sampling=Sampling(), max_new_tokens=16)
  assert out.new_tokens() == ar.new_tokens()
  accepted = np.asarray(out.stats.accepted)
  assert accepted.sum() > 0 and (accepted < np.asarray(out.stats.verifier_calls) * 3).any()


class _OtherLawDrafter(features.FeatureDrafter):
  """Planted bug: drafts from the drafter's law but reports the verifier-feature-free law (the
  drafter fed zero features) as q."""

  def propose(self, params, state, tokens, lengths, rng, sampling):
    proposal, new_state = super().propose(params, state, tokens, lengths, rng, sampling)
    flat = jax.nn.softmax(jnp.zeros_like(proposal.q[..., :1]) + proposal.q ** 0.5, axis=-1)
    return proposal.replace(q=jnp.where(proposal.q > 0, flat, 0.0)), new_state


def _law_check(cls=features.FeatureDrafter):
  v_cfg, v_params, d_cfg, d_params = _models(vocab_size=6, sharpness=3.0, sigma=0.5)
  return testing.sd_law_pvalue(v_cfg, v_params, cls(d_cfg, trees.chain(2)), d_params, [1, 4, 2])


def test_feature_sampling_is_lossless():
  assert _law_check() > 1e-3


def test_reporting_another_law_is_caught():
  assert _law_check(_OtherLawDrafter) < 1e-6


def test_distill_trains_a_feature_drafter_that_evaluate_decodes(tmp_path):
  """distill builds a feature drafter from a checkpoint's block 1 with a reduced vocabulary
  (size ...:features=1), trains it (its feature loss is logged) and saves it, with its held-out
  τ; evaluate loads it, measures c by forward timing and decodes greedy output identical to the
  verifier's."""
  source = str(tmp_path / "lm")
  train_lm.run(testing.with_overrides(train_lm_config.get_config("smoke"), {
      "train.num_steps": 1, "train.eval_every": 0, "train.checkpoint_every": 1}), source)
  config = distill_config.get_config("smoke,source=fixed")
  config.drafter.update(size="test-tiny:layers=1:features=1:vocab=200", checkpoint="")
  with pytest.raises(ValueError, match=r"drafter.size='test-tiny:layers=1:features=1:vocab="
                                       r"200' keeps some layers of a pretrained model"):
    distill_program.run(config, str(tmp_path / "none"))
  config.drafter.checkpoint = source
  workdir = str(tmp_path / "drafter")
  assert distill_program.run(config, workdir)["step"] == config.train.num_steps
  assert "tau_T0" in distill_program.read_result(workdir)["eval"]
  assert "train/aux_loss" in (tmp_path / "drafter" / "metrics.jsonl").read_text()
  ev = evaluate_config.get_config("smoke")
  ev.drafter.checkpoint = workdir
  ev.eval.update(temperatures=(0.0,), gammas=(2,), methods=("sd", "dyn:2-4"))
  rows = [r for r in evaluate.run(ev, str(tmp_path / "eval")) if r["method"] != "autoregressive"]
  assert {r["method"] for r in rows} == {"sd", "dyn"}
  assert all(r["identical_to_greedy"] and r["cost_ratio_c"] > 0 for r in rows)
  # c, r(M) and s(w) were timed beside the verifier's one-token forward, checked against the
  # autoregressive step for a slow spell.
  assert all(r["reference_vs_step"] > 0 for r in rows)
  # The theory counts a round's drafting: the chain's γ calls at c each; the tree's calls at
  # c(w) each, w the tokens a call feeds (the root's 1, then K = 2 frontier nodes), s(w) timed.
  for r in rows:
    assert r["theoretical_speedup"] == pytest.approx(
        r["block_efficiency"] / (r["verifier_cost_ratio_r"] + r["drafter_c"]), rel=1e-3)
  sd, dyn = (next(r for r in rows if r["method"] == m) for m in ("sd", "dyn"))
  assert sd["drafter_c"] == pytest.approx(2 * sd["cost_ratio_c"], abs=1e-4)
  assert sd["call_widths"] is None and sd["call_costs"] is None
  assert dyn["call_widths"] == [1, 2] and dyn["drafter_calls_per_round"] == 2
  assert dyn["call_costs"][0] == dyn["cost_ratio_c"] and dyn["call_costs"][1] > 0
  assert dyn["drafter_c"] == pytest.approx(sum(dyn["call_costs"]), abs=2e-4)
  # The cost model times and decodes it too (its forward needs features).
  perf = perf_config.get_config("smoke")
  perf.drafter.checkpoint = workdir
  rows = cost_model.run(perf, str(tmp_path / "cost"))
  assert all(r["c"] > 0 for r in rows if r["model"] == "drafter")
  checks = [r for r in rows if r["model"] == "speculative"]
  assert checks and all(1.0 <= r["tau"] <= 3.0 for r in checks)
  # On-policy data is sampled from the drafter alone, which a feature drafter cannot run.
  onpolicy = distill_config.get_config("smoke,source=onpolicy")
  onpolicy.drafter.update(checkpoint=workdir, size="")
  with pytest.raises(ValueError, match=r"data.source='onpolicy' samples responses from the "
                                       r"drafter alone, .* is a feature drafter"):
    distill_program.run(onpolicy, str(tmp_path / "onpolicy"))


def test_training_passes_and_their_loss():
  """Pass 2 reads the features pass 1 predicted (one position back); distill's loss adds the
  objective on pass 2's law and the mean feature regression to pass 1's objective. (Each
  forward is jitted: run eagerly, every op and each layer scan compiles a program of its own.)"""
  v_cfg, v_params, d_cfg, d_params = _models()
  x = jnp.asarray([[3, 1, 4, 1, 5, 9, 2]], jnp.int32)
  pos = jnp.arange(7)[None]
  t_logits, hidden, _ = jax.jit(llama.make_apply(v_cfg, (-1,)))(v_params, x, pos)
  f = hidden[-1]
  student = functools.partial(features_train.feature_apply, features=f, cfg=d_cfg,
                              feature_weight=0.5, passes=2)

  @jax.jit
  def by_hand_and_student(params):
    apply = llama.make_apply(d_cfg, (-1,), reduced_logits=True)
    l1, h1, _ = apply(params, x, pos, features=features.shift(f))
    l2, h2, _ = apply(params, x, pos, features=features.shift(h1[-1]))
    return l1, h1, l2, h2, student(params, x, pos)

  l1, h1, l2, h2, (logits, aux, _) = by_hand_and_student(d_params)
  np.testing.assert_allclose(logits, l1, atol=1e-6)
  np.testing.assert_allclose(aux["extra_logits"][0], l2, atol=1e-6)
  reg = 0.5 * (features_train.feature_loss(h1[-1], f) + features_train.feature_loss(h2[-1], f)) / 2
  np.testing.assert_allclose(aux["aux_loss"], reg, rtol=1e-6)
  objective = distill.Objective("fkl")
  log_p = divergences.log_law(t_logits, objective.sampling)
  batch = {"inputs": x, "targets": x, "weights": jnp.ones((1, 7))}
  loss, metrics = jax.jit(functools.partial(distill.distill_loss, student_apply=student,
                                            objective=objective))(d_params, log_p, batch)
  fkl = jax.jit(lambda lg: jnp.mean(divergences.DIVERGENCES["fkl"](
      log_p, divergences.log_law(lg, objective.sampling), 0.5)))
  np.testing.assert_allclose(metrics["loss"], fkl(l1), rtol=1e-5)
  np.testing.assert_allclose(loss, fkl(l1) + fkl(l2) + reg, rtol=1e-5)


def test_bad_input_names_the_field():
  with pytest.raises(ValueError, match=r"model.size='test-tiny:features=2': features=1 makes"):
    draft_init.parse_size("test-tiny:features=2")
  v_cfg, v_params, d_cfg, _ = _models()
  wider = llama.model_config("test-tiny", d_model=48, head_dim=12)
  with pytest.raises(ValueError, match=r"drafter.checkpoint is a feature drafter reading the "
                                       r"verifier's residual stream of width 32, but the "
                                       r"verifier's is 48"):
    draft_init.check_feature_width(wider, d_cfg)
  with pytest.raises(ValueError, match=r"needs a feature drafter"):
    features.FeatureDrafter(v_cfg)
  with pytest.raises(ValueError, match=r"distill.feature_weight=-1.0 must be a finite number >= 0"):
    features_train.make_student(d_cfg, -1.0)
  with pytest.raises(ValueError, match=r"distill.feature_passes=0 must be >= 1"):
    features_train.make_student(d_cfg, 1.0, 0)
  with pytest.raises(ValueError, match=r"is a feature drafter .* transformers' Llama cannot"):
    hf_export.params_to_hf(d_cfg, _models()[3])
  with pytest.raises(ValueError, match=r"reads features of width 32 beside its tokens"):
    llama.make_apply(d_cfg)(jax.tree.map(jnp.asarray, _models()[3]), jnp.zeros((1, 2), jnp.int32),
                            jnp.zeros((1, 2), jnp.int32))


def test_feature_loss_leaves_out_positions_past_the_response():
  """The regression averages over valid positions only: what sits past a row's response (chat
  padding) changes nothing, and an all-valid mask is the plain mean."""
  feature_loss = jax.jit(features_train.feature_loss)
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  pred, target = jax.random.normal(k1, (2, 5, 8)), jax.random.normal(k2, (2, 5, 8))
  valid = jnp.array([[True] * 5, [True, True, True, False, False]])
  full = feature_loss(pred, target)
  assert jnp.allclose(feature_loss(pred, target, jnp.ones((2, 5), bool)), full)
  masked = feature_loss(pred, target, valid)
  junk = pred.at[1, 3:].set(jax.random.normal(k3, (2, 8)) * 100)
  assert jnp.allclose(feature_loss(junk, target, valid), masked)
  assert not jnp.allclose(feature_loss(junk, target), full)
