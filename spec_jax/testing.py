"""Tiny models and exact laws shared by the tests (and handy in notebooks)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop, protocols
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import features as features_lib
from spec_jax.decoding.drafters import trees
from spec_jax.models import draft_init, llama


def tiny_model(seed: int = 0, vocab_size: int = 257, sharpness: float = 1.0,
               context: float = 1.0, **overrides):
  """A 'test-tiny' Llama with random params. `sharpness` scales the tied embedding so next-token
  laws range from near-uniform (1) to peaked (~10), which statistical tests need. `context`
  scales the attention's value and output kernels: at random init the residual is mostly the
  current token's embedding (other contexts move the next-token law by ~0.02 in total variation
  and never its argmax), so a test of what a cache holds needs ~6 (~0.17, the argmax moving
  with the context)."""
  cfg = llama.model_config("test-tiny", vocab_size=vocab_size, **overrides)
  params = llama.init_params(cfg, jax.random.key(seed))
  if sharpness != 1.0:
    params = {**params, "embed": {"embedding": params["embed"]["embedding"] * sharpness}}
  if context != 1.0:
    attn = params["layers"]["attn"]
    attn = {**attn, **{k: {"kernel": attn[k]["kernel"] * context} for k in ("v", "o")}}
    params = {**params, "layers": {**params["layers"], "attn": attn}}
  return cfg, params


def with_overrides(config, overrides: dict):
  """config with {"a.b.field": value} set, at any depth (what `--config.a.b.field=value` does)."""
  for key, value in overrides.items():
    *path, field = key.split(".")
    node = config
    for name in path:
      node = node[name]
    node[field] = value
  return config


def perturbed(params, sigma: float, seed: int = 1):
  """params + sigma * N(0, 1) noise: a drafter that agrees with its verifier often, not always."""
  return _perturbed(params, seed, sigma)


@functools.partial(jax.jit, static_argnums=2)
def _perturbed(params, seed, sigma: float):
  """`perturbed` as one compiled program (run op by op, each leaf shape compiles three). The
  barriers keep the draw, its scaling and the sum three separately rounded steps, as op by op
  (XLA would fold sigma into the normal's own scale and fuse the multiply-add): the values are
  the op-by-op ones bit for bit."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  barrier = jax.lax.optimization_barrier
  return jax.tree.unflatten(treedef, [
      x + barrier(sigma * barrier(jax.random.normal(k, x.shape, x.dtype)))
      for x, k in zip(leaves, keys)])


@functools.cache
def jitted_apply(cfg, hidden_layers: tuple[int, ...] = ()):
  """`llama.make_apply(cfg, hidden_layers)` jitted, once per config: tests and references run the
  same model many times, and a new jit object per call would trace and compile it again (run
  eagerly, each of its ops compiles on its own)."""
  return jax.jit(llama.make_apply(cfg, hidden_layers))


def naive_greedy(cfg, params, prompt: list[int], n: int, width: int = 64) -> list[int]:
  """Greedy continuation by re-running the full causal forward each step (no cache at all).
  The sequence is right-padded to a fixed `width` (causality makes the padding invisible), so
  every step reuses one compiled forward."""
  if len(prompt) + n > width:
    raise ValueError(f"prompt + n = {len(prompt) + n} exceeds width={width}.")
  apply = jitted_apply(cfg)
  seq = list(prompt)
  for _ in range(n):
    x = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
    logits, _, _ = apply(params, x, jnp.arange(width)[None])
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


def exact_sequence_law(cfg, params, prompt: list[int], n: int,
                       sampling: sampling_lib.Sampling) -> dict[tuple[int, ...], float]:
  """Exact probability of every n-token continuation under `sampling`, by enumeration
  (vocab_size ** n sequences; keep both small)."""
  apply = jitted_apply(cfg)
  law = {}
  for seq in itertools.product(range(cfg.vocab_size), repeat=n):
    x = jnp.asarray([list(prompt) + list(seq)], jnp.int32)
    logits, _, _ = apply(params, x, jnp.arange(x.shape[1])[None])
    probs = sampling_lib.probs_from_logits(logits[0, len(prompt) - 1:-1], sampling)
    law[seq] = float(np.prod([probs[i, t] for i, t in enumerate(seq)]))
  return law


def chi_square_pvalue(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float],
                      min_expected: float = 5.0) -> float:
  """Pearson chi-square goodness of fit of `samples` to `law`, pooling cells whose expected count
  is below `min_expected` into one cell. A sample outside the law's support gives p = 0."""
  counts = {}
  for s in samples:
    if law.get(s, 0.0) <= 0.0:
      return 0.0
    counts[s] = counts.get(s, 0) + 1
  n = len(samples)
  obs, exp, pool_obs, pool_exp = [], [], 0.0, 0.0
  for key, prob in law.items():
    if prob * n >= min_expected:
      obs.append(counts.get(key, 0))
      exp.append(prob * n)
    else:
      pool_obs += counts.get(key, 0)
      pool_exp += prob * n
  if pool_exp > 0:
    obs.append(pool_obs)
    exp.append(pool_exp)
  if len(obs) < 2:  # a single cell holds all samples, and all of them are in the support
    return 1.0
  exp = np.asarray(exp) * (n / np.sum(exp))  # guard float drift in the law's total
  return float(stats.chisquare(obs, exp).pvalue)


