"""Chain speculative decoding with transformer drafters through the one loop: greedy equality,
losslessness (chi-square), static shapes, bad input. (tests/test_loop.py tests the loop with
table-driven fakes and the verifier-fed drafter.)"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding import acceptance
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import lm
from spec_jax.decoding.drafters import trees
from spec_jax.decoding.sampling import Sampling

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40], [100, 101, 102], [7, 7]]


def _pair(vocab_size=257, sharpness=4.0, drafter_seed=11):
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=vocab_size, sharpness=sharpness)
  d_cfg, d_params = testing.tiny_model(seed=drafter_seed, vocab_size=vocab_size,
                                       sharpness=sharpness)
  return v_cfg, v_params, d_cfg, d_params


def _sd(v_cfg, v_params, d_cfg, d_params, prompts, *, gamma, sampling=Sampling(), n=10,
        stop_ids=(), rule="auto", seed=0, max_cache_len=None, **decode_kwargs):
  return loop.speculative_generate(
      v_params, d_params, prompts, jax.random.key(seed), verifier=verifier_lib.lm_verifier(v_cfg),
      drafter=lm.LMDrafter(d_cfg, trees.chain(gamma)),
      decode=loop.DecodeConfig(rule=rule, **decode_kwargs), sampling=sampling, max_new_tokens=n,
      stop_ids=stop_ids, max_cache_len=max_cache_len)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_equals_autoregressive_ragged_batch(gamma):
  # A verifier whose next token depends on its context (`tiny_model(context=)`): K/V written at
  # the wrong slots changes the output.
  v_cfg, v_params = testing.tiny_model(seed=0, sharpness=4.0, context=6.0)
  _, _, d_cfg, d_params = _pair()
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=10)
  sd = _sd(v_cfg, v_params, d_cfg, d_params, prompts, gamma=gamma)
  assert sd.new_tokens() == ar.new_tokens()
  np.testing.assert_array_equal(sd.lengths, ar.lengths)
  # The verifier as its own drafter accepts everything: τ = γ + 1 until the last round.
  same = _sd(v_cfg, v_params, v_cfg, v_params, prompts, gamma=gamma)
  assert same.new_tokens() == ar.new_tokens()
  calls = np.asarray(same.stats.verifier_calls)
  np.testing.assert_array_equal(calls, -(-10 // (gamma + 1)))
  np.testing.assert_array_equal(same.stats.accepted_at, same.stats.reached)


def test_greedy_rounds_match_a_host_simulation():
  """Acceptance counts per round, not just the output, match a host-side re-enactment of greedy
  SD. Output equality alone cannot see a drafter cache that goes stale after rejections (the
  verifier still corrects every token; only acceptance drops), and a perfect drafter never
  rejects. A noisy copy of the verifier agrees with it often but not always."""
  v_cfg, v_params = testing.tiny_model(seed=0, sharpness=4.0, context=6.0)
  d_cfg, d_params = v_cfg, testing.perturbed(v_params, 0.05)
  gamma, n = 3, 12

  def simulate(prompt):
    seq, rounds, accepted = list(prompt), 0, 0
    while len(seq) - len(prompt) < n:
      drafts = testing.naive_greedy(d_cfg, d_params, seq, gamma)
      targets = testing.naive_greedy(v_cfg, v_params, seq, gamma + 1)
      m = next((i for i in range(gamma) if drafts[i] != targets[i]), gamma)
      left = n - (len(seq) - len(prompt))
      seq += targets[:m + 1][:left]
      rounds, accepted = rounds + 1, accepted + min(m, left)  # drafts output, not cut
    return rounds, accepted

  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  out = _sd(v_cfg, v_params, d_cfg, d_params, prompts, gamma=gamma, n=n)
  want = [simulate(p) for p in PROMPTS]
  assert sum(a for _, a in want) > 0 and any(a < r * gamma for r, a in want)  # mixed verdicts
  np.testing.assert_array_equal(out.stats.verifier_calls, [r for r, _ in want])
  np.testing.assert_array_equal(out.stats.accepted, [a for _, a in want])


def test_acceptance_counts_end_where_the_output_ends():
  """The verifier drafting for itself accepts all γ = 4 drafts, but a budget of 2 tokens outputs
  two of them: depths 3-4 were examined and are not counted; a stop token drawn first ends its
  row's count at depth 1."""
  v_cfg, v_params, _, _ = _pair()
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  out = _sd(v_cfg, v_params, v_cfg, v_params, prompts, gamma=4, n=2)
  np.testing.assert_array_equal(out.num_new, [2] * 4)
  np.testing.assert_array_equal(out.stats.accepted, [2] * 4)
  np.testing.assert_array_equal(out.stats.reached, [[1, 1, 0, 0]] * 4)
  np.testing.assert_array_equal(out.stats.accepted_at, out.stats.reached)
  first = out.new_tokens()[0][0]
  stopped = _sd(v_cfg, v_params, v_cfg, v_params, prompts, gamma=4, n=6, stop_ids=(first,))
  assert stopped.new_tokens()[0] == [first]
  assert int(stopped.stats.accepted[0]) == 1
  np.testing.assert_array_equal(stopped.stats.reached[0], [1, 0, 0, 0])
  np.testing.assert_allclose(stopped.stats.alpha_sum[0], 1.0, atol=1e-5)


