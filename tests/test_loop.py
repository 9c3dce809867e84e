"""The one speculative loop, tested with table-driven fakes (no transformer): greedy output equals
the verifier's greedy continuation for every proposal shape, every sampling rule is lossless
(chi-square against the exact law), planted bugs in a rule, a cache commit or the feedback
channel fail, and bad input is refused before anything compiles. Also the verifier-fed drafter
(`drafters/hidden.py`) on a real transformer verifier."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding import acceptance
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import hidden, standard, trees
from spec_jax.decoding.sampling import Sampling

V = 6
PROMPTS = [[1, 2, 3, 4, 5], [4], [5, 0], [3, 3, 3]]
SHAPES = [trees.chain(1), trees.chain(3), standard.tree("rsd_c", 3, (2, 2)),
          standard.tree("rsd_s", 3, width=2), standard.tree("specinfer", 2, width=3),
          standard.tree("spectr", 2, width=3)]


def _run(v_params, d_params, prompts, drafter, *, verifier=None, sampling=Sampling(), n=10,
         seed=0, rule="auto", **kwargs):
  verifier = verifier or testing.MarkovVerifier(V, hidden_layers=drafter.verifier_layers)
  return loop.speculative_generate(
      v_params, d_params, generate_lib.pad_prompts(prompts, 6, pad_id=0), jax.random.key(seed),
      verifier=verifier, drafter=drafter, decode=loop.DecodeConfig(rule, **kwargs),
      sampling=sampling, max_new_tokens=n)


def test_hand_written_tables_give_the_exact_rounds():
  """t5x-style: hand-written logits, exact expected sequences and per-row counters.
  The verifier always continues x → x + 1 (mod 4); the drafter agrees except after 2, where it
  drafts 0. Chain γ = 3, 8 new tokens.
    prompt [1]: round 1 drafts 2 0 1, accepts 2, corrects to 3       → 2 3
                round 2 drafts 0 1 2 from 3, all accepted, bonus 3  → 0 1 2 3
                round 3 the same, cut at 8 tokens                   → 0 1
    prompt [3]: rounds 1 and 2 accept everything                     → 0 1 2 3 0 1 2 3
  Round 3 of prompt [1] counts the two depths it outputs: its third accepted draft is cut."""
  v = 4
  nxt = jax.nn.one_hot((jnp.arange(v) + 1) % v, v)                     # verifier: x → x + 1
  v_params = {"logits": 5.0 * jnp.broadcast_to(nxt, (v + 1, v, v))}
  d_params = {"logits": 5.0 * jax.nn.one_hot(jnp.asarray([1, 2, 0, 0]), v)}
  out = loop.speculative_generate(
      v_params, d_params, generate_lib.pad_prompts([[1], [3]], 2, pad_id=0), jax.random.key(0),
      verifier=testing.MarkovVerifier(v), drafter=testing.MarkovDrafter(v, trees.chain(3)),
      sampling=Sampling(), max_new_tokens=8)
  assert out.new_tokens() == [[2, 3, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3]]
  np.testing.assert_array_equal(out.stats.verifier_calls, [3, 2])
  np.testing.assert_array_equal(out.stats.accepted, [1 + 3 + 2, 3 + 3])
  np.testing.assert_array_equal(out.stats.reached, [[3, 3, 1], [2, 2, 2]])
  np.testing.assert_array_equal(out.stats.accepted_at, [[3, 2, 1], [2, 2, 2]])
  np.testing.assert_allclose(out.stats.alpha_sum, [6.0, 6.0])  # one-hot laws: α = 1 or 0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.describe())
def test_greedy_equals_verifier_greedy(shape):
  """Exact expected sequences, ragged prompts (one of one token), ragged acceptance."""
  v_params, d_params = testing.markov_tables(V, seed=1, drafter_noise=0.3)
  out = _run(v_params, d_params, PROMPTS, testing.MarkovDrafter(V, shape), n=12)
  assert out.new_tokens() == [testing.markov_greedy(v_params, p, 12) for p in PROMPTS]
  accepted, calls = np.asarray(out.stats.accepted), np.asarray(out.stats.verifier_calls)
  assert accepted.sum() > 0 and (accepted < calls * shape.depth).any()  # mixed verdicts
  # Bookkeeping: every emitted token is an accepted draft or one correction/bonus per call,
  # but for a last round cut inside its accepted drafts, which outputs no bonus.
  assert set((accepted + calls - 12).tolist()) <= {0, 1}
  np.testing.assert_array_equal(out.stats.accepted_at.sum(1), accepted)
  assert (np.asarray(out.stats.candidates) >= np.asarray(out.stats.reached).sum(1)).all()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.describe())
def test_perfect_drafter_accepts_every_draft(shape):
  """A verifier that ignores the predecessor and a drafter with its very table: every round
  accepts A drafts (the first child of every level is the greedy token; beam search excepted,
  which may keep W paths of higher joint probability instead)."""
  v_params, _ = testing.markov_tables(V, seed=2)
  table = v_params["logits"][0]
  v_params = {"logits": jnp.broadcast_to(table, v_params["logits"].shape)}
  out = _run(v_params, {"logits": table}, PROMPTS, testing.MarkovDrafter(V, shape), n=12)
  assert out.new_tokens() == [testing.markov_greedy(v_params, p, 12) for p in PROMPTS]
  if shape.layout != "beam":
    np.testing.assert_array_equal(out.stats.verifier_calls, -(-12 // (shape.depth + 1)))
    # A budget the rounds do not divide: the last round outputs r ≤ A of its A accepted drafts
    # and no bonus, and counts only the depths it outputs.
    a, n = shape.depth, 10 if shape.depth != 1 else 9
    out = _run(v_params, {"logits": table}, PROMPTS, testing.MarkovDrafter(V, shape), n=n)
    calls = -(-n // (a + 1))
    r = n - (calls - 1) * (a + 1)
    assert 0 < r <= a  # the cut round ends inside its drafts
    np.testing.assert_array_equal(out.stats.verifier_calls, calls)
    np.testing.assert_array_equal(out.stats.accepted, (calls - 1) * a + r)
    at = [(calls - 1) + (d < r) for d in range(a)]
    np.testing.assert_array_equal(out.stats.accepted_at, [at] * len(PROMPTS))
    np.testing.assert_array_equal(out.stats.reached, [at] * len(PROMPTS))


@dataclasses.dataclass(frozen=True)
class _ForgetfulVerifier(testing.MarkovVerifier):
  """Planted bug: never moves a tree's accepted path into place (keeps the chain behaviour)."""

  def commit(self, cache, lengths, verdict):
    return cache