def sd_law_pvalue(v_cfg, v_params, drafter, d_params, prompt: list[int], *, n: int = 2,
                  n_samples: int = 3000, min_accepted: int = 300,
                  sampling: sampling_lib.Sampling = sampling_lib.Sampling(1.0)) -> float:
  """Chi-square p-value of n tokens drawn by speculative decoding (n_samples copies of `prompt`,
  one batch) against the verifier's exact law of them. Asserts that at least `min_accepted`
  drafts were accepted, so the test exercises acceptance and not only bonus tokens."""
  from spec_jax.decoding import generate as generate_lib  # noqa: PLC0415 (tests only)
  from spec_jax.decoding import loop, verifier as verifier_lib  # noqa: PLC0415
  law = exact_sequence_law(v_cfg, v_params, prompt, n, sampling)
  out = loop.speculative_generate(
      v_params, d_params, generate_lib.pad_prompts([prompt] * n_samples, len(prompt), pad_id=0),
      jax.random.key(1), verifier=verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers),
      drafter=drafter, sampling=sampling, max_new_tokens=n)
  assert np.sum(out.stats.accepted) > min_accepted
  return chi_square_pvalue([tuple(r) for r in out.new_tokens()], law)


def dispatch(config, workdir: str):
  """What launch.py does with a config: lock it (programs may not add fields) and call
  spec_jax.programs.<config.program>.run."""
  import importlib  # noqa: PLC0415 (tests only)
  config.lock()
  return importlib.import_module(f"spec_jax.programs.{config.program}").run(config, workdir)


def refuse(*args, **kwargs):
  """A stand-in for work a resumed run must not redo: it fails the test if called."""
  raise AssertionError("a finished piece was redone instead of read back")


# ---------------------------------------------------------------------------------------------
# Table-driven fakes (t5x-style): the loop and every rule, tested with no transformer at all.


