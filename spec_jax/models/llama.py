"""Llama-family models (Llama 2/3.x, Mistral, Qwen2/2.5/3, SmolLM2, TinyLlama) and every drafter:
the config and the decoder block. The forward itself (`decoder.Decoder`, docs/design.md §2) and the
pieces it shares with the other families (KV cache, masks, RoPE, norms, attention: `layers.py`)
are re-exported here under the names the package has always used.

Shape legend: see `layers.py`.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models import decoder
from spec_jax.models import layers as L
from spec_jax.models import pallas_layers


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture of a Llama-family model (Llama 2/3.x, Mistral, Qwen2/3, SmolLM2, drafters).

  rope_scaling: "none", "linear" (positions divided by rope_factor) or "llama3" (Llama 3.1/3.2:
    rope_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions).
  qk_norm: RMSNorm over each query/key head before RoPE (Qwen3, Gemma 3).
  layer_windows: per-layer sliding window in tokens (0 = full attention); () = none anywhere.
  head_ids: a reduced output vocabulary (FR-Spec, EAGLE-3; `draft_init.reduce_vocab`): the
    output layer has one row per id, logit j is token head_ids[j], and every other token's logit
    is -inf (probability exactly 0). () = the full vocabulary. Needs untied embeddings.
  feature_width: a feature drafter (EAGLE; `draft_init.feature_drafter`,
    `decoding/drafters/features.py`): the forward also reads a feature vector per token (the
    verifier's final residual one position back) of this width, and its first layer's input is
    fc([features / rms; embedding / rms]). 0 = an ordinary language model.
  feature_layers: a multi-layer feature drafter (EAGLE-3; `draft_init.feature_drafter`): the
    verifier's residual depths it reads (l = the input of verifier block l, -1 or n_layers the
    final residual), mapped to the feature_width-wide feature by `feature_fc` ([n·F, F], a
    param beside the decoder's). () = the final residual alone, as it is.
  fused: q/k/v as one weight product ("qkv" [D, N+2K, H]) and gate/up as one ("gate_up"
    [D, 2, F]): the same model in fewer, larger products (`model.size=...:fused=1`;
    `layers.fuse_params` converts loaded weights).
  unrolled: the layers as straight-line code, each with its own params ("layers_<i>") instead
    of a scan over params stacked under "layers": the same model, no layer loop and no slicing
    of stacked weights (`model.size=...:unrolled=1`; `layers.unstack_layers` converts).
  decode_unrolled: the calls with a cache (prefill and decoding) run the layer scan written out
    (`nn.scan(unroll=n_layers)`) over the same stacked params: straight-line code as
    `unrolled` gives, with no change of params, checkpoints or training (which keeps the
    loop) (`model.size=...:decode_unrolled=1`). On a GPU each weight product reads its layer's
    slice in place (XLA's dynamic-slice fusion), and the step's kernels are those of the
    unrolled layout (experiments/scale/results.md, "Straight-line decoding over stacked
    weights"); XLA:CPU does not, and there it keeps the scanned step's time.
  out_major: each block's output-side products store their weights output axis first: "o"
    [D, N, H], "down" [D, F] (`layers.out_product`; `layers.out_major_params` converts):
    the same model, with the contraction along the weight rows' minor axis. On a GPU, XLA
    reduces the float32 products of small models itself (no cuBLAS call), and some weights
    stored [in, out] ([F, D] and [N, H, D] at the SmolLM2-135M shape) become two kernels there,
    the whole elementwise product written to memory and reduced again; stored [out, in] each is
    one (experiments/scale/results.md, "Output-major weights"). XLA:CPU runs it slower
    (`model.size=...:out_major=1`; a GPU option).
  pallas: the decoding calls' layers (a cache, at most `pallas_attention.MAX_TOKENS` tokens a row,
    no steering) as five hand-written GPU kernels each (`pallas_layers.py`; Llama and Gemma
    families) instead of XLA's fusions: the same model and params; needs the fused, scanned
    layout (`model.size=...:fused=1:pallas=1`). Kernels run on NVIDIA GPUs, and in Pallas's
    interpreter on CPU (slow; for tests).
  attn_kernel: XLA's layers, but each decoding call's attention (cache and new tokens, softmax,
    value product, sliding window) as one hand-written GPU kernel reading the stacked cache at
    the layer's index (`pallas_attention.attention`) instead of XLA's ~8 kernels; any layout, the
    weight products stay XLA's (cuBLAS), so it serves large batches too
    (`model.size=...:attn_kernel=1`). Llama and Gemma families; not with `pallas` (which
    includes it).
  Subclasses (other families, `gemma.GemmaConfig`) change the block and the properties below.
  """
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
  qk_norm: bool = False
  rope_scaling: str = "none"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  layer_windows: tuple[int, ...] = ()
  head_ids: tuple[int, ...] = dataclasses.field(default=(), repr=False)
  feature_width: int = 0
  feature_layers: tuple[int, ...] = ()
  fused: bool = False
  unrolled: bool = False
  decode_unrolled: bool = False
  out_major: bool = False
  pallas: bool = False
  attn_kernel: bool = False
  family: str = "llama"

  FAMILY = "llama"

  def __post_init__(self):
    if self.family != self.FAMILY:
      raise ValueError(f"{type(self).__name__} is the {self.FAMILY!r} family, got "
                       f"family={self.family!r}.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}.")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
      if getattr(self, f) < 1:
        raise ValueError(f"{type(self).__name__}.{f} must be >= 1, got {getattr(self, f)}.")
    if self.rope_scaling not in L.ROPE_SCALINGS:
      raise ValueError(f"rope_scaling={self.rope_scaling!r} is not implemented; supported: "
                       f"{', '.join(L.ROPE_SCALINGS)}.")
    if not isinstance(self.layer_windows, tuple):  # a list from JSON meta
      object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
    if not isinstance(self.head_ids, tuple):  # a list from JSON meta
      object.__setattr__(self, "head_ids", tuple(int(i) for i in self.head_ids))
    if self.head_ids:
      check_head_ids(self.head_ids, self.vocab_size, "head_ids")
      if self.tie_embeddings:
        raise ValueError("A reduced output vocabulary (head_ids) needs its own output layer: "
                         "set tie_embeddings=False (draft_init.reduce_vocab does).")
    if self.feature_width < 0:
      raise ValueError(f"feature_width must be >= 0 (0: no feature input), got "
                       f"{self.feature_width}.")
    if not isinstance(self.feature_layers, tuple):  # a list from JSON meta
      object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
    if self.feature_layers and (not self.feature_width or min(self.feature_layers) < -1
                                or len(set(self.feature_layers)) < len(self.feature_layers)):
      raise ValueError(f"feature_layers={self.feature_layers} needs a feature drafter "
                       "(feature_width > 0) and distinct verifier depths >= -1.")
    if self.layer_windows and (len(self.layer_windows) != self.n_layers
                               or min(self.layer_windows) < 0):
      raise ValueError(f"layer_windows needs one window >= 0 per layer ({self.n_layers}), got "
                       f"{self.layer_windows}.")

    kernels = "pallas" if self.pallas else "attn_kernel" if self.attn_kernel else ""
    if kernels and self.head_dim & (self.head_dim - 1):
      raise ValueError(f"{kernels}=1: the hand-written kernels load whole heads, and Triton "
                       f"loads only power-of-two sizes; head_dim={self.head_dim} is not one. "
                       f"Fix: drop :{kernels}=1 from model.size (XLA's layers take any head "
                       "size).")
    if self.pallas:
      reason = pallas_layers.unsupported(self)
      if reason is not None:
        raise ValueError(f"pallas=1: the hand-written kernels do not compute {reason}. Fix: "
                         "drop :pallas=1 from model.size.")
    if self.attn_kernel:
      if self.pallas:
        raise ValueError("attn_kernel=1 with pallas=1: the layers' kernels include the "
                         "attention. Fix: keep one of them in model.size.")
      if self.FAMILY not in ("llama", "gemma"):
        raise ValueError(f"attn_kernel=1: the attention kernel does not compute the "
                         f"{self.FAMILY!r} family's attention. Fix: drop :attn_kernel=1 from "
                         "model.size.")

  # What the shared decoder asks of a family.
  def block(self):
    return Block

  norm_offset = 0.0   # RMSNorm gain = offset + scale
  embed_scale = 1.0   # embeddings are multiplied by this
  attn_softcap = 0.0  # 0 = no soft-capping
  final_softcap = 0.0

  @property
  def query_scale(self) -> float:
    return self.head_dim ** -0.5

  @property
  def has_windows(self) -> bool:
    return any(self.layer_windows)

  def windows(self) -> tuple[int, ...]:
    return self.layer_windows or (0,) * self.n_layers

  def layer_rope(self, layer: int) -> tuple[float, str]:
    """(theta, scaling) of one layer's RoPE."""
    return self.rope_theta, self.rope_scaling

  def rope_table(self) -> np.ndarray:
    """Per-layer RoPE inverse frequencies float32[L, H/2]."""
    rows = []
    for layer in range(self.n_layers):
      theta, scaling = self.layer_rope(layer)
      rows.append(L.inv_freq(self.head_dim, theta, scaling, self.rope_factor,
                             self.rope_low_freq_factor, self.rope_high_freq_factor,
                             self.rope_original_max_positions))
    return np.stack(rows)

  @property
  def head_size(self) -> int:
    """Rows of the output layer: len(head_ids) for a reduced vocabulary, else vocab_size."""
    return len(self.head_ids) or self.vocab_size

  @property
  def num_params(self) -> int:
    d, f = self.d_model, self.d_ff
    attn = d * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
    if self.qkv_bias:
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
    if self.qk_norm:
      attn += 2 * self.head_dim
    per_layer = attn + 3 * d * f + self.norms_per_layer * d
    emb = self.vocab_size * d + (0 if self.tie_embeddings else self.head_size * d)
    return (self.n_layers * per_layer + emb + d + 2 * self.feature_width * d
            + len(self.feature_layers) * self.feature_width ** 2)

  norms_per_layer = 2