def test_a_cache_that_forgets_the_accepted_path_is_caught():
  v_params, d_params = testing.markov_tables(V, seed=1, drafter_noise=0.3)
  shape = standard.tree("rsd_c", 3, (3, 2))
  want = [testing.markov_greedy(v_params, p, 12) for p in PROMPTS]
  good = _run(v_params, d_params, PROMPTS, testing.MarkovDrafter(V, shape), n=12)
  bad = _run(v_params, d_params, PROMPTS, testing.MarkovDrafter(V, shape), n=12,
             verifier=_ForgetfulVerifier(V))
  assert good.new_tokens() == want and bad.new_tokens() != want


def _law_check(drafter, d_params, sampling, *, rule="auto", n_samples=3000, seed=0,
               v_params=None, n=2, **kwargs):
  """(p-value of the first n emitted tokens vs the exact law, output) over many rows."""
  v_params = v_params or testing.markov_tables(V, seed=3)[0]
  prompt = [1, 4, 2]
  law = testing.markov_law(v_params, prompt, n, sampling)
  out = _run(v_params, d_params, [prompt] * n_samples, drafter, sampling=sampling, n=n,
             seed=seed, rule=rule, **kwargs)
  return testing.chi_square_pvalue([tuple(r) for r in out.new_tokens()], law), out