def test_greedy_stop_tokens_match_autoregressive():
  v_cfg, v_params, d_cfg, d_params = _pair()
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  free = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg,
                               sampling=Sampling(), max_new_tokens=12).new_tokens()
  stops = (free[0][3], free[2][1])
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=12, stop_ids=stops)
  for drafter in [(d_cfg, d_params), (v_cfg, v_params)]:
    sd = _sd(v_cfg, v_params, *drafter, prompts, gamma=4, n=12, stop_ids=stops)
    assert sd.new_tokens() == ar.new_tokens()
    np.testing.assert_array_equal(sd.num_new, ar.num_new)


def _first_tokens_law_check(rule_name, sampling, gamma, n_samples=3000, seed=0):
  """(p-value of the first two emitted tokens vs the exact verifier law, empirical acceptance,
  analytic acceptance) for many rows of one prompt."""
  v_cfg, v_params, d_cfg, d_params = _pair(vocab_size=6, sharpness=3.0, drafter_seed=5)
  prompt = [1, 4, 2]
  law = testing.exact_sequence_law(v_cfg, v_params, prompt, 2, sampling)
  prompts = generate_lib.pad_prompts([prompt] * n_samples, 3, pad_id=0)
  out = _sd(v_cfg, v_params, d_cfg, d_params, prompts, gamma=gamma, sampling=sampling, n=2,
            rule=rule_name, seed=seed)
  samples = [tuple(r) for r in out.new_tokens()]
  reached = float(np.sum(out.stats.reached))
  empirical = float(np.sum(out.stats.accepted_at)) / reached
  analytic = float(np.sum(out.stats.alpha_sum)) / reached
  return testing.chi_square_pvalue(samples, law), empirical, analytic, reached


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(1.0, top_k=4),
                                      Sampling(0.9, top_p=0.85)])
def test_sampling_is_lossless(gamma, sampling):
  pvalue, empirical, analytic, reached = _first_tokens_law_check("speculative", sampling, gamma)
  assert pvalue > 1e-3
  # Acceptance matches Σ min(p, q) at the examined positions (binomial tolerance, 5 sigma).
  assert 0.05 < analytic < 0.95  # the drafter is neither perfect nor useless here
  assert abs(empirical - analytic) < 5 * np.sqrt(0.25 / reached)


def test_broken_rule_fails_the_law_check(monkeypatch):
  """The check above can fail: on rejection, resampling from p instead of the residual biases
  the emitted law towards tokens the drafter already proposes."""
  def broken(p, proposal, rng):
    verdict = acceptance.RULES["speculative"](p, proposal, rng)
    n = verdict.num_accepted
    gamma = proposal.drafts.shape[1]
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    resample = jax.random.categorical(jax.random.fold_in(rng, 99), jnp.log(p_n + 1e-30))
    return verdict.replace(next_token=jnp.where(n < gamma, resample, verdict.next_token)
                           .astype(jnp.int32))
  monkeypatch.setitem(acceptance.RULES, "broken_residual",
                      acceptance.Rule(broken, ("chain",), chains_only=True))
  pvalue, *_ = _first_tokens_law_check("broken_residual", Sampling(1.0), 1)
  assert pvalue < 1e-3


