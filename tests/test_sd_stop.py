"""`sd_stop`: chains whose rows stop drafting after an unconfident draft (`trees.TreeSpec.stop`,
`lm.draw_chain`), verified over the drafted nodes alone (`loop.score_drafted`,
`acceptance.chain.stop_at_drafted`): greedy output is the verifier's, sampled output follows its
exact law (chi-square, with planted bugs that fail it), rows really stop, and the verify call is
as wide as the longest live row."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding import acceptance, loop, methods, protocols
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import features, lm, trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import draft_init

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40], [100, 101, 102], [7, 7]]


def _run(v_cfg, v_params, drafter, d_params, prompts, *, sampling=Sampling(), n=12, seed=0):
  return loop.speculative_generate(
      v_params, d_params, prompts, jax.random.key(seed),
      verifier=verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers), drafter=drafter,
      sampling=sampling, max_new_tokens=n)


@pytest.mark.parametrize("stop", [0.05, 0.3, 0.9])
def test_greedy_output_is_the_verifiers(stop):
  """Ragged batch, an LM drafter that agrees with the verifier often (a perturbed copy) and a
  feature drafter: the output equals autoregressive greedy decoding token for token at every
  threshold, and the rows draft fewer tokens the higher the threshold."""
  v_cfg, v_params = testing.tiny_model(seed=0, sharpness=4.0)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg,
                             sampling=Sampling(), max_new_tokens=12)
  d_params = testing.perturbed(v_params, 0.05)
  out = _run(v_cfg, v_params, lm.LMDrafter(v_cfg, trees.chain(4, stop=stop)), d_params, prompts)
  assert out.new_tokens() == ar.new_tokens()
  drafted = np.asarray(out.stats.drafted) / np.asarray(out.stats.verifier_calls)
  assert np.all((1 <= drafted) & (drafted <= 4))
  if stop == 0.9:
    assert drafted.mean() < 3.5  # rows stopped
  f_cfg, f_params = draft_init.select_layers(v_cfg, v_params, (1,))
  f_cfg, f_params = draft_init.feature_drafter(f_cfg, jax.tree.map(np.asarray, f_params))
  f_params = testing.perturbed(jax.tree.map(jnp.asarray, f_params), 0.05)
  drafter = features.FeatureDrafter(f_cfg, trees.chain(3, stop=stop))
  assert _run(v_cfg, v_params, drafter, f_params, prompts).new_tokens() == ar.new_tokens()


def test_a_stop_below_every_draft_is_plain_sd():
  """A threshold no draft falls under drafts γ every round: the same tokens, rounds and
  acceptance as `sd` with the same key, at T = 1 (the draws are the same)."""
  v_cfg, v_params = testing.tiny_model(seed=0, sharpness=2.0)
  d_params = testing.perturbed(v_params, 0.1)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  plain = _run(v_cfg, v_params, lm.LMDrafter(v_cfg, trees.chain(3)), d_params, prompts,
               sampling=Sampling(1.0))
  stop = _run(v_cfg, v_params, lm.LMDrafter(v_cfg, trees.chain(3, stop=1e-30)), d_params,
              prompts, sampling=Sampling(1.0))
  assert stop.new_tokens() == plain.new_tokens()
  np.testing.assert_array_equal(stop.stats.accepted_at, plain.stats.accepted_at)
  np.testing.assert_array_equal(stop.stats.drafted, 3 * np.asarray(stop.stats.verifier_calls))


def _law_pvalue(monkeypatch=None, plant=None, sampling=Sampling(1.0)):
  """p-value of 3 tokens drawn by sd_stop (γ = 3, a tiny LM drafter stopping below 0.5) against
  an order-2 Markov verifier's exact law: its laws depend strongly on the context, so a token
  drawn from the wrong node's law shows."""
  v_params = testing.markov_tables(6, seed=3)[0]
  d_cfg, d_params = testing.tiny_model(seed=11, vocab_size=6, sharpness=3.0)
  if plant is not None:
    monkeypatch.setattr(acceptance.chain, "stop_at_drafted", plant)
  prompt = [1, 4, 2]
  out = loop.speculative_generate(
      v_params, d_params, generate_lib.pad_prompts([prompt] * 4000, 3, pad_id=0),
      jax.random.key(1), verifier=testing.MarkovVerifier(6),
      drafter=lm.LMDrafter(d_cfg, trees.chain(3, stop=0.5)), sampling=sampling,
      max_new_tokens=3)
  stats = out.stats
  assert np.sum(stats.accepted) > 300                                   # drafts get accepted
  assert np.sum(stats.drafted) < 2.7 * np.sum(stats.verifier_calls)    # and rows stop
  law = testing.markov_law(v_params, prompt, 3, sampling)
  return testing.chi_square_pvalue([tuple(r) for r in out.new_tokens()], law)


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_k=4)])
def test_sampling_is_lossless(sampling):
  assert _law_pvalue(sampling=sampling) > 1e-3


