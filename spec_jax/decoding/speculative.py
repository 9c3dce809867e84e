"""Chain speculative decoding: one jitted `lax.while_loop` per generate call (DESIGN.md §2).

Shape legend: B batch, P padded prompt length, N max new tokens, γ draft length, V vocabulary,
S = P + N + γ cache slots (slot = absolute position).

Invariants at the start of a round, per row b with L = lengths[b] committed tokens:
  * the verifier cache holds correct K/V for tokens[0 .. L-2]; tokens[L-1] (the last committed
    token: the correction or bonus of the previous round) has not been verified yet;
  * the drafter cache holds correct K/V for at least tokens[0 .. L-3].
One round:
  1. the drafter (`LMDrafter.propose`) feeds the window [tokens[L-2], tokens[L-1]] (re-writing
     L-2 is harmless: same token, same prefix, same K/V; it is needed after a fully accepted
     round, when x_γ was never fed), then drafts x_1..x_γ one token per call, keeping each
     step's exact law q_i;
  2. the verifier scores [tokens[L-1], x_1..x_γ] at positions L-1 .. L-1+γ in one call → p_1..p_{γ+1};
  3. the acceptance rule returns n accepted drafts and the correction/bonus token; the row emits
     up to n+1 tokens, cut exactly where autoregressive decoding would stop (after a stop token
     or at N new tokens).
Rejected drafts leave stale K/V in both caches at slots > the new L-1; the causal mask hides them
and the next round overwrites them before any query can see them. Nothing is ever cropped, so all
shapes are static and one compiled program serves every call of the same shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.decoding import acceptance
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.models import llama

# Incremented each time `_speculative_generate` is traced; tests assert it stays put across calls.
TRACE_COUNT = {"speculative": 0}


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static knobs of the speculative loop.

  gamma: draft tokens per round (γ).
  rule: "auto" (greedy when sampling is greedy, else speculative sampling), "greedy",
    "speculative", or "lenient" (lossy: accept with min(1, f(p)/q), f by `lenience` and `epsilon`).
  """
  gamma: int = 4
  rule: str = "auto"
  lenience: str = "lin"
  epsilon: float = 1.0

  def __post_init__(self):
    acceptance.validate_gamma(self.gamma)
    if self.rule not in ("auto", *acceptance.RULES):
      raise ValueError(f"decode.rule={self.rule!r} is not a rule; choose one of "
                       f"{['auto', *acceptance.RULES]}.")

  def rule_fn(self, sampling: sampling_lib.Sampling):
    rule = self.rule
    if rule == "auto":
      rule = "greedy" if sampling.greedy else "speculative"
    if rule == "greedy" and not sampling.greedy:
      raise ValueError("decode.rule='greedy' needs greedy sampling (temperature 0); with "
                       "temperature > 0 use 'speculative'.")
    if rule != "greedy" and sampling.greedy:
      raise ValueError(f"decode.rule={rule!r} samples, but temperature=0 means greedy decoding. "
                       "Set sampling.temperature > 0, or use rule 'greedy' (or 'auto').")
    if rule == "lenient":
      return functools.partial(acceptance.lenient, lenience=self.lenience, epsilon=self.epsilon)
    return acceptance.RULES[rule]


@flax.struct.dataclass
class SpecStats:
  """Per-row counters (only rows still generating count)."""
  verifier_calls: jax.Array     # int32[B]: verification rounds
  accepted: jax.Array           # int32[B]: accepted draft tokens
  reached: jax.Array            # int32[B, γ]: rounds in which draft position i was examined
  accepted_at: jax.Array        # int32[B, γ]: rounds in which draft position i was accepted
  alpha_sum: jax.Array          # f32[B]: Σ over examined positions of Σ_x min(p, q)


@flax.struct.dataclass
class SpecState:
  tokens: jax.Array             # int32[B, P + N]
  lengths: jax.Array            # int32[B]
  num_new: jax.Array            # int32[B]
  done: jax.Array               # bool[B]
  v_cache: llama.KVCache
  d_cache: object               # the drafter's state (an LM drafter's KV cache)
  rng: jax.Array
  round: jax.Array              # int32[]
  stats: SpecStats


@flax.struct.dataclass
class SpecOutput:
  tokens: jax.Array
  lengths: jax.Array
  prompt_lengths: jax.Array
  num_new: jax.Array
  rounds: jax.Array             # int32[]: loop iterations (the slowest row's verifier calls)
  stats: SpecStats

  def new_tokens(self) -> list[list[int]]:
    toks, lens, plens = jax.device_get((self.tokens, self.lengths, self.prompt_lengths))
    return [toks[b, plens[b]:lens[b]].tolist() for b in range(toks.shape[0])]


def check_pair(verifier_cfg: llama.LlamaConfig, drafter) -> None:
  """Drafter and verifier must share a vocabulary: q and p are laws over the same ids.
  `drafter` is a drafter or a LlamaConfig."""
  if verifier_cfg.vocab_size != drafter.vocab_size:
    raise ValueError(
        f"Drafter vocab_size={drafter.vocab_size} differs from the verifier's "
        f"{verifier_cfg.vocab_size}: speculative decoding compares their laws token by token. "
        "Train the drafter with the verifier's tokenizer (config.tokenizer).")


