"""Llama-family decoder with an explicit KV cache (DESIGN.md §2).

Shape legend (capital-letter einsums; the package legend in `spec_jax/__init__.py`):
  B batch, T new tokens in this call, S cache slots, D model width, L layers,
  N query heads, K key/value heads, G = N // K query heads per kv head, H head dim,
  F feed-forward width, V vocabulary; J is the same T new tokens on the key side of an einsum.

One forward serves every use: training (no cache, causal mask over the T tokens), prefill,
one-token decode, chain verification and tree verification. The caller chooses
  * `positions[B,T]`: RoPE positions of the new tokens,
  * `slots[B,T]`: cache slots the new tokens' K/V are written to (defaults to `positions`;
    tree verification writes to a scratch region; a slot >= S drops the write),
  * `mask[B,T,S]`: which cache slots each new token may attend to, after the write.
Caches are never cropped: rejected drafts leave stale K/V that the mask hides until a later
write overwrites them, so every shape stays static.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture of a Llama-family model (Llama, Mistral, Qwen2, SmolLM2)."""
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False
  dtype: str = "float32"  # compute and cache dtype; logits are always float32
  param_dtype: str = "float32"

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}.")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
      if getattr(self, f) < 1:
        raise ValueError(f"LlamaConfig.{f} must be >= 1, got {getattr(self, f)}.")

  @property
  def num_params(self) -> int:
    d, f = self.d_model, self.d_ff
    attn = d * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
    if self.qkv_bias:
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.n_layers * per_layer + emb + d


# Size variants by name. vocab_size is a placeholder: callers replace it with the tokenizer's
# (`model_config(name, vocab_size=...)`), so one variant serves any vocabulary.
_VARIANTS = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct).
    "smollm2-135m": dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                         head_dim=64, d_ff=1536, rope_theta=100_000.0, norm_eps=1e-5),
    # Drafters (DESIGN.md §4 cost notes: the 49k output layer dominates their step time).
    "drafter-xs": dict(vocab_size=49152, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=32, d_ff=384, rope_theta=100_000.0),
    "drafter-s": dict(vocab_size=49152, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                      head_dim=64, d_ff=768, rope_theta=100_000.0),
    "drafter-m": dict(vocab_size=49152, d_model=384, n_layers=6, n_heads=6, n_kv_heads=2,
                      head_dim=64, d_ff=1024, rope_theta=100_000.0),
    # Tests.
    "test-tiny": dict(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=8, d_ff=64, rope_theta=10_000.0),
}


def variant_names() -> list[str]:
  return sorted(_VARIANTS)


def model_config(name: str, **overrides) -> LlamaConfig:
  """The named size variant, with fields overridden (typically vocab_size, dtype)."""
  if name not in _VARIANTS:
    raise ValueError(f"Unknown model size {name!r}. Known variants: {', '.join(variant_names())}.")
  return LlamaConfig(**{**_VARIANTS[name], **overrides})


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values: k, v float[L, B, S, K, H]. Slot s holds whatever was last
  written there; validity is the caller's mask, never a field of the cache."""
  k: jax.Array
  v: jax.Array

  @property
  def size(self) -> int:
    return self.k.shape[2]


def init_cache(cfg: LlamaConfig, batch: int, size: int) -> KVCache:
  shape = (cfg.n_layers, batch, size, cfg.n_kv_heads, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype))


