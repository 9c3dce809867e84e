"""EAGLE-3 options for feature drafters: multi-layer features (`cfg.feature_layers`, size
'...:features=a+b+c'; `drafters/features.py`, `draft_init.feature_drafter`) and training-time
test weights (`distill.pass_decay`, `training/features.py`). Greedy decoding with a multi-layer
drafter (chain, a tree, dyn) equals the verifier's greedy output token for token on a ragged
batch with stop tokens; after random acceptances the drafter's cache, law and feature equal a
fresh forward over the committed text; sampled drafts emit the verifier's law (chi-square at
T = 1; a drafter reporting another law, the planted bug, fails it); its fc starts at the
final-residual drafter; pass weights are exact (decay 1 is the plain sum bit for bit); distill
trains one from a checkpoint and decoding loads it; bad sizes and settings name the field."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from configs import distill as distill_config
from spec_jax import loading, testing
from spec_jax.data.tokenizer import get_tokenizer
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import methods
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import dyn, features, standard, trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import draft_init, llama
from spec_jax.programs import distill as distill_program
from spec_jax.training import checkpoints, distill, divergences, train
from spec_jax.training import features as features_train

SHAPES = {"sd": trees.chain(3), "rsd_c": standard.tree("rsd_c", 3, (2, 2)),
          "dyn": dyn.shape((2, 5), 3, None, 3)}


# ---------------------------------------------------------------------------------------------
# Sizes, the fc's start, bad input.

def test_sizes_parse_and_bad_ones_name_the_field():
  size = draft_init.parse_size("smollm2-135m:layers=29:features=2+15+26:vocab=8192")
  assert (size.layers, size.features, size.feature_layers, size.vocab) == ((29,), 1,
                                                                          (2, 15, 26), 8192)
  assert draft_init.parse_size("x:layers=1:features=1").feature_layers == ()
  assert draft_init.parse_size("x:features=0,3").feature_layers == (0, 3)
  lists = "features= lists two or more distinct verifier depths >= 0"
  for bad, match in [("x:features=2", "features=1 makes a feature drafter"),
                     ("x:features=26+", lists), ("x:features=3+3", lists),
                     ("x:features=-1+3", lists), ("x:features=a+b", "features takes integers")]:
    with pytest.raises(ValueError, match=rf"^drafter\.size='{re.escape(bad)}': {match}"):
      draft_init.parse_size(bad, "drafter.size")


def test_bad_settings_name_the_field():
  v_cfg = llama.model_config("test-tiny", vocab_size=16)
  block = dataclasses.replace(v_cfg, n_layers=1)
  d_cfg, _ = draft_init.feature_drafter(block, None, (0, 1, 2))
  deep, _ = draft_init.feature_drafter(block, None, (1, 2, 5))
  with pytest.raises(ValueError, match=r"drafter.checkpoint is a feature drafter reading the "
                                       r"verifier's residual at depths \[1, 2, 5\], but the "
                                       r"verifier has 2 layers"):
    draft_init.check_feature_width(v_cfg, deep)
  with pytest.raises(ValueError, match=r"the verifier's residual stream at layer 5, but the "
                                       r"verifier has 2 layers"):
    verifier_lib.lm_verifier(v_cfg, features.FeatureDrafter(deep).verifier_layers)
  with pytest.raises(ValueError, match=r"feature_layers=\(1, 2\) needs a feature drafter"):
    llama.model_config("test-tiny", feature_layers=(1, 2))
  with pytest.raises(ValueError, match=r"distill.pass_decay=0.0 must be a number > 0"):
    features_train.make_student(d_cfg, 0.0, 3, 0.0)
  with pytest.raises(ValueError, match=r"distill.feature_passes=1: a multi-layer feature drafter "
                                       r".* Fix: --config.distill.feature_passes=3"):
    features_train.make_student(d_cfg, 0.0, 1)
  # distill trains the drafter drafter.size asks for or nothing (a checkpoint's config wins over
  # size, and a loader that dropped the depths would give a final-residual drafter).
  config = distill_config.get_config("smoke")
  config.distill.feature_passes = 2
  for size, model, reads in [("test-tiny:features=0+1", d_cfg, r"\[0, 1, 2\]"),
                             ("test-tiny:layers=1:features=0+1+2",
                              draft_init.feature_drafter(block, None)[0], "the final residual")]:
    config.drafter.size = size
    with pytest.raises(ValueError, match=rf"^drafter.size='{re.escape(size)}' asks for a feature "
                                         rf"drafter reading verifier depths .*, but "
                                         rf"drafter.checkpoint='' gives one reading {reads}\."):
      distill.plain_student(config, v_cfg, model, None)
  config.drafter.size = "test-tiny:layers=1:features=0+1+2"
  assert distill.plain_student(config, v_cfg, d_cfg, None).teacher_layers == (0, 1, 2)


def test_fc_starts_at_the_final_residual_drafter():
  """feature_fc starts as the identity on the deepest depth's slot (zeros elsewhere): with the
  final residual (depth 2 of 2) deepest, the drafter's teacher-forced law is the final-residual
  drafter's, up to the unit-RMS eps; its checkpoint shapes include the fc."""
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=16, sharpness=2.0)
  cfg, params = draft_init.select_layers(v_cfg, jax.tree.map(np.asarray, v_params), (1,))
  one_cfg, one = draft_init.feature_drafter(cfg, params)
  multi_cfg, multi = draft_init.feature_drafter(cfg, params, (0, 1, 2))
  kernel = multi["feature_fc"]["kernel"]
  np.testing.assert_array_equal(kernel, np.concatenate([np.zeros((64, 32)), np.eye(32)]))
  assert features.FeatureDrafter(multi_cfg).verifier_layers == (0, 1, 2)
  assert jax.tree.map(lambda x: x.shape, llama.param_shapes(multi_cfg))["feature_fc"] == {
      "kernel": (96, 32)}
  assert multi_cfg.num_params == one_cfg.num_params + 96 * 32
  x = jnp.asarray([[3, 1, 4, 1, 5, 9, 2]], jnp.int32)
  pos = jnp.arange(7)[None]
  _, hidden, _ = jax.jit(llama.make_apply(v_cfg, (0, 1, 2)))(v_params, x, pos)
  law = lambda c, p, f: jax.jit(functools.partial(  # noqa: E731
      features_train.feature_apply, cfg=c, feature_weight=0.0))(p, x, pos, features=f)[0]
  want = law(one_cfg, one, hidden[2])
  # Unit RMS twice (each depth, then the decoder's input): a relative eps / ms(f) ≈ 5e-4 here,
  # where the residual's rms is ~0.04; reading depth 1 instead moves the logits by > 0.05.
  np.testing.assert_allclose(law(multi_cfg, multi, hidden), want, atol=1e-3)
  other_cfg, other = draft_init.feature_drafter(cfg, params, (0, 1))
  assert np.abs(law(other_cfg, other, hidden) - want).max() > 0.05


