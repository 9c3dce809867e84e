"""The decoder layers of the Llama and Gemma families as five hand-written GPU kernels each
(`LlamaConfig.pallas`; docs/design.md §2).

A small model's decode step on a GPU is bound by kernel launches, not bytes: XLA's fusion leaves
~19-32 kernels a layer (RMSNorm's reduction and scaling, each product, RoPE, the softmax's two
reductions, the residual adds, the cache slice, the loop counter; experiments/scale/results.md),
~1.5-2 µs each, while the 135M shape's layer reads its 14 MB of float32 weights in ~4 µs. Here
each layer is five Pallas kernels (Triton lowering), each the whole of one stage, with every
elementwise step fused into the product that reads or writes it:

  1. `_qkv_kernel`       RMSNorm, the fused q/k/v product (+ bias), per-head q/k norm, RoPE;
                         q [R, N, H] and the new k/v [R, 2K, H];
  2. `attention_kernel`  one query token's G heads of one kv head against a split of the cache
                         (`mask_old`) and this call's new tokens (`mask_new`), online softmax
                         (flash decoding; `pallas_attention.py`);
  3. `_attention_out_kernel` the splits combined, the o product, the residual;
  4. `_mlp_in_kernel`    RMSNorm, the fused gate/up product, act(gate) · up;
  5. `_product_kernel`   the down product plus the residual.

Gemma's norms after each sublayer (x + RMSNorm(h)) need a whole row of the product h, so there
the two product kernels write h alone and the next kernel, which reads whole rows anyway,
resolves x + RMSNorm(h) as it reads the stream (one program writes it out for later kernels);
its sliding windows (a static window per layer, keys compared by the cache's slot positions),
q/k norms, GELU and Gemma 2's attention soft-capping are terms inside the kernels above.

Every stage needs all of the previous stage's output (a norm or a product over the full width),
so five is the floor without a grid-wide barrier. The layers are written out (no loop counter
between them) and each kernel takes the layer index as an operand and the *stacked* weights
[L, ...]: a kernel offsets its loads by the layer, so no weight is sliced or copied out (XLA
copies a dynamic slice of stacked weights before a product: experiments/scale/results.md, "the
levers"). The new K/V of all layers are written to the cache after the last layer, as
`decoder.Decoder` does.

Products at these shapes are matrix-vector products: each program owns a block of output
columns and a block of rows and accumulates broadcast products over blocks of the contracting
axis in float32 (no tensor cores; exact float32 arithmetic). With `Tiles.depth` > 1 the o and
down products share their contraction between programs: each writes a float32 partial sum
over its run of blocks ([depth, R, D]), and the kernel that reads the stream next adds them up
with the residual where it reads the row (a pending output, as Gemma's post-sublayer norms
are); the same five kernels a layer, more programs each. Triton needs power-of-two tiles: every
tile is one, and loads and stores past an axis's end are masked. On CPU the same kernels run in
Pallas's interpreter (tests); TPU has no Triton.

The attention kernel also serves alone, inside XLA's layers (`LlamaConfig.attn_kernel`,
`pallas_attention.attention`). Every kernel is cut by `pallas_attention.TILES`.

Rows R = B·T (every token of the call), so the same kernels serve one-token decoding, chain
verification and tree verification (masks are arguments, as in the XLA layers); calls of more
than `pallas_attention.MAX_TOKENS` tokens a row (prefill), training and steered calls keep
XLA's layers. Numerics: float32 accumulation, the XLA layers' rounding points to cfg.dtype after
each product; the
softmax is computed online (maximum and sum carried over blocks), not over the concatenated
logits, and its weights stay float32 for the value product: equal to the XLA layers to float32
rounding in float32 models and close in bfloat16 ones (tests/test_pallas_layers.py).

Shape legend: `layers.py`; R = B·T rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from spec_jax.models import pallas_attention
from spec_jax.models.pallas_attention import attention_kernel, check_backend, divisor_block

def unsupported(cfg) -> str | None:
  """Why these kernels cannot compute `cfg`'s layers (None: they can)."""
  if getattr(cfg, "FAMILY", "") not in ("llama", "gemma"):
    return f"the {getattr(cfg, 'FAMILY', type(cfg).__name__)!r} family's layers"
  if not cfg.fused:
    return "the unfused layout (the kernels read 'qkv' and 'gate_up': add :fused=1)"
  if cfg.unrolled:
    return "the unrolled layout (the kernels index the stacked layers: drop :unrolled=1)"
  if getattr(cfg, "out_major", False):
    return "the out-major layout (the kernels read o and down as [in, out]: drop :out_major=1)"
  return None