@dataclasses.dataclass(frozen=True)
class LMDrafter:
  """A small language model as drafter (plain, distilled or steered later).

  Every drafter offers the same two methods (DESIGN.md §2), so the loop never looks inside:
    init_state(params, prompt_tokens[B,P], size) -> state       (prefill)
    propose(params, state, tokens[B,S], lengths[B], rng, gamma, sampling)
        -> (draft int32[B,γ], q f32[B,γ,V], state)
  where q is the exact law each draft token was sampled from (float32, after the same
  temperature/top-k/top-p transform the verifier uses). A drafter is static (hashable): its
  arrays travel in `params` and `state`.
  """
  cfg: llama.LlamaConfig

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def init_state(self, params, prompt_tokens, size: int) -> llama.KVCache:
    b, p = prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    _, _, cache = llama.make_apply(self.cfg)(params, prompt_tokens, positions,
                                             llama.init_cache(self.cfg, b, size))
    return cache

  def propose(self, params, cache, tokens, lengths, rng, gamma, sampling):
    """Catch up on the committed tokens the cache lacks, then draft γ tokens (one call each)."""
    apply = llama.make_apply(self.cfg)
    b = tokens.shape[0]
    size = cache.size
    last = lengths - 1
    # Window [L-2, L-1]. With a one-token prompt (L = 1) there is no L-2: park that write at an
    # out-of-range slot, which drops it and hides it from every query (llama.split_mask).
    prev = jnp.maximum(last - 1, 0)
    window = jnp.stack([jnp.take_along_axis(tokens, prev[:, None], 1)[:, 0],
                        jnp.take_along_axis(tokens, last[:, None], 1)[:, 0]], axis=1)
    positions = jnp.stack([prev, last], axis=1)
    slots = jnp.stack([jnp.where(last >= 1, prev, size), last], axis=1)
    logits, _, cache = apply(params, window, positions, cache, None, slots)

    def draw(i, logits):
      probs = sampling_lib.probs_from_logits(logits, sampling)
      if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), probs
      return sampling_lib.sample(jax.random.fold_in(rng, i), probs), probs

    def step(i, carry):
      logits, cache, draft, q = carry
      x, probs = draw(i, logits)
      next_logits, _, cache = apply(params, x[:, None], (last + 1 + i)[:, None], cache)
      return next_logits[:, 0], cache, draft.at[:, i].set(x), q.at[:, i].set(probs)

    init = (logits[:, -1], cache, jnp.zeros((b, gamma), jnp.int32),
            jnp.zeros((b, gamma, self.vocab_size), jnp.float32))
    # Steps 0..γ-2 feed their token; the last draft is never fed (the verifier decides what
    # follows it, and the next round's catch-up window covers it).
    logits, cache, draft, q = jax.lax.fori_loop(0, gamma - 1, step, init)
    x, probs = draw(gamma - 1, logits)
    return draft.at[:, gamma - 1].set(x), q.at[:, gamma - 1].set(probs), cache


def commit_tokens(state: SpecState, emitted, n_emit, stop_ids, max_new_tokens):
  """Write up to n_emit[b] tokens of emitted[B, γ+1] per live row, stopping exactly where
  autoregressive decoding would: after a stop token, or at max_new_tokens."""
  b, width = emitted.shape
  live = ~state.done
  idx = jnp.arange(width)[None, :]
  valid = idx < n_emit[:, None]
  if stop_ids:
    is_stop = jnp.isin(emitted, jnp.asarray(stop_ids, jnp.int32)) & valid
    first_stop = jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1), width)
    n_emit = jnp.minimum(n_emit, first_stop + 1)
  else:
    first_stop = jnp.full((b,), width)
  n_emit = jnp.minimum(n_emit, max_new_tokens - state.num_new)
  n_emit = jnp.where(live, n_emit, 0)
  write = idx < n_emit[:, None]
  cols = jnp.where(write, state.lengths[:, None] + idx, state.tokens.shape[1])
  tokens = state.tokens.at[jnp.arange(b)[:, None], cols].set(emitted, mode="drop")
  num_new = state.num_new + n_emit
  stopped = live & (first_stop < n_emit)
  done = state.done | stopped | (num_new >= max_new_tokens)
  return tokens, state.lengths + n_emit, num_new, done


def prefill_state(v_params, d_params, prompt_tokens, prompt_lengths, rng, *, v_cfg, drafter,
                  overhang: int, depth: int, max_new_tokens: int) -> SpecState:
  """The loop's initial state: both caches prefilled with the whole prompt (more than the
  invariant needs), P + N + `overhang` slots (drafts of the last round overhang the output),
  per-depth counters of length `depth`."""
  b, p = prompt_tokens.shape
  size = p + max_new_tokens + overhang
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  _, _, v_cache = llama.make_apply(v_cfg)(v_params, prompt_tokens, positions,
                                          llama.init_cache(v_cfg, b, size))
  d_cache = drafter.init_state(d_params, prompt_tokens, size)
  zeros = jnp.zeros((b,), jnp.int32)
  stats = SpecStats(zeros, zeros, jnp.zeros((b, depth), jnp.int32),
                    jnp.zeros((b, depth), jnp.int32), jnp.zeros((b,), jnp.float32))
  return SpecState(jnp.pad(prompt_tokens, ((0, 0), (0, max_new_tokens))), prompt_lengths, zeros,
                   jnp.zeros((b,), bool), v_cache, d_cache, rng, jnp.int32(0), stats)


