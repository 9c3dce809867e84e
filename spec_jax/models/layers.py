"""Pieces every decoder family shares: the explicit KV cache, masks, RoPE variants, RMSNorm and
attention (docs/design.md §2). Written once; `llama.py` and `gemma.py` build their blocks from them and
`decoder.py` stacks the blocks.

Shape legend (capital-letter einsums; the package legend in `spec_jax/__init__.py`):
  B batch, T new tokens in this call, S cache slots, D model width, L layers,
  N query heads, K key/value heads, G = N // K query heads per kv head, H head dim,
  F feed-forward width, V vocabulary; J is the same T new tokens on the key side of an einsum.

A model config (`llama.LlamaConfig` or a subclass) is passed whole; the attention reads its fields
n_heads, n_kv_heads, head_dim, qkv_bias, qk_norm, norm_eps, norm_offset, query_scale, attn_softcap,
fused, out_major, dtype and param_dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models import pallas_attention

ROPE_SCALINGS = ("none", "linear", "llama3")


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values: k, v float[L, B, S, K, H]. Slot s holds whatever was last
  written there; validity is the caller's mask, never a field of the cache.

  pos int32[B, S]: the position of the token last written to each slot, kept only by models with
  sliding-window layers (None otherwise): a window is one more term of the mask, "key position >
  query position − window", and tree drafts sit at slots that are not their positions."""
  k: jax.Array
  v: jax.Array
  pos: jax.Array | None = None

  @property
  def size(self) -> int:
    return self.k.shape[2]


class KernelCache(NamedTuple):
  """What a layer attending on the attention kernel (`LlamaConfig.attn_kernel`) gets in place of
  its slice of the cache: the whole stacked cache and its own index, so the kernel reads the
  layer's slots in place (`pallas_attention.attention`)."""
  k: jax.Array      # [L, B, S, K, H]
  v: jax.Array
  layer: jax.Array  # int32 []: this layer


# How activations are laid out over a device mesh while a decoding program is traced on one
# ({kind: NamedSharding}, set by `parallel.decoding_layout`); None: left to GSPMD.
_SHARDINGS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("activation_shardings",
                                                                        default=None)


@contextlib.contextmanager
def activation_shardings(shardings: dict | None):
  """Within: `constrain(x, kind)` constrains x to shardings[kind]."""
  token = _SHARDINGS.set(shardings)
  try:
    yield
  finally:
    _SHARDINGS.reset(token)


def activation_layout() -> tuple:
  """The shardings `activation_shardings` sets here, hashable (a key for reusing a trace)."""
  shardings = _SHARDINGS.get()
  return () if shardings is None else tuple(sorted(shardings.items()))


def constrain(x: jax.Array, *kinds: str) -> jax.Array:
  """x constrained in turn to the shardings `activation_shardings` gives each of `kinds`
  (`parallel.ACTIVATIONS`; e.g. a product's output first as its weight shard leaves it, then as
  the next step reads it); x itself outside one."""
  shardings = _SHARDINGS.get()
  if shardings is not None:
    for kind in kinds:
      x = jax.lax.with_sharding_constraint(x, shardings[kind])
  return x


def init_cache(cfg, batch: int, size: int) -> KVCache:
  shape = (cfg.n_layers, batch, size, cfg.n_kv_heads, cfg.head_dim)
  pos = jnp.full((batch, size), -1, jnp.int32) if cfg.has_windows else None
  return KVCache(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype), pos=pos)


def causal_mask(positions: jax.Array, size: int) -> jax.Array:
  """bool[B,T,S]: slot s visible to the token at position p iff s <= p (slot = position layout)."""
  return jnp.arange(size)[None, None, :] <= positions[:, :, None]


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