LOSSLESS = [(trees.chain(1), Sampling(1.0), "auto"), (trees.chain(3), Sampling(0.8, top_k=4), "auto"),
            (trees.chain(2), Sampling(1.0, top_p=0.9), "lenient"),   # ε = 1: lossless
            (trees.chain(2), Sampling(1.0), "rrs_without"),           # tree rules fit chains
            (standard.tree("rsd_c", 2, (3, 2)), Sampling(1.0), "auto"),
            (standard.tree("rsd_s", 2, width=3), Sampling(0.9, top_k=5), "auto"),
            (standard.tree("specinfer", 2, width=3), Sampling(1.0), "auto"),
            (standard.tree("spectr", 2, width=3), Sampling(1.0, top_p=0.9), "auto")]


@pytest.mark.parametrize("shape,sampling,rule", LOSSLESS,
                         ids=[f"{s.describe()}-{r}" for s, _, r in LOSSLESS])
def test_every_sampling_rule_is_lossless(shape, sampling, rule):
  _, d_params = testing.markov_tables(V, seed=3, drafter_noise=0.5)
  pvalue, out = _law_check(testing.MarkovDrafter(V, shape), d_params, sampling, rule=rule)
  assert pvalue > 1e-3
  reached = float(np.sum(out.stats.reached))
  empirical = float(np.sum(out.stats.accepted_at)) / reached
  analytic = float(np.sum(out.stats.alpha_sum)) / reached
  assert 0.1 < empirical < 0.95  # drafts are accepted and rejected: the test is not vacuous
  if shape.is_chain:  # acceptance = Σ min(p, q) at the examined positions (5 sigma)
    assert abs(empirical - analytic) < 5 * np.sqrt(0.25 / reached)


def test_planted_bugs_fail_the_law_check(monkeypatch):
  """A chain rule resampling from p after a rejection, and without-replacement siblings checked
  with SpecInfer's with-replacement rule, both emit the wrong law."""
  def broken(p, proposal, rng):
    verdict = acceptance.RULES["speculative"](p, proposal, rng)
    n = verdict.num_accepted
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    resample = jax.random.categorical(jax.random.fold_in(rng, 99), jnp.log(p_n + 1e-30))
    gamma = proposal.drafts.shape[1]
    return verdict.replace(next_token=jnp.where(n < gamma, resample, verdict.next_token)
                           .astype(jnp.int32))
  monkeypatch.setitem(acceptance.RULES, "broken",
                      acceptance.Rule(broken, ("chain",), chains_only=True))
  _, d_params = testing.markov_tables(V, seed=3, drafter_noise=0.5)
  pvalue, _ = _law_check(testing.MarkovDrafter(V, trees.chain(1)), d_params, Sampling(1.0),
                         rule="broken")
  assert pvalue < 1e-3
  # A drafter much more peaked than the verifier makes the with-replacement error large.
  peaked = {"logits": 3.0 * d_params["logits"]}
  rsd = testing.MarkovDrafter(V, standard.tree("rsd_c", 1, (4,)))
  assert _law_check(rsd, peaked, Sampling(1.0))[0] > 1e-3
  assert _law_check(rsd, peaked, Sampling(1.0), rule="rrs_with", allow_inexact=True)[0] < 1e-3


@pytest.mark.parametrize("shape", [standard.tree("rsd_c", 2, (3, 2)),
                                   standard.tree("specinfer", 2, width=3)],
                         ids=lambda s: s.describe())
def test_rounds_after_an_accepted_path_are_lossless(shape):
  """Four tokens of depth-2 trees: a second round follows every first round, also one whose
  accepted path the verifier's cache must move into place; a verifier that never moves it
  (planted bug) emits the wrong law there, which two tokens would not show."""
  _, d_params = testing.markov_tables(V, seed=3, drafter_noise=0.5)
  drafter = testing.MarkovDrafter(V, shape)
  pvalue, out = _law_check(drafter, d_params, Sampling(1.0), n=4)
  assert pvalue > 1e-3
  assert (np.asarray(out.stats.verifier_calls) >= 2).all()
  assert (np.asarray(out.stats.accepted) >= 2).any()  # some first rounds accepted a path
  forgetful = _ForgetfulVerifier(V, hidden_layers=drafter.verifier_layers)
  assert _law_check(drafter, d_params, Sampling(1.0), n=4, verifier=forgetful)[0] < 1e-3


