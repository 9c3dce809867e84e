"""Prompt lookup (`decoding/drafters/lookup.py`): the lookup on hand-checked token tables, greedy
lookup SD and the lookup overlay (over an LM and a feature drafter) equal the verifier's greedy
output token for token, sampled SD with them is lossless (chi-square; planted bugs that report
another law fail it), evaluate runs both methods, bad input names the field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import evaluate as evaluate_config
from spec_jax import testing
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop, methods
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import features, lm, lookup, standard, trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import draft_init, llama
from spec_jax.programs import evaluate

# Prompts that repeat themselves, so that lookups find matches of every length.
PROMPTS = [[5, 9, 2, 5, 9, 2, 5], [4, 8, 4], [6, 1, 2, 9, 6, 1], [3]]
# Jitted once, sizes static: eagerly, every op would compile a program of its own.
_lookup = jax.jit(lookup.lookup, static_argnums=(2, 3))


@pytest.mark.parametrize("row, length, want_draft, want_match", [
    ([5, 6, 7, 8, 5, 6, 0, 0], 6, [7, 8, 5, 6], 2),   # "5 6" occurred at 0-1: what followed
    ([1, 2, 1, 2, 0, 0, 0, 0], 4, [1, 2, 1, 2], 2),   # period 2, continued past the root
    ([9, 1, 9, 2, 9, 0, 0, 0], 5, [2, 9, 2, 9], 1),   # only "9" recurs: its latest occurrence
    ([1, 2, 3, 4, 0, 0, 0, 0], 4, [4, 4, 4, 4], 0),   # nothing recurs: the root, match 0
    ([3, 0, 0, 0, 0, 0, 0, 0], 1, [3, 3, 3, 3], 0),   # one token: nothing before it
    ([7, 7, 7, 0, 0, 0, 0, 0], 3, [7, 7, 7, 7], 2),   # "7 7" ends at 1 (an end at 2 is the root)
    ([1, 2, 3, 1, 2, 4, 1, 2], 8, [4, 1, 2, 4], 2),   # the most recent of two "1 2"s
    ([2, 3, 4, 9, 3, 4, 2, 3, 4], 9, [9, 3, 4, 2], 3),  # "2 3 4" beats the later "3 4"
])
def test_lookup_on_hand_tables(row, length, want_draft, want_match):
  padding = [0] * (12 - len(row))
  draft, match = jax.device_get(
      _lookup(np.asarray([row + padding], np.int32), np.asarray([length], np.int32), 4, 3))
  assert draft[0].tolist() == want_draft
  assert int(match[0]) == want_match


def test_lookup_ignores_tokens_past_the_length_and_caps_n():
  # Rows of one batch with their own lengths; the tokens after each length are stale.
  tokens = np.asarray([[1, 2, 1, 2, 8, 8, 8], [4, 5, 6, 4, 5, 6, 4]], np.int32)
  draft, match = _lookup(tokens, np.asarray([3, 7], np.int32), 3, 2)
  assert np.asarray(draft).tolist() == [[2, 1, 2], [5, 6, 4]]
  assert np.asarray(match).tolist() == [1, 2]  # max_ngram = 2 caps the second row's 3-gram


def _models(vocab_size=16, sharpness=2.0, sigma=0.3, seed=1, feature=False):
  """(v_cfg, v_params, d_cfg, d_params): a tiny verifier and a drafter made of its block 1,
  perturbed (an LM drafter, or a feature drafter with `feature`)."""
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=vocab_size, sharpness=sharpness)
  # The drafter's layers are cut from host copies (numpy slicing compiles nothing).
  d_cfg, d_params = draft_init.select_layers(v_cfg, jax.tree.map(np.asarray, v_params), (1,))
  if feature:
    d_cfg, d_params = draft_init.feature_drafter(d_cfg, d_params)
  d_params = testing.perturbed(d_params, sigma, seed)
  return v_cfg, v_params, d_cfg, d_params


def _drafter(kind, d_cfg, gamma, min_ngram=2):
  if kind == "lookup":
    return lookup.PromptLookupDrafter(d_cfg.vocab_size, trees.chain(gamma))
  inner = features.for_model(d_cfg, trees.chain(gamma))
  return lookup.LookupOverlay(inner, max_ngram=3, min_ngram=min_ngram)


@pytest.mark.parametrize("kind, feature", [("lookup", False), ("overlay", False),
                                           ("overlay", True)])
def test_greedy_lookup_sd_equals_verifier_greedy(kind, feature):
  v_cfg, v_params, d_cfg, d_params = _models(feature=feature)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=24)
  drafter = _drafter(kind, d_cfg, 3)
  out = loop.speculative_generate(
      v_params, d_params, prompts, jax.random.key(0),
      verifier=verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers), drafter=drafter,
      sampling=Sampling(), max_new_tokens=24)
  assert out.new_tokens() == ar.new_tokens()
  accepted = np.asarray(out.stats.accepted)
  assert accepted.sum() > 0 and (accepted < np.asarray(out.stats.verifier_calls) * 3).any()


@pytest.mark.parametrize("mode", ["mixed", "all_rows"])
def test_overlay_keeps_the_lm_drafters_cache_right(mode):
  """After rounds with lookup drafts and random acceptance, the LM drafter's cache holds what its
  own rounds would have written: its law of the next draft equals a fresh forward over the
  committed text. "mixed": min_ngram = 2, random bonus tokens, so rounds mix lookup rows and
  model rows; "all_rows": min_ngram = 1 and bonus tokens that occurred before, so every row
  matches every round and the model's drafting is skipped (its catch-up window is written by
  the overlay)."""
  v_cfg, v_params, d_cfg, d_params = _models()
  del v_cfg, v_params
  prompts = PROMPTS if mode == "mixed" else PROMPTS[:3] + [[3, 7, 3]]
  padded = generate_lib.pad_prompts(prompts, 8, pad_id=0)
  inner = lm.LMDrafter(d_cfg, trees.chain(3))
  overlay = lookup.LookupOverlay(inner, max_ngram=3, min_ngram=2 if mode == "mixed" else 1)
  size = 64
  state = jax.jit(overlay.init, static_argnums=3)(d_params, padded.tokens, padded.lengths, size,
                                                  {})
  tokens = np.zeros((len(prompts), size), np.int32)
  tokens[:, :8] = np.asarray(padded.tokens)
  lengths = np.array(padded.lengths)
  rng = np.random.default_rng(0)
  propose = jax.jit(overlay.propose, static_argnames="sampling")
  used = []
  for _ in range(6):  # rounds with random acceptance counts, committed by hand
    _, match = _lookup(tokens, lengths, 3, 3)
    used.append(np.asarray(match) >= overlay.min_ngram)
    proposal, state = propose(d_params, state, tokens, lengths, jax.random.key(0),
                              sampling=Sampling())
    n = rng.integers(0, 4, size=len(prompts))
    drafts = np.asarray(proposal.drafts)
    new = np.array(tokens)
    for b in range(len(prompts)):
      length = int(lengths[b])
      new[b, length:length + n[b]] = drafts[b, :n[b]]
      seen = new[b, :length + n[b]]
      new[b, length + n[b]] = rng.integers(0, 16) if mode == "mixed" else rng.choice(seen)
    tokens, lengths = new, (lengths + n + 1).astype(np.int32)
  used = np.stack(used)
  if mode == "mixed":
    assert used.any() and not used.all(axis=1).all()
  else:
    assert used.all()
  # The LM's law of the next draft from its cache (catch-up window) against a fresh forward.
  logits, _, _ = jax.jit(inner._catch_up)(d_params, state, tokens, lengths)  # noqa: SLF001
  longest = int(lengths.max())  # one causal forward over the right-padded rows
  positions = np.arange(longest, dtype=np.int32)[None].repeat(len(prompts), 0)
  fresh, _, _ = jax.jit(llama.make_apply(d_cfg))(d_params, tokens[:, :longest], positions)
  fresh = np.take_along_axis(np.asarray(fresh), (lengths - 1)[:, None, None], axis=1)[:, 0]
  np.testing.assert_allclose(logits, fresh, atol=1e-4, rtol=1e-4)


class _SoftLookup(lookup.PromptLookupDrafter):
  """Planted bug: drafts the lookup chain but reports a softened law (half its mass on the draft,
  half uniform) as q."""

  def propose(self, params, state, tokens, lengths, rng, sampling):
    proposal, state = super().propose(params, state, tokens, lengths, rng, sampling)
    soft = 0.5 * proposal.q + 0.5 / self.vocab_size
    return proposal.replace(q=jnp.where(proposal.q.sum(-1, keepdims=True) > 0, soft, 0.0)), state


class _ModelLawOverlay(lookup.LookupOverlay):
  """Planted bug: substitutes the lookup drafts but reports the model drafter's law as q."""

  def propose(self, params, state, tokens, lengths, rng, sampling):
    proposal, new_state = super().propose(params, state, tokens, lengths, rng, sampling)
    model, _ = self.inner.propose(params, state, tokens, lengths, rng, sampling)
    return proposal.replace(q=model.q), new_state


