"""Autoregressive generation: one jitted loop (a `lax.while_loop` that ends once every row has
stopped, or without stop ids a loop of fixed trip count), batch > 1 with ragged prompts.

Cache layout (docs/design.md §2): slot = absolute position. Prompts are right-padded to a width
P (`max_prompt_tokens`, or with `buckets` the smallest of a few widths that holds the batch's
longest prompt), so one compiled program serves every batch of the same (B, P, O). The padding's
K/V land in slots >= length[b]; the causal mask hides them and the next real token in that row
overwrites them before any query can see them, so the width changes no token (up to the float
rounding of attention sums over more masked slots).

Stopping (shared with speculative decoding so both emit identical text): a row stops after it
emits a stop token (kept in the output) or after `max_new_tokens` new tokens.

`hidden_layers` also returns the model's hidden states at those layers (decoder.make_apply's
keys) for every position the loop fed: the prompt's from the prefill, each new token's from the
step that fed it. A teacher pass over the finished rows computes the same states (up to float
rounding), so distillation keeps these instead of running it (training/distill.py's
TeacherCache).
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import parallel
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.models import llama



@flax.struct.dataclass
class Prompts:
  """tokens int32[B, P] right-padded; lengths int32[B] (>= 1)."""
  tokens: jax.Array
  lengths: jax.Array


# eval.prompt_buckets' default: batches padded to 32, 64, 128, ... tokens (capped at the field's
# max_prompt_tokens), so a short batch's prefill is not that of the longest prompt allowed.
SMALLEST_BUCKET = 32


def bucket_widths(max_prompt_tokens: int, smallest: int = 0,
                  field: str = "eval.prompt_buckets") -> tuple[int, ...]:
  """The widths a prompt batch may be padded to: smallest, 2·smallest, 4·smallest, ... below
  max_prompt_tokens, then max_prompt_tokens (always the widest). smallest = 0: max_prompt_tokens
  alone (every batch padded alike). Each width is its own compiled program per decoding setting;
  doubling keeps them to about log2(max_prompt_tokens / smallest) + 1."""
  if isinstance(smallest, bool) or not isinstance(smallest, (int, np.integer)) or smallest < 0:
    raise ValueError(f"{field}={smallest!r} is not a width. Fix: set it to the smallest padded "
                     f"prompt width, an integer >= 1 (e.g. {SMALLEST_BUCKET}: widths double up to "
                     "max_prompt_tokens), or 0 to pad every batch to max_prompt_tokens.")
  widths, width = [], int(smallest)
  while 0 < width < max_prompt_tokens:
    widths.append(width)
    width *= 2
  return (*widths, int(max_prompt_tokens))


def encode_prompts(tokenizer, texts: Sequence[str], max_prompt_tokens: int,
                   field: str = "generation.max_prompt_tokens", buckets: int = 0) -> Prompts:
  """Tokenize and right-pad prompts to `max_prompt_tokens` (or, with `buckets`, to the smallest
  `bucket_widths(max_prompt_tokens, buckets)` entry that holds the longest), with clear errors
  for bad input."""
  if not texts:
    raise ValueError("No prompts given.")
  ids = tokenizer.encode_batch(list(texts))
  return pad_prompts(ids, max_prompt_tokens, tokenizer.pad_id, field, buckets)


def pad_prompts(ids: Sequence[Sequence[int]], max_prompt_tokens: int, pad_id: int,
                field: str = "generation.max_prompt_tokens", buckets: int = 0) -> Prompts:
  """Prompts right-padded with pad_id to width P: max_prompt_tokens, or with buckets > 0 the
  smallest `bucket_widths` entry >= the longest prompt (its field named like `field`'s sibling
  prompt_buckets). A prompt longer than max_prompt_tokens is an error naming `field`."""
  for i, row in enumerate(ids):
    if len(row) == 0:
      raise ValueError(f"Prompt {i} is empty: generation needs at least one prompt token. Fix: "
                       "give it text, or drop it.")
    if len(row) > max_prompt_tokens:
      raise ValueError(
          f"Prompt {i} has {len(row)} tokens but {field}={max_prompt_tokens} (the KV cache holds "
          f"max_prompt_tokens + max_new_tokens). Raise {field} or shorten the prompt.")
  longest = max((len(row) for row in ids), default=0)
  buckets_field = ".".join([*field.split(".")[:-1], "prompt_buckets"])
  width = min(w for w in bucket_widths(max_prompt_tokens, buckets, buckets_field) if w >= longest)
  tokens = np.full((len(ids), width), pad_id, np.int32)
  for i, row in enumerate(ids):
    tokens[i, :len(row)] = row
  return Prompts(jnp.asarray(tokens), jnp.asarray([len(r) for r in ids], jnp.int32))


def on_mesh(prompts: Prompts, mesh) -> Prompts:
  """Prompts as global arrays sharded over the mesh's batch axes, each process contributing its
  own rows of the same global batch (`parallel.shard_batch`); global arrays pass through."""
  if isinstance(prompts.tokens, jax.Array) and not prompts.tokens.is_fully_addressable:
    return prompts
  tokens, lengths = parallel.shard_batch((np.asarray(prompts.tokens), np.asarray(prompts.lengths)),
                                         parallel.batch_sharding(mesh))
  return Prompts(tokens, lengths)


@flax.struct.dataclass
class GenerateState:
  tokens: jax.Array      # int32[B, S]: prompt then generated tokens, S = P + O (O = max new tokens)
  lengths: jax.Array     # int32[B]: committed tokens per row (prompt + generated)
  num_new: jax.Array     # int32[B]: generated tokens per row
  done: jax.Array        # bool[B]
  cache: llama.KVCache
  rng: jax.Array
  step: jax.Array        # int32[]: decode steps taken (verifier-only forward calls after prefill)
  law_error: jax.Array   # int32[B]: `sampling.law_status` of the first broken law (0: none)
  law_error_at: jax.Array  # int32[B]: new tokens the row had emitted when it broke
  hidden: dict           # {layer: [B, S, D]} at `hidden_layers` (empty without)


@flax.struct.dataclass
class GenerateOutput:
  tokens: jax.Array      # int32[B, S]: prompt + generated (stale beyond lengths[b])
  lengths: jax.Array     # int32[B]
  prompt_lengths: jax.Array
  num_new: jax.Array     # int32[B]
  steps: jax.Array       # int32[]: forward calls, prefill included
  law_error: jax.Array   # int32[B]: 0, or the `sampling.law_status` code that stopped the row
  law_error_at: jax.Array  # int32[B]: new tokens emitted before it
  # {layer: [B, S, D]}: the hidden states at `hidden_layers` of positions < lengths[b] - 1 (each
  # token that has a successor in the row), zero elsewhere; empty without hidden_layers.
  hidden: dict = flax.struct.field(default_factory=dict)

  def new_tokens(self) -> list[list[int]]:
    """Generated ids per row (host side), stop token included when one was emitted."""
    toks, lens, plens = (parallel.to_host(x) for x in (self.tokens, self.lengths,
                                                       self.prompt_lengths))
    return [toks[b, plens[b]:lens[b]].tolist() for b in range(toks.shape[0])]


def commit(tokens, lengths, num_new, done, new, stop_ids, max_new_tokens):
  """Append `new[B]` to rows that are not done; update lengths, counts and done flags."""
  rows = jnp.arange(tokens.shape[0])
  live = ~done
  tokens = tokens.at[rows, jnp.where(live, lengths, tokens.shape[1])].set(new, mode="drop")
  lengths = lengths + live
  num_new = num_new + live
  is_stop = jnp.isin(new, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else jnp.zeros_like(live)
  done = done | (live & is_stop) | (num_new >= max_new_tokens)
  return tokens, lengths, num_new, done


STATIC = ("cfg", "sampling", "max_new_tokens", "stop_ids", "mesh", "hidden_layers",
          "fixed_steps")


@parallel.laid_out
def _generate(params, prompt_tokens, prompt_lengths, rng, *, cfg, sampling, max_new_tokens,
              stop_ids, mesh=None, hidden_layers=(), fixed_steps=False):
  apply = llama.make_apply(cfg, hidden_layers)
  b, p = prompt_tokens.shape
  size = p + max_new_tokens
  rows = jnp.arange(b)
  cache = parallel.constrain_caches(llama.init_cache(cfg, b, size), mesh)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  logits, hidden, cache = apply(params, prompt_tokens, positions, cache)
  # The prefill's states fill slots [0, P); slots past a prompt's length hold the padding's
  # until the step that feeds the row's real token there overwrites them.
  hidden = {k: jnp.pad(v, ((0, 0), (0, max_new_tokens), (0, 0))) for k, v in hidden.items()}
  last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
  rng, key = jax.random.split(rng)
  zeros = jnp.zeros_like(prompt_lengths)
  state = GenerateState(jnp.pad(prompt_tokens, ((0, 0), (0, max_new_tokens))), prompt_lengths,
                        zeros, jnp.zeros((b,), bool), cache, rng, jnp.int32(1), zeros, zeros,
                        hidden)
  state = _append(state, *sampling_lib.draw(key, last, sampling), stop_ids, max_new_tokens)

  def body(s: GenerateState) -> GenerateState:
    pos = (s.lengths - 1)[:, None]
    current = jnp.take_along_axis(s.tokens, pos, axis=1)
    logits, fed, cache = apply(params, current, pos, s.cache)
    cache = parallel.constrain_caches(cache, mesh)
    # A finished row feeds its last token again at the same slot: the same state.
    hidden = {k: v.at[rows, pos[:, 0]].set(fed[k][:, 0]) for k, v in s.hidden.items()}
    new, status = sampling_lib.draw(jax.random.fold_in(s.rng, s.step), logits[:, 0], sampling)
    s = _append(s.replace(cache=cache, hidden=hidden), new, status, stop_ids, max_new_tokens)
    return s.replace(step=s.step + 1)

  if fixed_steps:
    # Without stop tokens every row that keeps a sound law runs to max_new_tokens: a loop of
    # known trip count, whose condition the device never reports back to the host.
    state = jax.lax.fori_loop(0, max_new_tokens - 1, lambda _, s: body(s), state)
  else:
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  # Slots from lengths - 1 on were not all fed (a row's last token, its prefill padding): zero.
  fed = (jnp.arange(size)[None, :] < (state.lengths - 1)[:, None])[:, :, None]
  hidden = {k: jnp.where(fed, v, jnp.zeros((), v.dtype)) for k, v in state.hidden.items()}
  return GenerateOutput(state.tokens, state.lengths, prompt_lengths, state.num_new, state.step,
                        state.law_error, state.law_error_at, hidden)


def _append(s: GenerateState, new, status, stop_ids, max_new_tokens) -> GenerateState:
  """Commit `new` to the live rows whose law was sound; a row whose law broke stops there with
  its `status` recorded (nothing drawn from the broken law is kept)."""
  broke = ~s.done & (status != sampling_lib.LAW_OK)
  tokens, lengths, num_new, done = commit(s.tokens, s.lengths, s.num_new, s.done | broke, new,
                                          stop_ids, max_new_tokens)
  return s.replace(tokens=tokens, lengths=lengths, num_new=num_new, done=done | broke,
                   law_error=jnp.where(broke, status, s.law_error),
                   law_error_at=jnp.where(broke, s.num_new, s.law_error_at))


# Tests wrap `_generate` in chex.assert_max_traces and swap this in to check for retraces.
_generate_jit = jax.jit(_generate, static_argnames=STATIC)


def generate(params, prompts: Prompts, rng: jax.Array, *, cfg: llama.LlamaConfig,
             sampling: sampling_lib.Sampling, max_new_tokens: int,
             stop_ids: Sequence[int] = (), mesh=None, hidden_layers: Sequence[int] = (),
             fixed_steps: bool | None = None,
             compile_only: bool = False) -> GenerateOutput | None:
  """Sample up to `max_new_tokens` per row from the model `cfg` with `params`.

  One compiled program per (cfg, sampling, B, P, max_new_tokens, stop_ids); no host syncs inside.
  A row whose law is not a distribution (NaN logits, nothing left after top-k/top-p) stops there
  and the call raises `sampling.LawError` naming it (waiting for the result to check).
  mesh: decode on a `parallel.make_mesh` Mesh (batch over ('data', 'fsdp'), parameters placed
  for decoding by `parallel.place_params`, KV cache rows and heads sharded), or None for one
  device.
  hidden_layers: also return `GenerateOutput.hidden`, the states at these layers
  (decoder.make_apply's keys; draft_init.FINAL is the final pre-norm residual).
  fixed_steps: decode in a loop of exactly max_new_tokens − 1 steps after the prefill rather
  than a `while_loop` that stops once every row is done. The outputs are the same: without stop
  ids a row ends early only when its law breaks, and the call then raises. The loop's condition
  is then a known trip count, which a GPU runs without reading a flag back to the host every
  token. None: fixed exactly when there are no stop ids; True needs stop_ids=().
  compile_only: compile the program for these shapes and return None without decoding (a later
  call with the same shapes runs it at once: how timing warms up without a discarded decode).
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  if fixed_steps and stop_ids:
    raise ValueError(f"fixed_steps=True runs every row to max_new_tokens, so it takes no stop "
                     f"ids (got {tuple(stop_ids)}); pass stop_ids=() or fixed_steps=None.")
  if fixed_steps is None:
    fixed_steps = not stop_ids
  if mesh is not None:
    parallel.check_decode_mesh(mesh, prompts.tokens.shape[0], {"model": cfg.n_kv_heads})
    parallel.check_kernels_on_mesh(mesh, {"model": cfg})
    params = parallel.place_params(params, mesh)
    prompts = on_mesh(prompts, mesh)
  args = (params, prompts.tokens, prompts.lengths, rng)
  kwargs = dict(cfg=cfg, sampling=sampling, max_new_tokens=int(max_new_tokens),
                stop_ids=tuple(int(i) for i in stop_ids), mesh=mesh,
                hidden_layers=tuple(int(k) for k in hidden_layers), fixed_steps=bool(fixed_steps))
  if compile_only:
    _generate_jit.lower(*args, **kwargs).compile()
    return None
  out = _generate_jit(*args, **kwargs)
  sampling_lib.raise_for_laws(out.law_error, out.law_error_at, sampling, "generate")
  return out