# ---------------------------------------------------------------------------------------------
# The feedback channel: a drafter that drafts from the verifier's hidden state.

def _greedy_map(table, k):
  """g^k as an int array over tokens, g(x) = argmax table[x]."""
  g = np.argmax(np.asarray(table), axis=-1)
  out = np.arange(len(g))
  for _ in range(k):
    out = g[out]
  return out


class _RootReadingDrafter(hidden.HiddenStateDrafter):
  """Planted bug: reads the hidden state at the root, not at the deepest accepted node."""

  def commit(self, params, h, proposal, verdict, lengths, v_hidden):
    return v_hidden[self.layer][:, 0].astype(jnp.float32)


@pytest.mark.parametrize("buggy", [False, True])
def test_feedback_drafter_reads_the_last_accepted_node(buggy):
  """MarkovVerifier's hidden state at a node is one_hot(its token). With heads W_k[z] =
  one_hot(g^{k+1}(z)), a drafter fed the hidden state of the node whose output was the last
  committed token y = g(z) drafts the verifier's greedy continuation exactly: every round accepts
  γ. Reading any other node (the planted bug) rejects."""
  gamma, n = 3, 12
  # g(x) = x + 1 mod V: a cycle of length V, so no other node's hidden state (they are γ + 1 = 4
  # steps apart) predicts the same drafts.
  table = 5.0 * jax.nn.one_hot((jnp.arange(V) + 1) % V, V) + 0.1 * jax.random.normal(
      jax.random.key(4), (V, V))
  v_params = {"logits": jnp.broadcast_to(table, (V + 1, V, V))}
  heads = jnp.stack([10.0 * jax.nn.one_hot(_greedy_map(table, k + 2), V) for k in range(gamma)])
  cls = _RootReadingDrafter if buggy else hidden.HiddenStateDrafter
  drafter = cls(vocab_size=V, d_model=V, gamma=gamma, layer=1)
  # Prompts that are greedy chains themselves, so the prompt's hidden state is right too.
  prompts = [[a, int(_greedy_map(table, 1)[a])] for a in range(4)]
  out = _run(v_params, {"w": heads, "b": jnp.zeros((gamma, V))}, prompts, drafter, n=n)
  assert out.new_tokens() == [testing.markov_greedy(v_params, p, n) for p in prompts]
  perfect = np.all(np.asarray(out.stats.verifier_calls) == -(-n // (gamma + 1)))
  assert perfect != buggy


def test_feedback_drafter_on_a_transformer_greedy_and_lossless():
  """The feedback drafter with a real verifier: greedy output equals the verifier's at batch > 1
  with ragged acceptance; sampling emits the verifier's exact law (chi-square)."""
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=V, sharpness=3.0)
  drafter = hidden.HiddenStateDrafter(V, v_cfg.d_model, gamma=3, layer=-1)
  # Heads start as the verifier's own output layer (they draft its next token at the node again,
  # which it often repeats with 6 tokens), plus noise so they disagree with it sometimes.
  noise = drafter.init_params(jax.random.key(1), scale=1.0)
  embed_t = v_params["embed"]["embedding"].T                             # [D, V]
  d_params = {"w": embed_t[None] + noise["w"], "b": noise["b"]}
  ver = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=12)
  out = loop.speculative_generate(v_params, d_params, prompts, jax.random.key(0), verifier=ver,
                                  drafter=drafter, sampling=Sampling(), max_new_tokens=12)
  assert out.new_tokens() == ar.new_tokens()
  accepted = np.asarray(out.stats.accepted)
  assert accepted.sum() > 0 and (accepted < np.asarray(out.stats.verifier_calls) * 3).any()
  law = testing.exact_sequence_law(v_cfg, v_params, [1, 4, 2], 2, Sampling(1.0))
  many = generate_lib.pad_prompts([[1, 4, 2]] * 3000, 3, pad_id=0)
  sampled = loop.speculative_generate(v_params, d_params, many, jax.random.key(1), verifier=ver,
                                      drafter=drafter, sampling=Sampling(1.0), max_new_tokens=2)
  assert testing.chi_square_pvalue([tuple(r) for r in sampled.new_tokens()], law) > 1e-3
  assert np.sum(sampled.stats.accepted) > 100  # drafts were accepted, not just bonus tokens


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors naming the field, before anything compiles.