def inv_freq(head_dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
             low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
             original_max_positions: int = 8192) -> np.ndarray:
  """RoPE inverse frequencies float32[H/2], computed in float32 as transformers does.

  scaling "linear": every frequency divided by `factor` (positions interpolated);
  "llama3" (Llama 3.1/3.2): wavelengths longer than original/low_freq_factor divided by `factor`,
  shorter than original/high_freq_factor kept, smoothly interpolated in between."""
  base = np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
  freq = (np.float32(1.0) / base).astype(np.float32)
  if scaling == "none":
    return freq
  if scaling == "linear":
    return (freq / np.float32(factor)).astype(np.float32)
  if scaling != "llama3":
    raise ValueError(f"RoPE scaling {scaling!r} is not implemented; supported: {ROPE_SCALINGS}.")
  wavelen = np.float32(2 * math.pi) / freq
  low_wavelen = original_max_positions / low_freq_factor
  high_wavelen = original_max_positions / high_freq_factor
  scaled = np.where(wavelen > low_wavelen, freq / np.float32(factor), freq)
  smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, freq: jax.Array | float) -> jax.Array:
  """Rotary embedding in the rotate-half layout (HF Llama), x[B,T,*,H], positions[B,T].
  freq: inverse frequencies f32[H/2] (`inv_freq`), or a base theta for the default RoPE."""
  h = x.shape[-1]
  if not hasattr(freq, "shape"):
    freq = inv_freq(h, freq)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freq, jnp.float32)  # [B,T,H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis, computed in float32: y = x / rms(x) · (offset + scale).
  Llama stores the gain (offset 0, scale initialised to 1); Gemma stores gain − 1 (offset 1, scale
  initialised to 0)."""
  eps: float
  param_dtype: str
  offset: float = 0.0

  @nn.compact
  def __call__(self, x, deferred: bool = False):
    """The normed rows in x's dtype; deferred: (x · gain in x's dtype, 1/rms(x) f32[..., 1]),
    for a product without bias that follows: product(x · gain) · (1/rms) is the product of the
    normed rows, with the row scaling applied to the product's output where its consumer reads
    it (`Scaled`) instead of in a pass of its own over x. On a GPU, in bfloat16, that is one
    kernel a norm fewer: the gain rides in the same pass as the sum of squares
    (experiments/scale/results.md, "The norms' row scale")."""
    init = nn.initializers.zeros if self.offset else nn.initializers.ones
    scale = self.param("scale", init, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    gain = scale.astype(jnp.float32)
    if self.offset:
      gain = gain + self.offset
    if deferred:
      return Scaled((x32 * gain).astype(x.dtype), inv)
    return (x32 * inv * gain).astype(x.dtype)


class Scaled(NamedTuple):
  """Rows whose RMSNorm scaling is deferred past the product that reads them (`RMSNorm`):
  x[..., D] (x · gain) and inv f32[..., 1]."""
  x: jax.Array
  inv: jax.Array


def pre_norm(norm: "RMSNorm", x: jax.Array, deferred: bool):
  """A block's norm before its products: `Scaled` rows when `deferred` (the blocks defer it in
  decoding calls, where a step's kernels count; training keeps the normed rows and their
  rounding), else the normed rows."""
  return norm(x, deferred=True) if deferred else norm(x)


def dense(cfg, features, name, use_bias=False):
  return nn.DenseGeneral(features, use_bias=use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         kernel_init=nn.initializers.normal(0.02), name=name)


def _stream_rows(x):
  """Rows [B,T,D] (or `Scaled` ones) laid out as the residual stream."""
  if isinstance(x, Scaled):
    return Scaled(constrain(x.x, "stream"), x.inv)
  return constrain(x, "stream")


def scaled_product(cfg, features, name, x, use_bias=False):
  """dense(features)(x) of normed rows x (an array) or of `Scaled` rows: then the product of
  x · gain times 1/rms per row, in float32, rounded to cfg.dtype (in bfloat16 a rounding more
  than the normed rows' product: the product's own output. Asking the product for float32
  output instead makes XLA's GPU compiler convert the bfloat16 weights to float32 every call).
  A bias, which the row scaling must not touch, is refused: `pre_norm` keeps such products on
  normed rows."""
  if not isinstance(x, Scaled):
    return dense(cfg, features, name, use_bias)(x)
  if use_bias:
    raise ValueError(f"{name}: a product with a bias needs normed rows, not Scaled ones.")
  y = dense(cfg, features, name)(x.x).astype(jnp.float32)
  inv = x.inv.reshape(x.inv.shape + (1,) * (y.ndim - x.inv.ndim))
  return (y * inv).astype(cfg.dtype)


class OutMajorDense(nn.Module):
  """A product over x's last `n_in` axes whose kernel is stored output axis first,
  [features, *in]: the weights of `nn.DenseGeneral(features, axis=(-n_in..-1))`, whose kernel
  is [*in, features], transposed. Initialised to the transpose of what that module draws from
  the same key, so a random model is the same model in either layout."""
  features: int
  n_in: int
  dtype: str
  param_dtype: str

  @nn.compact
  def __call__(self, x):
    in_shape = x.shape[-self.n_in:]

    def init(key, shape, dtype):
      del shape
      drawn = nn.initializers.normal(0.02)(key, (*in_shape, self.features), dtype)
      return jnp.moveaxis(drawn, -1, 0)
    kernel = self.param("kernel", init, (self.features, *in_shape), self.param_dtype)
    x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
    contract = (tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(1, 1 + self.n_in)))
    return jax.lax.dot_general(x, kernel, (contract, ((), ())))


def out_product(cfg, n_in: int, name: str):
  """A block's output-side product to the model width over the input's last n_in axes ("o"
  over [N, H], "down" over [F]): a DenseGeneral kernel [*in, D], or with `cfg.out_major` the
  same weights stored [D, *in] (`OutMajorDense`)."""
  if getattr(cfg, "out_major", False):
    return OutMajorDense(cfg.d_model, n_in, cfg.dtype, cfg.param_dtype, name=name)
  return nn.DenseGeneral(cfg.d_model, axis=tuple(range(-n_in, 0)), use_bias=False,
                         dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         kernel_init=nn.initializers.normal(0.02), name=name)


def softcap(x: jax.Array, cap: float) -> jax.Array:
  """cap · tanh(x / cap) (Gemma 2's logit soft-capping); x unchanged when cap is 0."""
  return x if not cap else jnp.tanh(x / cap) * cap


def window_terms(window, positions, key_pos):
  """Sliding-window terms of the masks: (old[B,T,S] | None, new[B,T,T]) with key position >
  query position − window; all True where window is 0 (a global layer). window: traced int32
  scalar (this layer's), positions[B,T], key_pos int32[B,S] | None (the cache's `pos`)."""
  low = positions[:, :, None] - window
  full = window <= 0
  new = full | (positions[:, None, :] > low)
  old = None if key_pos is None else full | (key_pos[:, None, :] > low)
  return old, new


# On a GPU (SMALL_CACHE_PLATFORMS), a call of at most SMALL_CALL_TOKENS tokens a row whose
# layer cache holds at most SMALL_CACHE_BYTES attends to it with broadcast products reduced in
# place instead of library matrix products: XLA fuses them with the softmax, RoPE and the new
# tokens' part, 15.6 → 10.6 kernels a layer of the 8B shape (experiments/scale/results.md,
# "Small caches"). Each query head of a kv head re-reads the cache, which stays in the GPU's L2
# at this size; beyond it the library products read it once. XLA:CPU runs these products
# 1.1-1.7× slower than its matrix products, so CPU programs keep those (`lax.platform_dependent`
# picks by the platform a program is lowered for).
SMALL_CALL_TOKENS = 8
SMALL_CACHE_BYTES = 4 << 20
SMALL_CACHE_PLATFORMS = ("cuda", "rocm")


def _by_platform(small: bool, reduced, library, *args):
  """library(*args), or on SMALL_CACHE_PLATFORMS reduced(*args) when `small`."""
  if not small:
    return library(*args)
  return jax.lax.platform_dependent(*args, default=library,
                                    **{p: reduced for p in SMALL_CACHE_PLATFORMS})


def _cache_logits(q, cache_k, small: bool):
  """q[B,T,K,G,H] · cache_k[B,S,K,H] → f32[B,K,G,T,S]."""
  def reduced(q, cache_k):
    q = jnp.transpose(q.astype(jnp.float32), (0, 2, 3, 1, 4))[:, :, :, :, None, :]  # BKGT1H
    k = jnp.transpose(cache_k.astype(jnp.float32), (0, 2, 1, 3))[:, :, None, None]  # BK11SH
    return jnp.sum(q * k, axis=-1)
  return _by_platform(small, reduced, functools.partial(
      jnp.einsum, "BTKGH,BSKH->BKGTS", preferred_element_type=jnp.float32), q, cache_k)


def _cache_values(weights, cache_v, small: bool):
  """weights[B,K,G,T,S] · cache_v[B,S,K,H] → [B,T,K,G,H] in weights' dtype."""
  def reduced(weights, cache_v):
    v = jnp.transpose(cache_v.astype(jnp.float32), (0, 2, 1, 3))[:, :, None, None]  # BK11SH
    out = jnp.sum(weights.astype(jnp.float32)[..., None] * v, axis=-2)              # BKGTH
    return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(weights.dtype)
  return _by_platform(small, reduced, functools.partial(jnp.einsum, "BKGTS,BSKH->BTKGH"),
                      weights, cache_v)


class Attention(nn.Module):
  cfg: object

  @nn.compact
  def __call__(self, x, layer_cache, positions, mask_old, mask_new, freq, window=None,
               key_pos=None):
    """Attend to the cache as it was before this call (mask_old[B,T,S]) and to the T new tokens
    (mask_new[B,T,T]) as two parts of one softmax. Reading the cache without writing it first
    avoids copying the whole [B,S,K,H] buffer per layer; the new K/V are returned and written
    once, after all layers (`decoder.Decoder`), which XLA does in place inside decode loops.

    freq: this layer's RoPE inverse frequencies f32[H/2]; window: this layer's sliding window
    (int32 scalar, 0 = global) or None when the model has none; key_pos: the cache's slot
    positions (int32[B,S]) for the window term."""
    cfg = self.cfg
    k_heads, g = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    # x: normed rows [B,T,D], or `Scaled` ones whose row scaling lands on q/k/v (`RMSNorm`).
    x = _stream_rows(x)
    b, t = (x.x if isinstance(x, Scaled) else x).shape[:2]
    product = functools.partial(scaled_product, cfg, use_bias=cfg.qkv_bias)
    if cfg.fused:  # one product: "qkv" [D, N+2K, H]
      qkv = product((cfg.n_heads + 2 * k_heads, cfg.head_dim), "qkv", x)
      q, k, v = jnp.split(constrain(qkv, "heads_rows"), [cfg.n_heads, cfg.n_heads + k_heads],
                          axis=-2)
    else:
      q = constrain(product((cfg.n_heads, cfg.head_dim), "q", x), "heads_rows")  # [B,T,N,H]
      k = constrain(product((k_heads, cfg.head_dim), "k", x), "heads_rows")      # [B,T,K,H]
      v = constrain(product((k_heads, cfg.head_dim), "v", x), "heads_rows")
    if cfg.qk_norm:  # per head, before RoPE (Qwen3, Gemma 3)
      q = RMSNorm(cfg.norm_eps, cfg.param_dtype, cfg.norm_offset, name="q_norm")(q)
      k = RMSNorm(cfg.norm_eps, cfg.param_dtype, cfg.norm_offset, name="k_norm")(k)
    q = constrain(rope(q, positions, freq), "heads")
    k = constrain(rope(k, positions, freq).astype(cfg.dtype), "heads")
    v = constrain(v.astype(cfg.dtype), "heads")
    o_product = out_product(cfg, 2, "o")
    if isinstance(layer_cache, KernelCache):  # one kernel, windows included
      out = pallas_attention.attention(cfg, q, k, v, layer_cache.k, layer_cache.v,
                                       layer_cache.layer, mask_old, mask_new, positions,
                                       key_pos, window)
      return o_product(out), (k, v)
    if window is not None:
      old_window, new_window = window_terms(window, positions, key_pos)
      mask_new = mask_new & new_window
      if mask_old is not None and old_window is not None:
        mask_old = mask_old & old_window
    q = q.reshape(b, t, k_heads, g, cfg.head_dim) * jnp.asarray(cfg.query_scale, q.dtype)
    neg = jnp.finfo(jnp.float32).min
    logits = jnp.einsum("BTKGH,BJKH->BKGTJ", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask_new[:, None, None], softcap(logits, cfg.attn_softcap), neg)
    if layer_cache is not None:
      cache_k, cache_v = layer_cache
      small = t <= SMALL_CALL_TOKENS and cache_k.size * cache_k.dtype.itemsize \
          <= SMALL_CACHE_BYTES
      old = _cache_logits(q, cache_k, small)
      old = jnp.where(mask_old[:, None, None], softcap(old, cfg.attn_softcap), neg)
      logits = jnp.concatenate([old, logits], axis=-1)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTJ,BJKH->BTKGH", weights[..., -t:], v)
    if layer_cache is not None:
      out = out + _cache_values(weights[..., :-t], cache_v, small)
    out = constrain(out.reshape(b, t, cfg.n_heads, cfg.head_dim), "heads_rows")
    return constrain(o_product(out), "stream"), (k, v)


def gate_up(cfg, h) -> tuple[jax.Array, jax.Array]:
  """The gated MLP's two input products (gate[B,T,F], up[B,T,F]) of normed rows h[B,T,D] or
  `Scaled` ones: params "gate" and "up", or with `cfg.fused` one product "gate_up" [D, 2, F]."""
  h = _stream_rows(h)
  if cfg.fused:
    both = constrain(scaled_product(cfg, (2, cfg.d_ff), "gate_up", h), "hidden_pair")
    return both[..., 0, :], both[..., 1, :]
  return (constrain(scaled_product(cfg, cfg.d_ff, "gate", h), "hidden"),
          constrain(scaled_product(cfg, cfg.d_ff, "up", h), "hidden"))


# Fused params and the unfused ones each joins, in order: "qkv" concatenates along the heads axis
# (-2 of kernels [(L,) D, ·, H] and biases [(L,) ·, H]), "gate_up" stacks kernels [(L,) D, F]
# into [(L,) D, 2, F].
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def _fuse_leaf(parts: list[jax.Array], name: str) -> jax.Array:
  if name == "gate_up":  # kernels [(L,) D, F] → [(L,) D, 2, F]
    return jnp.stack(parts, axis=-2)
  return jnp.concatenate(parts, axis=-2)


def fuse_params(params):
  """The same model's params in the fused layout (`cfg.fused`): q/k/v → "qkv", gate/up →
  "gate_up", wherever they sit in the tree (scanned layers, a drafter's blocks). Products and
  outputs are unchanged; a layer's five input-side products (q, k, v, gate, up) become two."""
  if not isinstance(params, dict):
    return params
  out = {key: fuse_params(value) for key, value in params.items()}
  for fused, names in FUSED.items():
    if all(name in out for name in names):
      parts = [out.pop(name) for name in names]
      out[fused] = {leaf: _fuse_leaf([p[leaf] for p in parts], fused) for leaf in parts[0]}
  return out


def unfuse_params(params, cfg):
  """`fuse_params` undone (for export and for code that reads the unfused names)."""
  if not isinstance(params, dict):
    return params
  out = {key: unfuse_params(value, cfg) for key, value in params.items()}
  if "qkv" in out:
    qkv = out.pop("qkv")
    cuts = [cfg.n_heads, cfg.n_heads + cfg.n_kv_heads]
    for leaf, value in qkv.items():
      for name, part in zip(FUSED["qkv"], jnp.split(value, cuts, axis=-2)):
        out.setdefault(name, {})[leaf] = part
  if "gate_up" in out:
    for leaf, value in out.pop("gate_up").items():
      out.setdefault("gate", {})[leaf] = value[..., 0, :]
      out.setdefault("up", {})[leaf] = value[..., 1, :]
  return out


# The output-side products and the input axes of each (`cfg.out_major`): "o" [N, H, D] ↔
# [D, N, H] under an attention's params, "down" [F, D] ↔ [D, F] beside its block's gate/up.
OUT_MAJOR = {"o": 2, "down": 1}


def _out_major_tree(params, to_major: bool):
  if not isinstance(params, dict):
    return params
  out = {key: _out_major_tree(value, to_major) for key, value in params.items()}
  owners = {"o": "q" in out or "qkv" in out, "down": "up" in out or "gate_up" in out}
  for name, n_in in OUT_MAJOR.items():
    if owners[name] and name in out:
      kernel = out[name]["kernel"]  # [(L,) *in, D] or [(L,) D, *in]
      moved = (jnp.moveaxis(kernel, -1, -1 - n_in) if to_major
               else jnp.moveaxis(kernel, -1 - n_in, -1))
      out[name] = {**out[name], "kernel": moved}
  return out


def out_major_params(params):
  """The same model's params in the out-major layout (`cfg.out_major`): each block's "o" and
  "down" kernels stored output axis first, wherever the blocks sit (scanned or per-layer
  params, a drafter's blocks)."""
  return _out_major_tree(params, True)


def out_minor_params(params):
  """`out_major_params` undone (for export and for code that reads the usual layout)."""
  return _out_major_tree(params, False)


def unstack_layers(params, n_layers: int):
  """The scanned layers' params (stacked [L, ...] under "layers") as one tree per layer,
  "layers_<i>", for `cfg.unrolled`: the same model, each layer's weights an array of its own."""
  out = dict(params)
  stacked = out.pop("layers")
  for i in range(n_layers):
    out[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
  return out


def stack_layers(params, n_layers: int):
  """`unstack_layers` undone."""
  out = dict(params)
  per_layer = [out.pop(f"layers_{i}") for i in range(n_layers)]
  out["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
  return out


def per_token(delta: jax.Array) -> jax.Array:
  """[B, X] → [B, 1, X] (one delta for all T tokens); [B, T, X] unchanged."""
  return delta[:, None] if delta.ndim == 2 else delta