# Size variants by name. vocab_size is a placeholder: callers replace it with the tokenizer's
# (`model_config(name, vocab_size=...)`), so one variant serves any vocabulary.
_VARIANTS = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct).
    "smollm2-135m": dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                         head_dim=64, d_ff=1536, rope_theta=100_000.0, norm_eps=1e-5),
    # Drafters (docs/design.md §4 cost notes: the 49k output layer dominates their step time).
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


class Block(nn.Module):
  """One pre-norm Llama decoder layer; scanned over layers (params stacked on a leading L axis)."""
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x, layer_cache, positions, mask_old, mask_new, steer=None, freq=None,
               window=None, key_pos=None):
    """steer: this layer's steering deltas (SD², `models/steering.py`), None or a dict with
    "up" f32[B, F] | [B, T, F], added to the up projection inside the SwiGLU MLP ("merged":
    down(silu(gate) * (up + δ))), and/or "residual" f32[B, D] | [B, T, D], added to the block's
    output ("simple"). A [B, ·] delta serves every one of the T tokens. freq, window, key_pos:
    this layer's RoPE frequencies and sliding window (`layers.Attention`)."""
    cfg = self.cfg
    steer = steer or {}
    residual_in = x
    # Decoding calls (a cache) defer the norms' row scaling past the products (`L.RMSNorm`).
    decoding = layer_cache is not None
    norm = lambda name: L.RMSNorm(cfg.norm_eps, cfg.param_dtype, name=name)  # noqa: E731
    h, new_kv = L.Attention(cfg, name="attn")(
        L.pre_norm(norm("attn_norm"), x, decoding and not cfg.qkv_bias), layer_cache, positions,
        mask_old, mask_new, freq, window, key_pos)
    x = x + h
    gate, up = L.gate_up(cfg, L.pre_norm(norm("mlp_norm"), x, decoding))
    if "up" in steer:
      up = up + L.per_token(steer["up"]).astype(up.dtype)
    x = L.constrain(x + L.out_product(cfg, 1, "down")(nn.silu(gate) * up), "stream")
    if "residual" in steer:
      x = x + L.per_token(steer["residual"]).astype(x.dtype)
    return x, (new_kv, residual_in)