def _column_block(n: int, tiles, itemsize: int, depth: int = 1) -> int:
  """Output columns a program owns: the widest power of two up to 64 that still gives
  `tiles.programs` programs with `depth` programs to a column block, else the narrowest
  (`_narrowest`)."""
  narrowest = _narrowest(tiles, itemsize)
  for block in (64, 32, 16, 8, 4, 2):
    if block > narrowest and n % block == 0 and n // block * depth >= tiles.programs:
      return block
  return narrowest


def _depth(blocks: int, tiles) -> tuple[int, int]:
  """(programs sharing a contraction of `blocks` blocks, blocks each takes): `tiles.depth` at
  most, every program with at least one block."""
  per = pl.cdiv(blocks, min(tiles.depth, blocks))
  return pl.cdiv(blocks, per), per


def _narrowest(tiles, itemsize: int) -> int:
  """The fewest columns a program owns: `tiles.columns`, or those whose segments of a weight row
  fill a 32-byte memory sector."""
  return tiles.columns or max(8, 32 // itemsize)


def _rms(sumsq, width: int, eps: float):
  return jax.lax.rsqrt(sumsq / width + eps)


def _gain(gain, cfg):
  """RMSNorm's gain from its stored scale (float32): Gemma stores gain − 1."""
  gain = gain.astype(jnp.float32)
  return gain + cfg.norm_offset if cfg.norm_offset else gain


def _scaled(x, inv, gain_ref, layer, c, bk, width, cfg):
  """RMSNorm's output on block c of a row block x[rows, bk] (float32) with inverse RMS inv[rows]:
  (x · inv) · gain, rounded to the model's dtype, as float32 (zero past the width)."""
  cmask = c * bk + jnp.arange(bk) < width
  gain = _gain(plgpu.load(gain_ref.at[layer, pl.ds(c * bk, bk)], mask=cmask, other=0), cfg)
  return ((x * inv[:, None]) * gain[None, :]).astype(cfg.dtype).astype(jnp.float32)


def _row_chunks(ref, rows, rmask, width, bk):
  """chunk(c) → block [rows, c·bk : (c+1)·bk] of ref [R, width] in float32, zero outside."""
  def chunk(c):
    cmask = c * bk + jnp.arange(bk) < width
    return plgpu.load(ref.at[rows, pl.ds(c * bk, bk)], mask=rmask[:, None] & cmask[None, :],
                      other=0).astype(jnp.float32)
  return chunk


def _sum_squares(chunk, width, bk, rmask):
  def body(c, acc):
    x = chunk(c)
    return acc + jnp.sum(x * x, axis=1)
  return jax.lax.fori_loop(0, pl.cdiv(width, bk), body, jnp.zeros(rmask.shape, jnp.float32))


def _sum_partials(h_ref, rows, rmask, cmask, cols):
  """Σ_s h_ref[s, rows, cols] in float32: the partial sums of the programs that shared a
  product's contraction (`Tiles.depth`)."""
  def add(s, acc):
    return acc + plgpu.load(h_ref.at[s, rows, cols], mask=rmask[:, None] & cmask[None, :],
                            other=0)
  zeros = jnp.zeros((rmask.shape[0], cmask.shape[0]), jnp.float32)
  return jax.lax.fori_loop(0, h_ref.shape[0], add, zeros)


def _output_chunks(h_ref, rows, rmask, width, bk, dtype):
  """chunk(c) → block c of a sublayer's output h waiting in h_ref (float32 holding values of
  the model's dtype): [R, width] as its product stored it, or [S, R, width] float32 partial
  sums (`Tiles.depth`), added up and rounded as the product's output is."""
  if h_ref.ndim == 2:
    return _row_chunks(h_ref, rows, rmask, width, bk)

  def chunk(c):
    cmask = c * bk + jnp.arange(bk) < width
    total = _sum_partials(h_ref, rows, rmask, cmask, pl.ds(c * bk, bk))
    return total.astype(dtype).astype(jnp.float32)
  return chunk


def _stream(x_ref, pending, rows, rmask, width, bk, cfg):
  """chunk(c) → block c of the residual stream for a block of rows (float32 holding values of
  the model's dtype): x, or, where the previous sublayer's output h still waits (pending =
  (h_ref, gain_ref, gain layer)), x + RMSNorm(h) (Gemma's post-attention and post-MLP norms)
  or, without a gain, x + h (a product's partial sums, `Tiles.depth`), rounded as the XLA
  block rounds it."""
  load_x = _row_chunks(x_ref, rows, rmask, width, bk)
  if pending is None:
    return load_x
  h_ref, gain_ref, gain_layer = pending
  load_h = _output_chunks(h_ref, rows, rmask, width, bk, jnp.dtype(cfg.dtype))
  if gain_ref is None:
    return lambda c: (load_x(c) + load_h(c)).astype(cfg.dtype).astype(jnp.float32)
  inv = _rms(_sum_squares(load_h, width, bk, rmask), width, cfg.norm_eps)

  def chunk(c):
    normed = _scaled(load_h(c), inv, gain_ref, gain_layer, c, bk, width, cfg)
    return (load_x(c) + normed).astype(cfg.dtype).astype(jnp.float32)
  return chunk


def _store_stream(chunk, out_ref, rows, rmask, width, bk, when):
  """Where `when`, write the stream `chunk` gives to out_ref [R, width] (one program of a
  grid writes the stream it resolved, for the next kernels)."""
  @pl.when(when)
  def _():
    def body(c, carry):
      cmask = c * bk + jnp.arange(bk) < width
      plgpu.store(out_ref.at[rows, pl.ds(c * bk, bk)], chunk(c).astype(out_ref.dtype),
                  mask=rmask[:, None] & cmask[None, :])
      return carry
    jax.lax.fori_loop(0, pl.cdiv(width, bk), body, 0)


def _pending(refs: list, kind, gain_layer):
  """A kernel's pending operands, popped off the front of refs: (h_ref, gain_ref, gain_layer)
  for kind "norm" (the previous sublayer's output and its norm's scale: Gemma), (h_ref, None,
  gain_layer) for "add" (its partial sums alone: `Tiles.depth`), None for None."""
  if kind is None:
    return None
  h_ref = refs.pop(0)
  return h_ref, (refs.pop(0) if kind == "norm" else None), gain_layer


def _rope_pair(lo, hi, cos, sin):
  """RoPE in the rotate-half layout on a head's halves: (lo·cos − hi·sin, hi·cos + lo·sin)."""
  return lo * cos - hi * sin, hi * cos + lo * sin


def _qkv_kernel(*refs, n_rows, br, bk, bh, cfg, pending):
  """Program (head, part, row block): columns part·bh + [0, bh) of each half of one head of
  RMSNorm(x) @ qkv for a block of rows (RoPE pairs column j with j + H/2, so a program holds
  whole pairs; bh = H/2 under q/k norm, which needs the whole head), then the head's bias,
  q/k norm and RoPE; q heads to q_ref [R, N, H], k/v heads to kv_ref [R, 2K, H].
  refs: layer, x, [the previous layer's MLP output, and its post-MLP norm scale, when
  `pending` (`_pending`)], positions, attn_norm, qkv kernel, [qkv bias], [q_norm, k_norm],
  freqs; the outputs q [R, N, H], kv [R, 2K, H] and, when `pending`, the stream resolved
  [R, D]."""
  refs = list(refs)
  layer_ref, x_ref = refs.pop(0), refs.pop(0)
  layer = layer_ref[()]
  pend = _pending(refs, pending, layer - 1)
  pos_ref, norm_ref, w_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  bias_ref = refs.pop(0) if cfg.qkv_bias else None
  qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if cfg.qk_norm else (None, None)
  freq_ref, q_ref, kv_ref = refs[:3]
  head, part, rb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n, k_heads, h2 = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim // 2
  lo_cols, hi_cols = pl.ds(part * bh, bh), pl.ds(h2 + part * bh, bh)
  width, dtype = cfg.d_model, jnp.dtype(cfg.dtype)
  rows = pl.ds(rb * br, br)
  rmask = rb * br + jnp.arange(br) < n_rows
  stream = _stream(x_ref, pend, rows, rmask, width, bk, cfg)
  if pending:
    _store_stream(stream, refs[3], rows, rmask, width, bk, (head == 0) & (part == 0))
  inv = _rms(_sum_squares(stream, width, bk, rmask), width, cfg.norm_eps)

  def body(c, acc):
    lo, hi = acc
    x = _scaled(stream(c), inv, norm_ref, layer, c, bk, width, cfg)
    kmask = (c * bk + jnp.arange(bk) < width)[:, None]
    w_lo = plgpu.load(w_ref.at[layer, pl.ds(c * bk, bk), head, lo_cols], mask=kmask,
                      other=0).astype(jnp.float32)
    w_hi = plgpu.load(w_ref.at[layer, pl.ds(c * bk, bk), head, hi_cols], mask=kmask,
                      other=0).astype(jnp.float32)
    lo = lo + jnp.sum(x[:, :, None] * w_lo[None], axis=1)
    hi = hi + jnp.sum(x[:, :, None] * w_hi[None], axis=1)
    return lo, hi

  zeros = jnp.zeros((br, bh), jnp.float32)
  lo, hi = jax.lax.fori_loop(0, pl.cdiv(width, bk), body, (zeros, zeros))
  lo, hi = lo.astype(dtype).astype(jnp.float32), hi.astype(dtype).astype(jnp.float32)
  if bias_ref is not None:  # the dense layer adds its bias in the model's dtype
    lo = (lo + bias_ref[layer, head, lo_cols].astype(jnp.float32)).astype(dtype)
    hi = (hi + bias_ref[layer, head, hi_cols].astype(jnp.float32)).astype(dtype)
    lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
  is_q, is_v = head < n, head >= n + k_heads
  if qn_ref is not None:  # Qwen3, Gemma 3: RMSNorm over each q/k head, before RoPE
    inv_h = _rms(jnp.sum(lo * lo, axis=1) + jnp.sum(hi * hi, axis=1), 2 * h2, cfg.norm_eps)
    g_lo = _gain(jnp.where(is_q, qn_ref[layer, pl.ds(0, h2)], kn_ref[layer, pl.ds(0, h2)]), cfg)
    g_hi = _gain(jnp.where(is_q, qn_ref[layer, pl.ds(h2, h2)], kn_ref[layer, pl.ds(h2, h2)]),
                 cfg)
    n_lo = ((lo * inv_h[:, None]) * g_lo[None]).astype(dtype)
    n_hi = ((hi * inv_h[:, None]) * g_hi[None]).astype(dtype)
    lo = jnp.where(is_v, lo, n_lo.astype(jnp.float32))
    hi = jnp.where(is_v, hi, n_hi.astype(jnp.float32))
  # RoPE on q and k heads, angles in float32.
  pos = plgpu.load(pos_ref.at[rows], mask=rmask, other=0).astype(jnp.float32)
  angles = pos[:, None] * freq_ref[layer, lo_cols][None, :]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  rot_lo, rot_hi = _rope_pair(lo, hi, cos, sin)
  r_lo = jnp.where(is_v, lo, rot_lo).astype(dtype)
  r_hi = jnp.where(is_v, hi, rot_hi).astype(dtype)
  q_head, kv_head = jnp.minimum(head, n - 1), jnp.maximum(head - n, 0)
  q_mask, kv_mask = (rmask & is_q)[:, None], (rmask & ~is_q)[:, None]
  plgpu.store(q_ref.at[rows, q_head, lo_cols], r_lo.astype(q_ref.dtype), mask=q_mask)
  plgpu.store(q_ref.at[rows, q_head, hi_cols], r_hi.astype(q_ref.dtype), mask=q_mask)
  plgpu.store(kv_ref.at[rows, kv_head, lo_cols], r_lo.astype(kv_ref.dtype), mask=kv_mask)
  plgpu.store(kv_ref.at[rows, kv_head, hi_cols], r_hi.astype(kv_ref.dtype), mask=kv_mask)


def _store_product(acc, res_ref, out_ref, rows, cols, mask, dtype):
  """A product kernel's end: the float32 sum rounded to `dtype` (a dense layer's output), plus
  the residual when there is one, stored to the [rows, cols] block."""
  out = acc.astype(dtype).astype(jnp.float32)
  if res_ref is not None:
    out = plgpu.load(res_ref.at[rows, cols], mask=mask, other=0).astype(jnp.float32) + out
  plgpu.store(out_ref.at[rows, cols], out.astype(out_ref.dtype), mask=mask)


def _blocks(total: int, per: int):
  """The contraction blocks [first, end) of this program: all `total`, or with `per` (a
  product's contraction shared by programs, `Tiles.depth`) its run of per blocks, the
  program's index along the grid's third axis."""
  if not per:
    return 0, total
  first = pl.program_id(2) * per
  return first, jnp.minimum(first + per, total)


def _finish_product(acc, res_ref, out_ref, rows, cols, mask, dtype, per):
  """A product kernel's end: its share of the contraction as a float32 partial sum where the
  contraction is shared (`_blocks`), else the product (`_store_product`)."""
  if per:
    plgpu.store(out_ref.at[pl.program_id(2), rows, cols], acc, mask=mask)
  else:
    _store_product(acc, res_ref, out_ref, rows, cols, mask, dtype)


def _attention_out_kernel(*refs, n_rows, br, bk, bn, head_dim, dtype, residual, per=0):
  """`_product_kernel` for the o product, reading its input from the attention's splits:
  block c of row r is head n's Σ_s e^(m_s − M) acc_s / Σ_s e^(m_s − M) l_s (M = max_s m_s), the
  softmax over every split at once, rounded to `dtype` as XLA's attention output is.
  refs: layer, acc [splits, R, N, H], m, l [splits, R, N], o [L, N·H, D], [res [R, D]], out
  ([R, D], or [depth, R, D] float32 partial sums with `per`: `_blocks`)."""
  layer_ref, acc_ref, m_ref, l_ref, w_ref = refs[:5]
  res_ref, out_ref = refs[5:] if residual else (None, refs[5])
  cb, rb = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[()]
  splits, n_out = acc_ref.shape[0], w_ref.shape[2]
  width = w_ref.shape[1]
  rows, cols = pl.ds(rb * br, br), pl.ds(cb * bn, bn)
  rmask = rb * br + jnp.arange(br) < n_rows
  cmask = cb * bn + jnp.arange(bn) < n_out
  neg = jnp.finfo(jnp.float32).min

  def heads(c):
    """Block c (bk columns inside one head, bk | H) of the attention output, float32."""
    per_head = head_dim // bk
    head = jax.lax.div(c, jnp.int32(per_head))  # c ≥ 0: no floor-division sign fix-ups
    offset = (c - head * per_head) * bk

    def top(s, best):
      return jnp.maximum(best, plgpu.load(m_ref.at[s, rows, head], mask=rmask, other=neg))
    best = jax.lax.fori_loop(0, splits, top, jnp.full((br,), neg, jnp.float32))

    def gather(s, carry):
      num, den = carry
      weight = jnp.exp(plgpu.load(m_ref.at[s, rows, head], mask=rmask, other=neg) - best)
      den = den + weight * plgpu.load(l_ref.at[s, rows, head], mask=rmask, other=0)
      part = plgpu.load(acc_ref.at[s, rows, head, pl.ds(offset, bk)], mask=rmask[:, None],
                        other=0)
      return num + weight[:, None] * part, den
    num, den = jax.lax.fori_loop(0, splits, gather, (jnp.zeros((br, bk), jnp.float32),
                                                     jnp.zeros((br,), jnp.float32)))
    # A token that sees nothing (a parked padding row) gets zeros, not 0 / 0.
    return (num / jnp.where(den > 0, den, 1.0)[:, None]).astype(dtype).astype(jnp.float32)

  def body(c, acc):
    w = plgpu.load(w_ref.at[layer, pl.ds(c * bk, bk), cols], mask=cmask[None], other=0)
    return acc + jnp.sum(heads(c)[:, :, None] * w.astype(jnp.float32)[None], axis=1)

  first, end = _blocks(width // bk, per)
  acc = jax.lax.fori_loop(first, end, body, jnp.zeros((br, bn), jnp.float32))
  _finish_product(acc, res_ref, out_ref, rows, cols, rmask[:, None] & cmask[None, :], dtype,
                  per)


def _product_kernel(*refs, n_rows, br, bk, bn, dtype, residual, per=0):
  """Program (column block, row block[, contraction share]): x @ w[layer] for a block of rows
  and columns, rounded to `dtype`, plus res where `residual` (refs: layer, x [R, I], w
  [L, I, O], [res [R, O]], out [R, O]). Without: the sublayer's output, which the next kernel
  resolves (Gemma's norm). With `per`: a float32 partial sum over this program's blocks to out
  [depth, R, O] (`_blocks`)."""
  layer_ref, x_ref, w_ref = refs[:3]
  res_ref, out_ref = refs[3:] if residual else (None, refs[3])
  cb, rb = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[()]
  width, n_out = x_ref.shape[1], w_ref.shape[2]
  rows, cols = pl.ds(rb * br, br), pl.ds(cb * bn, bn)
  rmask = rb * br + jnp.arange(br) < n_rows
  cmask = cb * bn + jnp.arange(bn) < n_out

  def body(c, acc):
    kmask = c * bk + jnp.arange(bk) < width
    x = plgpu.load(x_ref.at[rows, pl.ds(c * bk, bk)], mask=rmask[:, None] & kmask[None, :],
                   other=0).astype(jnp.float32)
    w = plgpu.load(w_ref.at[layer, pl.ds(c * bk, bk), cols], mask=kmask[:, None] & cmask[None],
                   other=0).astype(jnp.float32)
    return acc + jnp.sum(x[:, :, None] * w[None], axis=1)

  first, end = _blocks(pl.cdiv(width, bk), per)
  acc = jax.lax.fori_loop(first, end, body, jnp.zeros((br, bn), jnp.float32))
  _finish_product(acc, res_ref, out_ref, rows, cols, rmask[:, None] & cmask[None, :], dtype,
                  per)


def _mlp_in_kernel(*refs, n_rows, br, bk, bn, cfg, pending):
  """Program (column block, row block): act(gate) · up of RMSNorm(x), gate/up = the columns of
  gate_up [L, D, 2, F], act = SiLU (Llama) or tanh-approximated GELU (Gemma).
  refs: layer, x, [the attention's output h, and its post-attention norm scale, when
  `pending` (`_pending`)], mlp_norm, gate_up; out [R, F] and, when `pending`, the stream
  resolved."""
  refs = list(refs)
  layer_ref, x_ref = refs.pop(0), refs.pop(0)
  layer = layer_ref[()]
  pend = _pending(refs, pending, layer)
  norm_ref, w_ref, out_ref = refs[:3]
  cb, rb = pl.program_id(0), pl.program_id(1)
  width, n_out, dtype = cfg.d_model, cfg.d_ff, jnp.dtype(cfg.dtype)
  rows, cols = pl.ds(rb * br, br), pl.ds(cb * bn, bn)
  rmask = rb * br + jnp.arange(br) < n_rows
  cmask = cb * bn + jnp.arange(bn) < n_out
  stream = _stream(x_ref, pend, rows, rmask, width, bk, cfg)
  if pending:
    _store_stream(stream, refs[3], rows, rmask, width, bk, cb == 0)
  inv = _rms(_sum_squares(stream, width, bk, rmask), width, cfg.norm_eps)

  def body(c, acc):
    gate, up = acc
    x = _scaled(stream(c), inv, norm_ref, layer, c, bk, width, cfg)
    wmask = (c * bk + jnp.arange(bk) < width)[:, None] & cmask[None]
    w_gate = plgpu.load(w_ref.at[layer, pl.ds(c * bk, bk), jnp.int32(0), cols], mask=wmask,
                        other=0).astype(jnp.float32)
    w_up = plgpu.load(w_ref.at[layer, pl.ds(c * bk, bk), jnp.int32(1), cols], mask=wmask,
                      other=0).astype(jnp.float32)
    return (gate + jnp.sum(x[:, :, None] * w_gate[None], axis=1),
            up + jnp.sum(x[:, :, None] * w_up[None], axis=1))

  zeros = jnp.zeros((br, bn), jnp.float32)
  gate, up = jax.lax.fori_loop(0, pl.cdiv(width, bk), body, (zeros, zeros))
  gate, up = gate.astype(dtype).astype(jnp.float32), up.astype(dtype).astype(jnp.float32)
  if cfg.FAMILY == "gemma":
    act = jax.nn.gelu(gate, approximate=True)
  else:
    act = gate * jax.nn.sigmoid(gate)
  act = act.astype(dtype).astype(jnp.float32)
  plgpu.store(out_ref.at[rows, cols], (act * up).astype(out_ref.dtype),
              mask=rmask[:, None] & cmask[None, :])


def layers(cfg, params, x, positions, cache_k, cache_v, mask_old, mask_new, key_pos=None,
           hidden=False):
  """The decoder's layer stack on the kernels above (`decoder.Decoder` with `cfg.pallas`).

  params: the scanned layers' params (stacked [L, ...], fused layout); x [B, T, D] the
  embedded tokens; positions int32[B, T]; cache_k/v [L, B, S, K, H] as they were before this
  call; mask_old bool[B, T, S] (the cache slots each token sees), mask_new bool[B, T, T]
  (`layers.split_mask`); key_pos int32[B, S] the cache's slot positions (models with sliding
  windows). Returns (x [B, T, D] after the last layer, (new_k, new_v) [L, B, T, K, H],
  residuals [L, B, T, D] (each layer's input) or None unless `hidden`)."""
  reason = unsupported(cfg)
  if reason is not None:
    raise ValueError(f"model pallas=1 does not compute {reason}.")
  check_backend()
  if cfg.has_windows and key_pos is None:
    raise ValueError("A model with sliding-window layers needs the cache's slot positions "
                     "(KVCache.pos) on the kernels.")
  # Triton where the program is lowered for an NVIDIA GPU (also when compiled for one on a
  # machine without it), Pallas's interpreter elsewhere: chosen at lowering, not tracing.
  run = functools.partial(_layers, cfg, hidden=hidden)
  return jax.lax.platform_dependent(
      params, x, positions, cache_k, cache_v, mask_old, mask_new, key_pos,
      cuda=functools.partial(run, interpret=False), default=functools.partial(run, interpret=True))


def _layers(cfg, params, x, positions, cache_k, cache_v, mask_old, mask_new, key_pos, *, hidden,
            interpret):
  b, t, d = x.shape
  n_rows = b * t
  n, k_heads, head_dim, d_ff = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  n_layers = cfg.n_layers
  dtype = jnp.dtype(cfg.dtype)
  attn = params["attn"]
  qkv_w = attn["qkv"]["kernel"]                                  # [L, D, N+2K, H]
  qkv_b = attn["qkv"].get("bias")                                # [L, N+2K, H]
  q_norm = attn.get("q_norm", {}).get("scale")                   # [L, H]
  k_norm = attn.get("k_norm", {}).get("scale")
  o_w = attn["o"]["kernel"].reshape(n_layers, n * head_dim, d)   # [L, N·H, D]: a bitcast
  gate_up = params["gate_up"]["kernel"]                          # [L, D, 2, F]
  down = params["down"]["kernel"]                                # [L, F, D]
  attn_norm, mlp_norm = params["attn_norm"]["scale"], params["mlp_norm"]["scale"]
  # Gemma: a norm after each sublayer, before its residual add ([L, D] each; None for Llama).
  post_attn = params.get("post_attn_norm", {}).get("scale")
  post_mlp = params.get("post_mlp_norm", {}).get("scale")
  post = post_attn is not None
  freqs = jnp.asarray(cfg.rope_table())                          # f32[L, H/2]

  tiles = pallas_attention.TILES
  br = min(pl.next_power_of_2(n_rows), tiles.rows)
  n_rb = pl.cdiv(n_rows, br)
  pos = positions.reshape(n_rows).astype(jnp.int32)
  old = mask_old.astype(jnp.int32)
  new = mask_new.astype(jnp.int32)
  call = functools.partial(pl.pallas_call, interpret=interpret,
                           compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                                                num_stages=tiles.num_stages))
  stream_shape = jax.ShapeDtypeStruct((n_rows, d), dtype)
  h2 = head_dim // 2
  # Each half's columns a program owns: split until there are tiles.programs programs, down to
  # `_narrowest` columns (by default a 32-byte segment of each weight row: one memory sector).
  bh, narrowest = h2, _narrowest(tiles, dtype.itemsize)
  while not cfg.qk_norm and bh > narrowest and h2 % (bh // 2) == 0 \
      and (n + 2 * k_heads) * (h2 // bh) < tiles.programs:
    bh //= 2
  qkv_bk = divisor_block(d, tiles.tile // (2 * br * bh))

  def qkv(pending):
    outs = (jax.ShapeDtypeStruct((n_rows, n, head_dim), dtype),
            jax.ShapeDtypeStruct((n_rows, 2 * k_heads, head_dim), dtype))
    return call(functools.partial(_qkv_kernel, n_rows=n_rows, br=br, bk=qkv_bk, bh=bh, cfg=cfg,
                                  pending=pending),
                grid=(n + 2 * k_heads, h2 // bh, n_rb),
                out_shape=outs + ((stream_shape,) if pending else ()), name="qkv_rope")

  gp, bs, bt, split_blocks, splits = pallas_attention.attention_cut(cfg, cache_k.shape[2], t,
                                                                     tiles)

  def attention(window):
    return call(functools.partial(attention_kernel, gp=gp, bs=bs, bt=bt,
                                  split_blocks=split_blocks, splits=splits, cfg=cfg,
                                  window=window),
                grid=(k_heads, n_rows, splits),
                out_shape=(jax.ShapeDtypeStruct((splits, n_rows, n, head_dim), jnp.float32),
                           jax.ShapeDtypeStruct((splits, n_rows, n), jnp.float32),
                           jax.ShapeDtypeStruct((splits, n_rows, n), jnp.float32)),
                name="attention")

  def shared(depth, per, n_out, kernel, name, **kw):
    """A product's kernel: its whole contraction a program (the output, plus the residual
    unless a norm waits for it), or shared by `depth` programs (float32 partial sums)."""
    if depth == 1:
      return call(functools.partial(kernel, residual=not post, **kw),
                  grid=(pl.cdiv(n_out, kw["bn"]), n_rb),
                  out_shape=jax.ShapeDtypeStruct((n_rows, n_out), dtype), name=name)
    return call(functools.partial(kernel, residual=False, per=per, **kw),
                grid=(pl.cdiv(n_out, kw["bn"]), n_rb, depth),
                out_shape=jax.ShapeDtypeStruct((depth, n_rows, n_out), jnp.float32), name=name)

  down_bn = _column_block(d, tiles, dtype.itemsize, tiles.depth)
  # Blocks of the contraction no longer than a share of it, so that depth programs get some.
  down_bk = divisor_block(d_ff, min(tiles.tile // (br * down_bn), max(d_ff // tiles.depth, 1)))
  down_depth, down_per = _depth(pl.cdiv(d_ff, down_bk), tiles)
  down_product = shared(down_depth, down_per, d, _product_kernel, "product", n_rows=n_rows,
                        br=br, bk=down_bk, bn=down_bn, dtype=dtype)
  o_bn = _column_block(d, tiles, dtype.itemsize, tiles.depth)
  o_bk = divisor_block(head_dim, min(tiles.tile // (br * o_bn),
                                     max(n * head_dim // tiles.depth, 1)))
  o_depth, o_per = _depth(n * head_dim // o_bk, tiles)
  o_product = shared(o_depth, o_per, d, _attention_out_kernel, "attention_out", n_rows=n_rows,
                     br=br, bn=o_bn, head_dim=head_dim, bk=o_bk, dtype=dtype)
  # What waits for the kernel after each product: its output and norm (Gemma's norms after
  # each sublayer: "norm"), its partial sums ("add"), or nothing (the residual added in it).
  o_waits = "norm" if post else ("add" if o_depth > 1 else None)
  down_waits = "norm" if post else ("add" if down_depth > 1 else None)
  mlp_bn = _column_block(d_ff, tiles, dtype.itemsize)

  def mlp_in(pending):
    return call(
        functools.partial(_mlp_in_kernel, n_rows=n_rows, br=br, cfg=cfg, pending=pending,
                          bk=divisor_block(d, tiles.tile // (2 * br * mlp_bn)), bn=mlp_bn),
        grid=(pl.cdiv(d_ff, mlp_bn), n_rb),
        out_shape=(jax.ShapeDtypeStruct((n_rows, d_ff), dtype),)
        + ((stream_shape,) if pending else ()), name="norm_gate_up")

  # The layers written out: a layer is five kernels and no loop bookkeeping (a loop's counter
  # would be a sixth); the layer index is a constant operand, the weights stay stacked. A
  # product's output that waits (a norm after the sublayer in Gemma, partial sums to add up)
  # is resolved with the residual by the next kernel, which needs the whole row anyway,
  # written out by one program, and after the last layer here.
  optional = ([qkv_b] if cfg.qkv_bias else []) + ([q_norm, k_norm] if cfg.qk_norm else [])
  windows = cfg.windows()
  window_args = (pos, key_pos.astype(jnp.int32)) if cfg.has_windows else ()
  qkv_first, qkv_next = qkv(None), (qkv(down_waits) if down_waits else None)
  mlp_in_kernel = mlp_in(o_waits)
  attentions = {w: attention(w) for w in sorted(set(windows))}
  x = x.reshape(n_rows, d)
  pending = None  # the previous layer's MLP output, waiting (`down_waits`)
  new_kv, residuals = [], []
  for i in range(n_layers):
    idx = jnp.int32(i)
    if pending is None:
      q, kv = qkv_first(idx, x, pos, attn_norm, qkv_w, *optional, freqs)
    else:
      gain = (post_mlp,) if down_waits == "norm" else ()
      q, kv, x = qkv_next(idx, x, pending, *gain, pos, attn_norm, qkv_w, *optional, freqs)
    residuals.append(x)
    heads = attentions[windows[i]](idx, q, cache_k, cache_v, kv, old, new, *window_args)
    if o_waits:
      h = o_product(idx, *heads, o_w)
      gain = (post_attn,) if o_waits == "norm" else ()
      act, x = mlp_in_kernel(idx, x, h, *gain, mlp_norm, gate_up)
    else:
      x = o_product(idx, *heads, o_w, x)
      (act,) = mlp_in_kernel(idx, x, mlp_norm, gate_up)
    if down_waits:
      pending = down_product(idx, act, down)
    else:
      x = down_product(idx, act, down, x)
    new_kv.append(kv)
  if pending is not None:  # the last layer's MLP output (as `gemma.Block` / `llama.Block`)
    h = (pending.sum(0) if pending.ndim == 3 else pending).astype(dtype).astype(jnp.float32)
    if down_waits == "norm":
      normed = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + cfg.norm_eps)
      x = x + (normed * _gain(post_mlp[n_layers - 1], cfg)).astype(dtype)
    else:
      x = (x.astype(jnp.float32) + h).astype(dtype)
  kv = jnp.stack(new_kv).reshape(n_layers, b, t, 2 * k_heads, head_dim)
  residuals = jnp.stack(residuals).reshape(n_layers, b, t, d) if hidden else None
  return x.reshape(b, t, d), (kv[..., :k_heads, :], kv[..., k_heads:, :]), residuals