def _keeps_the_rules_token(verdict, p, valid, rng, *, greedy):
  """Planted bug: cut at the drafted nodes but keep the token the rule chose past them (read
  from the padding's law, not p_k)."""
  k = jnp.sum(valid[:, 1:], axis=1).astype(jnp.int32)
  n = jnp.minimum(verdict.num_accepted, k)
  pos = jnp.arange(verdict.path.shape[1])[None]
  return verdict.replace(num_accepted=n, path=jnp.where(pos < n[:, None], pos + 1, 0))


def _no_cut(verdict, p, valid, rng, *, greedy):
  """Planted bug: no cut at all (the padding's token 0 is accepted as if drafted)."""
  return verdict


@pytest.mark.parametrize("plant", [_keeps_the_rules_token, _no_cut])
def test_planted_bugs_fail_the_law(monkeypatch, fresh_programs, plant):
  assert _law_pvalue(monkeypatch, plant) < 1e-6


def _feature_law_pvalue(monkeypatch=None, plant=None):
  """p-value of 3 tokens drawn by sd_stop over a feature drafter (γ = 3, stopping below 0.5) at
  T = 1 against the tiny LM verifier's exact law: its rows stop at different depths, so the
  next round's drafter state (features and cache) must be the verifier's after a cut chain."""
  v_cfg, v_params, d_cfg, d_params = testing.tiny_feature_pair(vocab_size=6, sharpness=3.0,
                                                               sigma=0.5)
  if plant is not None:
    monkeypatch.setattr(acceptance.chain, "stop_at_drafted", plant)
  prompt = [1, 4, 2]
  out = testing.decode(v_cfg, v_params, features.FeatureDrafter(d_cfg, trees.chain(3, stop=0.5)),
                       d_params, generate_lib.pad_prompts([prompt] * 4000, 3, pad_id=0),
                       Sampling(1.0), 3)
  stats = out.stats
  assert np.sum(stats.accepted) > 300                                   # drafts get accepted
  assert np.sum(stats.drafted) < 2.7 * np.sum(stats.verifier_calls)    # and rows stop
  law = testing.exact_sequence_law(v_cfg, v_params, prompt, 3, Sampling(1.0))
  return testing.chi_square_pvalue([tuple(r) for r in out.new_tokens()], law)


def test_sampling_over_a_feature_drafter_is_lossless():
  assert _feature_law_pvalue() > 1e-3


def test_a_planted_bug_fails_the_feature_drafters_law(monkeypatch, fresh_programs):
  assert _feature_law_pvalue(monkeypatch, _keeps_the_rules_token) < 1e-6


@dataclasses.dataclass(frozen=True)
class _WidthVerifier:
  """Scores every node with logits equal to the width of the call it came in."""
  vocab_size: int = 5
  hidden_layers: tuple = ()

  def score(self, params, cache, proposal, lengths):
    b, w = proposal.tokens.shape
    return jnp.full((b, w, self.vocab_size), float(w)), {}, cache


def test_the_verify_call_is_as_wide_as_the_longest_live_row():
  valid = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], bool)
  tokens = jnp.zeros((3, 5), jnp.int32)
  proposal = protocols.chain_proposal(tokens[:, 0], tokens[:, 1:], None, valid)
  lengths = jnp.ones((3,), jnp.int32)
  for done, width in (([False] * 3, 4), ([False, False, True], 3), ([True] * 3, 2)):
    logits, _, _ = loop.score_drafted(_WidthVerifier(), None, None, proposal, lengths,
                                      jnp.asarray(done))
    assert logits.shape == (3, 5, 5)
    np.testing.assert_array_equal(logits[:, :width], width)
    np.testing.assert_array_equal(logits[:, width:], 0.0)


def test_the_method_and_its_bad_input():
  entry = methods.parse("sd_stop:25@4", None)
  assert entry.shape == trees.chain(4, stop=0.25) and entry.label == "sd_stop:25"
  assert methods.parse("sd_stop", 3).shape.stop == 0.4
  with pytest.raises(ValueError, match="sd_stop:0: the stop is a percentage"):
    methods.parse("sd_stop:0@4", None)
  with pytest.raises(ValueError, match="chains only"):
    trees.TreeSpec("beam", 3, width=2, stop=0.5)
  with pytest.raises(ValueError, match=r"in \(0, 1\)"):
    trees.chain(3, stop=1.5)
