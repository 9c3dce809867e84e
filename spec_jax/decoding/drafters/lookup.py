"""Prompt lookup drafting (Saxena 2023, "prompt lookup decoding"; vLLM's `ngram` method): draft
the tokens that followed the most recent earlier occurrence of the text's last n tokens, with no
drafter model; and the same lookup laid over a model drafter (`LookupOverlay`).

Shape letters (repo legend): B batch, N token buffer (padded prompt + new tokens), A = γ draft
depth, V vocabulary, S cache slots.

The lookup (`lookup`), for a row with L committed tokens t_0 .. t_{L−1} (t_{L−1} the root):
  for n = max_ngram down to 1, the last end j < L − 1 with t_{j−n+1..j} = t_{L−n..L−1}; the
  longest n that occurs wins, the most recent j among its occurrences. The draft is
  t_{j+1}, t_{j+2}, ... continued periodically past the root (t_{k} := t_{k − d} for k > L − 1,
  d = L − 1 − j), so a text caught in a loop of period d gets a draft that repeats the loop.
  No occurrence: the draft repeats the root and `match` is 0.
The draft is a deterministic function of the committed prefix, so its law is the one-hot
q = δ(draft): every exact rule stays exact (speculative sampling accepts x with probability
p(x) and redraws from norm(p − δ_x)), and greedy stays equal to the verifier's greedy output.

`LookupOverlay` drafts the lookup chain for the rows whose match is at least `min_ngram` tokens
long and the model drafter's chain for the others. Which one a row uses depends on its prefix
alone, so each row's q is still the exact law of its draft. With every row on the lookup the
model's drafting is skipped (`lax.cond`): at batch 1 a matched round costs no drafter call.
The model drafter's state is kept as if it had drafted the chain that was verified: a feature
drafter's `commit` feeds the verified tokens itself; an LM drafter's cache gets the lookup drafts
written where its own would have been (one call of γ − 1 tokens, or γ + 1 with the catch-up
window when its drafting was skipped).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.decoding import methods
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import features, lm, standard, trees
from spec_jax.decoding.protocols import chain_proposal
from spec_jax.models import llama


def check_ngrams(max_ngram: int, min_ngram: int, field: str = "eval.lookup") -> None:
  """ValueError naming the fields unless 1 <= min_ngram <= max_ngram."""
  if int(min_ngram) < 1 or int(max_ngram) < int(min_ngram):
    raise ValueError(f"{field}.min_ngram={min_ngram}, {field}.max_ngram={max_ngram}: need "
                     f"1 <= min_ngram <= max_ngram (the n-gram lengths matched against the "
                     "text's last tokens; e.g. min_ngram=2, max_ngram=3).")


def lookup(tokens: jax.Array, lengths: jax.Array, gamma: int, max_ngram: int):
  """(draft int32[B, γ], match int32[B]) for tokens int32[B, N] with lengths int32[B] committed
  (see the module docstring); match is the matched n-gram's length, 0 for none."""
  b, size = tokens.shape
  last = lengths - 1                                                      # the root's index
  ends = jnp.arange(size, dtype=jnp.int32)[None]                          # candidate ends j
  best = jnp.full((b,), -1, jnp.int32)
  match = jnp.zeros((b,), jnp.int32)
  for n in range(1, max_ngram + 1):  # a longer match overrides a shorter one
    ok = (ends >= n - 1) & (ends < last[:, None]) & (last[:, None] >= n)
    for k in range(n):  # t_{j−k} = t_{L−1−k}
      here = jnp.take_along_axis(tokens, jnp.clip(ends - k, 0, size - 1), axis=1)
      want = jnp.take_along_axis(tokens, jnp.maximum(last - k, 0)[:, None], axis=1)
      ok &= here == want
    j = jnp.max(jnp.where(ok, ends, -1), axis=1)
    found = j >= 0
    best = jnp.where(found, j, best)
    match = jnp.where(found, n, match)
  period = jnp.maximum(last - best, 1)                                    # d = L − 1 − j
  index = best[:, None] + 1 + jnp.arange(gamma, dtype=jnp.int32)[None]    # [B, γ]
  over = index - last[:, None]
  index = jnp.where(over > 0, index - period[:, None] * ((over + period[:, None] - 1)
                                                         // period[:, None]), index)
  index = jnp.where(match[:, None] > 0, index, last[:, None])             # none: the root
  return jnp.take_along_axis(tokens, index, axis=1).astype(jnp.int32), match


def _one_hot_q(draft: jax.Array, vocab_size: int) -> jax.Array:
  """f32[B, γ + 1, V]: δ(draft_i) at node i (the leaf's row zero), the exact law of a lookup
  draft."""
  q = jax.nn.one_hot(draft, vocab_size, dtype=jnp.float32)
  return jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)


def _root(tokens, lengths):
  return jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter:
  """Chains of γ lookup drafts, no model (params are ignored). Implements `protocols.Drafter`;
  its state is an empty dict."""
  vocab_size: int
  shape: trees.TreeSpec = trees.chain(4)
  max_ngram: int = 3
  verifier_layers: tuple[int, ...] = ()

  def __post_init__(self):
    check_ngrams(self.max_ngram, 1)
    if not self.shape.is_chain:
      raise ValueError(f"Prompt lookup drafts chains, not {self.shape.describe()}. Fix: "
                       "lookup@γ (a chain).")

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden):
    del params, prompt_tokens, prompt_lengths, size, v_hidden
    return {}

  def propose(self, params, state, tokens, lengths, rng, sampling: sampling_lib.Sampling):
    del params, rng, sampling  # deterministic: the same draft at every temperature
    draft, _ = lookup(tokens, lengths, self.shape.depth, self.max_ngram)
    return chain_proposal(_root(tokens, lengths), draft,
                          _one_hot_q(draft, self.vocab_size)), state

  def commit(self, params, state, proposal, verdict, lengths, v_hidden):
    del params, proposal, verdict, lengths, v_hidden
    return state