@dataclasses.dataclass(frozen=True)
class MarkovVerifier:
  """An order-2 Markov chain as verifier: the logits after token x with predecessor w are
  params["logits"][w, x] (f32[V + 1, V, V]; row w = V means "no predecessor", at position 0).

  Its cache is the committed token sequence, int32[B, S] with slot = position, kept exactly as a
  KV cache is: `score` writes node j at slot L − 1 + j, `commit` moves a tree's accepted path
  into slots L .. L + n − 1. The root's predecessor is read back from the cache, so a loop that
  commits the wrong path sees the wrong law next round. hidden[layer] = one_hot(token) f32[.., V]
  for every layer asked for (D = V, one layer)."""
  vocab_size: int
  hidden_layers: tuple[int, ...] = ()
  num_layers: int = 1

  def __post_init__(self):
    protocols.check_layers(self.hidden_layers, self.num_layers,
                           "verifier hidden_layers (the drafter's verifier_layers)")

  def init(self, params, prompt_tokens, size: int):
    b, p = prompt_tokens.shape
    cache = jnp.zeros((b, size), jnp.int32).at[:, :p].set(prompt_tokens)
    one_hot = jax.nn.one_hot(prompt_tokens, self.vocab_size, dtype=jnp.float32)
    return cache, {layer: one_hot for layer in self.hidden_layers}

  def score(self, params, cache, proposal: protocols.Proposal, lengths):
    b, m = proposal.tokens.shape
    last = lengths - 1
    rows = jnp.arange(b)[:, None]
    cache = cache.at[rows, last[:, None] + jnp.arange(m)[None]].set(proposal.tokens, mode="drop")
    root_prev = jnp.where(last >= 1, cache[jnp.arange(b), jnp.maximum(last - 1, 0)],
                          self.vocab_size)
    parent_tok = jnp.take_along_axis(proposal.tokens, jnp.maximum(proposal.parent, 0), axis=1)
    prev = jnp.where(proposal.parent >= 0, parent_tok, root_prev[:, None])
    logits = params["logits"][prev, proposal.tokens]                       # [B, M, V]
    one_hot = jax.nn.one_hot(proposal.tokens, self.vocab_size, dtype=jnp.float32)
    return logits, {layer: one_hot for layer in self.hidden_layers}, cache

  def commit(self, cache, lengths, verdict: protocols.Verdict):
    b, depth = verdict.path.shape
    rows = jnp.arange(b)[:, None]
    last = (lengths - 1)[:, None]
    src = cache[rows, jnp.clip(last + verdict.path, 0, cache.shape[1] - 1)]
    d = jnp.arange(depth)[None]
    dst = jnp.where(d < verdict.num_accepted[:, None], last + 1 + d, cache.shape[1])
    return cache.at[rows, dst].set(src, mode="drop")


@dataclasses.dataclass(frozen=True)
class MarkovDrafter:
  """An order-1 Markov chain as drafter of `shape`: the law after token x is
  transform(params["logits"][x]) (f32[V, V]). Chains draw x_i from the law after x_{i−1}; trees
  grow with the real tree samplers (`drafters.trees.expand`). Stateless."""
  vocab_size: int
  shape: trees.TreeSpec
  verifier_layers: tuple[int, ...] = ()

  def init(self, params, prompt_tokens, prompt_lengths, size, v_hidden):
    return jnp.zeros((), jnp.int32)

  def propose(self, params, state, tokens, lengths, rng, sampling):
    table = params["logits"]
    root = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
    spec = self.shape
    if spec.is_chain:
      x, drafts, qs = root, [], []
      for i in range(spec.depth):
        q = sampling_lib.probs_from_logits(table[x], sampling)
        x = (jnp.argmax(table[x], -1).astype(jnp.int32) if sampling.greedy
             else sampling_lib.sample(jax.random.fold_in(rng, i), q))
        drafts.append(x)
        qs.append(q)
      return protocols.chain_proposal(root, jnp.stack(drafts, 1), jnp.stack(qs, 1)), state
    levels, q_levels = [trees.root_level(root)], []
    for d in range(1, spec.depth + 1):
      logits = table[levels[-1].tokens]                                    # [B, W, V]
      q = sampling_lib.probs_from_logits(logits, sampling)
      q_levels.append(q)
      levels.append(trees.expand(spec, d, jax.random.fold_in(rng, d), logits, q, levels[-1],
                                 spec.level_offsets[d - 1], sampling))
    b = root.shape[0]
    q_levels.append(jnp.zeros((b, spec.level_widths[-1], self.vocab_size), jnp.float32))
    tree = trees.assemble(spec, levels)
    return protocols.Proposal(
        tokens=tree.tokens, parent=tree.parent, depth=tree.depth, valid=tree.valid,
        q=jnp.concatenate(q_levels, 1), chain=False, scheme=spec.scheme, max_depth=spec.depth,
        max_candidates=spec.max_candidates), state

  def commit(self, params, state, proposal, verdict, lengths, v_hidden):
    return state


