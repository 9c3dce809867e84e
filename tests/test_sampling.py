"""Exact draws in the far tail, and laws that are not laws.

A token whose probability is a ratio r below the top token's is drawn by Gumbel-max only when its
noise beats the top token's by log(1/r). JAX's default Gumbel noise stops at ~15.9, so the old
sampler (`_old_sample`, kept here as the planted bug) drew tokens 1e-7 below the top about half as
often as it should and tokens 1e-8 below almost never. The tail law below has one dominant token
and 4095 tokens at ratios 1e-6 to 1e-8 of it, scattered over the vocabulary (and so over the
sampler's blocks); 200,000 draws put ~51, ~5 and ~28 draws into its three groups, and a binomial
test per group must pass (p > 1e-3) for every drawing site and fail for the old sampler.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from spec_jax import testing
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop, sampling
from spec_jax.decoding.acceptance import chain
from spec_jax.decoding.drafters import standard, trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import llama

N, CHUNK, V = 200_000, 25_000, 4096
GROUPS = {"1e-6": (256, 1e-6), "1e-7": (256, 1e-7), "1e-8..1e-7": (3583, None)}


def _tail_law():
  """(probs f32[V], group int[V]: -1 for the dominant token, else the index into GROUPS)."""
  ratios, group = [np.ones(1)], [np.full(1, -1)]
  for g, (count, ratio) in enumerate(GROUPS.values()):
    ratios.append(np.full(count, ratio) if ratio else np.geomspace(1e-8, 1e-7, count, endpoint=False))
    group.append(np.full(count, g))
  ratios, group = np.concatenate(ratios), np.concatenate(group)
  perm = np.random.default_rng(0).permutation(V)
  probs, groups = np.zeros(V), np.zeros(V, int)
  probs[perm], groups[perm] = ratios / ratios.sum(), group
  return probs.astype(np.float32), groups


PROBS, GROUP = _tail_law()


def _group_pvalues(tokens) -> dict[str, float]:
  """Two-sided binomial p-value of each tail group's count against its probability."""
  tokens = np.asarray(tokens).reshape(-1)
  law = PROBS.astype(np.float64) / PROBS.astype(np.float64).sum()
  return {name: stats.binomtest(int(np.sum(GROUP[tokens] == g)), tokens.size,
                                float(law[GROUP == g].sum())).pvalue
          for g, name in enumerate(GROUPS)}