def _law_check(kind, min_ngram=2, cls=None, feature=False):
  v_cfg, v_params, d_cfg, d_params = _models(vocab_size=6, sharpness=3.0, sigma=0.5,
                                             feature=feature)
  drafter = _drafter(kind, d_cfg, 2, min_ngram)
  if cls is not None:
    drafter = (cls(d_cfg.vocab_size, trees.chain(2)) if kind == "lookup" else
               cls(drafter.inner, drafter.max_ngram, drafter.min_ngram))
  # "1 4" recurs: every first round looks up [2, 1]; later rounds depend on the sampled text.
  return testing.sd_law_pvalue(v_cfg, v_params, drafter, d_params, [1, 4, 2, 1, 4], n=3,
                               min_accepted=200)


@pytest.mark.parametrize("kind, min_ngram, feature", [("lookup", 2, False),
                                                      ("overlay", 2, True),
                                                      ("overlay", 2, False),
                                                      ("overlay", 3, False)])
def test_lookup_sampling_is_lossless(kind, min_ngram, feature):
  assert _law_check(kind, min_ngram, feature=feature) > 1e-3


@pytest.mark.parametrize("kind, cls", [("lookup", _SoftLookup), ("overlay", _ModelLawOverlay)])
def test_reporting_another_law_is_caught(kind, cls):
  assert _law_check(kind, cls=cls) < 1e-6