def markov_tables(vocab_size: int, seed: int = 0, sharpness: float = 2.0,
                  drafter_noise: float = 0.5):
  """(verifier params, drafter params): random logit tables, the drafter's a noisy copy of the
  verifier's average over predecessors, so they agree often but not always."""
  kv, kd = jax.random.split(jax.random.key(seed))
  v_logits = sharpness * jax.random.normal(kv, (vocab_size + 1, vocab_size, vocab_size))
  d_logits = v_logits.mean(0) + drafter_noise * sharpness * jax.random.normal(
      kd, (vocab_size, vocab_size))
  return {"logits": v_logits}, {"logits": d_logits}


def markov_law(v_params, prompt: list[int], n: int,
               sampling: sampling_lib.Sampling) -> dict[tuple[int, ...], float]:
  """Exact probability of every n-token continuation under a MarkovVerifier, by enumeration."""
  table = np.asarray(v_params["logits"])
  vocab = table.shape[1]
  law = {}
  for seq in itertools.product(range(vocab), repeat=n):
    full = list(prompt) + list(seq)
    prob = 1.0
    for i, tok in enumerate(seq):
      t = len(prompt) + i
      prev = full[t - 2] if t >= 2 else vocab
      probs = np.asarray(sampling_lib.probs_from_logits(jnp.asarray(table[prev, full[t - 1]]),
                                                        sampling))
      prob *= float(probs[tok])
    law[seq] = prob
  return law


def markov_greedy(v_params, prompt: list[int], n: int) -> list[int]:
  """The MarkovVerifier's greedy continuation (ties → lowest id, as jnp.argmax)."""
  table = np.asarray(v_params["logits"])
  vocab = table.shape[1]
  seq = list(prompt)
  for _ in range(n):
    prev = seq[-2] if len(seq) >= 2 else vocab
    seq.append(int(np.argmax(table[prev, seq[-1]])))
  return seq[len(prompt):]


def lm_speculative(v_cfg, v_params, d_cfg, d_params, prompts, rng, *, gamma: int = 3,
                   shape=None, decode=None, **kwargs):
  """Speculative decoding with a Llama verifier and an LM drafter (a γ chain unless `shape`):
  the common pair of the tests, in one call."""
  from spec_jax.decoding import loop, verifier  # noqa: PLC0415 (tests only)
  from spec_jax.decoding.drafters import lm  # noqa: PLC0415
  return loop.speculative_generate(
      v_params, d_params, prompts, rng, verifier=verifier.lm_verifier(v_cfg),
      drafter=lm.LMDrafter(d_cfg, shape or trees.chain(gamma)),
      decode=decode or loop.DecodeConfig(), **kwargs)


def random_verdict(proposal: protocols.Proposal, rng: np.random.Generator) -> protocols.Verdict:
  """A verdict accepting a random path of the tree (each step a random valid child, down to a
  random depth, deeper ones likelier, or a leaf) and a random next token. Its fields are host
  arrays (numpy, the dtypes a rule returns): a jitted commit takes them as they are."""
  tokens, parent, valid = (np.asarray(x) for x in (proposal.tokens, proposal.parent,
                                                   proposal.valid))
  b, _ = tokens.shape
  depth = proposal.depth_bound
  n, path = np.zeros(b, np.int32), np.zeros((b, depth), np.int32)
  for row in range(b):
    node, want = 0, min(rng.integers(0, 2 * depth + 1), depth)
    while n[row] < want:
      children = np.nonzero(valid[row] & (parent[row] == node))[0]
      if not len(children):
        break
      node = int(rng.choice(children))
      path[row, n[row]] = node
      n[row] += 1
  zeros = np.zeros((b, depth), np.float32)
  return protocols.Verdict(
      num_accepted=n, next_token=rng.integers(0, 16, b).astype(np.int32), path=path,
      reached=zeros.astype(bool), alpha=zeros, num_candidates=zeros.astype(np.int32))