@functools.partial(jax.jit, static_argnames=("v_cfg", "drafter", "spec", "sampling",
                                             "max_new_tokens", "stop_ids"))
def _speculative_generate(v_params, d_params, prompt_tokens, prompt_lengths, rng, *, v_cfg,
                          drafter, spec, sampling, max_new_tokens, stop_ids):
  TRACE_COUNT["speculative"] += 1
  gamma = spec.gamma
  rule = spec.rule_fn(sampling)
  v_apply = llama.make_apply(v_cfg)
  b = prompt_tokens.shape[0]
  state = prefill_state(v_params, d_params, prompt_tokens, prompt_lengths, rng, v_cfg=v_cfg,
                        drafter=drafter, overhang=gamma, depth=gamma,
                        max_new_tokens=max_new_tokens)

  def body(s: SpecState) -> SpecState:
    key = jax.random.fold_in(s.rng, s.round)
    draft_key, accept_key = jax.random.split(key)
    draft, q, d_cache = drafter.propose(d_params, s.d_cache, s.tokens, s.lengths, draft_key,
                                        gamma, sampling)
    last = s.lengths - 1
    current = jnp.take_along_axis(s.tokens, last[:, None], 1)
    verify_tokens = jnp.concatenate([current, draft], axis=1)          # [B, γ+1]
    verify_pos = last[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)[None]
    logits, _, v_cache = v_apply(v_params, verify_tokens, verify_pos, s.v_cache)
    p_law = sampling_lib.probs_from_logits(logits, sampling)          # [B, γ+1, V]
    verdict = rule(p_law, q, draft, accept_key)
    n = verdict.num_accepted
    emitted = jnp.concatenate([draft, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = emitted.at[jnp.arange(b), n].set(verdict.next_token)     # x_1..x_n, next
    tokens, lengths, num_new, done = commit_tokens(s, emitted, n + 1, stop_ids, max_new_tokens)
    live = (~s.done).astype(jnp.int32)
    reached = (jnp.arange(gamma)[None] <= n[:, None]).astype(jnp.int32) * live[:, None]
    alpha = acceptance.acceptance_rate(p_law[:, :gamma], q)           # [B, γ]
    st = s.stats
    stats = SpecStats(
        verifier_calls=st.verifier_calls + live,
        accepted=st.accepted + n * live,
        reached=st.reached + reached,
        accepted_at=st.accepted_at + (jnp.arange(gamma)[None] < n[:, None]) * live[:, None],
        alpha_sum=st.alpha_sum + jnp.sum(alpha * reached, axis=1))
    return SpecState(tokens, lengths, num_new, done, v_cache, d_cache, s.rng, s.round + 1, stats)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return SpecOutput(state.tokens, state.lengths, prompt_lengths, state.num_new, state.round,
                    state.stats)


def speculative_generate(verifier_params, drafter_params, prompts: generate_lib.Prompts,
                         rng: jax.Array, *, verifier_cfg: llama.LlamaConfig,
                         drafter_cfg: llama.LlamaConfig | None = None, drafter=None,
                         spec: SpecConfig,
                         sampling: sampling_lib.Sampling, max_new_tokens: int,
                         stop_ids: Sequence[int] = (),
                         max_cache_len: int | None = None) -> SpecOutput:
  """Generate up to `max_new_tokens` per row with a draft model and exact (or lenient)
  verification. Same stopping rule and output layout as `generate.generate`.

  The drafter is `drafter` (any object with `init_state`/`propose`, see `LMDrafter`) or, as a
  shorthand, `drafter_cfg` for an LM drafter. The caches hold P + max_new_tokens + γ slots
  (drafts of the last round overhang by γ); `max_cache_len` (e.g. the verifier's context
  length) bounds that.
  """
  if (drafter is None) == (drafter_cfg is None):
    raise ValueError("Pass exactly one of drafter_cfg (an LM drafter) or drafter.")
  drafter = drafter or LMDrafter(drafter_cfg)
  check_pair(verifier_cfg, drafter)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  if max_cache_len is not None:
    room = max_cache_len - prompts.tokens.shape[1] - max_new_tokens
    acceptance.validate_gamma(spec.gamma, max_gamma=room, field="decode.gamma")
  spec.rule_fn(sampling)  # fail fast on rule/sampling mismatches, outside jit
  return _speculative_generate(
      verifier_params, drafter_params, prompts.tokens, prompts.lengths, rng, v_cfg=verifier_cfg,
      drafter=drafter, spec=spec, sampling=sampling, max_new_tokens=int(max_new_tokens),
      stop_ids=tuple(int(i) for i in stop_ids))