# ---------------------------------------------------------------------------------------------
# Decoding.

@pytest.fixture(scope="module")
def models():
  return testing.tiny_eagle3_pair()


@pytest.fixture(scope="module")
def greedy_reference(models):
  return testing.greedy_reference(*models[:2])


@pytest.mark.parametrize("method", sorted(SHAPES))
def test_greedy_multi_layer_drafter_equals_verifier_greedy(method, models, greedy_reference):
  v_cfg, v_params, d_cfg, d_params = models
  drafter = features.FeatureDrafter(d_cfg, SHAPES[method])
  testing.assert_greedy_equal(v_cfg, v_params, drafter, d_params, greedy_reference)


def test_drafter_state_after_random_acceptance_is_a_fresh_forward():
  """Rounds of propose / verifier score / a random accepted path and next token / both commits,
  over a dynamic tree: the drafter's K/V at every committed slot, and the law and predicted
  feature it keeps, equal a fresh forward over the committed text reading feature_fc of the
  verifier's layers (a wrong depth, node, token or slot in the commit changes them)."""
  v_cfg, v_params, d_cfg, d_params = testing.tiny_eagle3_pair()
  drafter = features.FeatureDrafter(d_cfg, dyn.shape((3, 4), 3, None, 3))
  state, tokens, lengths, depths = testing.feature_rounds(v_cfg, v_params, drafter, d_params)
  assert max(depths) == 3 and len(depths) >= 3  # paths of several depths, the deepest too
  testing.assert_fresh_feature_state(v_cfg, v_params, drafter, d_params, state, tokens, lengths)


class _OtherLawDrafter(features.FeatureDrafter):
  """Planted bug: drafts from the drafter's law but reports another law (q flattened to
  q^0.5, renormalised) as the one it drew from."""

  def propose(self, params, state, tokens, lengths, rng, sampling):
    proposal, new_state = super().propose(params, state, tokens, lengths, rng, sampling)
    flat = jax.nn.softmax(jnp.zeros_like(proposal.q[..., :1]) + proposal.q ** 0.5, axis=-1)
    return proposal.replace(q=jnp.where(proposal.q > 0, flat, 0.0)), new_state