@dataclasses.dataclass(frozen=True)
class LookupOverlay:
  """The lookup draft where the text's last `min_ngram`+ tokens occurred before, else `inner`'s
  (an `lm.LMDrafter` or `features.FeatureDrafter` of a chain shape). Implements
  `protocols.Drafter`; params and state are the inner drafter's."""
  inner: lm.LMDrafter | features.FeatureDrafter
  max_ngram: int = 3
  min_ngram: int = 2

  def __post_init__(self):
    check_ngrams(self.max_ngram, self.min_ngram)
    if type(self.inner) not in (lm.LMDrafter, features.FeatureDrafter):
      raise ValueError(
          f"sd_lookup lays prompt lookup over an LM or feature drafter, not "
          f"{type(self.inner).__name__} (a steered drafter's deltas would have to follow the "
          "substituted drafts). Fix: sd (or lookup alone) with this drafter.checkpoint.")
    if not self.inner.shape.is_chain:
      raise ValueError(f"sd_lookup drafts chains, not {self.inner.shape.describe()}. Fix: "
                       "sd_lookup@γ.")

  @property
  def shape(self) -> trees.TreeSpec:
    return self.inner.shape

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  @property
  def verifier_layers(self) -> tuple[int, ...]:
    return self.inner.verifier_layers

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden):
    return self.inner.init(params, prompt_tokens, prompt_lengths, size, v_hidden)

  def _feed(self, params, cache, tokens, lengths, draft, rows, window: bool):
    """An LM drafter's cache after a round it would have drafted `draft` in: draft tokens
    x_1..x_{γ−1} at slots L .. L + γ − 2 (and with `window` the catch-up pair t_{L−2}, t_{L−1}
    first) for rows bool[B]; other rows' writes are parked at slot S, which drops them."""
    last = lengths - 1
    feed, positions = draft[:, :-1], last[:, None] + 1 + jnp.arange(draft.shape[1] - 1)[None]
    if window:
      prev = jnp.maximum(last - 1, 0)
      pair = jnp.stack([jnp.take_along_axis(tokens, prev[:, None], 1)[:, 0],
                        _root(tokens, lengths)], axis=1)
      feed = jnp.concatenate([pair, feed], axis=1)
      positions = jnp.concatenate([jnp.stack([prev, last], axis=1), positions], axis=1)
    slots = jnp.where(rows[:, None], positions, cache.size)
    if window:  # a one-token prompt has no t_{L−2}
      slots = slots.at[:, 0].set(jnp.where(rows & (last >= 1), slots[:, 0], cache.size))
    if feed.shape[1] == 0:
      return cache
    _, _, cache = llama.make_apply(self.inner.cfg)(params, feed, positions, cache, None, slots)
    return cache

  def propose(self, params, state, tokens, lengths, rng, sampling: sampling_lib.Sampling):
    gamma = self.shape.depth
    draft, match = lookup(tokens, lengths, gamma, self.max_ngram)
    use = match >= self.min_ngram
    looked_up = chain_proposal(_root(tokens, lengths), draft, _one_hot_q(draft, self.vocab_size))
    is_lm = isinstance(self.inner, lm.LMDrafter)

    def skip(state):
      if is_lm:  # the catch-up window and the drafts, as the LM's own round would have fed
        state = self._feed(params, state, tokens, lengths, draft, use, window=True)
      return looked_up, state

    def model(state):
      proposal, state = self.inner.propose(params, state, tokens, lengths, rng, sampling)
      if is_lm:  # its own drafts sit at L .. L + γ − 2: the lookup rows' are overwritten
        state = self._feed(params, state, tokens, lengths, draft, use, window=False)
      return proposal, state

    proposal, state = jax.lax.cond(jnp.all(use), skip, model, state)
    return proposal.replace(
        tokens=jnp.where(use[:, None], looked_up.tokens, proposal.tokens),
        q=jnp.where(use[:, None, None], looked_up.q, proposal.q)), state

  def commit(self, params, state, proposal, verdict, lengths, v_hidden):
    return self.inner.commit(params, state, proposal, verdict, lengths, v_hidden)