def tiny_feature_pair(vocab_size=16, sharpness=2.0, sigma=0.3):
  """(v_cfg, v_params, d_cfg, d_params): a tiny verifier and a feature drafter made of its block
  1, every drafter weight perturbed by N(0, sigma²)."""
  v_cfg, v_params = tiny_model(seed=0, vocab_size=vocab_size, sharpness=sharpness)
  d_cfg, d_params = draft_init.select_layers(v_cfg, jax.tree.map(np.asarray, v_params), (1,))
  d_cfg, d_params = draft_init.feature_drafter(d_cfg, d_params)
  return v_cfg, v_params, d_cfg, perturbed(jax.device_put(d_params), sigma, 1)


def decode(v_cfg, v_params, drafter, d_params, prompts, sampling, n, **kwargs):
  """`loop.speculative_generate` of `drafter` against the LM verifier (v_cfg, v_params), key 0."""
  return loop.speculative_generate(
      v_params, d_params, prompts, jax.random.key(0),
      verifier=verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers), drafter=drafter,
      sampling=sampling, max_new_tokens=n, **kwargs)


def tiny_eagle3_pair(vocab_size=16, sharpness=2.0, sigma=0.2, depths=(0, 1, 2)):
  """(v_cfg, v_params, d_cfg, d_params): a tiny verifier (`tiny_model`, 2 layers) and a
  multi-layer feature drafter (EAGLE-3) made of its block 1, reading its residual at `depths`
  through feature_fc, every drafter weight (feature_fc's too, so every depth counts) perturbed
  by N(0, sigma²)."""
  v_cfg, v_params = tiny_model(seed=0, vocab_size=vocab_size, sharpness=sharpness)
  d_cfg, d_params = draft_init.select_layers(v_cfg, jax.tree.map(np.asarray, v_params), (1,))
  d_cfg, d_params = draft_init.feature_drafter(d_cfg, d_params, depths)
  return v_cfg, v_params, d_cfg, perturbed(jax.device_put(d_params), sigma, 1)


# ---------------------------------------------------------------------------------------------
# Shared checks of drafters against a tiny verifier (tests of trees, dyn and EAGLE-3 features).

RAGGED_PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 8], [6, 1, 2, 9], [3]]  # one prompt of one token


def greedy_reference(v_cfg, v_params, prompts=RAGGED_PROMPTS, n: int = 14):
  """(padded prompts, stop ids, the verifier's greedy output with them) for a ragged batch: two
  stop tokens taken from the free-running output cut two rows early."""
  padded = generate_lib.pad_prompts(prompts, 8, pad_id=0)
  greedy = sampling_lib.Sampling()
  free = generate_lib.generate(v_params, padded, jax.random.key(0), cfg=v_cfg, sampling=greedy,
                               max_new_tokens=n).new_tokens()
  stops = (free[0][5], free[2][3])
  ar = generate_lib.generate(v_params, padded, jax.random.key(0), cfg=v_cfg, sampling=greedy,
                             max_new_tokens=n, stop_ids=stops)
  assert min(map(len, ar.new_tokens())) < n
  return padded, stops, ar.new_tokens()


def assert_greedy_equal(v_cfg, v_params, drafter, d_params, reference, n: int = 14):
  """Greedy speculative decoding with `drafter` emits `reference`'s verifier greedy output token
  for token, and its drafts were partly accepted, partly not (a drafter that never agrees, or
  always does, would test nothing)."""
  prompts, stops, want = reference
  out = decode(v_cfg, v_params, drafter, d_params, prompts, sampling_lib.Sampling(), n,
               stop_ids=stops)
  assert out.new_tokens() == want
  accepted = np.asarray(out.stats.accepted)
  depth = drafter.shape.depth
  assert accepted.sum() > 0 and (accepted < np.asarray(out.stats.verifier_calls) * depth).any()