def _law_pvalue(cls=features.FeatureDrafter):
  """p-value of the first two tokens sampled at T = 1 by chain SD (γ = 2) with a multi-layer
  drafter, against the verifier's exact law."""
  v_cfg, v_params, d_cfg, d_params = testing.tiny_eagle3_pair(vocab_size=6, sharpness=3.0,
                                                               sigma=0.5)
  return testing.sd_law_pvalue(v_cfg, v_params, cls(d_cfg, trees.chain(2)), d_params, [1, 4, 2])


def test_sampled_multi_layer_drafts_are_lossless():
  assert _law_pvalue() > 1e-3


def test_reporting_another_law_is_caught():
  assert _law_pvalue(_OtherLawDrafter) < 1e-6


# ---------------------------------------------------------------------------------------------
# Training: pass weights, the multi-layer forward, a distill smoke.

def _passes(d_cfg, d_params, v_cfg, v_params, x, pos, passes):
  """The verifier's log-law and the drafter's laws and final residuals of `passes` passes by
  hand (pass k + 1 reading pass k's residual one position back), final-residual drafter."""
  t_logits, hidden, _ = llama.make_apply(v_cfg, (-1,))(v_params, x, pos)
  apply = llama.make_apply(d_cfg, (-1,), reduced_logits=True)
  laws, feats, feed = [], [], hidden[-1]
  for _ in range(passes):
    logits, h, _ = apply(d_params, x, pos, features=features.shift(feed))
    feed = h[-1]
    laws.append(logits)
    feats.append(feed)
  return divergences.log_law(t_logits, Sampling(1.0)), hidden[-1], laws, feats


def test_pass_decay_weights_the_passes():
  """decay = 1 is the plain loss bit for bit (each pass's objective summed, the feature loss
  their mean: no weights passed); decay = 0.8 weighs pass j by w_j = 0.8^j / Σ 0.8^i in both
  (the laws' sum scaled by the number of passes). The passes by hand and both losses are one
  jitted program (run eagerly, every op and each layer scan compiles a program of its own)."""
  v_cfg, v_params, d_cfg, d_params = testing.tiny_feature_pair()
  x = jnp.asarray([[3, 1, 4, 1, 5, 9, 2]], jnp.int32)
  pos = jnp.arange(7)[None]
  objective = distill.Objective("fkl")
  batch = {"inputs": x, "targets": x, "weights": jnp.ones((1, 7))}

  @jax.jit
  def by_hand_and_losses(d_params, v_params):
    log_p, f, laws, feats = _passes(d_cfg, d_params, v_cfg, v_params, x, pos, 3)
    fkl = [divergences.masked_mean(divergences.DIVERGENCES["fkl"](
        log_p, divergences.log_law(lg, objective.sampling), 0.5), batch["weights"])
           for lg in laws]
    reg = [features_train.feature_loss(h, f) for h in feats]

    def loss(decay):
      student = functools.partial(features_train.feature_apply, features=f, cfg=d_cfg,
                                  feature_weight=0.5, passes=3, decay=decay)
      return distill.distill_loss(d_params, log_p, batch, student_apply=student,
                                  objective=objective)

    return fkl, reg, loss(1.0), loss(0.8)

  fkl, reg, (total, metrics), decayed = by_hand_and_losses(d_params, v_params)
  plain = 0.0
  for r in reg:  # the feature loss's mean, in the order feature_apply adds it
    plain = plain + 0.5 * r / 3
  np.testing.assert_array_equal(total, fkl[0] + ((plain + fkl[1]) + fkl[2]))
  np.testing.assert_array_equal(metrics["loss"], fkl[0])
  w = np.array([1.0, 0.8, 0.64]) / 2.44
  np.testing.assert_allclose(features_train.pass_weights(3, 0.8), w, rtol=1e-12)
  total, metrics = decayed
  reg_part = 0.5 * sum(wj * r for wj, r in zip(w, reg))
  np.testing.assert_allclose(total, 3 * sum(wj * t for wj, t in zip(w, fkl)) + reg_part,
                             rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], fkl[0], rtol=1e-6)
  np.testing.assert_allclose(metrics["aux_loss"], total - 3 * w[0] * fkl[0], rtol=1e-5)


