"""Autoregressive generation: sampling laws, ragged batches, EOS, static shapes, bad input."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.data.tokenizer import ByteTokenizer
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding.sampling import Sampling, probs_from_logits

LOGITS = jnp.log(jnp.array([0.1, 0.4, 0.2, 0.3]))


def test_transforms_on_a_hand_written_law():
  np.testing.assert_allclose(probs_from_logits(LOGITS, Sampling(1.0)), [0.1, 0.4, 0.2, 0.3],
                             atol=1e-6)
  np.testing.assert_allclose(probs_from_logits(LOGITS, Sampling()), [0, 1, 0, 0])
  np.testing.assert_allclose(probs_from_logits(LOGITS, Sampling(1.0, top_k=2)),
                             [0, 4 / 7, 0, 3 / 7], atol=1e-6)
  # top_p: sorted 0.4, 0.3, 0.2, 0.1; mass before 0.2 is 0.7 < 0.75, before 0.1 is 0.9.
  np.testing.assert_allclose(probs_from_logits(LOGITS, Sampling(1.0, top_p=0.75)),
                             [0, 4 / 9, 2 / 9, 3 / 9], atol=1e-6)
  np.testing.assert_allclose(probs_from_logits(LOGITS, Sampling(1.0, top_p=0.7)),
                             [0, 4 / 7, 0, 3 / 7], atol=1e-6)
  # The boundary itself, on a law exact in binary (0.7 above is 0.70000005 in float32): the
  # mass before a 1/8 token is exactly 0.75, not < 0.75, so it is cut.
  exact = jnp.log(jnp.array([0.125, 0.5, 0.125, 0.25]))
  np.testing.assert_allclose(probs_from_logits(exact, Sampling(1.0, top_p=0.75)),
                             [0, 2 / 3, 0, 1 / 3], atol=1e-6)
  t2 = np.array([0.1, 0.4, 0.2, 0.3]) ** 0.5
  np.testing.assert_allclose(probs_from_logits(LOGITS, Sampling(2.0)), t2 / t2.sum(), atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k must be >= 0"),
])
def test_bad_sampling_is_a_clear_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Sampling(**kwargs)


def test_ragged_batch_greedy_matches_no_cache_reference():
  cfg, params = testing.tiny_model(seed=0, sharpness=4.0)
  prompts = [[5, 6, 7, 8, 9, 10, 11], [40], [100, 101, 102]]
  batch = generate_lib.pad_prompts(prompts, 8, pad_id=0)
  out = generate_lib.generate(params, batch, jax.random.key(0), cfg=cfg, sampling=Sampling(),
                              max_new_tokens=6)
  new = out.new_tokens()
  for prompt, row in zip(prompts, new):
    assert row == testing.naive_greedy(cfg, params, prompt, 6)
  np.testing.assert_array_equal(out.lengths, [13, 7, 9])


def test_stop_token_ends_only_its_row():
  cfg, params = testing.tiny_model(seed=1, sharpness=4.0)
  prompts = [[1, 2, 3], [50, 60]]
  batch = generate_lib.pad_prompts(prompts, 4, pad_id=0)
  free = generate_lib.generate(params, batch, jax.random.key(0), cfg=cfg, sampling=Sampling(),
                               max_new_tokens=8).new_tokens()
  stop = free[0][2]  # row 0 emits this as its third token
  out = generate_lib.generate(params, batch, jax.random.key(0), cfg=cfg, sampling=Sampling(),
                              max_new_tokens=8, stop_ids=(stop,))
  rows = out.new_tokens()
  assert rows[0] == free[0][:free[0].index(stop) + 1]  # stop token kept, nothing after it
  want1 = free[1][:free[1].index(stop) + 1] if stop in free[1] else free[1]
  assert rows[1] == want1
  np.testing.assert_array_equal(out.num_new, [len(rows[0]), len(rows[1])])


def test_fixed_steps_decode_like_the_while_loop_in_a_loop_of_known_trip_count():
  """Without stop ids generation runs a loop of exactly max_new_tokens − 1 steps (a trip count
  XLA knows, so a GPU reads no flag back per token) and emits what the stopping while loop does:
  the same tokens, lengths, counts and steps, and the kept states to rounding, greedy and
  sampled."""
  cfg, params = testing.tiny_model(seed=4, sharpness=2.0)
  batch = generate_lib.pad_prompts([[5, 6, 7, 8], [40], [100, 101]], 4, pad_id=0)
  for sampling in (Sampling(), Sampling(1.0)):
    kw = dict(cfg=cfg, sampling=sampling, max_new_tokens=12, hidden_layers=(1,))
    fixed = generate_lib.generate(params, batch, jax.random.key(3), **kw)
    loop = generate_lib.generate(params, batch, jax.random.key(3), fixed_steps=False, **kw)
    for field in ("tokens", "lengths", "num_new", "steps", "law_error", "law_error_at"):
      np.testing.assert_array_equal(getattr(fixed, field), getattr(loop, field), field)
    # Two programs, two fusions: the states agree to float32 rounding.
    np.testing.assert_allclose(fixed.hidden[1], loop.hidden[1], rtol=1e-5, atol=1e-7)
    assert int(fixed.steps) == 12 and (np.asarray(fixed.num_new) == 12).all()
  kw = dict(cfg=cfg, sampling=Sampling(1.0), max_new_tokens=12, stop_ids=(), mesh=None,
            hidden_layers=())

  def compiled(fixed_steps):
    return generate_lib._generate_jit.lower(params, batch.tokens, batch.lengths,
                                            jax.random.key(0), fixed_steps=fixed_steps,
                                            **kw).compile().as_text()
  trip = '"known_trip_count":{"n":"11"}'  # the decode loop's, after the prefill's token
  assert trip in compiled(True) and trip not in compiled(False)
  with pytest.raises(ValueError, match="fixed_steps=True runs every row to max_new_tokens"):
    generate_lib.generate(params, batch, jax.random.key(0), cfg=cfg, sampling=Sampling(),
                          max_new_tokens=4, stop_ids=(3,), fixed_steps=True)


@pytest.mark.parametrize("where", ["kept", "prefill_one_slot_late", "step_other_row"])
def test_kept_hidden_states_are_the_forward_over_the_finished_rows(where, monkeypatch):
  """hidden_layers: the states the loop computed (prefill for the prompt, each step for the
  token it fed) equal one forward pass over the finished rows at every slot before a row's last
  token, ragged prompts and a stop token included, and are zero from there on. A loop that
  keeps the prefill's states one slot late, or a step's state in another row, fails."""
  cfg, params = testing.tiny_model(seed=3, sharpness=4.0)
  prompts = [[5, 6, 7, 8, 9, 10, 11], [40], [100, 101, 102]]
  batch = generate_lib.pad_prompts(prompts, 8, pad_id=0)
  kwargs = dict(cfg=cfg, sampling=Sampling(1.0), max_new_tokens=6)
  free = generate_lib.generate(params, batch, jax.random.key(1), **kwargs).new_tokens()
  stop = free[1][2]  # row 1 stops at its third new token, the others run to 6 or stop earlier
  layers = (0, -1)
  if where != "kept":
    real = generate_lib.llama.make_apply

    def late(cfg, hidden_layers=(), **kw):
      apply = real(cfg, hidden_layers, **kw)

      def shifted(params, tokens, positions, cache=None, *args, **kws):
        logits, hidden, cache = apply(params, tokens, positions, cache, *args, **kws)
        step = tokens.shape[1] == 1
        if step == (where == "step_other_row"):
          hidden = {k: jnp.roll(v, 1, axis=0 if step else 1) for k, v in hidden.items()}
        return logits, hidden, cache
      return shifted
    monkeypatch.setattr(generate_lib.llama, "make_apply", late)
    # A new function object: jit's trace cache is keyed by it, and the kept run traced this one.
    monkeypatch.setattr(generate_lib, "_generate_jit", jax.jit(
        functools.partial(generate_lib._generate), static_argnames=generate_lib.STATIC))
  out = generate_lib.generate(params, batch, jax.random.key(1), stop_ids=(stop,),
                              hidden_layers=layers, **kwargs)
  monkeypatch.undo()
  assert set(out.hidden) == set(layers)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  tokens = np.where(np.arange(tokens.shape[1])[None] < lengths[:, None], tokens, 0)
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  _, want, _ = generate_lib.llama.make_apply(cfg, layers)(params, tokens, positions)
  ok = True
  for k in layers:
    got = np.asarray(out.hidden[k])
    for b, n in enumerate(lengths):
      ok &= np.allclose(got[b, :n - 1], np.asarray(want[k])[b, :n - 1], rtol=1e-4, atol=1e-4)
      assert not got[b, n - 1:].any()
  assert lengths[1] == len(prompts[1]) + 3
  assert ok == (where == "kept")


def test_no_recompile_across_calls_of_the_same_shapes(monkeypatch):
  chex.clear_trace_counter()
  monkeypatch.setattr(generate_lib, "_generate_jit", jax.jit(
      chex.assert_max_traces(generate_lib._generate, n=1), static_argnames=generate_lib.STATIC))
  cfg, params = testing.tiny_model(seed=2)
  kwargs = dict(cfg=cfg, sampling=Sampling(1.0, top_k=5), max_new_tokens=4)
  generate_lib.generate(params, generate_lib.pad_prompts([[1, 2]], 4, 0), jax.random.key(0),
                        **kwargs)
  for i, prompt in enumerate([[3], [4, 5, 6, 7], [9, 9]]):
    generate_lib.generate(params, generate_lib.pad_prompts([prompt], 4, 0), jax.random.key(i),
                          **kwargs)
  with pytest.raises(AssertionError, match="traced > 1 times"):  # the check can fail
    generate_lib.generate(params, generate_lib.pad_prompts([[1, 2]], 5, 0), jax.random.key(0),
                          **kwargs)


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_k=3), Sampling(1.0, top_p=0.8)])
def test_sampled_sequences_follow_the_exact_law(sampling):
  """Two-token continuations from the jitted sampler vs the enumerated law (chi-square)."""
  cfg, params = testing.tiny_model(seed=3, vocab_size=6, sharpness=3.0)
  prompt = [1, 4, 2]
  law = testing.exact_sequence_law(cfg, params, prompt, 2, sampling)
  n = 4000
  batch = generate_lib.pad_prompts([prompt] * n, 3, pad_id=0)
  out = generate_lib.generate(params, batch, jax.random.key(7), cfg=cfg, sampling=sampling,
                              max_new_tokens=2)
  samples = [tuple(r) for r in out.new_tokens()]
  assert sum(p > 0.01 for p in law.values()) >= 4  # a law worth testing, not a near-point mass
  assert testing.chi_square_pvalue(samples, law) > 1e-3
  # The test can fail: the same samples do not fit a law that ignores the transform.
  if sampling != Sampling(1.0):
    plain = testing.exact_sequence_law(cfg, params, prompt, 2, Sampling(1.0))
    assert testing.chi_square_pvalue(samples, plain) < 1e-3


def test_bad_prompts_are_clear_errors():
  tok = ByteTokenizer()
  with pytest.raises(ValueError, match="Prompt 1 is empty"):
    generate_lib.encode_prompts(tok, ["ok", ""], 8)
  with pytest.raises(ValueError, match="Prompt 0 has 11 tokens but generation.max_prompt_tokens=8"):
    generate_lib.encode_prompts(tok, ["hello world"], 8)
  with pytest.raises(ValueError, match="No prompts"):
    generate_lib.encode_prompts(tok, [], 8)
