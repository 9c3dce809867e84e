"""One layer's attention over an explicit KV cache as one hand-written GPU kernel (Pallas,
Triton lowering), and the tiles every hand-written kernel of the decoder is cut by
(docs/design.md §2).

`attention_kernel` computes, for one token's G query heads sharing a kv head, the softmax
attention over the cache slots `mask_old` allows and this call's new tokens `mask_new` allows,
online over blocks of slots (flash decoding); a long cache is split over programs. It serves
twice: inside the five-kernel layers of `pallas_layers.py` (`LlamaConfig.pallas`), whose o-product
kernel combines the splits, and alone inside XLA's layers (`LlamaConfig.attn_kernel`,
`attention` below), where it replaces XLA's ~8 kernels for a layer's attention (the cache part's
and the new part's products, the softmax's maximum, sum and scaling, the concatenation, the
output's transpose) and XLA combines a long cache's splits. Either way the kernel reads the
*stacked* cache [L, B, S, K, H] at the layer's index (an operand, traced in a scan), so no
layer's cache is sliced out. Query scale, Gemma 2's soft-capping and Gemma 3's sliding windows
(static per layer, or an operand) are terms inside it; a token that sees nothing gets zeros.
The softmax weights stay float32 for the value product: equal to XLA's attention to float32
rounding in float32 models, close in bfloat16 ones (tests/test_pallas_layers.py).

On CPU the kernel runs in Pallas's interpreter (tests), chosen at lowering
(`jax.lax.platform_dependent`), so a program compiled for an NVIDIA GPU on a machine without one
gets Triton's kernel. TPU has no Triton: refused.

Shape legend: `layers.py`; R = B·T rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Calls of more new tokens a row (prefill) keep XLA's layers: their products are matrix
# products, which cuBLAS does better than these matrix-vector kernels.
MAX_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class Tiles:
  """How the kernels cut their work (chosen without a GPU to time them; the next GPU loan
  sweeps them: experiments/scale/pallas_tiles.py).

  tile: elements of the largest intermediate tile ([rows, contracting block, columns]
    broadcast products); 8192 over 4 warps is 64 float32 registers a thread.
  programs: programs a kernel aims at, about two per SM of an H100/H200 (132): at one token a
    step each kernel reads a layer's weights once, and it needs every SM's loads in flight to
    stream them at full speed (the 135M shape's widths give 60-192).
  rows: rows (tokens) a program takes at once.
  split: cache slots an attention program reads at most: a longer cache is split over
    programs (flash decoding), combined by the o-product kernel (or by XLA, `attention`).
  num_warps, num_stages: Triton's, per kernel.
  columns: the fewest output columns a product's program owns; 0: one 32-byte memory sector of
    each weight row (8 float32 or 16 bfloat16 columns). Fewer (a power of two) gives a narrow
    product more programs, each reading part of a sector of every row.
  depth: programs that share the contracting axis of each of a layer's output-side products
    (o, down), each summing a run of its blocks; 1: one program takes a column block's whole
    contraction. Above 1 a product writes float32 partial sums and the kernel that reads the
    stream next (which reads whole rows anyway) adds them up with the residual, so the column
    blocks can stay wide (whole 128-256-byte segments of each weight row) while `programs`
    programs stream the weights."""
  tile: int = 8192
  programs: int = 256
  rows: int = 16
  split: int = 256
  num_warps: int = 4
  num_stages: int = 2
  columns: int = 0
  depth: int = 1

  def __post_init__(self):
    if self.columns < 0 or self.columns & (self.columns - 1):
      raise ValueError(f"Tiles.columns={self.columns}: Triton's blocks are powers of two; "
                       "use 0 (one 32-byte sector), 1, 2, 4, 8, ...")
    if self.depth < 1:
      raise ValueError(f"Tiles.depth={self.depth}: programs sharing a contraction; use 1 "
                       "(one program a column block) or more.")


# The tiles every call uses (read when a program is traced).
TILES = Tiles()


def pow2_floor(n: int) -> int:
  """The largest power of two ≤ n (1 for n ≤ 1)."""
  return 1 << (max(n, 1).bit_length() - 1)


def divisor_block(n: int, cap: int) -> int:
  """The largest power of two ≤ cap that divides n (1 if n is odd)."""
  cap = max(pow2_floor(cap), 1)
  while cap > 1 and n % cap:
    cap //= 2
  return cap


def check_backend() -> None:
  """ValueError on TPU (no Triton), before anything is compiled."""
  if jax.default_backend() == "tpu":
    raise ValueError("model pallas=1 / attn_kernel=1: the hand-written kernels are written for "
                     "NVIDIA GPUs (Triton lowering); on TPU use XLA's layers (drop :pallas=1 or "
                     ":attn_kernel=1 from model.size).")


def _visible(loaded):
  """A mask loaded as int32 (bool refs do not lower to Triton) → bool."""
  return loaded != 0


def attention_kernel(*refs, gp, bs, bt, split_blocks, splits, cfg, window, normalize=False):
  """Program (kv head, row, split): the G query heads of one token (row r = b·T + t) that
  share kv head `kvh`, over the cache slots `old_ref[b, t]` allows in this split's
  `split_blocks` blocks of slots, and, in the last split, this call's new tokens
  `new_ref[b, t]` allows: a softmax computed online over blocks (flash decoding). Each split
  writes its unnormalised output, maximum and sum; `_attention_out_kernel` combines the splits
  as it reads them, so a long cache spreads over many programs at no extra kernel.
  refs: layer, q, cache k, cache v, the new kv, mask_old, mask_new, [positions [R] and the
  cache's slot positions [B, S] for a sliding window, and the window [] when it is an
  operand], acc [splits, R, N, H], m and l [splits, R, N]; or, where `normalize` (one split),
  the attention's output [R, N, H] in the model's dtype instead. window: this layer's sliding
  window (static; 0 = global; "operand": read from the window ref, ≤ 0 = global): a key is
  visible only if its position > the query's − window."""
  layer_ref, q_ref, cache_k_ref, cache_v_ref, kv_ref, old_ref, new_ref = refs[:7]
  pos_ref, key_pos_ref = refs[7:9] if window else (None, None)
  window_ref = refs[9] if window == "operand" else None
  out_refs = refs[-1:] if normalize else refs[-3:]
  kvh, row, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = layer_ref[()]
  g, k_heads, dtype = cfg.n_heads // cfg.n_kv_heads, cfg.n_kv_heads, jnp.dtype(cfg.dtype)
  t_len = old_ref.shape[1]
  size = cache_k_ref.shape[2]
  b, t = row // t_len, row % t_len
  gmask = jnp.arange(gp) < g
  q = plgpu.load(q_ref.at[row, pl.ds(kvh * g, gp), :], mask=gmask[:, None], other=0)
  q = (q.astype(jnp.float32) * cfg.query_scale).astype(dtype).astype(jnp.float32)  # [Gp, H]
  neg = jnp.finfo(jnp.float32).min
  if window_ref is not None:  # a traced window (a scanned layer's): global where ≤ 0
    width_ = window_ref[()]
    low = jnp.where(width_ > 0, pos_ref[row] - width_, jnp.iinfo(jnp.int32).min)
  else:
    low = pos_ref[row] - window if window else None  # keys at or below are out of the window

  def attend(carry, k, v, visible):
    """One block of keys k[X, H], values v[X, H], visible bool[X]."""
    m, l, acc = carry
    logits = jnp.sum(q[:, None, :] * k[None], axis=2)  # [Gp, X]
    if cfg.attn_softcap:  # Gemma 2: cap · tanh(logits / cap)
      logits = jnp.tanh(logits / cfg.attn_softcap) * cfg.attn_softcap
    logits = jnp.where(visible[None, :], logits, neg)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    scale = jnp.exp(m - m_new)
    p = jnp.where(visible[None, :], jnp.exp(logits - m_new[:, None]), 0.0)
    acc = acc * scale[:, None] + jnp.sum(p[:, :, None] * v[None], axis=1)
    return m_new, l * scale + jnp.sum(p, axis=1), acc

  def cache_block(c, carry):
    slots = c * bs + jnp.arange(bs)
    smask = slots < size
    visible = _visible(plgpu.load(old_ref.at[b, t, pl.ds(c * bs, bs)], mask=smask, other=0))
    if window:
      visible &= plgpu.load(key_pos_ref.at[b, pl.ds(c * bs, bs)], mask=smask, other=0) > low
    k = plgpu.load(cache_k_ref.at[layer, b, pl.ds(c * bs, bs), kvh, :], mask=smask[:, None],
                   other=0).astype(jnp.float32)
    v = plgpu.load(cache_v_ref.at[layer, b, pl.ds(c * bs, bs), kvh, :], mask=smask[:, None],
                   other=0).astype(jnp.float32)
    return attend(carry, k, v, visible & smask)

  head_dim = cfg.head_dim
  carry = (jnp.full((gp,), neg, jnp.float32), jnp.zeros((gp,), jnp.float32),
           jnp.zeros((gp, head_dim), jnp.float32))
  first_block = split * split_blocks
  last_block = jnp.minimum(first_block + split_blocks, pl.cdiv(size, bs))
  carry = jax.lax.fori_loop(first_block, last_block, cache_block, carry)

  def new_block(c, carry):
    """This call's tokens c·bt .. c·bt + bt − 1: rows b·T + j of the new K/V [R, 2K, H]."""
    jmask = c * bt + jnp.arange(bt) < t_len
    visible = _visible(plgpu.load(new_ref.at[b, t, pl.ds(c * bt, bt)], mask=jmask, other=0))
    first = b * t_len + c * bt
    if window:
      visible &= plgpu.load(pos_ref.at[pl.ds(first, bt)], mask=jmask, other=0) > low
    k = plgpu.load(kv_ref.at[pl.ds(first, bt), kvh, :], mask=jmask[:, None],
                   other=0).astype(jnp.float32)
    v = plgpu.load(kv_ref.at[pl.ds(first, bt), k_heads + kvh, :], mask=jmask[:, None],
                   other=0).astype(jnp.float32)
    return attend(carry, k, v, visible & jmask & (split == splits - 1))  # the last split's

  m, l, acc = jax.lax.fori_loop(0, pl.cdiv(t_len, bt), new_block, carry)
  heads = pl.ds(kvh * g, gp)
  if normalize:  # one split: the output itself (zeros for a token that sees nothing)
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(dtype)
    plgpu.store(out_refs[0].at[row, heads, :], out.astype(out_refs[0].dtype), mask=gmask[:, None])
    return
  acc_ref, m_ref, l_ref = out_refs
  plgpu.store(acc_ref.at[split, row, heads, :], acc, mask=gmask[:, None])
  plgpu.store(m_ref.at[split, row, heads], m, mask=gmask)
  plgpu.store(l_ref.at[split, row, heads], l, mask=gmask)


def attention_cut(cfg, size: int, t: int, tiles: Tiles) -> tuple[int, int, int, int, int]:
  """How `attention_kernel` cuts a cache of `size` slots and t new tokens a row: (query heads
  a program pads to, cache slots a block, new tokens a block, blocks a split, splits)."""
  gp = pl.next_power_of_2(cfg.n_heads // cfg.n_kv_heads)
  bs = divisor_block(pl.next_power_of_2(size), max(tiles.tile // (gp * cfg.head_dim), 1))
  bt = min(bs, pl.next_power_of_2(t))
  split_blocks = max(tiles.split // bs, 1)
  return gp, bs, bt, split_blocks, pl.cdiv(pl.cdiv(size, bs), split_blocks)


def attention(cfg, q, k, v, cache_k, cache_v, layer, mask_old, mask_new, positions=None,
              key_pos=None, window=None):
  """One layer's attention as one kernel inside XLA's layers (`LlamaConfig.attn_kernel`):
  `attention_kernel` over the stacked cache at `layer`, so no layer's cache is sliced out.

  q [B, T, N, H] after RoPE (before the query scale), k, v [B, T, K, H] this call's new keys
  and values; cache_k/v [L, B, S, K, H] as they were before this call; layer int32 [] (traced
  in a scan); mask_old [B, T, S] and mask_new [B, T, T] (bool or int32; `layers.split_mask`);
  for models with sliding windows, positions [B, T], key_pos int32[B, S] (`KVCache.pos`) and
  window int32 [] (this layer's, ≤ 0 = global). Returns the attention's output [B, T, N, H] in
  cfg.dtype: what `layers.Attention` computes before its o product."""
  check_backend()
  if cfg.has_windows and (key_pos is None or window is None or positions is None):
    raise ValueError("A model with sliding-window layers needs positions, the cache's slot "
                     "positions (KVCache.pos) and the layer's window on the attention kernel.")
  run = functools.partial(_attention, cfg)
  args = (q, k, v, cache_k, cache_v, jnp.asarray(layer, jnp.int32), mask_old, mask_new)
  if cfg.has_windows:
    args += (positions, key_pos, jnp.asarray(window, jnp.int32))
  return jax.lax.platform_dependent(*args, cuda=functools.partial(run, interpret=False),
                                    default=functools.partial(run, interpret=True))


def _attention(cfg, q, k, v, cache_k, cache_v, layer, mask_old, mask_new, *window_args,
               interpret):
  b, t, n, head_dim = q.shape
  n_rows, k_heads, dtype = b * t, cfg.n_kv_heads, jnp.dtype(cfg.dtype)
  tiles = TILES
  gp, bs, bt, split_blocks, splits = attention_cut(cfg, cache_k.shape[2], t, tiles)
  kv = jnp.concatenate([k, v], axis=2).reshape(n_rows, 2 * k_heads, head_dim).astype(dtype)
  if window_args:
    positions, key_pos, window = window_args
    window_args = (positions.reshape(n_rows).astype(jnp.int32), key_pos.astype(jnp.int32),
                   window)
  normalize = splits == 1
  if normalize:
    out_shape = jax.ShapeDtypeStruct((n_rows, n, head_dim), dtype)
  else:
    out_shape = (jax.ShapeDtypeStruct((splits, n_rows, n, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((splits, n_rows, n), jnp.float32),
                 jax.ShapeDtypeStruct((splits, n_rows, n), jnp.float32))
  kernel = pl.pallas_call(
      functools.partial(attention_kernel, gp=gp, bs=bs, bt=bt, split_blocks=split_blocks,
                        splits=splits, cfg=cfg, normalize=normalize,
                        window="operand" if window_args else 0),
      grid=(k_heads, n_rows, splits), out_shape=out_shape, name="attention",
      interpret=interpret, compiler_params=plgpu.CompilerParams(
          num_warps=tiles.num_warps, num_stages=tiles.num_stages))
  out = kernel(layer, q.reshape(n_rows, n, head_dim).astype(dtype), cache_k, cache_v, kv,
               mask_old.astype(jnp.int32), mask_new.astype(jnp.int32), *window_args)
  if not normalize:  # a long cache's splits, combined as `pallas_layers._attention_out_kernel` does
    acc, m, l = out
    weight = jnp.exp(m - jnp.max(m, axis=0))
    den = jnp.sum(weight * l, axis=0)
    out = (jnp.sum(weight[..., None] * acc, axis=0)
           / jnp.where(den > 0, den, 1.0)[..., None]).astype(dtype)
  return out.reshape(b, t, n, head_dim)