# The shared pieces under the names the rest of the package has always used.
KVCache = L.KVCache
init_cache = L.init_cache
causal_mask = L.causal_mask
split_mask = L.split_mask
rope = L.rope
RMSNorm = L.RMSNorm
Llama = decoder.Decoder
make_apply = decoder.make_apply


def init_params(cfg, rng):
  """`decoder.init_params`, and a multi-layer feature drafter's `feature_fc` (which the
  drafter applies to the verifier's layers before the decoder reads them) at
  `feature_fc_kernel`."""
  params = decoder.init_params(cfg, rng)
  if getattr(cfg, "feature_layers", ()):
    kernel = jnp.asarray(feature_fc_kernel(cfg), cfg.param_dtype)
    params = {**params, "feature_fc": {"kernel": kernel}}
  return params


def param_shapes(cfg):
  """Parameter shapes/dtypes without allocating (for sharding and checkpoint restore)."""
  return jax.eval_shape(lambda rng: init_params(cfg, rng), jax.random.key(0))


def feature_fc_kernel(cfg) -> np.ndarray:
  """f32[n·F, F] for n = len(cfg.feature_layers): the identity on the deepest depth's slot (the
  final residual, -1, deepest of all) and zeros elsewhere, so the drafter first reads that layer
  alone, as a final-residual drafter reads its one."""
  layers, width = cfg.feature_layers, cfg.feature_width
  deepest = max(range(len(layers)), key=lambda i: (layers[i] == -1, layers[i]))
  kernel = np.zeros((len(layers) * width, width), np.float32)
  kernel[deepest * width:(deepest + 1) * width] = np.eye(width, dtype=np.float32)
  return kernel


def check_head_ids(ids, vocab_size: int, field: str) -> None:
  """ValueError naming `field` unless ids are distinct token ids of a vocab_size vocabulary."""
  ids = np.asarray(ids)
  if ids.ndim != 1 or not 1 <= ids.size <= vocab_size:
    raise ValueError(f"{field} must list 1..{vocab_size} token ids (the tokenizer's vocabulary), "
                     f"got {ids.size}. Fix: a smaller reduced vocabulary (e.g. vocab=8192).")
  outside = sorted(set(ids[(ids < 0) | (ids >= vocab_size)].tolist()))
  if outside:
    raise ValueError(f"{field} holds token ids outside the tokenizer's vocabulary [0, "
                     f"{vocab_size}): {outside[:5]}. The mapping belongs to another tokenizer: "
                     "rebuild it with this one.")
  if np.unique(ids).size != ids.size:
    dup = np.unique(ids)[np.bincount(np.searchsorted(np.unique(ids), ids)) > 1]
    raise ValueError(f"{field} lists token ids more than once: {dup[:5].tolist()}. Each output "
                     "row must be a distinct token.")


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