# --- methods (`decoding.methods`) -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LookupOptions:
  """Prompt lookup's knobs (config `eval.lookup`): the text's last n tokens, n = max_ngram down
  to 1, are looked up earlier in the text; sd_lookup takes the lookup draft only for matches of
  min_ngram+ tokens, the drafter's otherwise."""
  max_ngram: int = 3
  min_ngram: int = 2

  def __post_init__(self):
    for name in ("max_ngram", "min_ngram"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"lookup.{name}={value!r} must be an integer >= 1.")
    check_ngrams(self.max_ngram, self.min_ngram, field="lookup")


def _chain(ints, depth, opts, width):
  del ints, opts, width
  return trees.chain(depth)


def _build_lookup(source: methods.Source, shape, opts: LookupOptions) -> methods.Built:
  """No drafter model: c = 0 and no drafter calls (the n-gram search is in the measured
  speedup)."""
  drafter = PromptLookupDrafter(source.v_cfg.vocab_size, shape, int(opts.max_ngram))
  return methods.Built(drafter, {}, methods.Cost(calls=0), "lookup")


def _build_overlay(source: methods.Source, shape, opts: LookupOptions) -> methods.Built:
  """The lookup over the LM or feature drafter; its cost model is the drafter's γ calls, an upper
  bound (rounds where every row matched skip them)."""
  drafter = LookupOverlay(features.for_model(source.d_cfg, shape), int(opts.max_ngram),
                          int(opts.min_ngram))
  return methods.Built(drafter, source.d_params, standard.model_cost(source, shape), "sd_lookup")


methods.register(methods.Method(
    "lookup", "prompt lookup: what followed the text's last n-gram, no drafter model",
    build=_build_lookup, shape=_chain, needs_model=False, options=LookupOptions,
    options_field="lookup", example="lookup@4"))
methods.register(methods.Method(
    "sd_lookup", "prompt lookup where an n-gram of min_ngram+ tokens recurs, the drafter elsewhere",
    build=_build_overlay, shape=_chain, kinds=("lm",), options=LookupOptions,
    options_field="lookup", example="sd_lookup@4"))
