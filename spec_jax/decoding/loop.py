"""The speculative loop: one jitted `lax.while_loop` per generate call, for every drafter and
rule (chains, lenience, RSD-C, RSD-S, SpecInfer, SpecTr, drafters fed by the verifier).

Shape letters (repo legend): B batch, P padded prompt length, O max new tokens, M proposal nodes,
A deepest draft level, V vocabulary, S = P + O + M − 1 cache slots.

One round (docs/design.md §2):
  proposal, d_state = drafter.propose(d_params, d_state, tokens, lengths, rng, sampling)
  logits, hidden, v_cache = verifier.score(v_params, v_cache, proposal, lengths)
  verdict = rule(probs_from_logits(logits, sampling), proposal, rng)
  v_cache = verifier.commit(v_cache, lengths, verdict)
  d_state = drafter.commit(d_params, d_state, proposal, verdict, lengths, hidden)
  advance: each live row emits the accepted path and the next token, cut exactly where
           autoregressive decoding would stop (after a stop token or at O new tokens)
Invariant at the start of a round, per row with L = lengths[b] committed tokens: the verifier
cache holds correct K/V for tokens[0 .. L-2]; tokens[L-1] (the last committed token: the
previous round's correction or bonus) is the proposal's root, scored with the drafts. The
drafter's state is its own business. The proposal of the last round overhangs the output by up
to M − 1 slots, so caches hold S = P + O + M − 1 slots; nothing is ever cropped and one compiled
program serves every call with the same (B, P, O, drafter, verifier, rule, sampling).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax import parallel
from spec_jax.decoding import acceptance
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.protocols import Proposal, Verdict, check_layers


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Static knobs of verification. The draft shape (chain γ or tree) belongs to the drafter
  (`drafter.shape`), since a drafter such as a bank of heads fixes it.

  rule: "auto" (greedy at temperature 0, else the lossless rule of the drafter's sampling
    scheme), or a name in `acceptance.RULES`.
  lenience, epsilon: the lossy lenient rule's f and ε (DistillSpec §5.3); ε = 1 is lossless.
  allow_inexact: run a rule that does not fit the proposal's sampling scheme (to measure the
    loss in tests and experiments); off, such a rule is refused before anything compiles.
  relaxed_top_k: k of the lossy greedy rule top_k_relaxed (Stern et al. 2018).
  """
  rule: str = "auto"
  lenience: str = "lin"
  epsilon: float = 1.0
  allow_inexact: bool = False
  relaxed_top_k: int = 2

  def __post_init__(self):
    if self.rule not in ("auto", *acceptance.RULES):
      raise ValueError(f"decode.rule={self.rule!r} is not a rule; choose one of "
                       f"{['auto', *acceptance.RULES]}.")
    if self.rule == "lenient":
      acceptance.chain.lenience_fn(self.lenience, self.epsilon)

  def resolve(self, shape, sampling: sampling_lib.Sampling):
    """(rule name, rule function) for proposals of `shape` under `sampling`."""
    return acceptance.resolve(self.rule, shape, sampling, lenience=self.lenience,
                              epsilon=self.epsilon, allow_inexact=self.allow_inexact,
                              relaxed_top_k=self.relaxed_top_k)


@flax.struct.dataclass
class Stats:
  """Per-row counters, written once per round (only rows still generating count). The
  acceptance counters (accepted, reached, accepted_at, alpha_sum) count a round's depths up to
  the output's end (max_new_tokens, or an accepted stop token): drafts examined past it are not
  output and not counted. candidates and drafted count the work done."""
  verifier_calls: jax.Array     # int32[B]: verification rounds
  accepted: jax.Array           # int32[B]: accepted draft tokens
  reached: jax.Array            # int32[B, A]: rounds in which depth i + 1 was examined
  accepted_at: jax.Array        # int32[B, A]: rounds in which a depth-(i + 1) draft was accepted
  alpha_sum: jax.Array          # f32[B]: Σ over examined depths of Σ_x min(p, q)
  candidates: jax.Array         # int32[B]: draft candidates examined
  drafted: jax.Array            # int32[B]: valid draft nodes proposed (the root excluded)