@dataclasses.dataclass(frozen=True)
class _WrongVocabDrafter(testing.MarkovDrafter):
  """Proposes q over a larger vocabulary than its declared (and the verifier's) one."""

  def propose(self, params, state, tokens, lengths, rng, sampling):
    proposal, state = super().propose(params, state, tokens, lengths, rng, sampling)
    return proposal.replace(q=jnp.pad(proposal.q, ((0, 0), (0, 0), (0, 2)))), state


@dataclasses.dataclass(frozen=True)
class _NoLawDrafter(testing.MarkovDrafter):
  def propose(self, params, state, tokens, lengths, rng, sampling):
    proposal, state = super().propose(params, state, tokens, lengths, rng, sampling)
    return proposal.replace(q=None), state


def test_bad_input_is_refused_before_compiling():
  v_params, d_params = testing.markov_tables(V, seed=1)
  chain = trees.chain(2)
  with pytest.raises(ValueError, match=r"verifier_layers\) asks for .* layer 5, but the verifier "
                                      r"has 1 layers"):
    _run(v_params, d_params, PROMPTS, hidden.HiddenStateDrafter(V, V, 2, layer=5))
  v_cfg, _ = testing.tiny_model(vocab_size=V)
  with pytest.raises(ValueError, match=r"layer 9, but the verifier has 2 layers"):
    verifier_lib.lm_verifier(v_cfg, hidden.HiddenStateDrafter(V, V, 2, layer=9).verifier_layers)
  drafter = hidden.HiddenStateDrafter(V, V, 2, layer=1)
  with pytest.raises(ValueError, match="hidden_layers=drafter.verifier_layers"):
    _run(v_params, {}, PROMPTS, drafter, verifier=testing.MarkovVerifier(V))
  with pytest.raises(ValueError, match=r"proposal.q has shape \(4, 3, 8\)"):
    _run(v_params, d_params, PROMPTS, _WrongVocabDrafter(V, chain), sampling=Sampling(1.0))
  with pytest.raises(ValueError, match="proposal.q is None"):
    _run(v_params, d_params, PROMPTS, _NoLawDrafter(V, chain), sampling=Sampling(1.0))
  # Greedy needs no law.
  out = _run(v_params, d_params, PROMPTS, _NoLawDrafter(V, chain), n=6)
  assert out.new_tokens() == [testing.markov_greedy(v_params, p, 6) for p in PROMPTS]
  with pytest.raises(ValueError, match="Drafter vocab_size=7 differs from the verifier's 6"):
    _run(v_params, d_params, PROMPTS, testing.MarkovDrafter(7, chain))
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
    _run(v_params, d_params, PROMPTS, testing.MarkovDrafter(V, chain), n=0)
  with pytest.raises(ValueError, match="decode.rule='lenient' verifies chains"):
    _run(v_params, d_params, PROMPTS, testing.MarkovDrafter(V, standard.tree("rsd_c", 2, (2,))),
         sampling=Sampling(1.0), rule="lenient")
  with pytest.raises(ValueError, match="decode.rule='kseq' is not exact for rsd_c"):
    _run(v_params, d_params, PROMPTS, testing.MarkovDrafter(V, standard.tree("rsd_c", 2, (2,))),
         sampling=Sampling(1.0), rule="kseq")