def _draws(draw, n=N) -> np.ndarray:
  """n tokens from draw(key, probs[CHUNK, V]) -> int32[CHUNK], in jitted chunks."""
  f = jax.jit(lambda key: draw(key, jnp.broadcast_to(jnp.asarray(PROBS), (CHUNK, V))))
  return np.concatenate([np.asarray(f(jax.random.key(i))) for i in range(n // CHUNK)])


def _old_sample(key, probs):
  """The sampler before this fix: one Gumbel per token with JAX's default (low-range) noise."""
  logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
  return sampling.first_argmax(logp + jax.random.gumbel(key, logp.shape, jnp.float32))


def _assert_exact(pvalues):
  assert min(pvalues.values()) > 1e-3, pvalues


def _assert_tail_lost(pvalues):
  assert pvalues["1e-8..1e-7"] < 1e-4, pvalues


def _cut_tail(probs):
  """A planted bug as cheap as the exact sampler: the old sampler's failure mode (tokens far
  below the top are never drawn) applied to the law itself, at ratio 1e-7. Half the draws
  suffice to see it: ~14 expected in the deep group, none drawn (p ≈ 1e-6)."""
  return jnp.where(probs >= 1e-7 * jnp.max(probs, axis=-1, keepdims=True), probs, 0.0)


@pytest.mark.optimized  # large laws: run time dominates
def test_sample_is_exact_in_the_far_tail_and_the_old_sampler_is_not():
  _assert_exact(_group_pvalues(_draws(sampling.sample)))
  _assert_tail_lost(_group_pvalues(_draws(_old_sample)))


@pytest.mark.optimized  # large laws: run time dominates
def test_gumbel_top_k_first_draw_is_exact_in_the_far_tail():
  first = lambda key, probs: trees.gumbel_top_k(key, jnp.log(probs), 2)[0][:, 0]  # noqa: E731
  _assert_exact(_group_pvalues(_draws(first)))
  _assert_tail_lost(_group_pvalues(_draws(lambda key, probs: first(key, _cut_tail(probs)),
                                         n=N // 2)))


def _correction(key, probs, sample_fn=None):
  """A γ = 1 round whose draft (token z, q = δ_z) is rejected w.p. 0.95; the correction is then
  drawn from norm(max(0, p − q)) = the tail law. Returns the correction, or -1 if accepted."""
  z = int(np.argmin(PROBS))
  p = 0.95 * probs + 0.05 * jax.nn.one_hot(z, V)                           # [CHUNK, V]
  p = jnp.stack([p, p], axis=1)                                            # draft and bonus rows
  q = jnp.broadcast_to(jax.nn.one_hot(z, V)[None, None], (probs.shape[0], 1, V))
  draft = jnp.full((probs.shape[0], 1), z, jnp.int32)
  verdict = chain.speculative_sampling(p, q, draft, key)
  return jnp.where(verdict.num_accepted == 0, verdict.next_token, -1)


@pytest.mark.optimized  # large laws: run time dominates
def test_correction_token_is_exact_in_the_far_tail(monkeypatch):
  tokens = _draws(_correction)
  rejected = tokens[tokens >= 0]
  assert abs(rejected.size / N - 0.95) < 0.01
  _assert_exact(_group_pvalues(rejected))
  # Planted bug: the rule's draw loses the far tail.
  monkeypatch.setattr(chain, "sample", lambda key, law: sampling.sample(key, _cut_tail(law)))
  tokens = _draws(_correction, n=N // 2)
  _assert_tail_lost(_group_pvalues(tokens[tokens >= 0]))


def test_two_stage_sample_on_small_laws():
  """Every vocabulary size (one block, ragged last block), zero-probability tokens never drawn,
  and an unnormalised law drawn as its normalisation."""
  for v in (2, 3, 7, 300):
    probs = np.array(jax.nn.softmax(2.0 * jax.random.normal(jax.random.key(v), (v,))))
    probs[: v // 4] = 0.0
    probs = (3.0 * probs).astype(np.float32)
    x = np.asarray(jax.jit(sampling.sample)(jax.random.key(1),
                                            jnp.broadcast_to(jnp.asarray(probs), (30_000, v))))
    law = {(i,): float(p) for i, p in enumerate(probs / probs.sum())}
    assert testing.chi_square_pvalue([(int(t),) for t in x], law) > 1e-3, v
  assert sampling.block_size(49152) == 256 and sampling.block_size(3) == 2


def test_uniform_resolves_small_acceptance_ratios():
  u = np.asarray(sampling.uniform(jax.random.key(0), (4_000_000,)))
  assert u.min() >= 0.0 and u.max() < 1.0
  # P(u < 1e-6) = 1e-6: jax's default grid (spacing 2^-23 ≈ 1.2e-7) has 9 points there, this one
  # 2^23 points; below 2^-30 the default grid has only 0 (probability 2^-23 each time).
  assert np.sum(u < 2.0 ** -30) <= 3
  assert stats.binomtest(int(np.sum(u < 1e-3)), u.size, 1e-3).pvalue > 1e-3


# ---------------------------------------------------------------------------------------------
# Laws that are not laws: a per-row flag inside the loops, a clear error on the host.

def test_law_status_codes():
  logits = jnp.asarray([[0.0, 1.0], [jnp.nan, 1.0], [-jnp.inf, -jnp.inf], [jnp.inf, 0.0]])
  for s in (Sampling(1.0), Sampling(1.0, top_k=1), Sampling(0.7, top_p=0.5)):
    status = sampling.law_status(logits, sampling.probs_from_logits(logits, s))
    np.testing.assert_array_equal(status, [sampling.LAW_OK, sampling.LAW_NAN_LOGITS,
                                           sampling.LAW_EMPTY, sampling.LAW_EMPTY])
  # Greedy: a one-hot law, but NaN logits are still reported.
  status = sampling.law_status(logits[:2], sampling.probs_from_logits(logits[:2], Sampling()))
  np.testing.assert_array_equal(status, [sampling.LAW_OK, sampling.LAW_NAN_LOGITS])
  # What greedy decoding reports (`draw`, and `law_status` without probs): the one-hot always
  # has mass 1, so logits without a finite maximum are empty, as at every temperature > 0.
  for status in (sampling.law_status(logits), sampling.draw(jax.random.key(0), logits,
                                                            Sampling())[1]):
    np.testing.assert_array_equal(status, [sampling.LAW_OK, sampling.LAW_NAN_LOGITS,
                                           sampling.LAW_EMPTY, sampling.LAW_EMPTY])
  token, status = sampling.draw(jax.random.key(0), jnp.full((1, 5), -jnp.inf), Sampling())
  assert int(status[0]) == sampling.LAW_EMPTY and token.shape == (1,)


@dataclasses.dataclass(frozen=True)
class _BrokenVerifier(testing.MarkovVerifier):
  """A Markov verifier whose logits in row `row` become `value` once the row's committed length
  reaches `at_length` (a verifier that goes bad mid-generation)."""
  row: int = 1
  at_length: int = 5
  value: float = float("nan")

  def score(self, params, cache, proposal, lengths):
    logits, hidden, cache = super().score(params, cache, proposal, lengths)
    hit = (jnp.arange(logits.shape[0]) == self.row) & (lengths >= self.at_length)
    return jnp.where(hit[:, None, None], self.value, logits), hidden, cache


@pytest.mark.parametrize("value,cause", [(float("nan"), "logits contain NaN"),
                                         (-float("inf"), "left no token with positive probability")])
def test_a_broken_verifier_law_is_a_clear_error_not_token_zero(value, cause):
  v_params, d_params = testing.markov_tables(6, seed=0)
  verifier = _BrokenVerifier(6, value=value)
  drafter = testing.MarkovDrafter(6, trees.chain(2))
  prompts = generate_lib.Prompts(jnp.ones((3, 2), jnp.int32), jnp.full((3,), 2, jnp.int32))
  s = Sampling(1.0, top_k=3)
  with pytest.raises(sampling.LawError, match=rf"row 1 stopped at new token [2-4]: .*{cause}"):
    loop.speculative_generate(v_params, d_params, prompts, jax.random.key(0), verifier=verifier,
                              drafter=drafter, sampling=s, max_new_tokens=12)
  # Inside the loop it is a flag in the output: the bad row stopped, the others finished.
  out = loop._generate_jit(v_params, d_params, prompts.tokens, prompts.lengths, jax.random.key(0),
                           verifier=verifier, drafter=drafter, decode=loop.DecodeConfig(),
                           sampling=s, max_new_tokens=12, stop_ids=())
  assert np.asarray(out.law_error).tolist() == [0, sampling.LAW_NAN_LOGITS if value != value
                                                else sampling.LAW_EMPTY, 0]
  assert np.asarray(out.num_new).tolist()[0::2] == [12, 12] and int(out.num_new[1]) < 12


GREEDY_SHAPES = [trees.chain(2), standard.tree("rsd_c", 3, (2, 2)),
                 standard.tree("rsd_s", 3, width=2), standard.tree("specinfer", 2, width=3),
                 standard.tree("spectr", 2, width=3)]


@pytest.mark.parametrize("shape", GREEDY_SHAPES, ids=lambda s: s.describe())
def test_an_empty_verifier_law_under_greedy_is_a_clear_error_in_every_loop_shape(shape):
  """Greedy reads only the argmax, which all -inf logits still have (token 0): the loop must
  stop the row there as sampling does, having emitted only the verifier's greedy tokens."""
  v_params, d_params = testing.markov_tables(6, seed=0)
  verifier = _BrokenVerifier(6, value=-float("inf"))
  drafter = testing.MarkovDrafter(6, shape)
  prompts = generate_lib.Prompts(jnp.ones((3, 2), jnp.int32), jnp.full((3,), 2, jnp.int32))
  with pytest.raises(sampling.LawError, match=r"row 1 stopped at new token \d+: the greedy law "
                                              r".*left no token with positive probability"):
    loop.speculative_generate(v_params, d_params, prompts, jax.random.key(0), verifier=verifier,
                              drafter=drafter, sampling=Sampling(), max_new_tokens=12)
  out = loop._generate_jit(v_params, d_params, prompts.tokens, prompts.lengths, jax.random.key(0),
                           verifier=verifier, drafter=drafter, decode=loop.DecodeConfig(),
                           sampling=Sampling(), max_new_tokens=12, stop_ids=())
  assert np.asarray(out.law_error).tolist() == [0, sampling.LAW_EMPTY, 0]
  greedy = testing.markov_greedy(v_params, [1, 1], 12)
  new = out.new_tokens()
  assert new[0] == new[2] == greedy
  # Row 1 broke in the first round scored at length >= 5 (3 new tokens), keeping what came before.
  at = int(out.law_error_at[1])
  assert 3 <= at < 12 and int(out.num_new[1]) == at and new[1] == greedy[:at]


@pytest.mark.parametrize("s", [Sampling(), Sampling(1.0)], ids=["greedy", "T=1"])
def test_an_empty_law_mid_generation_is_a_clear_error_in_generate(monkeypatch, s):
  """A transformer whose logits in row 1 turn all -inf from position 5 on (those that choose the
  4th new token after a 3-token prompt): `generate` names the row and the number of tokens it
  kept, greedy as when sampling."""
  cfg, params = testing.tiny_model()
  prompts = generate_lib.Prompts(jnp.ones((3, 3), jnp.int32), jnp.full((3,), 3, jnp.int32))
  make_apply = llama.make_apply

  def broken_make_apply(cfg, *args, **kwargs):
    apply = make_apply(cfg, *args, **kwargs)

    def broken(params, tokens, positions, cache, *rest, **kw):
      logits, hidden, cache = apply(params, tokens, positions, cache, *rest, **kw)
      hit = (jnp.arange(tokens.shape[0])[:, None] == 1) & (positions >= 5)      # [B, T]
      return jnp.where(hit[..., None], -jnp.inf, logits), hidden, cache
    return broken

  monkeypatch.setattr(llama, "make_apply", broken_make_apply)
  # A fresh jit of a new function: jax caches traces per function, and a program traced with the
  # sound model (by another test) must not be reused.
  monkeypatch.setattr(generate_lib, "_generate_jit", jax.jit(
      lambda *a, **k: generate_lib._generate(*a, **k), static_argnames=generate_lib.STATIC))
  with pytest.raises(sampling.LawError, match=r"row 1 stopped at new token 3: "
                                              r".*left no token with positive probability"):
    generate_lib.generate(params, prompts, jax.random.key(0), cfg=cfg, sampling=s,
                          max_new_tokens=6)
  out = generate_lib._generate_jit(params, prompts.tokens, prompts.lengths, jax.random.key(0),
                                   cfg=cfg, sampling=s, max_new_tokens=6, stop_ids=())
  assert np.asarray(out.law_error).tolist() == [0, sampling.LAW_EMPTY, 0]
  new = out.new_tokens()
  assert [len(t) for t in new] == [6, 3, 6] and int(out.law_error_at[1]) == 3
  if s.greedy:  # the same prompt in every row: row 1 kept the sound tokens before the break
    assert new[1] == new[0][:3] and new[0] == new[2]


def test_nan_logits_in_autoregressive_generation_are_a_clear_error():
  cfg, params = testing.tiny_model()
  params = {**params, "embed": {"embedding": params["embed"]["embedding"] * jnp.nan}}
  prompts = generate_lib.Prompts(jnp.ones((2, 3), jnp.int32), jnp.full((2,), 3, jnp.int32))
  with pytest.raises(sampling.LawError, match=r"row 0 \(2 rows in all: \[0, 1\]\) stopped at "
                                              r"new token 0: .*logits contain NaN"):
    generate_lib.generate(params, prompts, jax.random.key(0), cfg=cfg, sampling=Sampling(1.0),
                          max_new_tokens=4)