def test_evaluate_runs_lookup_methods(tmp_path):
  config = evaluate_config.get_config("smoke")
  config.eval.update(methods=("sd", "lookup", "sd_lookup"), gammas=(2,), temperatures=(0.0, 1.0))
  rows = evaluate.run(config, str(tmp_path))
  by = {(r["method"], r["temperature"]): r for r in rows}
  for t in (0.0, 1.0):
    assert by["lookup", t]["cost_ratio_c"] == 0.0 and by["lookup", t]["drafter_calls"] == 0
    assert by["sd_lookup", t]["cost_ratio_c"] == by["sd", t]["cost_ratio_c"]
  assert by["lookup", 0.0]["identical_to_greedy"] and by["sd_lookup", 0.0]["identical_to_greedy"]


def test_bad_input_names_the_field(tmp_path):
  config = evaluate_config.get_config("smoke")
  config.eval.update(methods=("lookup",), gammas=(2,), temperatures=(0.0,))
  config.eval.lookup.min_ngram = 4
  with pytest.raises(ValueError, match="eval.lookup.min_ngram=4"):
    evaluate.run(config, str(tmp_path))
  config.eval.lookup.min_ngram = 2
  config.eval.methods = ("lookup:3",)
  with pytest.raises(ValueError, match="drafts a chain"):
    evaluate.run(config, str(tmp_path))
  overlay, greedy = methods.parse("sd_lookup@2", None), Sampling(0.0)
  with pytest.raises(ValueError, match="holds BPD heads"):
    methods.check(overlay, methods.Source(kind="bpd", b_cfg=object()), greedy)
  with pytest.raises(ValueError, match="holds a steered drafter"):
    methods.check(overlay, methods.Source(kind="steered", s_cfg=object()), greedy)
  with pytest.raises(ValueError, match="Prompt lookup drafts chains"):
    lookup.PromptLookupDrafter(16, standard.tree("rsd_c", depth=2, branching=(2,)))