def test_no_recompile_across_calls(monkeypatch):
  """Same shapes and static config, new prompts, lengths and seeds: the loop is traced once."""
  chex.clear_trace_counter()
  monkeypatch.setattr(loop, "_generate_jit", jax.jit(chex.assert_max_traces(loop._generate, n=1),
                                                     static_argnames=loop.STATIC))
  v_cfg, v_params, d_cfg, d_params = _pair()
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  _sd(v_cfg, v_params, d_cfg, d_params, prompts, gamma=3, sampling=Sampling(1.0), n=6)
  other = generate_lib.pad_prompts([[1], [2, 3], [4, 5, 6], [9]], 8, pad_id=0)
  for seed in range(3):
    _sd(v_cfg, v_params, d_cfg, d_params, other, gamma=3, sampling=Sampling(1.0), n=6, seed=seed)
  with pytest.raises(AssertionError, match="traced > 1 times"):  # and the check can fail
    _sd(v_cfg, v_params, d_cfg, d_params, other, gamma=2, sampling=Sampling(1.0), n=6)


def test_compile_only_compiles_what_the_next_call_runs(monkeypatch):
  """Timing's warm-up: compile_only traces and compiles, decodes nothing, and the next call with
  the same shapes runs that program (traced once in all); other shapes still trace anew."""
  chex.clear_trace_counter()
  monkeypatch.setattr(loop, "_generate_jit", jax.jit(chex.assert_max_traces(loop._generate, n=1),
                                                     static_argnames=loop.STATIC))
  monkeypatch.setattr(generate_lib, "_generate_jit", jax.jit(
      chex.assert_max_traces(generate_lib._generate, n=1), static_argnames=generate_lib.STATIC))
  v_cfg, v_params, d_cfg, d_params = _pair()
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  kwargs = dict(verifier=verifier_lib.lm_verifier(v_cfg), drafter=lm.LMDrafter(d_cfg, trees.chain(3)),
                sampling=Sampling(1.0), max_new_tokens=6)
  assert loop.speculative_generate(v_params, d_params, prompts, jax.random.key(0),
                                   compile_only=True, **kwargs) is None
  out = loop.speculative_generate(v_params, d_params, prompts, jax.random.key(1), **kwargs)
  assert int(out.num_new.min()) == 6
  ar = dict(cfg=v_cfg, sampling=Sampling(1.0), max_new_tokens=6)
  assert generate_lib.generate(v_params, prompts, jax.random.key(0), compile_only=True,
                               **ar) is None
  assert int(generate_lib.generate(v_params, prompts, jax.random.key(1), **ar).num_new.min()) == 6
  with pytest.raises(AssertionError, match="traced > 1 times"):  # the check can fail
    loop.speculative_generate(v_params, d_params, prompts, jax.random.key(0),
                              compile_only=True, **dict(kwargs, max_new_tokens=5))


def test_bad_input_is_a_clear_error():
  v_cfg, v_params, _, _ = _pair()
  d_cfg, d_params = testing.tiny_model(seed=1, vocab_size=300)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  with pytest.raises(ValueError, match="Drafter vocab_size=300 differs from the verifier's 257"):
    _sd(v_cfg, v_params, d_cfg, d_params, prompts, gamma=2)
  with pytest.raises(ValueError, match="gamma"):
    trees.chain(0)
  with pytest.raises(ValueError, match="decode.rule='bogus'"):
    loop.DecodeConfig(rule="bogus")
  with pytest.raises(ValueError, match="needs greedy sampling"):
    _sd(v_cfg, v_params, v_cfg, v_params, prompts, gamma=2, sampling=Sampling(1.0), rule="greedy")
  with pytest.raises(ValueError, match="temperature=0 means greedy"):
    _sd(v_cfg, v_params, v_cfg, v_params, prompts, gamma=2, rule="speculative")
  with pytest.raises(ValueError, match="decode.gamma = 5 exceeds the maximum 2"):
    _sd(v_cfg, v_params, v_cfg, v_params, prompts, gamma=5, max_cache_len=20)
  with pytest.raises(ValueError, match="decode.epsilon"):
    loop.DecodeConfig(rule="lenient", epsilon=1.5)