def causal_mask(positions: jax.Array, size: int) -> jax.Array:
  """bool[B,T,S]: slot s visible to the token at position p iff s <= p (slot = position layout)."""
  return jnp.arange(size)[None, None, :] <= positions[:, :, None]


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in the rotate-half layout (HF Llama), x[B,T,*,H], positions[B,T]."""
  h = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class RMSNorm(nn.Module):
  eps: float
  param_dtype: str

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _dense(cfg: LlamaConfig, features, name, use_bias=False):
  return nn.DenseGeneral(features, use_bias=use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         kernel_init=nn.initializers.normal(0.02), name=name)


class Attention(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x, layer_cache, positions, mask_old, mask_new):
    """Attend to the cache as it was before this call (mask_old[B,T,S]) and to the T new tokens
    (mask_new[B,T,T]) as two parts of one softmax. Reading the cache without writing it first
    avoids copying the whole [B,S,K,H] buffer per layer; the new K/V are returned and written
    once, after all layers (`Llama.__call__`), which XLA does in place inside decode loops."""
    cfg = self.cfg
    k_heads, g = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    q = _dense(cfg, (cfg.n_heads, cfg.head_dim), "q", cfg.qkv_bias)(x)  # [B,T,N,H]
    k = _dense(cfg, (k_heads, cfg.head_dim), "k", cfg.qkv_bias)(x)      # [B,T,K,H]
    v = _dense(cfg, (k_heads, cfg.head_dim), "v", cfg.qkv_bias)(x)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta).astype(cfg.dtype)
    v = v.astype(cfg.dtype)
    b, t = x.shape[:2]
    q = q.reshape(b, t, k_heads, g, cfg.head_dim) * jnp.asarray(cfg.head_dim ** -0.5, q.dtype)
    neg = jnp.finfo(jnp.float32).min
    logits = jnp.einsum("BTKGH,BJKH->BKGTJ", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask_new[:, None, None], logits, neg)
    if layer_cache is not None:
      cache_k, cache_v = layer_cache
      old = jnp.einsum("BTKGH,BSKH->BKGTS", q, cache_k, preferred_element_type=jnp.float32)
      logits = jnp.concatenate([jnp.where(mask_old[:, None, None], old, neg), logits], axis=-1)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTJ,BJKH->BTKGH", weights[..., -t:], v)
    if layer_cache is not None:
      out = out + jnp.einsum("BKGTS,BSKH->BTKGH", weights[..., :-t], cache_v)
    out = out.reshape(b, t, cfg.n_heads, cfg.head_dim)
    out = nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False, dtype=cfg.dtype,
                          param_dtype=cfg.param_dtype, kernel_init=nn.initializers.normal(0.02),
                          name="o")(out)
    return out, (k, v)


class Block(nn.Module):
  """One pre-norm decoder layer; scanned over layers (params stacked on a leading L axis)."""
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x, layer_cache, positions, mask_old, mask_new, steer=None):
    """steer: this layer's steering deltas (SD², `models/steering.py`), None or a dict with
    "up" f32[B, F] | [B, T, F], added to the up projection inside the SwiGLU MLP ("merged":
    down(silu(gate) * (up + δ))), and/or "residual" f32[B, D] | [B, T, D], added to the block's
    output ("simple"). A [B, ·] delta serves every one of the T tokens."""
    cfg = self.cfg
    steer = steer or {}
    residual_in = x
    h, new_kv = Attention(cfg, name="attn")(
        RMSNorm(cfg.norm_eps, cfg.param_dtype, name="attn_norm")(x), layer_cache, positions,
        mask_old, mask_new)
    x = x + h
    h = RMSNorm(cfg.norm_eps, cfg.param_dtype, name="mlp_norm")(x)
    gate = _dense(cfg, cfg.d_ff, "gate")(h)
    up = _dense(cfg, cfg.d_ff, "up")(h)
    if "up" in steer:
      up = up + _per_token(steer["up"]).astype(up.dtype)
    x = x + _dense(cfg, cfg.d_model, "down")(nn.silu(gate) * up)
    if "residual" in steer:
      x = x + _per_token(steer["residual"]).astype(x.dtype)
    return x, (new_kv, residual_in)


def _per_token(delta: jax.Array) -> jax.Array:
  """[B, X] → [B, 1, X] (one delta for all T tokens); [B, T, X] unchanged."""
  return delta[:, None] if delta.ndim == 2 else delta


def split_mask(mask: jax.Array, slots: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """Split a post-write mask[B,T,S] into (old[B,T,S], new[B,T,T]).

  old: cache slots as they were, minus the slots this call overwrites;
  new[b,t,j]: whether token t sees new token j, i.e. mask[b,t,slots[b,j]] (False when slot j
  is out of range, since that write is dropped).
  """
  b, t = slots.shape
  rows = jnp.arange(b)[:, None]
  written = jnp.zeros((b, size), bool).at[rows, slots].set(True, mode="drop")
  old = mask & ~written[:, None, :]
  idx = jnp.broadcast_to(jnp.clip(slots, 0, size - 1)[:, None, :], (b, t, t))
  new = jnp.take_along_axis(mask, idx, axis=2) & (slots < size)[:, None, :]
  return old, new


class Llama(nn.Module):
  cfg: LlamaConfig
  # Residual-stream depths returned as `hidden`: index l is the input of block l, and l = n_layers
  # (or -1) the final pre-norm residual. Static, so unused depths cost nothing.
  hidden_layers: tuple[int, ...] = ()

  @nn.compact
  def __call__(self, tokens, positions, cache: KVCache | None = None, mask=None, slots=None,
               steer=None):
    cfg = self.cfg
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     embedding_init=nn.initializers.normal(0.02), name="embed")
    x = embed(tokens)
    if mask is None:
      if cache is not None:
        mask = causal_mask(positions, cache.size)
      else:
        mask = positions[:, None, :] <= positions[:, :, None]  # causal over the T tokens
    if slots is None:
      slots = positions
    if cache is not None:
      mask_old, mask_new = split_mask(mask, slots, cache.size)
      layer_caches = (cache.k, cache.v)
    else:
      mask_old, mask_new, layer_caches = None, mask, None
    layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, 0),
                     length=cfg.n_layers)
    # steer: per-layer deltas with a leading L axis, scanned with the layers' params.
    x, ((new_k, new_v), residuals) = layers(cfg, name="layers")(
        x, layer_caches, positions, mask_old, mask_new, steer)
    hidden = {}
    for layer in self.hidden_layers:
      depth = cfg.n_layers if layer == -1 else layer
      if not 0 <= depth <= cfg.n_layers:
        raise ValueError(f"hidden layer {layer} outside [0, {cfg.n_layers}] (or -1).")
      hidden[layer] = x if depth == cfg.n_layers else residuals[depth]
    x = RMSNorm(cfg.norm_eps, cfg.param_dtype, name="final_norm")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = _dense(cfg, cfg.vocab_size, "lm_head")(x)
    new_cache = None
    if cache is not None:
      # One scatter of every layer's new K/V [L,B,T,K,H] into their slots; mode="drop" lets a
      # caller park writes it does not want (padding) at an out-of-range slot.
      rows = jnp.arange(tokens.shape[0])[:, None]
      new_cache = KVCache(k=cache.k.at[:, rows, slots].set(new_k, mode="drop"),
                          v=cache.v.at[:, rows, slots].set(new_v, mode="drop"))
    return logits.astype(jnp.float32), hidden, new_cache


def check_layers(layers, num_layers: int, field: str) -> tuple[int, ...]:
  """Residual depths as a tuple; ValueError naming `field` for a depth the verifier lacks."""
  layers = tuple(int(x) for x in layers)
  for layer in layers:
    if not (layer == -1 or 0 <= layer <= num_layers):
      raise ValueError(
          f"{field} asks for the verifier's residual stream at layer {layer}, but the verifier "
          f"has {num_layers} layers: use 0..{num_layers} (l = the input of block l, "
          f"{num_layers} = the final pre-norm residual) or -1 (the same final residual).")
  return layers


def make_apply(cfg: LlamaConfig, hidden_layers: Sequence[int] = ()):
  """The DESIGN.md §2 forward as a pure function:
  apply(params, tokens[B,T], positions[B,T], cache, mask[B,T,S] | None, slots[B,T] | None)
    -> (logits float32[B,T,V], hidden {layer: [B,T,D]}, cache).
  An optional `steer` keyword ({"up": f32[L,B,(T,)F]} and/or {"residual": f32[L,B,(T,)D]})
  injects SD² steering deltas into every layer (`Block`)."""
  model = Llama(cfg, tuple(hidden_layers))

  def apply(params, tokens, positions, cache=None, mask=None, slots=None, steer=None):
    return model.apply({"params": params}, tokens, positions, cache, mask, slots, steer)

  return apply


@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: LlamaConfig, rng: jax.Array):
  """Random initial parameters (normal(0.02) weights, unit norms). Jitted: eager init of the
  scanned layers dispatches op by op and is several times slower."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Llama(cfg).init(rng, tokens, tokens)["params"]


def param_shapes(cfg: LlamaConfig):
  """Parameter shapes/dtypes without allocating (for sharding and checkpoint restore)."""
  return jax.eval_shape(lambda rng: init_params(cfg, rng), jax.random.key(0))
