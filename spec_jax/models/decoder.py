"""The decoder every family shares: embedding, a scan over the family's blocks, final norm, output
head and one cache write (docs/design.md §2). The block comes from the config (`cfg.block()`:
`llama.Block`, `gemma.Block`), so one forward contract serves every family and everything built on
it (chain SD, trees, every drafter) works with any of them unchanged.

One forward serves every use: training (no cache, causal mask over the T tokens), prefill,
one-token decode, chain verification and tree verification. The caller chooses
  * `positions[B,T]`: RoPE positions of the new tokens,
  * `slots[B,T]`: cache slots the new tokens' K/V are written to (defaults to `positions`;
    tree verification writes to a scratch region; a slot >= S drops the write),
  * `mask[B,T,S]`: which cache slots each new token may attend to, after the write.
Caches are never cropped: rejected drafts leave stale K/V that the mask hides until a later
write overwrites them, so every shape stays static. Sliding-window layers add one term to the mask
from the positions (`layers.window_terms`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from spec_jax.models import layers as L
from spec_jax.models import pallas_attention, pallas_layers


class Decoder(nn.Module):
  cfg: object
  # Residual-stream depths returned as `hidden`: index l is the input of block l, and l = n_layers
  # (or -1) the final pre-norm residual. Static, so unused depths cost nothing.
  hidden_layers: tuple[int, ...] = ()
  # A reduced output vocabulary (cfg.head_ids): True returns its logits [..., len(head_ids)] as
  # they are (training; `draft_init.restrict`), False spreads them over the full vocabulary with
  # -inf elsewhere, so every caller sees token ids.
  reduced_logits: bool = False

  @nn.compact
  def __call__(self, tokens, positions, cache: L.KVCache | None = None, mask=None, slots=None,
               steer=None, features=None, logit_index=None):
    cfg = self.cfg
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     embedding_init=nn.initializers.normal(0.02), name="embed")
    x = L.constrain(embed(L.constrain(tokens, "ids")), "stream")
    if cfg.embed_scale != 1.0:  # Gemma: embeddings times sqrt(d_model), in the weights' dtype
      x = x * jnp.asarray(cfg.embed_scale, cfg.param_dtype).astype(x.dtype)
    if getattr(cfg, "feature_width", 0):
      # A feature drafter (EAGLE): each token's input is fc([f / rms(f); e / rms(e)]), f the
      # verifier's final residual one position back (features[B, T, F]).
      if features is None or features.shape[-1] != cfg.feature_width:
        raise ValueError(f"This model reads features of width {cfg.feature_width} beside its "
                         f"tokens (a feature drafter), got "
                         f"{None if features is None else features.shape}.")
      both = jnp.concatenate([unit_rms(features), unit_rms(x)], axis=-1).astype(x.dtype)
      x = L.constrain(L.dense(cfg, cfg.d_model, "fc")(L.constrain(both, "whole")), "hidden",
                      "stream")
    if mask is None:
      if cache is not None:
        mask = L.causal_mask(positions, cache.size)
      else:
        mask = positions[:, None, :] <= positions[:, :, None]  # causal over the T tokens
    if slots is None:
      slots = positions
    if cache is not None:
      mask_old, mask_new = L.split_mask(mask, slots, cache.size)
      layer_caches = (cache.k, cache.v)
      key_pos = cache.pos
    else:
      mask_old, mask_new, layer_caches, key_pos = None, mask, None, None
    freqs = jnp.asarray(cfg.rope_table())  # f32[L, H/2]: per-layer RoPE (Gemma: local/global)
    windows = jnp.asarray(cfg.windows(), jnp.int32) if cfg.has_windows else None  # [L]
    # The decoding calls (a cache, at most MAX_TOKENS tokens a row, no steering) may run on
    # hand-written kernels; training, prefill and steered calls keep XLA's layers.
    kernels = cache is not None and steer is None and not self.is_initializing() \
        and tokens.shape[1] <= pallas_attention.MAX_TOKENS
    cache_axis = 0  # the scan hands each layer its slice of the cache
    if kernels and getattr(cfg, "attn_kernel", False):
      # XLA's layers with one attention kernel each, reading the stacked cache at the layer's
      # index (scanned beside the params), no slice; the masks as int32 once for every layer.
      layer_caches = L.KernelCache(cache.k, cache.v, jnp.arange(cfg.n_layers, dtype=jnp.int32))
      cache_axis = L.KernelCache(nn.broadcast, nn.broadcast, 0)
      mask_old, mask_new = mask_old.astype(jnp.int32), mask_new.astype(jnp.int32)
    if kernels and getattr(cfg, "pallas", False):
      # Hand-written GPU kernels, five a layer, over the stacked params (`pallas_layers`).
      x, (new_k, new_v), residuals = pallas_layers.layers(
          cfg, self.variables["params"]["layers"], x, positions, cache.k, cache.v, mask_old,
          mask_new, cache.pos, hidden=bool(self.hidden_layers))
    elif cfg.unrolled:  # straight-line layers with their own params "layers_<i>"
      x, ((new_k, new_v), residuals) = _unrolled(
          cfg, x, layer_caches, positions, mask_old, mask_new, steer, freqs, windows, key_pos)
    else:
      # `decode_unrolled`: the calls with a cache as straight-line code over the stacked params.
      unroll = cfg.n_layers if cache is not None and getattr(cfg, "decode_unrolled", False) else 1
      layers = nn.scan(cfg.block(), variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(cache_axis, nn.broadcast, nn.broadcast, nn.broadcast, 0, 0,
                                0, nn.broadcast),
                       length=cfg.n_layers, unroll=unroll)
      # steer: per-layer deltas with a leading L axis, scanned with the layers' params.
      x, ((new_k, new_v), residuals) = layers(cfg, name="layers")(
          x, layer_caches, positions, mask_old, mask_new, steer, freqs, windows, key_pos)
    hidden = {}
    for layer in self.hidden_layers:
      depth = cfg.n_layers if layer == -1 else layer
      if not 0 <= depth <= cfg.n_layers:
        raise ValueError(f"hidden layer {layer} outside [0, {cfg.n_layers}] (or -1).")
      hidden[layer] = x if depth == cfg.n_layers else residuals[depth]
    if logit_index is not None:
      # Logits only where a loss reads them (`distill.loss_index`): the output layer is most of
      # a small drafter's training step, and a chat row's prompt and padding carry no loss.
      x = jnp.take_along_axis(x, logit_index[..., None], axis=1)
    x = L.RMSNorm(cfg.norm_eps, cfg.param_dtype, cfg.norm_offset, name="final_norm")(x)
    if cfg.tie_embeddings:
      logits = L.constrain(embed.attend(x), "vocab")
    else:
      logits = L.constrain(L.dense(cfg, cfg.head_size, "lm_head")(x), "vocab")
    logits = L.softcap(logits.astype(jnp.float32), cfg.final_softcap)
    if not self.reduced_logits:
      logits = expand_logits(cfg, logits)
    new_cache = None
    if cache is not None:
      # One scatter of every layer's new K/V [L,B,T,K,H] into their slots; mode="drop" lets a
      # caller park writes it does not want (padding) at an out-of-range slot.
      rows = jnp.arange(tokens.shape[0])[:, None]
      pos = None if cache.pos is None else cache.pos.at[rows, slots].set(positions, mode="drop")
      new_cache = L.KVCache(k=cache.k.at[:, rows, slots].set(new_k, mode="drop"),
                            v=cache.v.at[:, rows, slots].set(new_v, mode="drop"), pos=pos)
    return logits, hidden, new_cache


def _unrolled(cfg, x, layer_caches, positions, mask_old, mask_new, steer, freqs, windows,
              key_pos):
  """The layer scan written out, one block per layer with params "layers_<i>" (`cfg.unrolled`):
  what the scan returns, stacked the same way (new K/V [L, ...], residuals indexable by layer)."""
  def layer(tree, i):
    if isinstance(tree, L.KernelCache):  # the attention kernel reads the stacked cache
      return tree._replace(layer=tree.layer[i])
    return None if tree is None else jax.tree.map(lambda a: a[i], tree)

  new_k, new_v, residuals = [], [], []
  for i in range(cfg.n_layers):
    x, ((k, v), residual) = cfg.block()(cfg, name=f"layers_{i}")(
        x, layer(layer_caches, i), positions, mask_old, mask_new, layer(steer, i), freqs[i],
        layer(windows, i), key_pos)
    new_k.append(k)
    new_v.append(v)
    residuals.append(residual)
  return x, ((jnp.stack(new_k), jnp.stack(new_v)), residuals)


def unit_rms(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / rms(x) over the last axis, in float32 (a feature drafter's input and regression
  scale: the verifier's residual stream has a few large dimensions)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def expand_logits(cfg, logits: jax.Array) -> jax.Array:
  """Logits over a reduced output vocabulary [..., len(cfg.head_ids)] spread over the full one
  [..., V]: -inf (probability exactly 0) for every token outside it. Identity without one."""
  if not cfg.head_ids:
    return logits
  full = jnp.full((*logits.shape[:-1], cfg.vocab_size), -jnp.inf, logits.dtype)
  return full.at[..., jnp.asarray(cfg.head_ids, jnp.int32)].set(logits)


def make_apply(cfg, hidden_layers: Sequence[int] = (), *, reduced_logits: bool = False):
  """The docs/design.md §2 forward as a pure function, for a config of any family:
  apply(params, tokens[B,T], positions[B,T], cache, mask[B,T,S] | None, slots[B,T] | None)
    -> (logits float32[B,T,V], hidden {layer: [B,T,D]}, cache).
  An optional `steer` keyword ({"up": f32[L,B,(T,)F]} and/or {"residual": f32[L,B,(T,)D]})
  injects SD² steering deltas into every layer (the family's `Block`). reduced_logits: a model
  with a reduced output vocabulary returns logits [B,T,len(cfg.head_ids)] instead of [B,T,V].
  A feature drafter (cfg.feature_width) also takes `features` f32[B,T,F]. `logit_index`
  int32[B,K] computes the logits only at those positions of each row ([B,K,V]; hidden and
  cache are unaffected)."""
  hidden_layers = tuple(hidden_layers)

  def apply(params, tokens, positions, cache=None, mask=None, slots=None, steer=None,
            features=None, logit_index=None):
    context = (pallas_attention.TILES, L.activation_layout())
    return _apply(cfg, hidden_layers, reduced_logits, context, params, tokens, positions, cache,
                  mask, slots, steer, features, logit_index)

  return apply


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), inline=True)
def _apply(cfg, hidden_layers, reduced_logits, context, params, tokens, positions, cache, mask,
           slots, steer, features, logit_index):
  """`make_apply`'s forward, jitted and inlined where it is called, so that a call inside another
  traced program reuses the jaxpr of an earlier call with the same config and shapes instead of
  tracing the modules again (most of a decoding loop's trace time); the program is the same as
  without. context: what the forward reads while traced besides its arguments, as the caller
  sees it, part of that reuse's key: the kernels' `pallas_attention.TILES` (a tile sweep sets it
  between programs) and the activation layout of a decoding program on a mesh
  (`layers.activation_shardings`; none in training or on one device)."""
  del context  # read by the layers themselves
  return Decoder(cfg, hidden_layers, reduced_logits).apply(
      {"params": params}, tokens, positions, cache, mask, slots, steer, features, logit_index)


@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg, rng: jax.Array):
  """Random initial parameters (normal(0.02) weights, unit norms). Jitted: eager init of the
  scanned layers dispatches op by op and is several times slower."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  width = getattr(cfg, "feature_width", 0)
  features = jnp.zeros((1, 1, width), jnp.float32) if width else None
  return Decoder(cfg).init(rng, tokens, tokens, features=features)["params"]


def param_shapes(cfg):
  """Parameter shapes/dtypes without allocating (for sharding and checkpoint restore)."""
  return jax.eval_shape(lambda rng: init_params(cfg, rng), jax.random.key(0))


def final_norm(cfg, params, x: jax.Array) -> jax.Array:
  """The decoder's final RMSNorm on a residual x[..., D], in cfg.dtype (as `Decoder` computes
  it), from params holding "final_norm"."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.norm_eps)
  gain = params["final_norm"]["scale"].astype(jnp.float32) + cfg.norm_offset
  return (y * gain).astype(cfg.dtype)


def output_logits(cfg, params, x: jax.Array) -> jax.Array:
  """Logits f32[..., V] of a final pre-norm residual x[..., D]: the final norm, the output
  projection (the embedding when tied) and soft-capping, exactly the tail of `Decoder`. params
  need only "final_norm" and "embed" or "lm_head" (BPD heads share them with the verifier)."""
  y = final_norm(cfg, params, x)
  if cfg.tie_embeddings:
    logits = jnp.dot(y, params["embed"]["embedding"].astype(cfg.dtype).T)
  else:
    logits = jnp.dot(y, params["lm_head"]["kernel"].astype(cfg.dtype))
  return expand_logits(cfg, L.softcap(logits.astype(jnp.float32), cfg.final_softcap))