def feature_rounds(v_cfg, v_params, drafter, d_params, prompts=RAGGED_PROMPTS, steps: int = 5,
                   size: int = 48, on_propose=None):
  """Rounds of propose (T = 1) / verifier score / a random accepted path and next token
  (`random_verdict`) / both commits, for a feature drafter. `on_propose(step, state_before,
  proposal, lengths)` runs after each proposal. Returns (drafter state, committed tokens
  int32[B, size], lengths, the set of accepted depths). Every step is jitted once (the same
  shapes each round) and the host keeps the text in numpy: run eagerly, each of the models'
  ops would compile a program of its own."""
  verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  padded = generate_lib.pad_prompts(prompts, 8, pad_id=0)
  v_cache, v_hidden = jax.jit(verifier.init, static_argnums=2)(v_params, padded.tokens, size)
  state = jax.jit(drafter.init, static_argnums=3)(d_params, padded.tokens, padded.lengths, size,
                                                  v_hidden)
  tokens = np.zeros((len(prompts), size), np.int32)
  tokens[:, :8] = np.asarray(padded.tokens)
  lengths = np.array(padded.lengths)
  rng = np.random.default_rng(0)
  propose = jax.jit(drafter.propose, static_argnames="sampling")
  score, v_commit, commit = (jax.jit(verifier.score), jax.jit(verifier.commit),
                             jax.jit(drafter.commit))
  depths = set()
  for step in range(steps):
    lens = lengths.astype(np.int32)  # copies: the host arrays move on below
    before = state
    proposal, state = propose(d_params, state, tokens.copy(), lens, jax.random.key(step),
                              sampling=sampling_lib.Sampling(1.0))
    if on_propose is not None:
      on_propose(step, before, proposal, lengths)
    _, hidden, v_cache = score(v_params, v_cache, proposal, lens)
    verdict = random_verdict(proposal, rng)
    v_cache = v_commit(v_cache, lens, verdict)
    state = commit(d_params, state, proposal, verdict, lens, hidden)
    drafted = np.asarray(proposal.tokens)
    for b in range(len(prompts)):
      n = int(verdict.num_accepted[b])
      depths.add(n)
      path = drafted[b, verdict.path[b, :n]]
      tokens[b, lengths[b]:lengths[b] + n + 1] = [*path, int(verdict.next_token[b])]
      lengths[b] += n + 1
  return state, tokens, lengths, depths


@functools.partial(jax.jit, static_argnums=(0, 1))
def _fresh_feature_forward(v_cfg, drafter, v_params, d_params, tokens, last):
  """(drafter cache, logits f32[B, V], feature f32[B, D] at index `last` int32[B]) of a fresh
  forward over tokens int32[B, T] reading the verifier's features at the drafter's depths."""
  d_cfg = drafter.cfg
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  _, v_fresh, _ = llama.make_apply(v_cfg, drafter.verifier_layers)(v_params, tokens, positions)
  feature_in = features_lib.shift(features_lib.verifier_features(d_cfg, d_params, v_fresh))
  _, d_fresh, fresh = llama.make_apply(d_cfg, (-1,))(
      d_params, tokens, positions, llama.init_cache(d_cfg, b, t), features=feature_in)
  logits, feature = drafter._last(d_params, d_fresh[-1], last)  # noqa: SLF001
  return fresh, logits, feature


def assert_fresh_feature_state(v_cfg, v_params, drafter, d_params, state, tokens, lengths):
  """The feature drafter's K/V at every committed slot, and the law and predicted feature it
  keeps for the next round, equal a fresh forward over the committed text reading the
  verifier's features (`features.verifier_features` at the drafter's depths)."""
  longest = int(lengths.max())
  fresh, logits, feature = _fresh_feature_forward(
      v_cfg, drafter, v_params, d_params, tokens[:, :longest], (lengths - 1).astype(np.int32))
  for name in ("k", "v"):
    kept, want = (np.asarray(getattr(c, name)) for c in (state["cache"], fresh))
    for b, length in enumerate(lengths):
      np.testing.assert_allclose(kept[:, b, :length], want[:, b, :length], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(state["logits"], logits, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(state["feature"], feature, atol=1e-4, rtol=1e-4)