def test_multi_layer_forward_reads_the_fc_then_its_own_features():
  """Pass 1 reads feature_fc of the verifier's layers; pass 2 reads pass 1's final residual as
  it is (no fc); no feature loss (feature_weight has nothing to weigh). The passes by hand and
  the student are one jitted program."""
  v_cfg, v_params, d_cfg, d_params = testing.tiny_eagle3_pair()
  x = jnp.asarray([[3, 1, 4, 1, 5, 9, 2]], jnp.int32)
  pos = jnp.arange(7)[None]
  student = functools.partial(features_train.feature_apply, cfg=d_cfg, feature_weight=1.0,
                              passes=2, decay=0.8)

  @jax.jit
  def by_hand_and_student(v_params, d_params):
    _, hidden, _ = llama.make_apply(v_cfg, d_cfg.feature_layers)(v_params, x, pos)
    apply = llama.make_apply(d_cfg, (-1,), reduced_logits=True)
    g = features.verifier_features(d_cfg, d_params, hidden)
    l1, h1, _ = apply(d_params, x, pos, features=features.shift(g))
    l2, _, _ = apply(d_params, x, pos, features=features.shift(h1[-1]))
    return hidden, l1, l2, student(d_params, x, pos, features=hidden)

  hidden, l1, l2, (logits, aux, _) = by_hand_and_student(v_params, d_params)
  np.testing.assert_allclose(logits, l1, atol=1e-6)
  np.testing.assert_allclose(aux["extra_logits"][0], l2, atol=1e-6)
  assert aux["aux_loss"] == 0.0
  assert tuple(map(float, aux["pass_weights"])) == pytest.approx((2 / 1.8, 1.6 / 1.8))
  _, context_fn = features_train.make_student(d_cfg, 1.0, 2)
  context = context_fn(hidden, {"weights": jnp.ones((1, 7))}, None)
  assert sorted(context["features"]) == [0, 1, 2]


def _save_model(workdir, cfg, params, tokenizer):
  """A train_lm-layout checkpoint of (cfg, params) at step 0."""
  manager = checkpoints.make_manager(workdir)
  state = train.TrainState(step=jnp.int32(0), params=params, opt_state=jnp.zeros(()))
  checkpoints.save(manager, 0, state, checkpoints.make_meta(cfg, tokenizer))
  manager.wait_until_finished()
  manager.close()


@pytest.fixture(scope="module")
def verifier_checkpoint(tmp_path_factory):
  """(workdir of the distill smoke's verifier saved as a checkpoint, the smoke config)."""
  config = distill_config.get_config("smoke,source=fixed")
  tokenizer = get_tokenizer(config.tokenizer)
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed)
  path = str(tmp_path_factory.mktemp("verifier"))
  _save_model(path, v_cfg, v_params, tokenizer)
  return path, config, tokenizer


def test_distill_trains_a_multi_layer_drafter_that_decoding_loads(verifier_checkpoint, tmp_path):
  """A multi-layer drafter of the verifier's block 1 reading depths 0, 1, 2, saved as a
  checkpoint; distill trains it two steps with two passes at pass_decay 0.8 (feature_fc moves)
  and saves it; evaluate's and generate's loader (`loading.load_source`, then the method's
  `standard.model_drafter`) loads the distill workdir, and its greedy output is the
  verifier's."""
  source, config, tokenizer = verifier_checkpoint
  v_cfg, v_params, _ = checkpoints.load_model(source)
  cfg, params = draft_init.select_layers(v_cfg, jax.tree.map(np.asarray, v_params), (1,))
  cfg, params = draft_init.feature_drafter(cfg, params, (0, 1, 2))
  start = str(tmp_path / "start")
  _save_model(start, cfg, params, tokenizer)
  config.drafter.update(checkpoint=start)
  config.distill.update(feature_passes=2, pass_decay=0.8)
  config.train.update(num_steps=2, eval_every=0)
  workdir = str(tmp_path / "drafter")
  assert distill_program.run(config, workdir)["step"] == 2
  assert "train/aux_loss" in (tmp_path / "drafter" / "metrics.jsonl").read_text()
  loaded = loading.load_source(methods.Source(), common.model(checkpoint=workdir), tokenizer,
                               v_cfg, v_params, seed=0)
  assert loaded.features and loaded.d_cfg.feature_layers == (0, 1, 2)
  assert not np.allclose(loaded.d_params["feature_fc"]["kernel"], params["feature_fc"]["kernel"])
  drafter, d_params = standard.model_drafter(loaded, trees.chain(2))
  prompts = generate_lib.pad_prompts([[5, 9, 2], [4]], 3, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=8)
  out = testing.decode(v_cfg, v_params, drafter, d_params, prompts, Sampling(), 8)
  assert out.new_tokens() == ar.new_tokens()


def test_a_size_string_builds_the_multi_layer_drafter(verifier_checkpoint):
  source, _, tokenizer = verifier_checkpoint
  cfg, params = loading.resolve_model(
      common.model(size="test-tiny:layers=1:features=0+1+2", checkpoint=source), tokenizer,
      field="drafter.checkpoint")
  assert cfg.feature_layers == (0, 1, 2) and "feature_fc" in params