@flax.struct.dataclass
class LoopState:
  tokens: jax.Array             # int32[B, P + O]: prompt then generated tokens
  lengths: jax.Array            # int32[B]: committed tokens per row
  num_new: jax.Array            # int32[B]
  done: jax.Array               # bool[B]
  v_cache: object               # the verifier's cache
  d_state: object               # the drafter's state (opaque)
  rng: jax.Array
  round: jax.Array              # int32[]
  stats: Stats
  law_error: jax.Array          # int32[B]: `sampling.law_status` code of the first broken law
  law_error_at: jax.Array       # int32[B]: new tokens the row had emitted when it broke


@flax.struct.dataclass
class DecodeOutput:
  tokens: jax.Array             # int32[B, P + O] (stale beyond lengths[b])
  lengths: jax.Array            # int32[B]
  prompt_lengths: jax.Array     # int32[B]
  num_new: jax.Array            # int32[B]
  rounds: jax.Array             # int32[]: loop iterations (the slowest row's verifier calls)
  stats: Stats
  law_error: jax.Array          # int32[B]: 0, or the `sampling.law_status` code that stopped the row
  law_error_at: jax.Array       # int32[B]: new tokens emitted before it

  def new_tokens(self) -> list[list[int]]:
    toks, lens, plens = (parallel.to_host(x) for x in (self.tokens, self.lengths,
                                                       self.prompt_lengths))
    return [toks[b, plens[b]:lens[b]].tolist() for b in range(toks.shape[0])]


def emit(state: LoopState, emitted, n_emit, stop_ids, max_new_tokens):
  """Write up to n_emit[b] tokens of emitted[B, A+1] per live row, stopping exactly where
  autoregressive decoding would: after a stop token, or at max_new_tokens.
  Returns (tokens, lengths, num_new, done, window): window[b], the round's output positions that
  fall in the output whatever the verdict (up to the first stop token among its first n_emit
  tokens, and within max_new_tokens), for the acceptance counters."""
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
  window = jnp.minimum(first_stop + 1, max_new_tokens - state.num_new)
  n_emit = jnp.minimum(n_emit, max_new_tokens - state.num_new)
  n_emit = jnp.where(live, n_emit, 0)
  write = idx < n_emit[:, None]
  cols = jnp.where(write, state.lengths[:, None] + idx, state.tokens.shape[1])
  tokens = state.tokens.at[jnp.arange(b)[:, None], cols].set(emitted, mode="drop")
  num_new = state.num_new + n_emit
  stopped = live & (first_stop < n_emit)
  done = state.done | stopped | (num_new >= max_new_tokens)
  return tokens, state.lengths + n_emit, num_new, done, window


def _check_proposal(proposal: Proposal, shape, vocab_size: int, batch: int, rule: str) -> None:
  """Trace-time (static) checks: a proposal the rule cannot read is an error naming the field,
  raised while tracing, before XLA compiles anything."""
  m = shape.num_nodes
  for name in ("tokens", "parent", "depth", "valid"):
    got = getattr(proposal, name).shape
    if got != (batch, m):
      raise ValueError(f"proposal.{name} has shape {got}, but the drafter's shape "
                       f"({shape.describe()}) has M={m} nodes: want [B, M] = {(batch, m)}.")
  if proposal.chain != shape.is_chain:
    raise ValueError(f"proposal.chain={proposal.chain} but drafter.shape is {shape.describe()}.")
  if proposal.q is None:
    if not acceptance.RULES[rule].greedy:
      raise ValueError(f"proposal.q is None (the drafter gives no exact law), so only greedy "
                       f"decoding can verify it, not decode.rule={rule!r} (docs/design.md §6).")
    return
  if proposal.q.shape != (batch, m, vocab_size):
    raise ValueError(f"proposal.q has shape {proposal.q.shape}; it must be the exact law at "
                     f"every node, [B, M, V] = {(batch, m, vocab_size)} (V = the verifier's "
                     "vocabulary: map draft ids and laws into it first).")


def law_errors(logits, p, proposal: Proposal, sampling: sampling_lib.Sampling) -> jax.Array:
  """int32[B]: LAW_NAN_LOGITS / LAW_EMPTY if the verifier's law at a valid node is broken,
  LAW_DRAFT_NAN if the drafter's law q holds a NaN, else LAW_OK (`sampling.law_status`).
  Under greedy sampling the decoding law is the one-hot at the argmax, whose mass is always 1, so
  the status is read from the logits' maximum (`law_status` without probs): all -inf or a +inf
  is LAW_EMPTY (top_k_relaxed's T = 1 law is broken by exactly the same logits)."""
  node = sampling_lib.law_status(logits, None if sampling.greedy else p)        # [B, M]
  status = jnp.where(proposal.valid, node, sampling_lib.LAW_OK)
  out = jnp.where(jnp.any(status == sampling_lib.LAW_NAN_LOGITS, axis=1),
                  sampling_lib.LAW_NAN_LOGITS, jnp.max(status, axis=1))
  if proposal.q is not None:
    draft_nan = jnp.any(jnp.isnan(proposal.q), axis=(1, 2))
    out = jnp.where((out == sampling_lib.LAW_OK) & draft_nan, sampling_lib.LAW_DRAFT_NAN, out)
  return out.astype(jnp.int32)


def score_drafted(verifier, params, cache, proposal: Proposal, lengths, done):
  """`verifier.score` over the first w nodes of a chain whose rows stop drafting early
  (`trees.TreeSpec.stop`), w = the most valid nodes of a live row, so a round costs the verifier
  call of the drafts it made. One compiled call per w, each in a while loop that runs once if
  its w is the round's and never otherwise: a loop carries the cache in place, where a
  `lax.switch` over the widths copies it in and out each round. Logits and hidden states come
  back padded with zeros to the proposal's M nodes; nothing reads them past a row's drafts
  (`acceptance.chain.stop_at_drafted`)."""
  m = proposal.num_nodes
  nodes = jnp.sum(proposal.valid, axis=1).astype(jnp.int32)
  width = jnp.max(jnp.where(done, 2, nodes))

  def pad(x):
    return jnp.pad(x, [(0, 0), (0, m - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

  def score(w, cache):
    sub = Proposal(tokens=proposal.tokens[:, :w], parent=proposal.parent[:, :w],
                   depth=proposal.depth[:, :w], valid=proposal.valid[:, :w],
                   q=None if proposal.q is None else proposal.q[:, :w], chain=True,
                   scheme="chain", max_depth=w - 1, max_candidates=1)
    logits, hidden, cache = verifier.score(params, cache, sub, lengths)
    return pad(logits), {layer: pad(h) for layer, h in hidden.items()}, cache

  shapes = jax.eval_shape(lambda c: score(m, c)[:2], cache)
  out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes) + (cache,)
  for w in range(2, m + 1):
    def body(carry, w=w):
      return (False, *score(w, carry[-1]))
    out = jax.lax.while_loop(lambda carry: carry[0], body, (width == w, *out))[1:]
  return out


STATIC = ("verifier", "drafter", "decode", "sampling", "max_new_tokens", "stop_ids", "mesh")


@parallel.laid_out
def _generate(v_params, d_params, prompt_tokens, prompt_lengths, rng, *, verifier, drafter,
              decode: DecodeConfig, sampling, max_new_tokens, stop_ids,
              mesh=None) -> DecodeOutput:
  shape = drafter.shape
  stops = bool(getattr(shape, "stop", 0.0))  # a chain whose rows may draft fewer than γ
  rule_name, rule = decode.resolve(shape, sampling)
  b, p = prompt_tokens.shape
  depth = shape.depth
  size = p + max_new_tokens + shape.num_nodes - 1
  v_cache, v_hidden = verifier.init(v_params, prompt_tokens, size)
  want = drafter.verifier_layers
  d_state = drafter.init(d_params, prompt_tokens, prompt_lengths, size,
                         {layer: v_hidden[layer] for layer in want})
  # On a mesh: caches sharded over the batch and the KV heads (a no-op without one).
  v_cache, d_state = parallel.constrain_caches((v_cache, d_state), mesh)
  zeros = jnp.zeros((b,), jnp.int32)
  per_depth = jnp.zeros((b, depth), jnp.int32)
  state = LoopState(
      tokens=jnp.pad(prompt_tokens, ((0, 0), (0, max_new_tokens))), lengths=prompt_lengths,
      num_new=zeros, done=jnp.zeros((b,), bool), v_cache=v_cache, d_state=d_state, rng=rng,
      round=jnp.int32(0),
      stats=Stats(zeros, zeros, per_depth, per_depth, jnp.zeros((b,), jnp.float32), zeros,
                  zeros),
      law_error=zeros, law_error_at=zeros)

  def body(s: LoopState) -> LoopState:
    draft_key, accept_key = jax.random.split(jax.random.fold_in(s.rng, s.round))
    proposal, d_state = drafter.propose(d_params, s.d_state, s.tokens, s.lengths, draft_key,
                                        sampling)
    _check_proposal(proposal, shape, verifier.vocab_size, b, rule_name)
    if stops:  # rows drafted 1..γ tokens: verify the drafted nodes alone
      logits, hidden, v_cache = score_drafted(verifier, v_params, s.v_cache, proposal, s.lengths,
                                              s.done)
    else:
      logits, hidden, v_cache = verifier.score(v_params, s.v_cache, proposal, s.lengths)
    p = acceptance.verifier_law(rule_name, logits, sampling)  # the law the rule declares
    verdict: Verdict = rule(p, proposal, accept_key)
    if stops:
      verdict = acceptance.chain.stop_at_drafted(verdict, p, proposal.valid,
                                                 jax.random.fold_in(accept_key, 1),
                                                 greedy=acceptance.RULES[rule_name].greedy)
    # A row whose verifier or drafter law broke this round stops here, emitting nothing of it.
    status = law_errors(logits, p, proposal, sampling)
    broke = ~s.done & (status != sampling_lib.LAW_OK)
    v_cache = verifier.commit(v_cache, s.lengths, verdict)
    d_state = drafter.commit(d_params, d_state, proposal, verdict, s.lengths,
                             {layer: hidden[layer] for layer in want})
    v_cache, d_state = parallel.constrain_caches((v_cache, d_state), mesh)
    # Emit the accepted path's tokens, then the correction/bonus token at index n.
    n = verdict.num_accepted
    path_tokens = jnp.take_along_axis(proposal.tokens, verdict.path, axis=1)     # [B, A]
    emitted = jnp.concatenate([path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = emitted.at[jnp.arange(b), n].set(verdict.next_token)
    tokens, lengths, num_new, done, window = emit(s, emitted, jnp.where(broke, 0, n + 1),
                                                  stop_ids, max_new_tokens)
    live = (~s.done).astype(jnp.int32)
    # Acceptance counts the depths whose tokens would be output (`emit`'s window): a last
    # round's drafts past max_new_tokens or after an accepted stop token are not counted.
    counted = live[:, None] * (jnp.arange(depth)[None, :] < window[:, None])
    reached = verdict.reached.astype(jnp.int32) * counted
    st = s.stats
    stats = Stats(
        verifier_calls=st.verifier_calls + live,
        accepted=st.accepted + jnp.minimum(n, window) * live,
        reached=st.reached + reached,
        accepted_at=st.accepted_at + verdict.accepted.astype(jnp.int32) * counted,
        alpha_sum=st.alpha_sum + jnp.sum(verdict.alpha * reached, axis=1),
        candidates=st.candidates + jnp.sum(verdict.num_candidates, axis=1) * live,
        drafted=st.drafted + jnp.sum(proposal.valid[:, 1:], axis=1).astype(jnp.int32) * live)
    return LoopState(tokens, lengths, num_new, done | broke, v_cache, d_state, s.rng, s.round + 1,
                     stats, law_error=jnp.where(broke, status, s.law_error),
                     law_error_at=jnp.where(broke, s.num_new, s.law_error_at))

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return DecodeOutput(state.tokens, state.lengths, prompt_lengths, state.num_new, state.round,
                      state.stats, state.law_error, state.law_error_at)


_generate_jit = jax.jit(_generate, static_argnames=STATIC)


def check_pair(verifier, drafter) -> None:
  """Static checks of a drafter against a verifier, before anything is traced."""
  if verifier.vocab_size != drafter.vocab_size:
    raise ValueError(
        f"Drafter vocab_size={drafter.vocab_size} differs from the verifier's "
        f"{verifier.vocab_size}: speculative decoding compares their laws token by token. "
        "Train the drafter with the verifier's tokenizer (config.tokenizer).")
  missing = [layer for layer in drafter.verifier_layers if layer not in verifier.hidden_layers]
  if missing:
    check_layers(missing, getattr(verifier, "num_layers", 10**9), "drafter.verifier_layers")
    raise ValueError(
        f"drafter.verifier_layers={tuple(drafter.verifier_layers)} but the verifier returns "
        f"hidden states at {verifier.hidden_layers}: build it with "
        "verifier.lm_verifier(cfg, hidden_layers=drafter.verifier_layers).")


def lower(verifier_params, drafter_params, tokens, lengths, rng, *, verifier, drafter,
          decode: DecodeConfig = DecodeConfig(), sampling: sampling_lib.Sampling,
          max_new_tokens: int, stop_ids: Sequence[int] = (), mesh=None):
  """The loop's one jitted program lowered for these inputs, after speculative_generate's checks
  (pair, rule/shape/sampling, mesh divisibility). Every input may be abstract
  (`jax.ShapeDtypeStruct` with its sharding): nothing is allocated, so a plan far larger than
  the machine compiles ahead of time (programs/pod_plan.py). Parameters must already carry
  their shardings (`parallel.place_params` places concrete ones)."""
  check_pair(verifier, drafter)
  decode.resolve(drafter.shape, sampling)
  if mesh is not None:
    parallel.check_decode_mesh(mesh, tokens.shape[0],
                               {"verifier": _kv_heads(verifier), "drafter": _kv_heads(drafter)})
    parallel.check_kernels_on_mesh(mesh, {"verifier": getattr(verifier, "cfg", None),
                                          "drafter": getattr(drafter, "cfg", None)})
  return _generate_jit.lower(
      verifier_params, drafter_params, tokens, lengths, rng, verifier=verifier, drafter=drafter,
      decode=decode, sampling=sampling,
      max_new_tokens=acceptance.positive_int(max_new_tokens, "max_new_tokens"),
      stop_ids=tuple(int(i) for i in stop_ids), mesh=mesh)


def speculative_generate(verifier_params, drafter_params, prompts: generate_lib.Prompts,
                         rng: jax.Array, *, verifier, drafter,
                         decode: DecodeConfig = DecodeConfig(),
                         sampling: sampling_lib.Sampling, max_new_tokens: int,
                         stop_ids: Sequence[int] = (),
                         max_cache_len: int | None = None, mesh=None,
                         compile_only: bool = False) -> DecodeOutput | None:
  """Generate up to `max_new_tokens` per row with `drafter` proposing and `verifier` checking
  (exactly, or leniently if decode.rule = 'lenient'). Same stopping rule and output layout as
  `generate.generate`; greedy output equals it token for token.

  verifier: a `protocols.Verifier` (e.g. `verifier.lm_verifier(cfg, drafter.verifier_layers)`);
  drafter: a `protocols.Drafter` (e.g. `drafters.lm.LMDrafter(cfg, trees.chain(4))`).
  The caches hold P + max_new_tokens + M − 1 slots; `max_cache_len` (e.g. the verifier's
  context) bounds that. Bad input raises ValueError naming the field, before anything compiles.
  A row whose verifier or drafter law is not a distribution (NaN logits, nothing left after
  top-k/top-p) stops there and the call raises `sampling.LawError` naming it.

  mesh: a `parallel.make_mesh` Mesh to decode on, or None (one device). On a mesh the batch is
  sharded over ('data', 'fsdp'), both models' parameters are placed for decoding
  (`parallel.place_params`: weights stay put, activations move) and their KV caches shard rows
  and key/value heads ('tensor'); the output equals the single-device one (greedy: token for
  token). Multi-host: every process passes the same global prompts and parameters; each
  contributes its own rows.
  compile_only: run every check and compile for these shapes, then return None without decoding
  (the next call with the same shapes runs the compiled program).
  """
  check_pair(verifier, drafter)
  max_new_tokens = acceptance.positive_int(max_new_tokens, "max_new_tokens")
  shape = drafter.shape
  if max_cache_len is not None:
    room = max_cache_len - prompts.tokens.shape[1] - max_new_tokens
    overhang = shape.num_nodes - 1
    if overhang > room:
      if shape.is_chain:
        raise ValueError(f"decode.gamma = {shape.depth} exceeds the maximum {room} allowed here: "
                         f"the cache (max_cache_len={max_cache_len}) holds "
                         f"{prompts.tokens.shape[1]} prompt and {max_new_tokens} new tokens plus "
                         "γ draft slots. Lower decode.gamma or the new tokens.")
      raise ValueError(
          f"The draft tree ({shape.describe()}) has {shape.num_nodes} nodes but only {room} cache "
          f"slots are left after {prompts.tokens.shape[1]} prompt and {max_new_tokens} new tokens "
          f"(max_cache_len={max_cache_len}): use a smaller tree or fewer new tokens.")
  decode.resolve(shape, sampling)  # fail fast on rule/shape/sampling mismatches, outside jit
  if mesh is not None:
    parallel.check_decode_mesh(
        mesh, prompts.tokens.shape[0],
        {"verifier": _kv_heads(verifier), "drafter": _kv_heads(drafter)})
    parallel.check_kernels_on_mesh(mesh, {"verifier": getattr(verifier, "cfg", None),
                                          "drafter": getattr(drafter, "cfg", None)})
    verifier_params = parallel.place_params(verifier_params, mesh)
    drafter_params = parallel.place_params(drafter_params, mesh)
    prompts = generate_lib.on_mesh(prompts, mesh)
  args = (verifier_params, drafter_params, prompts.tokens, prompts.lengths, rng)
  kwargs = dict(verifier=verifier, drafter=drafter, decode=decode, sampling=sampling,
                max_new_tokens=max_new_tokens, stop_ids=tuple(int(i) for i in stop_ids), mesh=mesh)
  if compile_only:
    _generate_jit.lower(*args, **kwargs).compile()
    return None
  out = _generate_jit(*args, **kwargs)
  sampling_lib.raise_for_laws(out.law_error, out.law_error_at, sampling, "speculative decoding")
  return out


def _kv_heads(model) -> int | None:
  """Key/value heads of a Llama-family verifier or drafter (None for other kinds)."""
  return getattr(getattr(model, "cfg", None), "n_kv_heads", None)

